"""recurra.autocast on a Vulkan device: a Mamba-2 and an RWKV-7 training step under
autocast on the device (2-byte nodes without device kernels run on the CPU) agree with the
same step on the CPU; parameter gradients are float32 on the device; a bfloat16 parameter
on the device keeps its float32 master there."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
import recurra_models as rm
from recurra_optim import AdamW

pytestmark = pytest.mark.vulkan

TINY = {
    "mamba2": {"d_model": 32, "d_state": 8, "head_dim": 8},
    "rwkv7": {"n_embd": 32, "head_size": 8},
}


def _step(arch: str, device: str) -> tuple[float, dict[str, np.ndarray]]:
    model = rm.create(arch, vocab_size=64, n_layer=2, seed=2, **TINY[arch])
    model.to(device)
    d = np.random.default_rng(0).integers(0, 64, (2, 17)).astype(np.int32)
    with rc.autocast():
        loss = model.loss(d[:, :-1], d[:, 1:])
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        assert p.grad.dtype == rc.float32, n
        assert p.grad.device == p.device, n
        grads[n] = p.grad.numpy()
    return float(loss.item()), grads


@pytest.mark.parametrize("arch", list(TINY))
def test_autocast_step_on_the_device_matches_the_cpu(vulkan: str, arch: str) -> None:
    l_cpu, g_cpu = _step(arch, "cpu")
    l_dev, g_dev = _step(arch, vulkan)
    # float32 kernels differ in summation order between the backends; a bf16 rounding
    # that flips by one unit (2^-8 relative) moves the result by that much at most
    assert l_dev == pytest.approx(l_cpu, rel=1e-2)
    assert g_dev.keys() == g_cpu.keys()
    for n, a in g_dev.items():
        b = g_cpu[n].astype(np.float64).ravel()
        nb = np.linalg.norm(b)
        if nb < 1e-6:
            continue
        assert np.linalg.norm(a.ravel() - b) <= 0.05 * nb, n


@pytest.mark.parametrize("arch", list(TINY))
def test_recomputed_casts_on_the_device(vulkan: str, arch: str) -> None:
    """The backward's recomputed casts run on the device (strict placement) and give bitwise
    the loss and gradients of a backward that keeps the casts (the same kernels on the same
    data); both agree with the CPU in test_autocast_step_on_the_device_matches_the_cpu."""
    from recurra._tensor import LAZY

    got = {}
    rc.set_strict_placement(True)
    try:
        for on in (False, True):
            rc._core.set_recompute_casts(on)
            LAZY.clear()  # the setting is not part of a cached plan's key
            got[on] = _step(arch, vulkan)
    finally:
        rc._core.set_recompute_casts(True)
        rc.set_strict_placement(False)
        LAZY.clear()
    assert got[True][0] == got[False][0]
    assert got[True][1].keys() == got[False][1].keys()
    for n, g in got[True][1].items():
        assert np.array_equal(g, got[False][1][n]), n


def _step_folding(vulkan: str, monkeypatch, fold: bool) -> tuple[float, dict, int]:
    """_step("mamba2") with the casts folded into the adds and assigns reading them
    (RECURRA_FOLD_CASTS) or not; and how many casts the step's plans folded."""
    from recurra._tensor import LAZY

    monkeypatch.setenv("RECURRA_FOLD_CASTS", "1" if fold else "0")
    LAZY.clear()  # the setting is not part of a cached plan's key
    folded = []
    build = LAZY._build

    def spy(*a: object, **k: object) -> object:
        plan = build(*a, **k)
        folded.append(int(plan.graph.plan()["n_folded_casts"]))
        return plan

    monkeypatch.setattr(LAZY, "_build", spy)
    try:
        loss, grads = _step("mamba2", vulkan)
    finally:
        monkeypatch.setattr(LAZY, "_build", build)
        LAZY.clear()
    return loss, grads, max(folded)


def test_folded_gradient_casts_on_the_device(vulkan: str, monkeypatch) -> None:
    """A bf16 Mamba-2 backward on the device rounds the float32 gradients of the fused ops
    (the gated norm's dz, the conv's dxBC, the scan's dB, dC; the two dx summed; the
    pre-norms' dx added to the residual's gradient) in the assigns and adds that read them,
    without their cast nodes: 7 a layer fewer, bitwise the same loss and gradients."""
    l_on, g_on, n_on = _step_folding(vulkan, monkeypatch, True)
    l_off, g_off, n_off = _step_folding(vulkan, monkeypatch, False)
    assert n_off == 0
    assert n_on >= 6 * 2, n_on  # two layers
    assert l_on == l_off
    assert g_on.keys() == g_off.keys()
    for n, g in g_on.items():
        assert np.array_equal(g, g_off[n]), n


def test_mamba2_kept_variant_on_the_device(vulkan: str, monkeypatch) -> None:
    """Mamba-2 under autocast with the scan's checkpoints saved and its norm + out_proj kept
    (mamba2.SCAN_CHECKPOINTS / RECOMPUTE_NORM_PROJ: what bench/mixed_precision.py's
    bf16-keep runs) against the default (recomputed): the same loss and gradients up to the
    kernels' float32 summation order (with checkpoints the chunked scan runs at any length,
    without them the sequential one below 128 tokens) and a bf16 rounding flipped by it."""
    from recurra_models import mamba2

    l_new, g_new = _step("mamba2", vulkan)
    monkeypatch.setattr(mamba2, "SCAN_CHECKPOINTS", True)
    monkeypatch.setattr(mamba2, "RECOMPUTE_NORM_PROJ", False)
    l_old, g_old = _step("mamba2", vulkan)
    assert l_new == pytest.approx(l_old, rel=1e-3)
    assert g_new.keys() == g_old.keys()
    for n, a in g_new.items():
        b = g_old[n].astype(np.float64).ravel()
        assert np.linalg.norm(a.ravel() - b) <= 1e-2 * max(np.linalg.norm(b), 1e-6), n


