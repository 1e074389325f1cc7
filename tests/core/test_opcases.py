"""The op-case registry (recurra.opcases) on the CPU: every case's forward against its
float64 reference, gradients against finite differences, NaN propagation, and each case's
core node against the op it builds. The same cases run on Vulkan in
tests/vulkan/test_vulkan_ops.py and on every backend in ``recurra check-backends``."""

from __future__ import annotations

import numpy as np
import pytest

from recurra import opcases
from recurra.ops import apply, spec

CASES = opcases.cases()


def _ids(cases: list[opcases.OpCase]) -> list[str]:
    return [c.id for c in cases]


WITH_REF = [c for c in CASES if c.ref is not None]
WITH_FD = [c for c in CASES if c.fd is not None]
WITH_NAN_GRAD = [c for c in CASES if c.nan_grad]
WITH_NODE = [c for c in CASES if c.node is not None]


@pytest.mark.parametrize("case", WITH_REF, ids=_ids(WITH_REF))
def test_forward_matches_the_float64_reference(case):
    assert opcases.reference_errors(case) == []


@pytest.mark.parametrize("case", WITH_FD, ids=_ids(WITH_FD))
def test_gradient_matches_finite_differences(case):
    assert opcases.fd_errors(case) == []


@pytest.mark.parametrize("case", WITH_NAN_GRAD, ids=_ids(WITH_NAN_GRAD))
def test_nan_input_gives_nan_gradient(case):
    assert opcases.nan_grad_errors(case) == []


@pytest.mark.parametrize("case", WITH_NODE, ids=_ids(WITH_NODE))
def test_node_is_the_op_the_case_builds(case):
    """A backend's node tests run ``case.node`` directly: it must compute the same."""
    data = case.make_inputs()
    want = opcases.evaluate(case, data)
    assert len(want) == 1
    got = apply(case.node.op, list(data.values()), ip=case.node.ip, fp=case.node.fp).numpy()
    np.testing.assert_array_equal(got, want[0])


def test_registry_ids_are_unique_and_every_family_has_cases():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    import importlib

    for fam in opcases.FAMILIES:
        assert importlib.import_module(f"recurra.opcases.{fam}").cases(), fam


def test_every_elementwise_op_has_a_reference_and_a_gradient_check():
    """What one unary or binary entry gives an op: references, finite differences, NaNs."""
    from recurra.opcases import elementwise

    for c in elementwise.cases():
        assert c.ref is not None, c.id
    for op in {c.op for c in elementwise.cases()}:
        names = {c.name for c in CASES if c.op == op}
        assert any(n.startswith("fd_") for n in names), op
    for op in {c.op for c in elementwise.unary_cases()}:
        assert {"nan_inf", "nan_1000", "100003"} <= {c.name for c in CASES if c.op == op}


def test_a_wrong_reference_is_reported():
    """The harness can fail: a case whose reference is off by 1e-4 is reported."""
    import dataclasses

    case = next(c for c in CASES if c.id == "exp/17")
    bad = dataclasses.replace(case, ref=lambda x: np.exp(x) * (1 + 1e-4))
    errs = opcases.reference_errors(bad)
    assert errs and "exp/17" in errs[0] and "rtol" in errs[0]
    nan_case = next(c for c in CASES if c.id == "relu/nan_inf")
    hidden = dataclasses.replace(nan_case, ref=lambda x: np.nan_to_num(np.maximum(x, 0)))
    assert opcases.reference_errors(hidden)


def test_a_wrong_gradient_is_reported(monkeypatch):
    from recurra.opcases import _run

    case = next(c for c in CASES if c.id == "silu/fd_2x3")
    real = _run._grads

    def off(case, data, device):
        return {k: g * np.float32(1.05) for k, g in real(case, data, device).items()}

    monkeypatch.setattr(_run, "_grads", off)
    errs = opcases.fd_errors(case)
    assert errs and "gradient of x" in errs[0]


