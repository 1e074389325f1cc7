"""The float32 kernels that read 2-byte sources as they are (RECURRA_OPS_HALF_IN, issue 18)
on Vulkan: gated_rms_norm, causal_conv_silu, ssm_scan (its dt) and cross_entropy, with
their backwards, given bfloat16/float16 sources (strided slices of one projection, as
Mamba-2 passes them) run on the device (strict placement), with no cast node before them,
and give bit for bit what they give on the exact float32 up-casts of those sources (a cast
rounds nothing going up, so the values cannot differ); both agree with the CPU within
float32 summation-order tolerance. A bfloat16 Mamba-2 step on the device gives bitwise the
loss and gradients of the same step with the up-casts (recurra before these kernels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import recurra as rc
from recurra import _autocast, ops
from recurra._tensor import LAZY

pytestmark = pytest.mark.vulkan

HALF = {"bfloat16": rc.bfloat16, "float16": rc.float16}


def _run(
    device: str, dtype: rc.DType | None, up: bool, build: Callable[..., object], shapes: list
) -> tuple[np.ndarray, list[np.ndarray], list[str]]:
    """build(*views) on float32 parameters of `shapes` cast to `dtype` (then, with `up`,
    back to float32); the output, the parameters' gradients of sum(out * R) and the ops of
    the step's graph."""
    LAZY.clear()
    rng = np.random.default_rng(7)
    params = [
        rc.param(rng.standard_normal(s).astype(np.float32) * 0.5, device=device) for s in shapes
    ]
    srcs = []
    for p in params:
        t = p.to(dtype) if dtype is not None else p
        srcs.append(t.to(rc.float32) if up and dtype is not None else t)
    out = build(*srcs)
    r = rc.tensor(rng.standard_normal(out.shape).astype(np.float32), device=device)
    loss = ops.sum(out.to(rc.float32) * r) if out.dtype != rc.float32 else ops.sum(out * r)
    loss.backward()
    g = next(reversed(LAZY._plans.values())).graph
    got_ops = [g.info(i)["op"] for i in range(len(g))]
    return out.numpy(), [p.grad.numpy() for p in params], got_ops


def _check(vulkan: str, dtype_name: str, build, shapes, reads_half: set[str]) -> None:
    dtype = HALF[dtype_name]
    rc.set_strict_placement(True)
    try:
        out, grads, got_ops = _run(vulkan, dtype, False, build, shapes)
        out_up, grads_up, ops_up = _run(vulkan, dtype, True, build, shapes)
    finally:
        rc.set_strict_placement(False)
    assert reads_half <= set(got_ops), got_ops
    # no up-cast: the only casts left are the parameters' (to dtype) and the gradients'
    assert got_ops.count("cast") < ops_up.count("cast")
    assert out.tobytes() == out_up.tobytes()
    for a, b in zip(grads, grads_up):
        assert a.tobytes() == b.tobytes()
    out_cpu, grads_cpu, _ = _run("cpu", dtype, False, build, shapes)
    scale = np.abs(out_cpu).max() + 1e-6
    np.testing.assert_allclose(out, out_cpu, rtol=1e-4, atol=1e-5 * scale)
    for a, b in zip(grads, grads_cpu):
        # gradients of 2-byte tensors are rounded: one unit of the dtype where the float32
        # sums of the two backends differ in their last bits
        np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=1e-4 * (np.abs(b).max() + 1e-6))


@pytest.mark.parametrize("dtype", list(HALF))
def test_gated_rms_norm_reads_2_byte_y_z(vulkan: str, dtype: str) -> None:
    B, T, H, P = 2, 5, 3, 4
    C = H * P

    def build(proj, x, w, d):
        # y and z: strided slices of one 2-byte projection; x, w, D float32
        y = proj[:, :, :C]
        z = proj[:, :, C:]
        return ops.gated_rms_norm(
            y, z, w.to(rc.float32), 1e-5, P, x=x.to(rc.float32), d=d.to(rc.float32)
        )

    _check(
        vulkan,
        dtype,
        build,
        [(B, T, 2 * C), (B, T, C), (C,), (H,)],
        {"gated_rms_norm", "gated_rms_norm_back"},
    )


