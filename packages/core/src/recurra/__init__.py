from recurra import _core  # noqa: F401
