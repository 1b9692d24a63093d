"""moebench's Triton kernels and the experts backends built on them.

    options.py   TritonOptions: every code path as an argument, and the rules that resolve "auto"
    align.py     block alignment of (token, k) pairs by expert (kernels, direct_align, align_pairs)
    gemm.py      the sorted-token layer's GEMM1 and GEMM2 kernels and their launchers
    batched.py   the batched (E_local, T, H) GEMM kernels
    routing.py   softmax top-k routing in one launch
    quant.py     fp8 activation quantisation
    configs.py   tuned-config files (vLLM names), the lookup and the default heuristic
    experts.py   TritonExperts, BatchedTritonExperts, fused_moe
    common.py    @triton.jit helpers shared by the kernels
    env.py       the interpreter and the device (TMA, SMs)

Nothing is imported here: `moebench.kernels.triton.configs` stays importable without the kernels.
"""
