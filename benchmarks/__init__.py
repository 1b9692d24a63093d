"""moebench's benchmark cases, run through one entry point:

    PYTHONPATH=. python -m benchmarks --list            # the cases, one line each
    PYTHONPATH=. python -m benchmarks CASE [ARGS...]    # run one; CASE --help for its arguments

Each case is a module of this package with a `main(argv)` that parses its own arguments; the set-up
they share (output folder $OUT, header line, layer shapes and their tile config, timer, CSV and
Markdown writer) is in bench_common.py. The device_*.sh scripts are lists of such runs (and of
`moebench` commands). Adding a case: a module with `main(argv)`, plus one line in CASES.
"""

from __future__ import annotations

#: case name (= module name): what it measures, one line. Kept here, not read from the modules,
#: so that `--list` imports neither torch nor triton.
CASES: dict[str, str] = {
    "bench_triton": "Triton experts per layer point: layer, GEMMs, alignment, routing, torch, floors (PERF.md)",
    "vllm_style": "triton GEMMs against the vllm-triton experts with vLLM's H200 configs, same routings",
    "vllm_kernel": "engine files (new, vLLM's, SGLang's) in the vllm-triton experts; triton layer vs the best of them",
    "decode_launches": "the triton layer's code paths (TritonOptions variants) A/B at decode and prefill",
    "vendor_gemms": "prefill by a vendor grouped GEMM: DeepGEMM's GEMMs alone and its layer vs triton, over the floor",
    "gemm_configs": "each GEMM of the triton layer against its own best tile config",
    "routing_configs": "launch shape of the routing kernel against its rule",
    "align_methods": "alignment above the one-launch limit: scan vs sort over chunk sizes, and the auto rule",
    "batched_configs": "batched Triton experts: tuned-config lookup against the default heuristic",
    "between_keys": "token counts between a tuned file's keys: nearest entry vs heuristic vs other key",
    "gemm1_granularity": "GEMM1's weight-streaming rate at decode against the number of experts hit",
    "read_pattern": "HBM read rate of GEMM1's paired gate/up walk against the contiguous one (no MMA)",
    "fp8_k_step": "fp8 block weight stream at decode: one 128-column scale group per K step against two, beside bf16",
    "quant_rows": "the fp8 activation quantisation launches alone: a layer call's, and random / zero rows",
    "topk_ties": "where fused_topk_softmax and torch's topk pick different experts, and by how much",
    "profile_case": "torch.profiler table of one (prepare/finalize, experts) case, or its calls for ncu",
    "tune_device": "moebench tune on a device: halving vs grid vs the default heuristic",
    "fp8_table": "fp8 vs bf16 table from moebench sweep result folders",
    "weight_only_table": "weight-only (int8_w8a16 / int4_w4a16 / mxfp4) vs bf16 table from sweep result folders",
    "flip_table": "flip factor per token count of compare tp-vs-ep run folders",
    "shared_table": "shared experts (fused / separate / none) and activations from sweep folders, vs the floor",
}