@pytest.mark.parametrize("dtype", list(HALF))
def test_gated_rms_norm_wide_groups(vulkan: str, dtype: str) -> None:
    """group_size >= 64: one workgroup per unit (WIDE); y and z both 2-byte, no D skip."""
    C = 128

    def build(y, z, w):
        return ops.gated_rms_norm(y, z, w.to(rc.float32), 1e-5, C)

    _check(vulkan, dtype, build, [(3, C), (3, C), (C,)], {"gated_rms_norm", "gated_rms_norm_back"})


@pytest.mark.parametrize("dtype", list(HALF))
def test_causal_conv_silu_reads_a_2_byte_slice(vulkan: str, dtype: str) -> None:
    S, T, D, W = 2, 7, 6, 4

    def build(proj, c, b):
        return ops.causal_conv_silu(proj[:, :, 1 : D + 1], c.to(rc.float32), b.to(rc.float32))

    _check(
        vulkan,
        dtype,
        build,
        [(S, T, D + 3), (D, W), (D,)],
        {"causal_conv_silu", "causal_conv_silu_back"},
    )


@pytest.mark.parametrize("T", [9, 130])  # the sequential kernels; the chunked ones (T >= 128)
def test_ssm_scan_reads_a_2_byte_dt(vulkan: str, T: int) -> None:
    S, H, P, N, G = 2, 4, 3, 5, 2

    def build(x, proj, a, bm, cm):
        dt = proj[:, :, 1 : H + 1]  # a strided 2-byte slice, as Mamba-2's
        s0 = rc.tensor(np.zeros((S, H, P, N), np.float32), device=x.device)
        # x, B, C 2-byte too (Mamba-2's conv output rounded); s and A float32
        ids = np.arange(S, dtype=np.int32)
        y, _ = ops.ssm_scan(s0, x, dt, -ops.exp(a.to(rc.float32)), bm, cm, ids)
        return y

    shapes = [(S, T, H, P), (S, T, H + 2), (H, 1), (S, T, G, N), (S, T, G, N)]
    _check(vulkan, "bfloat16", build, shapes, {"ssm_scan", "ssm_scan_back"})


@pytest.mark.parametrize("dtype", list(HALF))
def test_cross_entropy_reads_2_byte_logits(vulkan: str, dtype: str) -> None:
    N, V = 6, 37
    targets = np.random.default_rng(1).integers(0, V, N).astype(np.int32)

    def build(logits):
        t = rc.tensor(targets, device=logits.device)
        return ops.cross_entropy(logits, t).reshape(1)

    _check(vulkan, dtype, build, [(N, V)], {"cross_entropy", "cross_entropy_back"})


SIZES = {
    "mamba2": {"d_model": 32, "d_state": 8, "head_dim": 8},
    "mamba": {"d_model": 32, "d_state": 8},
}


@pytest.mark.parametrize("arch", list(SIZES))
def test_bf16_step_equals_the_up_cast_step(vulkan: str, monkeypatch, arch: str) -> None:
    """Mamba-2 (the chunked scan's layout) and Mamba-1 (one decay per state: the sequential
    kernels) under autocast, strict placement on the device: bitwise the loss and gradients
    of the step with the up-casts and float32 norms, with fewer casts. (Products whose
    2-byte result a cast widens write float32 on the device, unrounded: in the up-cast step
    the norms' float32 inputs take such gradients, so that is off here, the two steps'
    products rounded alike; test_vulkan_autocast.py tests it.)"""
    rm = pytest.importorskip("recurra_models")
    monkeypatch.setenv("RECURRA_WIDEN_PRODUCTS", "0")
    d = np.random.default_rng(0).integers(0, 64, (2, 17)).astype(np.int32)
    op_class = _autocast.op_class
    got = []
    rc.set_strict_placement(True)
    try:
        for up in (False, True):
            LAZY.clear()
            model = rm.create(arch, vocab_size=64, n_layer=2, seed=2, **SIZES[arch])
            model.to(vulkan)
            if up:  # the sources of the reads_half ops cast up to float32, as before
                monkeypatch.setattr(
                    _autocast,
                    "op_class",
                    lambda n: "float32" if op_class(n) == "widen" else op_class(n),
                )
                monkeypatch.setattr(rm.nn, "NORM_TO_AUTOCAST", False)
            with rc.autocast():
                loss = model.loss(d[:, :-1], d[:, 1:])
            monkeypatch.setattr(_autocast, "op_class", op_class)
            monkeypatch.setattr(rm.nn, "NORM_TO_AUTOCAST", True)
            loss.backward()
            g = next(reversed(LAZY._plans.values())).graph
            n_casts = sum(g.info(i)["op"] == "cast" for i in range(len(g)))
            grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
            got.append((float(loss.item()), grads, n_casts))
    finally:
        rc.set_strict_placement(False)
        LAZY.clear()
    assert got[0][2] < got[1][2]
    assert got[0][0] == got[1][0]
    for n, g in got[0][1].items():
        assert g.tobytes() == got[1][1][n].tobytes(), n


