"""recurra/_core.pyi matches the bindings of recurra._core (what mypy checks against)."""

from __future__ import annotations

from pathlib import Path

from stub_check import compare, runtime_params

from recurra import _core


def test_core_stub_matches_the_bindings() -> None:
    stub = Path(_core.__file__).with_name("_core.pyi")
    if not stub.exists():  # an editable install: the stub sits in the source tree
        stub = Path(__file__).parents[2] / "packages/core/src/recurra/_core.pyi"
    assert compare(_core, stub) == []


def test_docstring_signatures_are_parsed() -> None:
    # The comparison above is only as good as this parser: check it on known bindings.
    leaf = runtime_params("leaf", _core.Graph.leaf)
    assert leaf is not None
    assert [(p.name, p.has_default) for p in leaf] == [
        ("dtype", False),
        ("shape", False),
        ("flags", True),
        ("name", True),
    ]
    bind = runtime_params("bind", _core.Graph.bind)
    assert bind is not None and [p.positional_only for p in bind] == [True, True]


def test_a_drifted_stub_is_caught(tmp_path: Path) -> None:
    stub = Path(__file__).parents[2] / "packages/core/src/recurra/_core.pyi"
    text = stub.read_text()
    drifted = text.replace("def blas_name() -> str: ...\n", "").replace(
        'name: str = "") -> int', "name: str = '', extra: int = 0) -> int"
    )
    assert drifted != text
    (tmp_path / "_core.pyi").write_text(drifted)
    problems = compare(_core, tmp_path / "_core.pyi")
    assert any("blas_name exists but the stub lacks it" in p for p in problems), problems
    assert any("Graph.leaf" in p for p in problems), problems
