"""Master weights: 2-byte parameters are updated through a float32 master copy with float32
moments; the 2-byte parameter is the master rounded to nearest even after every step.
Dynamic loss scaling divides the gradients by the scale and skips overflowing steps."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import recurra as rc
from recurra_optim import SGD, AdamW, DynamicLossScale, clip_grad_norm_

BF16 = ml_dtypes.bfloat16


def _pair(dtype: rc.DType, seed: int = 0):
    """A 2-byte parameter and a float32 one holding the same (rounded) values."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((5, 7)).astype(dtype.numpy)
    return rc.param(w, dtype=dtype), rc.param(w.astype(np.float32))


def _grads(steps: int, dtype: rc.DType, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((5, 7)).astype(dtype.numpy) for _ in range(steps)]


@pytest.mark.parametrize("dtype", [rc.bfloat16, rc.float16])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_master_weights_follow_the_float32_run(dtype: rc.DType, clip: float | None) -> None:
    """The master is updated exactly as a float32 parameter with the same (2-byte, exactly
    converted) gradients; the 2-byte parameter is the master rounded each step."""
    p, q = _pair(dtype)
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=clip)
    opt_h, opt_f = AdamW([p], **kw), AdamW([q], **kw)
    for g in _grads(6, dtype):
        p.grad = rc.tensor(g)
        q.grad = rc.tensor(g.astype(np.float32))
        opt_h.step()
        opt_f.step()
        master = opt_h.state[p]["master"]
        assert p.dtype == dtype and master.dtype == rc.float32
        assert opt_h.state[p]["exp_avg"].dtype == rc.float32
        np.testing.assert_array_equal(master.numpy(), q.numpy())
        np.testing.assert_array_equal(p.numpy(), q.numpy().astype(dtype.numpy))
        if clip is not None:
            assert opt_h.last_grad_norm == pytest.approx(opt_f.last_grad_norm, rel=1e-6)
    # small updates that round away in bf16 still accumulate in the master
    assert not np.array_equal(master.numpy(), p.numpy().astype(np.float32))


def test_master_in_state_dict_and_reload() -> None:
    p, q = _pair(rc.bfloat16)
    opt = AdamW([p], lr=1e-2)
    gs = _grads(4, rc.bfloat16)
    for g in gs[:2]:
        p.grad = rc.tensor(g)
        opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["master"].dtype == np.float32
    # a fresh parameter and optimizer restored from it continue identically
    p2 = rc.param(np.zeros((5, 7)), dtype=rc.bfloat16)
    opt2 = AdamW([p2], lr=1e-2)
    opt2.load_state_dict(sd)
    np.testing.assert_array_equal(p2.numpy(), p.numpy())  # written from the master
    for g in gs[2:]:
        for pp, oo in ((p, opt), (p2, opt2)):
            pp.grad = rc.tensor(g)
            oo.step()
    np.testing.assert_array_equal(opt2.state[p2]["master"].numpy(), opt.state[p]["master"].numpy())
    np.testing.assert_array_equal(p2.numpy(), p.numpy())
    # a float32 parameter refuses a master entry
    opt_f = AdamW([q], lr=1e-2)
    bad = opt_f.state_dict()
    bad["state"][0]["master"] = np.zeros((5, 7), np.float32)
    with pytest.raises(ValueError, match="master"):
        opt_f.load_state_dict(bad)


def test_save_load_file_round_trip(tmp_path) -> None:
    p, _ = _pair(rc.bfloat16)
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad = rc.tensor(_grads(1, rc.bfloat16)[0])
    opt.step()
    opt.save(tmp_path / "o.safetensors")
    p2 = rc.param(np.zeros((5, 7)), dtype=rc.bfloat16)
    opt2 = SGD([p2], lr=0.1, momentum=0.9)
    opt2.load(tmp_path / "o.safetensors")
    np.testing.assert_array_equal(opt2.state[p2]["master"].numpy(), opt.state[p]["master"].numpy())
    np.testing.assert_array_equal(p2.numpy(), p.numpy())


def test_clip_grad_norm_on_2byte_gradients() -> None:
    p, q = _pair(rc.bfloat16)
    g = _grads(1, rc.bfloat16)[0]
    p.grad = rc.tensor(g)
    q.grad = rc.tensor(g.astype(np.float32))
    n_h = clip_grad_norm_([p], 0.5)
    n_f = clip_grad_norm_([q], 0.5)
    assert n_h == pytest.approx(n_f, rel=1e-6)
    np.testing.assert_allclose(np.asarray(p.grad, np.float32), q.grad.numpy(), rtol=1e-6)


def test_int_parameters_are_refused() -> None:
    t = rc.tensor(np.zeros(3, np.int32))
    with pytest.raises((TypeError, ValueError)):
        AdamW([t])


def test_dynamic_loss_scale_unscales_and_skips() -> None:
    p, q = _pair(rc.bfloat16)
    q_ref = rc.param(q.numpy())
    opt, ref = AdamW([q], lr=1e-2), AdamW([q_ref], lr=1e-2)
    scaler = DynamicLossScale(init_scale=1024.0, growth_interval=2)
    g = _grads(3, rc.float16)
    # a finite step: the gradient (scaled by 1024) is divided by the scale in the step
    q.grad = rc.tensor(g[0].astype(np.float32) * 1024.0)
    q_ref.grad = rc.tensor(g[0].astype(np.float32))
    assert scaler.step(opt) and scaler.scale_value == 1024.0
    ref.step()
    np.testing.assert_allclose(q.numpy(), q_ref.numpy(), rtol=1e-6, atol=1e-7)
    # an overflowing step: skipped, nothing changes, the scale halves, gradients cleared
    before = q.numpy()
    state = opt.state[q]["exp_avg"].numpy()
    bad = g[1].astype(np.float32)
    bad[0, 0] = np.inf
    q.grad = rc.tensor(bad)
    assert not scaler.step(opt)
    assert scaler.scale_value == 512.0 and scaler.skipped == 1 and q.grad is None
    np.testing.assert_array_equal(q.numpy(), before)
    np.testing.assert_array_equal(opt.state[q]["exp_avg"].numpy(), state)
    assert opt.step_count == 1
    # growth after growth_interval good steps
    for _ in range(2):
        q.grad = rc.tensor(g[2].astype(np.float32))
        assert scaler.step(opt)
    assert scaler.scale_value == 1024.0
    st = scaler.state_dict()
    other = DynamicLossScale()
    other.load_state_dict(st)
    assert other.state_dict() == st
    with pytest.raises(ValueError):
        other.load_state_dict({"scale": -1.0, "good_steps": 0, "skipped": 0})
    with pytest.raises(ValueError):
        DynamicLossScale(init_scale=0.0)
