"""MoE layer shapes: presets from the models' public HuggingFace configs, a local config.json
reader, and validated custom shapes.

One table of presets (`PRESETS`) and one config reader; no per-model code branches. The shape is
what the MoE layer needs: E routed experts, top-k, hidden size H, expert intermediate size I
(the per-expert FFN width, `moe_intermediate_size` where a config has one), plus the router's
options (softmax or sigmoid scoring, grouped top-k, renormalisation), the experts' activation (and
biases: gpt-oss), the shared experts (one dense MLP beside the routed ones, timed with the layer:
moebench.kernels.layer) and the quantisation the checkpoint ships in (`quantization_config`).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from moebench.activation import ACTIVATIONS, SWIGLUOAI_LIMIT, activation_from_config
from moebench.errors import MoebenchError

SCORING_FUNCS = ("softmax", "sigmoid")


#: quantization_config quant_method values of GPTQ / AWQ checkpoints (integer weights, 16-bit activations).
_INT_WEIGHT_METHODS = ("gptq", "awq")
#: MX formats: one shared scale per 32 elements (OCP microscaling).
MX_BLOCK = 32


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint's expert weights ship (its config.json `quantization_config`), in
    moebench's dtype names: dtype "fp8_w8a8" (block_shape (bn, bk), or None: per-tensor scales),
    "mxfp4" (group_size 32), "int4_w4a16" / "int8_w8a16" (GPTQ / AWQ; group_size None = one scale
    per output channel; zero_points: asymmetric int4, GPTQ `sym: false` / AWQ `zero_point: true`).
    source: where it was read ("config.json", "preset")."""

    dtype: str
    block_shape: tuple[int, int] | None = None
    group_size: int | None = None
    source: str = "config.json"
    zero_points: bool = False

    def describe(self) -> str:
        """'fp8_w8a8 block[128,128]', 'fp8_w8a8 per-tensor', 'mxfp4', 'int4_w4a16 group 128'."""
        if self.dtype == "fp8_w8a8":
            return f"fp8_w8a8 block[{self.block_shape[0]},{self.block_shape[1]}]" if self.block_shape else "fp8_w8a8 per-tensor"
        if self.dtype == "mxfp4":
            return "mxfp4"
        text = f"{self.dtype} group {self.group_size}" if self.group_size else f"{self.dtype} per-channel"
        return text + (" zero points" if self.zero_points else "")


