"""The modular MoE kernel: prepare/finalize (communication) + experts (GEMMs).

    FusedMoEKernel(prepare_finalize, experts).apply(x, w13, w2, topk_weights, topk_ids)
      1. prepare_finalize.prepare()  -> PrepareResult in the P/F's activation format
      2. experts.apply()             GEMM1 [+ b13] -> activation-and-mul -> GEMM2 [+ b2]
      3. prepare_finalize.finalize() combine + top-k weight-and-reduce -> (M, H)

Shapes use the same letters everywhere: M tokens on this rank, H hidden, I intermediate (per
rank), E global experts, E_local experts on this rank, K = topk.
Weights follow vLLM: w13 (E_local, 2I, H) = gate rows then up rows (interleaved, gate row 2j and
up row 2j + 1, for swigluoai: moebench.activation); w2 (E_local, H, I). Optional per-expert biases
(ExpertBias: b13 (E_local, 2I) in w13's row order, b2 (E_local, H)).
"""

from __future__ import annotations

import contextlib
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch

from moebench.activation import SILU, Activation
from moebench.errors import FormatMismatchError, UnsupportedError
from moebench.comm import CommOp, tp_allreduce
from moebench.quant import SCALES, ActQuant, QuantScheme, scheme_of


@dataclass(frozen=True)
class ExpertBias:
    """Per-expert biases of both GEMMs (gpt-oss): b13 (E_local, 2I) added to GEMM1's output before
    the activation, in w13's row order; b2 (E_local, H) added to each expert's GEMM2 output before
    the router weight. Under TP, b13 is sharded with w13's rows and b2 lives on rank 0 only (zeros
    elsewhere), so the all-reduce adds it once."""

    b13: torch.Tensor
    b2: torch.Tensor


class ActivationFormat(enum.Enum):
    """How activations reach the experts.

    STANDARD: (M, H) tokens plus topk_ids / topk_weights (M, K).
    BATCHED:  (E_local, max_tokens, H) plus expert_num_tokens (E_local,).
    """

    STANDARD = "Standard"
    BATCHED = "BatchedExperts"

    def __str__(self) -> str:
        return self.value


# ---------------------------------------------------------------------------------------------
# Output allocation with optional poisoning: in check mode every buffer a backend allocates for
# its output starts as NaN, so an element that a kernel forgets to write cannot pass the check.

_POISON = False


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True) -> Iterator[None]:
    """Within this context, `alloc_output` fills new buffers with NaN."""
    global _POISON
    old, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = old


