"""Where moebench's worker processes start, and how they end with the process that started them.

Ranks (`distributed.spawn`), tuning workers and compile workers start from multiprocessing's fork
server: a fresh interpreter that imports torch, moebench and the workers' module once and then
forks each worker. A worker so costs a fork, not an interpreter start and a torch import, and the
server touches no GPU, so CUDA is as safe as with "spawn". Two things differ from "spawn", and
`start_worker` puts them right first thing in every worker:

- the environment: a forked worker has the server's (the one of the process's first worker), so
  the caller's current environment travels with the worker and replaces it;
- the parent: a worker's parent process is the server, which stays up while any of its workers
  does, so a worker watches the process that asked for it and exits when that one is gone.

Modules are imported by the server with the environment of the first worker's start (a variable
read at import time, such as TRITON_INTERPRET, keeps that value for every later worker).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import threading
import time

from moebench.results import pid_alive


def worker_context(module: str | None = None):
    """The multiprocessing context workers start from: the fork server with torch, moebench and
    `module` imported (where the platform has no fork server: "spawn")."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "moebench"] + ([module] if module else []))
    return ctx


def die_with_parent() -> None:
    """End this process as soon as the process that started it (multiprocessing's parent: the
    spawner, not the fork server) is gone, killed with -9 too: a worker left behind would go on
    holding the GPU, computing and writing into a run folder. A thread waits on the parent (a
    pidfd where the platform has one, else a poll every 0.2 s)."""
    parent = mp.parent_process()
    if parent is None:
        return
    parent_pid = parent.pid
    if not pid_alive(parent_pid):
        os._exit(1)
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # no pidfd here, or the parent is already gone
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
        else:
            while pid_alive(parent_pid):
                time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="moebench-parent-watch", daemon=True).start()


def start_worker(environ: dict[str, str] | None) -> None:
    """First thing in a worker: die with the parent, take the caller's environment (`environ`,
    the caller's `dict(os.environ)` at the worker's start; None keeps this process's)."""
    die_with_parent()
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
