"""The core's update ops (sgd_step, adam_step, adamw_step, lion_step, grad_norm, grad_clip):
in-place semantics, validation, and the math against float64 numpy, through FusedStep and
through the explicit graph API."""

from __future__ import annotations

import numpy as np
import pytest
from optim_reference import adam, assert_close, lion, sgd

import recurra
from recurra.ops import HYPER_LEN, FusedStep, pack_hyper

RNG = np.random.default_rng(42)
# 70001 spans two 65536-element chunks; the small ones share a chunk.
SIZES = [(1,), (3,), (17,), (5, 7), (70001,)]


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_pack_hyper_keeps_double_precision() -> None:
    h = pack_hyper({"lr": 1e-3, "b": 0.999, "c": 1e-8})
    assert h.dtype == np.float32 and h.shape == (HYPER_LEN,)
    back = h[0::2].astype(np.float64) + h[1::2].astype(np.float64)
    assert abs(back[0] - 1e-3) < 1e-3 * 1e-13
    assert abs(back[6] - 0.999) < 1e-13
    assert back[1] == 1.0  # grad_scale defaults to 1
    with pytest.raises(ValueError, match="unknown hyper-parameter"):
        pack_hyper({"learning_rate": 1.0})
    with pytest.raises(ValueError, match="finite"):
        pack_hyper({"lr": float("nan")})


def _adam_tensors(shapes: list[tuple[int, ...]]) -> list[tuple[np.ndarray, ...]]:
    return [
        (f32(*s), f32(*s), np.zeros(s, np.float32), np.zeros(s, np.float32), np.zeros(1, np.int32))
        for s in shapes
    ]


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_ops_update_in_place_and_match_reference(decoupled: bool) -> None:
    tensors = _adam_tensors(SIZES)
    p0 = [t[0].astype(np.float64) for t in tensors]
    ptrs = [[ptr(a) for a in t] for t in tensors]
    op = "adamw_step" if decoupled else "adam_step"
    fs = FusedStep([(op, (), tensors)])
    hp = {"lr": 0.01, "a": 0.9, "b": 0.999, "c": 1e-8, "weight_decay": 0.1}
    fs.set_hyper(0, hp)
    grads = [[f32(*s) for s in SIZES] for _ in range(10)]
    for step in grads:
        for t, g in enumerate(step):
            fs.bind(0, t, 1, g)
        fs.run()
    for t, (p, _, _m, v, s) in enumerate(tensors):
        assert [ptr(a) for a in tensors[t]][0] == ptrs[t][0]  # same buffers
        assert int(s[0]) == 10
        want = adam(p0[t], [step[t] for step in grads], 0.01, (0.9, 0.999), 1e-8, 0.1, decoupled)
        assert_close(p, want)
        assert np.all(v >= 0)


@pytest.mark.parametrize(
    "momentum,nesterov,dampening", [(0.0, False, 0.0), (0.9, False, 0.1), (0.9, True, 0.0)]
)
def test_sgd_op_matches_reference(momentum: float, nesterov: bool, dampening: float) -> None:
    has_buf = momentum != 0
    tensors = [
        (f32(*s), f32(*s), *([np.zeros(s, np.float32)] if has_buf else []), np.zeros(1, np.int32))
        for s in SIZES
    ]
    p0 = [t[0].astype(np.float64) for t in tensors]
    fs = FusedStep([("sgd_step", (int(has_buf),), tensors)])
    fs.set_hyper(
        0, {"lr": 0.05, "weight_decay": 0.01, "a": momentum, "b": dampening, "c": float(nesterov)}
    )
    grads = [[f32(*s) for s in SIZES] for _ in range(10)]
    for step in grads:
        for t, g in enumerate(step):
            fs.bind(0, t, 1, g)
        fs.run()
    for t, row in enumerate(tensors):
        want = sgd(p0[t], [s[t] for s in grads], 0.05, momentum, dampening, 0.01, nesterov)
        assert_close(row[0], want)


