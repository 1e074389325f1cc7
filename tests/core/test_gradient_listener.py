"""Gradient listeners (``recurra.add_gradient_listener``): a backward reports each group of
parameters as soon as its gradients are final, while the rest of the backward still runs
(recurra_dist starts a bucket's exchange there). What a listener reads must be the
gradient (float64 numpy reference, and bitwise the ``.grad`` the backward stores), the
groups must come in the order the backward completes them (last layers first), and a
captured step must report the same."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import recurra as rc
from recurra import ops

D, ROWS = 6, 5


def _params(seed: int = 0, device: str = "cpu") -> list[rc.Tensor]:
    rng = np.random.default_rng(seed)
    shapes = [(D, D), (D, D), (D, 1), (D, 3)]  # the last one takes no part in the loss
    return [
        rc.param(rng.standard_normal(s).astype(np.float32) * 0.4, device=device) for s in shapes
    ]


def _data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((ROWS, D)).astype(np.float32),
        rng.standard_normal((ROWS, 1)).astype(np.float32),
    )


def _loss(ps: list[rc.Tensor], x: rc.Tensor, y: rc.Tensor) -> rc.Tensor:
    h = ops.tanh(ops.tanh(x @ ps[0]) @ ps[1])
    return ops.mean(ops.sqr(h @ ps[2] - y))


def _reference(ps: list[rc.Tensor], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """d loss / d w0, w1, w2 in float64 numpy (by hand)."""
    w0, w1, w2 = (p.numpy().astype(np.float64) for p in ps[:3])
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    h1 = np.tanh(x64 @ w0)
    h2 = np.tanh(h1 @ w1)
    dr = 2.0 * (h2 @ w2 - y64) / y64.size
    g2 = h2.T @ dr
    dz2 = (dr @ w2.T) * (1 - h2**2)
    g1 = h1.T @ dz2
    g0 = x64.T @ ((dz2 @ w1.T) * (1 - h1**2))
    return [g0, g1, g2]


class Recorder:
    """Reads every parameter of a group when it is reported."""

    def __init__(self, params: list[rc.Tensor], groups: list[list[int]]) -> None:
        self.params, self.groups = params, groups
        self.events: list[Any] = []
        self.values: dict[int, np.ndarray] = {}
        self.packed: dict[int, np.ndarray] = {}
        self.present: list[bool] = []
        self.listen = True
        self.fail_at: int | None = None

    def begin(self, present: list[bool]) -> bool:
        self.events.append("begin")
        self.present = present
        return self.listen

    def ready(self, k: int, read: Any) -> None:
        self.events.append(k)
        if k == self.fail_at:
            raise KeyError("stop here")
        group = self.groups[k]
        if all(self.present[i] for i in group):  # read together too: the same values
            flat = np.empty(sum(self.params[i].size for i in group), np.float32)
            read(group, flat)
            self.packed[k] = flat
        for i in group:
            if self.present[i]:
                out = np.empty(self.params[i].shape, np.float32)
                read(i, out)
                self.values[i] = out
            else:
                with pytest.raises(ValueError, match="no gradient"):
                    read(i, np.empty(self.params[i].shape, np.float32))

    def end(self) -> None:
        self.events.append("end")


@pytest.fixture
def recorder_for():
    made: list[Recorder] = []

    def make(ps: list[rc.Tensor], groups: list[list[int]]) -> Recorder:
        rec = Recorder(ps, groups)
        rc.add_gradient_listener(rec)
        made.append(rec)
        return rec

    yield make
    for rec in made:
        rc.remove_gradient_listener(rec)


def test_groups_are_reported_last_layer_first_with_the_final_gradients(recorder_for) -> None:
    ps = _params()
    x, y = _data()
    # groups in the optimizer's order (first layer first) and the unused parameter
    rec = recorder_for(ps, [[0], [1], [2], [3]])
    _loss(ps, rc.tensor(x), rc.tensor(y)).backward()
    # the unused parameter's group is final at once; then the backward completes w2, w1, w0
    assert rec.events == ["begin", 3, 2, 1, 0, "end"]
    assert rec.present == [True, True, True, False]
    for i, ref in enumerate(_reference(ps, x, y)):
        got = rec.values[i]
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=1e-6)
        assert ps[i].grad is not None
        assert got.tobytes() == ps[i].grad.numpy().tobytes()  # what backward() stores
    assert ps[3].grad is None


def _check_packed(rec: Recorder) -> None:
    """What read(group, out) gave: the group's gradients one after the other."""
    assert rec.packed
    for k, flat in rec.packed.items():
        parts = [rec.values[i].reshape(-1) for i in rec.groups[k]]
        assert flat.tobytes() == np.concatenate(parts).tobytes()


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_a_group_waits_for_its_last_gradient(recorder_for, device, request) -> None:
    dev = request.getfixturevalue("vulkan") if device == "vulkan" else "cpu"
    ps = _params(device=dev)
    x, y = _data()
    rec = recorder_for(ps, [[0, 2], [1]])  # w0 is final after w1
    _loss(ps, rc.tensor(x, device=dev), rc.tensor(y, device=dev)).backward()
    assert rec.events == ["begin", 1, 0, "end"]
    assert set(rec.values) == {0, 1, 2}
    _check_packed(rec)
    assert set(rec.packed) == {0, 1}