def quant_from_config(qc: Any, where: str = "config") -> CheckpointQuant | None:
    """A config.json's `quantization_config` dict -> CheckpointQuant (None when there is none).

    fp8 (`quant_method: fp8`) with `weight_block_size` [bn, bk] -> fp8_w8a8 block (DeepSeek-V3),
    without -> fp8_w8a8 per-tensor; `mxfp4` (gpt-oss) -> mxfp4; GPTQ / AWQ `bits` 4 or 8 with
    `group_size` (-1: per channel) -> int4_w4a16 / int8_w8a16. Anything else: MoebenchError naming it."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise MoebenchError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    override = "pass --dtype bf16 (or fp8_w8a8) to time the layer unquantised or in fp8"
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            return CheckpointQuant("fp8_w8a8")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(_is_int(b) and b > 0 for b in block)):
            raise MoebenchError(f"{where}: quantization_config.weight_block_size must be two positive integers, got {block!r}")
        return CheckpointQuant("fp8_w8a8", block_shape=(int(block[0]), int(block[1])))
    if method == "mxfp4":
        return CheckpointQuant("mxfp4", group_size=MX_BLOCK)
    if method in _INT_WEIGHT_METHODS:
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        if bits not in (4, 8):
            raise MoebenchError(f"{where}: {method} with bits {bits!r}; moebench times 4- and 8-bit weights: {override}")
        if group is not None and (not _is_int(group) or (group < 1 and group != -1)):
            raise MoebenchError(f"{where}: {method} group_size must be a positive integer or -1, got {group!r}")
        # asymmetric (a zero point per group): GPTQ `sym: false`, AWQ `zero_point` (its default: true)
        zp = qc.get("sym") is False if method == "gptq" else bool(qc.get("zero_point", method == "awq"))
        return CheckpointQuant("int4_w4a16" if bits == 4 else "int8_w8a16",
                               group_size=None if group in (None, -1) else int(group), zero_points=zp)
    raise MoebenchError(f"{where}: quantization_config quant_method {method or '(none)'!r} is not supported; {override}")


@dataclass(frozen=True)
class MoEShape:
    """The routed-expert part of one MoE layer.

    name:              preset name, or where the shape came from ("custom", a config's model id)
    num_experts:       E, routed experts
    topk:              K, experts per token
    hidden:            H, model hidden size (rows of x: (M, H))
    intermediate:      I, one expert's intermediate size: w13 (E, 2I, H), w2 (E, H, I)
    scoring:           "softmax" or "sigmoid" router scores
    renormalize:       top-k weights rescaled to sum to 1 per token
    n_group/topk_group: grouped top-k (DeepSeek): experts split into n_group groups, tokens pick
                       experts only from their best topk_group groups; None = plain top-k
    routed_scaling_factor: multiplier on the routed output (DeepSeek-V3: 2.5); 1.0 = none
    shared_experts:    count of always-on shared experts (DeepSeek's n_shared_experts; 1 for one shared MLP)
    shared_intermediate: intermediate size of the whole shared MLP (DeepSeek: n_shared_experts x
                       moe_intermediate_size; Qwen2-MoE: shared_expert_intermediate_size); 0 = none
    shared_gate:       the shared MLP's output is scaled per token by sigmoid(x @ shared_expert_gate)
                       (Qwen2-MoE, Qwen3-Next)
    activation:        the experts' activation (moebench.activation: silu, gelu, swigluoai)
    swiglu_limit:      swigluoai's clamp limit (gpt-oss: 7.0)
    expert_bias:       the experts carry biases on both GEMMs (gpt-oss)
    quantization:      how the checkpoint's expert weights ship (its quantization_config), or None
    hf_id:             the HuggingFace model id the numbers come from
    source:            URL of the config.json the numbers come from (or the local path)
    notes:             anything a user should know about this shape
    aliases:           other names get_model accepts for this preset
    deploy:            the usual serving layouts on 8-GPU H200/H100 nodes ("tp1", "tp8", "ep8", ...):
                       the shards for which moebench ships tuned configs (`moebench configs coverage`)
    """

    name: str
    num_experts: int
    topk: int
    hidden: int
    intermediate: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0
    shared_intermediate: int = 0
    shared_gate: bool = False
    activation: str = "silu"
    swiglu_limit: float = SWIGLUOAI_LIMIT
    expert_bias: bool = False
    quantization: CheckpointQuant | None = None
    hf_id: str = ""
    source: str = ""
    notes: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)
    deploy: tuple[str, ...] = field(default=("tp1",), compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    # Short names used in formulas and docstrings.
    @property
    def E(self) -> int:  # noqa: N802
        return self.num_experts

    @property
    def K(self) -> int:  # noqa: N802
        return self.topk

    @property
    def H(self) -> int:  # noqa: N802
        return self.hidden

    @property
    def I(self) -> int:  # noqa: N802,E743
        return self.intermediate

    @property
    def grouped(self) -> bool:
        """True when the router uses grouped top-k (n_group > 1)."""
        return self.n_group is not None and self.n_group > 1

    @property
    def router_groups(self) -> tuple[int, int] | None:
        """(n_group, topk_group) where the router limits each token to its best groups, else None:
        synthetic routing draws inside that limit (moebench.routing.make_routing `groups`)."""
        return (self.n_group, self.topk_group) if self.grouped else None

    def expert_params(self) -> int:
        """Parameters of all routed experts of one layer: E * 3 * H * I."""
        return self.num_experts * 3 * self.hidden * self.intermediate

    def describe(self) -> str:
        """One line: name (E, topk, H, I) and router."""
        router = self.scoring
        if self.grouped:
            router += f", grouped {self.topk_group}/{self.n_group}"
        if self.renormalize:
            router += ", renorm"
        return f"{self.name} (E={self.num_experts}, topk={self.topk}, H={self.hidden}, I={self.intermediate}; {router})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        return d


def config_name(path: str, model_type: str = "") -> str:
    """The name of a shape read from `path` without a `_name_or_path`: the file's name without
    .json (cfg/a.json -> "a"); for a file called config.json, its model_type, else its folder."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem and stem.lower() != "config":
        return stem
    return model_type or os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(s: MoEShape) -> None:
    """Raise MoebenchError naming the bad field of a shape."""
    what = f"model shape {s.name!r}" if s.name else "model shape"
    if s.source:
        what += f" (read from {s.source})"
    for fld, flag in (("num_experts", "--num-experts"), ("hidden", "--hidden"), ("intermediate", "--intermediate")):
        v = getattr(s, fld)
        if not _is_int(v) or v < 1:
            raise MoebenchError(f"{what}: {fld} ({flag}) must be a positive integer, got {v!r}")
    if not _is_int(s.topk) or not 1 <= s.topk <= s.num_experts:
        raise MoebenchError(
            f"{what}: topk (--topk) must be an integer from 1 to the number of experts {s.num_experts}, got {s.topk!r}"
        )
    if s.scoring not in SCORING_FUNCS:
        raise MoebenchError(f"{what}: scoring must be one of {', '.join(SCORING_FUNCS)}, got {s.scoring!r}")
    if (s.n_group is None) != (s.topk_group is None):
        raise MoebenchError(f"{what}: n_group and topk_group must be given together (got {s.n_group!r}, {s.topk_group!r})")
    if s.n_group is not None:
        if not _is_int(s.n_group) or s.n_group < 1 or s.num_experts % s.n_group:
            raise MoebenchError(
                f"{what}: n_group must be a positive integer dividing the number of experts {s.num_experts}, got {s.n_group!r}"
            )
        if not _is_int(s.topk_group) or not 1 <= s.topk_group <= s.n_group:
            raise MoebenchError(f"{what}: topk_group must be an integer from 1 to n_group {s.n_group}, got {s.topk_group!r}")
        if s.topk > s.topk_group * (s.num_experts // s.n_group):
            raise MoebenchError(
                f"{what}: topk {s.topk} is more than the {s.topk_group} selected groups of "
                f"{s.num_experts // s.n_group} experts can hold; lower topk or raise topk_group"
            )
    if s.activation not in ACTIVATIONS:
        raise MoebenchError(f"{what}: activation must be one of {', '.join(ACTIVATIONS)}, got {s.activation!r}")
    if not _is_int(s.shared_intermediate) or s.shared_intermediate < 0:
        raise MoebenchError(f"{what}: shared_intermediate must be a non-negative integer, got {s.shared_intermediate!r}")
    if not _is_int(s.shared_experts) or s.shared_experts < 0:
        raise MoebenchError(f"{what}: shared_experts must be a non-negative integer, got {s.shared_experts!r}")
    if not isinstance(s.routed_scaling_factor, (int, float)) or isinstance(s.routed_scaling_factor, bool) or not (
        math.isfinite(s.routed_scaling_factor) and s.routed_scaling_factor > 0
    ):
        raise MoebenchError(f"{what}: routed_scaling_factor must be a positive number, got {s.routed_scaling_factor!r}")


def checkpoint_scheme(cq: CheckpointQuant):
    """The moebench.quant.QuantScheme that times a checkpoint's quantisation; a MoebenchError
    naming the dtype when moebench.quant does not know it."""
    from moebench.quant import QUANT_DTYPES, QuantScheme

    where = "the preset's checkpoint" if cq.source == "preset" else f"the checkpoint's quantization_config ({cq.source})"
    if cq.dtype not in QUANT_DTYPES:
        raise MoebenchError(f"{where} is {cq.describe()}, a dtype this moebench does not time ({cq.dtype} is not one of "
                            f"{', '.join(QUANT_DTYPES)}): pass --dtype bf16 or --dtype fp8_w8a8 to time it otherwise")
    if cq.dtype == "fp8_w8a8":
        if cq.block_shape is not None:
            return QuantScheme(cq.dtype, "block", tuple(cq.block_shape))
        return QuantScheme(cq.dtype, "tensor")
    from moebench.quant import parse_quant

    # int4_w4a16 with the checkpoint's group size and zero points; int8_w8a16 (symmetric per
    # channel) and mxfp4 with their own scales
    int4 = cq.dtype == "int4_w4a16"
    if cq.zero_points and not int4:
        raise MoebenchError(f"{where} is {cq.describe()}; moebench times zero points with int4_w4a16 only: "
                            f"pass --dtype {cq.dtype} to time it symmetric")
    try:
        return parse_quant(cq.dtype, group_size=cq.group_size if int4 else None, zero_points=int4 and cq.zero_points)
    except MoebenchError as e:
        raise MoebenchError(f"{where} is {cq.describe()}, which moebench cannot time as stored ({e}); "
                            f"pass --dtype to choose the precision") from None


# ---------------------------------------------------------------------------------------------
# Presets: values from each model's config.json on the HuggingFace Hub (the URL in `source`).

_HF = "https://huggingface.co/{}/blob/main/config.json"


def _preset(name: str, hf_id: str, E: int, topk: int, H: int, I: int, aliases: tuple[str, ...] = (), **kw: Any) -> MoEShape:  # noqa: E741,N803
    return MoEShape(name=name, num_experts=E, topk=topk, hidden=H, intermediate=I, hf_id=hf_id,
                    source=_HF.format(hf_id), aliases=aliases, **kw)


#: The released checkpoints' expert weights (their config.json quantization_config).
_FP8_BLOCK_128 = CheckpointQuant("fp8_w8a8", block_shape=(128, 128), source="preset")
_MXFP4 = CheckpointQuant("mxfp4", group_size=MX_BLOCK, source="preset")

_PRESET_LIST: tuple[MoEShape, ...] = (
    _preset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 8, 2, 4096, 14336,
            aliases=("mistralai/Mixtral-8x7B-Instruct-v0.1",),
            deploy=("tp1", "tp8"),
            notes="num_local_experts; softmax over the top-2 logits (= softmax then renormalise)"),
    _preset("mixtral-8x22b", "mistralai/Mixtral-8x22B-v0.1", 8, 2, 6144, 16384,
            aliases=("mistralai/Mixtral-8x22B-Instruct-v0.1",),
            deploy=("tp8",),
            notes="num_local_experts; softmax over the top-2 logits"),
    _preset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 128, 8, 2048, 768,
            aliases=("Qwen/Qwen3-30B-A3B-Instruct-2507", "Qwen/Qwen3-Coder-30B-A3B-Instruct"),
            deploy=("tp1",),
            notes="moe_intermediate_size; norm_topk_prob=true"),
    _preset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 128, 8, 4096, 1536,
            aliases=("Qwen/Qwen3-235B-A22B-Instruct-2507",),
            deploy=("tp8", "ep8"),
            notes="moe_intermediate_size; norm_topk_prob=true"),
    _preset("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", 512, 10, 2048, 512, shared_experts=1,
            shared_intermediate=512, shared_gate=True, deploy=("tp4",),
            notes="moe_intermediate_size; norm_topk_prob=true; one gated shared expert (size 512)"),
    _preset("qwen2-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", 60, 4, 2048, 1408, renormalize=False, shared_experts=1,
            aliases=("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B-Chat"), shared_intermediate=5632, shared_gate=True,
            deploy=("tp1",),
            notes="Qwen2MoE architecture; norm_topk_prob=false; one gated shared expert of size 5632"),
    _preset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 256, 8, 7168, 2048, scoring="sigmoid", n_group=8,
            topk_group=4, routed_scaling_factor=2.5, shared_experts=1, shared_intermediate=2048,
            quantization=_FP8_BLOCK_128,
            aliases=("deepseek-ai/DeepSeek-V3-0324", "deepseek-v3.1", "deepseek-ai/DeepSeek-V3.1"),
            deploy=("tp8", "ep8"),
            notes="n_routed_experts; sigmoid scores with e_score_correction_bias, noaux_tc grouped top-k; "
                  "norm_topk_prob=true; first 3 layers dense"),
    _preset("deepseek-r1", "deepseek-ai/DeepSeek-R1", 256, 8, 7168, 2048, scoring="sigmoid", n_group=8,
            topk_group=4, routed_scaling_factor=2.5, shared_experts=1, shared_intermediate=2048,
            quantization=_FP8_BLOCK_128, aliases=("deepseek-ai/DeepSeek-R1-0528",),
            deploy=("tp8", "ep8"),
            notes="same MoE shape as deepseek-v3"),
    _preset("deepseek-v2", "deepseek-ai/DeepSeek-V2", 160, 6, 5120, 1536, renormalize=False, n_group=8,
            topk_group=3, routed_scaling_factor=16.0, shared_experts=2, shared_intermediate=3072,
            deploy=("tp8",),
            notes="n_routed_experts; softmax, group_limited_greedy top-k; norm_topk_prob=false"),
    _preset("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", 64, 6, 2048, 1408, renormalize=False,
            shared_experts=2, shared_intermediate=2816, aliases=("deepseek-ai/DeepSeek-V2-Lite-Chat",),
            deploy=("tp1",),
            notes="n_routed_experts; softmax, greedy top-k; norm_topk_prob=false"),
    _preset("gpt-oss-20b", "openai/gpt-oss-20b", 32, 4, 2880, 2880, activation="swigluoai", expert_bias=True,
            quantization=_MXFP4, deploy=("tp1",),
            notes="num_local_experts; softmax over the top-4 logits; experts: clamped SwiGLU (swigluoai, gate/up "
                  "interleaved) with biases on both GEMMs; MXFP4 experts in the release"),
    _preset("gpt-oss-120b", "openai/gpt-oss-120b", 128, 4, 2880, 2880, activation="swigluoai", expert_bias=True,
            quantization=_MXFP4, deploy=("tp4",),
            notes="num_local_experts; softmax over the top-4 logits; swigluoai experts with biases; MXFP4 experts "
                  "in the release"),
    _preset("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", 64, 8, 2048, 1024, renormalize=False,
            aliases=("allenai/OLMoE-1B-7B-0924-Instruct", "olmoe"),
            deploy=("tp1",),
            notes="num_experts; norm_topk_prob=false"),
    _preset("dbrx", "databricks/dbrx-base", 16, 4, 6144, 10752,
            aliases=("databricks/dbrx-instruct", "dbrx-instruct", "dbrx-base"),
            deploy=("tp8",),
            notes="ffn_config.moe_num_experts / moe_top_k / ffn_hidden_size, d_model; moe_normalize_expert_weights=1"),
    _preset("llama4-scout", "meta-llama/Llama-4-Scout-17B-16E", 16, 1, 5120, 8192, scoring="sigmoid",
            renormalize=False, shared_experts=1, shared_intermediate=8192,
            aliases=("meta-llama/Llama-4-Scout-17B-16E-Instruct",),
            deploy=("tp8",),
            notes="text_config.num_local_experts; sigmoid of the top-1 logit; one shared expert"),
)

