"""Compares a native module's ``.pyi`` stub with the module itself (pybind11 bindings).

mypy reads only the stub, so a stub that drifts from the bindings type-checks wrong code as
right. pybind11 writes each function's signature as the first line of its docstring
(``name(self: T, x: int, y: str = 'a') -> int``); this module parses that line and the stub
(with ``ast``) and lists every difference in names, parameters, their order and defaults.
Types are not compared: pybind11 spells them its own way (``typing.SupportsInt | ...``).
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Param:
    name: str
    has_default: bool
    positional_only: bool


def _split_top_level(text: str) -> list[str]:
    """Splits ``text`` at the commas outside brackets and quotes."""
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def runtime_params(name: str, func: Any) -> list[Param] | None:
    """The parameters of a pybind11 function from its docstring (``self`` left out), or
    None when the docstring holds no signature."""
    doc = (getattr(func, "__doc__", None) or "").strip()
    m = re.match(rf"^{re.escape(name)}\((.*)\) -> .*$", doc.splitlines()[0] if doc else "")
    if m is None:
        return None
    out = []
    for part in _split_top_level(m.group(1)):
        pname = part.split(":", 1)[0].strip()
        if pname == "self":
            continue
        positional_only = re.fullmatch(r"arg\d+", pname) is not None
        out.append(Param(pname, "=" in part.split(":", 1)[-1], positional_only))
    return out


def _stub_params(fn: ast.FunctionDef) -> list[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    n_default = len(a.defaults)
    out = []
    for i, arg in enumerate(positional):
        if arg.arg == "self":
            continue
        has_default = i >= len(positional) - n_default
        out.append(Param(arg.arg, has_default, arg in a.posonlyargs))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(Param(arg.arg, default is not None, False))
    return out


@dataclass
class Stub:
    functions: dict[str, list[list[Param]]]  # overloads of one name: several signatures
    attributes: set[str]
    classes: dict[str, Stub]


def parse_stub(path: Path) -> Stub:
    return _parse_body(ast.parse(path.read_text()).body)


def _parse_body(body: list[ast.stmt]) -> Stub:
    stub = Stub({}, set(), {})
    for node in body:
        if isinstance(node, ast.FunctionDef):
            decorators = {getattr(d, "id", getattr(d, "attr", "")) for d in node.decorator_list}
            if "property" in decorators:
                stub.attributes.add(node.name)
            else:
                stub.functions.setdefault(node.name, []).append(_stub_params(node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stub.attributes.add(node.target.id)
            ann = node.annotation
            proto = ann.value if isinstance(ann, ast.Subscript) else ann
            call = stub.classes.get(getattr(proto, "id", ""), Stub({}, set(), {}))
            if "__call__" in call.functions:  # a callable typed by a Protocol's __call__
                stub.functions[node.target.id] = call.functions["__call__"]
        elif isinstance(node, ast.ClassDef):
            stub.classes[node.name] = _parse_body(node.body)
    return stub


def _public_runtime_names(obj: Any, *, is_class: bool) -> set[str]:
    names = set()
    for n in dir(obj):
        if n.startswith("_pybind11") or (n.startswith("__") and n.endswith("__")):
            continue
        if is_class and n in dir(object):
            continue
        names.add(n)
    return names


def _compare_function(where: str, runtime: Any, overloads: list[list[Param]]) -> list[str]:
    name = where.rsplit(".", 1)[-1]
    got = runtime_params(name, runtime)
    if got is None:
        return []  # nothing to compare against (no signature line)
    problems = []
    for sig in overloads:
        if [p.name for p in sig if not p.positional_only] != [
            p.name for p in got if not p.positional_only
        ] or len(sig) != len(got):
            problems.append(f"{where}: parameters {[p.name for p in sig]}, bindings {got}")
            continue
        for mine, theirs in zip(sig, got):
            if theirs.positional_only and not mine.positional_only:
                problems.append(f"{where}: {mine.name} must be positional-only (pybind11 {theirs})")
            if mine.has_default and not theirs.has_default:
                problems.append(f"{where}: the stub gives {mine.name} a default, bindings do not")
    # A default the bindings have and the stub omits only makes the stub stricter (mypy
    # rejects a call that would run); allowed where the stub says why (see _vk.pyi).
    return problems


def compare(module: ModuleType, stub_path: Path) -> list[str]:
    """Every difference between ``module`` and its stub, as readable lines."""
    stub = parse_stub(stub_path)
    problems = []
    runtime = _public_runtime_names(module, is_class=False)
    declared = set(stub.functions) | stub.attributes | set(stub.classes)
    declared = {n for n in declared if not n.startswith("_")}  # stub-only aliases (_Buffer)
    for n in sorted(runtime - declared):
        problems.append(f"{module.__name__}.{n} exists but the stub lacks it")
    for n in sorted(declared - runtime):
        problems.append(f"the stub declares {module.__name__}.{n}, which does not exist")
    for n, overloads in stub.functions.items():
        if hasattr(module, n):
            problems += _compare_function(f"{module.__name__}.{n}", getattr(module, n), overloads)
    for cname, cstub in stub.classes.items():
        cls = getattr(module, cname, None)
        if not inspect.isclass(cls):
            continue
        if issubclass(cls, BaseException):
            continue
        c_runtime = _public_runtime_names(cls, is_class=True)
        c_declared = (set(cstub.functions) | cstub.attributes) - {"__init__", "__len__"}
        c_declared = {n for n in c_declared if not (n.startswith("__") and n.endswith("__"))}
        for n in sorted(c_runtime - c_declared):
            problems.append(f"{module.__name__}.{cname}.{n} exists but the stub lacks it")
        for n in sorted(c_declared - c_runtime):
            problems.append(
                f"the stub declares {module.__name__}.{cname}.{n}, which does not exist"
            )
        for n, overloads in cstub.functions.items():
            if n.startswith("__") and n != "__init__":
                continue  # protocol methods (__len__, __buffer__): pybind11 adds no signature
            target = getattr(cls, n, None)
            if target is not None:
                problems += _compare_function(f"{module.__name__}.{cname}.{n}", target, overloads)
    return problems
