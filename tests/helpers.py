"""Helpers shared by the CPU kernel tests (tests/ is on sys.path when pytest runs them)."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (float64 ref), after checking the shape and that no element of out
    is NaN (outputs are poisoned with NaN first, so an unwritten element fails here)."""
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "output has unwritten (NaN) elements"
    den = ref.norm().item()
    num = (out.double() - ref).norm().item()
    return num / den if den > 0 else num


def random_expert_map(e_global: int, e_local: int, device, seed: int = 3) -> torch.Tensor:
    """(e_global,) int32: e_local randomly chosen experts numbered 0.. here, the others -1 (remote)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.full((e_global,), -1, dtype=torch.int32)
    m[torch.randperm(e_global, generator=g)[:e_local]] = torch.arange(e_local, dtype=torch.int32)
    return m.to(device)