PRESETS: dict[str, MoEShape] = {p.name: p for p in _PRESET_LIST}


def list_models() -> list[MoEShape]:
    """All presets, in table order."""
    return list(_PRESET_LIST)


# ---------------------------------------------------------------------------------------------
# Name lookup.


def _norm(name: str) -> str:
    """Lower case, '_' and spaces as '-'."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _alias_table() -> dict[str, str]:
    """normalised name -> preset name: the preset names, HF ids, and the ids' last path part."""
    table: dict[str, str] = {}
    for p in _PRESET_LIST:
        for n in (p.name, p.hf_id, *p.aliases):
            if not n:
                continue
            table[_norm(n)] = p.name
            table[_norm(n.rsplit("/", 1)[-1])] = p.name
    return table


def _lookup_preset(name: str) -> MoEShape | None:
    """Exact alias match, else the longest alias that prefixes the name (followed by '-');
    None when nothing matches or when two presets match equally well (ambiguous)."""
    table = _alias_table()
    key = _norm(name)
    for k in (key, key.rsplit("/", 1)[-1]):
        if k in table:
            return PRESETS[table[k]]
    base = key.rsplit("/", 1)[-1]
    best_len, best = 0, set()
    for alias, preset in table.items():
        if "/" in alias:
            continue
        if base.startswith(alias + "-"):
            if len(alias) > best_len:
                best_len, best = len(alias), {preset}
            elif len(alias) == best_len:
                best.add(preset)
    if len(best) == 1:
        return PRESETS[best.pop()]
    return None


