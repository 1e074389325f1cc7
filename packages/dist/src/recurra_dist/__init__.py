"""recurra-dist: data-parallel training for recurra on MPI (through mpi4py).

mpiexec -n 2 python train.py

import recurra_dist as dist
ctx = dist.init()                      # rank, world size, local rank; abort-on-error hook
model.to(ctx.device())                 # vulkan:<local_rank % n_gpus>, or cpu
dp = dist.DataParallel(model, opt)     # broadcasts rank 0's parameters
sampler = dist.ShardedSampler(data, batch_size, seq_len, seed, ctx.rank, ctx.world_size)
x, y = sampler.batch(step)             # this rank's rows of the global batch
model.loss(x, y).backward()
dp.step()                              # averages the gradients, then opt.step()
"""

from __future__ import annotations

from recurra_dist.context import (
    Context,
    abort,
    device_for,
    init,
    install_abort_hook,
    launched_world_size,
)
from recurra_dist.parallel import DataParallel, ExchangeTimeout
from recurra_dist.sampler import ShardedSampler

__version__ = "0.1.0"

__all__ = [
    "Context",
    "DataParallel",
    "ExchangeTimeout",
    "ShardedSampler",
    "abort",
    "device_for",
    "init",
    "install_abort_hook",
    "launched_world_size",
]
