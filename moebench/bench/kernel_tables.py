"""Measured experts times shipped with the package: what a modeled row's experts time is where a
table covers its shard, in place of the roofline floor.

A table (`moebench/bench/kernel_times/*.csv`, and any `*.csv` in $MOEBENCH_KERNEL_TIMES) holds
moebench's own measured experts-layer times, one line per (gpu, experts, topk, hidden,
intermediate, precision, tokens): `experts` the local experts of the shard, `intermediate` per
rank, `rows_per_expert` = tokens x topk / experts, `experts_us` the measured median, with the
`date`, `revision` and `source` (the run that measured it). `python -m benchmarks kernel_table`
writes one from sweep run folders (the `kernel_times` device job) or from PERF.md's raw files.

A modeled row of the same GPU (by datasheet profile), shard and precision takes the time
interpolated log-log in its rows per expert (the busiest rank's pairs over its local experts),
inside the table's measured range only; elsewhere the floor. The row says which
(`x_experts_source`).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path

COLUMNS = ("gpu", "experts", "topk", "hidden", "intermediate", "precision", "tokens", "rows_per_expert", "experts_us",
           "date", "revision", "source")
SHIPPED = Path(__file__).with_name("kernel_times")


def _files() -> tuple[Path, ...]:
    extra = os.environ.get("MOEBENCH_KERNEL_TIMES")
    dirs = [SHIPPED] + ([Path(extra)] if extra else [])
    return tuple(sorted(p for d in dirs if d.is_dir() for p in d.glob("*.csv")))


@lru_cache(maxsize=4)
def _load(files: tuple[Path, ...]):
    import pandas as pd

    from moebench.bench.hardware import gpu_target

    frames = [pd.read_csv(f).assign(file=f.name) for f in files]
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        from moebench.errors import MoebenchError

        raise MoebenchError(f"kernel time table without {', '.join(missing)}: {', '.join(f.name for f in files)}")
    df["profile"] = [getattr(gpu_target(g), "profile", str(g)) for g in df.gpu]
    return df


def precision_key(dtype: str, quant: str = "") -> str:
    """A row's precision as tables name it: 'bf16', 'fp8_w8a8 block[128,128]'."""
    return f"{dtype} {quant}".strip() if quant else str(dtype)


def lookup(gpu: str, experts: int, hidden: int, intermediate: int, topk: int, precision: str,
           rows_per_expert: float) -> tuple[float, str] | None:
    """(measured experts time in us, where it comes from) for this shard on `gpu`, interpolated
    log-log in rows per expert between the two nearest measured points around it; None where no
    table covers it (another GPU, shard or precision, or rows per expert outside the measured range)."""
    from moebench.bench.hardware import gpu_target

    df = _load(_files())
    if df is None or rows_per_expert <= 0:
        return None
    profile = getattr(gpu_target(gpu), "profile", gpu)
    g = df[(df.profile == profile) & (df.experts == experts) & (df.hidden == hidden) & (df.intermediate == intermediate)
           & (df.topk == topk) & (df.precision == precision)]
    if g.empty:
        return None
    g = g.groupby("rows_per_expert", as_index=False).agg(experts_us=("experts_us", "median"), date=("date", "max"),
                                                         revision=("revision", "first"), file=("file", "first"))
    g = g.sort_values("rows_per_expert")
    x = float(rows_per_expert)
    lo, hi = float(g.rows_per_expert.iloc[0]), float(g.rows_per_expert.iloc[-1])
    if not lo <= x <= hi:
        return None
    below = g[g.rows_per_expert <= x].iloc[-1]
    above = g[g.rows_per_expert >= x].iloc[0]
    if below.rows_per_expert == above.rows_per_expert:
        us = float(below.experts_us)
    else:
        t = (math.log(x) - math.log(below.rows_per_expert)) / (math.log(above.rows_per_expert)
                                                               - math.log(below.rows_per_expert))
        us = math.exp(math.log(below.experts_us) + t * (math.log(above.experts_us) - math.log(below.experts_us)))
    return us, f"measured table {below.file} ({profile}, {below.date}, rev {below.revision})"
