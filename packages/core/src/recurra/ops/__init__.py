"""All ops of recurra. Each works on lazy tensors, graph tensors and numpy arrays alike.

Ops with several results (the recurrent ones) return a tuple of tensors.

Each area is written in its own module with its own ``__all__``, and this package exports
exactly those names (type checkers follow star imports through ``__all__``, and the
``__all__ +=`` lines below): a name added to an area's ``__all__`` is public here too
(tests/core/test_api.py checks).
"""

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
from recurra.ops._apply import apply, apply_multi
from recurra.ops._elementwise import *  # noqa: F403
from recurra.ops._linalg import *  # noqa: F403
from recurra.ops._nn import *  # noqa: F403
from recurra.ops._optim import *  # noqa: F403
from recurra.ops._reduce import *  # noqa: F403
from recurra.ops._rwkv import *  # noqa: F403
from recurra.ops._shape import *  # noqa: F403
from recurra.ops._spec import *  # noqa: F403
from recurra.ops._ssm import *  # noqa: F403

__all__ = ["apply", "apply_multi"]
__all__ += _elementwise.__all__
__all__ += _linalg.__all__
__all__ += _nn.__all__
__all__ += _reduce.__all__
__all__ += _shape.__all__
__all__ += _ssm.__all__
__all__ += _rwkv.__all__
__all__ += _optim.__all__
__all__ += _spec.__all__
