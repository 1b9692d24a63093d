import pytest
import torch

from moebench.errors import MoebenchError
from moebench.inputs import make_weights
from moebench.layout import ParallelLayout


def test_sizes_tp_and_ep():
    tp8 = ParallelLayout.from_args(tp=8, dp=None, ep=None)
    assert (tp8.world_size, tp8.moe_tp_size, tp8.ep_size, tp8.use_all2all) == (8, 8, 1, False)
    ep8 = ParallelLayout.from_args(tp=None, dp=None, ep=8)
    assert (ep8.dp, ep8.tp, ep8.ep_size, ep8.moe_tp_size, ep8.use_all2all) == (8, 1, 8, 1, True)
    ep_tp = ParallelLayout.from_args(tp=2, dp=None, ep=8)
    assert (ep_tp.dp, ep_tp.tp, ep_tp.use_all2all) == (4, 2, True)
    # dp without EP: MoE is TP over all dp*tp ranks (vLLM's flattening), no all2all
    dp_only = ParallelLayout.from_args(tp=2, dp=2, ep=None)
    assert (dp_only.moe_tp_size, dp_only.use_all2all) == (4, False)
    # EP over tp ranks only (dp == 1): expert parallel, but no all2all kernels
    ep_tp_only = ParallelLayout.from_args(tp=4, dp=1, ep=4)
    assert ep_tp_only.enable_ep and not ep_tp_only.use_all2all


@pytest.mark.parametrize("args,msg", [
    ((2, 2, 8, None), "must equal"),
    ((3, None, 8, None), "not a multiple"),
    ((None, None, 4, 8), "does not match"),
    ((0, None, None, None), "positive"),
])
def test_layout_errors(args, msg):
    with pytest.raises(MoebenchError, match=msg):
        ParallelLayout.from_args(*args)


def test_validate_shape():
    ParallelLayout(tp=4).validate_shape(8, 14336)
    with pytest.raises(MoebenchError, match="does not divide"):
        ParallelLayout(tp=3).validate_shape(8, 14336)
    with pytest.raises(MoebenchError, match="larger than the number of experts"):
        ParallelLayout(tp=1, dp=16, enable_ep=True).validate_shape(8, 14336)


def test_linear_placement_remainder_to_first_ranks():
    lay = ParallelLayout(dp=4, enable_ep=True)
    assert [len(lay.local_experts(r, 10)) for r in range(4)] == [3, 3, 2, 2]
    assert [lay.local_experts(r, 10).start for r in range(4)] == [0, 3, 6, 8]
    assert [len(lay.local_experts(r, 60)) for r in range(4)] == [15] * 4
    owner = lay.expert_owner(10)
    assert owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    m = lay.expert_map(2, 10)
    assert m.dtype == torch.int32
    assert m.tolist() == [-1] * 6 + [0, 1] + [-1, -1]
    assert ParallelLayout(tp=4).expert_map(0, 10) is None


def test_tp_shards_recombine_to_full_layer():
    """Column-parallel w13 and row-parallel w2: summing the ranks' partial outputs gives the full one."""
    from moebench.kernels.reference import reference_moe

    e, h, i, m, k = 4, 12, 8, 5, 2
    w13, w2 = make_weights(range(e), h, i, torch.float64, "cpu", seed=3)
    x = torch.randn(m, h, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)])
    wts = torch.rand(m, k)
    full = reference_moe(x, w13, w2, wts, ids)
    lay = ParallelLayout(tp=4)
    parts = []
    for r in range(4):
        a, b = lay.shard_weights(w13, w2, r)
        assert a.shape == (e, 2 * i // 4, h) and b.shape == (e, h, i // 4)
        parts.append(reference_moe(x, a, b, wts, ids))
    torch.testing.assert_close(sum(parts), full)


def test_ep_shards_whole_experts():
    w13, w2 = make_weights(range(10), 6, 4, torch.float32, "cpu", seed=1)
    lay = ParallelLayout(dp=4, enable_ep=True)
    a, b = lay.shard_weights(w13, w2, 1)
    torch.testing.assert_close(a, w13[3:6])
    torch.testing.assert_close(b, w2[3:6])
    # weights generated for a subset equal the slice of the full weights
    c, d = make_weights(range(3, 6), 6, 4, torch.float32, "cpu", seed=1)
    torch.testing.assert_close(c, a)
    torch.testing.assert_close(d, b)
