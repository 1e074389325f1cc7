"""ShardedSampler: the ranks' rows put together are the one-process batch of the step, for
any world size that divides the batch (no MPI needed)."""

from __future__ import annotations

import numpy as np
import pytest

from recurra_dist import ShardedSampler
from recurra_models.training import batch_at

DATA = np.random.default_rng(7).integers(0, 300, size=500).astype(np.int32)


@pytest.mark.parametrize("world", [1, 2, 3, 6])
def test_shards_put_together_are_the_global_batch(world):
    for step in (0, 1, 17):
        want_x, want_y = batch_at(DATA, 6, 10, 5, step)
        parts = [ShardedSampler(DATA, 6, 10, 5, r, world).batch(step) for r in range(world)]
        np.testing.assert_array_equal(np.concatenate([x for x, _ in parts]), want_x)
        np.testing.assert_array_equal(np.concatenate([y for _, y in parts]), want_y)
        assert all(x.shape == (6 // world, 10) and x.dtype == np.int32 for x, _ in parts)
    # another seed, another batch
    assert not np.array_equal(
        ShardedSampler(DATA, 6, 10, 6, 0, world).batch(0)[0],
        ShardedSampler(DATA, 6, 10, 5, 0, world).batch(0)[0],
    )


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="multiple of the world size"):
        ShardedSampler(DATA, 6, 10, 0, 0, 4)
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        ShardedSampler(DATA, 6, 10, 0, 2, 2)
    with pytest.raises(ValueError, match="at least seq_len"):
        ShardedSampler(DATA[:5], 6, 10, 0, 0, 1)
