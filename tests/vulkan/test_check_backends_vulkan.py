"""recurra.check_backends on the Vulkan backend (lavapipe in CI): a selection of ops passes,
every computed node of those cases ran on the Vulkan device, and the command exits 0.

The recurrent ops may not have Vulkan kernels yet: their cases must then say
"unsupported" (never "ok" with a CPU fallback, never a mismatch); once the kernels land
they must say "ok" with every node on the device.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recurra import check_backends as cb

pytestmark = pytest.mark.vulkan

# A selection of ops whose Vulkan kernels exist (forward and backward), small shapes: a few
# seconds. Every case of every op runs on Vulkan in test_vulkan_ops.py (the op-case registry).
SUPPORTED = [
    "add",
    "transpose",
    "max",
    "matmul",
    "softmax",
    "cross_entropy",
    "layer_norm",
    "get_rows",
    "concat",
    "adamw_step",
    "grad_norm",
]
RECURRENT = ["ssm_conv", "ssm_scan", "rwkv_wkv6", "rwkv_wkv7", "gated_linear_attn"]


def test_supported_ops_are_ok_and_ran_on_vulkan(vulkan):
    results = cb.check(SUPPORTED, [vulkan])
    assert {r.op for r in results} == set(SUPPORTED)
    for r in results:
        assert r.verdict == "ok", (r.op, r.case, r.message, r.placement)
        assert r.backend.startswith("vulkan:")
        # the proof: every computed node of the graph (forward, loss, backward) was placed
        # on the Vulkan device, none on the CPU
        assert set(r.placement) == {r.backend} and r.placement[r.backend] > 0
        assert r.forward_nmse is not None and r.forward_nmse <= r.forward_tol
        if r.grad_nmse is not None:
            assert r.grad_nmse <= r.grad_tol
    # a matmul that is no multiple of the tile size, with gradients of both operands
    mm = [r for r in results if r.op == "matmul" and r.case == "67x45_45x33"]
    assert mm and mm[0].grad_nmse is not None


def test_recurrent_ops_are_ok_on_vulkan_or_reported_unsupported(vulkan):
    for r in cb.check(RECURRENT, [vulkan]):
        assert r.verdict in ("ok", "unsupported"), (r.op, r.case, r.message)
        if r.verdict == "ok":
            assert set(r.placement) == {r.backend}
        else:
            assert r.placement.get("cpu", 0) > 0 and r.fallback_ops, r
            assert cb.exit_code([r], strict=True) == cb.EXIT_MISMATCH


def test_main_json_shows_vulkan_placement(vulkan, capsys):
    assert cb.main(["--op", "mul", "--op", "rms_norm", "--backend", vulkan, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 0 and doc["backends"][0].startswith("vulkan:")
    assert doc["summary"]["ok"] == len(doc["results"]) > 0
    for r in doc["results"]:
        assert list(r["placement"]) == [doc["backends"][0]]


def test_module_entry_point_exits_0(vulkan):
    p = subprocess.run(
        [sys.executable, "-m", "recurra.check_backends", "--op", "sub", "--op", "log_softmax"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("sub ", "log_softmax "))]
    assert lines and all("vulkan:0" in ln and ln.rstrip().endswith("ok") for ln in lines)
    assert "PASS" in p.stdout
