"""The public API as written: recurra.ops exports every public name its area modules define
(the same names at run time and for mypy), and Tensor.storage gives the optimizers (and users)
a tensor's memory without a copy."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types

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


def _defined_public_names(module: types.ModuleType) -> list[str]:
    """The public names a module's source binds at its top level (def, class, assignment),
    in order: what mypy exports from it through a star import (its imports are not)."""
    names: list[str] = []
    for stmt in ast.parse(inspect.getsource(module)).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def test_each_area_exports_at_run_time_what_mypy_sees() -> None:
    # An area's __all__ is computed at import (recurra.ops._exports.public_names); mypy reads
    # the module's own definitions instead. Both must name the same functions and constants.
    helpers = {"recurra.ops._apply", "recurra.ops._exports"}
    areas = [importlib.import_module(n) for n in _area_modules() if n not in helpers]
    assert {a.__name__ for a in areas} == {a.__name__ for a in ops._AREAS}
    for area in areas:
        assert area.__all__ == _defined_public_names(area), area.__name__
    assert "relu" in ops._elementwise.__all__ and "HYPER_SLOTS" in ops._optim.__all__
    assert "np" not in ops.__all__ and "apply" in ops.__all__ and "coerce" not in ops.__all__


def test_every_spec_op_with_a_python_function_is_exported() -> None:
    # Every elementwise unary op has its function; any op whose name an area defines is
    # exported under that name.
    functions = {
        name: getattr(area, name)
        for area in ops._AREAS
        for name in dir(area)
        if inspect.isfunction(getattr(area, name))
        and getattr(area, name).__module__ == area.__name__
    }
    for name, sp in ops.spec().items():
        if sp.unary >= 0:
            assert name in functions, f"unary op {name} has no Python function"
        if name in functions:
            assert name in ops.__all__ and getattr(ops, name) is functions[name], name


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
