"""Tables (rich) and exports (CSV / JSON / Markdown / Parquet / HTML) of result rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import pandas as pd
from rich.console import Console
from rich.table import Table

from moebench.results import CORE_COLUMNS, ResultRow, precision_labels, rows_to_frame

EXPORT_FORMATS = ("csv", "json", "md", "parquet", "html")


def _markdown(df: pd.DataFrame) -> str:
    """GitHub-flavoured Markdown table, without needing the `tabulate` package."""
    cols = list(df.columns)
    fmt = lambda v: "" if v is None or (isinstance(v, float) and pd.isna(v)) else (  # noqa: E731
        f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|"))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(v) for v in rec) + " |" for rec in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def export_frame(df: pd.DataFrame, path: str | Path, fmt: str) -> None:
    """Write `df` to `path` in `fmt` (one of EXPORT_FORMATS)."""
    if fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "json":
        Path(path).write_text(json.dumps(df.to_dict("records"), indent=1, default=str))
    elif fmt == "md":
        Path(path).write_text(_markdown(df))
    elif fmt == "parquet":
        df.to_parquet(path, index=False)
    elif fmt == "html":
        Path(path).write_text(df.to_html(index=False, na_rep=""))
    else:
        raise ValueError(f"unknown export format {fmt}")


def _fmt(v, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 0.01 or v == 0 else f"{v:.2e}"
    return str(v)


def sweep_table(rows: Iterable[ResultRow], title: str = "moebench sweep") -> Table:
    """One row per (tokens, pair): latency, spread, metrics, correctness; fastest correct marked."""
    rows = list(rows)
    best: dict[int, float] = {}
    for r in rows:
        if r.status == "ok" and r.correct and r.latency_us is not None:
            best[r.tokens] = min(best.get(r.tokens, float("inf")), r.latency_us)
    t = Table(title=title, header_style="bold")
    breakdown = any(r.experts_us is not None for r in rows)
    cols = ["tokens", "prepare/finalize", "experts", "format", "latency us", "p10-p90"]
    cols += ["breakdown us"] if breakdown else []
    cols += ["TFLOP/s", "GB/s", "roofline", "rel err", "correct", "status / reason"]
    for col in cols:
        t.add_column(col, justify="right" if col not in ("prepare/finalize", "experts", "format", "status / reason") else "left")
    for r in rows:
        fastest = r.latency_us is not None and r.correct and best.get(r.tokens) == r.latency_us
        lat = _fmt(r.latency_us) + (" *" if fastest else "")
        spread = f"{_fmt(r.p10_us)}-{_fmt(r.p90_us)}" if r.p10_us is not None else "-"
        if r.modeled and r.status == "ok":
            status = "ok, modeled"
        else:
            status = r.status if not r.reason else f"{r.status}: {r.reason}"
        ok = {True: "[green]yes[/]", False: "[red]NO[/]", None: "-"}[r.correct]
        cells = [str(r.tokens), r.prepare_finalize, r.experts, r.activation_format, lat, spread]
        cells += [_breakdown(r)] if breakdown else []
        cells += [_fmt(r.tflops, 2), _fmt(r.gbps), _fmt(r.roofline_frac, 2), _fmt(r.max_rel_err, 6), ok, status]
        t.add_row(*cells)
    return t


def _breakdown(r: ResultRow) -> str:
    """'dispatch 1.0 + experts 2.0 + combine 3.0' or 'experts 2.0 + allreduce 1.0' (modeled parts marked ~)."""
    parts = []
    for name, label in (("dispatch_us", "disp"), ("experts_us", "exp"), ("combine_us", "comb"), ("allreduce_us", "ar")):
        v = getattr(r, name)
        if v is not None:
            parts.append(f"{label} {'~' if r.modeled and name != 'experts_us' else ''}{v:.1f}")
    return " + ".join(parts) if parts else "-"


def skipped_table(rows: Iterable[ResultRow]) -> Table | None:
    """Skipped pairs grouped by why (the files keep one row per pair and token count)."""
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        if r.status != "skipped":
            continue
        reason = r.reason
        if reason.startswith("format mismatch"):
            reason = "format mismatch: a Standard half with a BatchedExperts half"
        pair = f"{r.prepare_finalize}+{r.experts}"
        if pair not in by_reason.setdefault(reason, []):
            by_reason[reason].append(pair)
    if not by_reason:
        return None
    n = sum(len(v) for v in by_reason.values())
    t = Table(title=f"skipped pairs ({n})", header_style="bold", show_lines=False)
    t.add_column("why")
    t.add_column("pairs")
    for reason, pairs in by_reason.items():
        t.add_row(reason, ", ".join(pairs))
    return t


def print_rows(rows: Iterable[ResultRow], console: Console | None = None, title: str = "moebench sweep") -> None:
    rows = list(rows)
    console = console or Console()
    console.print(sweep_table([r for r in rows if r.status != "skipped"], title))
    skipped = skipped_table(rows)
    if skipped is not None:
        console.print(skipped)
    notes = []
    if any(r.device == "cpu" and r.latency_us is not None for r in rows):
        notes.append("CPU times are wall clock: they test correctness and plumbing, not kernel speed.")
    if any(r.modeled for r in rows):
        notes.append("modeled rows: the experts time is measured on this device for one rank's share; "
                     "communication (~) comes from the cost model, not a measurement.")
        notes += sorted({r.reason.split("; ", 1)[-1] for r in rows if r.modeled and r.status == "ok"})
    if any(r.latency_us is not None for r in rows):
        notes.append("* = fastest correct entry for its token count.")
    for n in notes:
        console.print(f"[dim]{n}[/]")


def frame(rows: Iterable[ResultRow]) -> pd.DataFrame:
    """The rows as a DataFrame with the design.md columns first."""
    df = rows_to_frame(rows)
    first = [c for c in CORE_COLUMNS if c in df.columns]
    return df[first + [c for c in df.columns if c not in first]]


# -- merged reports over result folders ---------------------------------------------------------

def pair_label(r) -> str:
    lay = f"EP{r['ep']}" if r["ep"] > 1 else (f"TP{r['world_size']}" if r["world_size"] > 1 else "1 rank")
    return f"{lay} {r['prepare_finalize']}+{r['experts']}" + (" (modeled)" if r["modeled"] else "")


def pivot(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rows (model, dtype, device, routing, tokens), columns pair labels, values latency_us of
    correct ok rows; plus a same-shaped boolean frame marking the fastest entry of each row. An
    `imbalance` column (max/mean tokens per expert) sits after the index."""
    ok = df[(df.status == "ok") & df.latency_us.notna()].copy()
    ok = ok[ok.correct.astype("boolean").fillna(True)]
    if ok.empty:
        return pd.DataFrame(), pd.DataFrame()
    ok["pair"] = ok.apply(pair_label, axis=1)
    ok["dtype"] = precision_labels(ok)  # fp8 schemes stay apart
    idx = ["model", "dtype", "device", "routing", "tokens"]
    table = ok.pivot_table(index=idx, columns="pair", values="latency_us", aggfunc="min")
    fastest = table.eq(table.min(axis=1), axis=0)
    imb = ok.groupby(idx).imbalance.mean()
    table.insert(0, "imbalance", imb)
    fastest.insert(0, "imbalance", False)
    return table.reset_index(), fastest.reset_index(drop=True)


