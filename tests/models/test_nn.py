"""recurra_models.nn: registration, state dicts and their errors, the layers against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra_models import nn


class Tiny(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, seed=1)
        self.layers = nn.ModuleList([nn.Linear(4, 4, seed=i) for i in range(2)])
        self.norm = nn.RMSNorm(4)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False, seed=3)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, t):
        x = self.emb(t)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(self.norm(x)))


def test_registration_names_and_tied_dedup():
    m = Tiny()
    names = [n for n, _ in m.named_parameters()]
    assert names == [
        "emb.weight",
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
        "norm.weight",
        "ln.weight",
        "ln.bias",
    ]
    all_names = [n for n, _ in m.named_parameters(remove_duplicate=False)]
    assert "head.weight" in all_names and len(all_names) == len(names) + 1
    assert m.num_parameters() == 40 + 2 * 20 + 4 + 8
    assert len(m.layers) == 2 and m.layers[-1] is m.layers[1]
    with pytest.raises(IndexError):
        m.layers[2]
    with pytest.raises(TypeError):
        nn.ModuleList([object()])  # type: ignore[list-item]


def test_forward_matches_numpy_and_gradients_flow():
    m = Tiny(tie=False)
    sd = m.state_dict()
    t = np.array([[1, 2, 3], [9, 0, 5]], np.int32)
    y = m(t)
    assert y.shape == (2, 3, 10)
    x = sd["emb.weight"][t].astype(np.float64)
    for i in range(2):
        x = x @ sd[f"layers.{i}.weight"].T + sd[f"layers.{i}.bias"]
    x = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * sd["norm.weight"]
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    x = (x - mu) / np.sqrt(var + 1e-5) * sd["ln.weight"] + sd["ln.bias"]
    ref = x @ sd["head.weight"].T
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, n


def test_state_dict_round_trip_in_place():
    a, b = Tiny(), Tiny()
    for p in b.parameters():
        p.assign_(np.zeros(p.shape, np.float32))
    before = [id(p) for p in b.parameters()]
    b.load_state_dict(a.state_dict())
    assert [id(p) for p in b.parameters()] == before  # tensors kept (optimizers stay valid)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        np.testing.assert_array_equal(x, y, err_msg=n)
    # the second name of a tied parameter is accepted
    sd = a.state_dict()
    sd["head.weight"] = sd.pop("emb.weight")
    b.load_state_dict(sd)
    np.testing.assert_array_equal(b.emb.weight.numpy(), a.emb.weight.numpy())


def test_load_state_dict_errors_name_the_key():
    m = Tiny()
    sd = m.state_dict()
    with pytest.raises(ValueError, match=r"missing keys: 'norm.weight'"):
        m.load_state_dict({k: v for k, v in sd.items() if k != "norm.weight"})
    with pytest.raises(ValueError, match=r"unexpected keys: 'extra'"):
        m.load_state_dict({**sd, "extra": np.zeros(1)})
    bad = dict(sd, **{"ln.bias": np.zeros(5, np.float32)})
    ref = m.ln.bias.numpy()
    with pytest.raises(ValueError, match=r"'ln.bias' has shape \(5,\).*\(4,\)"):
        m.load_state_dict(bad)
    np.testing.assert_array_equal(m.ln.bias.numpy(), ref)  # nothing changed
    m.load_state_dict({"ln.bias": np.ones(4)}, strict=False)
    np.testing.assert_array_equal(m.ln.bias.numpy(), np.ones(4))
    with pytest.raises(ValueError, match="non-numeric"):
        m.load_state_dict({"ln.bias": np.array(["a"] * 4)}, strict=False)


def test_modes_device_and_misc_errors():
    m = Tiny()
    assert m.training and m.layers[0].training
    m.eval()
    assert not m.training and not m.layers[0].training and not m.norm.training
    m.train()
    assert m.layers[1].training
    assert m.to("cpu") is m and str(m.device) == "cpu"
    assert m.head.weight is m.emb.weight  # still tied after to()
    with pytest.raises(ValueError, match="unknown device"):
        m.to("tpu")
    with pytest.raises(ValueError, match="token ids must be in"):
        m.emb(np.array([[10]]))
    with pytest.raises(ValueError, match="expected last axis 4"):
        m.layers[0](rc.tensor(np.zeros((2, 3), np.float32)))
    with pytest.raises(TypeError, match="trainable"):
        m.register_parameter("w", rc.tensor(np.zeros(2, np.float32)))
    with pytest.raises(NotImplementedError):
        nn.Module()(1)
    assert "Linear(4, 4, bias=True)" in repr(m)
