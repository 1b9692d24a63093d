"""`report`: tables and figures from earlier result folders."""

from __future__ import annotations

from pathlib import Path

import click

from moebench.cli.options import console, err_console
from moebench.errors import MoebenchError


@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["md", "csv", "html"]), default="md", show_default=True)
@click.option("--out", "out_file", type=click.Path(path_type=Path), default=None,
              help="Report file (default: report.<format> in the first results folder).")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="PNG of latency vs tokens.")
def report(results, fmt, out_file, plot_path):
    """Merge result folders: pivot (tokens x backend pairs), fastest correct entry highlighted, export."""
    from moebench.plots import latency_plot
    from moebench.report import frame, html_report, pivot, pivot_markdown, pivot_table_text, print_table, say
    from moebench.plots import check_plot_file
    from moebench.results import atomic_write_text, check_output_file, load_rows

    problems: list[str] = []  # a damaged or empty folder is one line; the others are reported
    rows = load_rows(results, problems)
    if not rows:  # nothing to report: the first problem is the error, one line
        load_rows(results)
        raise MoebenchError("the results hold no rows")
    for line in problems:  # one line each, however long (soft wrap): a script can count them
        err_console.print(f"notice: {line}", markup=False, highlight=False, soft_wrap=True)
    df = frame(rows)
    table, fastest = pivot(df)
    common = table.attrs.get("common", []) if not table.empty else []
    title = "moebench report" + (": " + ", ".join(common) if common else "")
    first = results[0] if results[0].is_dir() else results[0].parent
    out_file = out_file or first / f"report.{fmt}"
    check_output_file(out_file, "--out")  # before the plot and the report are made
    if plot_path is not None:
        check_plot_file(plot_path)
    png = None
    if plot_path is not None or fmt == "html":
        import tempfile

        target = plot_path or Path(tempfile.mkdtemp()) / "latency.png"
        latency_plot(df, title, target)
        png = target.read_bytes()
    if fmt == "md":
        atomic_write_text(out_file, f"# {title}\n\n" + (pivot_markdown(table, fastest) if not table.empty else "no correct rows\n"))
    elif fmt == "csv":
        atomic_write_text(out_file, table.to_csv(index=False))
    else:
        atomic_write_text(out_file, html_report(df, table, fastest, png, title))
    checks = sum(r.check_only and r.status == "ok" for r in rows)
    if not table.empty:
        left = print_table(console, pivot_table_text(table, fastest, title))
        if table.attrs.get("repeats"):
            say(console, f"{table.attrs['repeats']} cells hold more than one run of the same setting: "
                         "the fastest is shown.", "dim")
        if left:
            say(console, f"not shown at {console.width} columns: {', '.join(left)} (the report file has them).", "dim")
    if checks:
        say(console, f"left out {checks} check-only row{'s' if checks > 1 else ''} (compare tp-vs-ep's correctness "
                     "checks on this machine's ranks, at a stand-in shape): not results.", "dim")
    say(console, f"wrote {out_file}" + (f" and {plot_path}" if plot_path else ""))
