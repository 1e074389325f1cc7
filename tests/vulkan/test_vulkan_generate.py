"""Generation of a model on the Vulkan device: every step's graph runs there (strict
placement) and decodes what the model decodes on the CPU. The traced step graph is a CPU
feature: on a device it would move the carried state between host and device every token
(measured slower on the H200 than recording each step on the device), so it is not built."""

from __future__ import annotations

import pytest

import recurra as rc

rm = pytest.importorskip("recurra_models")
from recurra_models.generation import StepGraph  # noqa: E402

pytestmark = pytest.mark.vulkan


def _model(arch: str, seed: int):
    if arch == "mamba":
        return rm.create("mamba", vocab_size=40, d_model=16, n_layer=2, d_state=4, seed=seed)
    if arch == "mamba2":
        return rm.create(
            "mamba2", vocab_size=40, d_model=16, n_layer=2, d_state=4, head_dim=8, seed=seed
        )
    return rm.create("rwkv7", vocab_size=40, n_embd=16, n_layer=2, head_size=8, seed=seed)


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "rwkv7"])
def test_generation_on_vulkan_decodes_like_the_cpu(vulkan: str, arch: str) -> None:
    want = rm.generate(_model(arch, seed=3), [1, 2, 3], max_tokens=10, temperature=0.0)
    model = _model(arch, seed=3).to(vulkan)
    assert StepGraph.build(model) is None  # the lazy path, recorded on the device
    rc.set_strict_placement(True)  # every node of every step on Vulkan
    try:
        got = rm.generate(model, [1, 2, 3], max_tokens=10, temperature=0.0)
    finally:
        rc.set_strict_placement(False)
    assert got == want