def test_2_byte_parameter_master_on_the_device(vulkan: str) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    p = rc.param(w, device=vulkan, dtype=rc.bfloat16)
    q = rc.param(w.astype(p.dtype.numpy).astype(np.float32))
    opt, ref = AdamW([p], lr=1e-2), AdamW([q], lr=1e-2)
    for _ in range(3):
        g = rng.standard_normal((4, 6)).astype(p.dtype.numpy)
        p.grad = rc.tensor(g, device=vulkan)
        q.grad = rc.tensor(g.astype(np.float32))
        opt.step()
        ref.step()
    master = opt.state[p]["master"]
    assert master.dtype == rc.float32 and master.device == p.device and p.is_on_device
    # the device's Adam kernel (GLSL sqrt and division, not correctly rounded) may differ
    # from the CPU's in the last bits of an update of size lr = 1e-2
    np.testing.assert_allclose(master.numpy(), q.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(p.numpy(), master.numpy().astype(p.dtype.numpy))


TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40


def _curve(device: str, precision: str, steps: int) -> np.ndarray:
    model = rm.create("mamba2", vocab_size=256, n_layer=2, seed=1, **TINY["mamba2"])
    model.to(device)
    opt = AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.01)
    # three 64-token chunks (the last of 2 tokens): the chunked scan kernels
    run = dict(batch_size=2, seq_len=130, steps=steps, seed=5, log_every=0, precision=precision)
    tr = rm.Trainer(model, opt, rm.ByteTokenizer().encode(TEXT), **run)
    return np.array([r["loss"] for r in tr.fit()])


def test_mamba2_bf16_curve_on_the_device_follows_float32(vulkan: str) -> None:
    """A Mamba-2 Trainer run on the device (captured steps) in bf16 (its scans keep no
    checkpoints, its y rounded to bf16, its norm and out_proj recomputed) against the same
    run in float32 on the device: within 2% at every step (measured: 0.04%), and it learns.
    8 steps (about 35 s each run on lavapipe)."""
    l32 = _curve(vulkan, "fp32", 8)
    lbf = _curve(vulkan, "bf16", 8)
    assert l32[-1] < 0.7 * l32[0]  # measured: 5.62 -> 3.08 (lavapipe)
    rel = np.abs(lbf - l32) / l32
    assert rel.max() < 0.02, rel.max()


@pytest.mark.parametrize("split", ["", "4"])
def test_weight_gradient_is_the_unrounded_product(vulkan: str, monkeypatch, split: str) -> None:
    """Under autocast a float32 weight's gradient is the bf16 product x^T dy cast up; on the
    device that product writes float32 itself (the plan's n_widened_products; one dispatch
    instead of two) and its sums are not rounded to bf16 on the way: the gradient is the
    float64 sum of the bf16 operands' products to float32 accuracy, where a bf16 rounding
    would be off by up to 2^-9. RECURRA_WIDEN_PRODUCTS=0 runs the product and the cast (the
    rounded gradient). With split="4" the product runs in 4 slices of K (split-K)."""
    import ml_dtypes

    from recurra import ops
    from recurra._tensor import LAZY

    monkeypatch.setenv("RECURRA_VK_SPLITK", split)
    rng = np.random.default_rng(3)
    n, d_in, d_out = 96, 40, 24
    xv = rng.standard_normal((n, d_in)).astype(ml_dtypes.bfloat16)
    wv = rng.standard_normal((d_out, d_in)).astype(np.float32)

    def grad(fold: bool) -> tuple[np.ndarray, dict]:
        monkeypatch.setenv("RECURRA_WIDEN_PRODUCTS", "1" if fold else "0")
        LAZY.clear()
        rc.set_strict_placement(True)
        try:
            w = rc.param(wv, device=vulkan)
            x = rc.tensor(xv, device=vulkan)
            with rc.autocast(rc.bfloat16):
                y = ops.matmul(x, w.T)  # (n, d_out) bf16; dy = 1 everywhere (exact)
                loss = ops.sum(y)
            loss.backward()
            plan = dict(next(reversed(LAZY._plans.values())).graph.plan())
            return w.grad.numpy(), plan
        finally:
            rc.set_strict_placement(False)

    g, plan = grad(True)
    g0, plan0 = grad(False)
    assert g.dtype == np.float32 and g.shape == (d_out, d_in)
    assert plan["n_widened_products"] == 1 and plan0["n_widened_products"] == 0
    want = np.broadcast_to(xv.astype(np.float64).sum(axis=0), (d_out, d_in))
    scale = np.abs(want).max()
    np.testing.assert_allclose(g, want, rtol=0, atol=1e-6 * scale)
    # the unfolded step rounds the product to bf16 first (the same values, rounded)
    rounded = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(g0, rounded)
    assert np.abs(g0 - want).max() > 1e-4 * scale  # the rounding this test can see