# ---- bfloat16 / float16: every one-node case per dtype ------------------------------------
_SPEC = spec()
HALF_DTYPES = ["bfloat16", "float16"]
NODE_CASES = [c for c in CASES if c.node is not None and c.update is None]
HALF_CASES = [
    c
    for c in NODE_CASES
    if "bfloat16" in _SPEC[c.node.op].dtypes
    and c.op != "cast"  # its result's dtype is its own: tests/core/test_dtypes.py
    and any(v.dtype == np.float32 for v in c.make_inputs().values())
]
FLOAT32_ONLY = [
    c
    for c in NODE_CASES
    if "bfloat16" not in _SPEC[c.node.op].dtypes and not _SPEC[c.node.op].reads_half
]
# the float32 ops that read 2-byte sources as they are (RECURRA_OPS_HALF_IN)
READS_HALF = [
    c
    for c in NODE_CASES
    if _SPEC[c.node.op].reads_half and any(v.dtype == np.float32 for v in c.make_inputs().values())
]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("case", HALF_CASES, ids=_ids(HALF_CASES))
def test_forward_in_2_byte_floats_matches_the_float64_reference(case, dtype):
    """Inputs rounded to the dtype, the op in float32, its result rounded once: within half
    an ulp of the float64 reference on the same inputs (plus the case's float32 tolerance)."""
    assert opcases.half_errors(case, dtype) == []


GRAD_HALF = [c for c in HALF_CASES if c.grad and not c.nonfinite]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("case", GRAD_HALF, ids=_ids(GRAD_HALF))
def test_gradient_in_2_byte_floats_matches_float32(case, dtype):
    assert opcases.half_grad_errors(case, dtype) == []


def test_every_op_case_family_has_2_byte_cases():
    # Every op with a one-node case takes 2-byte sources, or reads them as they are
    # (RECURRA_OPS_HALF_IN). The float32-only ops (ssm_conv, the wkv ops, the optimizer
    # ops) have no one-node case: their refusal of bfloat16 is tests/core/test_dtypes.py's.
    # A float32-only op given a one-node case lands here and needs a refusal test with it.
    assert len(HALF_CASES) > 300 and READS_HALF
    assert not FLOAT32_ONLY, [c.id for c in FLOAT32_ONLY]
    assert {c.node.op for c in HALF_CASES} >= {"matmul", "add", "silu", "sum", "softmax"}


def test_a_reference_off_by_an_ulp_is_reported_in_2_byte_floats():
    """The per-dtype harness can fail: one ulp (2^-7 for bfloat16) is beyond its bound."""
    import dataclasses

    case = next(c for c in HALF_CASES if c.id == "exp/17")
    assert opcases.half_errors(case, "bfloat16") == []
    bad = dataclasses.replace(case, ref=lambda x: np.exp(x) * (1 + 2.0**-7))
    errs = opcases.half_errors(bad, "bfloat16")
    assert len(errs) == 1 and "exp/17 in bfloat16" in errs[0]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("case", READS_HALF, ids=_ids(READS_HALF))
def test_ops_reading_2_byte_sources_match_their_float32_up_cast(case, dtype):
    """An op of RECURRA_OPS_HALF_IN given 2-byte sources (the first float one alone, then
    all of them) computes what it computes on their exact float32 up-casts, bit for bit:
    float32 output (cross_entropy_back: the logits' dtype, the float32 result rounded once)."""
    import ml_dtypes

    data = case.make_inputs()
    half = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    floats = [k for k, v in data.items() if v.dtype == np.float32]
    for which in (floats[:1], floats):
        srcs = [v.astype(half) if k in which else v for k, v in data.items()]
        wide = [s.astype(np.float32) if s.dtype == half else s for s in srcs]
        got = apply(case.node.op, srcs, ip=case.node.ip, fp=case.node.fp)
        ref = apply(case.node.op, wide, ip=case.node.ip, fp=case.node.fp)
        out = got.numpy()
        want = ref.numpy()
        if case.node.op == "cross_entropy_back" and list(data)[1] in which:
            assert str(got.dtype) == dtype, which  # the logits' gradient in their dtype
            want = want.astype(half)
        else:
            assert str(got.dtype) == "float32", which
        assert out.tobytes() == want.tobytes(), which
