"""Every pair of backends that `check_combination` calls runnable here does run: a sweep over all
of them (one process, and two real ranks) skips exactly the pairs it refuses, and every other row
ran and matched the float64 reference."""

from __future__ import annotations

import json

import pytest
import torch

from moebench.backends import check_combination, experts_names, prepare_finalize_names
from moebench.layout import ParallelLayout
from test_cli import moebench_inproc

SIZES = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--dtype", "fp32",
         "--reps", "1", "--tokens", "3", "--experts", "all", "--prepare-finalize", "all"]


@pytest.mark.parametrize("layout_args", [[], ["--world-size", "2", "--ep", "2"]], ids=["one-process", "ep2-ranks"])
def test_every_pair_called_runnable_runs(tmp_path, layout_args):
    res = moebench_inproc("sweep", *SIZES, *layout_args, "--device", "cpu", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in next(tmp_path.rglob("rows.jsonl")).read_text().splitlines() if line]
    lay = ParallelLayout.from_args(None, None, 2) if layout_args else ParallelLayout()
    seen = set()
    for r in rows:
        pf, ex = r["prepare_finalize"], r["experts"]
        seen.add((pf, ex))
        reason = check_combination(pf, ex, "cpu", torch.float32, lay.world_size, lay.enable_ep)
        if reason is not None:
            assert r["status"] == "skipped", (pf, ex, r["reason"])
            continue
        if r["status"] == "skipped":  # refused by the sweep's own rule (a DP layout needs a token exchange)
            assert lay.dp > 1 and "token exchange" in r["reason"], (pf, ex, r["reason"])
            continue
        assert r["status"] == "ok" and r["correct"] is True, (pf, ex, r["status"], r["reason"], r["max_rel_err"])
    assert seen == {(pf, ex) for pf in prepare_finalize_names() for ex in experts_names() if ex != "reference"}
