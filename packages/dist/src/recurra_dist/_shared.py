"""Pairwise sums through MPI's shared memory, for ranks that all run on one host.

MPI-3 shared windows (``MPI_Win_allocate_shared`` on the host's communicator) give each rank
a segment of memory that the other ranks of the host load from and store to like their own.
Where a bucket's host buffer lives in such a segment, the pairwise sum needs no messages:
rank r adds the r-th of N parts of the bucket straight out of every rank's segment (in rank
order, float32, a cache-sized chunk at a time in the add threads) into its own segment, and
after a barrier every rank copies the other parts' sums out of their owners' segments. The
same adds as the messages' sums: the same bits.

Accesses follow the MPI standard's rules for load/store on shared windows: every window is
locked once (``MPI_Win_lock_all``, no check), and between phases each rank runs
``MPI_Win_sync`` (its stores visible, the others' seen), a barrier, and ``MPI_Win_sync``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from recurra_dist._exchange import _add_slice

__all__ = ["SharedSums"]

#: where MPICH places the shared windows' memory (files in a tmpfs). A window larger than the
#: room left there is not refused by MPI: touching its pages kills the process (SIGBUS), as in
#: a container with Docker's default 64 MB /dev/shm. So the room is checked first.
SHM_DIR = "/dev/shm"


def _shm_free() -> int:
    """Bytes free in :data:`SHM_DIR` (0 where it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class _Window:
    """One shared window: every rank's segment as a float32 array (this rank's writable)."""

    def __init__(self, node: Any, n: int, pages: bool = False) -> None:
        from mpi4py import MPI

        info = MPI.INFO_NULL
        if pages:  # every rank's segment on pages of its own (MPICH: page-aligned)
            info = MPI.Info.Create()
            info.Set("alloc_shared_noncontig", "true")
        self.win = MPI.Win.Allocate_shared(4 * max(n, 1), 4, info, comm=node)
        if pages:
            info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.segments: list[np.ndarray] = []
        for q in range(node.Get_size()):
            mem, _ = self.win.Shared_query(q)
            self.segments.append(np.frombuffer(cast(Any, mem), np.float32)[:n])
        self.mine: np.ndarray = self.segments[node.Get_rank()]
        self.base = self.mine.ctypes.data
        self.size = n

    def holds(self, buf: np.ndarray) -> int:
        """The offset (elements) of ``buf`` in this rank's segment, or -1 if not in it."""
        at = buf.ctypes.data - self.base
        if buf.dtype != np.float32 or not buf.flags.c_contiguous or at < 0 or at % 4:
            return -1
        return at // 4 if at // 4 + buf.size <= self.size else -1

    def free(self) -> None:
        self.segments, self.mine = [], np.empty(0, np.float32)
        self.win.Unlock_all()
        self.win.Free()


class SharedSums:
    """Pairwise sums in shared windows of the ranks of ``comm`` where all run on one host.

    :meth:`allocate` gives a buffer in this rank's segment of a new window (a collective:
    every rank asks for the same sizes in the same order); :meth:`sum` sums a buffer across
    the ranks in place. A buffer that every rank holds at the same place of the same window
    is summed there; any other (host-visible device memory, a user's array) is first copied
    into a window of scratch (in the add threads) and the sums are copied out of the owners'
    segments straight into it.

    ``usable`` (the same on every rank): whether all ranks of ``comm`` share one host
    (``node``: the host's communicator, by default ``MPI_COMM_TYPE_SHARED``; tests pass
    another to play several hosts). Where not, :meth:`sum` returns False and the caller
    sends messages; :meth:`allocate` gives plain arrays.
    """

    #: elements added at a time per thread: small enough to stay in the cache
    CHUNK = 1 << 16

    def __init__(self, comm: Any, node: Any = None) -> None:
        from mpi4py import MPI

        self.comm = comm
        me = comm.Get_rank()
        if node is None:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=me)
        local = node.Get_size() == comm.Get_size() and node.Get_rank() == me
        ok = np.array([int(local)], np.int32)
        comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
        self.usable = bool(ok[0])
        self.node = node if self.usable else None
        self.node_size = node.Get_size()  # ranks sharing this host
        self._windows: list[_Window] = []
        self._scratch: _Window | None = None
        #: bytes of the host's shared memory that this object's windows hold (all ranks')
        self.committed = 0
        #: sums done in place in a window, and those copied into the scratch window first
        self.in_place = self.copied = 0

    def allocate(self, n: int, pages: bool = False) -> np.ndarray:
        """A float32 array of ``n`` elements in a new shared window (every rank calls it);
        ``pages``: each rank's segment starts on a page of its own (for memory a device
        imports). Where there is no window (no room, several hosts): a plain array."""
        if not self.usable or not self._room(n):
            return np.empty(n, np.float32)
        w = _Window(self.node, n, pages)
        self._windows.append(w)
        return w.mine

    def in_window(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` lies in this rank's segment of one of the windows."""
        return any(w.holds(buf) >= 0 for w in self._windows)

    def _room(self, n: int) -> bool:
        """Whether every rank sees room in the host's shared memory for a window of ``n``
        floats per rank beside those held already, with a quarter to spare (a collective);
        if so the window is counted in :attr:`committed`."""
        from mpi4py import MPI

        need = 4 * max(n, 1) * self.node_size
        ok = np.array([int(_shm_free() >= (self.committed + need) * 5 // 4)], np.int32)
        self.comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
        if ok[0]:
            self.committed += need
        return bool(ok[0])

    def close(self) -> None:
        """Frees the windows (a collective; arrays from :meth:`allocate` must be dropped):
        later sums return False and allocations are private."""
        for w in self._windows + ([self._scratch] if self._scratch else []):
            w.free()
        self._windows, self._scratch = [], None
        self.usable, self.node, self.committed = False, None, 0

    def sum(
        self,
        comm: Any,
        buf: np.ndarray,
        wait: Callable[[list[Any]], None],
        pool: Any,
        threads: int,
    ) -> bool:
        """Sums ``buf`` (float32, the same size on every rank) over ``comm`` in place: False
        (nothing done, on every rank) where the ranks do not share a host."""
        if not self.usable:
            return False
        where = np.array([-1, -1, buf.size], np.int64)
        for k, w in enumerate(self._windows):
            at = w.holds(buf)
            if at >= 0:
                where[:2] = k, at
                break
        size = comm.Get_size()
        everyone = np.empty(3 * size, np.int64)
        wait([comm.Iallgather(where, everyone)])
        peers = everyone.reshape(size, 3)
        jobs = max(1, threads if pool is not None else 1)
        if peers[0, 0] >= 0 and (peers == peers[0]).all():  # the same on every rank
            self.in_place += 1
            self._sum(comm, self._windows[int(where[0])], int(where[1]), buf, wait, pool, jobs)
            return True
        self.copied += 1
        n = int(peers[:, 2].max())
        if self._scratch is None or self._scratch.size < n:  # a collective, on every rank
            if self._scratch is not None:
                self._scratch.free()
                self.committed -= 4 * self._scratch.size * self.node_size
            self._scratch = None
            if not self._room(n):  # no room: messages (on every rank)
                self.copied -= 1
                return False
            self._scratch = _Window(self.node, n)
        self._sum(comm, self._scratch, 0, buf, wait, pool, jobs)
        return True

    def _sum(
        self,
        comm: Any,
        w: _Window,
        at: int,
        out: np.ndarray,
        wait: Callable[[list[Any]], None],
        pool: Any,
        jobs: int,
    ) -> None:
        """Sums ``out`` over the ranks in place, where ``out`` is elements [at, at + n) of
        this rank's segment of ``w``, or else a buffer of its own (then the parts that the
        other ranks add are first copied into the segment at ``at``, and the sums of this
        rank's part after it)."""
        size, me, n = comm.Get_size(), comm.Get_rank(), out.size
        cut = [k * n // size for k in range(size + 1)]
        segs = [s[at : at + n] for s in w.segments]
        chunk = self.CHUNK
        copied = out.ctypes.data != segs[me].ctypes.data
        terms = [out if q == me else segs[q] for q in range(size)]

        def add(lo: int, hi: int) -> None:  # this rank's part, a chunk at a time
            for x in range(lo, hi, chunk):
                y = min(hi, x + chunk)
                _add_slice([t[x:y] for t in terms], out[x:y], 0, y - x)
                if copied:  # for the others to read (still in the cache)
                    np.copyto(segs[me][x:y], out[x:y])

        others = n - (cut[me + 1] - cut[me])

        def publish(lo: int, hi: int) -> None:  # the others' parts into this rank's segment
            for x, y in _spans(cut, me, lo, hi):
                np.copyto(segs[me][x:y], out[x:y])

        def gather(lo: int, hi: int) -> None:  # the sums of the others' parts into out
            for q, (x, y) in zip(_owners(me, size), _spans(cut, me, lo, hi)):
                np.copyto(out[x:y], segs[q][x:y])

        if copied:
            _run(pool, jobs, publish, others)
        self._fence(comm, w, wait)  # every rank's values in place
        _run(pool, jobs, add, cut[me + 1] - cut[me], cut[me])
        self._fence(comm, w, wait)  # every part summed
        _run(pool, jobs, gather, others)
        self._fence(comm, w, wait)  # nobody reads the segments any more: they may change

    @staticmethod
    def _fence(comm: Any, w: _Window, wait: Callable[[list[Any]], None]) -> None:
        w.win.Sync()
        wait([comm.Ibarrier()])
        w.win.Sync()


def _owners(me: int, size: int) -> list[int]:
    return [q for q in range(size) if q != me]


def _spans(cut: list[int], me: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """Elements [lo, hi) of the other ranks' parts laid end to end (``cut``: the parts'
    bounds), as spans of the buffer: one per other rank, in rank order (maybe empty)."""
    out, at = [], 0
    for q in _owners(me, len(cut) - 1):
        a, b = cut[q], cut[q + 1]
        x, y = max(a, a + lo - at), min(b, a + hi - at)
        out.append((x, max(x, y)))
        at += b - a
    return out


def _run(pool: Any, jobs: int, work: Callable[[int, int], Any], n: int, start: int = 0) -> None:
    """Runs ``work(lo, hi)`` over [start, start + n) cut into ``jobs`` equal spans (in
    ``pool``'s threads where there are several)."""
    jobs = max(1, min(jobs, n // SharedSums.CHUNK))
    cuts = [start + k * n // jobs for k in range(jobs + 1)]
    if pool is None or jobs == 1:
        for k in range(jobs):
            work(cuts[k], cuts[k + 1])
    else:
        list(pool.map(work, cuts[:-1], cuts[1:]))
