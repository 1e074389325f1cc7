"""The data-parallel wrapper: one model + optimizer per rank, gradients averaged across ranks.

Every rank holds the whole model. At the start the parameters are broadcast from rank 0;
each rank then computes the loss and gradients of its share of the global batch, and before
the optimizer updates, :meth:`DataParallel.sync_gradients` replaces every gradient by its
mean over the ranks. The optimizer (clipping, accumulation, weight decay...) then sees the
gradient of the whole global batch, so N ranks compute what one process computes with the
same global batch, up to float32 rounding.

The exchange is bucketed in a fixed order: the parameters in the optimizer's order, cut
into buckets of about ``bucket_mb`` megabytes. Each bucket is one float32 host buffer; the
gradients are copied into it (on a device: concatenated there, then one download), summed
across ranks (by default in the exchange thread, ``_exchange.py``, while the next bucket is
packed or the backward goes on), scaled by 1/N and copied back (on a device: one upload, cut
into the new gradients there). The order and the sizes are the same on every rank and in
every run, and every rank gets the same sum, so the ranks stay bit-identical (the tests
check it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

import recurra as rc
from recurra import Tensor, _core
from recurra_dist._buckets import (
    Bucket,
    compute,
    make_buckets,
    pack,
    packed_device,
    packed_reader,
    read_grad_into,
    read_into,
    set_grads,
    staged_parts,
    upload_packed,
    upload_staged,
    write_grad,
)
from recurra_dist._early import Early
from recurra_dist._exchange import (
    Exchanger,
    Ticket,
    pairwise_sum,
    threads_supported,
)
from recurra_dist._shared import SharedSums
from recurra_dist.context import Context, init

__all__ = ["DataParallel", "ExchangeTimeout"]


class ExchangeTimeout(RuntimeError):
    """A collective did not complete within the wrapper's timeout (a rank is gone or stuck)."""