def test_read_gives_this_backwards_gradient_not_the_sum(recorder_for) -> None:
    ps = _params()
    (x0, y0), (x1, y1) = _data(1), _data(2)
    _loss(ps, rc.tensor(x0), rc.tensor(y0)).backward()  # no listener yet
    first = [p.grad.numpy().copy() for p in ps[:3]]  # type: ignore[union-attr]
    rec = recorder_for(ps, [[2], [1], [0]])
    _loss(ps, rc.tensor(x1), rc.tensor(y1)).backward()
    for i, ref in enumerate(_reference(ps, x1, y1)):
        np.testing.assert_allclose(rec.values[i], ref, rtol=2e-4, atol=1e-6)
        total = (first[i] + rec.values[i]).tobytes()
        assert ps[i].grad is not None and ps[i].grad.numpy().tobytes() == total


def test_a_listener_may_sit_out_and_an_error_stops_the_backward(recorder_for) -> None:
    ps = _params()
    x, y = _data()
    rec = recorder_for(ps, [[2], [1], [0]])
    rec.listen = False
    _loss(ps, rc.tensor(x), rc.tensor(y)).backward()
    assert rec.events == ["begin"]
    ref = [p.grad.numpy().copy() for p in ps[:3]]  # type: ignore[union-attr]
    for p in ps:
        p.grad = None
    rec.listen, rec.fail_at, rec.events = True, 1, []
    with pytest.raises(KeyError, match="stop here"):
        _loss(ps, rc.tensor(x), rc.tensor(y)).backward()
    assert rec.events == ["begin", 0, 1]
    assert all(p.grad is None for p in ps)
    rec.fail_at, rec.events = None, []  # the graph works again
    _loss(ps, rc.tensor(x), rc.tensor(y)).backward()
    assert rec.events == ["begin", 0, 1, 2, "end"]
    for i in range(3):
        assert ps[i].grad is not None and ps[i].grad.numpy().tobytes() == ref[i].tobytes()


def test_a_listener_that_is_dropped_is_forgotten() -> None:
    ps = _params()
    x, y = _data()
    rec = Recorder(ps, [[0]])
    rc.add_gradient_listener(rec)
    events = rec.events
    del rec  # held weakly
    _loss(ps, rc.tensor(x), rc.tensor(y)).backward()
    assert events == []


def test_a_captured_step_reports_like_backward(recorder_for) -> None:
    ps = _params()
    rec = recorder_for(ps, [[2], [1], [0]])
    step = rc.capture(lambda x, y: _loss(ps, x, y), backward=True)
    for seed in (1, 2, 3):
        x, y = _data(seed)
        rec.events = []
        step(x, y)
        assert rec.events == ["begin", 0, 1, 2, "end"]
        for i, ref in enumerate(_reference(ps, x, y)):
            np.testing.assert_allclose(rec.values[i], ref, rtol=2e-4, atol=1e-6)
            assert ps[i].grad is not None
            assert rec.values[i].tobytes() == ps[i].grad.numpy().tobytes()
        for p in ps:
            p.grad = None
    assert step.replays == 2


@pytest.mark.vulkan
def test_device_splits_are_cut_where_a_group_completes(recorder_for, vulkan) -> None:
    ps = _params(device=vulkan)
    x, y = _data()
    rec = recorder_for(ps, [[0], [1], [2]])
    loss = _loss(ps, rc.tensor(x, device=vulkan), rc.tensor(y, device=vulkan))
    loss.backward()
    assert rec.events == ["begin", 2, 1, 0, "end"]
    for i, ref in enumerate(_reference(ps, x, y)):
        np.testing.assert_allclose(rec.values[i], ref, rtol=2e-4, atol=1e-6)
        assert ps[i].grad is not None
        assert rec.values[i].tobytes() == ps[i].grad.numpy().tobytes()
    _check_packed(rec)


