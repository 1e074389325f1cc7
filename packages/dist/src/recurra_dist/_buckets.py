"""The buckets of :class:`~recurra_dist.parallel.DataParallel` and the moves of their
gradients: packed into a bucket's host buffer (on a device: concatenated there, one
download), and the averaged values back into the gradients (on a device: cut into them
there, in one computation or piece by piece)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import recurra as rc
from recurra import Tensor, _core


def _device_buffer(t: Tensor) -> rc.DeviceBuffer | None:
    """The DeviceBuffer behind a device tensor, or None for a host tensor."""
    v = t.storage
    return v if isinstance(v, rc.DeviceBuffer) else None


class Bucket:
    """A run of consecutive parameters exchanged together, and its host buffer.

    Where the parameters live on a device with asynchronous reads, the buffer is host-visible
    memory of that device (``staged``): MPI sums into it in place, and the averaged
    gradients are cut out of it on the device, without a copy to upload first. Where the
    ranks share a host and the device imports host memory, that memory is the bucket's place
    in MPI's shared window (``imported``, :meth:`import_into`): the device's copies land where
    the other ranks read them."""

    __slots__ = ("params", "offsets", "buffer", "staged", "imported")

    #: whether buffers may be host-visible device memory (bench/dist.py --staging off: no;
    #: they then live in MPI's shared window, downloaded into it through a staging copy)
    stage = True
    #: whether the device may import the bucket's place in the shared window
    #: (bench/dist.py --import-host off: no; host-visible memory copied into the window)
    import_host = True

    def __init__(self, params: list[Tensor], host: bool = True) -> None:
        self.params = params
        self.offsets = np.cumsum([0] + [int(p.size) for p in params]).tolist()
        self.buffer = np.empty(self.offsets[-1], np.float32)
        self.staged: rc.DeviceBuffer | None = None
        self.imported = False
        if host and self.stageable():
            self.host_visible()

    def host_visible(self) -> None:
        """Makes the buffer host-visible memory of the parameters' device."""
        self.staged = _core.DeviceBuffer(self.device, max(self.buffer.nbytes, 4), "host")
        self.buffer = self.staged.host_array()[: self.buffer.nbytes].view(np.float32)

    @property
    def device(self) -> str:
        return str(self.params[0].device)

    def stageable(self) -> bool:
        """Whether the buffer may be host-visible memory of the parameters' device."""
        dev = self.params[0].device
        return (
            dev.backend != "cpu"
            and all(p.device == dev and p.dtype == rc.float32 for p in self.params)
            and _core.has_async_reads(str(dev))
            and Bucket.stage
        )

    def import_into(self, region: np.ndarray) -> bool:
        """Makes ``region`` (float32, page-aligned, at least the bucket's size) the bucket's
        buffer, imported by its device; False (nothing changed) where the device refuses."""
        try:
            buf = _core.DeviceBuffer.import_host(self.device, region.view(np.uint8))
        except ValueError:
            return False
        self.staged, self.imported = buf, True
        self.buffer = region[: self.buffer.size]
        return True

    def view(self, i: int) -> np.ndarray:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i + 1]].reshape(p.shape)


def make_buckets(params: list[Tensor], max_elems: int, host: bool = True) -> list[Bucket]:
    """Cuts ``params`` (in order) into runs of at most ``max_elems`` elements (a larger
    parameter is a bucket alone); ``host=False``: the buffers are placed later (no
    host-visible memory yet)."""
    out: list[Bucket] = []
    run: list[Tensor] = []
    size = 0
    for p in params:
        if run and size + int(p.size) > max_elems:
            out.append(Bucket(run, host))
            run, size = [], 0
        run.append(p)
        size += int(p.size)
    if run:
        out.append(Bucket(run, host))
    return out


def compute(ts: list[Tensor]) -> None:
    """Runs what ``ts`` still need (one lazy run; the results stay on their device)."""
    pending = [t for t in ts if t.storage is None]
    if pending:
        pending[0]._frontend.run(pending)


def packed_device(b: Bucket, act: list[bool]) -> Any:
    """The device of a bucket whose gradients all live on one device backend (they are then
    packed there into one tensor: one download and one upload per bucket), else None."""
    dev = b.params[0].device
    if dev.backend == "cpu" or not all(act):
        return None
    for p in b.params:
        g = p.grad
        if not isinstance(g, Tensor) or g.device != dev or g.shape != p.shape or p.device != dev:
            return None
    return dev


def pack(b: Bucket) -> Any:
    """Copies every gradient of bucket ``b`` into its buffer (on one device: packed there,
    one download); returns that device, or None."""
    dev = packed_device(b, [True] * len(b.params))
    if dev is not None:
        download_packed(b)
    else:
        for i, p in enumerate(b.params):
            read_grad_into(p, b.view(i))
    return dev


