"""Process groups for multi-rank runs: spawn N local processes, or join a torchrun job.

    results = spawn(fn, world_size=4, device="cpu")   # fn(ctx, *args) on every rank
    ctx = join_torchrun()                             # under torchrun: RANK / WORLD_SIZE set

Backends: gloo on CPU, NCCL on CUDA (one GPU per rank, rank i on cuda:i). With fewer GPUs than
ranks (`spawn(..., share_gpus=True)`), ranks share them, rank i on cuda:(i % GPUs), over a gloo
group (NCCL refuses two ranks on one device); such a run's RankContext says how many ranks share
a GPU (`ranks_per_gpu`), and its times are not those of one GPU per rank. Every process group is
created with a timeout, so a collective whose peer died raises instead of hanging. `spawn` also
watches its children: a rank that raises sends its error and traceback back and the parent raises
`RankFailedError` naming the rank; a rank that dies without reporting (killed, os._exit) is noticed
from its exit code; in both cases the other ranks are terminated at once. A rank dies with the
process that spawned it, even one killed with SIGKILL (it never runs on alone).

Ranks start from a fork server (`moebench.runtime.processes`): a rank costs a fork, not an
interpreter start and a torch import, and runs with the environment of its `spawn` call.

Only rank 0 prints and writes files: guard output with `is_main(ctx)`.
"""

from __future__ import annotations

import datetime
import io
import os
from multiprocessing import connection as mp_connection
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from moebench.errors import MoebenchError, WriteError, one_line
from moebench.runtime.processes import start_worker, worker_context

#: Environment every spawned rank gets (required on the shared GPU hosts: no NVLink multicast).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

DEFAULT_TIMEOUT_S = 300.0