@pytest.mark.vulkan
def test_an_asynchronous_read_waits_for_the_copy_in_flight(recorder_for, vulkan, monkeypatch):
    """On a device with asynchronous reads the backward is submitted whole and the groups
    are reported while it runs: a read waits for the part that copies its gradients (here
    the first layer's, behind a long chain), never giving the copy of the step before."""
    from recurra import _core

    assert _core.has_async_reads(vulkan)
    rng = np.random.default_rng(5)
    width, rows, depth = 96, 256, 24
    mix = rc.tensor(rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width), vulkan)
    ps = [
        rc.param(rng.standard_normal((D, width)).astype(np.float32) * 0.3, device=vulkan),
        rc.param(rng.standard_normal((width, 1)).astype(np.float32) * 0.3, device=vulkan),
    ]

    def loss(x: rc.Tensor, y: rc.Tensor) -> rc.Tensor:
        h = ops.tanh(x @ ps[0])
        for _ in range(depth):  # the long part between the two gradients
            h = ops.tanh(h @ mix)
        return ops.mean(ops.sqr(h @ ps[1] - y))

    rec = recorder_for(ps, [[0], [1]])
    seen = []
    for seed in (11, 12, 13):
        x = rng.standard_normal((rows, D)).astype(np.float32)
        y = rng.standard_normal((rows, 1)).astype(np.float32)
        for p in ps:
            p.grad = None
        rec.events = []
        loss(rc.tensor(x, vulkan), rc.tensor(y, vulkan)).backward()
        assert rec.events == ["begin", 1, 0, "end"]
        for i in (0, 1):
            assert rec.values[i].tobytes() == ps[i].grad.numpy().tobytes(), (seed, i)
        seen.append(rec.values[0].copy())
        # the same backward read synchronously gives the same bits
        monkeypatch.setenv("RECURRA_ASYNC_READS", "0")
        for p in ps:
            p.grad = None
        loss(rc.tensor(x, vulkan), rc.tensor(y, vulkan)).backward()
        monkeypatch.delenv("RECURRA_ASYNC_READS")
        assert rec.values[0].tobytes() == seen[-1].tobytes()
    # each step's own gradient, not one kept from the step before
    assert not np.array_equal(seen[0], seen[1]) and not np.array_equal(seen[1], seen[2])


def test_device_buffer_misuse_raises() -> None:
    with pytest.raises(ValueError, match="unknown or unavailable device backend"):
        rc.DeviceBuffer("cpu", 16, "host")
    from recurra import _core

    assert not _core.has_async_reads("cpu") and not _core.has_async_reads("nonesuch")


@pytest.mark.vulkan
def test_host_visible_device_buffer(vulkan) -> None:
    """DeviceBuffer(pool='host'): host-visible memory; what the host writes, a download
    reads; a device buffer has no host array; a bad pool name is refused."""
    buf = rc.DeviceBuffer(vulkan, 64, "host")
    assert buf.host_visible
    arr = buf.host_array()
    assert arr.dtype == np.uint8 and arr.shape == (64,)
    arr[:] = np.arange(64, dtype=np.uint8)
    out = np.empty(64, np.uint8)
    buf.download(out)
    assert out.tolist() == list(range(64))
    dev = rc.DeviceBuffer(vulkan, 64)
    assert not dev.host_visible
    with pytest.raises(ValueError, match="pool='host'"):
        dev.host_array()
    with pytest.raises(ValueError, match="pool is"):
        rc.DeviceBuffer(vulkan, 64, "pinned")


def _page_aligned(nbytes: int) -> tuple[Any, np.ndarray]:
    """``nbytes`` (a multiple of the page) of anonymous memory at a page: (the mapping, its
    bytes)."""
    import mmap

    m = mmap.mmap(-1, nbytes)
    return m, np.frombuffer(m, np.uint8)


