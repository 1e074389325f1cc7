"""The exchange thread: sums gradient buckets across the ranks while the caller goes on.

:class:`DataParallel` hands each bucket's host buffer to :meth:`Exchanger.submit` in bucket
order (the same on every rank); one thread per process sums them, one after another, on a
communicator of its own, and the caller waits for a bucket through the :class:`Ticket`
that ``submit`` returns. The backward (or the packing of the next bucket) thus runs while
MPI sums: a blocking ``MPI_Allreduce`` no longer stops the thread that feeds the device.
The sums are those of the same collectives called in the caller's thread, bit for bit (the
same buckets, the same calls, the same order).

It needs MPI's ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it; MPICH gives it): the caller's
thread keeps calling MPI on the job's communicator meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Exchanger", "Ticket", "threads_supported"]


def threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (two threads may call it at once)."""
    from mpi4py import MPI

    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


class Ticket:
    """One bucket handed to the exchange thread: :meth:`Exchanger.wait_for` waits for it."""

    __slots__ = ("owner", "number")

    def __init__(self, owner: Exchanger, number: int) -> None:
        self.owner, self.number = owner, number


class Exchanger:
    """A thread that runs ``reduce(comm, buffer)`` for each buffer submitted, in order.

    Args:
        comm: the communicator its collectives use (a duplicate, so that they never meet
            the caller's collectives on the job's communicator).
        reduce: sums one buffer in place across the ranks of ``comm`` (it may raise: the
            error is raised again in the thread that waits, and later buckets are skipped).
    """

    def __init__(self, comm: Any, reduce: Callable[[Any, np.ndarray], None]) -> None:
        self.comm = comm
        self._reduce = reduce
        self._cv = threading.Condition()
        self._jobs: deque[np.ndarray] = deque()
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0  # the thread's time in reduce(), summed over buckets

    def submit(self, buf: np.ndarray) -> Ticket:
        """Queues ``buf`` (summed in place later, after the buffers queued before it)."""
        with self._cv:
            self._jobs.append(buf)
            self._submitted += 1
            ticket = Ticket(self, self._submitted)
            self._cv.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="recurra-dist-exchange", daemon=True
            )
            self._thread.start()
        return ticket

    def wait_for(self, ticket: Ticket) -> None:
        """Waits until the bucket of ``ticket`` is summed; raises the thread's error, if any
        (an :class:`ExchangeTimeout` of a collective, say)."""
        with self._cv:
            while self._done < ticket.number and self._error is None:
                self._cv.wait(0.5)
            if self._error is not None:
                raise self._error

    def wait_all(self) -> None:
        """Waits until every bucket submitted so far is summed (raises as :meth:`wait_for`)."""
        self.wait_for(Ticket(self, self._submitted))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                buf = self._jobs[0]
                failed = self._error is not None
            if not failed:
                t0 = time.perf_counter()
                try:
                    self._reduce(self.comm, buf)
                except BaseException as e:  # handed to the waiting thread
                    with self._cv:
                        self._error = e
                self.busy_s += time.perf_counter() - t0
            with self._cv:
                self._jobs.popleft()
                self._done += 1
                self._cv.notify_all()
