"""All ops of recurra. Each works on lazy tensors, graph tensors and numpy arrays alike.

Ops with several results (the recurrent ones) return a tuple of tensors.

Each area is written in its own module, and this package exports every public name an area
module defines (not its imports, nor ``_private`` helpers): a function written there is
public here without being listed anywhere. At run time each area's ``__all__`` is computed
from its definitions (``_exports.public_names``); type checkers follow the star imports
below, which re-export the same names (tests/core/test_api.py checks that both agree).
"""

import typing

from recurra.ops import (
    _elementwise,
    _linalg,
    _nn,
    _optim,
    _reduce,
    _rwkv,
    _shape,
    _spec,
    _ssm,
)
from recurra.ops._apply import apply as apply
from recurra.ops._apply import apply_multi as apply_multi
from recurra.ops._elementwise import *  # noqa: F403
from recurra.ops._linalg import *  # noqa: F403
from recurra.ops._nn import *  # noqa: F403
from recurra.ops._optim import *  # noqa: F403
from recurra.ops._reduce import *  # noqa: F403
from recurra.ops._rwkv import *  # noqa: F403
from recurra.ops._shape import *  # noqa: F403
from recurra.ops._spec import *  # noqa: F403
from recurra.ops._ssm import *  # noqa: F403

#: The area modules, in the order their names appear in ``__all__``.
_AREAS = (_elementwise, _linalg, _nn, _reduce, _shape, _ssm, _rwkv, _optim, _spec)

if not typing.TYPE_CHECKING:  # mypy reads the star imports above
    __all__ = ["apply", "apply_multi", *(name for area in _AREAS for name in area.__all__)]
