"""The scheduler chooses fused or decomposed ops (recurra/op_spec.h, csrc/decompose.cpp):
no Python module of the ops, the models or the optimizers asks which device it is on to pick
an op. A grep over their sources: only the modules listed below mention devices at all, each
for where data lives (constants made on their op's device, in-place updates bound to device
memory, a graph whose state stays on the device, checkpoint loading), not for op choice."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "packages"
SCANNED = [
    ROOT / "core/src/recurra/ops",
    ROOT / "models/src/recurra_models",
    ROOT / "optim/src/recurra_optim",
]
DEVICE = re.compile(r"\.backend\b|\bbackends\b|is_on_device|all_on_cpu|\"cpu\"|'cpu'")

# Data placement only (see the module docstring).
ALLOWED = {
    "core/src/recurra/ops/_apply.py",  # a numpy constant goes to the device of the op's tensors
    "core/src/recurra/ops/_optim.py",  # update ops bind the device buffers they update
    "models/src/recurra_models/generation.py",  # a resident step graph on the model's device
    "models/src/recurra_models/loading.py",  # torch checkpoints load to host memory
    "models/src/recurra_models/nn.py",  # Module.device / Module.to
    "optim/src/recurra_optim/optimizer.py",  # state tensors kept beside their parameters
}


def _code_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if not ln.strip().startswith("#")]


def test_only_data_placement_modules_mention_devices():
    found = set()
    for folder in SCANNED:
        assert folder.is_dir(), folder
        for path in folder.rglob("*.py"):
            if any(DEVICE.search(ln) for ln in _code_lines(path)):
                found.add(str(path.relative_to(ROOT)))
    assert found - ALLOWED == set(), "these modules branch on the device"


def test_fused_ops_are_one_call():
    # The ops that have a decomposition are called as one op, without a device test.
    for name in ("_nn.py", "_ssm.py", "_apply.py"):
        text = (ROOT / "core/src/recurra/ops" / name).read_text()
        assert "all_on_cpu" not in text, name
    for name in ("mamba.py", "mamba2.py", "lm.py"):
        path = ROOT / "models/src/recurra_models" / name
        assert not any(DEVICE.search(ln) for ln in _code_lines(path)), name
