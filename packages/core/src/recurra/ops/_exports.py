"""What an area module of recurra.ops exports: the public names it defines itself."""

from __future__ import annotations

import types
from collections.abc import Mapping


def public_names(namespace: Mapping[str, object]) -> list[str]:
    """The public names of the module whose ``globals()`` is ``namespace``, in definition
    order: every name not starting with ``_`` except modules and what the module imports (a
    function, class or object whose ``__module__`` is another module's).

    An area module ends with ``__all__ = public_names(globals())`` under ``if not
    typing.TYPE_CHECKING``: mypy reads the same names from the module itself (a star import
    re-exports the public names a module defines, not its imports), so a new function is
    exported without being listed anywhere. Name a helper ``_x`` to keep it private;
    tests/core/test_api.py checks that this rule and mypy's agree.
    """
    module = namespace["__name__"]
    return [
        name
        for name, value in namespace.items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", module) == module
    ]
