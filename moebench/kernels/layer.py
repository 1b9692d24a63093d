"""The whole MoE layer around a FusedMoEKernel: the experts' activation and biases, and the shared
experts, in one of two forms (both timed as part of the layer):

    fused      the shared MLP split into S = shared_intermediate / I experts of the routed size,
               appended to the routed experts; every token is routed to them too (top-k + S) with
               weight 1 (Qwen-MoE: its shared gate sigmoid(x @ g)), so one experts call does both
    separate   a dense MLP (GEMM, activation, GEMM) on the rank's own tokens, added to the routed
               output: torch matmuls for 16-bit / fp32 weights; fp8 weights run as a one-expert
               layer of moebench's Triton experts (the dense fp8 GEMMs moebench has)

Under EP the shared experts are replicated on every rank: each token's shared pairs stay on its
own rank (in the fused form they get ids E + rank * S + s, which only that rank's expert map holds).
Under TP they are sharded over I with the routed experts (each rank computes a partial sum, the
all-reduce adds them). The shared gate (Qwen2-MoE, Qwen3-Next) is an input of the layer like the
routing: computed with the router (one more output column of its GEMM), not timed.

Shapes: x (M, H); shared MLP w13 (1, 2Is, H), w2 (1, H, Is) with Is this rank's shared
intermediate (its gate/up layout follows the activation, as the routed w13's does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.activation import SILU, Activation
from moebench.errors import MoebenchError
from moebench.inputs import make_weights
from moebench.kernels.modular import NO_PHASES, ExpertBias, FusedMoEKernel
from moebench.kernels.reference import act_and_mul, reference_moe
from moebench.quant import quantize_weights, scheme_of

SHARED_MODES = ("none", "fused", "separate")
#: Seeds of the shared MLP's weights: expert ids far above any routed expert's.
_SHARED_SEED_ID = 1 << 20


def fused_count(shared_intermediate: int, intermediate: int) -> int:
    """S: the shared MLP as S experts of the routed size; an error when it does not split evenly."""
    if shared_intermediate % intermediate:
        raise MoebenchError(f"shared experts fused: the shared MLP's intermediate {shared_intermediate} is not a multiple "
                            f"of the routed experts' {intermediate}; use --shared-experts separate")
    return shared_intermediate // intermediate


@dataclass
class RankLayer:
    """One rank's weights of the layer, as the kernels take them.

    w13, w2: routed experts (E_local, 2I, H) / (E_local, H, I), plus the S fused shared experts
    appended (mode fused); quantised (QuantWeight) when the spec is. bias: ExpertBias or None.
    shared_w13 / shared_w2: the separate shared MLP (1, 2Is, H) / (1, H, Is), or None.
    unquantized: the same tuple unquantised (fp8 runs that keep them), for err_vs_unquantized."""

    w13: object
    w2: object
    bias: ExpertBias | None = None
    shared_w13: object = None
    shared_w2: object = None
    num_fused: int = 0
    mode: str = "none"
    unquantized: "RankLayer | None" = None


def _shared_shard(shape, mode: str, shard: tuple[int, int]) -> tuple[int, int]:
    """(rank, size) of the shared MLP's I shard, checked: the model has one and it splits evenly."""
    if not shape.shared_intermediate:
        raise MoebenchError(f"shared experts {mode}: model {shape.name!r} has none (use --shared-experts none)")
    if shape.shared_intermediate % shard[1]:
        raise MoebenchError(f"shared experts: intermediate {shape.shared_intermediate} does not split over {shard[1]} ranks")
    return shard


def _shared_weights(shape, dtype, device, seed, tp_rank, tp_size, interleaved):
    return make_weights([_SHARED_SEED_ID], shape.hidden, shape.shared_intermediate, dtype, device, seed,
                        tp_rank=tp_rank, tp_size=tp_size, interleaved=interleaved)


