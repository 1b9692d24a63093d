"""fp8_w8a8 in the Triton experts (`triton`, `batched-triton`) and the Triton activation
quantisation (moebench.kernels.triton.quant), under the interpreter on CPU.

The kernels are checked against moebench.reference_moe, which emulates the scheme's rounding
points (x quantised; the intermediate stored in the activation dtype, then quantised), so the
error left is the kernel's: fp32 accumulation order and the final store in the activation dtype
(measured about 1.6e-3 for bf16 Standard, 2.3e-3 for batched, whose finalize rounds once more).
Shapes are odd (H=152, I=72: partial last scale group for every block shape), E=20 with top-4.
"""

from __future__ import annotations

import pytest
import torch

import moebench
from helpers import random_expert_map, rel_err
from moebench.errors import MoebenchError
from moebench.inputs import make_weights
from moebench.kernels.modular import poisoned_outputs
from moebench.kernels.triton.align import moe_align_block_size
from moebench.kernels.triton.batched import batched_moe
from moebench.kernels.triton.configs import fit_to_quant_block
from moebench.kernels.tuned_files import device_name
from moebench.kernels.triton.experts import BatchedTritonExperts, TritonExperts, fused_moe
from moebench.kernels.triton.launch import launch_gemm1
from moebench.kernels.triton.options import TritonOptions, resolve_use_tma
from moebench.kernels.triton.quant import check_block_config, quantize_rows, silu_mul_rows
from moebench.quant import FP8_DTYPE, QuantScheme, quantize_activation, quantize_weights
from moebench.kernels import tuned_files as TF

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, I, E, K = 152, 72, 20, 4
#: 128-wide tiles: two programs along each GEMM's N, the last one partial (GEMM1: 64 gate + 64 up
#: columns of I = 72; GEMM2: 128 of H = 152), a third fewer programs than 64-wide ones (the
#: interpreter's time goes with the programs run)
CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
SCHEMES = {
    "tensor": QuantScheme("fp8_w8a8", "tensor"),
    "token": QuantScheme("fp8_w8a8", "token"),
    "block128": QuantScheme("fp8_w8a8", "block", (128, 128)),
    "block32": QuantScheme("fp8_w8a8", "block", (32, 32)),
}
KERNELS = [("triton", "no-dpep"), ("batched-triton", "batched-local")]
KIDS = ["triton", "batched"]
#: What the kernels must reach against the emulating reference (bf16 output; see the docstring).
TIGHT = 5e-3
#: The same for block-scaled fp8 tiles with swapped operands on a GPU (swap_ab; the test says why).
SWAPPED_GPU = 1e-2


_WEIGHTS: dict = {}


def _qweights(scheme: QuantScheme, e: int = E, h: int = H, i: int = I, dtype=torch.bfloat16):
    key = (scheme, e, h, i, dtype)
    if key not in _WEIGHTS:
        w13, w2 = make_weights(range(e), h, i, torch.float32, DEV, seed=0)
        _WEIGHTS[key] = quantize_weights(w13.to(dtype), w2.to(dtype), scheme, act_dtype=dtype)
    return _WEIGHTS[key]