@pytest.mark.parametrize("gs", [4, 64])  # one thread per group; a workgroup per group (WIDE)
def test_gated_rms_norm_writes_its_output_in_bf16(vulkan: str, gs: int) -> None:
    """The norm before a product writes the product's dtype itself (ops.gated_rms_norm
    dtype=...): on the device bitwise the float32 result rounded, as the cast after it gave,
    and the same gradients (the backward reads the product's bf16 gradient as it is)."""
    B, T, C = 2, 3, 128
    rng = np.random.default_rng(9)
    data = [rng.standard_normal(s).astype(np.float32) for s in [(B, T, C)] * 2 + [(C,)]]
    r = rng.standard_normal((B, T, C)).astype(np.float32)
    _bf16_output_is_the_cast(
        vulkan, data, r, lambda y, z, w, dtype: ops.gated_rms_norm(y, z, w, 1e-5, gs, dtype=dtype)
    )


def _bf16_output_is_the_cast(
    vulkan: str, data: list[np.ndarray], r: np.ndarray, build: Callable[..., Any]
) -> np.ndarray:
    """build(*params, dtype) on the device (strict placement) with dtype=bf16 against
    build(..., None) followed by a cast: bitwise the same output and gradients of every
    parameter (made from ``data``) of sum(out * r). Returns the bf16 output."""
    got = []
    rc.set_strict_placement(True)
    try:
        for fused in (True, False):
            LAZY.clear()
            ps = [rc.param(a, device=vulkan) for a in data]
            out = build(*ps, rc.bfloat16 if fused else None)
            if not fused:
                out = out.to(rc.bfloat16)
            assert out.dtype == rc.bfloat16
            loss = ops.sum(out.to(rc.float32) * rc.tensor(r, device=vulkan))
            loss.backward()
            got.append((out.numpy(), [p.grad.numpy() for p in ps]))
    finally:
        rc.set_strict_placement(False)
    assert got[0][0].tobytes() == got[1][0].tobytes()
    for a, b in zip(got[0][1], got[1][1]):
        assert a.tobytes() == b.tobytes()
    return got[0][0]


@pytest.mark.parametrize("half_x", [False, True])
def test_causal_conv_writes_its_output_in_bf16(vulkan: str, half_x: bool) -> None:
    """The conv before the scan writes the autocast dtype itself (ops.causal_conv_silu
    dtype=...): on the device bitwise the float32 result rounded, as the cast after it gave,
    the same gradients (the backward reads the bf16 gradient as it is), and the CPU's
    result within a bf16 rounding."""
    B, T, C, K = 2, 9, 70, 4  # channels past one 64-channel workgroup
    rng = np.random.default_rng(4)
    xv = rng.standard_normal((B, T, C)).astype(np.float32)
    wv = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    bv = (rng.standard_normal(C) * 0.1).astype(np.float32)
    r = rng.standard_normal((B, T, C)).astype(np.float32)
    xin = xv.astype(rc.bfloat16.numpy) if half_x else xv
    out = _bf16_output_is_the_cast(
        vulkan, [xin, wv, bv], r, lambda x, w, b, dtype: ops.causal_conv_silu(x, w, b, dtype=dtype)
    )
    cpu = ops.causal_conv_silu(rc.tensor(xin), rc.tensor(wv), rc.tensor(bv), dtype=rc.bfloat16)
    np.testing.assert_allclose(
        out.astype(np.float32), cpu.numpy().astype(np.float32), rtol=2.0**-7, atol=1e-6
    )
