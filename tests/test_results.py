"""The run folder: rows appended as measured, a crash-cut line ignored, resume by key, exports."""

import json

import pandas as pd
import pytest

from moebench.errors import MoebenchError
from moebench.report import write_exports
from moebench.results import CORE_COLUMNS, ResultRow, RunStore, load_rows


def _row(tokens, **kw):
    base = dict(model="m", num_experts=4, topk=2, hidden=8, intermediate=8, tokens=tokens, tp=1, dp=1, ep=1,
                world_size=1, prepare_finalize="no-dpep", experts="torch", activation_format="Standard",
                dtype="fp32", device="cpu", routing="uniform", latency_us=1.5, correct=True)
    base.update(kw)
    return ResultRow(**base)


def test_rows_survive_a_crash_and_resume_skips_them(tmp_path):
    store = RunStore(tmp_path / "run", metadata={"command": "test"})
    store.add(_row(1))
    store.add(_row(2, extra={"pairs_per_rank": "3,4"}))
    # a crash in the middle of writing the third row leaves half a line
    with open(tmp_path / "run" / "rows.jsonl", "a") as f:
        f.write('{"model": "m", "tokens": 3, "num_exp')
    again = RunStore(tmp_path / "run")
    assert [r.tokens for r in again.rows] == [1, 2]
    assert again.has(_row(2).key()) and not again.has(_row(3).key())
    assert again.rows[1].extra == {"pairs_per_rank": "3,4"}
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())
    assert meta["command"] == "test" and "git_revision" in meta


def test_ctrl_c_after_a_row_is_written_whole_keeps_it_and_during_its_write_drops_it(tmp_path, monkeypatch):
    # Ctrl-C landing in the fsync after a whole line (a loaded machine: the signal waits there) keeps
    # the finished row on disk and in the store; one landing mid-write leaves no torn line and no row
    import moebench.fileio as fileio

    store = RunStore(tmp_path / "run", metadata={"command": "test"})
    store.add(_row(1))

    def interrupted_fsync(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(fileio.os, "fsync", interrupted_fsync)
    with pytest.raises(KeyboardInterrupt):
        store.add(_row(2))
    monkeypatch.undo()
    assert [r.tokens for r in store.rows] == [1, 2] and [r.tokens for r in RunStore(tmp_path / "run").rows] == [1, 2]
    real_write = fileio.os.write

    def half_then_interrupted(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise KeyboardInterrupt

    monkeypatch.setattr(fileio.os, "write", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.add(_row(3))
    monkeypatch.undo()
    assert [r.tokens for r in store.rows] == [1, 2]
    assert (tmp_path / "run" / "rows.jsonl").read_bytes().endswith(b"}\n")
    assert [r.tokens for r in RunStore(tmp_path / "run").rows] == [1, 2]


def test_exports_have_the_design_columns_first(tmp_path):
    store = RunStore(tmp_path / "run")
    store.add(_row(1))
    store.add(_row(4, status="skipped", reason="format mismatch", latency_us=None, correct=None))
    written = write_exports(store, ["csv", "json", "md", "html"])
    assert {p.suffix for p in written} == {".csv", ".json", ".md", ".html"}
    df = pd.read_csv(tmp_path / "run" / "results.csv")
    assert list(df.columns[: len(CORE_COLUMNS)]) == CORE_COLUMNS
    assert not list((tmp_path / "run").glob(".*tmp"))  # atomic writes leave no temporaries
    rows = load_rows([tmp_path / "run"])
    assert [r.status for r in rows] == ["ok", "skipped"]
    assert load_rows([tmp_path / "run" / "results.csv"])[1].reason == "format mismatch"


def test_load_rows_errors(tmp_path):
    with pytest.raises(MoebenchError, match="does not exist"):
        load_rows([tmp_path / "missing.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(MoebenchError, match="no rows.jsonl"):
        load_rows([tmp_path / "empty"])
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(MoebenchError, match="not a moebench results file"):
        load_rows([bad])
