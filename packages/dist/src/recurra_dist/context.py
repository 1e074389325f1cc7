"""Where this process is in an MPI job: rank, world size, local rank, its device, and the
error handling that ends every rank when one fails.

Nothing here starts MPI at import: :func:`init` does (through mpi4py), and
:func:`launched_world_size` reads the launcher's environment without starting it.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = [
    "Context",
    "abort",
    "device_for",
    "init",
    "install_abort_hook",
    "launched_world_size",
]

# What MPI launchers set in every process they start: MPICH's Hydra, Intel MPI and srun
# with PMI: PMI_SIZE; Open MPI: OMPI_COMM_WORLD_SIZE.
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def launched_world_size() -> int:
    """The number of processes of the MPI job this process was started in, read from the
    launcher's environment (1 when it was not started by ``mpiexec``). Starts nothing."""
    for var in _SIZE_VARS:
        raw = os.environ.get(var, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise ImportError(
            f"recurra_dist needs mpi4py and an MPI library ({e}): pip install mpi4py mpich"
        ) from None
    return MPI


@dataclass(frozen=True)
class Context:
    """This process's place in the job.

    Attributes:
        comm: the mpi4py communicator of the job (a duplicate of COMM_WORLD by default).
        rank, world_size: the rank in ``comm`` and its size.
        local_rank, local_size: the rank among the processes of this host and their number.
    """

    comm: Any
    rank: int
    world_size: int
    local_rank: int
    local_size: int

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the rank that writes checkpoints and prints)."""
        return self.rank == 0

    def device(self, backend: str = "auto") -> str:
        """This rank's device: see :func:`device_for`."""
        return device_for(self.local_rank, backend)

    def barrier(self) -> None:
        self.comm.Barrier()


_CONTEXT: Context | None = None


def init(comm: Any = None, *, abort_on_error: bool = True) -> Context:
    """Starts MPI (once) and returns this process's :class:`Context`.

    ``comm`` defaults to a duplicate of ``MPI.COMM_WORLD``; the local rank comes from
    splitting it by shared memory (the processes of one host). With ``abort_on_error``, an
    exception that reaches the top of any rank prints its traceback, prefixed with the
    rank, and ends the whole job through ``MPI_Abort`` (:func:`install_abort_hook`), so that
    no rank waits forever for one that failed.
    """
    global _CONTEXT
    if comm is None and _CONTEXT is not None:
        return _CONTEXT
    MPI = _mpi()
    own = comm is None
    if own:
        launched = launched_world_size()
        if launched > 1 and MPI.COMM_WORLD.Get_size() == 1:
            # Each process would train alone, believing it is the whole job.
            library = MPI.Get_library_version().splitlines()[0].strip()
            raise RuntimeError(
                f"recurra_dist: mpiexec started {launched} processes, but the MPI library "
                f"mpi4py loaded ({library}) sees a job of 1: it is not the MPI of that "
                "mpiexec. Launch with the mpiexec of the same MPI, or point mpi4py at the "
                "launcher's library (MPI4PY_LIBMPI=/path/to/libmpi.so.12 for the mpich wheel)"
            )
        comm = MPI.COMM_WORLD.Dup()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    ctx = Context(comm, comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size())
    local.Free()
    if abort_on_error:
        install_abort_hook(ctx)
    if own:
        _CONTEXT = ctx
    return ctx


def abort(ctx: Context, message: str, code: int = 1) -> None:
    """Prints ``message`` on stderr with this rank's number and ends every rank of the job
    with exit status ``code`` (``MPI_Abort``). A job of one process just exits."""
    sys.stderr.write(f"[rank {ctx.rank}/{ctx.world_size}] {message.rstrip()}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if ctx.world_size > 1:
        ctx.comm.Abort(code)
    os._exit(code)  # Abort returned (it should not), or a job of one process


def install_abort_hook(ctx: Context, grace: float = 3.0) -> None:
    """Replaces ``sys.excepthook`` (and ``threading.excepthook``) so that an uncaught
    exception on this rank prints its traceback and aborts the whole job (:func:`abort`).

    A rank that leaves through ``sys.exit(status)`` with a nonzero status while other
    ranks still run ends the job too, with that status: at exit every rank meets the others
    (a non-blocking barrier on a communicator of its own); a rank exiting with an error
    waits ``grace`` seconds for them, then aborts. Without this the others would wait in
    their next collective until DataParallel's timeout. (``raise SystemExit(n)`` is not
    seen: use ``sys.exit``; ``os._exit`` leaves without a word, and the launcher ends the
    job with that status.)"""
    import threading

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception(kind, exc, tb))
        abort(ctx, f"failed, ending the job:\n{text}", 1)

    def thread_hook(args: Any) -> None:
        if args.exc_type is SystemExit:
            return
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    if ctx.world_size == 1:
        return
    leaving: dict[str, Any] = {"code": 0, "call": ""}
    real_exit = sys.exit

    def exit_(status: str | int | None = None) -> None:
        leaving["code"] = _exit_status(status)
        leaving["call"] = f"sys.exit({status!r})"
        real_exit(status)

    sys.exit = exit_  # type: ignore[assignment]
    atexit.register(_meet_at_exit, ctx, ctx.comm.Dup(), leaving, grace)


def _exit_status(status: object) -> int:
    """The process status Python gives for ``sys.exit(status)``."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1  # a message: printed, status 1


def _meet_at_exit(ctx: Context, comm: Any, leaving: dict[str, Any], grace: float) -> None:
    req = comm.Ibarrier()
    if leaving["code"] == 0:
        req.Wait()  # as MPI_Finalize would: the job ends when every rank has
        return
    deadline = time.monotonic() + grace
    while not req.Test():
        if time.monotonic() > deadline:
            abort(
                ctx,
                f"{leaving['call']} while other ranks still run: ending the job",
                leaving["code"] or 1,
            )
        time.sleep(0.01)


def device_for(local_rank: int, backend: str = "auto") -> str:
    """The device of the process with ``local_rank`` on its host: ``vulkan:<local_rank %
    n>`` when ``backend`` is ``vulkan`` (or ``auto`` and the Vulkan backend has n >= 1
    devices), else ``cpu``.

    Raises ValueError for an unknown backend name, RuntimeError when ``vulkan`` is asked
    for and no Vulkan device is usable (with the reason the backend gives)."""
    backend = backend.strip().lower()
    if backend == "cpu":
        return "cpu"
    if backend not in ("auto", "vulkan"):
        raise ValueError(f"device_for: backend must be 'auto', 'cpu' or 'vulkan', got {backend!r}")
    import recurra.backends

    info = {b.name: b for b in recurra.backends.available()}.get("vulkan")
    n = len(info.devices) if info is not None and info.available else 0
    if n == 0:
        if backend == "vulkan":
            why = info.reason if info is not None else "recurra-vulkan is not installed"
            raise RuntimeError(f"device_for: no usable Vulkan device ({why})")
        return "cpu"
    return f"vulkan:{int(local_rank) % n}"
