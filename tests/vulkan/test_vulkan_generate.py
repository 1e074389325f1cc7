"""Generation of a model on the Vulkan device: the traced one-token step graph runs there
(every node on the device, one submission a token) and decodes exactly what the lazy path
decodes on the same device and what the model decodes on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

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
def test_step_graph_runs_on_vulkan_and_decodes_like_the_cpu(vulkan: str, arch: str) -> None:
    cpu_model = _model(arch, seed=3)
    want = rm.generate(cpu_model, [1, 2, 3], max_tokens=10, temperature=0.0)
    model = _model(arch, seed=3).to(vulkan)
    g = StepGraph.build(model)
    assert g is not None
    state = [np.asarray(t) for layer in model.init_state(1) for t in layer]
    logits, _ = g(np.array([[5]], np.int32), state)
    assert list(g.graph.placement()) == [str(model.device)]  # every node on the device
    ref = cpu_model(np.array([[5]], np.int32)).numpy()
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert rm.generate(model, [1, 2, 3], max_tokens=10, temperature=0.0) == want
    assert rm.generate(model, [1, 2, 3], max_tokens=10, temperature=0.0, use_graph=False) == want
