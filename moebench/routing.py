"""Routers and synthetic routing.

Routers turn router logits (M, E) into `topk_weights (M, K)` float32 and `topk_ids (M, K)` int32:
`softmax_topk` (Mixtral, Qwen, gpt-oss) and `grouped_topk` / `sigmoid_grouped_topk` (DeepSeek).

Synthetic routing (`--routing`) draws topk ids from a chosen distribution so that load balance is
a controlled input of a benchmark:

    uniform    every token picks K distinct experts uniformly at random
    zipf:S     expert popularity follows a Zipf law with exponent S > 0 (rank r gets weight r^-S,
               ranks assigned to experts by a seeded permutation); K distinct picks per token
    hot:F      a fraction F (0 < F <= 1) of the tokens send one of their K picks to one hot
               expert; all other picks are uniform over the other experts
    file:PATH  topk ids saved from a real run: .json (list of lists), .npy (no pickle) or .pt
               (weights_only); tiled or truncated to M tokens

Group-limited routing (`groups=(n_group, topk_group)`, what a grouped router such as DeepSeek-V3's
imposes): the experts split into n_group equal contiguous groups; each token keeps the topk_group
groups holding its best draws and picks its K experts inside them (uniform, zipf and hot draw
their keys as above; a file's ids are a real run's and are kept as they are). With one group per
node this is node-limited routing (DeepSeek-V3 on 64 GPUs: each token reaches at most 4 nodes).

Every token's K ids are distinct. Weights are a softmax over random normal logits of the chosen
experts (so they sum to 1 per token), sorted descending along K as a router would emit them.
Everything is drawn on the CPU from a seeded generator, so the same seed gives the same routing
on any device.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import warnings
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from moebench.errors import MoebenchError

ROUTING_FORMS = "uniform, zipf:S (S > 0), hot:F (0 < F <= 1), file:PATH (.json, .npy or .pt topk ids)"


# ---------------------------------------------------------------------------------------------
# Routers.


def _check_logits(logits: torch.Tensor, topk: int) -> tuple[int, int]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise MoebenchError(f"router logits must be a 2-D tensor (M, E), got {getattr(logits, 'shape', type(logits))}")
    m, e = logits.shape
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= e:
        raise MoebenchError(f"topk must be an integer from 1 to the number of experts {e}, got {topk!r}")
    return m, e


def softmax_topk(logits: torch.Tensor, topk: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, then the K largest probabilities.

    logits: (M, E). Returns topk_weights (M, K) float32 (renormalised to sum 1 per token when
    `renormalize`) and topk_ids (M, K) int32, largest weight first.
    """
    _check_logits(logits, topk)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