def _routing(m: int, e: int, k: int, seed: int = 1, first: int | None = None):
    """Softmax top-k of random logits; `first`: every token's first choice (its other k - 1 differ)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, e, generator=g)
    if first is not None:
        logits[:, first] += 100.0
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return w.to(DEV), ids.to(DEV, torch.int32)


def _x(m: int, dtype=torch.bfloat16, h: int = H, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, h, generator=g).to(DEV, dtype)


def _cfg(scheme: QuantScheme, **kw) -> dict:
    return dict(fit_to_quant_block(dict(CFG, **kw), scheme))


def _opts(**kw) -> TritonOptions:
    """TritonOptions(**kw) with the unswapped dots: "auto" swaps block-scaled GEMMs of 16-row tiles
    at least 128 wide (CFG's), and only the tests whose subject is the swap take it
    (test_triton_fp8_swap_ab, test_triton_fp8_block_swap_ab_auto)."""
    return TritonOptions(**dict(dict(swap_ab=False), **kw))


def _run(experts: str, pf: str, x, w13, w2, tw, ti, expert_map=None, num_experts=None, **kw):
    kernel = moebench.make_kernel(experts, pf, experts_kwargs=kw)
    with poisoned_outputs():
        return kernel.apply(x, w13, w2, tw, ti, expert_map=expert_map, num_experts=num_experts)


# ---------------------------------------------------------------------------------------------
# The activation quantisation kernel: bit for bit moebench.quant.quantize_activation


QSCHEMES = dict(SCHEMES, block32x48=QuantScheme("fp8_w8a8", "block", (32, 48)))


#: Every scheme on every shape but (5, 2500): rows longer than the kernel's 1024-column chunk, which
#: only the per-tensor and per-token scales walk in chunks (ONE_CHUNK off); a block scheme's group
#: fits one chunk, so its 2500-column rows would take the (7, 200) rows' path (same constexprs,
#: BLOCK_M 8) with more groups along the grid, and are left out.
QCASES = [(n, s) for s in [(7, 200), (3, 5, 77), (1, 1), (0, 40)] for n in QSCHEMES] \
    + [(n, (5, 2500)) for n in ("tensor", "token")]


@pytest.mark.parametrize("name,shape", QCASES)
def test_quantize_rows_bit_exact(name, shape):
    scheme = QSCHEMES[name]
    g = torch.Generator().manual_seed(sum(shape))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(shape, generator=g) * 3).to(DEV, dtype)
        flat = x.view(-1, shape[-1])
        if flat.numel() > 3:
            flat[0, :3] = 0  # zeros inside a row
        if flat.shape[0] > 1:
            flat[1] = 0  # an all-zero row: scale AMAX_EPS / 448, q = 0
        statics = [None, torch.tensor([0.004], device=DEV)] if scheme.scales == "tensor" else [None]
        for static in statics:  # 0.004: values beyond 448 * scale saturate
            q, s = quantize_rows(x, scheme, static)
            q_ref, s_ref = quantize_activation(x, scheme, static)
            assert q.dtype == FP8_DTYPE and q.shape == q_ref.shape
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (name, shape, dtype, static)
            assert s.shape == s_ref.shape and s.stride() == s_ref.stride() and torch.equal(s, s_ref)


@pytest.mark.parametrize("i", [128, 384, 192])
def test_silu_mul_rows_matches_reference(i):
    # silu(gate) * up rounded to bf16, then (I a multiple of 128) quantised per row and 128 columns
    # bit for bit as moebench.quant does, scales written through the caller's strides (DeepGEMM's
    # MN-major layout); rows at or past the limit stay unwritten
    g = torch.Generator().manual_seed(i)
    gu = (torch.randn(37, 2 * i, generator=g) * 3).to(DEV, torch.bfloat16)
    limit = torch.tensor([30], dtype=torch.int32, device=DEV)
    h = (torch.nn.functional.silu(gu[:, :i].float()) * gu[:, i:].float()).bfloat16()
    out = torch.full((37, i), 7.0, dtype=torch.bfloat16, device=DEV)
    silu_mul_rows(gu, limit, out)
    torch.testing.assert_close(out[:30].float(), h[:30].float(), rtol=1e-2, atol=1e-2)  # sigmoid's last bits
    assert (out[30:] == 7.0).all()
    if i % 128:
        with pytest.raises(MoebenchError, match="multiple of 128"):
            silu_mul_rows(gu, limit, torch.empty((37, i), dtype=FP8_DTYPE, device=DEV),
                          torch.empty((37, 1), device=DEV))
        return
    q = torch.zeros((37, i), dtype=FP8_DTYPE, device=DEV)
    s = torch.empty_strided((37, i // 128), (1, 40), device=DEV).fill_(-1.0)  # MN-major, rows padded to 40
    silu_mul_rows(gu, limit, q, s)
    q_ref, s_ref = quantize_activation(out[:30], QuantScheme(scales="block", block_shape=(128, 128)))
    assert torch.equal(q[:30].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s[:30], s_ref)
    assert (s[30:] == -1.0).all() and (q[30:].view(torch.uint8) == 0).all()


def test_quantize_rows_rounding_edges():
    # Every e4m3 value, every midpoint between neighbours (ties -> even), the floats just beside
    # the midpoints, subnormals, signed zeros and saturation, with scale 1: the interpreter's own
    # cast rounds some of these wrongly, the kernel must not.
    allq = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    allq = allq[~allq.isnan()].sort().values
    mids = (allq[1:] + allq[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    extra = torch.tensor([0.0, -0.0, 1.97, -1.97, 1e-3, -1e-3, 1e-30, -1e-30, 448.0, 464.0, -1e6, 1e6])
    x = torch.cat([allq, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), extra]).to(DEV)
    scheme = SCHEMES["tensor"]
    one = torch.ones(1, device=DEV)
    q, _ = quantize_rows(x.view(1, -1), scheme, one)
    q_ref, _ = quantize_activation(x.view(1, -1), scheme, one)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("name", ["token", "block32"])
def test_quantize_rows_limits(name):
    # row_limit: rows past it are not written (the Standard intermediate past
    # num_tokens_post_padded); pair_rows: nor are sentinel rows; batch_counts: rows past each
    # batch's count are not written.
    scheme = SCHEMES[name]
    x = _x(12, h=100)
    q, s = quantize_rows(x, scheme, row_limit=torch.tensor([5], dtype=torch.int32, device=DEV))
    q_ref, s_ref = quantize_activation(x, scheme)
    assert torch.equal(q[:5].view(torch.uint8), q_ref[:5].view(torch.uint8)) and torch.equal(s[:5], s_ref[:5])
    # pair_rows: of the rows below the limit only those whose sorted id is a pair (< 9)
    ids = torch.tensor([0, 9, 3, 9, 9, 1, 9, 9, 2, 9, 9, 9], dtype=torch.int32, device=DEV)
    q, s = quantize_rows(x, scheme, row_limit=torch.tensor([8], dtype=torch.int32, device=DEV), pair_rows=(ids, 9))
    pairs = [0, 2, 5]
    assert torch.equal(q[pairs].view(torch.uint8), q_ref[pairs].view(torch.uint8)) and torch.equal(s[pairs], s_ref[pairs])
    with pytest.raises(MoebenchError, match="pair_rows gives 4 sorted ids for 12 rows"):
        quantize_rows(x, scheme, pair_rows=(ids[:4], 9))
    xb = x.view(3, 4, 100)
    counts = torch.tensor([0, 4, 2], dtype=torch.int32, device=DEV)
    q, s = quantize_rows(xb, scheme, batch_counts=counts)
    q_ref, s_ref = quantize_activation(xb, scheme)
    for b, c in enumerate(counts.tolist()):
        assert torch.equal(q[b, :c].view(torch.uint8), q_ref[b, :c].view(torch.uint8))
        assert torch.equal(s[b, :c], s_ref[b, :c])


# ---------------------------------------------------------------------------------------------
# Both experts backends against the emulating reference


# every scheme in the Standard kernel; the batched kernel's two scale paths (epilogue, per K step)
# and its static per-tensor quantisation
@pytest.mark.parametrize("experts,pf,name", [(*KERNELS[0], n) for n in SCHEMES]
                         + [(*KERNELS[1], "tensor"), (*KERNELS[1], "block32")])
def test_fp8_matches_reference(experts, pf, name):
    scheme = SCHEMES[name]
    q13, q2 = _qweights(scheme)
    m = 13
    x = _x(m)
    tw, ti = _routing(m, E, K)
    out = _run(experts, pf, x, q13, q2, tw, ti, config=_cfg(scheme), options=_opts())
    assert out.dtype == torch.bfloat16 and out.shape == (m, H)
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti)) < TIGHT


@pytest.mark.parametrize("experts,pf,name", [(*KERNELS[0], "block128"), (*KERNELS[1], "token")])
def test_fp8_fp32_activations_tight(experts, pf, name):
    # With fp32 activations nothing is rounded to 16 bits: the kernel and the reference quantise
    # the same values, and only the fp32 accumulation order is left.
    scheme = SCHEMES[name]
    q13, q2 = _qweights(scheme)
    x = _x(9, torch.float32)
    tw, ti = _routing(9, E, K)
    out = _run(experts, pf, x, q13, q2, tw, ti, config=_cfg(scheme), options=_opts())
    assert out.dtype == torch.float32
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti)) < 1e-6


@pytest.mark.parametrize("experts,pf", KERNELS, ids=KIDS)
def test_fp8_one_token_fp16(experts, pf):
    # M = 1 (most experts without tokens), fp16 activations: the output keeps x's dtype.
    scheme = SCHEMES["block32"]
    q13, q2 = _qweights(scheme, dtype=torch.float16)
    x = _x(1, torch.float16)
    tw, ti = _routing(1, E, K)
    out = _run(experts, pf, x, q13, q2, tw, ti, config=_cfg(scheme), options=_opts())
    assert out.dtype == torch.float16
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti)) < TIGHT


@pytest.mark.parametrize("experts,pf", KERNELS, ids=KIDS)
def test_fp8_zero_tokens(experts, pf):
    q13, q2 = _qweights(SCHEMES["token"])
    out = _run(experts, pf, _x(0), q13, q2, *_routing(0, E, K), config=CFG)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["token", "block32"])
def test_triton_fp8_one_expert_split_k(name):
    # Every token on expert 7 (top-1): a long run of blocks, the others empty; BLOCK_SIZE_K=32
    # with split_k=2 splits GEMM2's K loop (I=72: a 64-wide and an 8-wide part, block groups of 32).
    scheme = SCHEMES[name]
    q13, q2 = _qweights(scheme)
    m = 40
    x = _x(m)
    ti = torch.full((m, 1), 7, dtype=torch.int32, device=DEV)
    tw = torch.rand(m, 1, device=DEV)
    cfg = _cfg(scheme, BLOCK_SIZE_K=32, GROUP_SIZE_M=4)
    out = _run("triton", "no-dpep", x, q13, q2, tw, ti, config=cfg, split_k=2, options=_opts())
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti)) < TIGHT


@pytest.mark.parametrize("experts,pf,name", [(*KERNELS[0], "tensor"), (*KERNELS[0], "block128"),
                                             (*KERNELS[1], "block128")])
def test_fp8_expert_map_remote(experts, pf, name):
    # 20 global experts, 8 here; every token visits local expert `here` (one full run), token 1
    # routes only to remote experts: its row must be exactly zero.
    scheme = SCHEMES[name]
    e_local = 8
    emap = random_expert_map(E, e_local, DEV)
    q13, q2 = _qweights(scheme, e=e_local)
    m = 11
    x = _x(m)
    tw, ti = _routing(m, E, K, first=int(torch.nonzero(emap.cpu() >= 0).reshape(-1)[0]))
    ti[1] = torch.nonzero(emap.cpu() < 0).reshape(-1)[:K].to(DEV, torch.int32)
    out = _run(experts, pf, x, q13, q2, tw, ti, expert_map=emap, config=_cfg(scheme, BLOCK_SIZE_M=32))
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti, emap)) < TIGHT
    assert (out[1] == 0).all()


@pytest.mark.parametrize("name", ["block128", "tensor"])
@pytest.mark.parametrize("use_map", [False, True], ids=["all-local", "expert-map"])
def test_triton_fp8_pair_store(name, use_map):
    # GEMM2 storing each pair's bf16 row, summed by topk_sum: block 128 with H = 152 (a partial
    # last scale group), and per tensor (GEMM1 quantises the intermediate itself)
    scheme = SCHEMES[name]
    e_local = 12 if use_map else E
    q13, q2 = _qweights(scheme, e=e_local)
    emap = random_expert_map(E, e_local, DEV) if use_map else None
    x = _x(9)
    tw, ti = _routing(9, E, K)
    out = _run("triton", "no-dpep", x, q13, q2, tw, ti, emap, E, config=_cfg(scheme),
               options=_opts(pair_store=True))
    assert out.dtype == torch.bfloat16 and rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti, emap)) < TIGHT


def test_fp8_non_square_block():
    # block [32, 96] (BLOCK_SIZE_K=32 divides 96; GEMM1's 64-column tiles span two 32-row scale groups,
    # H=152: a partial K group), and use_tma=True, which these 152-byte fp8 rows cannot take (TMA
    # wants 16-byte rows)
    scheme = QuantScheme("fp8_w8a8", "block", (32, 96))
    q13, q2 = _qweights(scheme, e=16)
    x = _x(7)
    tw, ti = _routing(7, 16, K)
    cfg = _cfg(scheme, BLOCK_SIZE_K=32)
    out = _run("triton", "no-dpep", x, q13, q2, tw, ti, config=cfg, options=TritonOptions(use_tma=True))
    ref = moebench.reference_moe(x, q13, q2, tw, ti)
    assert rel_err(out, ref) < TIGHT
    out = _run("batched-triton", "batched-local", x, q13, q2, tw, ti, config=cfg)
    assert rel_err(out, ref) < TIGHT


def test_fp8_block_k_below_32_refused_on_gpu():
    # the GPU's fp8 dots need K >= 32: a one-line error there; the interpreter runs 16
    cfg = dict(CFG, BLOCK_SIZE_K=16)
    with pytest.raises(MoebenchError, match=r"BLOCK_SIZE_K=16 is below 32.*use BLOCK_SIZE_K >= 32"):
        check_block_config(cfg, SCHEMES["token"], "triton experts", "cuda")
    check_block_config(cfg, SCHEMES["token"], "triton experts", "cpu")
    check_block_config(cfg, QuantScheme("int4_w4a16", group_size=128), "triton experts", "cuda")


@pytest.mark.parametrize("experts,pf", KERNELS, ids=KIDS)
def test_block_k_must_divide_scale_block(experts, pf):
    scheme = SCHEMES["block32"]
    q13, q2 = _qweights(scheme)
    tw, ti = _routing(3, E, K)
    with pytest.raises(MoebenchError, match=r"BLOCK_SIZE_K=64 does not divide .*bk=32"):
        _run(experts, pf, _x(3), q13, q2, tw, ti, config=dict(CFG, BLOCK_SIZE_K=64))


# ---------------------------------------------------------------------------------------------
# Configs and the public functions


@pytest.mark.parametrize("experts_cls,pf", [(TritonExperts, "no-dpep"), (BatchedTritonExperts, "batched-local")])
def test_triton_fp8_config_lookup_uses_scheme_file(tmp_path, monkeypatch, experts_cls, pf):
    # A tuned file under the fp8 name (dtype=fp8_w8a8,block_shape=[32,32]) is found and used (the
    # batched experts key it on the routed tokens, 5); without it the default heuristic is fitted
    # to the scale block.
    scheme = SCHEMES["block32"]
    e, h, i = 8, 64, 32
    q13, q2 = _qweights(scheme, e=e, h=h, i=i)
    x = _x(5, h=h)
    tw, ti = _routing(5, e, 2)
    ref = moebench.reference_moe(x, q13, q2, tw, ti)
    monkeypatch.setenv("MOEBENCH_CONFIG_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)

    experts = experts_cls()
    kernel = moebench.FusedMoEKernel(moebench.make_kernel(experts_cls.name, pf).prepare_finalize, experts)
    with poisoned_outputs():
        out = kernel.apply(x, q13, q2, tw, ti)
    assert experts.last_config_source == "default heuristic"
    assert rel_err(out, ref) < TIGHT

    entry = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    name = f"E={e},N={i},device_name={device_name(DEV)},dtype=fp8_w8a8,block_shape=[32,32].json"
    TF.write_config_file(tmp_path / name, {8: entry})  # a write makes this process's lookup look again
    with poisoned_outputs():
        out = kernel.apply(x, q13, q2, tw, ti)
    assert experts.last_config_source.endswith(f"{name}[8]")
    assert rel_err(out, ref) < TIGHT


def test_fp8_block_default_tiles():
    # the sorted-token layer's fp8 block default by pairs per expert (M * 8 / 128 here): 64-wide
    # 16-row tiles below a quarter of a pair, 128-wide 16-row tiles in 3 stages up to 16 pairs,
    # then 64-row tiles with 4 warps; K inside the scale block; N capped by the layer's N
    from moebench.kernels.triton.configs import heuristic_config

    block = SCHEMES["block128"]

    def tile(m, n=768, e=128):
        c = heuristic_config(m, e, n, 2048, 8, torch.bfloat16, block)
        return tuple(c[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages"))

    assert tile(2) == (16, 64, 128, 4, 4)
    assert tile(4) == tile(256) == (16, 128, 128, 4, 3)
    assert tile(512) == tile(4096) == (64, 128, 128, 4, 4)
    assert tile(64, n=48)[:2] == (16, 64)
    # the batched experts' default (no pairs-per-expert band) keeps its own tile, fitted to the block
    batched = BatchedTritonExperts().config_for(64, 128, 768, 2048, torch.bfloat16, block, device_type="cpu")
    assert batched["BLOCK_SIZE_K"] == 128 and batched["BLOCK_SIZE_N"] <= 128


def test_batched_fp8_default_config_fitted():
    scheme = SCHEMES["block32"]
    cfg = BatchedTritonExperts().config_for(64, 8, 4096, 4096, torch.bfloat16, scheme, device_type="cpu")
    assert 32 % cfg["BLOCK_SIZE_K"] == 0
    q13, q2 = _qweights(scheme, e=8, h=64, i=32)
    x = _x(6, h=64)
    tw, ti = _routing(6, 8, 2)
    kernel = moebench.make_kernel("batched-triton", "batched-local")  # default config path
    with poisoned_outputs():
        out = kernel.apply(x, q13, q2, tw, ti)
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti)) < TIGHT


@pytest.mark.parametrize("name", ["tensor"])
def test_fused_moe_fp8_entry_points(name):
    # fused_moe with QuantWeights: an unquantised x is quantised there (same bits as prepare's
    # torch quantisation, so the same output as the modular kernel); an fp8 x needs a_scale, and
    # its output (and stored intermediate) is in out_dtype.
    scheme = SCHEMES[name]
    q13, q2 = _qweights(scheme, e=16)
    x = _x(6)
    tw, ti = _routing(6, 16, K)
    cfg = _cfg(scheme, BLOCK_SIZE_N=128)  # (one GEMM1 program per row block: the entry points are the subject)
    a = fused_moe(x, q13, q2, tw, ti, config=cfg)
    b = _run("triton", "no-dpep", x, q13, q2, tw, ti, config=cfg)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    x16 = x.to(torch.float16)
    xq, xs = quantize_activation(x16, scheme, q13.input_scale)
    c = fused_moe(xq, q13, q2, tw, ti, config=cfg, a_scale=xs, out_dtype=torch.float16)
    assert c.dtype == torch.float16
    assert rel_err(c, moebench.reference_moe(x16, q13, q2, tw, ti)) < TIGHT
    with pytest.raises(MoebenchError, match="a_scale"):
        fused_moe(xq, q13, q2, tw, ti, config=cfg)


def test_batched_moe_quantises_unquantised_input():
    # batched_moe given bf16 activations with fp8 weights quantises them itself (rows past each
    # count skipped) and matches the path where prepare quantised them.
    scheme = SCHEMES["token"]
    q13, q2 = _qweights(scheme, e=3)
    a = torch.randn(3, 8, H, device=DEV).to(torch.bfloat16)
    counts = torch.tensor([0, 8, 5], dtype=torch.int32, device=DEV)
    cfg = _cfg(scheme)
    with poisoned_outputs():
        out = batched_moe(a, counts, q13, q2, cfg)
        aq, s = quantize_activation(a, scheme)
        ref = batched_moe(aq, counts, q13, q2, cfg, s, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    for e, c in enumerate(counts.tolist()):
        assert torch.equal(out[e, :c], ref[e, :c])
    assert torch.isnan(out[0]).all() and torch.isnan(out[2, 5:]).all()  # skipped rows stay unwritten


@pytest.mark.parametrize("name", ["tensor", "token", "block32"])
def test_triton_fp8_wide_gemm1(name):
    # GEMM1 as one (BK, BLOCK_SIZE_N) tile and one dot: each column's scale follows its w13 row
    # (gate n or up I + n), per channel and per block, and the result matches the reference.
    scheme = SCHEMES[name]
    q13, q2 = _qweights(scheme)
    m = 9
    x = _x(m)
    tw, ti = _routing(m, E, K)
    cfg = _cfg(scheme)
    with poisoned_outputs():
        out = fused_moe(x, q13, q2, tw, ti, config=cfg, options=_opts(wide_gemm1=True))
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti)) < TIGHT


@pytest.mark.parametrize("name", ["token", "block32"])
@pytest.mark.parametrize("wide", [False, True], ids=["paired", "wide"])
def test_triton_fp8_swap_ab(name, wide):
    # both GEMMs as w^T x^T into a transposed accumulator, scales transposed with it: the
    # reference, on 16-row blocks (one token: the direct alignment) and 32-row blocks, with an
    # expert map; the same result as the unswapped dots within rounding. One scheme per scale
    # path of the swapped dots: per token (epilogue scales; per tensor is the same path with one
    # scale for every row, so a row scale applied along the wrong axis shows only here) and block 32
    # (scales per K step; two column groups per 64-wide tile, so a weight scale applied along the
    # wrong axis shows; block 128 swapped is test_triton_fp8_block_swap_ab_auto's)
    scheme = SCHEMES[name]
    e_local = 12
    q13, q2 = _qweights(scheme, e=e_local)
    emap = random_expert_map(E, e_local, DEV)
    for m, bm in ((1, 16), (9, 32)):
        x = _x(m)
        tw, ti = _routing(m, E, K)
        cfg = _cfg(scheme, BLOCK_SIZE_M=bm)
        ref = moebench.reference_moe(x, q13, q2, tw, ti, emap)
        with poisoned_outputs():
            got = fused_moe(x, q13, q2, tw, ti, emap, E, cfg, options=TritonOptions(swap_ab=True, wide_gemm1=wide))
            plain = fused_moe(x, q13, q2, tw, ti, emap, E, cfg, options=TritonOptions(swap_ab=False, wide_gemm1=wide))
        assert rel_err(got, ref) < TIGHT, (m, bm)
        assert rel_err(got, plain.double()) < TIGHT, (m, bm)


def test_triton_fp8_block_swap_ab_auto(monkeypatch):
    # "auto" swaps the block-scaled GEMMs of 16-row tiles at least 128 wide (one token: the direct
    # alignment; 13 tokens: the alignment kernels), not 64-wide ones: a spy on the resolved choice
    # of both GEMMs, and the layer against the reference (on an H200 the swapped tile measured up to
    # 5.7e-3: there the 128 weight columns fill wgmma's M side, whose fp8 products are accumulated at
    # reduced precision within each K step, where the unswapped 16-row tile is not)
    import moebench.kernels.triton.options as opts

    seen = []
    real = opts.resolve_swap_ab
    monkeypatch.setattr(opts, "resolve_swap_ab", lambda *a: seen.append(real(*a)) or seen[-1])
    scheme = SCHEMES["block128"]
    q13, q2 = _qweights(scheme)
    for m in (1, 13):
        x = _x(m)
        tw, ti = _routing(m, E, K)
        ref = moebench.reference_moe(x, q13, q2, tw, ti)
        # (the choice is the tile's alone: the unswapped 64-wide tile once, at 13 tokens)
        for bn, want in ((128, [True, True]), (64, [False, False]))[: 1 if m == 1 else 2]:
            seen.clear()
            out = _run("triton", "no-dpep", x, q13, q2, tw, ti, config=_cfg(scheme, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128))
            assert seen == want, (m, bn)
            assert rel_err(out, ref) < (SWAPPED_GPU if DEV == "cuda" and bn == 128 else TIGHT), (m, bn)
    # the swapped GEMM2 storing per-pair rows (pair_store), with an expert map
    emap = random_expert_map(E, 12, DEV)
    q13, q2 = _qweights(scheme, e=12)
    seen.clear()
    with poisoned_outputs():
        out = fused_moe(x, q13, q2, tw, ti, emap, E, _cfg(scheme, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128), 1,
                        options=TritonOptions(pair_store=True))
    assert seen == [True, True]
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti, emap)) < (SWAPPED_GPU if DEV == "cuda" else TIGHT)


@pytest.mark.parametrize("name", ["tensor", "block128"])
@pytest.mark.parametrize("wide", [False, True], ids=["paired", "wide"])
def test_triton_fp8_tma_weight_tiles(name, wide, monkeypatch):
    # use_tma=True: both GEMMs' fp8 weight tiles through TMA descriptors (H = 160, I = 80: 16-byte
    # rows, partial 128-wide scale groups), with an expert map and the direct alignment; the
    # descriptors are really made, and "auto" leaves these 16- and 32-row tiles on pointer loads.
    # Per-tensor scales (epilogue) and block ones (per K step; their scales load by pointer as
    # without TMA, where block 32 is tested)
    import moebench.kernels.triton.launch as launch

    made = []
    real = launch.TensorDescriptor.from_tensor
    monkeypatch.setattr(launch.TensorDescriptor, "from_tensor", lambda t, block: made.append(t.dtype) or real(t, block))
    scheme = SCHEMES[name]
    e_local = 12
    q13, q2 = _qweights(scheme, e=e_local, h=160, i=80)
    emap = random_expert_map(E, e_local, DEV)
    for m, bm in ((1, 16), (9, 32)):
        x = _x(m, h=160)
        tw, ti = _routing(m, E, K)
        cfg = _cfg(scheme, BLOCK_SIZE_M=bm)
        ref = moebench.reference_moe(x, q13, q2, tw, ti, emap)
        # "auto" (the rule, and the layer making no descriptor where it says no: at one token)
        assert not resolve_use_tma(TritonOptions(), cfg, FP8_DTYPE), bm
        with poisoned_outputs():
            made.clear()
            if m == 1:
                fused_moe(x, q13, q2, tw, ti, emap, E, cfg, options=TritonOptions(wide_gemm1=wide))
                assert made == [], "auto: no TMA for fp8 below 64-row tiles"
            got = fused_moe(x, q13, q2, tw, ti, emap, E, cfg, options=TritonOptions(use_tma=True, wide_gemm1=wide))
            assert made == [FP8_DTYPE, FP8_DTYPE], made
        assert rel_err(got, ref) < TIGHT, (m, bm)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_fused_per_tensor_intermediate_is_bit_exact(act):
    # GEMM1 storing the per-tensor fp8 intermediate itself gives the bytes of the two-step path
    # (store in the activation dtype, then quantize_rows with w2's static scale), rows in use.
    scheme = SCHEMES["tensor"]
    q13, q2 = _qweights(scheme, dtype=act)
    m = 11
    xq, xs = quantize_rows(_x(m, act), scheme, q13.input_scale)
    tw, ti = _routing(m, E, K)
    cfg = _cfg(scheme, BLOCK_SIZE_N=128)  # one 128-wide tile of the 72 columns per row block
    align = moe_align_block_size(ti, cfg["BLOCK_SIZE_M"], E)
    two_step = launch_gemm1(xq, q13, align, K, cfg, a_scale=xs, out_dtype=act)
    q_ref, _ = quantize_rows(two_step, scheme, q2.input_scale, row_limit=align.num_tokens_post_padded)
    fused = launch_gemm1(xq, q13, align, K, cfg, a_scale=xs, out_dtype=act, out_scale=q2.input_scale)
    used = int(align.num_tokens_post_padded)
    assert fused.dtype == FP8_DTYPE
    assert torch.equal(fused[:used].view(torch.uint8), q_ref[:used].view(torch.uint8))


@pytest.mark.parametrize("name", ["block128", "token"])
def test_fp8_direct_alignment_few_tokens(name, monkeypatch):
    # fp8 whose intermediate has its own quantisation launch takes one block per pair up to a
    # quarter as many pairs as experts, without an expert map: the layer against the reference, and
    # a spy on which alignment ran (one token: 4 pairs of 20 experts; 2 tokens: 8 pairs; a map)
    from moebench.kernels.triton import align as A

    scheme = SCHEMES[name]
    calls = []
    real = A.direct_align
    monkeypatch.setattr(A, "direct_align", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m, e_local, want in ((1, E, [1]), (2, E, []), (1, 12, [])):
        calls.clear()
        q13, q2 = _qweights(scheme, e=e_local)
        emap = random_expert_map(E, e_local, DEV) if e_local < E else None
        x = _x(m)
        tw, ti = _routing(m, E, K)
        out = _run("triton", "no-dpep", x, q13, q2, tw, ti, emap, E, config=_cfg(scheme), options=_opts())
        assert calls == want, (m, e_local)
        assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti, emap)) < TIGHT


@pytest.mark.parametrize("name", ["block128", "block32"])
def test_triton_fp8_block_two_groups_per_k_step(name, monkeypatch):
    # GEMM1's paired walk taking two scale groups per iteration (fp8_k_groups): the reference and the
    # one-group result, with an expert map; "auto" takes two at 16-row tiles where H is a multiple
    # of 2 x BLOCK_SIZE_K and at least fp8_k_groups_min_hidden with at most half a pair per expert (a spy
    # on the resolved choice: 4 pairs over 20 experts; 8 pairs by the rule), one above that load (20 pairs), at
    # 32-row tiles (8 pairs: a load that would take two) and below the H threshold; a forced 2 that cannot run (H = 152) is refused.
    # Each case launches "auto" and the forced other choice (the spy says which "auto" took, so the
    # two launches are the one- and the two-group walk). Block 32 (BLOCK_SIZE_K 32): each iteration's
    # two steps in two scale groups; block 128 (BLOCK_SIZE_K 64): both in one group. 128-wide tiles
    # (one GEMM1 program per row block, I = 72), unswapped as the 64-wide ones "auto" leaves.
    import moebench.kernels.triton.options as opts

    scheme = SCHEMES[name]
    h, e_local = 256, 12
    q13, q2 = _qweights(scheme, e=e_local, h=h)
    emap = random_expert_map(E, e_local, DEV)
    seen = []
    real = opts.resolve_k_groups
    monkeypatch.setattr(opts, "resolve_k_groups", lambda *a: seen.append(real(*a)) or seen[-1])
    # 8 pairs (2 tokens): still two, by the rule itself (the layer's launches as at 4 pairs)
    two_tokens = _cfg(scheme, BLOCK_SIZE_M=16, BLOCK_SIZE_N=128)
    assert real(TritonOptions(fp8_k_groups_min_hidden=h), two_tokens, scheme, False, False, h, 2 * K / E) == 2
    for m, bm, want in ((1, 16, 2), (5, 16, 1), (2, 32, 1)):
        x = _x(m, h=h)
        tw, ti = _routing(m, E, K)
        cfg = _cfg(scheme, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=128)
        ref = moebench.reference_moe(x, q13, q2, tw, ti, emap)
        other = 3 - want
        seen.clear()
        with poisoned_outputs():
            auto = fused_moe(x, q13, q2, tw, ti, emap, E, cfg,
                             options=TritonOptions(fp8_k_groups_min_hidden=h, swap_ab=False))
            forced = fused_moe(x, q13, q2, tw, ti, emap, E, cfg, options=TritonOptions(fp8_k_groups=other, swap_ab=False))
        two, one = (auto, forced) if want == 2 else (forced, auto)
        # the default threshold (4096) is above this H
        seen.append(real(TritonOptions(), cfg, scheme, False, False, h, m * K / E))
        assert seen == [want, other, 1], (m, bm)
        assert rel_err(two, ref) < TIGHT and rel_err(one, ref) < TIGHT, (m, bm)
        assert rel_err(two, one.double()) < TIGHT, (m, bm)
    q13, q2 = _qweights(scheme)  # H = 152
    x = _x(9)
    tw, ti = _routing(9, E, K)
    with pytest.raises(MoebenchError, match="fp8_k_groups=2 needs"):
        fused_moe(x, q13, q2, tw, ti, config=_cfg(scheme), options=TritonOptions(fp8_k_groups=2))
    with pytest.raises(MoebenchError, match="fp8_k_groups must be 1, 2"):
        TritonOptions(fp8_k_groups=3)


@pytest.mark.parametrize("name", ["block128", "tensor", "token"])
def test_fp8_token_rows(name):
    # The token-rows layout with every fp8 scheme (H = 152: a K tail in each 128-column scale group;
    # per tensor: GEMM1 quantises the intermediate of the E_local x 16 rows itself; block / token: a
    # launch of its own), with an expert map and a token repeating an expert: the layer against the
    # reference and against the alignment kernels' layout.
    scheme = SCHEMES[name]
    q13, q2 = _qweights(scheme, e=12)
    emap = random_expert_map(E, 12, DEV)
    x = _x(11)
    tw, ti = _routing(11, E, K)
    ti[2, 3] = ti[2, 0]
    ref = moebench.reference_moe(x, q13, q2, tw, ti, emap)
    with poisoned_outputs():
        rows = fused_moe(x, q13, q2, tw, ti, emap, E, _cfg(scheme), options=_opts(token_rows=True))
        aligned = fused_moe(x, q13, q2, tw, ti, emap, E, _cfg(scheme), options=_opts(token_rows=False))
    assert rel_err(rows, ref) < TIGHT and rel_err(aligned, ref) < TIGHT
    assert rel_err(rows, aligned.double()) < TIGHT


@pytest.mark.parametrize("name,m", [("block128", 1), ("token", 13), ("block32", 13)])
def test_intermediate_sentinel_rows_are_never_read(name, m, monkeypatch):
    # The intermediate's quantisation skips the alignment's sentinel rows (pair_rows): GEMM2 must
    # not let whatever they hold reach the output. Here they hold NaN (q and scale) after it ran.
    import moebench.kernels.triton.launch as gemm_mod

    real = gemm_mod.quantize_rows

    def poisoning(x, scheme, static=None, **kw):
        q, s = real(x, scheme, static, **kw)
        ids, num_pairs = kw["pair_rows"]
        sentinel = ids[: q.shape[0]] >= num_pairs
        q.view(torch.uint8)[sentinel] = 0x7F  # e4m3 NaN
        if s.stride(0):
            s[sentinel] = float("nan")
        return q, s

    monkeypatch.setattr(gemm_mod, "quantize_rows", poisoning)
    scheme = SCHEMES[name]
    q13, q2 = _qweights(scheme)
    x = _x(m)
    tw, ti = _routing(m, E, K)
    out = fused_moe(x, q13, q2, tw, ti, None, E, _cfg(scheme), options=_opts(token_rows=False))
    assert not out.isnan().any()
    assert rel_err(out, moebench.reference_moe(x, q13, q2, tw, ti)) < TIGHT


def test_silu_mul_rows_grouped_takes_each_groups_own_rows():
    # (E, T, 2I) with one limit per group (a masked layout's counts): rows t < counts[e] of each
    # group, in place; fp8 scales through a 3-D MN-major layout
    g = torch.Generator().manual_seed(3)
    e, t, i = 3, 20, 128
    gu = (torch.randn(e, t, 2 * i, generator=g) * 3).to(DEV, torch.bfloat16)
    counts = torch.tensor([5, 0, 20], dtype=torch.int32, device=DEV)
    h = (torch.nn.functional.silu(gu[..., :i].float()) * gu[..., i:].float()).bfloat16()
    q = torch.zeros((e, t, i), dtype=FP8_DTYPE, device=DEV)
    s = torch.empty_strided((e, t, 1), (t, 1, t), device=DEV).fill_(-1.0)
    silu_mul_rows(gu, counts, q, s)
    scheme = QuantScheme(scales="block", block_shape=(128, 128))
    for j, c in enumerate(counts.tolist()):
        if c:
            q_ref, s_ref = quantize_activation(h[j, :c], scheme)
            assert torch.equal(q[j, :c].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s[j, :c], s_ref)
        assert (s[j, c:] == -1.0).all() and (q[j, c:].view(torch.uint8) == 0).all()
    with pytest.raises(MoebenchError, match="one row limit per row group"):
        silu_mul_rows(gu, counts[:2], q, s)