def test_lion_op_matches_reference() -> None:
    tensors = [(f32(*s), f32(*s), np.zeros(s, np.float32), np.zeros(1, np.int32)) for s in SIZES]
    p0 = [t[0].astype(np.float64) for t in tensors]
    fs = FusedStep([("lion_step", (), tensors)])
    fs.set_hyper(0, {"lr": 1e-3, "a": 0.9, "b": 0.99, "weight_decay": 0.1})
    grads = [[f32(*s) for s in SIZES] for _ in range(10)]
    for step in grads:
        for t, g in enumerate(step):
            fs.bind(0, t, 1, g)
        fs.run()
    for t, row in enumerate(tensors):
        assert_close(row[0], lion(p0[t], [s[t] for s in grads], 1e-3, (0.9, 0.99), 0.1))


def test_grad_norm_and_clip_match_numpy() -> None:
    grads = [f32(*s, scale=3.0) for s in SIZES]
    want = [np.clip(g.astype(np.float64) * 0.5, -1.0, 1.0) for g in grads]
    norm = np.sqrt(sum(float(np.sum(w * w)) for w in want))
    fs = FusedStep([("grad_clip", (), [(g,) for g in grads])], norm=True)
    fs.set_hyper(0, {"grad_scale": 0.5, "clip_value": 1.0, "max_norm": 2.0})
    ptrs = [ptr(g) for g in grads]
    fs.run()
    assert abs(fs.grad_norm() - norm) <= 1e-6 * norm
    coef = 2.0 / (norm + 1e-6)
    for g, w, p in zip(grads, want, ptrs):
        assert ptr(g) == p
        assert_close(g, w * coef, rtol=1e-6)


def test_grad_norm_is_deterministic_across_thread_counts() -> None:
    g = f32(300_000)
    results = []
    before = recurra.get_num_threads()
    try:
        for n in (1, 2, 3):
            recurra.set_num_threads(n)
            fs = FusedStep([("grad_clip", (), [(g.copy(),)])], norm=True)
            fs.run()
            results.append(fs.grad_norm())
    finally:
        recurra.set_num_threads(before)
    assert results[0] == results[1] == results[2]


