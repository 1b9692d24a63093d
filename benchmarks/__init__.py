"""moebench's benchmark cases, run through one entry point:

    PYTHONPATH=. python -m benchmarks --list            # the cases, one line each
    PYTHONPATH=. python -m benchmarks CASE [ARGS...]    # run one; CASE --help for its arguments

Each case is a module of this package with a `main(argv)` that parses its own arguments; the set-up
they share (output folder $OUT, header line, layer shapes and their tile config, timer, CSV and
Markdown writer) is in bench_common.py. The `device` case holds the jobs a GPU machine runs (lists of
such runs, `moebench` commands and GPU tests): `python -m benchmarks device --list`. Adding a case: a
module with `main(argv)`, plus one line in CASES.
"""

from __future__ import annotations

#: case name (= module name): what it measures, one line. Kept here, not read from the modules,
#: so that `--list` imports neither torch nor triton.
CASES: dict[str, str] = {
    "device": "the device jobs behind PERF.md: --list, or NAME... runs them into $OUT (--dry-run prints the commands)",
    "bench_triton": "Triton experts per layer point: layer, GEMMs, alignment, routing, torch, floors, library GEMMs",
    "vllm_kernel": "engine files (new, vLLM's, SGLang's) in the vllm-triton experts; triton layer vs the best of them",
    "decode_launches": "the triton layer's code paths (TritonOptions variants) A/B at decode and prefill",
    "peers": "every engine's experts kernel beside moebench's: ratios to the fastest peer and to the floor, targets",
    "vendor_gemms": "prefill by a vendor grouped GEMM: DeepGEMM's GEMMs alone and its layer vs triton, over the floor",
    "profile_case": "torch.profiler table of one (prepare/finalize, experts) case, or its calls for ncu",
    "ep_model_table": "measured dispatch / combine of real-rank sweep folders beside the modeled ones of --simulate folders",
    "deepgemm_breakdown": "the DeepGEMM pairs per launch: its two grouped GEMMs vs the glue, against the glue's least bytes",
    "fp8_table": "fp8 vs bf16 table from moebench sweep result folders",
    "weight_only_table": "weight-only (int8_w8a16 / int4_w4a16 / mxfp4) vs bf16 table from sweep result folders",
    "flip_table": "flip factor per token count of compare tp-vs-ep run folders",
    "kernel_table": "moebench's measured experts times as the table modeled rows read (from sweep folders or PERF raw files)",
    "shared_table": "shared experts (fused / separate / none) and activations from sweep folders, vs the floor",
}
