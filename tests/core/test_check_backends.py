"""recurra.check_backends without a device backend: arguments and exit codes, --list, the
CPU-only behaviour, the comparison metric, and that wrong results, CPU fallbacks and
failures are reported as such (injected into the backend side of a CPU self-test)."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from recurra import check_backends as cb
from recurra import ops


def _case(op_id: str) -> cb.Case:
    return next(c for c in cb.cases() if c.id == op_id)


# ---- the metric --------------------------------------------------------------------------


def test_nmse_is_the_normalized_squared_error():
    ref = np.array([1.0, -2.0, 3.0], np.float32)
    got = ref + np.array([1e-3, 0.0, -2e-3], np.float32)
    want = (1e-6 + 4e-6) / 14.0  # sum of squared differences / sum of squares
    assert cb.nmse(got, ref) == pytest.approx(want, rel=1e-3)
    assert cb.nmse(ref, ref) == 0.0
    # an all-zero reference: the plain sum of squares
    assert cb.nmse(np.array([0.5, 0.0]), np.zeros(2)) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="shapes differ"):
        cb.nmse(np.zeros(2), np.zeros(3))


def test_compare_flags_every_kind_of_disagreement():
    ref = np.array([[1.0, np.nan], [np.inf, 2.0]], np.float32)
    assert cb.compare(ref.copy(), ref) == 0.0
    assert cb.compare(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32)) == 0.0
    moved_nan = np.array([[np.nan, 1.0], [np.inf, 2.0]], np.float32)
    assert cb.compare(moved_nan, ref) == math.inf
    lost_inf = np.array([[1.0, np.nan], [5.0, 2.0]], np.float32)
    assert cb.compare(lost_inf, ref) == math.inf
    flipped_inf = np.array([[1.0, np.nan], [-np.inf, 2.0]], np.float32)
    assert cb.compare(flipped_inf, ref) == math.inf
    assert cb.compare(np.zeros(3, np.float32), np.zeros(4, np.float32)) == math.inf
    ints = np.array([1, 2, 3], np.int32)
    assert cb.compare(ints.copy(), ints) == 0.0
    assert cb.compare(np.array([1, 2, 4], np.int32), ints) == math.inf
    assert cb.compare(None, None) == 0.0
    assert cb.compare(None, ints) == math.inf
    assert cb.compare(ints, None) == math.inf
    # a small float error is measured, not rounded away
    f = np.array([3.0, 4.0], np.float32)
    assert cb.compare(f * np.float32(1.001), f) == pytest.approx(1e-6, rel=1e-2)


# ---- the cases -----------------------------------------------------------------------------

# Public names of recurra.ops that are helpers, not ops.
HELPERS = {"apply", "apply_multi", "pack_hyper"}


def test_every_op_wrapper_has_cases_or_a_reason():
    public = {
        n
        for n in ops.__all__
        if inspect.isfunction(getattr(ops, n)) and n not in HELPERS and not n.startswith("_")
    }
    covered = set(cb.op_names())
    assert public - covered - set(cb.NOT_COVERED) == set()
    assert covered <= public  # a case names a real op
    for name in ("ssm_conv", "ssm_scan", "rwkv_wkv6", "rwkv_wkv7", "gated_linear_attn"):
        assert name in covered
    scan = {c.name for c in cb.cases() if c.op == "ssm_scan"}
    assert {"mamba1", "mamba2"} <= scan


def test_case_inputs_are_reproducible_and_ids_unique():
    ids = [c.id for c in cb.cases()]
    assert len(ids) == len(set(ids))
    case = next(c for c in cb.cases() if c.id == "ssm_scan/mamba2")
    a = case.inputs(np.random.default_rng(case.seed()))
    b = case.inputs(np.random.default_rng(case.seed()))
    assert list(a) == ["s", "x", "dt", "A", "B", "C", "ids"]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert a["ids"].dtype == np.int32


# One-element rows: softmax is 1, log_softmax and layer_norm 0 whatever x, and so is the loss
# of one class; their gradient is 0 (and still compared).
ZERO_GRADIENT = {"softmax/1", "log_softmax/1", "cross_entropy/1x1", "layer_norm/rows_1"}


def test_every_case_runs_on_the_cpu_with_real_gradients():
    """The harness compares something: each case computes, and every float input of a
    differentiable case gets a non-zero gradient of sum(out * R)."""
    for case in cb.cases():
        data = case.inputs(np.random.default_rng(case.seed()))
        if case.update is not None:
            run = cb._run_update(case, data, None)
            # every source comes back, and the update changed what it updates
            assert len(run.outputs) == len(data), case.id
            first = list(data)[0]  # the parameter (the gradient for grad_clip)
            assert not np.array_equal(run.outputs[0], data[first]), case.id
            continue
        run = cb._run_case(case, data, None)
        assert run.outputs, case.id
        if not case.nonfinite:  # the NaN cases propagate NaN by design
            assert all(np.all(np.isfinite(o)) for o in run.outputs), case.id
        if not case.grad:
            continue
        floats = [k for k, v in data.items() if v.dtype == np.float32]
        assert sorted(run.grads) == sorted(floats), case.id
        for k in floats:
            g = run.grads[k]
            assert g is not None and g.shape == data[k].shape, (case.id, k)
            if case.id not in ZERO_GRADIENT:
                assert g.size == 0 or np.any(g != 0), (case.id, k)


def test_update_cases_match_a_numpy_sgd_step():
    """The optimizer path really runs the update: plain SGD, 3 steps, is p - 3 * lr * g."""
    case = _case("sgd_step/plain")
    data = case.inputs(np.random.default_rng(case.seed()))
    run = cb._run_update(case, data, None)
    lr = dict(case.update.hyper)["lr"]
    want = data["param0"].astype(np.float64) - case.update.steps * lr * data["grad0"]
    assert cb.nmse(run.outputs[0], want) < 1e-12
    np.testing.assert_array_equal(run.outputs[2], data["step0"] + case.update.steps)


def test_an_update_without_a_device_kernel_is_unsupported(monkeypatch):
    real = cb._run_update

    def no_kernel(case, data, backend):
        if backend is None:
            return real(case, data, None)
        raise RuntimeError("adam_step updates memory on fake:0, which has no kernel for it")

    monkeypatch.setattr(cb, "_run_update", no_kernel)
    r = cb.check_case(_case("adam_step/l2_wd"), "fake:0")
    assert r.verdict == "unsupported" and "no kernel" in r.message

    def broken(case, data, backend):
        if backend is None:
            return real(case, data, None)
        raise RuntimeError("device lost")

    monkeypatch.setattr(cb, "_run_update", broken)
    assert cb.check_case(_case("adam_step/l2_wd"), "fake:0").verdict == "ERROR"


def test_cpu_self_check_is_ok_and_placed_on_the_cpu():
    results = cb.check(["add", "matmul", "ssm_scan", "concat"], ["cpu"])
    assert len(results) == len(
        [c for c in cb.cases() if c.op in ("add", "matmul", "ssm_scan", "concat")]
    )
    for r in results:
        assert r.verdict == "ok", (r.op, r.case, r.message)
        assert set(r.placement) == {"cpu"} and r.placement["cpu"] > 0
        assert r.forward_nmse == 0.0
    assert cb.exit_code(results) == 0


def test_forward_of_a_known_op_against_numpy():
    """The reference side is the op itself: matmul's result is numpy's product."""
    case = next(c for c in cb.cases() if c.id == "matmul/67x45_45x33")
    data = case.inputs(np.random.default_rng(case.seed()))
    run = cb._run_case(case, data, None)
    want = data["a"].astype(np.float64) @ data["b"].astype(np.float64)
    assert cb.nmse(run.outputs[0], want) < 1e-12


# ---- injected wrong results, fallbacks, failures -------------------------------------------


@pytest.fixture
def tamper(monkeypatch):
    """Lets a test alter what the backend side of a case returns (the CPU reference side,
    called with backend None, is left alone)."""
    real = cb._run_case
    state: dict = {"fn": None}

    def fake(case, data, backend):
        if backend is None:
            return real(case, data, None)
        run = real(case, data, "cpu")
        return state["fn"](run) if state["fn"] else run

    monkeypatch.setattr(cb, "_run_case", fake)
    return state


def test_a_wrong_forward_result_is_a_mismatch(tamper):
    def wrong(run):
        run.outputs[0] = run.outputs[0] * np.float32(1.01)  # NMSE 1e-4
        return run

    tamper["fn"] = wrong
    r = cb.check_case(_case("matmul/5x7_7x3"), "cpu")
    assert r.verdict == "MISMATCH" and r.failed
    assert r.forward_nmse == pytest.approx(1e-4, rel=0.05)
    assert "forward" in r.message
    assert cb.exit_code([r]) == cb.EXIT_MISMATCH


def test_a_wrong_gradient_is_a_mismatch_naming_the_input(tamper):
    def wrong(run):
        run.grads["b"] = run.grads["b"] + np.float32(1e-2)
        return run

    tamper["fn"] = wrong
    r = cb.check_case(_case("matmul/5x7_7x3"), "cpu")
    assert r.verdict == "MISMATCH"
    assert r.forward_nmse == 0.0 and r.grad_nmse > 1e-7
    assert r.worst_grad == "b" and "gradient of b" in r.message


def test_a_small_error_within_the_bound_is_ok(tamper):
    def close(run):
        run.outputs[0] = run.outputs[0] * np.float32(1 + 1e-5)  # NMSE 1e-10
        return run

    tamper["fn"] = close
    r = cb.check_case(_case("softmax/last_axis"), "cpu")
    assert r.verdict == "ok" and 0 < r.forward_nmse < 1e-9


def test_a_missing_gradient_is_a_mismatch(tamper):
    def lost(run):
        run.grads["x"] = None
        return run

    tamper["fn"] = lost
    assert cb.check_case(_case("exp/3x17"), "cpu").verdict == "MISMATCH"


def test_a_cpu_fallback_is_unsupported_not_ok(tamper):
    def fell_back(run):
        n = sum(run.placement.values())
        run.placement = {"fake:0": n - 2, "cpu": 2}
        run.fallback = ["ssm_scan", "ssm_scan_back"]
        return run

    tamper["fn"] = fell_back
    r = cb.check_case(_case("ssm_scan/mamba1"), "fake:0")
    assert r.verdict == "unsupported" and not r.failed
    assert "ssm_scan_back" in r.message and "cpu 2" in r.placement_text()
    assert cb.exit_code([r]) == 0
    assert cb.exit_code([r], strict=True) == cb.EXIT_MISMATCH


def test_numbers_beat_placement_a_partial_run_can_still_mismatch(tamper):
    def both(run):
        run.placement = {"fake:0": 3, "cpu": 1}
        run.outputs[0] = -run.outputs[0]
        return run

    tamper["fn"] = both
    assert cb.check_case(_case("neg/3x17"), "fake:0").verdict == "MISMATCH"


def test_an_exception_is_an_error_verdict(tamper):
    def boom(run):
        raise RuntimeError("device lost")

    tamper["fn"] = boom
    r = cb.check_case(_case("add/same_3x17"), "cpu")
    assert r.verdict == "ERROR" and "device lost" in r.message
    assert cb.exit_code([r]) == cb.EXIT_MISMATCH


def test_main_reports_a_mismatch_with_exit_1(tamper, capsys):
    def wrong(run):
        run.outputs[0] = run.outputs[0] + np.float32(1.0)
        return run

    tamper["fn"] = wrong
    assert cb.main(["--backend", "cpu", "--op", "sqrt"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "FAIL" in out
    assert cb.main(["--backend", "cpu", "--op", "sqrt", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    n_cases = len(cb.select_cases(["sqrt"]))
    assert doc["exit_code"] == 1 and doc["summary"]["MISMATCH"] == n_cases
    assert doc["results"][0]["verdict"] == "MISMATCH"


# ---- arguments, --list, CPU only -----------------------------------------------------------


def test_list_names_every_case(capsys):
    assert cb.main(["--list"]) == 0
    out = capsys.readouterr().out
    for c in cb.cases():
        assert c.op in out and c.name in out
    assert "adamw_step" in out and "grad_norm" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--op", "nope"], "no cases for op(s) nope"),
        (["--op", "Add"], "no cases"),  # exact names only
        (["--backend", "tpu"], "unknown backend 'tpu'"),
        (["--backend", "cpu:1"], "one CPU"),
    ],
)
def test_bad_selections_exit_2(argv, needle, capsys):
    assert cb.main(argv) == cb.EXIT_USAGE
    assert needle in capsys.readouterr().err


def test_bad_flags_exit_2(capsys):
    assert cb.main(["--frobnicate"]) == cb.EXIT_USAGE
    assert "unrecognized" in capsys.readouterr().err


def test_no_device_backend_exits_3_unless_allowed(monkeypatch, capsys):
    monkeypatch.setattr(cb, "device_backends", lambda: [])
    assert cb.main([]) == cb.EXIT_NO_BACKEND
    assert "no backend other than the CPU" in capsys.readouterr().err
    assert cb.main(["--allow-cpu-only"]) == 0
    assert cb.main(["--json"]) == cb.EXIT_NO_BACKEND
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["exit_code"] == 3 and doc["results"] == [] and "CPU" in doc["message"]


def test_a_known_but_unavailable_backend_exits_3(monkeypatch, capsys):
    from recurra import backends

    info = backends.BackendInfo("vulkan", False, reason="no driver here")
    monkeypatch.setattr(backends, "available", lambda refresh=False: [info])
    monkeypatch.setattr(backends, "registered_devices", lambda: [])
    assert cb.main(["--backend", "vulkan"]) == cb.EXIT_NO_BACKEND
    assert "no driver here" in capsys.readouterr().err


def test_module_entry_point_cpu_only():
    env = dict(os.environ, RECURRA_BACKENDS="cpu")
    cmd = [sys.executable, "-m", "recurra.check_backends"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "no backend other than the CPU" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run(
        [*cmd, "--allow-cpu-only"], capture_output=True, text=True, env=env, timeout=600
    )
    assert p.returncode == 0, p.stdout + p.stderr
