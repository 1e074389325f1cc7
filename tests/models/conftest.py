"""Puts this folder (reference_rwkv_models) and tests/core (gradcheck) on sys.path: the
folder is a package, so pytest does not add it by itself."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parent / "core"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