def get_model(name_or_path: str) -> MoEShape:
    """A preset by name (case-insensitive; HF ids such as "mistralai/Mixtral-8x7B-v0.1" work
    when they point at one preset), or the shape read from a local HuggingFace config.json
    (a file, or a folder holding config.json). Never touches the network."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise MoebenchError("--model needs a preset name or a path to a config.json; run `moebench models` for the presets")
    arg = name_or_path.strip()
    path = os.path.expanduser(arg)
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            # A stray folder named like a preset does not hide the preset.
            if os.sep not in arg and _lookup_preset(arg) is not None:
                return _lookup_preset(arg)  # type: ignore[return-value]
            raise MoebenchError(f"folder {arg!r} has no config.json: pass the path of a HuggingFace config.json")
        return read_hf_config(cfg)
    if os.path.isfile(path):
        return read_hf_config(path)
    if arg.lower().endswith(".json"):
        raise MoebenchError(f"config file {arg!r} does not exist: check the path, or use a preset (`moebench models`)")
    preset = _lookup_preset(arg)
    if preset is not None:
        return preset
    names = list(PRESETS) + sorted({_norm(a.rsplit("/", 1)[-1]) for p in _PRESET_LIST for a in p.aliases})
    near = difflib.get_close_matches(_norm(arg).rsplit("/", 1)[-1], names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(near)}? " if near else ""
    local = " (no network: download its config.json and pass the file's path)" if "/" in arg else ""
    raise MoebenchError(
        f"unknown model {arg!r}{local}: {hint}run `moebench models` for the presets, or pass a config.json path"
    )


def custom_shape(num_experts: int, topk: int, hidden: int, intermediate: int, name: str = "custom", **kw: Any) -> MoEShape:
    """A shape from the four size flags; errors name the flag that is wrong."""
    return MoEShape(name=name, num_experts=num_experts, topk=topk, hidden=hidden, intermediate=intermediate, **kw)


# ---------------------------------------------------------------------------------------------
# Local HuggingFace config.json.

# Key names for each field, first match wins. ("a.b" = nested dict key.)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "ffn_config.moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k", "experts_per_token", "num_experts_per_token",
              "ffn_config.moe_top_k")
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim")
_INTER_KEYS = ("moe_intermediate_size", "ffn_config.ffn_hidden_size", "expert_intermediate_size", "intermediate_size",
               "ffn_hidden_size")
# Sub-configs of multimodal models whose text part holds the MoE layer.
_SUB_CONFIGS = ("text_config", "language_config", "llm_config")
# Architectures whose router scores with a sigmoid without saying so in the config.
_SIGMOID_MODEL_TYPES = ("llama4", "llama4_text")
# Architectures whose shared MLP output is scaled by sigmoid(x @ shared_expert_gate).
_GATED_SHARED_MODEL_TYPES = ("qwen2_moe", "qwen3_next")


def _get(cfg: dict[str, Any], dotted: str) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        v = _get(cfg, k)
        if v is not None:
            return k, v
    return None, None


def read_hf_config(path: str) -> MoEShape:
    """Read the MoE shape from a local HuggingFace config.json with the json module only.

    Understands Mixtral/gpt-oss/Llama-4 (num_local_experts), Qwen-MoE/OLMoE (num_experts),
    DeepSeek (n_routed_experts, scoring_func, n_group, topk_group), DBRX (ffn_config.*, d_model),
    and multimodal configs whose text_config holds the MoE layer.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise MoebenchError(f"config file {path!r} does not exist: check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MoebenchError(f"cannot read config file {path!r} ({e.__class__.__name__}): pass a readable UTF-8 config.json") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise MoebenchError(f"config file {path!r} is not valid JSON (line {e.lineno}: {e.msg}): pass a HuggingFace config.json") from None
    if not isinstance(cfg, dict):
        raise MoebenchError(f"config file {path!r} holds a JSON {type(cfg).__name__}, not an object: pass a HuggingFace config.json")

    outer_quant = cfg.get("quantization_config")
    key, experts = _first(cfg, _EXPERT_KEYS)
    if not experts:
        for sub in _SUB_CONFIGS:
            if isinstance(cfg.get(sub), dict) and _first(cfg[sub], _EXPERT_KEYS)[1]:
                outer_type = cfg.get("model_type")
                cfg = dict(cfg[sub])
                cfg.setdefault("_outer_model_type", outer_type)
                key, experts = _first(cfg, _EXPERT_KEYS)
                break
    mt = cfg.get("model_type", "unknown")
    flags = "--num-experts/--topk/--hidden/--intermediate"
    if experts is None:
        raise MoebenchError(
            f"config file {path!r} (model_type {mt!r}) is not a Mixture-of-Experts model: it has no expert count "
            f"({', '.join(_EXPERT_KEYS)}); use a MoE model's config or the {flags} flags"
        )
    if _is_int(experts) and experts == 0:
        raise MoebenchError(
            f"config file {path!r} (model_type {mt!r}): {key} is 0, so the model has no routed experts (a dense "
            f"model) and no MoE layer to run; use a MoE model's config or the {flags} flags"
        )

    def need(keys: tuple[str, ...], what: str) -> int:
        k, v = _first(cfg, keys)
        if v is None:
            raise MoebenchError(f"config file {path!r} has no {what} ({', '.join(keys)}): add it or use the size flags")
        if isinstance(v, float) and math.isfinite(v) and v == int(v) and v >= 1:
            raise MoebenchError(f"config file {path!r}: {k} must be a positive integer, got {v:g} (a JSON number "
                                f"with a fraction or an exponent; write it as an integer, e.g. {int(v)})")
        if not _is_int(v) or v < 1:
            raise MoebenchError(f"config file {path!r}: {k} must be a positive integer, got {v!r}")
        return v

    num_experts = need(_EXPERT_KEYS, "expert count")
    topk = need(_TOPK_KEYS, "experts-per-token count")
    hidden = need(_HIDDEN_KEYS, "hidden size")
    intermediate = need(_INTER_KEYS, "intermediate size")

    model_type = str(cfg.get("model_type") or cfg.get("_outer_model_type") or "")
    scoring = cfg.get("scoring_func")
    if scoring is None:
        scoring = "sigmoid" if model_type in _SIGMOID_MODEL_TYPES else "softmax"
    if scoring not in SCORING_FUNCS:
        raise MoebenchError(
            f"config file {path!r}: scoring_func {scoring!r} is not supported; moebench routes with {', '.join(SCORING_FUNCS)}"
        )

    if "norm_topk_prob" in cfg:
        renormalize = bool(cfg["norm_topk_prob"])
    elif _get(cfg, "ffn_config.moe_normalize_expert_weights") is not None:
        renormalize = True
    else:
        # Mixtral, gpt-oss: softmax over the top-k logits, i.e. renormalised; Llama-4: sigmoid, not.
        renormalize = model_type not in _SIGMOID_MODEL_TYPES

    n_group, topk_group = cfg.get("n_group"), cfg.get("topk_group")
    if n_group in (None, 1) or topk_group is None:
        n_group = topk_group = None

    shared = cfg.get("n_shared_experts", cfg.get("num_shared_experts"))
    if shared is None:
        if cfg.get("shared_expert_intermediate_size"):
            shared = 1
        elif model_type in _SIGMOID_MODEL_TYPES:
            shared = 1
        else:
            shared = 0
    scaling = cfg.get("routed_scaling_factor")
    if scaling is None:
        scaling = 1.0
    # The shared MLP: Qwen-MoE names its size; DeepSeek's is n_shared_experts routed-sized experts;
    # Llama-4's one shared expert is as wide as a routed one.
    shared_inter = cfg.get("shared_expert_intermediate_size")
    if not shared_inter and shared:
        shared_inter = shared * intermediate
    shared_inter = int(shared_inter or 0)
    if not shared:
        shared_inter = 0
    shared_gate = bool(shared_inter) and model_type in _GATED_SHARED_MODEL_TYPES
    act, bias = activation_from_config(cfg, f"config file {path!r}")
    quant = quant_from_config(cfg.get("quantization_config", outer_quant), f"config file {path!r}")

    name = cfg.get("_name_or_path") or config_name(path, model_type)
    return MoEShape(
        name=str(name), num_experts=num_experts, topk=topk, hidden=hidden, intermediate=intermediate,
        scoring=scoring, renormalize=renormalize, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=scaling, shared_experts=shared, shared_intermediate=shared_inter, shared_gate=shared_gate,
        activation=act.name, swiglu_limit=act.limit, expert_bias=bias, quantization=quant, source=os.path.abspath(path),
        notes=f"read from config.json (model_type {model_type or 'unknown'}, experts from {key})",
    )