class DataParallel:
    """Wraps a model and its optimizer for data-parallel training across the ranks of ``ctx``.

    Args:
        model: anything with ``parameters()`` (or a list of parameters). Its parameters are
            overwritten with rank 0's at construction.
        optimizer: a recurra_optim optimizer over those parameters; its order of parameters
            is the exchange order.
        ctx: the :class:`Context` (default: :func:`recurra_dist.init`).
        bucket_mb: the size of a bucket, in megabytes of float32 gradients.
        timeout: seconds a collective may take before :class:`ExchangeTimeout` is raised
            (None: wait for ever; a rank that dies is noticed by the launcher anyway).
        overlap: start each bucket's exchange during the backward, as soon as its gradients
            are final (the buckets hold the last layers' parameters first, whose gradients
            the backward computes first), instead of after it. The results are bitwise the
            same (the same buckets, summed in the same order); it needs float32 gradients
            (else it stays off: ``overlap`` is then False).
        collective: how a bucket is summed. ``"pairwise"``: a reduce-scatter and an allgather by
            point-to-point messages, each rank adding its part of the bucket with numpy in rank
            order (in ``add_threads`` threads); measured faster than MPICH's ``MPI_Allreduce`` on
            one host (2 ranks, 516 MB in 25 MB buckets on the H200 host: 137 ms against 225 ms;
            bench/dist.py --allreduce); through MPI's shared memory instead of messages where
            the ranks share a host (``shared_memory`` below). ``"blocking"``: every rank is
            first waited for (``MPI_Ibarrier`` under ``timeout``), then ``MPI_Allreduce`` runs
            in place.
            ``"nonblocking"``: ``MPI_Iallreduce``, progressed while the next bucket is packed and
            waited for with naps: better for small buckets, whose time is latency. ``"auto"`` (the
            default): pairwise for buckets of at least 1 MiB, else nonblocking. Each gives the same
            bits on every rank and in every run (with 2 ranks all four give the same bits; with
            more, the order of the sum differs).
        exchange_thread: sum the buckets in a thread of their own (on a communicator of
            their own), so that the backward, or the packing of the next bucket, goes on
            while MPI sums (a blocking ``MPI_Allreduce`` in the backward's thread would stop
            it feeding the device). The same collectives in the same order: the same bits.
            Needs ``MPI_THREAD_MULTIPLE`` (else it stays off: ``exchange_thread`` is then
            False).
        add_threads: the threads a pairwise sum adds in (None: the host's cores shared by
            its ranks, one left to each, at most 4). The same bits with any number.

    On a device with asynchronous reads (recurra_vulkan), each bucket's buffer is host-visible
    memory of the device: the backward copies a bucket's gradients into it in the submission
    that completes them and the device runs on while the host sums them; the averaged
    buckets go back to the gradients in one computation (scaled by 1/N there) before the
    optimizer step. Where the ranks share a host and their devices import host memory, that
    memory is the bucket's place in an MPI shared window (summed there in place).

    Raises ValueError when the ranks' models differ (parameter count or shapes), or a
    parameter of the model is not in the optimizer.

    Attributes (timers, in seconds, of the last exchange and in total):
        last_exchange_s, total_exchange_s: the exposed time, what the step waits for (with
        overlap: the packing and MPI calls inside the backward plus :meth:`sync_gradients`);
        last_span_s: with overlap, from the first bucket's packing to the end of
        :meth:`sync_gradients` (the exchange's whole time, the hidden part included; without
        overlap it is last_exchange_s); overlapped: how many exchanges began during the
        backward; exchanges; last_bytes.
        exchange_thread: whether the buckets are summed in the exchange thread (may be
        switched between steps); add_threads: the threads a pairwise sum adds in.
        shared_memory: where all ranks run on one host, the buckets' host buffers live in
        MPI-3 shared windows (``MPI_Win_allocate_shared``) and a pairwise sum reads the other
        ranks' values straight out of them (``_shared.SharedSums``, in ``add_threads``
        threads, no messages; host-visible device memory is copied into a window first).
        False where the ranks are on several hosts (or to force messages); ``shared``
        counts the sums done in place (``in_place``) and copied in (``copied``).
        piece_mb: without shared memory, a pairwise sum cuts a bucket into pieces of this
        many megabytes (0: none) and adds one while the next one's messages arrive.
        stream_mb: with the exchange thread, a bucket summed pairwise of more than twice
        this many megabytes is handed to it in pieces of this size (0: whole), and on a
        device each piece is written back while the next ones are summed (the tail of the
        exchange after the backward: the last bucket, often the embedding's gradient
        alone); streamed counts those buckets. download_pieces (on by default): such a
        bucket on a device, packed after the backward (not by the backward: overlap), is
        downloaded piece by piece too, each piece summed while the next one downloads.
        All of these give the same bits; each must be the same on every rank (else their
        collectives do not match).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        ctx: Context | None = None,
        *,
        bucket_mb: float = 25.0,
        timeout: float | None = 600.0,
        overlap: bool = True,
        collective: str = "auto",
        exchange_thread: bool = True,
        add_threads: int | None = None,
    ) -> None:
        if add_threads is not None and (not isinstance(add_threads, int) or add_threads < 1):
            raise ValueError(f"DataParallel: add_threads must be an int >= 1, got {add_threads!r}")
        if not bucket_mb > 0:
            raise ValueError(f"DataParallel: bucket_mb must be > 0, got {bucket_mb!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"DataParallel: timeout must be > 0 or None, got {timeout!r}")
        if collective not in _COLLECTIVES:
            raise ValueError(
                f"DataParallel: collective is one of {', '.join(_COLLECTIVES)}, not {collective!r}"
            )
        self.collective = collective
        self.ctx = ctx if ctx is not None else init()
        self.model, self.optimizer = model, optimizer
        self.timeout = timeout
        self.params: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        own = model.parameters() if hasattr(model, "parameters") else model
        mine = {id(p) for p in self.params}
        missing = [i for i, p in enumerate(_as_list(own)) if id(p) not in mine]
        if missing:
            raise ValueError(
                f"DataParallel: {len(missing)} parameter(s) of the model are not in the "
                f"optimizer (first: parameter {missing[0]}); give the optimizer all of them"
            )
        self._check_same_model()
        # The buckets' sums have a communicator of their own: in the exchange thread they
        # run beside the caller's collectives (any(), barrier()) on ctx.comm.
        self._xcomm = self.ctx.comm.Dup()
        self.exchange_thread = bool(exchange_thread) and threads_supported()
        self._exchanger = Exchanger(self._xcomm, self._reduce)
        self._scratch = np.empty(0, np.float32)  # pairwise sums' parts received
        # pairwise sums add in threads: the host's cores shared by its ranks, one left each
        cores = (os.cpu_count() or 1) // max(1, self.ctx.local_size)
        self.add_threads = add_threads or max(1, min(4, cores - 1))
        self._add_pool: Any = None
        if self.add_threads > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._add_pool = ThreadPoolExecutor(self.add_threads, "recurra-dist-add")
        # ranks of one host read each other's buckets straight out of MPI's shared memory
        self.shared = SharedSums(self._xcomm)
        self.shared_memory = self.shared.usable
        # by messages in pieces: a piece added while the next one arrives
        self.piece_mb = 0.0  # off: not measured faster (slower on 2 cores)
        # a large bucket in device memory: summed and written back piece by piece
        self.stream_mb = 32.0
        self.streamed = 0  # buckets summed in pieces of stream_mb
        # a device bucket summed in pieces is downloaded in pieces (after a backward)
        self.download_pieces = True
        # The last parameters first: the backward completes their gradients first.
        self.buckets = make_buckets(self.params[::-1], int(bucket_mb * (1 << 20)) // 4, False)
        self._place_buckets()
        self.last_exchange_s = 0.0
        self.last_span_s = 0.0
        self.total_exchange_s = 0.0
        self.exchanges = 0
        self.overlapped = 0  # exchanges begun during the backward
        self.last_bytes = 0
        self.broadcast_parameters()
        fp32 = all(p.dtype == rc.float32 for p in self.params)
        self.overlap = bool(overlap) and fp32  # may be switched between steps
        self._early = Early(self)
        if fp32 and self.world_size > 1:
            rc.add_gradient_listener(self._early)

    # -- the job ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.rank == 0

    def shard(self, batch_size: int) -> slice:
        """The rows of a global batch of ``batch_size`` this rank computes: the r-th of N
        equal, consecutive parts. Raises ValueError unless N divides ``batch_size``."""
        n = self.world_size
        if batch_size % n:
            raise ValueError(
                f"the global batch size {batch_size} is not a multiple of the {n} ranks"
            )
        b = batch_size // n
        return slice(self.rank * b, (self.rank + 1) * b)

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks (the same float on every rank)."""
        buf = np.array([float(value)], np.float64)
        self._wait([self.ctx.comm.Iallreduce(_in_place(), buf, op=_op("SUM"))])
        return float(buf[0]) / self.world_size

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank."""
        buf = np.array([1 if flag else 0], np.int32)
        self._wait([self.ctx.comm.Iallreduce(_in_place(), buf, op=_op("MAX"))])
        return bool(buf[0])

    def barrier(self) -> None:
        self._wait([self.ctx.comm.Ibarrier()])

    # -- parameters and gradients ------------------------------------------------------------
    def broadcast_parameters(self, root: int = 0) -> None:
        """Overwrites every rank's parameters with those of ``root``, bucket by bucket."""
        comm = self.ctx.comm
        for b in self.buckets:
            if self.rank == root:
                for i, p in enumerate(b.params):
                    read_into(p, b.view(i))
            self._wait([comm.Ibcast(b.buffer, root=root)])
            if self.rank != root:
                for i, p in enumerate(b.params):
                    p.assign_(b.view(i))

    def sync_gradients(self) -> None:
        """Replaces every parameter's gradient by its mean over the ranks (a missing gradient
        counts as zeros where another rank has one; where no rank has one it stays None).
        Times the exchange (``last_exchange_s``)."""
        t0 = time.perf_counter()
        comm, n = self.ctx.comm, self.world_size
        if n == 1:  # the mean over one rank: nothing to do
            self.last_exchange_s, self.last_span_s, self.last_bytes = 0.0, 0.0, 0
            self.exchanges += 1
            return
        early = self._early
        if early.started:  # begun during the backward
            stale = self.any(not early.current())  # every rank takes the same way
            if not stale:
                inside, t_first, nbytes = early.inside_s, early.t_first, early.nbytes
                early.finish(scale=np.float32(1.0 / n))
                self.overlapped += 1
                t1 = time.perf_counter()
                self._timed(inside + t1 - t0, t1 - t_first, nbytes)
                return
            early.drain()  # gradients changed since the backward: exchange them now
        present = np.array([p.grad is not None for p in self.params], np.int32)
        self._wait([comm.Iallreduce(_in_place(), present, op=_op("MAX"))])
        flags = iter(present.tolist())
        active = [[bool(next(flags)) for _ in b.params] for b in self.buckets]
        scale = np.float32(1.0 / n)
        pending: list[tuple[Bucket, list[bool], Any, Any]] = []
        staged: list[Bucket] = []  # buckets to write back in one computation
        nbytes = 0
        for b, act in zip(self.buckets, active):
            if not any(act):
                continue
            dev = packed_device(b, act)
            fill = None
            if dev is not None:
                fill = self._reader(b)
            else:
                for i, p in enumerate(b.params):
                    if not act[i]:
                        continue
                    if p.grad is None:
                        b.view(i)[...] = 0.0
                    else:
                        read_grad_into(p, b.view(i))
            req = self._allreduce(b.buffer, fill)
            pending.append((b, act, req, dev))
            nbytes += b.buffer.nbytes
            if len(pending) > 1:  # unpack the previous bucket while this one is in flight
                self._finish(*pending.pop(0), scale, staged)
        while pending:
            self._finish(*pending.pop(0), scale, staged)
        upload_staged(staged, scale)
        dt = time.perf_counter() - t0
        self._timed(dt, dt, nbytes)

    def _allreduce(self, buf: np.ndarray, fill: Callable[[int, int], None] | None = None) -> Any:
        """Sums ``buf`` over the ranks, in place: returns what to wait for (:meth:`_wait`):
        the exchange thread's ticket (``exchange_thread``), else the request (nonblocking),
        or None once it is done (blocking). ``fill(lo, hi)``, if given, first writes
        elements [lo, hi) of ``buf`` (a download): in pieces, each piece just before it is
        handed over, so that one is summed while the next is downloaded."""
        step = int(self.stream_mb * (1 << 20)) // 4
        whole = step <= 0 or buf.size <= 2 * step or not self._pairwise(buf[:step])
        if not self.exchange_thread or whole:
            if fill is not None:
                fill(0, buf.size)
            if not self.exchange_thread:
                return self._start_sum(self._xcomm, buf)
            return self._exchanger.submit(buf)
        # in pieces (each summed pairwise: the same bits): each one can be written back
        # while the next is summed (_finish)
        spans = [(a, min(buf.size, a + step)) for a in range(0, buf.size, step)]
        pieces = []
        for lo, hi in spans:
            if fill is not None:
                fill(lo, hi)
            pieces.append(((lo, hi), self._exchanger.submit(buf[lo:hi])))
        last = pieces[-1][1]
        last.pieces = pieces
        self.streamed += 1
        return last

    def _reader(self, b: Bucket) -> Callable[[int, int], None] | None:
        """Packs a device bucket: what downloads it piece by piece (download_pieces), or
        None once it is downloaded whole."""
        read = packed_reader(b)
        if self.download_pieces:
            return read
        read(0, b.buffer.size)
        return None

    def _pairwise(self, buf: np.ndarray) -> bool:
        """Whether ``collective`` sums ``buf`` pairwise."""
        how = self.collective
        return how == "pairwise" or (how == "auto" and buf.nbytes >= _BLOCKING_MIN_BYTES)

    def _reduce(self, comm: Any, buf: np.ndarray) -> None:
        """The exchange thread's work: sums ``buf`` in place over ``comm``, waiting for it."""
        self._wait([self._start_sum(comm, buf)])

    def _start_sum(self, comm: Any, buf: np.ndarray) -> Any:
        """Starts the sum of ``buf`` over ``comm``, in place: the request to wait for
        (nonblocking), or None once it is done (blocking: every rank is waited for first,
        under the timeout); see ``collective``."""
        if self._pairwise(buf):
            shared = self.shared if self.shared_memory else None
            piece = int(self.piece_mb * (1 << 20)) // 4
            pool, threads = self._add_pool, self.add_threads
            pairwise_sum(comm, buf, self._wait, self._scratch_of, pool, threads, piece, shared)
            return None
        if self.collective != "blocking":
            return comm.Iallreduce(_in_place(), buf, op=_op("SUM"))
        self._wait([comm.Ibarrier()])
        comm.Allreduce(_in_place(), buf, op=_op("SUM"))
        return None

    def _place_buckets(self) -> None:
        """Gives the buckets their host buffers: where the ranks share a host, in MPI shared
        windows. Buckets of a device with asynchronous reads: where every rank's device
        imports host memory, their places in a window of page-aligned segments, imported by
        the device (its copies land where the other ranks add from); else host-visible
        device memory, whose parts the other ranks add are copied into a window. The
        others: one window for all."""
        dev = [b for b in self.buckets if b.stageable()]
        if dev and self.shared.usable and Bucket.import_host:
            ok = np.array([int(all(_core.can_import_host(b.device) for b in dev))], np.int32)
            self._wait([self.ctx.comm.Iallreduce(_in_place(), ok, op=_op("MIN"))])
            if ok[0]:
                sizes = [-(-b.buffer.nbytes // _IMPORT_ALIGN) * _IMPORT_ALIGN // 4 for b in dev]
                whole = self.shared.allocate(sum(sizes), pages=True)
                at = 0
                for b, n in zip(dev, sizes):
                    if self.shared.in_window(whole):  # (else no room: plain memory below)
                        b.import_into(whole[at : at + n])
                    at += n
        for b in dev:
            if not b.imported:
                b.host_visible()
        plain = [b for b in self.buckets if b.staged is None]
        if not self.shared.usable or not plain:
            return
        whole = self.shared.allocate(sum(b.buffer.size for b in plain))
        at = 0
        for b in plain:
            b.buffer = whole[at : at + b.buffer.size]
            at += b.buffer.size

    def close(self) -> None:
        """Frees the MPI shared windows of the buckets (a collective: every rank calls it,
        between steps); the wrapper goes on with buffers of its own and messages. Buckets
        the device imported are let go of first (and recurra's cached graphs, which hold
        their buffers, dropped)."""
        imported = False
        for b in self.buckets:
            if b.imported:  # the device lets go of the window's memory first
                b.staged, b.imported, imported = None, False, True
            if b.staged is None:
                b.buffer = b.buffer.copy()
        if imported:  # cached graphs hold the buffers they read (upload_staged's)
            from recurra._tensor import LAZY

            LAZY.clear()
        self.shared_memory = False
        self.shared.close()

    def _scratch_of(self, n: int) -> np.ndarray:
        """A float32 array of at least ``n`` elements, kept for the next bucket."""
        if self._scratch.size < n:
            self._scratch = np.empty(n, np.float32)
        return self._scratch

    def profile_exchange(self) -> list[dict[str, float]]:
        """Times the exchange of the gradients there are now, phase by phase and bucket by
        bucket, every rank waited for between phases (for benchmarks: bench/dist.py
        --exchange-only). Per bucket: ``bytes``, ``download_s`` (the gradients to the
        host buffer: on a device one packed download), ``allreduce_s`` (the sum alone) and
        ``upload_s`` (the mean back into the gradients, this bucket alone). The last entry,
        ``bucket = -1``, holds the totals, with ``upload_s`` the time of writing every
        bucket back at once (as :meth:`sync_gradients` does), and ``tail_s`` the last
        bucket's download, sum and write back one after the other as a step runs them (in
        pieces: stream_mb): with overlap, what stays exposed after the backward, which
        completes that bucket last. Leaves every gradient the mean over the ranks, as
        :meth:`sync_gradients`. Every parameter needs a gradient."""
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise ValueError(
                f"profile_exchange: parameter {missing[0]} has no gradient; run a backward first"
            )
        scale = np.float32(1.0 / self.world_size)
        last = self.buckets[-1]
        kept = [p.grad for p in last.params]
        self.barrier()
        t0 = time.perf_counter()
        dev = packed_device(last, [True] * len(last.params))
        fill = None
        if dev is not None:
            fill = self._reader(last)
        else:
            pack(last)
        # (the host path writes the means into the gradients in place: put them back below)
        packed = last.buffer.copy() if dev is None else None
        req = self._allreduce(last.buffer, fill)
        tail: list[Bucket] = []
        self._finish(last, [True] * len(last.params), req, dev, scale, tail)
        upload_staged(tail, scale)
        tail_s = time.perf_counter() - t0
        for i, (p, g) in enumerate(zip(last.params, kept)):  # the backward's gradients again
            p.grad = g
            if packed is not None:
                write_grad(p, packed[last.offsets[i] : last.offsets[i + 1]].reshape(p.shape))
        rows: list[dict[str, float]] = []
        devs = []
        for k, b in enumerate(self.buckets):
            self.barrier()
            t0 = time.perf_counter()
            dev = pack(b)
            t1 = time.perf_counter()
            self.barrier()
            t2 = time.perf_counter()
            self._wait([self._allreduce(b.buffer)])
            t3 = time.perf_counter()
            devs.append(dev)
            row = {"bucket": k, "bytes": b.buffer.nbytes, "download_s": t1 - t0}
            rows.append({**row, "allreduce_s": t3 - t2})
        total = {"bucket": -1, "bytes": sum(r["bytes"] for r in rows), "upload_s": 0.0}
        total["tail_s"] = tail_s
        for key in ("download_s", "allreduce_s"):
            total[key] = sum(r[key] for r in rows)
        saved = [b.buffer.copy() for b in self.buckets]
        for k, (b, dev) in enumerate(zip(self.buckets, devs)):  # each bucket alone
            self.barrier()
            t0 = time.perf_counter()
            staged: list[Bucket] = []
            self._finish(b, [True] * len(b.params), None, dev, scale, staged)
            upload_staged(staged, scale)
            rows[k]["upload_s"] = time.perf_counter() - t0
            np.copyto(b.buffer, saved[k])  # the sum again: the host path scaled it
        self.barrier()
        t0 = time.perf_counter()
        staged = []
        for b, dev in zip(self.buckets, devs):  # all at once, as sync_gradients
            self._finish(b, [True] * len(b.params), None, dev, scale, staged)
        upload_staged(staged, scale)
        total["upload_s"] = time.perf_counter() - t0
        return rows + [total]

    def _timed(self, exposed: float, span: float, nbytes: int) -> None:
        self.last_exchange_s = exposed
        self.last_span_s = span
        self.total_exchange_s += exposed
        self.exchanges += 1
        self.last_bytes = nbytes

    def _finish(
        self,
        b: Bucket,
        act: list[bool],
        req: Any,
        dev: Any,
        scale: np.float32,
        staged: list[Bucket],
    ) -> None:
        """Waits for bucket ``b``'s sum and writes its mean back into the gradients (a
        bucket in host-visible memory of its device: added to ``staged``, written back by
        :func:`upload_staged`; those summed already are written back before waiting for
        this one's sum, while the exchange thread goes on)."""
        if dev is not None and b.staged is not None and isinstance(req, Ticket) and req.pieces:
            self._finish_pieces(b, req.pieces, scale, staged)
            return
        self._wait_writing_back(req, scale, staged)
        if dev is not None and b.staged is not None:
            staged.append(b)
            return
        b.buffer *= scale
        if dev is not None:
            upload_packed(b, dev)
            return
        for i, p in enumerate(b.params):
            if act[i]:
                write_grad(p, b.view(i))

    def _wait_writing_back(self, req: Any, scale: np.float32, staged: list[Bucket]) -> None:
        """Waits for ``req``; the buckets in ``staged`` are written back first where the
        exchange thread is not done with it (and ``staged`` emptied)."""
        if staged and isinstance(req, Ticket) and not req.owner.done(req):
            upload_staged(staged, scale)
            staged.clear()
        self._wait([req])

    def _finish_pieces(
        self,
        b: Bucket,
        pieces: list[tuple[tuple[int, int], Ticket]],
        scale: np.float32,
        staged: list[Bucket],
    ) -> None:
        """_finish for a bucket in host-visible memory of its device summed in pieces: each
        piece goes to the device as soon as it is summed, while the next ones are summed;
        then each parameter's pieces are joined there into its new gradient."""
        got: list[list[Tensor]] = [[] for _ in b.params]
        for (lo, hi), ticket in pieces:
            self._wait_writing_back(ticket, scale, staged)
            parts = staged_parts(b, lo, hi, scale)
            compute([t for _, t in parts])
            for i, t in parts:
                got[i].append(t)
        with rc.no_grad():
            news = [
                (p, (rc.ops.concat(ts) if len(ts) > 1 else ts[0]).reshape(p.shape))
                for p, ts in zip(b.params, got)
            ]
        set_grads(news)

    # -- the step ----------------------------------------------------------------------------
    @property
    def will_update(self) -> bool:
        """Whether the optimizer's next step() updates (it closes an accumulation window)."""
        k = int(getattr(self.optimizer, "accumulate_steps", 1))
        return int(getattr(self.optimizer, "micro_step", 0)) + 1 >= k

    def step(self) -> None:
        """``optimizer.step()``, with the gradients averaged across the ranks first when this
        step updates (inside an accumulation window the gradients only sum up locally, and
        the exchange happens once, on the summed gradient, when the window closes)."""
        if self.will_update:
            self.sync_gradients()
        else:
            self.last_exchange_s = self.last_span_s = 0.0
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    # -- checks --------------------------------------------------------------------------------
    def _check_same_model(self) -> None:
        shapes = [tuple(p.shape) for p in self.params]
        theirs = self.ctx.comm.allgather(shapes)
        for r, s in enumerate(theirs):
            if s != theirs[0]:
                raise ValueError(
                    f"DataParallel: rank {r}'s model differs from rank 0's "
                    f"({len(s)} parameters vs {len(theirs[0])}, or other shapes): every "
                    "rank must build the same model"
                )

    def consistent(self) -> bool:
        """Whether every rank holds bit-identical parameters (a check for tests and debugging:
        compares a hash of all parameter bytes)."""
        import hashlib

        h = hashlib.sha256()
        for p in self.params:
            h.update(np.ascontiguousarray(p.numpy()).tobytes())
        digests = self.ctx.comm.allgather(h.hexdigest())
        return all(d == digests[0] for d in digests)

    def _wait(self, reqs: list[Any]) -> None:
        """Waits for ``reqs``; raises ExchangeTimeout after ``timeout`` seconds."""
        MPI = _mpi()
        for t in reqs:
            if isinstance(t, Ticket):  # a bucket of the exchange thread
                t.owner.wait_for(t)
        # None: a blocking collective, done
        reqs = [r for r in reqs if r is not None and not isinstance(r, Ticket)]
        if not reqs:
            return
        if self.timeout is None:
            MPI.Request.Waitall(reqs)
            return
        deadline = time.monotonic() + self.timeout
        spins, nap = 0, 1e-5
        # Another thread (the exchange thread) naps at once: spinning, it would hold the
        # GIL against the thread that feeds the device.
        patience = 1000 if threading.current_thread() is threading.main_thread() else 10
        while not MPI.Request.Testall(reqs):
            spins += 1
            if spins > patience:  # a slow peer: stop spinning a core against it
                time.sleep(nap)
                nap = min(2 * nap, 2e-4)
                if time.monotonic() > deadline:
                    raise ExchangeTimeout(
                        f"rank {self.rank}: an MPI collective waited more than "
                        f"{self.timeout:g} s; a rank is gone or stuck"
                    )


# -- helpers -----------------------------------------------------------------------------------


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def _in_place() -> Any:
    return _mpi().IN_PLACE


def _op(name: str) -> Any:
    return getattr(_mpi(), name)


#: DataParallel's ways to sum a bucket (see its docstring)
_COLLECTIVES = ("auto", "pairwise", "blocking", "nonblocking")
#: buckets imported by their device start at multiples of this many bytes of the window (a
#: multiple of the page and of devices' import alignment)
_IMPORT_ALIGN = 1 << 16
#: collective="auto": buckets of at least this many bytes are summed pairwise
_BLOCKING_MIN_BYTES = 1 << 20


def _as_list(params: Iterable[Tensor]) -> list[Tensor]:
    return list(params)
