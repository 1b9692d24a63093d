"""How robust a TP-vs-EP answer is to the modeled communication.

In a simulated comparison the experts time is measured (or the roofline floor) and the
communication time is modeled. For one token count with winner W and loser L, scaling both
layouts' modeled communication by one factor f flips the answer where

    experts_W + f * comm_W = experts_L + f * comm_L   ->   f = (experts_L - experts_W) / (comm_W - comm_L)

No positive solution means it never flips (W is faster in experts and in communication). The
layout with the larger communication decides the flip: f > 1 means "unless communication runs f x
slower than modeled", f < 1 "unless it runs 1/f x faster". The bandwidth that means is that layout's
communication bytes / (f * its modeled time).

Each modeled row also carries a band: its communication under the fastest and the slowest
published transport for the same traffic (moebench.comm.model). A winner whose slowest
case is not faster than the loser's fastest is "too close to call on modeled communication".
"""

from __future__ import annotations

import math

import pandas as pd

TOO_CLOSE = "too close to call on modeled communication"

COLUMNS = ("comm_bytes", "comm_lo_us", "comm_hi_us", "latency_lo_us", "latency_hi_us", "comm_band", "comm_model",
           "comm_flip_factor", "comm_flip_gbps", "comm_flip_by", "too_close")


def flip_factor(experts_w: float, comm_w: float, experts_l: float, comm_l: float) -> float:
    """The factor on both layouts' communication at which the loser catches up; inf: never."""
    den = comm_w - comm_l
    if den == 0:
        return math.inf
    f = (experts_l - experts_w) / den
    return f if f > 0 else math.inf


def comm_name(layout: str) -> str:
    """What a layout's communication is: DP+EP (and EP) layouts dispatch and combine; the others
    (TP, TP+EP, EP x TP: tokens replicated) all-reduce."""
    return "dispatch+combine" if layout.startswith(("DP", "EP")) and "/" not in layout else "the all-reduce"


def add_columns(df: pd.DataFrame, rows: dict) -> pd.DataFrame:
    """Fill COLUMNS of a compare summary `df` (one row per tokens x layout); rows: (tokens,
    layout) -> the ResultRow behind each summary row (its extra holds the comm_* figures)."""
    for c in COLUMNS:
        df[c] = None
    for i, rec in df.iterrows():
        r = rows[(rec.tokens, rec.layout)]
        x = r.extra
        comm = float(rec.comm_us)
        lo, hi = (comm if x.get(k) is None else float(x[k]) for k in ("comm_lo_us", "comm_hi_us"))
        df.at[i, "comm_bytes"] = x.get("comm_bytes")
        df.at[i, "comm_lo_us"], df.at[i, "comm_hi_us"] = lo, hi
        df.at[i, "latency_lo_us"] = float(rec.experts_us or 0.0) + lo
        df.at[i, "latency_hi_us"] = float(rec.experts_us or 0.0) + hi
        df.at[i, "comm_band"] = x.get("comm_band", "")
        df.at[i, "comm_model"] = x.get("comm_model", "")
    df["too_close"] = False
    for t, g in df.groupby("tokens"):
        if len(g) < 2:
            continue
        g = g.sort_values("latency_us")
        w, l = g.iloc[0], g.iloc[1]
        f = flip_factor(float(w.experts_us or 0), float(w.comm_us), float(l.experts_us or 0), float(l.comm_us))
        decider = w if float(w.comm_us) > float(l.comm_us) else l
        gbps = None
        if math.isfinite(f) and decider.comm_bytes and decider.comm_us:
            gbps = float(decider.comm_bytes) / (f * float(decider.comm_us)) / 1e3
        close = bool(w.latency_hi_us >= l.latency_lo_us)
        for i in g.index:
            df.at[i, "comm_flip_factor"] = f
            df.at[i, "comm_flip_gbps"] = gbps
            df.at[i, "comm_flip_by"] = comm_name(decider.layout) if math.isfinite(f) else ""
            df.at[i, "too_close"] = close
    df["comm_flip_factor"] = df["comm_flip_factor"].astype(float)
    df["comm_flip_gbps"] = df["comm_flip_gbps"].astype(float)
    df["too_close"] = df["too_close"].astype(bool)
    return df


def clause(df: pd.DataFrame, tokens: int) -> str:
    """'unless dispatch+combine run 2.4x slower than modeled, i.e. below 140 GB/s' for `tokens`."""
    g = df[df.tokens == tokens]
    if len(g) < 2:
        return ""
    f, gbps, by = g.comm_flip_factor.iloc[0], g.comm_flip_gbps.iloc[0], g.comm_flip_by.iloc[0]
    if not math.isfinite(f):
        return "whatever the communication costs (faster in both the experts GEMM and communication)"
    bw = "" if gbps is None or pd.isna(gbps) else f", i.e. {'below' if f > 1 else 'above'} {gbps:.3g} GB/s"
    if f >= 1:
        return f"unless {by} run {f:.1f}x slower than modeled{bw}"
    return f"unless {by} run {1 / f:.1f}x faster than modeled{bw}"


def close_line(df: pd.DataFrame) -> str:
    """'; too close to call on modeled communication at 16, 64 tokens (...)' or ''."""
    close = sorted({int(t) for t in df[df.too_close].tokens})
    if not close:
        return ""
    return (f"; {TOO_CLOSE} at {', '.join(map(str, close))} tokens (the layouts' bands between the fastest and "
            f"the slowest published transport for this link overlap)")
