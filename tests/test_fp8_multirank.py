"""fp8 over real gloo ranks (world sizes 2 and 4): all2all-ll dispatches fp8 rows with their scales
(quantised before dispatch), allgather-rs gathers them, against the float64 reference of the
quantised weights (which emulates the scheme)."""

from __future__ import annotations

import pytest
import torch

from moebench.kernels.modular import FusedMoEKernel, poisoned_outputs
from moebench.kernels.reference import reference_moe
from moebench.backends import make_experts, make_prepare_finalize
from moebench.layout import ParallelLayout
from moebench.quant import FP8_DTYPE, QuantScheme, quantize_weights
from moebench.runtime.distributed import RankContext, spawn
from moebench.runtime.rank_case import run_rank_case

H, I, K, E = 48, 32, 2, 8
SCHEMES = {
    "tensor": QuantScheme(scales="tensor"),
    "token": QuantScheme(scales="token"),
    "block": QuantScheme(scales="block", block_shape=(16, 16)),
}


def _case_inputs(seed: int, m: int, scheme: QuantScheme):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    q13, q2 = quantize_weights(w13, w2, scheme, torch.bfloat16)
    x = torch.randn(m, H, generator=g).bfloat16()
    ids = torch.rand(m, E, generator=g).argsort(dim=1)[:, :K].int()
    w = torch.softmax(torch.randn(m, K, generator=g), dim=-1)
    return x, q13, q2, w, ids


def _rel(out, ref) -> float:
    if ref.numel() == 0:
        return 0.0
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _run(ctx: RankContext) -> dict:
    errs, sent = {}, {}
    ep = ParallelLayout(dp=ctx.world_size, enable_ep=True)
    for i, (name, scheme) in enumerate(SCHEMES.items()):
        for pf, ex in (("all2all-ll", "batched-triton"), ("allgather-rs", "triton")):
            for m in (13, ctx.world_size - 1):  # world - 1: one rank brings no tokens
                x, q13, q2, w, ids = _case_inputs(100 + i * 7 + m, m, scheme)
                kw = {"group": ctx.group}
                if pf == "all2all-ll":
                    kw["max_tokens_per_rank"] = 16
                p = make_prepare_finalize(pf, **kw)
                if pf == "all2all-ll":  # record what the dispatch sends (the combine returns bf16 rows)
                    orig, orig_fin, phase = p._a2a, p.finalize, {"now": "dispatch"}

                    def spy(out, inp, o, s, orig=orig, key=f"{name} m={m}", phase=phase):
                        sent.setdefault(f"{key} {phase['now']}", set()).add((str(inp.dtype), tuple(inp.shape[1:])))
                        return orig(out, inp, o, s)

                    def fin(*a, orig_fin=orig_fin, phase=phase, **kw):
                        phase["now"] = "combine"
                        try:
                            return orig_fin(*a, **kw)
                        finally:
                            phase["now"] = "dispatch"

                    p._a2a, p.finalize = spy, fin
                kernel = FusedMoEKernel(p, make_experts(ex))
                with poisoned_outputs():
                    res = run_rank_case(ctx, kernel, x, q13, q2, w, ids, ep)
                lo, hi = res.rows
                errs[f"{pf}+{ex} {name} M={m}"] = _rel(res.out, reference_moe(x, q13, q2, w, ids)[lo:hi])
    return {"errs": errs, "sent": {k: sorted(v) for k, v in sent.items()}}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request):
    return request.param, spawn(_run, request.param, "cpu", timeout_s=300, total_timeout_s=900)


def test_fp8_paths_match_reference(results):
    world, res = results
    bad = {f"rank {r}: {n}": e for r, d in enumerate(res) for n, e in d["errs"].items() if not e < 3e-2}
    assert not bad, bad
    assert len(res[0]["errs"]) == len(SCHEMES) * 2 * 2


def test_all2all_sends_fp8_byte_rows(results):
    """The rows that travel are uint8 rows of H fp8 bytes plus 4 bytes per scale group."""
    _, res = results
    for name, scheme in SCHEMES.items():
        sent = {s for k, v in res[0]["sent"].items() if k.startswith(name) and k.endswith("dispatch") for s in v}
        back = {s for k, v in res[0]["sent"].items() if k.startswith(name) and k.endswith("combine") for s in v}
        want = ("torch.uint8", (H + 4 * scheme.num_groups(H),))
        assert want in sent, (name, sent)
        assert not any(dt == "torch.bfloat16" for dt, _ in sent), sent
        assert ("torch.bfloat16", (H,)) in back, back


def test_prepare_quantises_before_dispatch_single_rank():
    x, q13, q2, w, ids = _case_inputs(0, 5, SCHEMES["block"])
    kernel = FusedMoEKernel(make_prepare_finalize("all2all-ll", max_tokens_per_rank=8), make_experts("batched-triton"))
    prep = kernel.prepare(x, q13, q2, w, ids)
    assert prep.a.dtype == FP8_DTYPE and prep.a_scale.shape == (E, 8, 3) and prep.out_dtype == torch.bfloat16
    assert int(prep.expert_num_tokens.sum()) == 5 * K
