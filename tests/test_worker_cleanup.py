"""A tune stopped by a signal leaves no worker behind: every spawned tuning process asks Linux to
kill it with its parent (moebench.tuning.precompile.die_with_parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

PARENT = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    sys.path.insert(0, sys.argv[1])
    import child
    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=child.main, args=(sys.argv[1] + "/ready",))
        p.start()
        print(p.pid, flush=True)
        time.sleep(600)
""")
CHILD = textwrap.dedent("""
    import pathlib, sys, time
    from moebench.tuning.precompile import die_with_parent
    def main(ready):
        die_with_parent()
        pathlib.Path(ready).touch()
        time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_spawned_worker_dies_with_its_parent(tmp_path, sig):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    child = int(parent.stdout.readline())
    deadline = time.time() + 120  # the child imports torch first: slow on a loaded machine
    while not (tmp_path / "ready").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "ready").exists() and _alive(child), "the child never called die_with_parent"
    parent.send_signal(sig)
    parent.wait(timeout=30)
    deadline = time.time() + 20
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the spawned worker outlived its parent"
