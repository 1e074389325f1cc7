"""Device memory past one allocation, and memory errors that say what happened.

A graph's intermediates on a device live in an arena split into *segments*: buffers no
larger than the device's largest allocation (``maxMemoryAllocationSize``, 2 GiB on
lavapipe), no tensor across a segment boundary. ``RECURRA_VK_MAX_BUFFER_MB`` lowers that
limit so that small graphs use many segments. A tensor that cannot be one buffer is refused
when the graph is planned; every MemoryError names the pool, the bytes asked, the device's
limit and what is free, and what to try.

References are independent of recurra: numpy in float64 (by chunks where the tensors are
large), or the same graph on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra import ops

pytestmark = pytest.mark.vulkan

GiB = 1 << 30


def vk_info() -> dict:
    import recurra_vulkan

    return recurra_vulkan.backend_info()["devices"][0]


def check_segments(plan: dict, limit: int) -> list[int]:
    segs = plan["segments"]["vulkan:0"]
    assert all(0 < s <= limit for s in segs), (segs, limit)
    assert sum(segs) == plan["arena_bytes"] - sum(
        sum(v) for k, v in plan["segments"].items() if k != "vulkan:0"
    )
    return segs


# ---- (a) the example: 120M elements, intermediates past 2 GiB --------------------


def test_exp_tanh_graph_of_120m_elements_trains(vulkan: str) -> None:
    n, period = 120_000_000, 1000
    pattern = np.linspace(-1.0, 1.0, period)  # x repeats it: the reference needs one period
    x = rc.param(np.tile(pattern.astype(np.float32), n // period), device=vulkan)
    y = ops.exp(x)
    z = ops.tanh(y) * y
    loss = ops.sum(z * z)
    loss.backward()

    p = pattern.astype(np.float32).astype(np.float64)
    yr = np.exp(p)
    zr = np.tanh(yr) * yr
    want_loss = (n // period) * np.sum(zr * zr)
    # d(z^2)/dx = 2 z (tanh(y) + y (1 - tanh(y)^2)) y
    want_grad = 2 * zr * (np.tanh(yr) + yr * (1 - np.tanh(yr) ** 2)) * yr
    np.testing.assert_allclose(loss.item(), want_loss, rtol=1e-4)
    g = x.grad.numpy().reshape(-1, period)
    assert np.abs(g - want_grad.astype(np.float32)).max() <= 1e-5 * np.abs(want_grad).max()


# ---- (b) ~3 GiB of intermediates, a device-side parameter gradient, mirrors ---------------


def test_graph_of_3_gib_intermediates_matches_numpy(vulkan: str) -> None:
    rows, cols = 1536, 125_000  # 192M elements: 768 MB a tensor
    rng = np.random.default_rng(5)
    xs = rng.uniform(-1, 1, (rows, cols)).astype(np.float32)
    ws = rng.uniform(0.5, 1.5, cols).astype(np.float32)

    g = rc.Graph(backends=[vulkan], strict=True)
    x = g.param((rows, cols), name="x")  # host data: its copy on the device is a mirror
    w = g.param((cols,), name="w")
    e = ops.exp(x * w)
    loss = ops.mean(e * x)
    g.build_backward(loss)
    g.set_data(x, xs)
    g.set_data(w, ws)
    plan = g.memory()
    # ~3 GiB of intermediates: the arena (past one 2 GiB allocation) and x's gradient, which
    # has memory of its own (elementwise nodes write over sources that die there)
    assert plan["arena_bytes"] + plan["own_bytes"] > 2.5 * GiB
    # the arena in segments of at most one allocation each: several where it passes one
    # (lavapipe's 2 GiB; an H200 allocates 4 GiB at once)
    limit = vk_info()["max_buffer_bytes"]
    segments = check_segments(plan, limit)
    assert len(segments) >= (2 if plan["arena_bytes"] > limit else 1)
    g.compute()

    n = rows * cols
    want_loss, gx_err, gx_max = 0.0, 0.0, 0.0
    gw = np.zeros(cols)
    gx = x.grad.numpy()
    w64 = ws.astype(np.float64)
    for lo in range(0, rows, 128):  # float64 by chunks of rows
        x64 = xs[lo : lo + 128].astype(np.float64)
        a64 = x64 * w64
        e64 = np.exp(a64)
        want_loss += np.sum(e64 * x64) / n
        gw += np.sum(e64 * x64 * x64, axis=0) / n  # d/dw_j of e x
        want_gx = e64 * (a64 + 1) / n  # d/dx of exp(x w) x
        gx_err = max(gx_err, float(np.abs(gx[lo : lo + 128] - want_gx).max()))
        gx_max = max(gx_max, float(np.abs(want_gx).max()))
    np.testing.assert_allclose(loss.item(), want_loss, rtol=1e-4)
    assert gx_err <= 1e-5 * gx_max
    np.testing.assert_allclose(w.grad.numpy(), gw, rtol=1e-3, atol=1e-4 * np.abs(gw).max())


# ---- (c) forced small segments: the same gradients as the CPU ------------------------------


def mlp_grads(backends: list[str]) -> tuple[dict, list[np.ndarray], float]:
    rng = np.random.default_rng(11)
    bsz, d, h = 256, 96, 512  # w2 is 1 MiB
    g = rc.Graph(backends=backends, strict=bool(backends))
    x = g.input((bsz, d), name="x")
    ws = [g.param((d, h), name="w1"), g.param((h,), name="b1"), g.param((h, h), name="w2")]
    ws += [g.param((h, 3), name="w3")]
    hid = ops.tanh(x @ ws[0] + ws[1])
    hid = ops.relu(hid @ ws[2]) * hid
    loss = ops.mean(ops.sqr(hid @ ws[3]))
    g.build_backward(loss)
    g.set_data(x, rng.standard_normal((bsz, d)))
    for w in ws:
        g.set_data(w, rng.standard_normal(w.shape) / np.sqrt(w.shape[0]))
    plan = g.memory()
    g.compute()
    return plan, [w.grad.numpy() for w in ws], loss.item()


def test_forced_small_segments_give_the_cpu_gradients(vulkan: str, monkeypatch) -> None:
    monkeypatch.setenv("RECURRA_VK_MAX_BUFFER_MB", "1")
    plan, grads, loss = mlp_grads([vulkan])
    segs = check_segments(plan, 1 << 20)
    assert len(segs) >= 4  # the arena is several MiB
    _, want, want_loss = mlp_grads([])
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_forced_small_segments_mamba2_lm_gradients(vulkan: str, monkeypatch) -> None:
    rm = pytest.importorskip("recurra_models")
    from recurra._tensor import LAZY  # the last plan's graph: how many segments it used

    tokens = np.random.default_rng(3).integers(0, 256, (2, 65)).astype(np.int32)

    def grads(device: str) -> tuple[float, dict[str, np.ndarray]]:
        model = rm.create("mamba2", vocab_size=256, d_model=64, n_layer=2, seed=1).to(device)
        loss = model.loss(
            rc.tensor(tokens[:, :-1], device=device), rc.tensor(tokens[:, 1:], device=device)
        )
        loss.backward()
        return loss.item(), {k: p.grad.numpy() for k, p in model.named_parameters()}

    want_loss, want = grads("cpu")
    monkeypatch.setenv("RECURRA_VK_MAX_BUFFER_MB", "1")
    LAZY.clear()
    loss, got = grads(vulkan)
    plan = next(reversed(LAZY._plans.values())).graph.plan()
    assert len(check_segments(plan, 1 << 20)) >= 2
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    for k, ref in want.items():
        np.testing.assert_allclose(
            got[k], ref, rtol=2e-3, atol=2e-4 * np.abs(ref).max() + 1e-7, err_msg=k
        )


# ---- (d) refusals and the messages of MemoryError ------------------------------------------


def test_tensor_larger_than_one_buffer_is_refused_when_planned(vulkan: str, monkeypatch) -> None:
    monkeypatch.setenv("RECURRA_VK_MAX_BUFFER_MB", "1")
    g = rc.Graph(backends=[vulkan])
    x = g.input((300_000,), name="x")
    y = ops.exp(x)  # 1.2 MB: more than one 1 MiB buffer
    g.set_output(ops.sum(y))
    rc.reset_transfer_stats()
    with pytest.raises(MemoryError) as e:
        g.memory()
    msg = str(e.value)
    assert "op 'exp'" in msg and "(300000,)" in msg and "1200000 bytes" in msg
    assert "(1048576 bytes)" in msg and "RECURRA_VK_MAX_BUFFER_MB" in msg
    assert "before anything ran" in msg and "free of" in msg and "gradient checkpointing" in msg
    assert rc.transfer_stats()["host_to_device"]["count"] == 0  # nothing was uploaded
    monkeypatch.delenv("RECURRA_VK_MAX_BUFFER_MB")
    g.set_data(x, np.ones(300_000))
    g.compute()  # with the device's own limit it runs
    assert g.get_data(y)[0] == pytest.approx(np.e)


def test_copy_of_a_host_tensor_larger_than_one_buffer_is_refused(vulkan: str, monkeypatch) -> None:
    monkeypatch.setenv("RECURRA_VK_MAX_BUFFER_MB", "1")
    g = rc.Graph(backends=[vulkan])
    x = g.input((300_000,), name="x")  # on the host: the device reads a copy (a mirror)
    g.set_output(ops.sum(x))
    with pytest.raises(MemoryError, match=r"cannot hold a copy of leaf \(node 0, 'x'\)"):
        g.memory()


def test_tensor_past_2_31_elements_is_refused_not_moved_to_the_cpu(vulkan: str) -> None:
    g = rc.Graph(backends=[vulkan])
    x = g.input((1,), name="x")
    big = ops.exp(ops.broadcast_to(x, (1 << 16, 1 << 15 | 1)))  # 2^31 + 2^16 elements
    g.set_output(ops.sum(big))
    with pytest.raises(
        MemoryError, match=r"op 'exp'.*\(65536, 32769\).*at most 2147483647 elements"
    ):
        g.memory()


def test_device_out_of_memory_names_pool_bytes_limit_and_free(vulkan: str, monkeypatch) -> None:
    monkeypatch.setenv("RECURRA_VK_MEMORY_LIMIT_MB", "1")  # recurra may reserve 1 MiB in all
    with pytest.raises(MemoryError) as e:
        rc.tensor(np.zeros(10_000_123, np.float32), device=vulkan)
    msg = str(e.value)
    assert "persistent pool asked for" in msg and "(40000492 bytes)" in msg, msg
    assert (
        "largest allocation is" in msg and "free of" in msg and "RECURRA_VK_MEMORY_LIMIT_MB" in msg
    )
    assert "gradient checkpointing" in msg

    monkeypatch.delenv("RECURRA_VK_MEMORY_LIMIT_MB")
    x = rc.param(np.ones(10_000_123, np.float32), device=vulkan)
    monkeypatch.setenv("RECURRA_VK_MEMORY_LIMIT_MB", "1")
    with pytest.raises(MemoryError) as e:
        ops.sum(ops.exp(x) * x).item()
    msg = str(e.value)
    assert "transient arena pool asked for" in msg and "gradient checkpointing" in msg, msg


# ---- (e) op scratch: one node's worth per submission, not one per node ---------------------


def _scan_stack(layers: int, device: str) -> tuple[float, list[np.ndarray], int]:
    """A stack of ``layers`` selective scans (each layer's y feeds the next) trained once on
    ``device``. Returns the loss, the gradients of the inputs, and (on Vulkan) the peak bytes
    of the backend's op-scratch pool during the step."""
    import recurra_vulkan

    rng = np.random.default_rng(7)
    S, T, H, P, N = 2, 96, 4, 16, 16
    x = rc.param(rng.standard_normal((S, T, H, P)).astype(np.float32), device=device)
    s0 = rc.tensor(np.zeros((S, H, P, N), np.float32), device=device)
    params = [x]
    y = x
    for _ in range(layers):
        dt = rc.param(rng.standard_normal((S, T, H)).astype(np.float32) * 0.5, device=device)
        A = rc.param(-np.exp(rng.standard_normal((H, 1))).astype(np.float32), device=device)
        B = rc.param(rng.standard_normal((S, T, 1, N)).astype(np.float32) * 0.3, device=device)
        C = rc.param(rng.standard_normal((S, T, 1, N)).astype(np.float32) * 0.3, device=device)
        params += [dt, A, B, C]
        y, _ = ops.ssm_scan(s0, y, dt, A, B, C, np.arange(S))
    loss = ops.sum(y * y)
    peak = 0
    if device != "cpu":
        recurra_vulkan.memory_info(0, reset_peaks=True)
    loss.backward()
    if device != "cpu":
        peak = recurra_vulkan.memory_info(0)["internal"]["peak_bytes"]
    return loss.item(), [p.grad.numpy() for p in params], peak


def test_scratch_of_a_submission_is_reused_by_later_nodes(vulkan: str) -> None:
    # Every scan's backward takes op scratch. The nodes of one submission hand it on to each
    # other (the recorder orders the two uses by a barrier), so 6 layers need about what one
    # layer needs, not six times as much - and give the CPU's values and gradients.
    _, _, one = _scan_stack(1, vulkan)
    loss, grads, six = _scan_stack(6, vulkan)
    assert one > 0
    assert six < 2 * one, (one, six)
    want_loss, want_grads, _ = _scan_stack(6, "cpu")
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3 * np.abs(w).max())