def test_update_refuses_a_shape_mismatch() -> None:
    p, m, v = (np.zeros((2, 2), np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="shape mismatch"):
        FusedStep(
            [("adam_step", (), [(p, np.ones((3, 3), np.float32), m, v, np.zeros(1, np.int32))])]
        )
    with pytest.raises(ValueError, match="shape mismatch"):
        FusedStep(
            [
                (
                    "adam_step",
                    (),
                    [
                        (
                            p,
                            np.ones((2, 2), np.float32),
                            m,
                            np.zeros(4, np.float32),
                            np.zeros(1, np.int32),
                        )
                    ],
                )
            ]
        )
    fs = FusedStep(
        [("adam_step", (), [(p, np.ones((2, 2), np.float32), m, v, np.zeros(1, np.int32))])]
    )
    with pytest.raises(ValueError):
        fs.bind(0, 0, 1, np.ones(9, np.float32))  # rebinding checks the size too


def test_update_validates_dtypes_and_layout() -> None:
    p, g, m, v = (np.zeros(4, np.float32) for _ in range(4))
    with pytest.raises(TypeError, match="int32"):
        FusedStep([("adam_step", (), [(p, g, m, v, np.zeros(1, np.float32))])])
    with pytest.raises(ValueError, match="one element"):
        FusedStep([("adam_step", (), [(p, g, m, v, np.zeros(2, np.int32))])])
    with pytest.raises(ValueError, match="C-contiguous"):
        FusedStep(
            [
                (
                    "adam_step",
                    (),
                    [(np.zeros((4, 4), np.float32)[:, 0], g, m, v, np.zeros(1, np.int32))],
                )
            ]
        )
    with pytest.raises(ValueError, match="unknown update op"):
        FusedStep([("adagrad_step", (), [(p, g)])])


def test_update_refuses_aliased_buffers() -> None:
    p, g = np.zeros(4, np.float32), np.ones(4, np.float32)
    fs = FusedStep([("adam_step", (), [(p, g, p, np.zeros(4, np.float32), np.zeros(1, np.int32))])])
    with pytest.raises(ValueError, match="same memory"):
        fs.run()


def test_grad_clip_refuses_the_same_gradient_twice() -> None:
    g = np.ones(4, np.float32)
    fs = FusedStep([("grad_clip", (), [(g,), (np.ones(2, np.float32),), (g,)])])
    with pytest.raises(ValueError, match="same memory"):
        fs.run()


def test_update_refuses_a_bad_step_count() -> None:
    p, g, m, v = (np.zeros(4, np.float32) for _ in range(4))
    s = np.array([-3], np.int32)
    fs = FusedStep([("adam_step", (), [(p, g, m, v, s)])])
    with pytest.raises(ValueError, match="invalid step count"):
        fs.run()


def test_nan_gradients_propagate() -> None:
    # Clamping must not turn a NaN gradient into a finite one (x86 max/min operand order).
    p, m, v = (np.zeros(3, np.float32) for _ in range(3))
    g = np.array([np.nan, 1.0, -1.0], np.float32)
    fs = FusedStep([("adam_step", (), [(p, g, m, v, np.zeros(1, np.int32))])])
    fs.set_hyper(0, {"lr": 0.1, "a": 0.9, "b": 0.999, "c": 1e-8, "clip_value": 0.5})
    fs.run()
    assert np.isnan(p[0]) and np.isfinite(p[1:]).all()


# ---- the explicit graph API ---------------------------------------------------------------


def test_graph_api_update_runs_on_compute_and_keeps_state_in_the_leaves() -> None:
    g = recurra.Graph()
    x = g.input((4, 3), name="x")
    w = g.param((3, 2), name="w")
    loss = recurra.ops.mean(recurra.ops.sqr(x @ w))
    g.build_backward(loss)
    m, v = g.tensor((3, 2)), g.tensor((3, 2))
    step = g.tensor((1,), dtype="int32")
    hyper = g.tensor((HYPER_LEN,))
    upd = recurra.ops.adam_step(hyper, [w], [w.grad], [m], [v], [step])
    assert upd.shape == (1,)
    xs, w0 = f32(4, 3), f32(3, 2)
    g.set_data(x, xs)
    g.set_data(w, w0)
    g.set_data(m, np.zeros((3, 2)))
    g.set_data(v, np.zeros((3, 2)))
    g.set_data(step, np.zeros(1, np.int32))
    g.set_data(hyper, pack_hyper({"lr": 0.1, "a": 0.9, "b": 0.999, "c": 1e-8}))
    grads = []
    wv = w0.astype(np.float64)
    for _ in range(3):
        grads.append(2 * xs.T.astype(np.float64) @ (xs @ wv) / 8)
        wv = adam(w0, grads, 0.1, (0.9, 0.999), 1e-8)
        g.compute()
    assert int(step.numpy()[0]) == 3
    assert_close(w.numpy(), wv, rtol=1e-5)


def test_graph_api_update_ops_need_graph_leaves() -> None:
    with pytest.raises(TypeError, match="recurra.Graph"):
        recurra.ops.adam_step(
            np.zeros(HYPER_LEN, np.float32),
            [np.zeros(2, np.float32)],
            [np.zeros(2, np.float32)],
            [np.zeros(2, np.float32)],
            [np.zeros(2, np.float32)],
            [np.zeros(1, np.int32)],
        )
    g = recurra.Graph()
    a = g.tensor((2,))
    target = a * 2.0  # not a leaf: an update cannot write into it
    with pytest.raises(ValueError, match="must be a leaf"):
        recurra.ops.adam_step(
            g.tensor((HYPER_LEN,)),
            [target],
            [g.tensor((2,))],
            [g.tensor((2,))],
            [g.tensor((2,))],
            [g.tensor((1,), dtype="int32")],
        )
