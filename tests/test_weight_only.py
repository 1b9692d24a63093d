"""Weight-only quantised experts (int8_w8a16, int4_w4a16 with and without zero points, mxfp4):
packing, the Triton kernels against the float64 reference of the dequantised weights on sizes
whose K is not a multiple of the group, the bytes the roofline counts, tuned-file names, and the
CLI (a sweep end to end, bad options)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import moebench
from moebench.bench import metrics
from moebench.correctness import relative_error
from moebench.errors import MoebenchError
from moebench.inputs import make_tokens, make_weights
from moebench.kernels.reference import reference_moe
from moebench.kernels.triton import configs as C
from moebench.kernels.triton.batched import batched_moe
from moebench.kernels.triton.experts import fused_moe
from moebench.kernels.triton.options import TritonOptions
from moebench.kernels.triton.wquant import check_wq_config
from moebench.quant import (
    E2M1_VALUES,
    QuantScheme,
    QuantWeight,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    parse_quant,
    quantize_weight,
    unpack_nibbles,
)
from moebench.tuning.space import WQ_GROUP_REASON, Problem, prune_reason
from tests.test_cli import assert_bad_input, moebench_inproc
from moebench.kernels import tuned_files as TF

#: The kernels' own error against the reference of the very weights they dot: bf16 rounding of the
#: intermediate and the output only (observed 3-7e-3); a wrong nibble, scale or zero is >= 5e-2.
TOL = 1.2e-2

SCHEMES = {
    "int8": QuantScheme("int8_w8a16"),
    "int4-g32": QuantScheme("int4_w4a16", group_size=32),
    "int4-g64": QuantScheme("int4_w4a16", group_size=64),
    "int4-g128": QuantScheme("int4_w4a16"),
    "int4-g32-zp": QuantScheme("int4_w4a16", group_size=32, zero_points=True),
    "int4-g64-zp": QuantScheme("int4_w4a16", group_size=64, zero_points=True),
    "int4-g128-zp": QuantScheme("int4_w4a16", group_size=128, zero_points=True),
    "mxfp4": QuantScheme("mxfp4"),
}
#: H = 200 and I = 72 are multiples of none of the groups (32, 64, 128): every K loop ends in a
#: partial group; H = 201 is odd too (the packed layout pads it).
E, TOPK, H, I = 4, 2, 200, 72
#: BLOCK_SIZE_K below the group (one scale column per tile) and above it (one per K index).
#: BLOCK_SIZE_N 128: two programs along each GEMM's N, the last one partial (GEMM1: 64 gate + 64 up
#: columns of I = 72; GEMM2: 128 of H = 200), fewer than 64-wide tiles make (the interpreter's time
#: goes with the programs run); the scales are per output column, whatever the tile's width.
CFG_SMALL_K = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
CFG_BIG_K = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=256, GROUP_SIZE_M=4, num_warps=4, num_stages=2)


def _problem(scheme, m, hidden=H, inter=I, seed=0):
    w13, w2 = make_weights(range(E), hidden, inter, torch.bfloat16, "cpu", seed, quant=scheme)
    x = make_tokens(m, hidden, torch.bfloat16, "cpu", seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(m)])
    wts = torch.rand((m, TOPK), generator=g)
    return x, w13, w2, wts, ids


# ---------------------------------------------------------------------------------------------
# Packing


def test_nibble_packing_round_trip_and_layout():
    codes = torch.randint(0, 16, (3, 5, 11))
    for dim in (-1, 1):
        packed = pack_nibbles(codes, dim)
        assert packed.dtype == torch.uint8
        back = unpack_nibbles(packed, dim)
        n = codes.shape[dim]
        assert torch.equal(back.narrow(dim, 0, n), codes)
        assert (back.narrow(dim, n, back.shape[dim] - n) == 0).all()  # odd length padded with a 0 code
    # element 2j in the low nibble of byte j, 2j + 1 in the high nibble (vLLM's int4 layout)
    assert pack_nibbles(torch.tensor([3, 12, 5])).tolist() == [3 | (12 << 4), 5]


def test_e2m1_codes():
    codes = torch.arange(16)
    vals = e2m1_decode(codes)
    assert vals[:8].tolist() == list(E2M1_VALUES) and vals[8:].tolist() == [-v for v in E2M1_VALUES]
    back = e2m1_encode(vals)
    assert torch.equal(back, torch.where(codes == 8, 0, codes))  # -0 encodes as +0
    # nearest, ties to even (the even code), saturating at 6
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.3])
    assert e2m1_encode(mids).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 9]


@pytest.mark.parametrize("name", ["int8", "int4-g32", "int4-g128-zp", "mxfp4"])
def test_quantize_layout_and_error_bound(name):
    scheme = SCHEMES[name]
    w = torch.randn(2, 6, 75) * 0.05
    q = quantize_weight(w, scheme)
    assert q.shape == w.shape
    d = q.dequantize().float()
    if name == "int8":
        assert q.q.dtype == torch.int8 and q.scale.shape == (2, 6)
        step = q.scale.float().unsqueeze(-1)
    else:
        g = scheme.group_size
        assert q.q.shape == (2, 6, -(-75 // g) * g // 2) and q.scale.shape == (2, 6, -(-75 // g))
        codes = unpack_nibbles(q.q)
        if name == "mxfp4":
            assert q.scale.dtype == torch.uint8
            scale = torch.exp2(q.scale.float() - 127).repeat_interleave(g, -1)[..., :75]
            # e2m1 steps are at most 2 (between 4 and 6) times the scale: half a step inside +-6 x
            # scale; above it (OCP's exponent leaves amax below 8 x scale) values saturate at 6 x scale
            inside = w.abs() <= 6 * scale
            assert ((d - w).abs()[inside] <= scale[inside] + 1e-7).all()
            assert ((d - w).abs() <= 2 * scale + 1e-7).all() and (d.abs() <= 6 * scale).all()
            assert torch.equal(codes[..., 75:], torch.zeros_like(codes[..., 75:]))
            return
        step = q.scale.float().repeat_interleave(g, -1)[..., :75]
        if scheme.zero_points:
            assert q.zeros.shape == (2, 3, -(-75 // g))
        else:
            assert (codes[..., 75:] == 8).all()  # the padding of the partial group is the code of 0
    # half a step, plus the one rounding of the dequantised value to bf16
    assert ((d - w).abs() <= step / 2 + w.abs() / 128 + 1e-6).all()


def test_dequantize_matches_hand_arithmetic():
    scheme = SCHEMES["int4-g32-zp"]
    q = quantize_weight(torch.randn(1, 3, 40), scheme)
    codes = unpack_nibbles(q.q)[0].float()  # (3, 64)
    zeros = unpack_nibbles(q.zeros, dim=1)[0, :3].float()  # (3, 2)
    s = q.scale[0].float()
    want = torch.empty(3, 40)
    for n in range(3):
        for k in range(40):
            want[n, k] = (codes[n, k] - zeros[n, k // 32]) * s[n, k // 32]
    assert torch.equal(q.dequantize(torch.float32)[0], want.to(torch.bfloat16).float())


def test_quantweight_expert_selection_keeps_packing():
    q = quantize_weight(torch.randn(4, 6, 75), SCHEMES["int4-g32-zp"])
    sub = q[torch.tensor([1, 3])]
    assert sub.shape == (2, 6, 75) and sub.zeros.shape == (2, 3, 3)
    assert torch.equal(sub.dequantize(), q.dequantize()[[1, 3]])


# ---------------------------------------------------------------------------------------------
# Kernels against the reference


# each scheme's branch of the dequantisation (int8; int4 with the fixed zero point 8 and with zero
# points; mxfp4), both tiles against the group (BLOCK_SIZE_K 32 inside a group, 256 over several:
# the two ways the kernel indexes the scales), and each int4 group size once (zero points at 64;
# int4-g32-zp and int4-g64 are the batched and odd-hidden tests')
@pytest.mark.parametrize("name", ["int8", "int4-g32", "int4-g128", "int4-g64-zp", "mxfp4"])
def test_triton_layer_matches_reference(name):
    x, w13, w2, wts, ids = _problem(SCHEMES[name], m=5)
    ref = reference_moe(x, w13, w2, wts, ids)
    for cfg in (CFG_SMALL_K, CFG_BIG_K):
        out = fused_moe(x, w13, w2, wts, ids, config=cfg)
        assert out.dtype == torch.bfloat16
        assert relative_error(out, ref) < TOL, (name, cfg["BLOCK_SIZE_K"])


@pytest.mark.parametrize("name", ["int8", "int4-g64", "int4-g32-zp", "mxfp4"])
def test_batched_triton_matches_reference(name):
    scheme = SCHEMES[name]
    w13, w2 = make_weights(range(3), H, I, torch.bfloat16, "cpu", 0, quant=scheme)
    a = make_tokens(3 * 8, H, torch.bfloat16, "cpu", 1).view(3, 8, H)
    counts = torch.tensor([3, 0, 8])
    for cfg in (CFG_SMALL_K, CFG_BIG_K):
        out = batched_moe(a, counts, w13, w2, cfg)
        for e in (0, 2):
            c = int(counts[e])
            ref = reference_moe(a[e, :c], w13[e], w2[e], torch.ones(c, 1), torch.zeros(c, 1, dtype=torch.long))
            assert relative_error(out[e, :c], ref) < TOL, (name, e, cfg["BLOCK_SIZE_K"])


@pytest.mark.parametrize("name", ["int4-g32-zp", "mxfp4", "int8"])
@pytest.mark.parametrize("pair", [("no-dpep", "triton"), ("batched-local", "batched-triton")])
def test_modular_kernel_odd_hidden(name, pair):
    """Through the modular kernel (prepare leaves the activations alone), one token (direct
    alignment) and five, an odd hidden size (CFG_SMALL_K: a 9-wide K tail after six 32-wide steps;
    the default config's lookup with weight-only weights runs in test_sweep_int4_end_to_end)."""
    kernel = moebench.make_kernel(experts=pair[1], prepare_finalize=pair[0], experts_kwargs={"config": CFG_SMALL_K})
    for m in (1, 5):
        x, w13, w2, wts, ids = _problem(SCHEMES[name], m=m, hidden=201, inter=40)
        out = kernel.apply(x, w13, w2, wts, ids)
        assert relative_error(out, reference_moe(x, w13, w2, wts, ids)) < TOL, (name, pair, m)


def test_wide_gemm1_walk():
    x, w13, w2, wts, ids = _problem(SCHEMES["int4-g64-zp"], m=7)
    out = fused_moe(x, w13, w2, wts, ids, config=CFG_SMALL_K, options=TritonOptions(wide_gemm1=True))
    assert relative_error(out, reference_moe(x, w13, w2, wts, ids)) < TOL


def test_kernel_reads_the_zero_points():
    """The check can fail: the same codes with every zero point moved by one give another layer."""
    x, w13, w2, wts, ids = _problem(SCHEMES["int4-g32-zp"], m=5)
    ref = reference_moe(x, w13, w2, wts, ids)
    z = unpack_nibbles(w13.zeros, dim=1)
    moved = QuantWeight(w13.q, w13.scale, w13.scheme, zeros=pack_nibbles((z + 1).clamp(max=15), dim=1), k=w13.k)
    out = fused_moe(x, moved, w2, wts, ids, config=CFG_SMALL_K)
    assert relative_error(out, ref) > 5 * TOL
    assert relative_error(out, reference_moe(x, moved, w2, wts, ids)) < TOL


def test_weight_only_needs_16bit_activations():
    with pytest.raises(MoebenchError, match="fp32"):
        make_weights(range(2), 64, 32, torch.float32, "cpu", 0, quant=SCHEMES["int4-g32"])
    x, w13, w2, wts, ids = _problem(SCHEMES["int8"], m=2)
    with pytest.raises(MoebenchError, match="bfloat16"):
        fused_moe(x.float(), w13, w2, wts, ids, config=CFG_SMALL_K)


# ---------------------------------------------------------------------------------------------
# Bytes, file names, tile rules


@pytest.mark.parametrize("name", list(SCHEMES))
def test_expert_weight_bytes_are_the_stored_bytes(name):
    w13, w2 = make_weights(range(1), H, I, torch.bfloat16, "cpu", 0, quant=SCHEMES[name])
    assert metrics.expert_weight_bytes(H, I, 2, SCHEMES[name]) == w13.nbytes() + w2.nbytes()


def test_expert_weight_bytes_by_hand():
    h, i = 4096, 1024  # whole groups: w13 (2048, 4096), w2 (4096, 1024)
    n = 3 * h * i
    assert metrics.expert_weight_bytes(h, i, 2, SCHEMES["int8"]) == n + 2 * (2 * i + h)
    g128 = 2 * i * (h // 128) + h * (i // 128)  # groups of both matrices
    assert metrics.expert_weight_bytes(h, i, 2, SCHEMES["int4-g128"]) == n / 2 + 2 * g128
    assert metrics.expert_weight_bytes(h, i, 2, SCHEMES["int4-g128-zp"]) == n / 2 + 2 * g128 + g128 / 2
    assert metrics.expert_weight_bytes(h, i, 2, SCHEMES["mxfp4"]) == n / 2 + n / 32
    # fp8 unchanged: one byte per element, fp32 scales
    assert metrics.expert_weight_bytes(h, i, 2, QuantScheme("fp8_w8a8", "token")) == n + 4 * (2 * i + h)
    ids = torch.tensor([[0, 1]])
    assert metrics.layer_bytes(ids, 8, h, i, 2, quant=SCHEMES["mxfp4"]) == round(2 * (n / 2 + n / 32) + 2 * h * 2)


def test_config_file_names():
    def name(q):
        return TF.config_file_name(8, 512, "NVIDIA_H200", *TF.name_parts(torch.bfloat16, q),
                                  per_channel_quant=TF.per_channel_quant(q))

    assert name(SCHEMES["int8"]) == "E=8,N=512,device_name=NVIDIA_H200,dtype=int8_w8a16.json"
    for k in ("int4-g32", "int4-g128", "int4-g64-zp"):
        assert name(SCHEMES[k]) == "E=8,N=512,device_name=NVIDIA_H200,dtype=int4_w4a16.json"
    assert name(SCHEMES["mxfp4"]) == "E=8,N=512,device_name=NVIDIA_H200,dtype=mxfp4.json"
    assert name(None) == "E=8,N=512,device_name=NVIDIA_H200.json"
    assert name(QuantScheme("fp8_w8a8", "block", (128, 128))) == \
        "E=8,N=512,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert TF.file_scheme("E=8,N=512,device_name=NVIDIA_H200,dtype=int4_w4a16.json") == "int4_w4a16"


def test_merge_refuses_another_scheme(tmp_path):
    entry = {1: dict(CFG_SMALL_K)}
    p = TF.merge_config_file(tmp_path / "E=4,N=72,device_name=cpu,dtype=int4_w4a16.json", entry,
                            torch.bfloat16, SCHEMES["int4-g64-zp"])
    assert TF.load_config_file(p)[1]["BLOCK_SIZE_K"] == 32
    with pytest.raises(MoebenchError, match="refusing"):
        TF.merge_config_file(tmp_path / "E=4,N=72,device_name=cpu,dtype=mxfp4.json", entry, torch.bfloat16,
                            SCHEMES["int8"])


def test_tile_rules_against_the_group():
    p = Problem(tokens=16, num_experts=8, local_experts=8, topk=2, hidden=256, inter=128, wq_group=64)
    base = dict(CFG_SMALL_K, BLOCK_SIZE_M=16)
    assert prune_reason(dict(base, BLOCK_SIZE_K=96), p) == WQ_GROUP_REASON
    assert prune_reason(dict(base, BLOCK_SIZE_K=32), p) is None
    assert prune_reason(dict(base, BLOCK_SIZE_K=128), p) is None
    with pytest.raises(MoebenchError, match="group size 64"):
        check_wq_config(dict(base, BLOCK_SIZE_K=96), SCHEMES["int4-g64"], "test")
    # the weight-only default keeps the 16-bit band's BLOCK_SIZE_M (fp8 doubles its BLOCK_SIZE_K)
    cfg = C.default_config(4, 8, 128, 256, 2)
    assert C.quant_default(cfg, SCHEMES["mxfp4"]) == dict(cfg, BLOCK_SIZE_K=64, num_stages=3)


def test_scheme_labels_and_options():
    assert SCHEMES["int4-g64-zp"].describe() == "int4_w4a16 group[64]+zp"
    assert SCHEMES["mxfp4"].scales_label == "e8m0 group[32]" and SCHEMES["int8"].scales_label == "per-channel"
    assert QuantScheme().describe() == "fp8_w8a8 per-tensor"  # the fp8 default is unchanged
    for bad in (dict(name="int4_w4a16", group_size=48), dict(name="mxfp4", group_size=64),
                dict(name="int8_w8a16", zero_points=True), dict(name="fp8_w8a8", group_size=32),
                dict(name="int8_w8a16", scales="token")):
        with pytest.raises(MoebenchError):
            QuantScheme(**bad)


# ---------------------------------------------------------------------------------------------
# CLI

SHAPE = ["--num-experts", "4", "--topk", "2", "--hidden", "100", "--intermediate", "40"]


def test_sweep_int4_end_to_end(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "1,3", "--dtype", "int4_w4a16", "--group-size", "64", "--zero-points",
                  "--device", "cpu", "--experts", "all", "--prepare-finalize",
                  "no-dpep,batched-local", "--reps", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    files = list(tmp_path.glob("*/results.csv"))
    df = pd.read_csv(files[0])
    ok = df[df.status == "ok"]
    assert set(ok.experts) == {"triton", "batched-triton"} and len(ok) == 4
    assert (ok.dtype == "int4_w4a16").all() and (ok["quant"] == "group[64]+zp").all()
    assert ok.correct.all() and (ok.max_rel_err < TOL).all()
    # what int4 costs against the unquantised layer, beside the kernel's own error
    assert ((ok.err_vs_unquantized > 0.03) & (ok.err_vs_unquantized < 0.4)).all()
    torch_rows = df[(df.experts == "torch") & (df.prepare_finalize == "no-dpep")]
    assert (torch_rows.status == "skipped").all() and torch_rows.reason.str.contains("int4_w4a16").all()
    # GB/s counts the packed weights of the experts hit plus bf16 activations in and out
    scheme = QuantScheme("int4_w4a16", group_size=64, zero_points=True)
    for _, r in ok.iterrows():
        hit = 2 if r.tokens == 1 else None
        if hit is not None:
            want = 2 * metrics.expert_weight_bytes(100, 40, 2, scheme) + 2 * 100 * 2
            assert abs(r.gbps * r.latency_us * 1e3 - want) / want < 1e-6
    # the device script's table reads these rows (no bf16 rows here: its bf16 columns stay empty)
    from benchmarks.weight_only_table import load, table

    lines = table(load(tmp_path, "triton")).splitlines()
    assert len(lines) == 4 and all("int4_w4a16 group[64]+zp" in ln and "| True |" in ln for ln in lines[2:])


@pytest.mark.parametrize("args,needles", [
    (["--dtype", "mxfp4", "--experts", "torch"], ["torch", "mxfp4", "--experts triton,batched-triton"]),
    (["--dtype", "int4_w4a16", "--group-size", "48"], ["--group-size", "32, 64, 128"]),
])
def test_bad_weight_only_options(args, needles):
    assert_bad_input(moebench_inproc("sweep", *SHAPE, "--tokens", "1", "--device", "cpu", *args), *needles)


@pytest.mark.parametrize("args,needle", [
    (("mxfp4", None, None, 64), "32"),
    (("int8_w8a16", None, None, None, True), "--zero-points"),
    (("bf16", None, None, 64), "int4_w4a16 only"),
    (("int4_w4a16", "128,128"), "fp8_w8a8 only"),
    (("int4_w4a16", None, "token"), "fp8_w8a8 only"),
])
def test_bad_option_combinations_are_one_line(args, needle):
    """What the CLI parses --dtype/--block-shape/--scales/--group-size/--zero-points with."""
    with pytest.raises(MoebenchError, match=needle) as e:
        parse_quant(*args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype, group, decode_bk", [("int8_w8a16", None, 128), ("int4_w4a16", 128, 128),
                                                     ("int4_w4a16", 32, 64), ("mxfp4", None, 64)])
def test_weight_only_default_keeps_the_dequantised_tile_small(dtype, group, decode_bk):
    """The weight-only default: BLOCK_SIZE_N <= 128, 4 warps, 3 stages at every band; BLOCK_SIZE_K
    128 in decode only where one scale spans 128 values along K, else 64; never above the 16-bit
    band's BLOCK_SIZE_K (tiny shapes)."""
    from moebench.kernels.triton.configs import heuristic_config

    scheme = parse_quant(dtype, group_size=group)
    for m in (1, 16, 64, 256, 1024, 4096):
        cfg = heuristic_config(m, 128, 1536, 2048, 8, torch.bfloat16, scheme)
        assert cfg["BLOCK_SIZE_N"] <= 128 and cfg["num_warps"] == 4 and cfg["num_stages"] == 3
        assert cfg["BLOCK_SIZE_K"] == (decode_bk if cfg["BLOCK_SIZE_M"] == 16 else 64)
        assert cfg["BLOCK_SIZE_M"] == heuristic_config(m, 128, 1536, 2048, 8)["BLOCK_SIZE_M"]
    assert heuristic_config(1, 8, 64, 32, 2, torch.bfloat16, scheme)["BLOCK_SIZE_K"] == 32


@pytest.mark.parametrize("name", ["int4-g32-zp", "mxfp4"])
@pytest.mark.parametrize("pair", [("no-dpep", "triton"), ("batched-local", "batched-triton")], ids=lambda p: p[1])
def test_interleaved_swigluoai_with_biases(name, pair):
    """gpt-oss's layer as it ships: interleaved w13 (gate row 2j, up row 2j + 1), clamped SwiGLU
    and expert biases, weights quantised: each gate and up column reads its own row's scales (and
    zero points); a column paired with the wrong row's scales is off by far more than TOL. (int8's
    per-channel scales are found by row as mxfp4's are.)"""
    from moebench.activation import Activation
    from moebench.kernels.modular import ExpertBias

    act = Activation("swigluoai")
    scheme = SCHEMES[name]
    w13, w2 = make_weights(range(E), H, I, torch.bfloat16, "cpu", 3, quant=scheme, interleaved=True)
    x = make_tokens(6, H, torch.bfloat16, "cpu", 4) * 4
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(6)])
    wts = torch.rand((6, TOPK), generator=g)
    bias = ExpertBias((torch.randn(E, 2 * I, generator=g) * 0.3).bfloat16(), (torch.randn(E, H, generator=g) * 0.1).bfloat16())
    kernel = moebench.make_kernel(experts=pair[1], prepare_finalize=pair[0], experts_kwargs={"config": CFG_SMALL_K})
    out = kernel.apply(x, w13, w2, wts, ids, activation=act, bias=bias)
    ref = reference_moe(x, w13, w2, wts, ids, activation=act, bias=bias)
    assert relative_error(out, ref) < TOL, (name, pair)
    # the same weights read as if gate and up were the two halves: another layer
    assert relative_error(out, reference_moe(x, w13, w2, wts, ids, activation=Activation("silu"), bias=bias)) > 0.1
