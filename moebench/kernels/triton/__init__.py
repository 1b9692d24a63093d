"""moebench's Triton kernels and the experts backends built on them.

    options.py   TritonOptions: every code path as an argument, the rules that resolve "auto", and
                 the LayerPlan a layer call's GEMMs run with (plan_layer: resolved once per call)
    align.py     block alignment of (token, k) pairs by expert (kernels, direct_align, align_pairs)
    gemm1.py     the sorted-token layer's GEMM1 kernels: the paired and the wide walk
    gemm2.py     the sorted-token layer's GEMM2 kernel and the top-k sum
    launch.py    their launchers (launch_gemm1, launch_gemm2, fused_moe_gemms, topk_sum, sorted_rows)
    batched.py   the batched (E_local, T, H) GEMM kernels
    batched_layout.py  that layout built from (token, k) rows and reduced back, one launch each
    routing.py   softmax top-k routing in one launch
    quant.py     fp8 activation quantisation
    configs.py   tuned-config files (vLLM names), the lookup and the default heuristic
    experts.py   TritonExperts, BatchedTritonExperts, fused_moe
    common.py    @triton.jit helpers shared by the kernels, and their argument groups
    env.py       the interpreter and the device (TMA, SMs)

Nothing is imported here: `moebench.kernels.triton.configs` stays importable without the kernels.
"""
