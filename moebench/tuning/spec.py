"""A tuning run's settings (TuneSpec, saved in tune.json): what the tuner (moebench.tuning.tuner),
its candidates (moebench.tuning.candidates) and its compile workers (moebench.tuning.precompile)
share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from moebench.inputs import dtype_name, parse_dtype
from moebench.kernels.triton import configs as C
from moebench.layout import ParallelLayout
from moebench.models import MoEShape
from moebench.quant import WEIGHT_ONLY, QuantScheme, precision_text
from moebench.tuning.space import dtype_bytes
from moebench.kernels import tuned_files as TF


@dataclass
class TuneSpec:
    """Everything that decides what a tuning run measures (saved in tune.json for --resume).

    space: value lists per parameter (None = the full SPACE). reps / final_reps: timer
    repetitions of the screening and final stages (None = device default). quant: the fp8 scheme
    (moebench.quant.QuantScheme) of the weights, None for unquantised; `dtype` is then the
    activation dtype (bf16).
    """

    shape: MoEShape
    layout: ParallelLayout
    tokens: list[int]
    dtype: torch.dtype
    device: str
    strategy: str = "halving"
    budget: int | None = None
    seed: int = 0
    routing: str = "uniform"
    reps: int | None = None
    final_reps: int | None = None
    space: dict[str, list[int]] | None = None
    quant: QuantScheme | None = None
    down: bool = False  # tune GEMM2's own config (the `_down.json` file) against GEMM1's
    #: whose kernel is tuned: "moebench" (the `triton` experts, moebench's files) or an engine's
    #: ("vllm", "sglang": the engine's file name and folder; timed with `experts`)
    kernel: str = "moebench"
    #: files to beat (`tune --against FILE`): name -> {tokens: config}; at each token count the
    #: file's nearest entry seeds the search and competes in the final stage, so the winner is never
    #: slower than it there, and the report gives winner / file
    against: dict[str, dict[int, dict[str, int]]] | None = None

    def to_json(self) -> dict[str, Any]:
        shape = {k: v for k, v in self.shape.__dict__.items() if k != "aliases"}
        return {
            "shape": shape, "layout": {"tp": self.layout.tp, "dp": self.layout.dp, "enable_ep": self.layout.enable_ep},
            "tokens": list(self.tokens), "dtype": dtype_name(self.dtype), "device": self.device,
            "strategy": self.strategy, "budget": self.budget, "seed": self.seed, "routing": self.routing,
            "reps": self.reps, "final_reps": self.final_reps, "space": self.space,
            "quant": quant_to_json(self.quant), "down": self.down, "kernel": self.kernel,
            "against": None if self.against is None else {
                name: {str(t): dict(c) for t, c in table.items()} for name, table in self.against.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TuneSpec":
        return cls(
            shape=MoEShape(**d["shape"]), layout=ParallelLayout(**d["layout"]), tokens=[int(t) for t in d["tokens"]],
            dtype=parse_dtype(d["dtype"]), device=d["device"], strategy=d["strategy"], budget=d.get("budget"),
            seed=int(d.get("seed", 0)), routing=d.get("routing", "uniform"), reps=d.get("reps"),
            final_reps=d.get("final_reps"), space=d.get("space"), quant=quant_from_json(d.get("quant")),
            down=bool(d.get("down", False)), kernel=d.get("kernel", "moebench"),
            against=None if not d.get("against") else {
                name: {int(t): dict(c) for t, c in table.items()} for name, table in d["against"].items()},
        )

    @property
    def precision(self) -> str:
        """'bf16', or 'fp8_w8a8 block[128,128] (bf16 activations)'."""
        return precision_text(dtype_name(self.dtype), self.quant)

    @property
    def experts(self) -> str:
        """The experts backend the run times: `triton` (kernel moebench); for an engine, vLLM's own
        `vllm` where it imports on the GPU, else `vllm-triton` (engine_configs.engine_experts)."""
        if self.kernel == "moebench":
            return "triton"
        from moebench.kernels.engine_configs import engine_experts

        return engine_experts(self.kernel, self.device)

    @property
    def timed_text(self) -> str:
        """Which kernel the measurements timed, in words (report, metadata)."""
        if self.kernel == "moebench":
            return "moebench's `triton` experts"
        if self.experts == "vllm":
            from moebench.kernels.vllm_native import vllm_version

            return f"vLLM's own fused_experts (vllm {vllm_version()}) under its override_config"
        return (f"moebench's `vllm-triton` experts ({self.kernel}'s fused-MoE kernel structure, "
                f"moebench's implementation; {self.kernel} itself not run)")

    @property
    def elem_bytes(self) -> int:
        """Bytes per GEMM operand element (shared memory estimate): 1 for fp8; the activation
        dtype's for weight-only schemes (their A tiles are 16-bit; the packed B tiles are smaller,
        so the estimate is an upper bound)."""
        return 1 if self.quant is not None and not self.quant.weight_only else dtype_bytes(self.dtype)

    @property
    def local_experts(self) -> int:
        """E of the file name: experts on one rank (all of them without EP)."""
        return file_shape(self.shape, self.layout)[0]

    @property
    def inter_per_rank(self) -> int:
        """N of the file name: I / tp."""
        return file_shape(self.shape, self.layout)[1]

    def rivals(self, tokens: int) -> dict[str, dict[str, int]]:
        """Each --against file's entry at `tokens` (its nearest key, as the engines look it up)."""
        return {name: dict(TF.nearest_entry(table, tokens)[1]) for name, table in (self.against or {}).items()}

    def screen_reps(self) -> tuple[int, int]:
        cuda = torch.device(self.device).type == "cuda"
        return (self.reps or (20 if cuda else 2), self.final_reps or (50 if cuda else 3))

    def identity(self) -> dict[str, Any]:
        """The fields a resumed run must agree on."""
        d = self.to_json()
        d["shape"] = {k: d["shape"][k] for k in ("num_experts", "topk", "hidden", "intermediate")}
        return d


