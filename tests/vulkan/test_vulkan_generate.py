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
        assert [b.split(":")[0] for b, _, _ in graph.graph.splits()] == ["vulkan"]
        got = rm.generate(model, [1, 2, 3], max_tokens=10, temperature=0.0)
        lazy = rm.generate(model, [1, 2, 3], max_tokens=10, temperature=0.0, use_graph=False)
    finally:
        rc.set_strict_placement(False)
    assert got == want
    assert lazy == want


def test_resident_step_keeps_the_state_on_the_device(vulkan: str) -> None:
    model = _model("mamba2", seed=1).to(vulkan)
    state_bytes = sum(
        int(np.prod(t.shape)) * 4 for layer in model.init_state(1) for t in layer
    )
    n = 12
    rm.generate(model, [1, 2, 3], max_tokens=2, temperature=0.0)  # plans, warms the caches
    rc.reset_transfer_stats()
    rm.generate(model, [1, 2, 3], max_tokens=n, temperature=0.0)
    moved = rc.transfer_stats()
    up = moved["host_to_device"]["bytes"]
    down = moved["device_to_host"]["bytes"]
    # per token: one int32 id up, the logits (vocab floats) down; the prefill reads its own
    # logits row and the state is carried in place
    assert down <= (n + 2) * 40 * 4 * 3, moved
    assert up < state_bytes, (up, state_bytes, moved)
