"""The modular kernel: format check, weight-and-reduce, and every CPU backend pair against the
float64 reference on awkward shapes and dtypes."""

import pytest
import torch

import moebench
from moebench.errors import FormatMismatchError, MoebenchError
from moebench.kernels.modular import (
    TopKWeightAndReduceBatched,
    TopKWeightAndReduceContiguous,
    poisoned_outputs,
)
from moebench.backends import check_combination, make_kernel
from moebench.kernels.token_layout import batched_slots, local_topk_ids, sort_by_expert
from moebench.correctness import TOLERANCE, relative_error

PAIRS = [("torch", "no-dpep"), ("batched-torch", "batched-local"), ("reference", "no-dpep")]


def make_case(m, e, k, h, i, dtype, routing="uniform", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    if routing == "one-expert":
        ids = torch.stack([torch.cat([torch.tensor([3]), torch.randperm(e - 1, generator=g)[:k - 1] + 4]) % e
                           for _ in range(m)]) if m else torch.empty(0, k, dtype=torch.long)
    elif routing == "few-experts":  # most experts get no tokens
        ids = torch.stack([torch.randperm(k + 1, generator=g)[:k] for _ in range(m)]) if m else torch.empty(0, k, dtype=torch.long)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]) if m else torch.empty(0, k, dtype=torch.long)
    wts = torch.softmax(torch.randn(m, k, generator=g), -1)
    return x, w13, w2, wts, ids.to(torch.int32)


def check_pair(experts, pf, case, expert_map=None, local=None):
    x, w13, w2, wts, ids = case
    if local is not None:
        w13, w2 = w13[local], w2[local]
    ref = moebench.reference_moe(x, w13, w2, wts, ids, expert_map)
    kernel = make_kernel(experts, pf)
    with poisoned_outputs():
        out = kernel.apply(x, w13, w2, wts, ids, expert_map=expert_map, num_experts=case[1].shape[0])
    assert out.shape == x.shape and out.dtype == x.dtype
    err = relative_error(out, ref)
    assert err <= TOLERANCE[x.dtype], f"{pf}+{experts}: rel err {err}"
    return out


