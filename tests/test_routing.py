"""Routers, synthetic routing distributions, routing files, load imbalance."""

import json
import pickle

import numpy as np
import pytest
import torch

from moebench.errors import MoebenchError
from moebench.models import get_model
from moebench.routing import (
    RoutingSpec,
    grouped_topk,
    load_imbalance,
    make_routing,
    parse_routing,
    rank_imbalance,
    route,
    sigmoid_grouped_topk,
    softmax_topk,
    tokens_per_expert,
)


def _assert_valid(w, ids, m, e, k):
    assert w.shape == (m, k) and ids.shape == (m, k)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    if m:
        assert int(ids.min()) >= 0 and int(ids.max()) < e
        s = ids.sort(dim=1).values
        assert bool((s[:, 1:] != s[:, :-1]).all()), "an expert appears twice for one token"
        torch.testing.assert_close(w.sum(dim=1), torch.ones(m), atol=1e-5, rtol=0)
        assert bool((w > 0).all())


# -- routers ----------------------------------------------------------------------------------


def test_softmax_topk_matches_manual():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    w, ids = softmax_topk(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(w, torch.stack([p[0, [1, 2]], p[1, [2, 3]]]))
    w2, _ = softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w2.sum(-1), torch.ones(2))
    torch.testing.assert_close(w2[0, 0] / w2[0, 1], p[0, 1] / p[0, 2])
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    with pytest.raises(MoebenchError, match="topk"):
        softmax_topk(logits, 5)