def quant_to_json(q: QuantScheme | None) -> dict[str, Any] | None:
    if q is None:
        return None
    d = {"name": q.name, "scales": q.scales, "block_shape": list(q.block_shape) if q.block_shape else None}
    if q.weight_only:
        d.update(group_size=q.group_size, zero_points=q.zero_points)
    return d


def quant_from_json(d: Mapping[str, Any] | None) -> QuantScheme | None:
    if not d:
        return None
    bs = d.get("block_shape")
    name = d.get("name", "fp8_w8a8")
    if name in WEIGHT_ONLY:
        return QuantScheme(name, group_size=d.get("group_size"), zero_points=bool(d.get("zero_points")))
    return QuantScheme(name, d["scales"], tuple(int(b) for b in bs) if bs else None)


def file_shape(shape: MoEShape, layout: ParallelLayout) -> tuple[int, int]:
    """(E, N) of the tuned-config file one rank of `layout` looks up: its local experts (all of
    them without EP) and I / tp."""
    e = len(layout.local_experts(0, shape.num_experts)) if layout.enable_ep else shape.num_experts
    return e, layout.intermediate_per_rank(shape.intermediate)


def gemm1_config(spec: TuneSpec, tokens: int) -> tuple[dict[str, int], str]:
    """GEMM1's config at `tokens` as the layer looks it up on spec.device (tuned file along the
    lookup order, else the default heuristic), and where it came from: what a `--down` run tunes
    GEMM2 against."""
    cfg, src = C.layer_config(
        tokens, local_experts=spec.local_experts, inter=spec.inter_per_rank, hidden=spec.shape.hidden,
        topk=spec.shape.topk, num_experts=spec.shape.num_experts, dtype=spec.dtype, folders=TF.config_search_dirs(),
        device_name=TF.device_name(spec.device), quant=spec.quant)
    return dict(cfg), src