class RankFailedError(MoebenchError):
    """A rank of a multi-rank run raised, died, or did not finish in time.

    rank: the failing rank (None when the whole run timed out); traceback: the rank's traceback
    text when it reported one.
    """

    def __init__(self, message: str, rank: int | None = None, traceback_text: str = "",
                 write_fault: tuple[str, int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback_text
        #: (path, errno) where the rank stopped on a disk fault (a WriteError): the parent raises that
        self.write_fault = write_fault


@dataclass
class RankContext:
    """Where this process sits in a multi-rank run.

    group: the process group of the run (None = the default group, or no group at all when
    world_size == 1 and torch.distributed is not initialised). backend: "gloo", "nccl" or "none".
    ranks_per_gpu: how many ranks of the run share this rank's GPU (1: a GPU of its own).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: Any = None
    backend: str = "none"
    ranks_per_gpu: int = 1

    @property
    def distributed(self) -> bool:
        return self.backend != "none" and dist.is_available() and dist.is_initialized()

    @property
    def shares_gpu(self) -> bool:
        """True when other ranks of the run compute on this rank's GPU too."""
        return self.device.type == "cuda" and self.ranks_per_gpu > 1


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a spawned run compute: backend of the group, the CUDA device index of each
    rank (None on CPU), and how many ranks share the busiest GPU (1: a GPU each)."""

    backend: str
    devices: tuple[int, ...] | None
    ranks_per_gpu: int = 1

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1


def place_ranks(world_size: int, device: str, gpu_count: int, share_gpus: bool = False) -> Placement:
    """How `world_size` ranks sit on `device` with `gpu_count` visible GPUs: CPU -> gloo; CUDA with
    a GPU per rank -> NCCL, rank i on cuda:i; CUDA with fewer GPUs and share_gpus -> gloo (NCCL
    refuses two ranks on one device), rank i on cuda:(i % gpu_count). Else a MoebenchError."""
    if world_size < 1:
        raise MoebenchError(f"world size must be >= 1, got {world_size}")
    if device == "cpu":
        return Placement("gloo", None)
    if device != "cuda":
        raise MoebenchError(f"spawn runs on 'cpu' or 'cuda', not {device!r}")
    if gpu_count >= world_size:
        return Placement("nccl", tuple(range(world_size)))
    if gpu_count < 1:
        raise MoebenchError(f"--world-size {world_size} on cuda needs a GPU, but none is visible")
    if not share_gpus:
        raise MoebenchError(
            f"--world-size {world_size} needs {world_size} GPUs but {gpu_count} are visible; "
            f"use --simulate to model the other ranks"
        )
    return Placement("gloo", tuple(r % gpu_count for r in range(world_size)), -(-world_size // gpu_count))


def is_main(ctx: RankContext | None) -> bool:
    """True on the rank that prints and writes files (rank 0, or a run without ranks)."""
    return ctx is None or ctx.rank == 0


def single_context(device: str | torch.device = "cpu") -> RankContext:
    """The context of a plain one-process run (no process group)."""
    return RankContext(rank=0, world_size=1, local_rank=0, device=torch.device(device), group=None, backend="none")


# ---------------------------------------------------------------------------------------------
# Small helpers the dispatch backends share: rank/world of a group that may be absent, and the
# single-tensor collectives under their current names (torch >= 2.13 renamed them).


def group_rank_world(group: Any = None) -> tuple[int, int]:
    """(rank, world) in `group` (None = default group); (0, 1) when torch.distributed is not up."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gloo_on_cuda(t: torch.Tensor, group: Any = None) -> bool:
    """True when `t` is a CUDA tensor and `group` a gloo group (ranks sharing a GPU): the
    collectives below then go through host memory, which gloo serves for every one of them."""
    return t.is_cuda and dist.is_initialized() and dist.get_backend(group) == "gloo"


def all_reduce(t: torch.Tensor, group: Any = None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of `t` over `group`; returns t."""
    if gloo_on_cuda(t, group):
        host = t.cpu()
        dist.all_reduce(host, op=op, group=group)
        t.copy_(host)
    else:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_to_all_single(output: torch.Tensor, inp: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group: Any = None) -> None:
    """dist.all_to_all_single (uneven splits allowed)."""
    if gloo_on_cuda(inp, group):
        host = output.cpu()
        dist.all_to_all_single(host, inp.cpu(), output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        output.copy_(host)
        return
    dist.all_to_all_single(output, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                           group=group)


def all_gather_single(output: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """output (world * n, ...) <- every rank's inp (n, ...), in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if gloo_on_cuda(inp, group):
        host = output.cpu()
        fn(host, inp.cpu(), group=group)
        output.copy_(host)
        return
    fn(output, inp, group=group)


def reduce_scatter_single(output: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """output (n, ...) <- sum over ranks of chunk `rank` of inp (world * n, ...)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if gloo_on_cuda(inp, group):
        host = output.cpu()
        fn(host, inp.cpu(), op=dist.ReduceOp.SUM, group=group)
        output.copy_(host)
        return
    fn(output, inp, op=dist.ReduceOp.SUM, group=group)


def barrier(ctx: RankContext | None) -> None:
    """Barrier over the run's group (no-op without one); waits for the device too."""
    if ctx is not None and ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    if ctx is not None and ctx.distributed and ctx.world_size > 1:
        if ctx.backend == "nccl":
            dist.barrier(group=ctx.group, device_ids=[ctx.device.index or 0])
        else:
            dist.barrier(group=ctx.group)


# ---------------------------------------------------------------------------------------------
# torchrun


def leave_torchrun(ctx: RankContext | None) -> None:
    """End a torchrun run together: wait until every rank (rank 0 included, after writing its
    files) is done, then tear the group down, so no rank exits while a peer still holds it."""
    if ctx is None or not ctx.distributed:
        return
    barrier(ctx)
    dist.destroy_process_group()


def join_torchrun(timeout_s: float = DEFAULT_TIMEOUT_S) -> RankContext | None:
    """Join the process group of a torchrun job; None when RANK / WORLD_SIZE are not set.

    NCCL when CUDA is available (device cuda:LOCAL_RANK), gloo otherwise. Reuses the default
    group when one is already initialised.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        for k, v in CHILD_ENV.items():
            os.environ.setdefault(k, v)
        kw: dict[str, Any] = {}
        if use_cuda:
            kw["device_id"] = device
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kw
        )
    else:
        backend = dist.get_backend()
    return RankContext(rank=rank, world_size=world, local_rank=local_rank, device=device, group=None, backend=backend)


# ---------------------------------------------------------------------------------------------
# spawn


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    # torch.save into bytes: tensors travel by value, so a result survives its sender's exit
    # (torch's shared-memory tensor passing needs the sender alive while the parent unpickles).
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _rank_main(
    rank: int, world_size: int, placement: Placement, port: int, timeout_s: float,
    fn: Callable[..., Any], args: tuple, results: Any, environ: dict[str, str] | None = None,
) -> None:
    """Body of one spawned rank: take the spawning process's environment (`environ`), init the
    group, run fn(ctx, *args), report to the parent over `results`, this rank's end of a pipe."""
    start_worker(environ)
    os.environ.update(CHILD_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        backend = placement.backend
        if placement.devices is not None:
            dev = torch.device("cuda", placement.devices[rank])
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        kw: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s), **kw,
        )
        ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, device=dev, group=None, backend=backend,
                          ranks_per_gpu=placement.ranks_per_gpu)
        value = fn(ctx, *args)
        results.send(("ok", rank, _dumps(value)))
    except BaseException as e:  # noqa: BLE001 - everything a rank raises goes to the parent
        fault = (e.path, e.errno) if isinstance(e, WriteError) else None
        results.send(("err", rank, one_line(e, where=True), traceback.format_exc(), fault))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly; exit anyway
            pass


_COMM_WORDS = ("connection", "closed", "gloo", "nccl", "timed out", "timeout", "peer", "socket", "broken pipe")


def _root_cause(failures: dict[int, RankFailedError]) -> RankFailedError:
    """Of several failed ranks, the one most likely to be the cause: a rank whose error is not a
    lost connection, else a rank that died without reporting, else the lowest rank."""
    def lost_peer(e: RankFailedError) -> bool:
        return bool(e.traceback) and any(w in str(e).lower() for w in _COMM_WORDS)

    ranked = sorted(failures.items(), key=lambda kv: (lost_peer(kv[1]), bool(kv[1].traceback), kv[0]))
    rank, err = ranked[0]
    others = sorted(r for r in failures if r != rank)
    if others:
        err.args = (f"{err.args[0]} (ranks {others} failed after it)",)
    return err


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    device: str,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    total_timeout_s: float | None = None,
    share_gpus: bool = False,
) -> list[Any]:
    """Run fn(ctx, *args) on `world_size` new processes; return their values, rank 0's first.

    fn must be importable by name (a module-level function) and its arguments and return value
    picklable; tensors come back by value, on the CPU (CUDA tensors are moved there).
    device "cpu" uses gloo; "cuda" uses NCCL with rank i on cuda:i and needs world_size visible
    GPUs, unless share_gpus: then with fewer GPUs the ranks share them over a gloo group
    (`place_ranks`). Children get NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

    timeout_s: the process groups' collective timeout (a collective waiting on a dead peer
    raises after this long). total_timeout_s: a wall-clock limit for the whole run (None = none).
    Raises RankFailedError when a rank raises (its error line and traceback), dies without
    reporting (its exit code) or the run exceeds total_timeout_s; the other ranks are terminated.
    """
    placement = place_ranks(world_size, device, torch.cuda.device_count() if device == "cuda" else 0, share_gpus)
    mpctx = worker_context(getattr(fn, "__module__", None))
    # one pipe per rank, not a multiprocessing Queue: a pipe holds no semaphore, so a parent
    # killed mid-run leaves nothing for multiprocessing's resource tracker to warn about
    pipes = [mpctx.Pipe(duplex=False) for _ in range(world_size)]
    port = free_port()
    procs = []
    environ = dict(os.environ)
    for rank in range(world_size):
        p = mpctx.Process(
            target=_rank_main, args=(rank, world_size, placement, port, timeout_s, fn, args, pipes[rank][1], environ),
            name=f"moebench-rank{rank}", daemon=True,
        )
        p.start()
        pipes[rank][1].close()  # the rank holds its end: its exit closes the pipe (EOF here)
        procs.append(p)

    values: dict[int, Any] = {}
    failures: dict[int, RankFailedError] = {}
    first_failure_at: float | None = None
    deadline = None if total_timeout_s is None else time.monotonic() + total_timeout_s
    exited_at: dict[int, float] = {}
    try:
        while len(values) < world_size:
            msgs = []
            for conn in mp_connection.wait([r for r, _ in pipes if not r.closed], timeout=0.1):
                try:
                    msgs.append(conn.recv())
                except EOFError:  # the rank exited: no more messages on this pipe
                    conn.close()
            now = time.monotonic()
            for msg in msgs:
                if msg[0] == "ok":
                    values[msg[1]] = _loads(msg[2])
                else:
                    _, rank, line, tb, fault = msg
                    failures.setdefault(rank, RankFailedError(f"rank {rank} of {world_size} failed: {line}", rank, tb,
                                                              fault))
            for rank, p in enumerate(procs):
                if rank in values or rank in failures or p.exitcode is None:
                    continue
                # Exited without a message yet: give the pipe a moment (its last message may
                # still be in flight), then call it dead.
                first = exited_at.setdefault(rank, now)
                if now - first > 1.0:
                    code = p.exitcode
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    failures[rank] = RankFailedError(
                        f"rank {rank} of {world_size} {how} without reporting a result", rank
                    )
            if failures:
                # A rank's failure makes its peers fail too (lost connection): wait a moment for
                # the root cause to arrive, then report it.
                first_failure_at = first_failure_at or now
                if now - first_failure_at > 2.5 or len(values) + len(failures) == world_size:
                    cause = _root_cause(failures)
                    if cause.write_fault is not None:  # a full disk is a full disk, whichever rank wrote
                        raise WriteError(*cause.write_fault) from None
                    raise cause
            if deadline is not None and now > deadline:
                missing = [r for r in range(world_size) if r not in values]
                raise RankFailedError(
                    f"multi-rank run did not finish within {total_timeout_s:.0f} s (ranks {missing} still running)"
                )
    finally:
        _stop(procs)
        for r, _ in pipes:
            r.close()
    return [values[r] for r in range(world_size)]