def grouped_topk(
    logits: torch.Tensor,
    topk: int,
    n_group: int,
    topk_group: int,
    renormalize: bool = True,
    scoring: str = "sigmoid",
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k (DeepSeek-V2/V3): experts are split into `n_group` equal groups; each token
    keeps its best `topk_group` groups and picks its K experts inside them.

    logits: (M, E); bias: (E,) score-correction bias (DeepSeek-V3 `e_score_correction_bias`),
    used only to choose experts, never in the weights. A group's score is the sum of its two best
    biased scores when a bias is given (V3, noaux_tc), else its best score (V2).
    Returns topk_weights (M, K) float32 = the unbiased scores of the chosen experts (renormalised
    when asked) and topk_ids (M, K) int32.
    """
    m, e = _check_logits(logits, topk)
    if scoring not in ("softmax", "sigmoid"):
        raise MoebenchError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or e % n_group:
        raise MoebenchError(f"n_group must be a positive integer dividing the number of experts {e}, got {n_group!r}")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise MoebenchError(f"topk_group must be an integer from 1 to n_group {n_group}, got {topk_group!r}")
    per_group = e // n_group
    if topk > topk_group * per_group:
        raise MoebenchError(f"topk {topk} exceeds the {topk_group * per_group} experts of the {topk_group} kept groups")
    scores = torch.sigmoid(logits.float()) if scoring == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    choice = scores
    if bias is not None:
        if bias.shape != (e,):
            raise MoebenchError(f"router bias must have shape ({e},), got {tuple(bias.shape)}")
        choice = scores + bias.to(device=scores.device, dtype=torch.float32)
    grouped = choice.view(m, n_group, per_group)
    if bias is not None and per_group >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (M, n_group)
    else:
        group_scores = grouped.max(dim=-1).values  # (M, n_group)
    keep = torch.topk(group_scores, topk_group, dim=-1).indices  # (M, topk_group)
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    expert_mask = group_mask.unsqueeze(-1).expand(m, n_group, per_group).reshape(m, e)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(masked, topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    topk: int,
    n_group: int,
    topk_group: int,
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 router: sigmoid scores, grouped top-k (see `grouped_topk`).

    logits: (M, E), bias: (E,) or None. Returns (M, K) float32 weights and (M, K) int32 ids.
    """
    return grouped_topk(logits, topk, n_group, topk_group, renormalize, scoring="sigmoid", bias=bias)


def route(logits: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The router a `moebench.models.MoEShape` describes (plain or grouped, softmax or sigmoid).

    logits: (M, E). Returns topk_weights (M, K) float32, topk_ids (M, K) int32.
    """
    if shape.grouped:
        return grouped_topk(logits, shape.topk, shape.n_group, shape.topk_group, shape.renormalize, shape.scoring)
    if shape.scoring == "sigmoid":
        _check_logits(logits, shape.topk)
        vals, ids = torch.topk(logits.float(), shape.topk, dim=-1)
        w = torch.sigmoid(vals)
        if shape.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(torch.float32), ids.to(torch.int32)
    return softmax_topk(logits, shape.topk, shape.renormalize)


# ---------------------------------------------------------------------------------------------
# Synthetic routing specs.


@dataclass(frozen=True)
class RoutingSpec:
    """A parsed --routing value. kind: uniform | zipf | hot | file; param: S or F; path: file."""

    kind: str
    param: float | None = None
    path: str | None = None

    def __str__(self) -> str:
        if self.kind == "file":
            return f"file:{self.path}"
        if self.param is None:
            return self.kind
        return f"{self.kind}:{self.param:g}"


def parse_routing(spec: str | RoutingSpec) -> RoutingSpec:
    """Parse `uniform`, `zipf:S`, `hot:F` or `file:PATH`; anything else is a MoebenchError
    listing the valid forms."""
    if isinstance(spec, RoutingSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise MoebenchError(f"--routing needs a value; valid forms: {ROUTING_FORMS}")
    text = spec.strip()
    kind, sep, arg = text.partition(":")
    kind = kind.strip().lower()
    if kind == "uniform" and not sep:
        return RoutingSpec("uniform")
    if kind == "file":
        path = arg.strip()
        if not path:
            raise MoebenchError(f"--routing {text!r}: file: needs a path, e.g. file:ids.npy; valid forms: {ROUTING_FORMS}")
        return RoutingSpec("file", path=path)
    if kind in ("zipf", "hot") and sep:
        try:
            value = float(arg)
        except ValueError:
            value = float("nan")
        if kind == "zipf" and math.isfinite(value) and value > 0:
            return RoutingSpec("zipf", param=value)
        if kind == "hot" and math.isfinite(value) and 0 < value <= 1:
            return RoutingSpec("hot", param=value)
        rule = "S must be a number > 0" if kind == "zipf" else "F must be a number with 0 < F <= 1"
        raise MoebenchError(f"--routing {text!r}: {rule}; valid forms: {ROUTING_FORMS}")
    raise MoebenchError(f"--routing {text!r} is not understood; valid forms: {ROUTING_FORMS}")


def _check_sizes(m: int, e: int, topk: int) -> None:
    for name, v, lo in (("tokens", m, 0), ("num_experts", e, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise MoebenchError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= e:
        raise MoebenchError(f"topk must be an integer from 1 to the number of experts {e}, got {topk!r}")


def _distinct_by_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """(M, E) random keys -> (M, K) int64: the K experts with the largest keys (distinct)."""
    return torch.topk(keys, k, dim=-1).indices


def _gumbel(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=gen).clamp_(min=1e-30)
    return -torch.log((-torch.log(u)).clamp_(min=1e-30))


def make_routing(
    spec: str | RoutingSpec,
    num_tokens: int,
    num_experts: int,
    topk: int,
    seed: int | None = 0,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    groups: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic routing for M = num_tokens tokens; `groups` = (n_group, topk_group) limits each
    token to its best topk_group of n_group expert groups (see the module docstring).

    Returns topk_weights (M, K) float32 (softmax of random logits over the K picks, descending,
    summing to 1) and topk_ids (M, K) int32 with K distinct ids per token in [0, E).
    Deterministic for a given `seed` (or CPU `generator`, which takes precedence).
    Works for M = 0 (two (0, K) tensors).
    """
    rs = parse_routing(spec)
    m, e = num_tokens, num_experts
    _check_sizes(m, e, topk)
    if groups is not None:
        _check_groups(groups, e, topk)
    if generator is None:
        generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    limit = (lambda keys: keys) if groups is None else (lambda keys: _group_limit(keys, *groups))  # noqa: E731

    if rs.kind == "uniform":
        ids = _distinct_by_keys(limit(torch.rand((m, e), generator=generator)), topk)
    elif rs.kind == "zipf":
        # Plackett-Luce sampling without replacement: top-K of log p + Gumbel noise.
        ranks = torch.randperm(e, generator=generator).to(torch.float32) + 1.0  # expert -> popularity rank
        logp = -float(rs.param) * torch.log(ranks)
        ids = _distinct_by_keys(limit(logp.unsqueeze(0) + _gumbel((m, e), generator)), topk)
    elif rs.kind == "hot" and groups is not None:
        ids = _hot_group_ids(float(rs.param), m, e, topk, generator, groups)
    elif rs.kind == "hot":
        ids = _hot_ids(float(rs.param), m, e, topk, generator)
    elif rs.kind == "file":
        ids = load_topk_ids(rs.path, e, topk, m)
    else:  # pragma: no cover - parse_routing only makes the kinds above
        raise MoebenchError(f"routing kind {rs.kind!r} is not understood; valid forms: {ROUTING_FORMS}")

    logits = torch.randn((m, topk), generator=generator)
    weights = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
    return weights.to(device=device, dtype=torch.float32), ids.to(device=device, dtype=torch.int32)


def _check_groups(groups, e: int, topk: int) -> None:
    n_group, topk_group = groups
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or e % n_group:
        raise MoebenchError(f"n_group must be a positive integer dividing the number of experts {e}, got {n_group!r}")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise MoebenchError(f"topk_group must be an integer from 1 to n_group {n_group}, got {topk_group!r}")
    if topk > topk_group * (e // n_group):
        raise MoebenchError(f"topk {topk} exceeds the {topk_group * (e // n_group)} experts of {topk_group} kept "
                            f"groups of {e // n_group}")


def _group_limit(keys: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """keys (M, E) with -inf outside each token's topk_group groups of largest best key (the
    grouped router's rule on the draw)."""
    m, e = keys.shape
    grouped = keys.view(m, n_group, e // n_group)
    keep = torch.topk(grouped.amax(dim=-1), topk_group, dim=-1).indices
    mask = torch.zeros(m, n_group, dtype=torch.bool).scatter_(1, keep, True)
    return keys.masked_fill(~mask.unsqueeze(-1).expand_as(grouped).reshape(m, e), float("-inf"))


def _hot_group_ids(frac: float, m: int, e: int, topk: int, gen: torch.Generator, groups) -> torch.Tensor:
    """`_hot_ids` under a group limit: the hot tokens' hot expert draws the largest key (its group
    is kept), the other tokens never draw it."""
    hot = int(torch.randint(e, (1,), generator=gen))
    n_hot = min(m, int(round(frac * m)))
    keys = torch.rand((m, e), generator=gen)
    if topk < e:
        keys[:, hot] = -1.0
        if n_hot:
            keys[torch.randperm(m, generator=gen)[:n_hot], hot] = 2.0
    return _distinct_by_keys(_group_limit(keys, *groups), topk)


def _hot_ids(frac: float, m: int, e: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """(M, K) int64: round(F * M) tokens (a seeded random subset) include one seeded hot expert
    at a random position among their K picks; all other picks avoid the hot expert when that is
    possible (topk < E), so exactly those tokens reach it."""
    hot = int(torch.randint(e, (1,), generator=gen))
    n_hot = min(m, int(round(frac * m)))
    keys = torch.rand((m, e), generator=gen)
    if topk < e:
        keys[:, hot] = -1.0  # never chosen as a uniform pick
    ids = _distinct_by_keys(keys, topk)
    if n_hot and topk < e:
        rows = torch.randperm(m, generator=gen)[:n_hot]
        pos = torch.randint(topk, (n_hot,), generator=gen)
        ids[rows, pos] = hot
    return ids


# ---------------------------------------------------------------------------------------------
# Routing from a file of saved topk ids.


def _read_ids_file(path: str) -> np.ndarray | torch.Tensor | list:
    """Read a .json/.npy/.pt file of topk ids without executing anything in it."""
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        raise MoebenchError(f"routing file {path!r} is a folder: give the .json, .npy or .pt file of topk ids after file:")
    if not os.path.isfile(path):
        raise MoebenchError(f"routing file {path!r} does not exist: check the path after file:")
    if ext == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MoebenchError(f"routing file {path!r} is not valid JSON ({e.__class__.__name__}): save topk ids as a list of lists") from None
        if isinstance(data, dict):
            if "topk_ids" not in data:
                raise MoebenchError(f"routing file {path!r} is a JSON object without a 'topk_ids' key: save a list of lists of ids")
            data = data["topk_ids"]
        return data
    if ext == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
            first = str(e).splitlines()[0] if str(e) else e.__class__.__name__
            raise MoebenchError(
                f"routing file {path!r} is not a plain .npy array ({first}); pickled objects are refused: "
                "save an integer array with numpy.save"
            ) from None
        if not isinstance(arr, np.ndarray):
            raise MoebenchError(f"routing file {path!r} is an .npz archive, not an .npy array: save one array with numpy.save")
        return arr
    if ext == ".pt":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. torch's note on the pickle protocol of the file
                obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError... for bad files
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise MoebenchError(
                f"routing file {path!r} cannot be loaded with weights_only=True ({first[:160]}): "
                "save a tensor or {'topk_ids': tensor} with torch.save"
            ) from None
        if isinstance(obj, dict):
            if "topk_ids" not in obj:
                raise MoebenchError(f"routing file {path!r} holds a dict without a 'topk_ids' key: save {{'topk_ids': tensor}}")
            obj = obj["topk_ids"]
        if not isinstance(obj, torch.Tensor):
            raise MoebenchError(f"routing file {path!r} holds a {type(obj).__name__}, not a tensor of topk ids")
        return obj
    raise MoebenchError(f"routing file {path!r}: unsupported extension {ext or '(none)'!r}; use .json, .npy or .pt")


def _to_int_tensor(data: np.ndarray | torch.Tensor | list, path: str) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.dtype == torch.bool or data.is_floating_point() or data.is_complex():
            raise MoebenchError(f"routing file {path!r}: topk ids must be integers, got dtype {data.dtype}")
        return data.to(torch.int64)
    if isinstance(data, np.ndarray):
        if data.dtype.kind not in "iu":
            raise MoebenchError(f"routing file {path!r}: topk ids must be integers, got dtype {data.dtype}")
        return torch.from_numpy(data.astype(np.int64))
    # JSON: a list of equal-length lists of ints.
    if not isinstance(data, list) or not all(isinstance(r, list) for r in data):
        raise MoebenchError(f"routing file {path!r}: expected a list of lists of expert ids (M, K)")
    if data and len({len(r) for r in data}) != 1:
        raise MoebenchError(f"routing file {path!r}: rows have different lengths; every token needs the same K ids")
    for r in data:
        for v in r:
            if isinstance(v, bool) or not isinstance(v, int):
                raise MoebenchError(f"routing file {path!r}: topk ids must be integers, found {v!r}")
    if not data:
        return torch.empty((0, 0), dtype=torch.int64)
    return torch.tensor(data, dtype=torch.int64)


def load_topk_ids(path: str, num_experts: int, topk: int, num_tokens: int) -> torch.Tensor:
    """Saved topk ids (M', K) from `path`, checked, then tiled or truncated to num_tokens rows.

    Checks: 2-D, K == topk, M' >= 1, ids in [0, E), no expert twice in one row.
    Returns (num_tokens, K) int64 on the CPU.
    """
    _check_sizes(num_tokens, num_experts, topk)
    ids = _to_int_tensor(_read_ids_file(path), path)
    if ids.dim() != 2:
        raise MoebenchError(f"routing file {path!r}: topk ids must be 2-D (tokens, topk), got shape {tuple(ids.shape)}")
    if ids.shape[0] == 0:
        raise MoebenchError(f"routing file {path!r} holds no tokens: save at least one row of topk ids")
    if ids.shape[1] != topk:
        raise MoebenchError(f"routing file {path!r} has {ids.shape[1]} ids per token but topk is {topk}: use a file saved with topk {topk}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise MoebenchError(f"routing file {path!r} has expert id {bad}, outside [0, {num_experts}): use a file for a model with {num_experts} experts")
    if topk > 1:
        s = ids.sort(dim=1).values
        dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
        if bool(dup.any()):
            row = int(dup.nonzero()[0, 0])
            raise MoebenchError(f"routing file {path!r}: token {row} picks the same expert twice ({ids[row].tolist()}); ids in a row must be distinct")
    reps = -(-num_tokens // ids.shape[0]) if num_tokens else 0
    return ids.repeat(reps, 1)[:num_tokens] if reps else ids[:0]


# ---------------------------------------------------------------------------------------------
# Load balance.


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many (token, k) picks each expert receives. topk_ids: (M, K); ids of -1
    (expert not present, e.g. after an expert_map) are ignored."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = flat[flat >= 0]
    if flat.numel() and int(flat.max()) >= num_experts:
        raise MoebenchError(f"topk id {int(flat.max())} is outside [0, {num_experts})")
    return torch.bincount(flat.cpu(), minlength=num_experts)


def load_imbalance(topk_ids: torch.Tensor, num_experts: int) -> float:
    """max / mean tokens per expert: 1.0 when perfectly balanced, E / K when all tokens go to the
    same K experts. Defined as 1.0 when there are no tokens."""
    counts = tokens_per_expert(topk_ids, num_experts)
    total = int(counts.sum())
    if total == 0:
        return 1.0
    return float(counts.max()) / (total / num_experts)


def rank_imbalance(topk_ids: torch.Tensor, expert_owner: torch.Tensor, world: int) -> tuple[torch.Tensor, float]:
    """Expert-parallel load: (token, k) picks handled by each rank, and their max / mean.

    topk_ids: (M, K) global expert ids; expert_owner: (E,) rank owning each expert (as
    `ParallelLayout.expert_owner`); world: number of EP ranks.
    Returns (world,) int64 counts and max/mean (1.0 with no tokens).
    """
    per_expert = tokens_per_expert(topk_ids, expert_owner.numel())
    owner = expert_owner.to(torch.int64).cpu()
    if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= world):
        raise MoebenchError(f"expert_owner holds a rank outside [0, {world})")
    counts = torch.zeros(world, dtype=torch.int64).index_add_(0, owner, per_expert)
    total = int(counts.sum())
    return counts, (float(counts.max()) / (total / world) if total else 1.0)
