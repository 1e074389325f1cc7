"""The op spec (recurra/op_spec.h) against the core's op table, and its Python view."""

from __future__ import annotations

import numpy as np
import pytest

from recurra import _core, ops


def test_spec_lists_the_op_table_in_order():
    assert list(ops.spec()) == list(_core.op_names())


def test_spec_is_read_only():
    spec = ops.spec()
    with pytest.raises(TypeError):
        spec["add"] = spec["sub"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        spec["add"].name = "plus"  # type: ignore[misc]


def test_counts_are_ranges():
    for name, s in ops.spec().items():
        for lo, hi in (s.srcs, s.n_ip, s.n_fp):
            assert lo >= 0 and (hi == -1 or hi >= lo), name


def test_backward_and_decomposition_name_ops():
    spec = ops.spec()
    for name, s in spec.items():
        for field in (s.backward, s.decomposition):
            for part in filter(None, (p.strip() for p in field.split(","))):
                assert part in spec, f"{name}: {part} is not an op"


def test_unary_codes_are_dense_and_unique():
    codes = sorted(s.unary for s in ops.spec().values() if s.unary >= 0)
    assert codes == list(range(ops.op_codes()["UNARY_COUNT"]))


def test_every_unary_op_is_one_source_to_its_shape():
    for name, s in ops.spec().items():
        if s.unary < 0:
            continue
        assert s.srcs == (1, 1) and s.n_ip == (0, 0), name
        fp = [0.5] * s.n_fp[1]
        fp.sort()
        assert _core.infer(name, [("float32", [2, 3])], [], fp) == ("float32", (2, 3))


def test_act_grad_takes_the_code_of_an_activation():
    spec = ops.spec()
    src = [("float32", [4])] * 3
    for s in spec.values():
        if s.unary < 0:
            continue
        fp = [0.0, 1.0][: s.n_fp[1]]
        if s.backward == "act_grad":
            assert _core.infer("act_grad", src, [s.unary], fp) == ("float32", (4,))
        else:  # neg, sqr, exp, scale: their gradients are built from other ops
            with pytest.raises(ValueError, match="unknown activation code"):
                _core.infer("act_grad", src, [s.unary], fp)
    for bad in (-1, ops.op_codes()["UNARY_COUNT"]):
        with pytest.raises(ValueError, match="unknown activation code"):
            _core.infer("act_grad", src, [bad], [])
    with pytest.raises(ValueError, match="clamp needs min, max"):
        _core.infer("act_grad", src, [spec["clamp"].unary], [])


def test_act_grad_code_computes_that_activation():
    # act_grad(g, x, y) with sigmoid's code is g * y (1 - y), in float64 numpy
    x = np.linspace(-3, 3, 11).astype(np.float32)
    g = np.linspace(1, 2, 11).astype(np.float32)
    y = 1 / (1 + np.exp(-x.astype(np.float64)))
    got = ops.apply("act_grad", [g, x, y.astype(np.float32)], ip=(ops.spec()["sigmoid"].unary,))
    np.testing.assert_allclose(got.numpy(), g * y * (1 - y), rtol=1e-6)


def test_hyper_slots_follow_the_spec():
    codes = ops.op_codes()
    for i, name in enumerate(ops.HYPER_SLOTS):
        if name != "reserved":
            assert codes["HYPER_" + name.upper()] == i
    assert len(ops.HYPER_SLOTS) == codes["HYPER_SLOTS"]


def test_ssm_scan_takes_only_known_flags():
    s = [("float32", [1, 1, 2, 3]), ("float32", [1, 4, 1, 2]), ("float32", [1, 4, 1])]
    s += [("float32", [1, 1]), ("float32", [1, 4, 1, 3]), ("float32", [1, 4, 1, 3])]
    s += [("int32", [1])]
    _core.infer("ssm_scan", s, [0], [])
    _core.infer("ssm_scan", s, [ops.op_codes()["SSM_SCAN_SAVE_CHECKPOINTS"]], [])
    with pytest.raises(ValueError, match="RECURRA_SSM_SCAN_"):
        _core.infer("ssm_scan", s, [8], [])
    with pytest.raises(ValueError, match="one token"):  # 4 tokens: not in place
        _core.infer("ssm_scan", s, [ops.op_codes()["SSM_SCAN_STATE_IN_PLACE"]], [])