def pivot_markdown(table: pd.DataFrame, fastest: pd.DataFrame) -> str:
    """Markdown with the fastest latency of each row in bold."""
    cols = list(table.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for i, rec in table.iterrows():
        cells = []
        for c in cols:
            v = rec[c]
            s = "" if pd.isna(v) else (f"{v:.1f}" if isinstance(v, float) else str(v))
            if c in fastest.columns and bool(fastest.loc[i, c]) and s:
                s = f"**{s}**"
            cells.append(s)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pivot_html(table: pd.DataFrame, fastest: pd.DataFrame) -> str:
    def style(col):
        if col.name not in fastest.columns:
            return [""] * len(col)
        return ["background-color:#c6efce;font-weight:bold" if f else "" for f in fastest[col.name]]

    return table.style.apply(style).format(precision=1, na_rep="").hide(axis="index").to_html()


def html_report(df: pd.DataFrame, table: pd.DataFrame, fastest: pd.DataFrame, png: bytes | None, title: str) -> str:
    """One self-contained HTML page: pivot (fastest highlighted), plot (inline PNG), all rows."""
    import base64
    import html

    img = f'<img alt="latency vs tokens" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>' if png else ""
    modeled = "<p>Rows marked (modeled) take communication time from the cost model.</p>" if df.modeled.any() else ""
    cpu = "<p>CPU rows are wall clock: they test correctness and plumbing, not kernel speed.</p>" if (df.device == "cpu").any() else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse;font-size:13px}"
            "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{modeled}{cpu}<h2>latency (us), fastest correct per row highlighted</h2>"
            f"{pivot_html(table, fastest) if not table.empty else '<p>no correct rows</p>'}{img}"
            f"<h2>all rows</h2>{df.to_html(index=False, na_rep='')}</body></html>")
