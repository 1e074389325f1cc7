"""Copies between the host and a Vulkan device: through the staging buffer (in chunks, its
two halves taking turns), and straight into or out of host-visible memory of the device
(DeviceBuffer(pool='host'): one device copy, no staging).

On a CPU device (lavapipe) every buffer is host-visible and a copy is a memcpy;
RECURRA_VULKAN_HOST_VISIBLE=0 lays buffers out as on a discrete GPU, so that the staged and
the direct paths run here too (in a process of their own: the device reads it once)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import recurra as rc

# element counts: one, an odd size, and 80 MB (3 chunks of the 32 MB staging halves)
SIZES = [1, 1_234_567, 20_000_001]


def check_round_trips(device: str) -> None:
    """Uploads and downloads of SIZES, whole and at offsets, from and into ordinary host
    memory and host-visible device memory; each byte compared with numpy's."""
    rng = np.random.default_rng(7)
    for n in SIZES:
        a = rng.standard_normal(n).astype(np.float32)
        buf = rc.DeviceBuffer(device, a.nbytes + 8)
        buf.upload(a, 8)
        out = np.full(n, np.nan, np.float32)
        buf.download(out, 8)
        assert out.tobytes() == a.tobytes(), n
        # into host-visible memory of the device, 12 bytes in (not at the block's start)
        host = rc.DeviceBuffer(device, a.nbytes + 16, "host")
        view = host.host_array()[12 : 12 + a.nbytes].view(np.float32)
        view[...] = np.nan
        buf.download(view, 8)
        assert view.tobytes() == a.tobytes(), n
        # and from there into another buffer, then back to ordinary memory
        view *= np.float32(2.0)
        other = rc.DeviceBuffer(device, a.nbytes)
        other.upload(view)
        back = np.empty(n, np.float32)
        other.download(back)
        assert back.tobytes() == (a * np.float32(2.0)).tobytes(), n
        # a part of the buffer alone
        if n > 1:
            part = np.empty(n // 2, np.float32)
            buf.download(part, 8 + 4 * (n - n // 2))
            assert part.tobytes() == a[n - n // 2 :].tobytes(), n


def test_round_trips(vulkan: str) -> None:
    check_round_trips(vulkan)


def test_round_trips_through_staging(vulkan: str) -> None:
    """The same with buffers the host cannot map (as on a discrete GPU)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import recurra.backends as b; "
        "b.available(); import test_vulkan_transfers as t; "
        "t.check_round_trips('vulkan'); print('ROUND TRIPS OK')"
    )
    env = dict(os.environ, RECURRA_VULKAN_HOST_VISIBLE="0")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run(
        [sys.executable, "-c", code, here], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and "ROUND TRIPS OK" in r.stdout, r.stdout + r.stderr


def test_unmapped_buffers_train_the_same(vulkan: str) -> None:
    """A small training computation gives the same bits whichever memory the buffers use."""
    code = (
        "import numpy as np, recurra as rc, recurra.backends as b; b.available()\n"
        "x = rc.tensor(np.linspace(-2, 2, 4096, dtype=np.float32).reshape(64, 64), "
        "device='vulkan').requires_grad_()\n"
        "y = (rc.ops.matmul(x, x) * 0.5).sum()\n"
        "y.backward()\n"
        "import sys; sys.stdout.write(x.grad.numpy().tobytes().hex())\n"
    )
    outs = []
    for v in ("1", "0"):
        env = dict(os.environ, RECURRA_VULKAN_HOST_VISIBLE=v)
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    ref = np.linspace(-2, 2, 4096, dtype=np.float64).reshape(64, 64)
    grad = np.frombuffer(bytes.fromhex(outs[1]), np.float32).reshape(64, 64)
    ones = np.full((64, 64), 0.5)
    np.testing.assert_allclose(grad, ones @ ref.T + ref.T @ ones, rtol=1e-5, atol=1e-4)
    assert outs[0] == outs[1]
