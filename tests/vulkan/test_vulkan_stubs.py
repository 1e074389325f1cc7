"""recurra_vulkan/_vk.pyi matches the bindings; typed public API on a device (Tensor.storage,
an optimizer's state restored in place on the device, the repr of a device tensor)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stub_check import compare

import recurra
import recurra_optim

pytestmark = pytest.mark.vulkan


def test_vk_stub_matches_the_bindings(vulkan: str) -> None:
    from recurra_vulkan import _vk

    stub = Path(_vk.__file__).with_name("_vk.pyi")
    if not stub.exists():  # an editable install: the stub sits in the source tree
        stub = Path(__file__).parents[2] / "packages/vulkan/src/recurra_vulkan/_vk.pyi"
    assert compare(_vk, stub) == []


def test_storage_of_a_device_tensor_is_a_device_buffer(vulkan: str) -> None:
    t = recurra.tensor(np.arange(5, dtype=np.float32), device=vulkan)
    s = t.storage
    assert isinstance(s, recurra.DeviceBuffer)
    assert s.valid and s.nbytes >= 5 * 4 and s.backend.startswith(vulkan)
    host = np.empty(5, np.float32)
    s.download(host)
    np.testing.assert_array_equal(host, np.arange(5))
    u = t * 2.0
    assert u.storage is None
    assert "pending" in repr(u)
    np.testing.assert_array_equal(u.numpy(), 2.0 * np.arange(5))
    assert repr(u) == f"recurra.Tensor(on {u.device}, shape=(5,), dtype=float32)"


def test_load_state_dict_restores_device_state_in_place(vulkan: str) -> None:
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((4, 3)).astype(np.float32)
    grads = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3)]

    def run(p: recurra.Tensor, opt: recurra_optim.Adam, gs: list[np.ndarray]) -> None:
        for g in gs:
            p.grad = recurra.tensor(g, device=p.device)
            opt.step()

    p = recurra.param(w0, device=vulkan)
    opt = recurra_optim.Adam([p], lr=0.1)
    run(p, opt, grads[:2])
    saved, w_saved = opt.state_dict(), p.numpy()

    q = recurra.param(w_saved, device=vulkan)
    other = recurra_optim.Adam([q], lr=0.1)
    bufs = {k: t.storage for k, t in other.state[q].items()}
    other.load_state_dict(saved)
    assert other.resident
    # the same device buffers, now holding the saved values
    assert all(other.state[q][k].storage is b for k, b in bufs.items())
    for k, want in saved["state"][0].items():
        got = other.state[q][k].numpy()
        np.testing.assert_array_equal(got.reshape(np.shape(want)), want, err_msg=k)
    # and the next step continues exactly as the original optimizer's
    run(p, opt, grads[2:])
    run(q, other, grads[2:])
    np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-6, atol=1e-7)
