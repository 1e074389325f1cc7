"""The cast nodes of a bfloat16 Mamba-2 training step (issue 18): the ops that compute in
float32 but read 2-byte sources as they are (OpSpec.reads_half: the gated norm, the causal
convolution, the scan, cross-entropy) get no up-cast before them, so the plan has fewer
cast nodes than with those sources cast up to float32 (recurra's behaviour before), and no
cast feeds one of those ops. The plans are built, not run (bench/step_memory.py's)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import recurra as rc
from recurra.ops import spec

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import step_memory  # noqa: E402 - bench/ on sys.path first

READS_HALF = {name for name, s in spec().items() if s.reads_half}
FORWARD_READS_HALF = {name for name in READS_HALF if not name.endswith("_back")}


def _plan(up_casts: bool, n_layer: int) -> list[dict]:
    from recurra import _core

    _core.set_cpu_refused_ops(step_memory.VULKAN_MISSING)
    p = step_memory.step_plan(
        "mamba2-130m", n_layer, 2, 16, False, 0, "bf16", with_casts=True, up_casts=up_casts
    )
    return p["casts"]


@pytest.mark.parametrize("n_layer", [1, 2])
def test_bf16_mamba2_step_has_fewer_casts(n_layer: int) -> None:
    before, after = _plan(True, n_layer), _plan(False, n_layer)

    def up_casts_into(casts: list[dict], ops: set[str]) -> list[dict]:
        return [
            c
            for c in casts
            if c["dtype_in"] != "float32"
            and c["dtype_out"] == "float32"
            and set(c["readers"]) & ops
        ]

    # before: 2-byte activations cast up to float32 for the fused ops' forwards (and again,
    # recomputed, for their backwards); after: none (what is left into a backward is the
    # gradient of a norm's output, cast back to its float32 dtype)
    assert up_casts_into(before, FORWARD_READS_HALF)
    assert not up_casts_into(after, FORWARD_READS_HALF)
    assert len(up_casts_into(after, READS_HALF)) < len(up_casts_into(before, READS_HALF))
    assert sum(c["bytes"] for c in after) < sum(c["bytes"] for c in before)
    # per layer: the up-casts of the conv's input, of the scan's x, dt, B, C and of the
    # norm's y, z and x, each once in the forward and once recomputed in the backward, are
    # gone (18 a layer; the bound leaves room for the model changing its wiring)
    assert len(before) - len(after) >= 12 * n_layer
    # the logits' gradient comes out of cross_entropy_back in bfloat16: no down-cast of it
    assert not [c for c in after if c["src"].startswith("cross_entropy_back")]
    assert [c for c in before if c["src"].startswith("cross_entropy_back")]


def test_the_step_under_both_policies_gives_the_same_values() -> None:
    """The fused ops reading bfloat16 sources compute what they computed on the exact
    float32 up-casts: a tiny bf16 Mamba-2 step on the CPU gives bitwise the same loss and
    gradients with and without the up-casts."""
    import recurra_models as rm
    from recurra import _autocast

    d = np.random.default_rng(0).integers(0, 64, (2, 17)).astype(np.int32)
    got = []
    op_class = _autocast.op_class
    for up in (False, True):
        model = rm.create(
            "mamba2", vocab_size=64, n_layer=2, seed=2, d_model=32, d_state=8, head_dim=8
        )
        if up:
            _autocast.op_class = lambda n: "float32" if op_class(n) == "widen" else op_class(n)
            rm.nn.NORM_TO_AUTOCAST = False
        try:
            with rc.autocast():
                loss = model.loss(d[:, :-1], d[:, 1:])
        finally:
            _autocast.op_class = op_class
            rm.nn.NORM_TO_AUTOCAST = True
        loss.backward()
        got.append((float(loss.item()), {n: p.grad.numpy() for n, p in model.named_parameters()}))
    assert got[0][0] == got[1][0]
    for n, g in got[0][1].items():
        assert g.tobytes() == got[1][1][n].tobytes(), n


class _Planned(Exception):
    pass


def _per_layer_peak(up_casts: bool) -> float:
    """The planned peak's growth per layer of a small bf16 Mamba-2 step (its activations kept
    for the backward), with the fused ops reading 2-byte sources or (up_casts) fed float32
    up-casts as before."""
    import recurra_models as rm
    from recurra import _autocast, _core
    from recurra._tensor import LAZY
    from recurra_models import nn

    _core.set_cpu_refused_ops(step_memory.VULKAN_MISSING)
    data = np.random.default_rng(0).integers(0, 32, (2, 257)).astype(np.int32)
    op_class = _autocast.op_class
    peaks = []
    for n_layer in (1, 3):
        model = rm.create(
            "mamba2", vocab_size=32, n_layer=n_layer, seed=0, d_model=64, d_state=16, head_dim=16
        )
        if up_casts:
            _autocast.op_class = lambda n: "float32" if op_class(n) == "widen" else op_class(n)
            nn.NORM_TO_AUTOCAST = False
        try:
            with rc.autocast(rc.bfloat16):
                loss = model.loss(rc.tensor(data[:, :-1].copy()), rc.tensor(data[:, 1:].copy()))
        finally:
            _autocast.op_class = op_class
            nn.NORM_TO_AUTOCAST = True
        got: dict = {}
        build = LAZY._build

        def capture(*a: object, got: dict = got, build: object = build, **k: object) -> object:
            got.update(build(*a, **k).graph.plan())  # type: ignore[operator]
            raise _Planned

        LAZY._build = capture
        try:
            loss.backward()
        except _Planned:
            pass
        finally:
            LAZY._build = build
            LAZY.clear()
        peaks.append(got["peak_live_bytes"])
    return (peaks[1] - peaks[0]) / 2


def test_reading_2_byte_sources_keeps_no_more_per_layer() -> None:
    """Folding the casts must not cost memory: the conv reading in_proj's output as a view
    kept all of that output (z and dt too) alive for its backward, ~20% more per layer than
    the up-cast plan; the mixer now hands the conv xbc's own 2-byte copy."""
    folded, up = _per_layer_peak(False), _per_layer_peak(True)
    assert folded <= up, (folded, up)
