"""All ops of recurra. Each works on lazy tensors, graph tensors and numpy arrays alike.

Ops with several results (the recurrent ones) return a tuple of tensors.
"""

from recurra.ops._apply import apply, apply_multi
from recurra.ops._elementwise import *  # noqa: F403
from recurra.ops._elementwise import __all__ as _ew_all

__all__ = ["apply", "apply_multi", *_ew_all]

# Areas written in their own modules; each exports its public names through __all__.
for _mod in ("_reduce", "_linalg", "_nn", "_shape", "_ssm", "_rwkv", "_optim", "_spec"):
    try:
        _m = __import__(f"recurra.ops.{_mod}", fromlist=["__all__"])
    except ModuleNotFoundError as _e:  # an area not written yet
        if _e.name != f"recurra.ops.{_mod}":
            raise
        continue
    for _name in getattr(_m, "__all__", ()):
        globals()[_name] = getattr(_m, _name)
        __all__.append(_name)
del _mod
