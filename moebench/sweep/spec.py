"""What a sweep asks for: the SweepSpec (shape, token counts, layout, backends, precision, how to
check and time) and the names it is given."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moebench.activation import SILU, Activation
from moebench.backends import experts_names, get_experts_class, get_prepare_finalize_class, prepare_finalize_names
from moebench.inputs import dtype_name
from moebench.layout import ParallelLayout
from moebench.models import MoEShape
from moebench.quant import QuantScheme, precision_text


@dataclass
class SweepSpec:
    shape: MoEShape
    tokens: list[int]
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    experts: list[str] = field(default_factory=lambda: default_experts())
    prepare_finalize: list[str] = field(default_factory=lambda: prepare_finalize_names())
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    routing: str = "uniform"
    seed: int = 0
    check: bool = True
    warmup: int | None = None
    reps: int | None = None
    #: Distinct routings the timed calls cycle through (1 = the checked routing every call). With
    #: N > 1 every CUDA-graph replay runs N different routings, as vLLM's tuner does, so hot
    #: experts' weights do not stay in L2 from one call to the next.
    routings: int = 1
    #: False: `tokens` are per rank (a DP rank brings M tokens, M * world in all). True: `tokens`
    #: are the whole batch, split over the DP ranks (how tp-vs-ep compares equal work).
    tokens_are_global: bool = False
    #: fp8 scheme (weights and activations quantised; `dtype` is then the activation and output
    #: dtype); None = unquantised.
    quant: QuantScheme | None = None
    #: the experts' activation and biases (moebench.activation; from the model unless overridden)
    activation: Activation = SILU
    bias: bool = False
    #: the shared experts' form in the timed layer: "none", "fused" or "separate" (moebench.kernels.layer)
    shared: str = "none"
    #: simulated runs: the communication comes from the model (every declared transport is a
    #: candidate, whether or not it runs here); model_experts: the experts time is the target
    #: GPU's floor too (the experts need not run here)
    model_comm: bool = False
    model_experts: bool = False
    #: the GPU a modeled experts time speaks of (its datasheet's name)
    target_gpu: str = ""
    #: what each case times: "" the whole layer, other names registered variants
    #: (moebench.sweep.variants), each a row of its own
    variants: list[str] = field(default_factory=lambda: [""])
    #: its rows check correctness only (ResultRow.check_only): a stand-in shape's check of modeled rows
    check_only: bool = False
    #: the backends' classes by name, resolved once when the spec is built: every part of a run
    #: takes them from here (an unknown name is refused now, with the valid ones)
    experts_classes: dict = field(init=False, repr=False, compare=False)
    pf_classes: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.experts_classes = {n: get_experts_class(n) for n in self.experts}
        self.pf_classes = {n: get_prepare_finalize_class(n) for n in self.prepare_finalize}

    @property
    def dtype_label(self) -> str:
        """The `dtype` column: 'fp8_w8a8' for quantised runs, else 'bf16' / 'fp16' / 'fp32'."""
        return self.quant.name if self.quant is not None else dtype_name(self.dtype)

    @property
    def quant_label(self) -> str:
        """The `quant` column: 'per-tensor', 'per-token', 'block[128,128]' or ''."""
        return self.quant.scales_label if self.quant is not None else ""

    @property
    def precision(self) -> str:
        """'bf16', or 'fp8_w8a8 block[128,128] (bf16 activations)'."""
        return precision_text(dtype_name(self.dtype), self.quant)

    @property
    def act_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def batch_tokens(self, m: int, moves_tokens: bool) -> int:
        """Tokens of the whole batch for a case of `m` tokens."""
        if moves_tokens and not self.tokens_are_global:
            return m * self.layout.world_size
        return m

    def timing_kwargs(self) -> dict:
        """The timer's warm-up and timed calls: 3 and 50 on a GPU; 3 timed on a CPU, after no
        warm-up where the case is checked (the checked call, on the same inputs just before, is
        the warm-up) and after one where it is not."""
        if self.device == "cuda":
            return {"warmup": self.warmup or 3, "reps": self.reps or 50}
        warmup = self.warmup if self.warmup is not None else 0 if self.check else 1
        return {"warmup": warmup, "reps": self.reps or 3}


def default_experts() -> list[str]:
    """Every experts backend that competes (the float64 reference only checks)."""
    return [n for n in experts_names() if n != "reference"]


def resolve_names(value: str, valid: list[str], kind: str, default: list[str]) -> list[str]:
    """'all' or a comma list -> names, each checked against the registry."""
    if value in ("all", "", None):
        return list(default)
    names = [v.strip() for v in value.split(",") if v.strip()]
    getter = get_experts_class if kind == "experts" else get_prepare_finalize_class
    for n in names:
        if n not in valid:
            getter(n)  # raises the "unknown ..., valid: ..." error with a suggestion
    return names