@pytest.mark.parametrize("experts,pf", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,e,k,h,i", [(9, 60, 4, 72, 40), (1, 8, 2, 30, 22), (17, 6, 3, 50, 14)])
def test_pair_matches_reference(experts, pf, dtype, m, e, k, h, i):
    check_pair(experts, pf, make_case(m, e, k, h, i, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_torch_ignores_what_the_padding_rows_hold(dtype, monkeypatch):
    # the batched layout's rows past each expert's count are garbage (whatever the buffer held):
    # NaN there must not reach a valid row (torch's CPU bf16 bmm carried it into its batch's rows)
    import moebench.dispatch.batched_local as bl

    real = bl.batched_rows

    def scatter_over_nan(x, slot_map, num_local, max_tokens):
        buf = real(x, slot_map, num_local, max_tokens)
        counts = torch.bincount(slot_map[slot_map >= 0] // max_tokens, minlength=num_local)
        pad = torch.arange(max_tokens) >= counts.unsqueeze(1)
        return torch.where(pad.unsqueeze(-1), torch.tensor(float("nan"), dtype=buf.dtype), buf)

    monkeypatch.setattr(bl, "batched_rows", scatter_over_nan)
    check_pair("batched-torch", "batched-local", make_case(17, 6, 3, 50, 14, dtype))


@pytest.mark.parametrize("experts,pf", PAIRS)
@pytest.mark.parametrize("routing", ["one-expert", "few-experts"])
def test_skewed_routing(experts, pf, routing):
    check_pair(experts, pf, make_case(13, 12, 3, 24, 18, torch.float32, routing))


@pytest.mark.parametrize("experts,pf", PAIRS)
def test_zero_tokens(experts, pf):
    x, w13, w2, wts, ids = make_case(0, 8, 2, 16, 8, torch.float32)
    out = make_kernel(experts, pf).apply(x, w13, w2, wts, ids)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("experts,pf", PAIRS)
def test_expert_map_with_remote_experts(experts, pf):
    case = make_case(11, 10, 3, 24, 16, torch.float32)
    local = [0, 1, 2, 7]
    emap = torch.full((10,), -1, dtype=torch.int32)
    emap[local] = torch.arange(4, dtype=torch.int32)
    out = check_pair(experts, pf, case, expert_map=emap, local=local)
    # a token whose experts are all remote gets exactly zero
    x, w13, w2, wts, ids = case
    ids2 = ids.clone()
    ids2[0] = torch.tensor([3, 4, 5], dtype=torch.int32)
    out2 = make_kernel(experts, pf).apply(x, w13[local], w2[local], wts, ids2, expert_map=emap, num_experts=10)
    assert torch.count_nonzero(out2[0]) == 0
    assert out.abs().sum() > 0


def test_format_mismatch_refused_naming_both_halves():
    with pytest.raises(FormatMismatchError) as ei:
        make_kernel("torch", "batched-local")
    msg = str(ei.value)
    assert "batched-local" in msg and "torch" in msg and "BatchedExperts" in msg and "Standard" in msg
    with pytest.raises(FormatMismatchError):
        make_kernel("batched-torch", "no-dpep")
    reason = check_combination("no-dpep", "batched-torch", "cpu")
    assert "format mismatch" in reason and "no-dpep" in reason and "batched-torch" in reason


def test_unknown_backend_lists_valid_names():
    with pytest.raises(MoebenchError, match="did you mean 'triton'.*valid:"):
        make_kernel("trition", "no-dpep")
    with pytest.raises(MoebenchError, match="valid: .*no-dpep"):
        make_kernel("torch", "nope")


def test_capability_reasons():
    assert check_combination("batched-local", "batched-torch", "cpu", world_size=2) is not None
    assert check_combination("no-dpep", "torch", "cpu") is None
    assert "does not run on cpu" in check_combination("no-dpep", "deepgemm", "cpu")


def test_weight_and_reduce_contiguous():
    out = torch.arange(12.0).reshape(2, 3, 2)
    w = torch.tensor([[1.0, 0.0, 2.0], [0.5, 0.5, 0.0]])
    got = TopKWeightAndReduceContiguous().apply(out, w, None)
    torch.testing.assert_close(got, torch.tensor([[8.0, 11.0], [7.0, 8.0]]))


def test_batched_slots_and_reduce():
    local = torch.tensor([[0, 2], [2, -1], [0, 1]])
    slot, counts = batched_slots(local, 3, max_tokens=3)
    assert counts.tolist() == [2, 1, 2]
    assert slot.tolist() == [[0, 6], [7, -1], [1, 3]]
    out = torch.arange(9 * 2, dtype=torch.float32).reshape(3, 3, 2)
    w = torch.tensor([[1.0, 1.0], [2.0, 5.0], [1.0, 0.5]])
    got = TopKWeightAndReduceBatched().apply(out, w, slot)
    exp = torch.stack([out[0, 0] + out[2, 0], 2 * out[2, 1], out[0, 1] + 0.5 * out[1, 0]])
    torch.testing.assert_close(got, exp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_batched_layout_in_triton_is_the_torch_one(dtype):
    # the batched layout's two Triton launches (rows into slots, the weighted sum back) against the
    # torch forms: pairs on another rank copy and add nothing, padding rows (NaN here) are never read
    from moebench.kernels.token_layout import scatter_to_batched
    from moebench.kernels.triton.batched_layout import TopKWeightAndReduceBatchedTriton, batched_rows

    g = torch.Generator().manual_seed(3)
    m, k, e, h = 7, 3, 8, 40
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    emap = torch.full((e,), -1)
    emap[2:7] = torch.arange(5)
    slot, counts = batched_slots(local_topk_ids(ids, emap), 5, m)
    assert (slot < 0).any()
    x = torch.randn(m, h, generator=g).to(dtype)
    got, want = batched_rows(x, slot, 5, m), scatter_to_batched(x, slot, 5, m)
    for j, n in enumerate(counts.tolist()):
        assert torch.equal(got[j, :n].view(torch.uint8), want[j, :n].view(torch.uint8))
    out = torch.randn(5, m, h, generator=g).to(torch.bfloat16)
    pad = torch.arange(m) >= counts.unsqueeze(1)
    out[pad] = float("nan")
    w = torch.rand(m, k, generator=g)
    tri = TopKWeightAndReduceBatchedTriton().apply(out, w, slot)
    assert torch.isfinite(tri.float()).all()
    assert torch.equal(tri, TopKWeightAndReduceBatched().apply(out, w, slot))


def test_sort_by_expert_positions():
    local = torch.tensor([[1, 0], [1, -1], [0, 1]])
    s = sort_by_expert(local, 2)
    assert s.counts.tolist() == [2, 3]
    assert s.offsets.tolist() == [2, 5]
    flat = local.reshape(-1)
    assert flat[s.order[:5]].tolist() == [0, 0, 1, 1, 1]
    assert s.pos[[0, 2, 5]].tolist() == [0, 1, 2]  # the three pairs of expert 1, in token order


def test_poison_catches_unwritten_output():
    with poisoned_outputs():
        buf = moebench.kernels.modular.alloc_output((2, 3), torch.float32, "cpu")
    assert torch.isnan(buf).all()
    ref = torch.ones(2, 3, dtype=torch.float64)
    assert relative_error(buf, ref) == float("inf")


def test_apply_marks_its_phases_for_a_runner():
    """FusedMoEKernel.apply enters dispatch, experts, combine in turn on the hook a runner passes;
    MoELayer's separate shared MLP counts as more experts; without a hook nothing changes."""
    import contextlib

    from moebench.kernels.layer import MoELayer
    from moebench.kernels.reference import reference_moe
    from moebench.routing import make_routing

    class Marks:
        def __init__(self):
            self.seen = []

        @contextlib.contextmanager
        def phase(self, name):
            self.seen.append(name)
            yield

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g)
    w13, w2 = torch.randn(4, 24, 16, generator=g) * 0.25, torch.randn(4, 16, 12, generator=g) * 0.3
    tw, ids = make_routing("uniform", 5, 4, 2, seed=1)
    for pf, ex in (("no-dpep", "torch"), ("batched-local", "batched-torch")):
        kernel, marks = make_kernel(ex, pf), Marks()
        out = kernel.apply(x, w13, w2, tw, ids, phases=marks)
        assert marks.seen == ["dispatch", "experts", "combine"]
        assert torch.equal(out, kernel.apply(x, w13, w2, tw, ids))
        assert relative_error(out, reference_moe(x, w13, w2, tw, ids)) < 1e-4
    sw13, sw2 = torch.randn(1, 24, 16, generator=g) * 0.25, torch.randn(1, 16, 12, generator=g) * 0.3
    marks = Marks()
    MoELayer(make_kernel("torch", "no-dpep"), shared_w13=sw13, shared_w2=sw2).apply(x, w13, w2, tw, ids, phases=marks)
    assert marks.seen == ["dispatch", "experts", "combine", "experts"]