def test_sigmoid_grouped_topk_stays_in_best_groups():
    torch.manual_seed(0)
    m, e, n_group, topk_group, k = 64, 32, 8, 2, 4
    logits = torch.randn(m, e)
    bias = torch.randn(e) * 0.1
    w, ids = sigmoid_grouped_topk(logits, k, n_group, topk_group, renormalize=True, bias=bias)
    _assert_valid(w, ids, m, e, k)
    scores = torch.sigmoid(logits)
    biased = (scores + bias).view(m, n_group, e // n_group)
    best_groups = biased.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    for t in range(m):
        groups = set((ids[t] // (e // n_group)).tolist())
        assert groups <= set(best_groups[t].tolist())
    # Weights are the unbiased sigmoid scores, renormalised.
    raw = scores.gather(1, ids.long())
    torch.testing.assert_close(w, raw / raw.sum(-1, keepdim=True))


def test_grouped_topk_one_group_equals_plain_topk():
    logits = torch.randn(16, 12)
    w, ids = grouped_topk(logits, 3, 1, 1, renormalize=True, scoring="softmax")
    w2, ids2 = softmax_topk(logits, 3, renormalize=True)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2)
    with pytest.raises(MoebenchError, match="n_group"):
        grouped_topk(logits, 3, 5, 1)


def test_route_follows_the_shape():
    shape = get_model("deepseek-v3")
    w, ids = route(torch.randn(10, shape.E), shape)
    _assert_valid(w, ids, 10, shape.E, shape.K)
    shape = get_model("mixtral-8x7b")
    w, ids = route(torch.randn(10, shape.E), shape)
    _assert_valid(w, ids, 10, shape.E, shape.K)


# -- specs ------------------------------------------------------------------------------------


def test_parse_routing_forms():
    assert parse_routing("uniform") == RoutingSpec("uniform")
    assert parse_routing("zipf:1.5") == RoutingSpec("zipf", 1.5)
    assert parse_routing("hot:1") == RoutingSpec("hot", 1.0)
    assert parse_routing("file:/tmp/x.npy") == RoutingSpec("file", path="/tmp/x.npy")
    assert str(parse_routing("zipf:1.5")) == "zipf:1.5"


@pytest.mark.parametrize("bad", ["", "random", "zipf", "zipf:0", "zipf:-1", "zipf:abc", "hot:0", "hot:1.5",
                                 "hot:nan", "file:", "uniform:3"])
def test_parse_routing_rejects_bad_specs(bad):
    with pytest.raises(MoebenchError, match="uniform, zipf:S"):
        parse_routing(bad)


# -- synthetic distributions --------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["uniform", "zipf:1.2", "hot:0.3", "hot:1"])
@pytest.mark.parametrize("m,e,k", [(1, 8, 2), (257, 60, 4), (100, 6, 6), (50, 1, 1)])
def test_distributions_give_valid_distinct_ids(spec, m, e, k):
    w, ids = make_routing(spec, m, e, k, seed=3)
    _assert_valid(w, ids, m, e, k)
    assert bool((w[:, :-1] >= w[:, 1:]).all())  # descending along K


@pytest.mark.parametrize("spec", ["uniform", "zipf:1.0", "hot:0.5"])
def test_zero_tokens(spec):
    w, ids = make_routing(spec, 0, 16, 4, seed=0)
    assert w.shape == (0, 4) and ids.shape == (0, 4)
    assert load_imbalance(ids, 16) == 1.0
    assert tokens_per_expert(ids, 16).tolist() == [0] * 16


def test_determinism_per_seed():
    for spec in ("uniform", "zipf:1.1", "hot:0.4"):
        a = make_routing(spec, 300, 64, 8, seed=7)
        b = make_routing(spec, 300, 64, 8, seed=7)
        c = make_routing(spec, 300, 64, 8, seed=8)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[1], c[1])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(make_routing("uniform", 50, 16, 2, generator=g1)[1], make_routing("uniform", 50, 16, 2, generator=g2)[1])


def test_zipf_is_more_imbalanced_than_uniform():
    m, e, k = 4096, 64, 4
    uni = load_imbalance(make_routing("uniform", m, e, k, seed=1)[1], e)
    z1 = load_imbalance(make_routing("zipf:1.0", m, e, k, seed=1)[1], e)
    z2 = load_imbalance(make_routing("zipf:2.0", m, e, k, seed=1)[1], e)
    assert 1.0 <= uni < 1.3
    assert z1 > 2 * uni
    assert z2 > z1


def test_hot_fraction_reaches_one_expert():
    m, e, k, f = 2000, 32, 4, 0.3
    _, ids = make_routing(f"hot:{f}", m, e, k, seed=2)
    counts = tokens_per_expert(ids, e)
    hot = int(counts.argmax())
    tokens_on_hot = int((ids == hot).any(dim=1).sum())
    assert abs(tokens_on_hot / m - f) < 0.01
    # Every other expert gets about the uniform share of the remaining picks.
    others = torch.cat([counts[:hot], counts[hot + 1:]]).float()
    assert abs(float(others.mean()) - (m * k - tokens_on_hot) / (e - 1)) < 1e-6 * m
    _, ids_all = make_routing("hot:1", m, e, k, seed=2)
    assert int(tokens_per_expert(ids_all, e).max()) == m


def test_make_routing_bad_sizes():
    with pytest.raises(MoebenchError, match="topk"):
        make_routing("uniform", 4, 8, 9)
    with pytest.raises(MoebenchError, match="tokens"):
        make_routing("uniform", -1, 8, 2)
    with pytest.raises(MoebenchError, match="valid forms"):
        make_routing("gauss", 4, 8, 2)


# -- routing files ------------------------------------------------------------------------------

IDS = [[0, 3], [2, 1], [3, 0]]


def test_file_json_npy_pt_tile_and_truncate(tmp_path):
    (tmp_path / "ids.json").write_text(json.dumps(IDS))
    np.save(tmp_path / "ids.npy", np.array(IDS, dtype=np.int16))
    torch.save(torch.tensor(IDS), tmp_path / "ids.pt")
    torch.save({"topk_ids": torch.tensor(IDS, dtype=torch.int32)}, tmp_path / "dict.pt")
    (tmp_path / "dict.json").write_text(json.dumps({"topk_ids": IDS}))
    for name in ("ids.json", "ids.npy", "ids.pt", "dict.pt", "dict.json"):
        w, ids = make_routing(f"file:{tmp_path / name}", 7, 4, 2, seed=0)
        _assert_valid(w, ids, 7, 4, 2)
        assert ids.tolist() == (IDS * 3)[:7], name
        w, ids = make_routing(f"file:{tmp_path / name}", 2, 4, 2)
        assert ids.tolist() == IDS[:2]
        w, ids = make_routing(f"file:{tmp_path / name}", 0, 4, 2)
        assert ids.shape == (0, 2)


class _Evil:
    def __reduce__(self):
        return (print, ("pickle code ran",))


def test_file_refuses_pickles_and_impostors(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([[_Evil(), 1]], dtype=object), allow_pickle=True)
    with pytest.raises(MoebenchError, match="pickled objects are refused"):
        make_routing(f"file:{tmp_path / 'obj.npy'}", 4, 4, 2)
    (tmp_path / "text.npy").write_text("0 1\n2 3\n")
    with pytest.raises(MoebenchError, match="not a plain .npy"):
        make_routing(f"file:{tmp_path / 'text.npy'}", 4, 4, 2)
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(MoebenchError, match="weights_only"):
        make_routing(f"file:{tmp_path / 'evil.pt'}", 4, 4, 2)
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(MoebenchError, match="weights_only"):
        make_routing(f"file:{tmp_path / 'text.pt'}", 4, 4, 2)
    torch.save({"other": torch.zeros(2, 2)}, tmp_path / "nokey.pt")
    with pytest.raises(MoebenchError, match="topk_ids"):
        make_routing(f"file:{tmp_path / 'nokey.pt'}", 4, 4, 2)
    (tmp_path / "bad.json").write_text("[[0, 1], [2")
    with pytest.raises(MoebenchError, match="not valid JSON"):
        make_routing(f"file:{tmp_path / 'bad.json'}", 4, 4, 2)
    (tmp_path / "ids.csv").write_text("0,1\n")
    with pytest.raises(MoebenchError, match="unsupported extension"):
        make_routing(f"file:{tmp_path / 'ids.csv'}", 4, 4, 2)
    with pytest.raises(MoebenchError, match="does not exist"):
        make_routing(f"file:{tmp_path / 'nope.npy'}", 4, 4, 2)


@pytest.mark.parametrize("data,match", [
    ([[0, 1, 2], [1, 2, 3]], "ids per token but topk is 2"),
    ([[0, 4], [1, 2]], "outside"),
    ([[0, -1], [1, 2]], "outside"),
    ([[1, 1], [0, 2]], "same expert twice"),
    ([[0, 1], [2]], "different lengths"),
    ([[0.0, 1.5]], "integers"),
    ([[True, False]], "integers"),
    ([], "no tokens"),
    ([1, 2], "list of lists"),
])
def test_file_content_checks_json(tmp_path, data, match):
    p = tmp_path / "ids.json"
    p.write_text(json.dumps(data))
    with pytest.raises(MoebenchError, match=match):
        make_routing(f"file:{p}", 4, 4, 2)


def test_file_content_checks_arrays(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros((3, 2), dtype=np.float32))
    with pytest.raises(MoebenchError, match="integers"):
        make_routing(f"file:{tmp_path / 'f.npy'}", 4, 4, 2)
    np.save(tmp_path / "1d.npy", np.arange(4))
    with pytest.raises(MoebenchError, match="2-D"):
        make_routing(f"file:{tmp_path / '1d.npy'}", 4, 4, 2)
    torch.save(torch.tensor([[0, 9]]), tmp_path / "range.pt")
    with pytest.raises(MoebenchError, match="outside"):
        make_routing(f"file:{tmp_path / 'range.pt'}", 4, 4, 2)


# -- imbalance ---------------------------------------------------------------------------------


def test_imbalance_measures():
    ids = torch.tensor([[0, 1], [0, 2], [0, 3]])
    assert tokens_per_expert(ids, 4).tolist() == [3, 1, 1, 1]
    assert load_imbalance(ids, 4) == pytest.approx(3 / 1.5)
    balanced = torch.tensor([[0, 1], [2, 3]])
    assert load_imbalance(balanced, 4) == 1.0
    owner = torch.tensor([0, 0, 1, 1])
    counts, ratio = rank_imbalance(ids, owner, 2)
    assert counts.tolist() == [4, 2] and ratio == pytest.approx(4 / 3)
    counts, ratio = rank_imbalance(torch.empty(0, 2, dtype=torch.int32), owner, 2)
    assert counts.tolist() == [0, 0] and ratio == 1.0
    with pytest.raises(MoebenchError):
        tokens_per_expert(torch.tensor([[0, 4]]), 4)


@pytest.mark.parametrize("spec", ["uniform", "zipf:1.2", "hot:0.5"])
def test_group_limited_routing_keeps_each_token_in_its_groups(spec):
    """groups=(n_group, topk_group): every token's experts lie in at most topk_group of the n_group
    contiguous groups (DeepSeek-V3: 4 of 8), and more than one group combination occurs."""
    _, ids = make_routing(spec, 512, 64, 6, seed=3, groups=(8, 3))
    per_token = [set((row // 8).tolist()) for row in ids.long()]
    assert max(len(g) for g in per_token) <= 3
    assert len({frozenset(g) for g in per_token}) > 10
    assert all(len(set(row.tolist())) == 6 for row in ids)
    if spec.startswith("hot"):
        hot = int(torch.mode(ids.reshape(-1)).values)
        assert int((ids == hot).any(dim=1).sum()) == 256  # the hot tokens keep the hot expert's group
    with pytest.raises(MoebenchError, match="n_group"):
        make_routing(spec, 4, 60, 2, groups=(8, 3))
    with pytest.raises(MoebenchError, match="exceeds"):
        make_routing(spec, 4, 64, 9, groups=(8, 1))
