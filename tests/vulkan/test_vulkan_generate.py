"""Generation of a model on the Vulkan device: the one-token step is traced once into a
resident graph (parameters and the carried state bound to device buffers, the new state
written back in place by `assign` nodes), every node on the device (strict placement), and
it decodes what the model decodes on the CPU. Per token only the token id goes up and the
logits come down: the state never crosses to the host."""

from __future__ import annotations

import numpy as np
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
    if arch == "rwkv6":
        return rm.create("rwkv6", vocab_size=40, n_embd=16, n_layer=2, head_size=8, seed=seed)
    return rm.create("rwkv7", vocab_size=40, n_embd=16, n_layer=2, head_size=8, seed=seed)


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "rwkv6", "rwkv7"])
def test_generation_on_vulkan_decodes_like_the_cpu(vulkan: str, arch: str) -> None:
    want = rm.generate(_model(arch, seed=3), [1, 2, 3], max_tokens=10, temperature=0.0)
    model = _model(arch, seed=3).to(vulkan)
    rc.set_strict_placement(True)  # every node of every step on Vulkan
    try:
        graph = StepGraph.build(model)
        assert graph is not None and graph.resident
        graph.start(model.init_state(1))
        assert graph.step(np.array([[1]], np.int32)).shape == (1, 1, 40)
        assert [b.split(":")[0] for b, _, _ in graph.graph.splits()] == ["vulkan"]
        got = rm.generate(model, [1, 2, 3], max_tokens=10, temperature=0.0)
        lazy = rm.generate(model, [1, 2, 3], max_tokens=10, temperature=0.0, use_graph=False)
    finally:
        rc.set_strict_placement(False)
    assert got == want
    assert lazy == want


def test_resident_step_keeps_the_state_on_the_device(vulkan: str) -> None:
    model = _model("mamba2", seed=1).to(vulkan)
    state_bytes = sum(int(np.prod(t.shape)) * 4 for layer in model.init_state(1) for t in layer)
    moved = []
    for n in (4, 12):
        rm.generate(model, [1, 2, 3], max_tokens=n, temperature=0.0)  # plans, warms caches
        rc.reset_transfer_stats()
        rm.generate(model, [1, 2, 3], max_tokens=n, temperature=0.0)
        moved.append(rc.transfer_stats())
    # per extra token: one int32 id up, the logits row (40 floats) down; the state (far
    # larger) stays where it is
    up = (moved[1]["host_to_device"]["bytes"] - moved[0]["host_to_device"]["bytes"]) / 8
    down = (moved[1]["device_to_host"]["bytes"] - moved[0]["device_to_host"]["bytes"]) / 8
    assert up <= 4 * 3, moved  # the token id and each layer's int32 scan ids (constants)
    assert down <= 40 * 4, moved
    assert state_bytes > 40 * 4 * 4
