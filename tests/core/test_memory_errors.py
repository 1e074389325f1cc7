"""Host memory errors say what happened: a MemoryError names the pool, the bytes asked, the
host's free and total memory, and what to try."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra import ops


def test_host_arena_out_of_memory_names_pool_bytes_and_free() -> None:
    x = rc.tensor(np.ones(1, np.float32))
    big = ops.exp(ops.broadcast_to(x, (1 << 20, 1 << 20, 1 << 20)))  # 2^62 bytes
    with pytest.raises(MemoryError) as e:
        ops.sum(big).item()
    msg = str(e.value)
    assert "out of host memory: the transient arena pool asked for 4294967296.00 GiB" in msg, msg
    assert "available of" in msg and "recurra holds" in msg
    assert "gradient checkpointing" in msg
    assert rc.tensor(np.ones(3, np.float32)).sum().item() == 3.0  # nothing broke