def download_packed(b: Bucket) -> None:
    """Concatenates the bucket's gradients on their device and downloads them at once."""
    packed_reader(b)(0, b.buffer.size)


def packed_reader(b: Bucket) -> Callable[[int, int], None]:
    """Concatenates the bucket's gradients on their device; returns ``read(lo, hi)``, which
    downloads elements [lo, hi) of them into the bucket's buffer (where it is host-visible
    memory of the device: one device copy straight into it), so that a piece can be summed
    while the next one is downloaded."""
    with rc.no_grad():
        flat = []
        for p in b.params:
            assert p.grad is not None  # _device_of checked every gradient of the bucket
            flat.append(p.grad.reshape(-1))
        packed = rc.ops.concat(flat) if len(flat) > 1 else flat[0]
    compute([packed])
    src = _device_buffer(packed)
    if src is None:  # not in a buffer of its own: at once
        read_into(packed, b.buffer)
        return lambda lo, hi: None

    def read(lo: int, hi: int) -> None:
        if hi > lo:
            src.download(b.buffer[lo:hi], 4 * lo)

    return read


def upload_packed(b: Bucket, dev: Any) -> None:
    """Uploads the bucket at once and cuts it into the new gradients on the device."""
    whole = rc.tensor(b.buffer, device=dev)
    with rc.no_grad():
        parts = [
            rc.ops.getitem(whole, slice(b.offsets[i], b.offsets[i + 1])).reshape(p.shape)
            for i, p in enumerate(b.params)
        ]
    compute(parts)
    for p, t in zip(b.params, parts):
        p.grad = t.detach()


def upload_staged(buckets: list[Bucket], scale: np.float32) -> None:
    """Writes the means of buckets summed in host-visible device memory back into their
    gradients: one computation for all of them, which cuts each bucket into its parameters'
    shapes and scales it by ``scale`` on the device (the same float32 product as on the
    host)."""
    if not buckets:
        return
    news: list[tuple[Tensor, Tensor]] = []
    with rc.no_grad():
        for b in buckets:
            for i, t in staged_parts(b, 0, b.offsets[-1], scale):
                news.append((b.params[i], t.reshape(b.params[i].shape)))
    set_grads(news)


def staged_parts(b: Bucket, lo: int, hi: int, scale: np.float32) -> list[tuple[int, Tensor]]:
    """Elements [lo, hi) of bucket ``b``'s host-visible buffer, scaled by ``scale`` on its
    device (lazily), cut at its parameters' bounds: (parameter index, 1-D tensor), in order."""
    assert b.staged is not None
    dev = b.params[0].device
    whole = Tensor._new(None, (), (), (), (b.offsets[-1],), rc.float32, b.staged, False, dev)
    out = []
    with rc.no_grad():
        for i in range(len(b.params)):
            x, y = max(lo, b.offsets[i]), min(hi, b.offsets[i + 1])
            if x < y:
                out.append((i, rc.ops.getitem(whole, slice(x, y)) * float(scale)))
    return out


def set_grads(news: list[tuple[Tensor, Tensor]]) -> None:
    """Computes the new gradients (one run) and sets them."""
    compute([t for _, t in news])
    for p, t in news:
        p.grad = t.detach()


def read_into(t: Tensor, out: np.ndarray) -> None:
    """Copies tensor ``t``'s value into host array ``out`` (a download for a device tensor)."""
    buf = _device_buffer(t)
    if buf is not None:
        buf.download(out)
    else:
        np.copyto(out, np.asarray(t), casting="same_kind")


def read_grad_into(p: Tensor, out: np.ndarray) -> None:
    g: Tensor | np.ndarray | None = p.grad  # a numpy array where a user set one
    if g is None or g.shape != p.shape:
        shape = None if g is None else g.shape
        raise ValueError(f"the gradient has shape {shape}, the parameter {p.shape}")
    if isinstance(g, Tensor):
        read_into(g, out)
    else:
        np.copyto(out, np.asarray(g, np.float32))


def write_grad(p: Tensor, value: np.ndarray) -> None:
    """Sets ``p.grad`` to ``value``, in place where the gradient's buffer allows it."""
    g = p.grad
    if isinstance(g, Tensor) and g.is_leaf:
        buf = _device_buffer(g)
        if buf is not None:
            buf.upload(value)
            return
        arr = g.storage
        if (
            isinstance(arr, np.ndarray)
            and arr.dtype == np.float32
            and arr.flags.writeable
            and arr.flags.c_contiguous
        ):
            np.copyto(arr, value)
            return
    p.grad = rc.tensor(value, device=p.device)
