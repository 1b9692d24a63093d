"""The experts' activation: which function sits between GEMM1 and GEMM2, and how w13's output
holds its gate and up halves. Plain data (no kernels): the reference, the torch experts and the
Triton kernels read the same frozen `Activation`.

| name        | w13 output (2I columns)                  | h (I columns)                                   |
|-------------|------------------------------------------|-------------------------------------------------|
| `silu`      | [gate | up] (halves)                     | silu(gate) * up                                 |
| `gelu`      | [gate | up] (halves)                     | gelu(gate) * up, exact (erf) GELU               |
| `swigluoai` | gate, up interleaved: even columns gate, | g = min(gate, limit), u = clamp(up, +-limit),   |
|             | odd columns up (gpt-oss's checkpoint)    | h = (u + 1) * g * sigmoid(alpha * g)            |

`swigluoai` is vLLM's name for gpt-oss's clamped SwiGLU (alpha 1.702, limit 7.0, as in
transformers' GptOssExperts). `gelu` is the exact form: what a config's `hidden_act: "gelu"`
means in transformers (ACT2FN["gelu"] is erf GELU) and what vLLM's MoE "gelu" computes; the tanh
approximations (`gelu_pytorch_tanh`, `gelu_new`, ...) are refused by name, never silently swapped.

Biases (gpt-oss): b13 (E, 2I) is added to GEMM1's output before the activation (in w13's column
order, so interleaved for swigluoai), b2 (E, H) to each expert's GEMM2 output before the router
weight multiplies it, as transformers' GptOssExperts and vLLM's fused MoE kernel add them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moebench.errors import MoebenchError

ACTIVATIONS = ("silu", "gelu", "swigluoai")
#: gpt-oss's clamped SwiGLU constants (transformers GptOssExperts: alpha 1.702, limit 7.0).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
#: config.json `hidden_act` values -> moebench's activation.
_HIDDEN_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu"}
#: hidden_act values that name a GELU moebench does not compute (the tanh approximations).
_GELU_APPROX = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python", "gelu_accurate", "quick_gelu")
#: model types whose experts run gpt-oss's clamped SwiGLU with biases.
_SWIGLUOAI_MODEL_TYPES = ("gpt_oss",)


@dataclass(frozen=True)
class Activation:
    """name: one of ACTIVATIONS; alpha, limit: swigluoai's constants (ignored by the others).

    kind: the kernels' constexpr (0 silu, 1 gelu, 2 swigluoai); interleaved: w13's gate and up
    columns alternate (swigluoai) instead of being two halves."""

    name: str = "silu"
    alpha: float = SWIGLUOAI_ALPHA
    limit: float = SWIGLUOAI_LIMIT

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise MoebenchError(f"unknown activation {self.name!r}; use one of {', '.join(ACTIVATIONS)}")
        for what, v in (("alpha", self.alpha), ("limit", self.limit)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise MoebenchError(f"activation {self.name}: {what} must be a positive number, got {v!r}")

    @property
    def kind(self) -> int:
        return ACTIVATIONS.index(self.name)

    @property
    def interleaved(self) -> bool:
        return self.name == "swigluoai"

    def describe(self) -> str:
        """'silu', 'gelu (exact)', 'swigluoai (alpha 1.702, limit 7)'."""
        if self.name == "swigluoai":
            return f"swigluoai (alpha {self.alpha:g}, limit {self.limit:g})"
        return "gelu (exact)" if self.name == "gelu" else self.name


SILU = Activation("silu")


def parse_activation(name: str | None) -> Activation | None:
    """`--activation silu|gelu|swigluoai` -> Activation; None/'' -> None (from the model)."""
    if not name:
        return None
    return Activation(name.strip().lower())


def activation_from_config(cfg: dict[str, Any], where: str = "config") -> tuple[Activation, bool]:
    """(the experts' activation, whether they carry biases) from a HuggingFace config dict:
    model_type gpt_oss -> swigluoai with biases (its `swiglu_limit` when given); else
    `hidden_act` (silu / swish / gelu; absent = silu); a GELU approximation is an error."""
    model_type = str(cfg.get("model_type") or cfg.get("_outer_model_type") or "")
    if model_type in _SWIGLUOAI_MODEL_TYPES:
        limit = cfg.get("swiglu_limit", SWIGLUOAI_LIMIT)
        return Activation("swigluoai", limit=float(limit)), True
    act = cfg.get("hidden_act")
    if act is None:
        return SILU, False
    act = str(act).lower()
    if act in _HIDDEN_ACT:
        return Activation(_HIDDEN_ACT[act]), False
    if act in _GELU_APPROX:
        raise MoebenchError(f"{where}: hidden_act {act!r} is a GELU approximation; moebench's gelu is the exact (erf) "
                            f"form: pass --activation gelu to time that instead")
    raise MoebenchError(f"{where}: hidden_act {act!r} is not supported; pass --activation {'|'.join(ACTIVATIONS)}")
