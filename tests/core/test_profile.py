"""recurra.profile: per-op wall time of the CPU nodes computed inside the block."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(5)


def _work(n: int = 64) -> np.ndarray:
    a = RNG.standard_normal((n, 32)).astype(np.float32)
    b = RNG.standard_normal((n, 32)).astype(np.float32)
    # a @ b.T: b is read transposed (no copy); exp of the product
    return ops.exp(rc.tensor(a) @ rc.tensor(b).T * 0.01).numpy(), a, b


def test_counts_each_op_per_call():
    with rc.profile() as prof:
        for _ in range(3):
            got, a, b = _work()
            np.testing.assert_allclose(got, np.exp(a.astype(np.float64) @ b.T * 0.01), rtol=1e-5)
    by_key = {o.key: o for o in prof.ops}
    assert by_key["matmul"].calls == 3
    assert by_key["exp"].calls == 3
    assert all(o.seconds >= 0 for o in prof.ops)
    assert prof.total_seconds == pytest.approx(sum(o.seconds for o in prof.ops))
    # most time first
    secs = [o.seconds for o in prof.ops]
    assert secs == sorted(secs, reverse=True)
    assert "matmul" in prof.table() and "total" in prof.table()


def test_time_of_a_slow_op_is_measured():
    # a 400 x 400 x 400 product costs ~1e8 flops: far above the clock's resolution, and
    # the profile's time of it cannot exceed the wall time of the block
    a = RNG.standard_normal((400, 400)).astype(np.float32)
    t0 = time.perf_counter()
    with rc.profile() as prof:
        (rc.tensor(a) @ rc.tensor(a)).numpy()
    wall = time.perf_counter() - t0
    mm = next(o for o in prof.ops if o.key == "matmul")
    assert 0 < mm.seconds <= wall


def test_by_shape_keys_name_shapes_and_transposes():
    with rc.profile(by_shape=True) as prof:
        _work(48)
    keys = [o.key for o in prof.ops]
    assert "matmul (48, 32), (32, 48)T -> (48, 48)" in keys, keys
    assert any(k.startswith("exp (48, 48)") for k in keys), keys


def test_nothing_is_recorded_outside_a_block():
    with rc.profile() as prof:
        pass
    _work()
    assert prof.ops == []
    with rc.profile() as prof2:
        pass
    assert prof2.ops == []  # what ran between the blocks is not carried into the next


def test_blocks_do_not_nest():
    with rc.profile():
        with pytest.raises(RuntimeError, match="already running"):
            with rc.profile():
                pass
    with rc.profile() as prof:  # the failed inner block left the profiler usable
        _work()
    assert any(o.key == "matmul" for o in prof.ops)


def test_env_var_prints_a_table_at_exit():
    code = textwrap.dedent(
        """
        import numpy as np
        import recurra as rc
        from recurra import ops
        x = rc.tensor(np.ones((8, 8), np.float32))
        print(float(ops.exp(x @ x).sum().numpy()))
        """
    )
    env = dict(os.environ, RECURRA_PROFILE="shape")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) == pytest.approx(64 * np.exp(8.0), rel=1e-5)
    assert "recurra profile (RECURRA_PROFILE=shape)" in r.stderr
    assert "matmul (8, 8), (8, 8) -> (8, 8)" in r.stderr
