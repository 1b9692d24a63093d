"""A tune stopped by a signal leaves no worker behind: every worker process (tuning, compile, rank)
exits with the process that started it (moebench.runtime.processes.die_with_parent)."""

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
    from moebench.runtime.processes import die_with_parent
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


SPAWNER = textwrap.dedent("""
    import sys, time
    from moebench.runtime.distributed import spawn
    def wait(ctx):
        time.sleep(600)
    if __name__ == "__main__":
        print("started", flush=True)
        spawn(wait, 2, "cpu")
""")


def test_killed_parent_of_ranks_leaves_no_leaked_semaphore(tmp_path):
    """kill -9 of a process running ranks: the ranks die with it, and multiprocessing's resource
    tracker has nothing to warn about (rank results travel over pipes, not a semaphore-backed queue)."""
    (tmp_path / "spawner.py").write_text(SPAWNER)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "spawner.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert parent.stdout.readline().strip() == "started"
    time.sleep(3)  # the ranks are up (importing torch) or starting
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    err = parent.stderr.read()  # until every process holding the pipe (the tracker included) is gone
    assert "leaked" not in err, err
