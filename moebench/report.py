"""Tables (console) and exports (CSV / JSON / Markdown / Parquet / HTML) of result rows.

Printed tables fit the console: every column is as wide as its widest cell, and when the whole
table is wider than the console, low-priority columns are left out (the results files keep every
column) - no cell is ever cut. On a terminal they print as rich tables; anywhere else (a pipe, a
log file, CI) as plain aligned text. results.csv / .json / .parquet hold every column of every row;
results.md / .html are a short report of the run (what ran, on what, the fastest pair per token
count, then the detail).
"""

from __future__ import annotations

import html as _html
import importlib.util
import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from moebench.fileio import atomic_write_with
from moebench.results import CORE_COLUMNS, ResultRow, RunStore, precision_labels, rows_to_frame, skip_kind

EXPORT_FORMATS = ("csv", "json", "md", "parquet", "html")


def markdown(df: pd.DataFrame) -> str:
    """GitHub-flavoured Markdown table, without needing the `tabulate` package."""
    cols = list(df.columns)
    fmt = lambda v: "" if v is None or (isinstance(v, float) and pd.isna(v)) else (  # noqa: E731
        f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|"))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(v) for v in rec) + " |" for rec in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def export_frame(df: pd.DataFrame, path: str | Path, fmt: str, meta: dict | None = None) -> None:
    """Write result rows `df` to `path` in `fmt` (one of EXPORT_FORMATS). csv / json / parquet
    hold every column; md / html are the readable run report (`run_report`), which takes the
    run's settings from `meta`, else from the metadata.json beside `path` when there is one."""
    if fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "json":
        Path(path).write_text(json.dumps(df.to_dict("records"), indent=1, default=str))
    elif fmt in ("md", "html"):
        if meta is None:
            meta = read_metadata(Path(path).parent)
        Path(path).write_text(run_report(df, meta, fmt))
    elif fmt == "parquet":
        df.to_parquet(path, index=False)
    else:
        raise ValueError(f"unknown export format {fmt}")


def read_metadata(folder: Path) -> dict:
    p = Path(folder) / "metadata.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, ValueError):
        return {}


def frame(rows: Iterable[ResultRow]) -> pd.DataFrame:
    """The rows as a DataFrame with the design.md columns first."""
    df = rows_to_frame(rows)
    first = [c for c in CORE_COLUMNS if c in df.columns]
    return df[first + [c for c in df.columns if c not in first]]



def write_exports(store: RunStore, formats: Iterable[str] = ("csv", "json", "md")) -> list[Path]:
    """Write the run folder's exports (results.<fmt>) from the store's rows; returns the paths
    written (none for a store that does not write)."""
    if not store.write:
        return []
    df = frame(store.rows)
    written = []
    for fmt in formats:
        path = store.folder / f"results.{fmt}"
        if fmt == "parquet" and importlib.util.find_spec("pyarrow") is None:
            continue  # the CLI refuses --format parquet without pyarrow; the API skips it
        atomic_write_with(path, lambda tmp, fmt=fmt: export_frame(df, tmp, fmt))
        written.append(path)
    return written


# -- tables that fit the console -----------------------------------------------------------------

GAP = 2  # spaces between two columns, in plain text and in the rich tables alike


@dataclass
class Column:
    """One column of a TextTable. `header` may hold a newline (a two-line header: name, unit).

    drop: 0 = always shown; otherwise columns with larger numbers are left out first when the table
    is too wide. group: columns of one group are left out together. fallback_for: a group; this
    column is shown only once that group has been left out (e.g. 'comm' for dispatch + combine)."""

    key: str
    header: str
    cells: list[str]
    right: bool = True
    drop: int = 0
    group: str = ""
    fallback_for: str = ""
    styles: list[str] | None = None
    name: str = ""  # for "not shown" notes (default: the header on one line)

    @property
    def width(self) -> int:
        return max([len(x) for x in self.header.split("\n")] + [len(c) for c in self.cells])

    @property
    def label(self) -> str:
        return self.name or " ".join(self.header.split())


def _table_width(cols: list[Column]) -> int:
    return sum(c.width for c in cols) + GAP * max(len(cols) - 1, 0)


@dataclass
class TextTable:
    title: str
    columns: list[Column] = field(default_factory=list)

    @property
    def nrows(self) -> int:
        return len(self.columns[0].cells) if self.columns else 0

    def fit(self, width: int) -> tuple[list[Column], list[Column]]:
        """(shown, left out): low-priority columns are left out, a group at a time, until the
        table is at most `width` characters wide (or only the columns that always show are left)."""
        prio: dict[str, int] = {}
        for c in self.columns:
            if c.drop:
                g = c.group or c.key
                prio[g] = max(prio.get(g, 0), c.drop)
        out: set[str] = set()

        def active(c: Column) -> bool:
            return not c.fallback_for or c.fallback_for in out

        def shown() -> list[Column]:
            return [c for c in self.columns if active(c) and (c.group or c.key) not in out]

        for g in sorted(prio, key=lambda g: -prio[g]):
            if _table_width(shown()) <= width:
                break
            out.add(g)
        keep = shown()
        keys = {c.key for c in keep}
        return keep, [c for c in self.columns if c.key not in keys and active(c)]

    def lines(self, cols: list[Column] | None = None) -> list[str]:
        """Plain aligned text: title, header (bottom-aligned), a dashed rule, the rows."""
        cols = self.columns if cols is None else cols
        if not cols:
            return []
        heads = [c.header.split("\n") for c in cols]
        nh = max(map(len, heads))
        heads = [[""] * (nh - len(h)) + h for h in heads]
        widths = [c.width for c in cols]

        def join(cells: list[str]) -> str:
            return (" " * GAP).join(s.rjust(w) if c.right else s.ljust(w)
                                    for s, w, c in zip(cells, widths, cols)).rstrip()

        out = [self.title] if self.title else []
        out += [join([h[i] for h in heads]) for i in range(nh)]
        out.append((" " * GAP).join("-" * w for w in widths))
        out += [join([c.cells[i] for c in cols]) for i in range(self.nrows)]
        return out

    def rich(self, cols: list[Column] | None = None) -> Table:
        """The same table for a terminal: bold header, a rule under it, styled cells."""
        cols = self.columns if cols is None else cols
        t = Table(title=self.title or None, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, collapse_padding=True, header_style="bold")
        for c in cols:
            t.add_column(c.header, justify="right" if c.right else "left", no_wrap=True, overflow="fold",
                         min_width=c.width)
        for i in range(self.nrows):
            t.add_row(*[Text(c.cells[i], style=(c.styles[i] if c.styles else None) or "") for c in cols])
        return t


def print_table(console: Console, table: TextTable) -> list[str]:
    """Print `table` within `console.width` (a rich table on a terminal, plain text elsewhere, or
    where even the columns that always show do not fit: long lines rather than cut cells);
    returns the labels of the columns left out."""
    shown, left = table.fit(console.width)
    if console.is_terminal and _table_width(shown) <= console.width:
        console.print(table.rich(shown))
    else:
        for line in table.lines(shown):
            console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
    return [c.label for c in left]


def word_lines(text: Text, width: int) -> list[Text]:
    """`text` wrapped at spaces into lines of at most `width` cells, a word never split: a word
    longer than the width (a path) gets a line of its own, whole."""
    out: list[Text] = []
    for para in text.split("\n", allow_blank=True):
        plain, cuts, col = para.plain, [], 0
        for m in re.finditer(r"\S+\s*", plain):
            if col and col + len(m.group().rstrip()) > width:
                cuts.append(m.start())
                col = 0
            col += len(m.group())
        for line in para.divide(cuts):
            line.rstrip()
            out.append(line)
    return out


def say(console: Console, text: str | Text, style: str | None = None, markup: bool = False) -> None:
    """Prose, wrapped at the console width between words, never inside one (a path stays whole, to
    be copied). No markup unless asked for: reasons and paths may hold brackets."""
    t = text if isinstance(text, Text) else Text.from_markup(text) if markup else Text(text)
    if style:
        t.stylize(style)
    for line in word_lines(t, max(console.width, 20)):
        console.print(line, soft_wrap=True, highlight=False)


def print_fitted(console: Console, table: TextTable, where: str = "--json has every column") -> None:
    """`print_table`, then a note naming the columns left out to fit the console."""
    left = print_table(console, table)
    if left:
        say(console, f"not shown at {console.width} columns: {', '.join(left)} ({where}).", "dim")


# -- numbers -----------------------------------------------------------------------------------

def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _decimals(values: Iterable[float | None]) -> int:
    """Decimals for a column from its largest value (-1: scientific notation)."""
    m = max((abs(v) for v in values if v is not None), default=0.0)
    return 0 if m >= 1000 else 1 if m >= 10 else 2 if (m >= 0.1 or m == 0) else -1


def _sci(v: float) -> str:
    if v == 0:
        return "0"
    mant, exp = f"{v:.1e}".split("e")
    return f"{mant}e{int(exp)}"


def num_cells(values: Iterable, decimals: int | None = None) -> list[str]:
    """Numbers as strings with one number of decimals for the whole column ('-' for missing)."""
    vals = [_num(v) for v in values]
    d = _decimals(vals) if decimals is None else decimals
    return ["-" if v is None else (_sci(v) if d < 0 else f"{v:.{d}f}") for v in vals]


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    if name in df.columns:
        return pd.to_numeric(df[name], errors="coerce")
    return pd.Series(float("nan"), index=df.index)


def _time_unit(latency: pd.Series) -> tuple[str, float, int]:
    """(unit, factor from us, decimals) for the time columns of a table: ms when every latency is
    at least 1 ms, else us; decimals for three significant digits of the smallest latency (0-3)."""
    pos = latency.abs()[latency.abs() > 0]
    if pos.empty:
        return "us", 1.0, 1
    unit, k = ("ms", 1e-3) if float(pos.min()) >= 1000 else ("us", 1.0)
    return unit, k, int(min(max(2 - math.floor(math.log10(float(pos.min()) * k)), 0), 3))


def _flag(v) -> bool | None:
    """True / False / None (unchecked) from a `correct` cell of any dtype."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, str):
        return {"true": True, "false": False}.get(v.lower())
    return bool(v)


# -- series: what tells result rows apart ------------------------------------------------------

_SIZES = (("num_experts", "E"), ("topk", "topk"), ("hidden", "H"), ("intermediate", "I"))
#: Settings that make separate rows of a comparison (the others are compared side by side).
ROW_KEYS = ("shape", "dtype", "device", "routing")


def layout_label(tp: int, dp: int, ep: int, world: int) -> str:
    """'1 rank', 'TP4', 'TP4 (dp2xtp2)', 'EP8', 'EP8 (dp4xtp2)'."""
    tp, dp, ep, world = int(tp), int(dp), int(ep), int(world)
    if ep > 1:
        return f"EP{ep}" + (f" (dp{dp}xtp{tp})" if tp > 1 else "")
    if world <= 1:
        return "1 rank"
    return f"TP{world}" + (f" (dp{dp}xtp{tp})" if dp > 1 else "")


def link_labels(df: pd.DataFrame) -> pd.Series:
    """The modeled link of each row ('h200-nvlink 450 GB/s'; '' for measured rows): the x_link
    column, or for files written before it, the link named in the row's reason."""
    out = (df["x_link"] if "x_link" in df.columns else pd.Series(None, index=df.index, dtype=object))
    out = out.map(lambda v: v if isinstance(v, str) else "")
    parsed = df["reason"].fillna("").astype(str).str.extract(r"link (\S+ [\d.]+ GB/s)")[0].fillna("")
    out = out.where(out != "", parsed)
    return out.where(df["modeled"].map(lambda v: bool(_flag(v))), "")


def modeled_gpus(df: pd.DataFrame) -> pd.Series:
    """Per row the GPU whose roofline floor is its experts time ('' where the experts time was
    measured): the x_modeled_gpu column, or for files written before it, the row's timing method."""
    out = df["x_modeled_gpu"] if "x_modeled_gpu" in df.columns else pd.Series(None, index=df.index, dtype=object)
    out = out.map(lambda v: v if isinstance(v, str) else "")
    method = df["timing_method"] if "timing_method" in df.columns else pd.Series("", index=df.index)
    parsed = method.fillna("").astype(str).str.extract(r"^roofline model \(([^,()]+),")[0].fillna("")
    return out.where(out != "", parsed)


def time_sources(df: pd.DataFrame) -> pd.Series:
    """What each row's time speaks of (the `device` setting of tables and reports): the device
    it was measured on ('cpu', 'cuda', or the GPU's name where the run folder gave it); '<device> + modeled comm' where its experts were measured
    there and the communication comes from the model; '<GPU> (modeled)' where the experts time is
    that GPU's roofline floor too. Rows of different sources never share a cell."""
    modeled = df["modeled"].map(lambda v: bool(_flag(v)))
    gpu = modeled_gpus(df)
    device = df["device"].astype(str)
    if "x_device_name" in df.columns:  # the GPU a cuda row ran on (its run folder's metadata)
        name = df["x_device_name"].map(lambda v: v if isinstance(v, str) else "")
        device = device.where(name == "", name + device.str.removeprefix("cuda").map(lambda x: f" ({x[1:]})" if x else ""))
    return pd.Series([d if not m else f"{g} (modeled)" if g else f"{d} + modeled comm"
                      for d, m, g in zip(device, modeled, gpu)], index=df.index, dtype=object)


def _check_only(df: pd.DataFrame) -> pd.Series:
    """Rows that check correctness only (ResultRow.check_only): never results."""
    if "check_only" not in df.columns:
        return pd.Series(False, index=df.index)
    return df["check_only"].map(lambda v: bool(_flag(v)))


def settings(df: pd.DataFrame) -> pd.DataFrame:
    """Per row: shape, layout, link, routing, dtype (with the fp8 scheme), device (what the time
    speaks of: `time_sources`), modeled, pair (with the all-reduce it assumes)."""
    s = pd.DataFrame(index=df.index)
    s["shape"] = [f"{r.model} (E={int(r.num_experts)}, topk={int(r.topk)}, H={int(r.hidden)}, I={int(r.intermediate)})"
                  for r in df.itertuples()]
    s["layout"] = [layout_label(r.tp, r.dp, r.ep, r.world_size) for r in df.itertuples()]
    s["link"] = link_labels(df) if len(df) else pd.Series(dtype=object)
    s["routing"] = df["routing"].astype(str)
    s["dtype"] = precision_labels(df) if len(df) else pd.Series(dtype=object)
    s["device"] = time_sources(df) if len(df) else pd.Series(dtype=object)
    s["modeled"] = df["modeled"].map(lambda v: bool(_flag(v)))
    s["pair"] = (df["prepare_finalize"].astype(str) + "+" + df["experts"].astype(str) + _allreduce_suffix(df)
                 + _layer_suffix(df))
    return s


def _layer_suffix(df: pd.DataFrame) -> pd.Series:
    """' [swigluoai+bias, shared fused, variant gemm]' where a row's layer is not plain silu
    without shared experts, or the row times a variant ('' otherwise; files written before these
    columns read as plain)."""
    def col(name, default):
        return df[name].fillna(default) if name in df.columns else pd.Series(default, index=df.index)

    act, bias, shared = col("activation", "silu").astype(str), col("expert_bias", False), col("shared_experts", "none")
    variant = col("variant", "").astype(str)
    parts = []
    for a, b, sh, v, chk in zip(act, bias, shared.astype(str), variant, _check_only(df)):
        bits = ([a + ("+bias" if _flag(b) else "")] if a != "silu" or _flag(b) else []) + \
            ([f"shared {sh}"] if sh != "none" else []) + ([f"variant {v}"] if v else []) + (["check only"] if chk else [])
        parts.append(f" [{', '.join(bits)}]" if bits else "")
    return pd.Series(parts, index=df.index, dtype=object)


@dataclass
class SeriesLabels:
    """labels: per row the row-side settings that differ (columns `row_keys`) and `series`, the
    name of the column-side series (layout, link, modeled where they differ, then the pair);
    common: the settings every row shares, as phrases ('custom (E=6, ...)', 'fp32', ...)."""

    labels: pd.DataFrame
    row_keys: list[str]
    common: list[str]
    common_keys: list[str] = field(default_factory=list)  # the setting each phrase of `common` states

    @property
    def shape(self) -> str:
        """The shape every row shares ('' where shapes differ)."""
        return self.common[self.common_keys.index("shape")] if "shape" in self.common_keys else ""


def _shape_short(df: pd.DataFrame) -> list[str]:
    """Shape labels by what differs: the model name where names differ, the sizes a name does not
    pin down ('E=16' vs 'E=8' for two custom shapes)."""
    model = df["model"].astype(str)
    fields = [(c, short) for c, short in _SIZES if df.groupby(model)[c].nunique().max() > 1]
    name = model.nunique() > 1
    return [" ".join(([r.model] if name else []) + [f"{short}={int(getattr(r, c))}" for c, short in fields])
            for r in df.itertuples()]


def label_series(df: pd.DataFrame) -> SeriesLabels:
    """Group rows by their full setting (shape, layout, link, routing, precision, device, modeled)
    and name each group by what differs."""
    s = settings(df)
    varies = {k: s[k].nunique() > 1 for k in s.columns}
    # measured rows have no link: the modeled flag tells them apart; links differ among modeled rows
    varies["link"] = s["link"][s["link"] != ""].nunique() > 1
    labels = pd.DataFrame(index=df.index)
    row_keys = []
    for k in ROW_KEYS:
        if varies[k]:
            labels[k] = _shape_short(df) if k == "shape" else s[k]
            row_keys.append(k)
    name = s["pair"]
    if varies["link"]:
        name = s["link"].where(s["link"] == "", s["link"] + " ") + name
    if varies["layout"]:
        name = s["layout"] + " " + name
    # measured and modeled rows differ in `device` (what their time speaks of): rows apart, never one cell
    labels["series"] = name
    common, keys = [], []
    if len(df):
        first = s.iloc[0]
        for k, fmt in (("shape", "{}"), ("layout", "{}"), ("link", "link {}"), ("dtype", "{}"), ("device", "{}"),
                       ("routing", "routing {}")):
            if not varies[k] and first[k] and (k != "link" or (s["link"] != "").all()):
                common.append(fmt.format(first[k]))
                keys.append(k)
    return SeriesLabels(labels, row_keys, common, keys)


def _correct_ok(df: pd.DataFrame) -> pd.Series:
    """Rows that may rank: status ok, timed, not known to be wrong, not a check only."""
    lat = _column(df, "latency_us")
    return ((df["status"] == "ok") & lat.notna() & df["correct"].map(lambda v: _flag(v) is not False)
            & ~_check_only(df))


def _fastest(df: pd.DataFrame, lab: SeriesLabels) -> pd.Series:
    """True where a row is the fastest rankable one of its (row-side setting, tokens)."""
    lat = _column(df, "latency_us").where(_correct_ok(df))
    keys = [lab.labels[k] for k in lab.row_keys] + [df["tokens"]]
    best = lat.groupby(keys).transform("min") if len(df) else lat
    return lat.notna() & (lat == best)


# -- the table of measured rows (sweep output, results.md / .html detail) -----------------------

_PARTS = (("dispatch", "dispatch"), ("experts", "experts"), ("combine", "combine"), ("allreduce", "all-reduce"))


def _other(total: pd.Series, parts: list[pd.Series]) -> pd.Series:
    """total minus the parts where a row has any part (NaN elsewhere); rounding noise reads 0.
    Never negative: where the parts add up to more than the total (real ranks time each part alone
    between barriers, on its slowest rank, while the parts overlap in the whole layer), the
    remainder is unknown (NaN; `overlapping_parts` counts those rows for a note)."""
    known = pd.concat(parts, axis=1)
    other = (total - known.sum(axis=1, min_count=1)).where(known.notna().any(axis=1))
    other = other.where(other.isna() | (other.abs() > 1e-9 * total.abs()), 0.0)
    return other.where(~(other < 0))


def overlapping_parts(rows: Iterable[ResultRow]) -> int:
    """Rows whose timed parts add up to more than their latency (their 'other' is left blank)."""
    n = 0
    for r in rows:
        parts = [v for v in (r.dispatch_us, r.experts_us, r.combine_us, r.allreduce_us) if v is not None]
        if r.latency_us is not None and parts and sum(parts) - r.latency_us > 1e-9 * abs(r.latency_us):
            n += 1
    return n


def _check_cell(status: str, correct) -> str:
    if status == "failed":
        return "failed"
    return {True: "ok", False: "WRONG", None: "unchecked"}[_flag(correct)]


def results_table(df: pd.DataFrame, title: str = "") -> TextTable:
    """Measured (not skipped) rows: tokens, pair, latency (* = fastest correct of its token
    count), the breakdown with the remainder as 'other' (latency minus the parts), metrics and the
    check. Times in us, or ms where every latency is at least 1 ms; units are in the headers."""
    df = df[df["status"] != "skipped"].reset_index(drop=True)
    lab = label_series(df)
    lat = _column(df, "latency_us")
    parts = {name: _column(df, f"{name}_us") for name, _ in _PARTS}
    present = [name for name, _ in _PARTS if parts[name].notna().any()]
    unit, k, td = _time_unit(lat)  # one unit and one number of decimals for every time column
    fastest = _fastest(df, lab)
    cols = [Column(key, key, list(lab.labels[key]), right=False) for key in lab.row_keys]
    cols.append(Column("tokens", "tokens", [str(int(t)) for t in df["tokens"]]))
    cols.append(Column("pair", "pair", list(lab.labels["series"]), right=False))
    cols.append(Column("format", "format", list(df["activation_format"].astype(str)), right=False, drop=100))
    cells = num_cells(lat * k, td)
    cells = ["untimed" if c == "-" and st == "ok" else c for c, st in zip(cells, df["status"])]
    if fastest.any():
        cells = [c + ("*" if f else " ") for c, f in zip(cells, fastest)]
    cols.append(Column("latency", f"latency\n{unit}", cells, styles=["bold green" if f else "" for f in fastest]))
    p10, p90 = _column(df, "p10_us") * k, _column(df, "p90_us") * k
    if p10.notna().any():
        spread = [f"{a}-{b}" if a != "-" else "-" for a, b in zip(num_cells(p10, td), num_cells(p90, td))]
        cols.append(Column("p10-p90", f"p10-p90\n{unit}", spread, drop=80))
    comm = [n for n in present if n != "experts"]
    split = len(comm) >= 2
    for name, header in _PARTS:
        if name in present:
            grouping = dict(group="split", drop=50) if split and name != "experts" else dict(group="breakdown", drop=35)
            cols.append(Column(name, f"{header}\n{unit}", num_cells(parts[name] * k, td), **grouping))
    if split:
        total = sum(parts[n].fillna(0.0) for n in comm).where(pd.concat([parts[n] for n in comm], axis=1).notna().any(axis=1))
        cols.append(Column("comm", f"comm\n{unit}", num_cells(total * k, td), group="breakdown", drop=35,
                           fallback_for="split"))
    if present:
        cols.append(Column("other", f"other\n{unit}", num_cells(_other(lat, [parts[n] for n in present]) * k, td),
                           group="breakdown", drop=35))
    cols.append(Column("tflops", "TFLOP/s", num_cells(_column(df, "tflops")), drop=60))
    cols.append(Column("gbps", "GB/s", num_cells(_column(df, "gbps")), drop=70))
    cols.append(Column("roofline", "roofline", num_cells(_column(df, "roofline_frac")), drop=40))
    cols.append(Column("err", "rel err", num_cells(_column(df, "max_rel_err"), -1), drop=90))
    checks = [_check_cell(st, c) for st, c in zip(df["status"], df["correct"])]
    cols.append(Column("check", "check", checks, right=False,
                       styles=["green" if c == "ok" else "red" if c in ("WRONG", "failed") else "" for c in checks]))
    if "config_source" in df.columns and df["config_source"].fillna("").astype(str).ne("").any():
        cols.append(Column("config", "config", [c if isinstance(c, str) and c else "-" for c in df["config_source"]],
                           right=False, drop=110))
    return TextTable(title, cols)


# -- skipped and failed pairs --------------------------------------------------------------------

#: Short names of the reasons a pair is skipped (first match wins), for the one-line count.
def _skip_reason(reason: str) -> str:
    if reason.startswith("format mismatch"):
        return "format mismatch: a Standard half with a BatchedExperts half"
    return reason


def _skipped_pairs(rows: Iterable[ResultRow]) -> dict[str, list[str]]:
    """Skip reason -> distinct pairs, in the order the sweep met them."""
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        if r.status == "skipped":
            pairs = by_reason.setdefault(_skip_reason(r.reason), [])
            pair = f"{r.prepare_finalize}+{r.experts}"
            if pair not in pairs:
                pairs.append(pair)
    return by_reason


def skipped_summary(rows: Iterable[ResultRow]) -> str | None:
    """'skipped 33 pairs (--show-skipped lists them): 18 format mismatch, 7 not on cpu, ...'."""
    kinds: dict[str, set[str]] = {}
    for reason, pairs in _skipped_pairs(rows).items():
        kinds.setdefault(skip_kind(reason), set()).update(pairs)
    if not kinds:
        return None
    n = len(set().union(*kinds.values()))
    counts = sorted(kinds.items(), key=lambda kv: -len(kv[1]))
    return f"skipped {n} pairs (--show-skipped lists them): " + ", ".join(f"{len(p)} {k}" for k, p in counts)


def skipped_lines(rows: Iterable[ResultRow], width: int = 80) -> list[str]:
    """Every skipped pair under its reason, wrapped at `width`."""
    by_reason = _skipped_pairs(rows)
    if not by_reason:
        return []
    n = sum(len(v) for v in by_reason.values())
    wrap = dict(width=max(width, 20), break_long_words=False, break_on_hyphens=False)
    lines = textwrap.wrap(f"skipped pairs ({n}; the results files keep one row per pair and token count):", **wrap)
    for reason, pairs in by_reason.items():
        lines += textwrap.wrap(f"{reason} ({len(pairs)}):", initial_indent="  ", subsequent_indent="  ", **wrap)
        lines += textwrap.wrap(", ".join(pairs), initial_indent="    ", subsequent_indent="    ", **wrap)
    return lines


def failed_lines(rows: Iterable[ResultRow]) -> list[str]:
    """One line per failure reason: the pairs (with their token counts) and the reason."""
    by_reason: dict[str, dict[str, list[int]]] = {}
    for r in rows:
        if r.status == "failed":
            by_reason.setdefault(r.reason, {}).setdefault(f"{r.prepare_finalize}+{r.experts}", []).append(r.tokens)
    def where(pair: str, tokens: list[int]) -> str:
        return f"{pair} (M={','.join(map(str, tokens))})"

    return [f"failed: {', '.join(where(p, t) for p, t in pairs.items())}: {reason}" for reason, pairs in by_reason.items()]


def row_notes(rows: list[ResultRow]) -> list[str]:
    notes = []
    if any(r.device == "cpu" and r.latency_us is not None for r in rows):
        notes.append("CPU times are wall clock: they test correctness and plumbing, not kernel speed.")
    def gpu(r: ResultRow) -> str:
        v = r.extra.get("modeled_gpu")
        return v if isinstance(v, str) else ""

    if any(r.modeled and not gpu(r) for r in rows):
        notes.append("modeled rows: the experts time is measured on this device for one rank's share; "
                     "communication comes from the cost model, not a measurement.")
    gpus = sorted({gpu(r) for r in rows if r.modeled and gpu(r)})
    if gpus:
        notes.append(f"rows '{gpus[0]} (modeled)'{' and the like' if len(gpus) > 1 else ''}: the experts time is "
                     "that GPU's roofline floor for one rank's share and the communication comes from the cost "
                     "model; neither was measured here.")
    if any(r.check_only for r in rows):
        notes.append("rows marked check only: correctness checks of the modeled rows on this machine's ranks, "
                     "at a stand-in shape; they are not results and are never ranked.")
        notes += sorted({r.reason.split("; ", 1)[-1] for r in rows if r.modeled and r.status == "ok"})
    if any(r.experts_us is not None for r in rows):
        notes.append("other = latency minus the parts shown (routing, alignment, work outside the timed parts).")
        over = overlapping_parts(rows)
        if over:
            notes.append(f"other is blank at {over} row{'s' if over > 1 else ''}: their parts add up to more than the "
                         "whole layer (rows of a run that timed each part alone between barriers; runs now time "
                         "the parts inside the layer's own runs, on each run's slowest rank).")
    if any(r.latency_us is not None for r in rows):
        notes.append("* = fastest correct entry for its token count.")
    return notes


def print_rows(rows: Iterable[ResultRow], console: Console | None = None, title: str = "moebench sweep",
               show_skipped: bool = False) -> None:
    """The sweep's table (fitted to the console), the skipped pairs (a one-line count by reason,
    or all of them with `show_skipped`), failures with their reasons, and notes."""
    rows = list(rows)
    console = console or Console()
    df = frame(rows)
    left = []
    if (df["status"] != "skipped").any():
        left = print_table(console, results_table(df, title))
    if show_skipped:
        for line in skipped_lines(rows, console.width):
            console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
    else:
        line = skipped_summary(rows)
        if line:
            say(console, line)
    for line in failed_lines(rows):
        say(console, line)
    notes = row_notes(rows)
    if left:
        notes.append(f"not shown at {console.width} columns: {', '.join(left)} (the results files hold every column).")
    for n in notes:
        say(console, n, "dim")


# -- compare tp-vs-ep ----------------------------------------------------------------------------

def _allreduce_suffix(df: pd.DataFrame) -> pd.Series:
    """' (custom)' / ' (nccl)' after a TP pair: which all-reduce the row's time assumes."""
    if "allreduce" not in df:
        return pd.Series("", index=df.index)
    return df["allreduce"].fillna("").astype(str).map(lambda a: f" ({a} AR)" if a else "")


def compare_table(summary: pd.DataFrame, title: str) -> TextTable:
    """compare tp-vs-ep's summary: per token count and candidate layout the transport it runs over,
    its breakdown (experts, communication, the remainder as 'other'), the total (* = the fastest
    layout that fits and that an engine runs), the one-sided flip factor, the batch it holds."""
    df = summary.reset_index(drop=True)
    lat = _column(df, "latency_us")
    parts = {name: _column(df, f"{name}_us") for name, _ in _PARTS}
    unit, k, td = _time_unit(lat)
    via = []
    for _, r in df.iterrows():
        if str(r.get("kind", "")) == "dp-ep" or r.get("dispatch_us") == r.get("dispatch_us") and r.get("dispatch_us") is not None:
            via.append(str(r.prepare_finalize))
        else:
            via.append(f"{r.allreduce} AR" if isinstance(r.get("allreduce"), str) and r.allreduce else str(r.prepare_finalize))
    cols = [Column("tokens", "batch\ntokens", [str(int(t)) for t in df["tokens"]]),
            Column("layout", "layout", list(df["layout"].astype(str)), right=False),
            Column("via", "via", via, right=False),
            Column("pair", "experts", list(df["experts"].astype(str)), right=False, drop=70)]
    cols.append(Column("experts", f"experts\n{unit}", num_cells(parts["experts"] * k, td)))
    comm = _column(df, "comm_us")
    cols.append(Column("comm", f"comm\n{unit}", num_cells(comm * k, td)))
    other = _other(_column(df, "latency_serial_us") if "latency_serial_us" in df.columns else lat,
                   [parts[n] for n, _ in _PARTS if parts[n].notna().any()])
    cols.append(Column("other", f"other\n{unit}", num_cells(other * k, td), drop=35))
    win = df["winner"].map(lambda v: bool(_flag(v))) if "winner" in df.columns else pd.Series(False, index=df.index)
    ovl = df["overlap"].eq("two-batch") if "overlap" in df.columns else pd.Series(False, index=df.index)
    cols.append(Column("total", f"total\n{unit}", [c + ("*" if w else ("~" if o else " ")) for c, w, o in
                                                   zip(num_cells(lat * k, td), win, ovl)],
                       styles=["bold green" if w else "" for w in win]))
    if "overlap" in df.columns:
        cols.append(Column("ovl", "ovl", ["2b" if o else "" for o in ovl], right=False, drop=50))
    if "latency_lo_us" in df.columns and "latency_hi_us" in df.columns:
        lo, hi = _column(df, "latency_lo_us") * k, _column(df, "latency_hi_us") * k
        cols.append(Column("band", f"band\n{unit}", ["" if pd.isna(a) else f"{a}-{b}" for a, b in
                                                     zip(num_cells(lo, td), num_cells(hi, td))], drop=55))
    if "comm_flip_factor" in df.columns:
        flips = _column(df, "comm_flip_factor")
        close = df["too_close"].map(lambda v: bool(_flag(v))) if "too_close" in df.columns else pd.Series(False, index=df.index)
        cells = ["never" if f == float("inf") else ("-" if pd.isna(f) else f"{f:.2f}") for f in flips]
        cols.append(Column("flip", "flip\nx", [c + (" close" if t and w else "") for c, t, w in zip(cells, close, win)],
                           styles=["yellow" if t and w else "" for t, w in zip(close, win)]))
    if "fits" in df.columns:
        held = []
        for _, r in df.iterrows():
            if r.get("fits") is False:
                held.append("no fit")
            elif not bool(r.get("deployable", True)):
                held.append("no engine")
            elif r.get("sequences") is not None and r.get("sequences") == r.get("sequences"):
                held.append(str(int(r.sequences)))
            else:
                held.append("-")
        cols.append(Column("holds", "holds", held))
    if "rank_imbalance" in df.columns:
        cols.append(Column("imb", "rank\nimb.", num_cells(_column(df, "rank_imbalance"), 2), drop=60))
    if "checked_on_ranks" in df.columns:
        checked = [{True: "yes", False: "NO", None: "-"}[_flag(v)] for v in df["checked_on_ranks"]]
        cols.append(Column("checked", "checked", checked, right=False, drop=40,
                           styles=["red" if c == "NO" else "" for c in checked]))
    return TextTable(title, cols)


# -- merged reports over result folders ---------------------------------------------------------

def pivot(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rows: the row-side settings that differ (shape, dtype, device, routing) and tokens; columns:
    one per series (the pair, with the layout, link and modeled flag where they differ); values:
    latency_us of correct ok rows. Plus a same-shaped boolean frame marking the fastest entry of
    each row. An `imbalance` column (max/mean tokens per expert) sits after the index.
    table.attrs: 'common' (the settings every row shares), 'repeats' (cells that hold more than one
    run of the same setting; the fastest is shown)."""
    ok = df[_correct_ok(df)].copy()
    if ok.empty:
        return pd.DataFrame(), pd.DataFrame()
    lab = label_series(ok)
    ok = ok.drop(columns=[c for c in lab.labels.columns if c in ok.columns]).join(lab.labels)
    ok["latency_us"] = _column(ok, "latency_us")
    ok["imbalance"] = _column(ok, "imbalance")
    idx = lab.row_keys + ["tokens"]
    table = ok.pivot_table(index=idx, columns="series", values="latency_us", aggfunc="min")
    counts = ok.pivot_table(index=idx, columns="series", values="latency_us", aggfunc="count")
    fastest = table.eq(table.min(axis=1), axis=0)
    table.insert(0, "imbalance", ok.groupby(idx).imbalance.mean())
    fastest.insert(0, "imbalance", False)
    table, fastest = table.reset_index(), fastest.reset_index(drop=True)
    table.columns.name = fastest.columns.name = None
    table.attrs.update(common=lab.common, repeats=int((counts > 1).sum().sum()))
    return table, fastest


def _wrap_header(label: str, width: int = 12) -> str:
    """A series name on a few lines (at spaces, and before the '+' of a long pair)."""
    words: list[str] = []
    for w in label.split(" "):
        if "+" in w and len(w) > width:
            a, b = w.split("+", 1)
            words += [a, "+" + b]
        else:
            words.append(w)
    lines: list[str] = []
    for w in words:
        if lines and len(lines[-1]) + 1 + len(w) <= width:
            lines[-1] += " " + w
        else:
            lines.append(w)
    return "\n".join(lines)


def pivot_table_text(table: pd.DataFrame, fastest: pd.DataFrame, title: str) -> TextTable:
    """The pivot for the console: the series that are fastest most often come first to stay; the
    others are left out first when the console is narrow."""
    series = [c for c in fastest.columns if c != "imbalance"]
    index = [c for c in table.columns if c not in fastest.columns]
    unit, k, td = _time_unit(pd.concat([table[s] for s in series]))
    best = table[series].min(axis=1)
    score = sorted(series, key=lambda s: (-int(fastest[s].sum()), float((table[s] / best).mean())))
    cols = [Column(c, c, [str(int(v)) if c == "tokens" else str(v) for v in table[c]], right=c == "tokens")
            for c in index]
    cols.append(Column("imbalance", "imbalance", num_cells(table["imbalance"], 2), drop=1000))
    for s in series:
        cells = [c + ("*" if f else " ") for c, f in zip(num_cells(table[s] * k, td), fastest[s])]
        cols.append(Column(s, _wrap_header(s), cells, drop=10 + score.index(s), name=s,
                           styles=["bold green" if f else "" for f in fastest[s]]))
    t = TextTable(f"{title} (latency {unit}; * fastest correct)", cols)
    return t


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


_CSS = ("<style>body{font-family:sans-serif;margin:2em;max-width:80em} table{border-collapse:collapse;font-size:13px;"
        "margin:.5em 0 1.5em} td,th{border:1px solid #ccc;padding:3px 6px;text-align:right} th{background:#f3f3f3}"
        " td.l,th.l{text-align:left} td.best{background-color:#c6efce;font-weight:bold} .note{color:#555}</style>")


def html_report(df: pd.DataFrame, table: pd.DataFrame, fastest: pd.DataFrame, png: bytes | None, title: str) -> str:
    """One self-contained HTML page: pivot (fastest highlighted), plot (inline PNG), all rows."""
    import base64

    img = f'<img alt="latency vs tokens" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>' if png else ""
    modeled = "<p>Rows marked (modeled) take communication time from the cost model.</p>" if df.modeled.any() else ""
    cpu = "<p>CPU rows are wall clock: they test correctness and plumbing, not kernel speed.</p>" if (df.device == "cpu").any() else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_html.escape(title)}</title>{_CSS}</head><body>"
            f"<h1>{_html.escape(title)}</h1>{modeled}{cpu}<h2>latency (us), fastest correct per row highlighted</h2>"
            f"{pivot_html(table, fastest) if not table.empty else '<p>no correct rows</p>'}{img}"
            f"<h2>all rows</h2>{_html_table(results_table(df).columns)}</body></html>")


# -- the run report (results.md / results.html) -------------------------------------------------

def _md_table(cols: list[Column]) -> str:
    esc = lambda s: s.strip().replace("|", "\\|")  # noqa: E731
    n = len(cols[0].cells) if cols else 0
    lines = ["| " + " | ".join(esc(c.label) for c in cols) + " |",
             "|" + "|".join("---:" if c.right else "---" for c in cols) + "|"]
    lines += ["| " + " | ".join(esc(c.cells[i]) for c in cols) + " |" for i in range(n)]
    return "\n".join(lines) + "\n"


def _html_table(cols: list[Column]) -> str:
    n = len(cols[0].cells) if cols else 0

    def cell(tag: str, c: Column, text: str, best: bool = False) -> str:
        cls = " ".join(x for x in ("" if c.right else "l", "best" if best else "") if x)
        attr = f' class="{cls}"' if cls else ""
        return f"<{tag}{attr}>{_html.escape(text.strip())}</{tag}>"

    head = "".join(cell("th", c, c.label) for c in cols)
    body = "".join("<tr>" + "".join(cell("td", c, c.cells[i], c.key == "latency" and c.cells[i].endswith("*"))
                                    for c in cols) + "</tr>" for i in range(n))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def best_table(df: pd.DataFrame) -> list[Column]:
    """Per (row-side setting, tokens): the fastest correct pair, its latency and metrics, and the
    runner-up with how much slower it is."""
    ok = df[_correct_ok(df)].reset_index(drop=True)
    if ok.empty:
        return []
    lab = label_series(ok)
    ok = ok.assign(_lat=_column(ok, "latency_us"), _series=lab.labels["series"])
    keys = lab.row_keys
    for k in keys:
        ok[f"_k_{k}"] = lab.labels[k]
    groups = ok.sort_values("_lat").groupby([f"_k_{k}" for k in keys] + ["tokens"], sort=True)
    recs = []
    for _, g in groups:
        a = g.iloc[0]
        others = g[g["_series"] != a["_series"]]  # the runner-up is another pair, never the winner run again
        b = others.iloc[0] if len(others) else None
        recs.append((a, b))
    unit, k, td = _time_unit(ok["_lat"])
    cols = [Column(key, key, [str(a[f"_k_{key}"]) for a, _ in recs], right=False) for key in keys]
    cols.append(Column("tokens", "tokens", [str(int(a.tokens)) for a, _ in recs]))
    cols.append(Column("pair", "fastest pair", [str(a._series) for a, _ in recs], right=False))
    cols.append(Column("latency", f"latency {unit}", num_cells([a._lat * k for a, _ in recs], td)))
    cols.append(Column("tflops", "TFLOP/s", num_cells([a.get("tflops") for a, _ in recs])))
    cols.append(Column("gbps", "GB/s", num_cells([a.get("gbps") for a, _ in recs])))
    cols.append(Column("roofline", "roofline", num_cells([a.get("roofline_frac") for a, _ in recs])))
    cols.append(Column("next", "next best", ["-" if b is None else f"{b._series} ({b._lat / a._lat:.2f}x)"
                                              if a._lat else str(b._series) for a, b in recs], right=False))
    return cols


def _what_ran(df: pd.DataFrame, meta: dict, lab: SeriesLabels) -> list[str]:
    rows = [ResultRow.from_dict(r) for r in df.to_dict("records")]
    s = settings(df)
    lines = []
    values = {k: [v for v in dict.fromkeys(s[k]) if v] for k in ("shape", "layout", "link", "dtype", "device", "routing")}
    varying = [f"{k}: {', '.join(v)}" for k, v in values.items() if v and k not in lab.common_keys]
    common = [c for c in lab.common if c != lab.shape]  # the shape is in the title
    lines.append("settings: " + "; ".join(([", ".join(common)] if common else []) + varying))
    tokens = sorted({int(t) for t in df["tokens"]})
    measured = [r for r in rows if r.status == "ok"]
    failed = [r for r in rows if r.status == "failed"]
    skipped = {f"{r.prepare_finalize}+{r.experts}" for r in rows if r.status == "skipped"}
    lines.append(f"token counts: {', '.join(map(str, tokens))}; {len(measured)} rows measured "
                 f"({len({(r.prepare_finalize, r.experts) for r in measured})} pairs), {len(failed)} failed, "
                 f"{len(skipped)} pairs skipped")
    if meta.get("mode"):
        lines.append(f"mode: {meta['mode']}")
    link = meta.get("link")
    if isinstance(link, dict) and link.get("name"):
        lines.append(f"link: {link['name']} {link.get('bandwidth_gbps', 0):g} GB/s per direction, "
                     f"{link.get('latency_us', 0):g} us per step ({link.get('source', '')})"
                     + (f"; {meta['link_why']}" if meta.get("link_why") else ""))
    dev = meta.get("device_summary") or {}
    if dev:
        versions = ", ".join(f"{k} {dev[k]}" for k in ("torch", "triton", "cuda") if dev.get(k))
        lines.append(f"on: {dev.get('name', dev.get('device', '?'))}" + (f" ({versions})" if versions else ""))
    if meta.get("argv"):
        lines.append("command: moebench " + " ".join(map(str, meta["argv"])))
    stamp = ", ".join(f"{k} {meta[k]}" for k in ("git_revision", "started", "host") if meta.get(k))
    if stamp:
        lines.append(stamp)
    return lines


def run_report(df: pd.DataFrame, meta: dict | None = None, fmt: str = "md") -> str:
    """results.md / results.html of a run: what ran and on what, the fastest correct pair per
    token count, every measured row (the table the sweep prints, with every column), then the
    skipped and failed pairs with their reasons. csv / json keep every column of every row."""
    meta = meta or {}
    rows = [ResultRow.from_dict(r) for r in df.to_dict("records")]
    lab = label_series(df)
    command = meta.get("command", "results")
    title = f"moebench {command}" + (f": {lab.shape}" if lab.shape else "")
    sections: list[tuple[str, str, object]] = [("", "list", _what_ran(df, meta, lab)) if len(df) else ("", "text", "no rows")]
    notes = [n for n in row_notes(rows) if not n.startswith("* =")]
    if notes:
        sections.append(("", "notes", notes))
    best = best_table(df)
    if best:
        sections.append(("Fastest correct pair per token count", "table", best))
    detail = results_table(df)
    if detail.nrows:
        sections.append(("Measured rows", "table", detail.fit(10**9)[0]))  # every column that applies
    not_run = [f"skipped, {reason} ({len(pairs)}): {', '.join(pairs)}" for reason, pairs in _skipped_pairs(rows).items()]
    not_run += failed_lines(rows)
    if not_run:
        sections.append(("Not run", "list", not_run))
    sections.append(("", "notes", ["Every column of every row is in results.csv and results.json"
                                   " (and results.parquet where written)."]))
    return _render_md(title, sections) if fmt == "md" else _render_html(title, sections)


def _render_md(title: str, sections) -> str:
    out = [f"# {title}", ""]
    for head, kind, body in sections:
        if head:
            out += [f"## {head}", ""]
        if kind == "table":
            out.append(_md_table(body))
        elif kind == "list":
            out += [f"- {x}" for x in body] + [""]
        elif kind == "notes":
            out += [f"*{x}*" for x in body] + [""]
        else:
            out += [str(body), ""]
    return "\n".join(out).rstrip() + "\n"


def _render_html(title: str, sections) -> str:
    esc = _html.escape
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>{_CSS}</head><body>",
           f"<h1>{esc(title)}</h1>"]
    for head, kind, body in sections:
        if head:
            out.append(f"<h2>{esc(head)}</h2>")
        if kind == "table":
            out.append(_html_table(body))
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{esc(x)}</li>" for x in body) + "</ul>")
        elif kind == "notes":
            out += [f"<p class='note'>{esc(x)}</p>" for x in body]
        else:
            out.append(f"<p>{esc(str(body))}</p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