def test_memory_info_counts_pools_and_reserved(vulkan: str) -> None:
    import recurra_vulkan

    before = recurra_vulkan.memory_info(0)
    w = rc.tensor(np.ones((1 << 20,), np.float32), device=vulkan)  # 4 MiB, persistent
    info = recurra_vulkan.memory_info(0)
    assert info["persistent"]["bytes_in_use"] >= before["persistent"]["bytes_in_use"] + (4 << 20)
    assert (
        info["peak_reserved_bytes"]
        >= info["reserved_bytes"]
        >= sum(info[p]["bytes_in_use"] for p in ("persistent", "transient", "internal"))
    )
    del w
    with pytest.raises(ValueError):
        recurra_vulkan.memory_info(99)


def test_idle_kept_blocks_go_before_a_larger_one_is_made(vulkan: str) -> None:
    # A freed large buffer's block is kept for reuse; when a larger buffer comes instead, the
    # idle block is given back before the new one is made, so it does not add to the peak.
    import recurra_vulkan

    mib = 1 << 20
    a = rc.tensor(np.zeros(300 * mib // 4, np.float32), device=vulkan)
    del a
    base = recurra_vulkan.memory_info(0, reset_peaks=True)["reserved_bytes"]
    b = rc.tensor(np.ones(600 * mib // 4, np.float32), device=vulkan)
    info = recurra_vulkan.memory_info(0)
    assert info["peak_reserved_bytes"] < base + 600 * mib - 150 * mib, (base, info)
    np.testing.assert_array_equal(b.numpy()[:: 1 << 20], 1.0)


def test_a_steady_training_loop_makes_no_new_blocks(vulkan: str) -> None:
    # Each step plans the same arena and scratch: after the first steps every buffer comes
    # from blocks already held (a driver allocation per step would cost time and peak).
    import recurra_vulkan

    rng = np.random.default_rng(3)
    big = 40_000_000  # 160 MB: a block of its own for the values and for the gradient
    w = rc.param(rng.standard_normal(big).astype(np.float32) * 0.01, device=vulkan)
    v = rc.param(rng.standard_normal((256, 256)).astype(np.float32) * 0.1, device=vulkan)
    made = []
    for _ in range(5):
        w.grad = v.grad = None
        loss = ops.sum(ops.tanh(w) * ops.tanh(w)) + ops.sum(ops.matmul(v, v) ** 2)
        loss.backward()
        made.append(recurra_vulkan.memory_info(0)["blocks_made"])
    assert made[2] == made[4], made
    g = w.grad.numpy()[:1000].astype(np.float64)
    x = w.numpy()[:1000].astype(np.float64)
    np.testing.assert_allclose(g, 2 * np.tanh(x) * (1 - np.tanh(x) ** 2), rtol=1e-4, atol=1e-7)


def test_empty_shared_blocks_are_kept_for_the_next_step(vulkan: str) -> None:
    # A step that holds several shared blocks' worth of buffers and frees them all must find
    # those blocks again in the next step: giving all but one back to the driver made (and
    # the driver cleared) the others again every step.
    import recurra_vulkan

    made = []
    for k in range(4):
        held = [rc.tensor(np.full(5 << 20, k, np.float32), device=vulkan) for _ in range(8)]
        assert float(held[-1].numpy()[-1]) == k
        del held
        np.testing.assert_array_equal((rc.tensor(np.ones(4), device=vulkan) * 2).numpy(), 2.0)
        made.append(recurra_vulkan.memory_info(0)["blocks_made"])
    assert made[1] == made[3], made


def test_mamba2_step_with_an_arena_past_2_gib(vulkan: str) -> None:
    # A Mamba-2 LM step (forward, cross-entropy, backward) whose planned arena on the device
    # passes 2 GiB (lavapipe's largest allocation): 16384 tokens, a 16384-token vocabulary and
    # the loss unchunked, so the logits and their gradient are 1 GiB each (a penalty on the
    # logits' mean square reads them too, so the cross-entropy's gradient cannot take their
    # memory). Reference: the CPU's gradients over 8 slices of the batch (the loss is a mean
    # over tokens, so the whole batch's gradient is the mean of the slices').
    rm = pytest.importorskip("recurra_models")
    from recurra._tensor import LAZY

    B, T, V = 8, 2048, 16384
    tokens = np.random.default_rng(5).integers(0, V, (B, T + 1)).astype(np.int32)

    def step(device: str, rows: slice) -> tuple[float, dict[str, np.ndarray]]:
        model = rm.create("mamba2", vocab_size=V, d_model=16, head_dim=16, n_layer=1, seed=2).to(
            device
        )
        x = rc.tensor(tokens[rows, :-1].copy(), device=device)
        y = rc.tensor(tokens[rows, 1:].copy(), device=device)
        logits = model.forward(x)
        loss = ops.cross_entropy(logits, y) + 1e-3 * ops.mean(logits * logits)
        loss.backward()
        return loss.item(), {k: p.grad.numpy() for k, p in model.named_parameters()}

    LAZY.clear()
    loss, got = step(vulkan, slice(0, B))
    plan = next(reversed(LAZY._plans.values())).graph.plan()
    LAZY.clear()
    segs = check_segments(plan, vk_info()["max_buffer_bytes"])
    assert sum(segs) > 2 * GiB, segs
    parts = [step("cpu", slice(i, i + 1)) for i in range(B)]
    want_loss = float(np.mean([p[0] for p in parts]))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    for k in got:
        ref = np.mean([p[1][k] for p in parts], axis=0)
        np.testing.assert_allclose(
            got[k], ref, rtol=2e-3, atol=2e-4 * np.abs(ref).max() + 1e-7, err_msg=k
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_gradient_takes_the_logits_memory(vulkan: str, dtype: str) -> None:
    """On the device, too, the logits' gradient is written over the logits (in their dtype):
    one (N, V) tensor less at the peak of a loss's backward, the same gradients."""
    from recurra._tensor import LAZY

    rng = np.random.default_rng(7)
    n, d, v = 40, 24, 300  # V past one workgroup's 256 threads (and not a multiple of 4)
    hv = rng.standard_normal((n, d)).astype(np.float32)
    wv = (rng.standard_normal((d, v)) * 0.5).astype(np.float32)
    tv = rng.integers(0, v, n).astype(np.int32)
    rc.set_strict_placement(True)
    try:
        LAZY.clear()
        h = rc.param(hv, device=vulkan)
        w = rc.param(wv, device=vulkan)
        t = rc.tensor(tv, device=vulkan)
        half = dtype == "bfloat16"
        with rc.autocast(rc.bfloat16, enabled=half):
            loss = ops.cross_entropy(ops.matmul(h, w), t)
        loss.backward()
        g = next(reversed(LAZY._plans.values())).graph
        plan = g.plan()
        got_h, got_w = h.grad.numpy(), w.grad.numpy()
    finally:
        rc.set_strict_placement(False)
    assert {g.info(i)["op"] for i in range(len(g))} >= {"cross_entropy_back", "matmul"}
    assert plan["in_place_bytes"] >= n * v * (2 if half else 4), plan
    # float64: the logits as the device computed them (bf16 products of bf16-rounded
    # operands under autocast), their softmax gradient
    if half:
        import ml_dtypes

        def rnd(a):
            return a.astype(ml_dtypes.bfloat16).astype(np.float64)

        logits = rnd(rnd(hv) @ rnd(wv))
    else:
        logits = hv.astype(np.float64) @ wv.astype(np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(n), tv] -= 1.0
    p /= n
    want_h, want_w = p @ wv.astype(np.float64).T, hv.astype(np.float64).T @ p
    tol = 2e-2 if half else 1e-4
    np.testing.assert_allclose(got_h, want_h, rtol=tol, atol=tol * np.abs(want_h).max())
    np.testing.assert_allclose(got_w, want_w, rtol=tol, atol=tol * np.abs(want_w).max())