@pytest.mark.vulkan
def test_imported_host_memory(vulkan) -> None:
    """DeviceBuffer.import_host: the device reads and writes the caller's page-aligned memory
    (a download lands in it, a tensor over it reads what the host wrote); memory not on a
    page boundary is refused with ValueError; freeing the buffer leaves the memory alone."""
    import mmap

    from recurra import _core
    from recurra._devices import parse_device

    if not _core.can_import_host(vulkan):
        pytest.skip(f"{vulkan} cannot import host memory (no VK_EXT_external_memory_host)")
    page = mmap.PAGESIZE
    m, mem = _page_aligned(4 * page)
    buf = rc.DeviceBuffer.import_host(vulkan, mem)
    assert buf.host_visible and buf.nbytes == 4 * page
    floats = mem.view(np.float32)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(floats.size).astype(np.float32)
    floats[:] = x
    back = np.empty_like(x)
    buf.download(back)
    assert back.tobytes() == x.tobytes()
    # a device result downloaded into the imported memory (one device copy)
    t = rc.tensor(x, device=vulkan) * 2.0
    t._frontend.run([t])
    t.storage.download(floats)
    assert floats.tobytes() == (x * np.float32(2.0)).tobytes()
    # the memory as a tensor's storage on the device
    n = floats.size
    dev = parse_device(vulkan)
    whole = rc.Tensor._new(None, (), (), (), (n,), rc.float32, buf, False, dev)
    assert (whole + 1.0).numpy().tobytes() == (floats + np.float32(1.0)).tobytes()
    with pytest.raises(ValueError, match="multiples"):
        rc.DeviceBuffer.import_host(vulkan, mem[16 : 16 + page])
    with pytest.raises(ValueError, match="multiples"):
        rc.DeviceBuffer.import_host(vulkan, mem[: page + 4])
    del whole, t, buf
    import gc

    gc.collect()
    floats[:] = 7.0  # still the caller's memory, still writable
    assert floats[0] == 7.0
    del floats, mem
    m.close()
    assert not _core.can_import_host("cpu") and not _core.can_import_host("nonesuch")


@pytest.mark.vulkan
def test_a_listener_target_receives_the_group_on_the_device(recorder_for, vulkan) -> None:
    """A listener's target(k) (host-visible memory of the device): the backward copies group
    k's gradients there packed, so read(group, that memory) copies nothing and finds them;
    the graph does not keep the memory after the backward. A group this backward does not
    wholly compute gets no target."""
    from recurra import _core

    assert _core.has_async_reads(vulkan)
    ps = _params(device=vulkan)
    x, y = _data()
    groups = [[2], [1, 0], [3]]
    sizes = [sum(int(ps[i].size) for i in g) for g in groups]
    bufs = [rc.DeviceBuffer(vulkan, 4 * n, "host") for n in sizes]
    arrays = [b.host_array().view(np.float32) for b in bufs]
    rec = recorder_for(ps, groups)
    asked: list[int] = []

    def target(k: int) -> Any:
        asked.append(k)
        return bufs[k]

    rec.target = target  # type: ignore[attr-defined]
    for a in arrays:
        a[:] = np.nan
    loss = _loss(ps, rc.tensor(x, device=vulkan), rc.tensor(y, device=vulkan))
    loss.backward()
    assert sorted(asked) == [0, 1]  # parameter 3 has no gradient: group 2 gets none
    ref = _reference(ps, x, y)
    for k in (0, 1):
        want = np.concatenate([ps[i].grad.numpy().reshape(-1) for i in groups[k]])
        assert arrays[k].tobytes() == want.tobytes(), k  # the device wrote it there
        assert rec.packed[k].tobytes() == want.tobytes(), k
        got = np.concatenate([ref[i].reshape(-1) for i in groups[k]])
        np.testing.assert_allclose(arrays[k], got, rtol=1e-4, atol=1e-6)
    assert np.isnan(arrays[2]).all()
    # reading into the target itself: nothing to copy, the same bits
    rec.packed.clear()

    def ready_into_target(k: int, read: Any) -> None:
        if k in (0, 1):
            read(groups[k], arrays[k])
            rec.packed[k] = arrays[k].copy()

    rec.ready = ready_into_target  # type: ignore[method-assign]
    for p in ps:
        p.grad = None
    _loss(ps, rc.tensor(x, device=vulkan), rc.tensor(y, device=vulkan)).backward()
    for k in (0, 1):
        want = np.concatenate([ps[i].grad.numpy().reshape(-1) for i in groups[k]])
        assert rec.packed[k].tobytes() == want.tobytes(), k
