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

import torch

from moebench.activation import SILU, Activation
from moebench.errors import MoebenchError
from moebench.kernels.modular import NO_PHASES, ExpertBias, FusedMoEKernel
from moebench.kernels.reference import act_and_mul
from moebench.quant import scheme_of

SHARED_MODES = ("none", "fused", "separate")


def fused_count(shared_intermediate: int, intermediate: int) -> int:
    """S: the shared MLP as S experts of the routed size; an error when it does not split evenly."""
    if shared_intermediate % intermediate:
        raise MoebenchError(f"shared experts fused: the shared MLP's intermediate {shared_intermediate} is not a multiple "
                            f"of the routed experts' {intermediate}; use --shared-experts separate")
    return shared_intermediate // intermediate


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


