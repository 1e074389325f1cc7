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
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from recurra_dist._shared import SharedSums

__all__ = ["Exchanger", "Ticket", "pairwise_sum", "threads_supported"]

# pairwise_sum's message tags: the reduce-scatter's, the allgather's
_TAG_SCATTER, _TAG_GATHER = 7301, 7302


def threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (two threads may call it at once)."""
    from mpi4py import MPI

    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


class Ticket:
    """One bucket handed to the exchange thread: :meth:`Exchanger.wait_for` waits for it.

    A bucket handed over in pieces has the ticket of its last piece, whose ``pieces`` lists
    ``((start, stop), ticket)`` of every piece (elements of the bucket), in order."""

    __slots__ = ("owner", "number", "pieces")

    def __init__(self, owner: Exchanger, number: int) -> None:
        self.owner, self.number = owner, number
        self.pieces: list[tuple[tuple[int, int], Ticket]] = []


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

    def done(self, ticket: Ticket) -> bool:
        """Whether the bucket of ``ticket`` is summed (or the thread failed)."""
        with self._cv:
            return self._done >= ticket.number or self._error is not None

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


def pairwise_sum(
    comm: Any,
    buf: np.ndarray,
    wait: Callable[[list[Any]], None],
    scratch: Callable[[int], np.ndarray],
    pool: Any = None,
    threads: int = 1,
    piece: int = 0,
    shared: SharedSums | None = None,
) -> None:
    """Sums ``buf`` (float32, the same size on every rank) over the ranks of ``comm``, in
    place: a reduce-scatter and an allgather by point-to-point messages, the sum by numpy.

    Rank r owns the r-th of N equal parts of the buffer: it receives that part from every
    other rank (one copy each, MPI's single-copy path between processes of one host), adds
    the N parts in rank order (g_0 + g_1 + ... + g_{N-1}, float32) into its own, and sends
    the result to every other rank. Each part is summed by one rank only, so every rank ends
    with the same bits, the same in every run. ``wait`` waits for a list of requests (the
    timeout), ``scratch(n)`` gives a float32 array of at least n elements for the parts
    received, and ``pool`` (an executor of ``threads`` threads, or None) adds in several
    threads (numpy lets go of the GIL while it adds).

    ``piece`` > 0 (elements, the same on every rank) pipelines a large buffer: it is cut
    into pieces of ``piece`` elements (the last one shorter), each summed as above, and
    while piece k is added (in ``pool``'s threads), piece k + 1's parts arrive and piece
    k - 1's sums go out. Each element is still the same rank-order float32 sum, so the
    result is bitwise the same however the buffer is cut.

    ``shared`` (all ranks on one host): the same sums through MPI's shared memory, without
    messages (:class:`~recurra_dist._shared.SharedSums`), where the ranks share a host (else
    the messages above)."""
    size, me = comm.Get_size(), comm.Get_rank()
    if size == 1:  # the sum over one rank
        return
    if shared is not None and shared.sum(comm, buf, wait, pool, threads):
        return
    n = buf.size
    step = n if piece <= 0 or piece >= n else int(piece)
    spans = [(a, min(n, a + step)) for a in range(0, n, step)] if n else [(0, 0)]
    width = -(-step // size)  # the most elements a rank owns of one piece
    slots = min(2, len(spans))  # scratch for the parts of two pieces at a time
    tmp = scratch(slots * (size - 1) * width)
    parts = [_Piece(buf, a, b, size, me) for a, b in spans]
    for k in range(slots):
        parts[k].scatter(comm, tmp, k * (size - 1) * width)
    adding: list[Any] = []
    try:
        for k, part in enumerate(parts):
            wait(part.reqs)
            adding = _add_in_order(part.terms, part.mine, pool, threads, block=False)
            # while it adds: the sums of the piece before go out, the next piece comes in
            later = parts[k - 1].reqs if k else []
            ahead = parts[k + 1].reqs if k + 1 < len(parts) else []
            wait(later + ahead)
            _join(adding)
            adding = []
            part.gather(comm)
            if k + slots < len(parts):  # its scratch is free again
                parts[k + slots].scatter(comm, tmp, (k % slots) * (size - 1) * width)
        wait(parts[-1].reqs)
    finally:
        _join(adding)  # no thread writes into buf after an error


class _Piece:
    """Elements [a, b) of a pairwise sum's buffer: the part of each rank, the requests in
    flight (the reduce-scatter's, then the allgather's) and the terms of the sum."""

    __slots__ = ("buf", "cut", "me", "mine", "reqs", "terms")

    def __init__(self, buf: np.ndarray, a: int, b: int, size: int, me: int) -> None:
        self.buf, self.me = buf, me
        self.cut = [a + k * (b - a) // size for k in range(size + 1)]
        self.mine = buf[self.cut[me] : self.cut[me + 1]]
        self.reqs: list[Any] = []
        self.terms: list[np.ndarray] = []

    def scatter(self, comm: Any, tmp: np.ndarray, at: int) -> None:
        """Receives the other ranks' values of this rank's part (into ``tmp`` from ``at``)
        and sends them theirs."""
        m, cut = self.mine.size, self.cut
        for q in range(len(cut) - 1):
            if q == self.me:
                self.terms.append(self.mine)
                continue
            got = tmp[at : at + m]
            at += m
            self.terms.append(got)
            self.reqs.append(comm.Irecv(got, source=q, tag=_TAG_SCATTER))
            self.reqs.append(comm.Isend(self.buf[cut[q] : cut[q + 1]], dest=q, tag=_TAG_SCATTER))

    def gather(self, comm: Any) -> None:
        """Sends this rank's sums to the other ranks and receives theirs."""
        cut, self.reqs, self.terms = self.cut, [], []
        for q in range(len(cut) - 1):
            if q != self.me:
                theirs = self.buf[cut[q] : cut[q + 1]]
                self.reqs.append(comm.Irecv(theirs, source=q, tag=_TAG_GATHER))
                self.reqs.append(comm.Isend(self.mine, dest=q, tag=_TAG_GATHER))


def _join(futures: list[Any]) -> None:
    for f in futures:
        f.result()


#: pieces of at least this many elements are added in threads of their own
_ADD_PIECE = 1 << 18


def _add_in_order(
    terms: list[np.ndarray], out: np.ndarray, pool: Any, threads: int, block: bool = True
) -> list[Any]:
    """out = terms[0] + terms[1] + ... (float32, left to right), elementwise; ``out`` may be
    one of the terms. With ``pool``, the elements are cut into pieces added in its threads
    (each element's sum is the same however they are cut); ``block=False`` returns their
    futures at once (:func:`_join` waits for them), else they are waited for."""
    n = out.size
    pieces = 1 if pool is None else max(1, min(threads, n // _ADD_PIECE))
    if pool is None or (pieces == 1 and block):
        _add_slice(terms, out, 0, n)
        return []
    cuts = [k * n // pieces for k in range(pieces + 1)]
    futures = [pool.submit(_add_slice, terms, out, cuts[k], cuts[k + 1]) for k in range(pieces)]
    if block:
        _join(futures)
        return []
    return futures


def _add_slice(terms: list[np.ndarray], out: np.ndarray, a: int, b: int) -> None:
    if len(terms) == 2:  # elementwise: writing out while reading it is safe
        np.add(terms[0][a:b], terms[1][a:b], out=out[a:b])
        return
    acc = terms[0][a:b] + terms[1][a:b]  # out may be a later term: not written before the end
    for t in terms[2:]:
        np.add(acc, t[a:b], out=acc)
    out[a:b] = acc
