"""Inputs for checks and timing: random normal, weights scaled by 1/sqrt(fan-in), never zeros."""

from __future__ import annotations

import torch

from moebench.errors import MoebenchError
from moebench.quant import quantize_weights

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise MoebenchError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def make_weights(
    experts: range | list[int],
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    quant=None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of the given global experts, w13 (E_local, 2I', H) and w2 (E_local, H, I'), with
    I' = intermediate / tp_size (this TP rank's column / row shard), N(0, 1/fan_in).

    quant: a moebench.quant.QuantScheme -> QuantWeights (fp8 + scales), quantised from these
    values; each rank quantises the shard it holds (`dtype` is then the activation dtype).

    Every expert is drawn from its own seed, so any rank, shard or subset sees the same values as a
    full single-rank run: a shard of the full weights equals the weights of the shard.

    interleaved: w13's gate and up rows alternate (row 2j gate j, 2j + 1 up j: swigluoai's layout,
    moebench.activation) instead of two halves; the same values either way.
    """
    experts = list(experts)
    ip = intermediate // tp_size
    lo, hi = tp_rank * ip, (tp_rank + 1) * ip
    w13 = torch.empty((len(experts), 2 * ip, hidden), dtype=dtype, device=device)
    w2 = torch.empty((len(experts), hidden, ip), dtype=dtype, device=device)
    for i, e in enumerate(experts):
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + e)
        full13 = torch.randn((2 * intermediate, hidden), generator=g, device=device).mul_(hidden ** -0.5)
        full2 = torch.randn((hidden, intermediate), generator=g, device=device).mul_(intermediate ** -0.5)
        w13[i, :ip] = full13[lo:hi]
        w13[i, ip:] = full13[intermediate + lo : intermediate + hi]
        w2[i] = full2[:, lo:hi]
    if interleaved:
        w13 = torch.stack([w13[:, :ip], w13[:, ip:]], dim=2).reshape(w13.shape)
    if quant is not None:
        return quantize_weights(w13, w2, quant, dtype)
    return w13, w2


def rank_weights(spec, rank: int, keep_unquantized: bool = False) -> tuple[tuple, tuple | None]:
    """Rank `rank`'s shard of a SweepSpec's weights (all of them for a single rank), generated
    directly (same values as slicing the full weights): ((w13, w2) as the kernels take them,
    quantised when spec.quant; the unquantised pair when spec.quant and keep_unquantized, for
    err_vs_unquantized, else None)."""
    s, lay = spec.shape, spec.layout
    if lay.enable_ep:
        w13, w2 = make_weights(lay.local_experts(rank, s.num_experts), s.hidden, s.intermediate, spec.dtype,
                               spec.device, spec.seed)
    else:
        w13, w2 = make_weights(range(s.num_experts), s.hidden, s.intermediate, spec.dtype, spec.device, spec.seed,
                               tp_rank=rank, tp_size=lay.moe_tp_size)
    kernel_weights = quantize_weights(w13, w2, spec.quant, spec.dtype)
    return kernel_weights, ((w13, w2) if spec.quant is not None and keep_unquantized else None)


def make_tokens(tokens: int, hidden: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """x (M, H) ~ N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((tokens, hidden), generator=g, device=device, dtype=torch.float32).to(dtype)


def available_memory(device: str) -> int:
    """Bytes free for new tensors on `device` (GPU: free memory; CPU: MemAvailable)."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def check_fits(
    e_local: int, hidden: int, inter_local: int, max_tokens: int, topk: int, dtype: torch.dtype, device: str,
    advice: str = "shard it with --tp/--ep, use --simulate, or use fewer --tokens", ranks: int = 1,
) -> int:
    """Estimate the bytes a case needs before allocating; raise a MoebenchError that says how much
    is needed and what to do (`advice`) when it would not fit. `ranks` processes that each hold
    such a share on this device (CPU ranks share the host's memory) must fit together. Returns the
    estimate of one."""
    el = torch.tensor([], dtype=dtype).element_size()
    weights = e_local * 3 * hidden * inter_local * el
    staging = 3 * hidden * inter_local * (4 + 8)  # one expert in fp32 (generation) and fp64 (reference)
    # per (token, expert) pair: the gate/up intermediate and the output row, in the dtype and in
    # fp32; per token: x, the output, and the float64 reference (accumulator and one expert's rows).
    act = max_tokens * topk * (2 * inter_local + hidden) * (el + 4) + max_tokens * hidden * (2 * el + 3 * 8)
    need = weights + staging + act
    have = available_memory(device)
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    if ranks > 1 and ranks * need > 0.9 * have:
        raise MoebenchError(f"{ranks} ranks need about {gib(ranks * need)} together on {device} ({gib(need)} each) "
                            f"but {gib(have)} is free; {advice}")
    if need > 0.9 * have:
        raise MoebenchError(
            f"this shape needs about {gib(need)} on {device} (weights {gib(weights)}) but {gib(have)} is free; "
            f"{advice}"
        )
    return need
