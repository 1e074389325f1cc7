"""The public API as written: recurra.ops exports every op of its area modules explicitly,
and Tensor.storage gives the optimizers (and users) a tensor's memory without a copy."""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest

import recurra
from recurra import ops


def _area_modules() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(ops.__path__, "recurra.ops.") if m.name != "__init__"
    )


def test_ops_exports_every_public_name_of_every_area_module() -> None:
    exported = set(ops.__all__)
    assert len(exported) == len(ops.__all__), "a name is listed twice in recurra.ops.__all__"
    areas = _area_modules()
    assert "recurra.ops._ssm" in areas and "recurra.ops._optim" in areas
    for name in areas:
        mod = importlib.import_module(name)
        for public in getattr(mod, "__all__", ()):
            assert public in exported, f"{name}.{public} is missing from recurra.ops.__all__"
            assert getattr(ops, public) is getattr(mod, public), f"recurra.ops.{public}"


def test_ops_all_names_resolve() -> None:
    for name in ops.__all__:
        assert callable(getattr(ops, name)) or name.startswith("HYPER_"), name


def test_storage_of_a_host_tensor_is_its_own_memory() -> None:
    t = recurra.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    s = t.storage
    assert isinstance(s, np.ndarray)
    assert s.shape == (2, 3) and s.dtype == np.float32
    s[0, 0] = 42.0  # the tensor's own memory: the write shows in its value
    assert t.numpy()[0, 0] == 42.0
    assert t.storage is s  # no copy, nothing computed


def test_storage_is_none_while_pending_and_filled_once_computed() -> None:
    a = recurra.tensor(np.ones(4, np.float32))
    b = a * 3.0
    assert b.storage is None  # recorded, not run
    np.testing.assert_array_equal(b.numpy(), np.full(4, 3.0))
    s = b.storage
    assert isinstance(s, np.ndarray)
    np.testing.assert_array_equal(s, np.full(4, 3.0))


def test_storage_is_read_only_property() -> None:
    t = recurra.tensor(np.zeros(2, np.float32))
    with pytest.raises(AttributeError):
        t.storage = np.ones(2, np.float32)  # type: ignore[misc]
