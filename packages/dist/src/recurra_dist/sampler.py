"""A seeded sampler that shards every global batch across the ranks.

The global batch of step ``s`` is drawn from ``np.random.default_rng([seed, s])`` alone
(the window starts of :func:`recurra_models.training.batch_at`), so it does not depend on
the number of ranks: rank ``r`` of ``N`` takes rows ``r*B/N .. (r+1)*B/N`` of it. The data
position of a run is therefore just the step: a run saved at step ``s`` by N ranks resumes
at step ``s`` on M ranks and sees the same global batches (the global batch size must stay
the same and both N and M must divide it).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ShardedSampler"]


class ShardedSampler:
    """Batches of ``seq_len``-token windows of ``data`` for one rank.

    Args:
        data: 1-D integer token array.
        batch_size: the global batch size (sequences per step over all ranks).
        seq_len: tokens per sequence.
        seed: the batch seed.
        rank, world_size: this rank and the number of ranks; ``world_size`` must divide
            ``batch_size``.

    Raises ValueError for sizes that do not fit (a world size that does not divide the
    batch, a rank out of range, data shorter than ``seq_len + 1``).
    """

    def __init__(
        self,
        data: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ShardedSampler: rank {rank} of world size {world_size}")
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"ShardedSampler: the global batch size {batch_size} must be a positive "
                f"multiple of the world size {world_size}"
            )
        arr = np.asarray(data)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.shape[0] < seq_len + 1:
            raise ValueError(
                f"ShardedSampler: data must be a 1-D integer array of at least seq_len + 1 = "
                f"{seq_len + 1} tokens, got {arr.dtype} {arr.shape}"
            )
        self.data, self.batch_size, self.seq_len = arr, int(batch_size), int(seq_len)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.local_batch = self.batch_size // self.world_size

    def rows(self) -> slice:
        """This rank's rows of a global batch."""
        return slice(self.rank * self.local_batch, (self.rank + 1) * self.local_batch)

    def global_starts(self, step: int) -> np.ndarray:
        """The window starts of the global batch of ``step`` (every rank draws all of them,
        so that the batch does not depend on the world size)."""
        n = int(self.data.shape[0]) - self.seq_len
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, int(step)])
        return rng.integers(0, n, size=self.batch_size)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of this rank for ``step``: int32 (batch_size / world_size,
        seq_len) each, the targets shifted by one token."""
        starts = self.global_starts(step)[self.rows()]
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        chunk = self.data[idx].astype(np.int32, copy=False)
        return np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])