def fuse_shared(w13: torch.Tensor, w2: torch.Tensor, sw13: torch.Tensor, sw2: torch.Tensor,
                interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Routed (E_l, 2I, H) / (E_l, H, I) and a shared MLP (1, 2Is, H) / (1, H, Is) -> the routed
    experts with S = Is / I shared chunks appended (chunk c: intermediate columns c*I .. (c+1)*I
    of gate and of up, the matching columns of w2), and S."""
    i = w2.shape[-1]
    s = fused_count(sw2.shape[-1], i)
    g = sw13[0]
    if interleaved:  # rows 2j, 2j + 1 are column j's gate and up: chunks are contiguous row ranges
        chunks13 = g.reshape(s, 2 * i, g.shape[-1])
    else:
        gate, up = g[: s * i].reshape(s, i, -1), g[s * i :].reshape(s, i, -1)
        chunks13 = torch.cat([gate, up], dim=1)
    chunks2 = sw2[0].reshape(sw2.shape[1], s, i).permute(1, 0, 2)
    return torch.cat([w13, chunks13]), torch.cat([w2, chunks2.contiguous()]), s


def make_rank_layer(shape, e_list, dtype, device, seed, tp_rank, tp_size, activation: Activation, bias: bool,
                    mode: str, quant=None, keep_unquantized: bool = False,
                    shared_shard: tuple[int, int] | None = None) -> RankLayer:
    """One rank's RankLayer: the routed experts `e_list` (global ids; TP shard tp_rank of tp_size),
    biases (b2 on TP rank 0 only), the shared MLP in `mode` (its I shard shared_shard = (rank,
    size); default the routed experts' (tp_rank, tp_size)), quantised with `quant` (the fused
    shared experts with the routed ones, per expert)."""
    il = activation.interleaved
    w13, w2 = make_weights(e_list, shape.hidden, shape.intermediate, dtype, device, seed, tp_rank=tp_rank,
                           tp_size=tp_size, interleaved=il)
    b = make_biases(e_list, shape.hidden, shape.intermediate, dtype, device, seed, tp_rank, tp_size) if bias else None
    if il:
        b = interleave_bias(b)
    sw13 = sw2 = None
    s = 0
    if mode != "none":
        sr, ss = _shared_shard(shape, mode, shared_shard or (tp_rank, tp_size))
        sw13, sw2 = _shared_weights(shape, dtype, device, seed, sr, ss, il)
    if mode == "fused":
        w13, w2, s = fuse_shared(w13, w2, sw13, sw2, il)
        sw13 = sw2 = None
        if b is not None:  # the shared experts carry no biases
            b = ExpertBias(torch.cat([b.b13, b.b13.new_zeros((s, b.b13.shape[1]))]),
                           torch.cat([b.b2, b.b2.new_zeros((s, b.b2.shape[1]))]))
    plain = RankLayer(w13, w2, b, sw13, sw2, s, mode)
    if quant is None:
        return plain
    q13, q2 = quantize_weights(w13, w2, quant, dtype)
    qs13, qs2 = quantize_weights(sw13, sw2, quant, dtype) if sw13 is not None else (None, None)
    return RankLayer(q13, q2, b, qs13, qs2, s, mode, unquantized=plain if keep_unquantized else None)


def outline_rank_layer(shape, e_list, tp_rank: int, tp_size: int, bias: bool, mode: str,
                       shared_shard: tuple[int, int] | None = None) -> RankLayer:
    """make_rank_layer's shapes without its numbers: every tensor on the meta device (no memory,
    no time). What a run that models the experts time needs: the work (pairs, experts hit,
    weight bytes) follows from the shapes alone."""
    e, h = len(list(e_list)), shape.hidden
    i = shape.intermediate // tp_size
    meta = dict(device="meta", dtype=torch.bfloat16)
    b = ExpertBias(torch.empty((e, 2 * i), **meta), torch.empty((e, h), **meta)) if bias else None
    sw13 = sw2 = None
    s = 0
    if mode != "none":
        _, ss = _shared_shard(shape, mode, shared_shard or (tp_rank, tp_size))
        si = shape.shared_intermediate // ss
        sw13, sw2 = torch.empty((1, 2 * si, h), **meta), torch.empty((1, h, si), **meta)
    if mode == "fused":
        s = fused_count(sw2.shape[-1], i)
        e += s
        sw13 = sw2 = None
        if b is not None:
            b = ExpertBias(torch.empty((e, 2 * i), **meta), torch.empty((e, h), **meta))
    return RankLayer(torch.empty((e, 2 * i, h), **meta), torch.empty((e, h, i), **meta), b, sw13, sw2, s, mode)


def make_biases(experts, hidden: int, intermediate: int, dtype: torch.dtype, device: str, seed: int,
                tp_rank: int = 0, tp_size: int = 1) -> ExpertBias:
    """Biases of the given global experts, each from its own seed: b13 (E_l, 2I') sharded like
    w13's rows (TP: this rank's columns of gate and of up; in w13's column order, which the caller
    interleaves with the weights), b2 (E_l, H) on TP rank 0, zeros on the others (added once)."""
    experts = list(experts)
    ip = intermediate // tp_size
    lo, hi = tp_rank * ip, (tp_rank + 1) * ip
    b13 = torch.empty((len(experts), 2 * ip), dtype=dtype, device=device)
    b2 = torch.zeros((len(experts), hidden), dtype=dtype, device=device)
    for n, e in enumerate(experts):
        g = torch.Generator(device=device).manual_seed(seed * 1_000_033 + e + 7)
        full13 = torch.randn((2 * intermediate,), generator=g, device=device).mul_(0.5)
        full2 = torch.randn((hidden,), generator=g, device=device).mul_(0.5)
        b13[n, :ip], b13[n, ip:] = full13[lo:hi], full13[intermediate + lo : intermediate + hi]
        if tp_rank == 0:
            b2[n] = full2
    return ExpertBias(b13, b2)


def interleave_bias(bias: ExpertBias | None) -> ExpertBias | None:
    """b13 from halves [gate | up] to interleaved columns (gate j at 2j, up j at 2j + 1)."""
    if bias is None:
        return None
    i = bias.b13.shape[1] // 2
    return ExpertBias(torch.stack([bias.b13[:, :i], bias.b13[:, i:]], dim=-1).reshape(bias.b13.shape), bias.b2)


def shared_gate_values(x: torch.Tensor, seed: int) -> torch.Tensor:
    """(M,) float32 sigmoid(x @ g), g ~ N(0, 1/H) from `seed`: the shared gate of Qwen-MoE."""
    gen = torch.Generator(device=x.device).manual_seed(seed * 1_000_037 + 11)
    g = torch.randn((x.shape[1],), generator=gen, device=x.device).mul_(x.shape[1] ** -0.5)
    return torch.sigmoid(x.float() @ g)


def extend_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, num_shared: int,
                   gate: torch.Tensor | None = None, token_group: torch.Tensor | None = None):
    """(M, K) routing -> (M, K + S): each token also to shared experts num_experts + g * S + s
    (g = token_group[t], the rank owning the token under EP; 0 otherwise) with weight 1, or its
    gate value (M,)."""
    m = topk_ids.shape[0]
    dev = topk_ids.device
    base = torch.zeros(m, dtype=torch.int64, device=dev) if token_group is None else token_group.to(dev).long()
    ids = num_experts + base[:, None] * num_shared + torch.arange(num_shared, device=dev)[None, :]
    w = torch.ones((m, num_shared), dtype=topk_weights.dtype, device=dev)
    if gate is not None:
        w = w * gate.to(dev, topk_weights.dtype).reshape(m, 1)
    return torch.cat([topk_weights, w], dim=1), torch.cat([topk_ids.to(torch.int64), ids.to(topk_ids.dtype)], dim=1)


def extend_expert_map(expert_map: torch.Tensor | None, num_experts: int, e_local: int, num_shared: int,
                      group: int = 0, groups: int = 1) -> torch.Tensor | None:
    """The expert map over E + groups * S ids: the routed part as given, this rank's shared ids
    (group `group`) -> local e_local + s, other groups' -> -1. None stays None when groups == 1."""
    if expert_map is None and groups == 1:
        return None
    dev = expert_map.device if expert_map is not None else "cpu"
    routed = expert_map if expert_map is not None else torch.arange(num_experts, dtype=torch.int32, device=dev)
    shared = torch.full((groups * num_shared,), -1, dtype=routed.dtype, device=dev)
    shared[group * num_shared : (group + 1) * num_shared] = e_local + torch.arange(num_shared, dtype=routed.dtype, device=dev)
    return torch.cat([routed, shared])


