"""Rebuild a tuned-config file from a `moebench tune` report.md (its "file:" line and winner column).

    python scripts/configs_from_report.py REPORT.md [--out moebench/configs] [--triton-version 3.6.0]

For results that come back without the JSON file itself (the device tool does not return file
names holding '=' and ','): the report names the file and lists each token count's winner, which
is exactly what the tuner wrote into it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from moebench.kernels.tuned_files import write_config_file
from moebench.tuning.space import from_key

_KEY = re.compile(r"^M(\d+),N(\d+),K(\d+),G(\d+),w(\d+),s(\d+)$")


def parse_report(text: str) -> tuple[str, dict[int, dict[str, int]]]:
    """(file name, {tokens: winner config}) from a tune report.md."""
    name = re.search(r"- file: `([^`]+)`", text)
    if not name:
        raise SystemExit("no '- file:' line in the report")
    table: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0].isdigit() and _KEY.match(cells[1]):
            table[int(cells[0])] = dict(from_key(int(v) for v in _KEY.match(cells[1]).groups()))
    if not table:
        raise SystemExit("no winner rows in the report")
    return Path(name.group(1)).name, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("--out", type=Path, default=Path("results/configs"))
    ap.add_argument("--triton-version", default=None)
    a = ap.parse_args()
    name, table = parse_report(a.report.read_text())
    print(write_config_file(a.out / name, table, a.triton_version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
