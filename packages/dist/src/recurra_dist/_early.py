"""The exchange begun during the backward (:class:`Early`, a recurra gradient listener) for
:class:`~recurra_dist.parallel.DataParallel`: each bucket packed and its sum started as soon
as the backward has its gradients final."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

import recurra as rc
from recurra import Tensor
from recurra_dist._buckets import Bucket, packed_device, read_into, upload_staged
from recurra_dist._exchange import Ticket

if TYPE_CHECKING:
    from recurra_dist.parallel import DataParallel

__all__ = ["Early"]


class Early:
    """The exchange started during the backward (a recurra gradient listener): each bucket
    is packed and its ``MPI_Iallreduce`` started as soon as its gradients are final, in
    bucket order (the same on every rank), while the backward goes on; the requests are
    tested at every bucket (MPI progresses them during MPI calls).
    :meth:`DataParallel.sync_gradients` then waits for them and writes the means back."""

    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp
        self.params = dp.params
        index = {id(p): i for i, p in enumerate(dp.params)}
        self.groups = [[index[id(p)] for p in b.params] for b in dp.buckets]
        self.started = False
        self._reset()

    def _reset(self) -> None:
        self.reqs: list[Any] = []  # per bucket started, in order
        self.packed = [False] * len(self.groups)
        self.mine: list[bool] = []
        self.present: np.ndarray | None = None
        self.flags_req: Any = None
        self.grads: list[Any] = []
        self.nbytes = 0
        self.inside_s = 0.0
        self.t_first = 0.0

    # -- the listener --------------------------------------------------------------------
    def begin(self, present: list[bool]) -> bool:
        dp = self.dp
        if not dp.overlap or not dp.will_update:
            return False
        t0 = time.perf_counter()
        if self.started:  # a backward whose exchange nobody finished: let it end first
            self.drain()
        for p in self.params:
            g = p.grad
            if g is not None and (
                not isinstance(g, Tensor) or g.dtype != rc.float32 or g.shape != p.shape
            ):
                return False  # a gradient set by hand: exchanged after the backward
        self.mine = present
        self.present = np.array(
            [bool(f) or p.grad is not None for f, p in zip(present, self.params)], np.int32
        )
        self.flags_req = dp.ctx.comm.Iallreduce(_in_place(), self.present, op=_op("MAX"))
        self.started = True
        self.inside_s = time.perf_counter() - t0
        return True

    def target(self, k: int) -> Any:
        """Where the device copies bucket k's gradients in the backward: straight into the
        bucket's buffer where it is host-visible memory of the device (imported or not) and
        this backward's gradients are the bucket's whole value (none to add to)."""
        b = self.dp.buckets[k]
        if b.staged is None or any(self.params[i].grad is not None for i in self.groups[k]):
            return None
        return b.staged

    def ready(self, k: int, read: Any) -> None:
        t0 = time.perf_counter()
        if not self.t_first:  # (the graph's forward ran since begin(): not counted)
            self.t_first = t0 - self.inside_s
        b, group = self.dp.buckets[k], self.groups[k]
        if all(self.mine[i] and self.params[i].grad is None for i in group):
            read(group, b.buffer)  # on a device: one download for the bucket
            group = []
        for j, i in enumerate(group):
            view, prev = b.view(j), self.params[i].grad
            if self.mine[i]:
                read(i, view)
                if prev is not None:  # the sum backward() makes: prev + this gradient
                    extra = np.empty_like(view)
                    read_into(prev, extra)
                    np.add(extra, view, out=view)
            elif prev is not None:
                read_into(prev, view)
            else:
                view[...] = 0.0
        self.packed[k] = True
        while len(self.reqs) < len(self.packed) and self.packed[len(self.reqs)]:
            buf = self.dp.buckets[len(self.reqs)].buffer
            self.reqs.append(self.dp._allreduce(buf))
            self.nbytes += buf.nbytes
        _test(self.reqs)  # progress for the buckets in flight
        self.inside_s += time.perf_counter() - t0

    def end(self) -> None:
        self.grads = [p.grad for p in self.params]
        if self.reqs:
            t0 = time.perf_counter()
            _test(self.reqs)  # progress while the caller reads the loss
            self.inside_s += time.perf_counter() - t0

    # -- after the backward ------------------------------------------------------------------
    def current(self) -> bool:
        """Whether the gradients are those of the backward the exchange began in."""
        return (
            len(self.reqs) == len(self.groups)
            and len(self.grads) == len(self.params)
            and all(p.grad is g for p, g in zip(self.params, self.grads))
        )

    def finish(self, scale: np.float32) -> None:
        dp = self.dp
        dp._wait([self.flags_req])
        assert self.present is not None
        flags = iter(self.present.tolist())
        staged: list[Bucket] = []
        for b, req in zip(dp.buckets, self.reqs):
            act = [bool(next(flags)) for _ in b.params]
            if any(act):
                dp._finish(b, act, req, packed_device(b, act), scale, staged)
            else:
                dp._wait([req])
        upload_staged(staged, scale)
        self.started = False
        self._reset()

    def drain(self) -> None:
        """Lets the requests in flight end (every rank started the same ones) and forgets
        them. Buckets the backward did not reach are started, so the collectives match."""
        dp = self.dp
        while len(self.reqs) < len(self.groups):
            self.reqs.append(dp._allreduce(dp.buckets[len(self.reqs)].buffer))
        dp._wait([self.flags_req, *self.reqs])
        self.started = False
        self._reset()


def _in_place() -> Any:
    from mpi4py import MPI

    return MPI.IN_PLACE


def _op(name: str) -> Any:
    from mpi4py import MPI

    return getattr(MPI, name)


def _test(reqs: list[Any]) -> None:
    """Lets MPI progress the requests in flight (None: a blocking collective, done; a
    Ticket: the exchange thread's)."""
    live = [r for r in reqs if r is not None and not isinstance(r, Ticket)]
    if live:
        _request().Testall(live)


def _request() -> Any:
    from mpi4py import MPI

    return MPI.Request