def shared_mlp(x: torch.Tensor, sw13, sw2, activation: Activation = SILU, gate: torch.Tensor | None = None,
               config=None) -> torch.Tensor:
    """The separate shared MLP on x (M, H) -> (M, H) in x's dtype (times the gate (M,) when given):
    16-bit / fp32 weights as torch matmuls, fp8 weights (QuantWeight) as a one-expert layer of the
    Triton experts (every token to expert 0 with weight 1 or its gate)."""
    m = x.shape[0]
    if scheme_of(sw13) is not None:
        from moebench.kernels.triton.experts import fused_moe

        w = torch.ones((m, 1), dtype=torch.float32, device=x.device) if gate is None else \
            gate.to(x.device, torch.float32).reshape(m, 1)
        return fused_moe(x, sw13, sw2, w, torch.zeros((m, 1), dtype=torch.int64, device=x.device), config=config,
                         out_dtype=x.dtype, activation=activation)
    h = act_and_mul(x @ sw13[0].t(), activation)
    y = h @ sw2[0].t()
    if gate is not None:
        y = y * gate.to(y.dtype).reshape(m, 1)
    return y


def shared_reference(x: torch.Tensor, sw13, sw2, activation: Activation = SILU,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference of the separate shared MLP (through reference_moe: one expert, every
    token routed to it; fp8 weights with the kernels' rounding points)."""
    m = x.shape[0]
    w = torch.ones((m, 1), dtype=torch.float32, device=x.device) if gate is None else \
        gate.to(x.device, torch.float32).reshape(m, 1)
    return reference_moe(x, sw13, sw2, w, torch.zeros((m, 1), dtype=torch.int64, device=x.device), activation=activation)


class MoELayer:
    """A FusedMoEKernel with the layer's activation, biases and separate shared MLP: `apply` takes
    the kernel's arguments (routing already extended for fused shared experts) and returns (M, H).
    shared_rows: the rows of x whose tokens this rank owns (their shared MLP is computed here:
    the tokens of an EP rank), None = all."""

    def __init__(self, kernel: FusedMoEKernel, activation: Activation = SILU, bias: ExpertBias | None = None,
                 shared_w13=None, shared_w2=None, shared_gate: torch.Tensor | None = None,
                 shared_rows: slice | None = None):
        self.kernel = kernel
        self.experts = kernel.experts
        self.prepare_finalize = kernel.prepare_finalize
        self.activation = activation
        self.bias = bias
        self.shared_w13, self.shared_w2 = shared_w13, shared_w2
        self.shared_gate = shared_gate
        self.shared_rows = shared_rows

    @property
    def name(self) -> str:
        return self.kernel.name

    def apply(self, x, w13, w2, topk_weights, topk_ids, expert_map=None, num_experts=None, phases=None) -> torch.Tensor:
        """The kernel's apply (its phases under `phases`, FusedMoEKernel.apply), then the separate
        shared MLP, timed as more of the "experts" phase."""
        out = self.kernel.apply(x, w13, w2, topk_weights, topk_ids, expert_map, num_experts,
                                activation=self.activation, bias=self.bias, phases=phases)
        if self.shared_w13 is not None:
            with (phases if phases is not None else NO_PHASES).phase("experts"):
                rows = self.shared_rows or slice(None)
                out[rows] += shared_mlp(x[rows], self.shared_w13, self.shared_w2, self.activation,
                                        None if self.shared_gate is None else self.shared_gate[rows])
        return out


def layer_args(lw: RankLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               gate: torch.Tensor | None = None, expert_map: torch.Tensor | None = None, group: int = 0,
               groups: int = 1, token_group: torch.Tensor | None = None) -> tuple:
    """The kernel's arguments (x, w13, w2, topk_weights, topk_ids, expert_map, num_experts) for
    rank layer `lw`: with fused shared experts the routing extended by S slots (ids E + g * S + s,
    g = token_group of each token, this rank's group `group` of `groups`) and the expert map and
    expert count extended to match."""
    if lw.mode != "fused":
        return (x, lw.w13, lw.w2, topk_weights, topk_ids, expert_map, num_experts)
    s = lw.num_fused
    e_local = lw.w13.shape[0] - s
    tw, ids = extend_routing(topk_weights, topk_ids, num_experts, s, gate, token_group)
    emap = extend_expert_map(expert_map, num_experts, e_local, s, group, groups)
    if emap is not None:
        emap = emap.to(x.device)
    return (x, lw.w13, lw.w2, tw, ids, emap, num_experts + groups * s)


def layer_reference(lw: RankLayer, args: tuple, activation: Activation = SILU, gate: torch.Tensor | None = None,
                    shared_rows: slice | None = None) -> torch.Tensor:
    """float64 reference of the layer on `args` (from `layer_args`): the routed (and fused shared)
    experts, plus the separate shared MLP on `shared_rows` of x."""
    x, w13, w2, tw, ids, emap, _ = args
    ref = reference_moe(x, w13, w2, tw, ids, emap, activation=activation, bias=lw.bias)
    if lw.shared_w13 is not None:
        rows = shared_rows or slice(None)
        ref[rows] += shared_reference(x[rows], lw.shared_w13, lw.shared_w2, activation,
                                      None if gate is None else gate[rows])
    return ref


def layer_bytes_extra(lw: RankLayer, shape, hit: int, dtype_bytes: int | float, quant=None) -> float:
    """Bytes the layer moves beyond the routed experts hit: the separate shared MLP's weights
    (fused shared experts are among the experts hit) and the biases of the experts hit."""
    from moebench.bench.metrics import bias_bytes, expert_weight_bytes

    i = lw.w2.shape[-1]
    extra = bias_bytes(hit, shape.hidden, i, dtype_bytes) if lw.bias is not None else 0.0
    if lw.shared_w13 is not None:
        extra += expert_weight_bytes(shape.hidden, lw.shared_w2.shape[-1], dtype_bytes, quant)
    return extra
