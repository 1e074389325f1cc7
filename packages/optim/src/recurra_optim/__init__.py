"""recurra-optim: optimizers whose state lives where the parameters live.

    import recurra, recurra_optim as optim
    w = recurra.param(np.zeros((4, 8), np.float32))
    opt = optim.AdamW([w], lr=1e-3, accumulate_steps=4, max_grad_norm=1.0)
    sched = optim.lr_scheduler.CosineWarmupLR(opt, warmup_steps=100, total_steps=10_000)
    for x, y in batches:
        loss = recurra.ops.mean((x @ w - y) ** 2)
        loss.backward()
        opt.step(); sched.step(); opt.zero_grad()
    opt.save("opt.safetensors")

Every step updates the parameters and their state in place with one fused native kernel
per parameter group; moments and step counts are recurra tensors on the parameter's device.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from recurra_optim import lr_scheduler
from recurra_optim.clip import clip_grad_norm_, clip_grad_value_
from recurra_optim.lr_scheduler import CosineWarmupLR, LRScheduler, OneCycleLR, StepLR
from recurra_optim.optimizer import Optimizer
from recurra_optim.optimizers import SGD, Adam, AdamW, Lion
from recurra_optim.scaler import DynamicLossScale

try:
    __version__ = _metadata.version("recurra-optim")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "CosineWarmupLR",
    "DynamicLossScale",
    "LRScheduler",
    "Lion",
    "OneCycleLR",
    "Optimizer",
    "StepLR",
    "__version__",
    "clip_grad_norm_",
    "clip_grad_value_",
    "lr_scheduler",
]
