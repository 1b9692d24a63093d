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


class WorkCounter:
    """Counts the work of the torch calls made inside `with WorkCounter() as w:` on this thread
    (a TorchDispatchMode): `calls` (aten op name -> how many), `largest_bytes` (the biggest real,
    not meta, tensor an op returned). A bound on work done, where a test would otherwise bound a
    wall-clock time."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.calls: dict[str, int] = {}
        self.largest_bytes = 0

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                counter.calls[name] = counter.calls.get(name, 0) + 1
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        counter.largest_bytes = max(counter.largest_bytes, t.numel() * t.element_size())
                return out

        self._mode = _Mode()

    def __enter__(self) -> "WorkCounter":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def count(self, *names: str) -> int:
        return sum(self.calls.get(n, 0) for n in names)
