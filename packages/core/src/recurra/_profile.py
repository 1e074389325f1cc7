"""The op profiler: where the time of a computation goes, per op (see :func:`recurra.profile`)."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from recurra import _core


@dataclass(frozen=True)
class OpTime:
    """The time of one op (or, by shape, one op on given shapes) summed over its calls."""

    key: str
    calls: int
    seconds: float


@dataclass
class Profile:
    """Per-op wall time of the CPU nodes computed inside a :func:`recurra.profile` block,
    most time first. Filled when the block ends."""

    ops: list[OpTime] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(o.seconds for o in self.ops)

    def table(self, limit: int = 30) -> str:
        """The entries as a text table (at most `limit` rows, the rest summed in one)."""
        total = self.total_seconds or 1.0
        width = max([len(o.key) for o in self.ops[:limit]] + [2])
        lines = [f"{'op':<{width}}  {'calls':>7}  {'ms':>10}  {'share':>6}"]
        rows = [(o.key, o.calls, o.seconds) for o in self.ops[:limit]]
        rest = self.ops[limit:]
        if rest:
            rows.append(("(others)", sum(o.calls for o in rest), sum(o.seconds for o in rest)))
        for key, calls, sec in rows:
            lines.append(f"{key:<{width}}  {calls:>7}  {sec * 1e3:>10.2f}  {sec / total:>6.1%}")
        lines.append(f"{'total':<{width}}  {'':>7}  {self.total_seconds * 1e3:>10.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _snapshot() -> list[OpTime]:
    return [OpTime(k, c, ns * 1e-9) for k, c, ns in _core.profile_stats()]


@contextmanager
def profile(by_shape: bool = False) -> Iterator[Profile]:
    """Times every CPU node that graphs compute inside the block, per op::

        with recurra.profile() as prof:
            loss = model.loss(x, y); loss.backward(); opt.step()
        print(prof.table())

    With ``by_shape=True`` the entries are per op and shapes of its sources and result (a
    source marked ``T`` is read transposed, ``*`` otherwise strided). Work on a device
    backend counts as one ``"<backend> split"`` entry per run. The timer is process-wide:
    computations in other threads during the block are counted too. Profiling costs a
    clock read per node (with by_shape also a string per node)."""
    if _core.profile_enabled():
        raise RuntimeError("recurra.profile: a profile is already running (blocks do not nest)")
    prof = Profile()
    _core.profile_reset()
    _core.profile_enable(True, bool(by_shape))
    try:
        yield prof
    finally:
        _core.profile_enable(False, False)
        prof.ops = _snapshot()
        _core.profile_reset()


def _profile_from_env() -> None:
    """RECURRA_PROFILE=1 (or =shape): profile the whole process; the table goes to stderr
    at exit."""
    mode = os.environ.get("RECURRA_PROFILE", "")
    if mode in ("", "0"):
        return
    _core.profile_reset()
    _core.profile_enable(True, mode == "shape")

    def report() -> None:
        _core.profile_enable(False, False)
        table = Profile(_snapshot()).table()
        print(f"recurra profile (RECURRA_PROFILE={mode}):\n{table}", file=sys.stderr)

    atexit.register(report)