def alloc_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Allocate an output buffer (uninitialised, or NaN inside `poisoned_outputs`)."""
    if _POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# What prepare hands to the experts.


@dataclass
class PrepareResult:
    """Activations in a P/F's format, plus what its finalize needs later.

    a:                 STANDARD (M', H); BATCHED (E_local, max_tokens, H)
    topk_ids:          STANDARD (M', K) global expert ids; None for BATCHED
    topk_weights:      STANDARD (M', K) float32; None for BATCHED
    expert_num_tokens: BATCHED (E_local,) int32 valid rows per expert; None for STANDARD
    expert_map:        (E,) int32 global -> local expert id, -1 when remote; None = all local
    num_experts:       E, the global number of experts
    handle:            private state of the P/F for finalize (slot maps, split sizes, ...)
    a_scale:           when `a` is quantised (float8_e4m3fn): float32 scales per row of `a`,
                       STANDARD (M', G), BATCHED (E_local, max_tokens, G); G = groups per row
                       (moebench.quant); None when `a` is not quantised
    quant:             the QuantScheme `a` was quantised with, or None
    out_dtype:         dtype of the layer's input x, which the experts' output keeps (set by
                       FusedMoEKernel; None = a's dtype)
    num_tokens:        BATCHED: tokens routed into the layer over all ranks (one rank: exact;
                       several: this rank's count x world), the token count the tuned-config
                       lookup keys on, as the STANDARD path keys on M'; None = unknown
    topk:              BATCHED: K, experts per token (with num_tokens: the mean rows per local
                       expert the default heuristic sizes tiles for); None = unknown
    """

    a: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None
    expert_num_tokens: torch.Tensor | None
    expert_map: torch.Tensor | None
    num_experts: int
    handle: Any = field(default=None)
    a_scale: torch.Tensor | None = None
    quant: QuantScheme | None = None
    out_dtype: torch.dtype | None = None
    num_tokens: int | None = None
    topk: int | None = None


# ---------------------------------------------------------------------------------------------
# Who applies the top-k weights and sums over k: exactly one side, once.


class TopKWeightAndReduce(ABC):
    """Turns the experts' output into the (M, H) weighted sum over k."""

    name: ClassVar[str]

    @abstractmethod
    def apply(self, out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor | None) -> torch.Tensor:
        """out: the experts' output; topk_weights (M, K); slot_map as the format needs (or None)."""


class TopKWeightAndReduceNoOp(TopKWeightAndReduce):
    """The experts already weighted and summed: out is (M, H)."""

    name = "noop"

    def apply(self, out, topk_weights, slot_map):
        return out


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    """out is (M, K, H) unweighted: multiply by topk_weights and sum over K."""

    name = "contiguous"

    def apply(self, out, topk_weights, slot_map):
        m, k, h = out.shape
        w = topk_weights.to(torch.float32).unsqueeze(-1)
        return (out.to(torch.float32) * w).sum(dim=1).to(out.dtype)


class TopKWeightAndReduceBatched(TopKWeightAndReduce):
    """out is (E_local, T, H) unweighted; slot_map (M, K) gives each (token, k) its flat row
    index e * T + t in out, or -1 when that expert is not here (contributes zero)."""

    name = "batched"

    def apply(self, out, topk_weights, slot_map):
        assert slot_map is not None
        e, t, h = out.shape
        flat = out.reshape(e * t, h)
        m, k = slot_map.shape
        valid = slot_map >= 0
        rows = flat.index_select(0, slot_map.clamp(min=0).reshape(-1)).reshape(m, k, h).to(torch.float32)
        # Remote pairs point at row 0 only to keep the gather static; that row may be unwritten
        # (NaN in check mode), so mask with where, not by multiplying with a zero weight.
        rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        w = topk_weights.to(torch.float32).unsqueeze(-1)
        return (rows * w).sum(dim=1).to(out.dtype)


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """The experts leave the choice to the prepare/finalize (its default reduce is used)."""

    name = "delegate"

    def apply(self, out, topk_weights, slot_map):
        raise RuntimeError("TopKWeightAndReduceDelegate must be resolved by the prepare/finalize")


# ---------------------------------------------------------------------------------------------
# The two halves. Each backend declares its capabilities as class attributes; the registry
# combines them (moebench.backends.check_combination) to say yes or no with a reason.


class PrepareAndFinalize(ABC):
    """Communication half: dispatch before the experts, combine after."""

    name: ClassVar[str]
    activation_format: ClassVar[ActivationFormat]
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    min_world_size: ClassVar[int] = 1
    max_world_size: ClassVar[int | None] = None
    needs_expert_parallel: ClassVar[bool] = False
    #: True when it moves tokens between ranks (each rank brings its own tokens: the DP path);
    #: False when tokens stay put (the TP path: same tokens on every rank, all-reduce after).
    communicates: ClassVar[bool] = False
    #: What one layer with it sends between ranks (moebench.comm.CommOp, in order): the
    #: communication model prices these, whether or not the backend can run on this machine.
    #: Tokens that stay put (TP) pay the all-reduce of the output when tp > 1.
    communication: ClassVar[tuple[CommOp, ...]] = tp_allreduce()
    #: How engines deploy it, for each engine that runs it: engine -> the flags that select it
    #: ("" = the engine's default); {} = no engine runs it (a layout over it is never recommended).
    engine_flags: ClassVar[dict[str, str]] = {}
    #: Engines overlap its dispatch / combine with the other micro-batch's experts (SGLang's
    #: two-batch overlap, vLLM's dual-batch overlap) and recommend it for this transport.
    overlaps: ClassVar[bool] = False
    #: fp8 scale kinds (moebench.quant.SCALES) prepare can quantise activations with, before
    #: any dispatch (so fp8 travels); () = it cannot quantise.
    supported_quant: ClassVar[tuple[str, ...]] = SCALES

    @classmethod
    def unavailable_reason(cls, device: str, world_size: int) -> str | None:
        """None when usable here, else why not (package missing, too few GPUs...)."""
        return None

    @abstractmethod
    def default_weight_and_reduce(self) -> TopKWeightAndReduce:
        """What this P/F does when the experts delegate."""

    @abstractmethod
    def prepare(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        num_local_experts: int,
        expert_map: torch.Tensor | None,
        quant: ActQuant | None = None,
    ) -> PrepareResult:
        """x (M, H), topk_weights (M, K) float32, topk_ids (M, K) global ids; num_experts = E
        (global), num_local_experts = E_local (w13.shape[0]); expert_map (E,) or None.
        quant: quantise x with this scheme before any dispatch (result a fp8 + a_scale)."""

    @abstractmethod
    def finalize(
        self,
        out: torch.Tensor,
        prep: PrepareResult,
        topk_weights: torch.Tensor,
        weight_and_reduce: TopKWeightAndReduce,
    ) -> torch.Tensor:
        """out: the experts' output for `prep`. Returns (M, H) in x's dtype."""

    def resolve(self, weight_and_reduce: TopKWeightAndReduce) -> TopKWeightAndReduce:
        if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
            return self.default_weight_and_reduce()
        return weight_and_reduce


class Experts(ABC):
    """GEMM half: GEMM1 over w13, SiLU(gate) * up, GEMM2 over w2."""

    name: ClassVar[str]
    activation_format: ClassVar[ActivationFormat]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: False for correctness-only backends (the float64 reference): never timed as a contender.
    timed: ClassVar[bool] = True
    #: GPU makers whose GPUs it runs on ("nvidia", "amd"): what a modeled experts time on a
    #: target GPU asks of it
    gpu_vendors: ClassVar[tuple[str, ...]] = ("nvidia", "amd")
    #: Quantisation kinds (moebench.quant.QUANT_KINDS: the fp8 scale kinds and the weight-only
    #: scheme names, `QuantScheme.kind`) the experts take quantised weights with; () = none.
    supported_quant: ClassVar[tuple[str, ...]] = ()
    #: With quantised weights: True = the experts want unquantised activations and quantise them
    #: themselves; False = prepare quantises (before dispatch) and hands over fp8 + scales.
    quantizes_input: ClassVar[bool] = False
    #: Activations (moebench.activation names) the experts compute between the GEMMs.
    supported_activations: ClassVar[tuple[str, ...]] = ("silu",)
    #: True when the experts add per-expert biases (ExpertBias) on both GEMMs.
    supports_bias: ClassVar[bool] = False
    #: Where the last call's tile config came from (a tuned file's entry, the default heuristic,
    #: explicit), for the result rows; None for backends without tile configs.
    last_config_source: str | None = None

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """None when usable here, else why not."""
        return None

    @classmethod
    def quant_unavailable_reason(cls, device: str, scheme: QuantScheme) -> str | None:
        """None when `scheme` (one of supported_quant) runs on `device`, else why not (a
        backend whose fp8 path needs particular hardware says so here)."""
        return None

    @classmethod
    def activation_unavailable_reason(cls, activation: Activation, bias: bool, quant: QuantScheme | None = None) -> str | None:
        """None when the experts compute `activation` (with biases when `bias`) on weights of
        `quant`, else why not (from the declared supported_activations / supports_bias; a backend
        with narrower combinations overrides this)."""
        if activation.name not in cls.supported_activations:
            return (f"experts '{cls.name}' do not compute activation {activation.name} "
                    f"(they compute {', '.join(cls.supported_activations)})")
        if bias and not cls.supports_bias:
            return f"experts '{cls.name}' do not add expert biases"
        return None

    def check_activation(self, activation: Activation, bias: ExpertBias | None, quant: QuantScheme | None = None) -> None:
        """Raise UnsupportedError when `apply` cannot run this activation / bias."""
        reason = self.activation_unavailable_reason(activation, bias is not None, quant)
        if reason is not None:
            raise UnsupportedError(reason)

    @abstractmethod
    def weight_and_reduce(self) -> TopKWeightAndReduce:
        """Which top-k weight-and-reduce the output of `apply` still needs."""

    @abstractmethod
    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor, *, activation: Activation = SILU,
              bias: ExpertBias | None = None) -> torch.Tensor:
        """w13 (E_local, 2I, H), w2 (E_local, H, I): tensors, or moebench.quant.QuantWeight with
        the same shapes when quantised (then prep.a is fp8 with prep.a_scale, unless the experts
        declare quantizes_input). activation: the function between the GEMMs (and w13's gate/up
        layout); bias: per-expert biases, or None. A backend refuses what it does not declare
        (`check_activation`).

        STANDARD: returns (M', H) when weight_and_reduce() is no-op, (M', K, H) for contiguous.
        BATCHED:  returns (E_local, max_tokens, H), unweighted.
        """


class _NoPhases:
    """The phase hook of a call nobody times."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield


NO_PHASES = _NoPhases()


class FusedMoEKernel:
    """prepare -> experts -> finalize. Final: plug halves in, do not subclass."""

    def __init__(self, prepare_finalize: PrepareAndFinalize, experts: Experts):
        pf_fmt, ex_fmt = prepare_finalize.activation_format, experts.activation_format
        if pf_fmt != ex_fmt:
            raise FormatMismatchError(
                f"prepare/finalize '{prepare_finalize.name}' produces {pf_fmt} activations but experts "
                f"'{experts.name}' expect {ex_fmt}; pair '{prepare_finalize.name}' with a {pf_fmt} "
                f"experts backend"
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    @property
    def name(self) -> str:
        return f"{self.prepare_finalize.name}+{self.experts.name}"

    def check_quant(self, w13, w2) -> QuantScheme | None:
        """The weights' QuantScheme (None = unquantised); refuses a pair that cannot run it."""
        quant = scheme_of(w13)
        if scheme_of(w2) != quant:
            raise UnsupportedError("w13 and w2 must be quantised with the same scheme (or both not at all)")
        if quant is None:
            return None
        if quant.kind not in self.experts.supported_quant:
            raise UnsupportedError(f"experts '{self.experts.name}' do not support {quant.describe()}")
        if quant.weight_only:
            return quant  # activations stay unquantised: nothing for prepare to do
        if not self.experts.quantizes_input and quant.scales not in self.prepare_finalize.supported_quant:
            raise UnsupportedError(
                f"prepare/finalize '{self.prepare_finalize.name}' cannot quantise activations as {quant.describe()}"
            )
        return quant

    def prepare(self, x, w13, w2, topk_weights, topk_ids, expert_map=None, num_experts=None) -> PrepareResult:
        """Step 1 alone (arguments as `apply`): the P/F's prepare, quantising x there when the
        weights are quantised and the experts do not quantise their input themselves."""
        if num_experts is None:
            num_experts = expert_map.shape[0] if expert_map is not None else w13.shape[0]
        quant = self.check_quant(w13, w2)
        # Which side quantises the activations is the experts' declaration, never a guess.
        pf_quant = (None if quant is None or quant.weight_only or self.experts.quantizes_input
                    else ActQuant(quant, w13.input_scale))
        prep = self.prepare_finalize.prepare(
            x, topk_weights, topk_ids, num_experts, w13.shape[0], expert_map, quant=pf_quant
        )
        prep.out_dtype = x.dtype
        return prep

    def apply(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        num_experts: int | None = None,
        *,
        activation: Activation = SILU,
        bias: ExpertBias | None = None,
        phases=None,
    ) -> torch.Tensor:
        """x (M, H), w13 (E_local, 2I, H), w2 (E_local, H, I), topk_* (M, K) -> (M, H).

        expert_map (E,) maps global to local expert ids (-1 = remote); num_experts is the global E
        (defaults to w13.shape[0] when there is no expert_map). activation / bias: the experts'
        function and per-expert biases (moebench.activation, ExpertBias). phases: where a runner
        times the three steps - an object whose `phase(name)` is a context manager, entered as
        "dispatch", "experts" and "combine" in turn (moebench.runtime.rank_case.PhaseTimer).
        """
        marks = phases if phases is not None else NO_PHASES
        self.experts.check_activation(activation, bias, scheme_of(w13))
        with marks.phase("dispatch"):
            prep = self.prepare(x, w13, w2, topk_weights, topk_ids, expert_map, num_experts)
        with marks.phase("experts"):
            if activation == SILU and bias is None:  # the plain layer: any backend's apply(prep, w13, w2)
                out = self.experts.apply(prep, w13, w2)
            else:
                out = self.experts.apply(prep, w13, w2, activation=activation, bias=bias)
        with marks.phase("combine"):
            war = self.prepare_finalize.resolve(self.experts.weight_and_reduce())
            return self.prepare_finalize.finalize(out, prep, topk_weights, war)
