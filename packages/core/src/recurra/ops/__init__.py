"""All ops of recurra. Each works on lazy tensors, graph tensors and numpy arrays alike.

Ops with several results (the recurrent ones) return a tuple of tensors.

Each area is written in its own module with its own ``__all__``; this package imports every
public name explicitly, so type checkers and readers see where each op comes from. A name
added to an area's ``__all__`` must be added here too (tests/core/test_api.py checks).
"""

from recurra.ops._apply import apply, apply_multi
from recurra.ops._elementwise import (
    abs,
    add,
    broadcast_to,
    clamp,
    contiguous,
    div,
    exp,
    gelu,
    gelu_tanh,
    getitem,
    log,
    mul,
    neg,
    permute,
    pow,
    relu,
    reshape,
    scale,
    sigmoid,
    silu,
    softplus,
    sqr,
    sqrt,
    sub,
    tanh,
    transpose,
)
from recurra.ops._linalg import matmul, out_prod
from recurra.ops._nn import (
    causal_conv_silu,
    cross_entropy,
    gated_rms_norm,
    get_rows,
    layer_norm,
    log_softmax,
    mse_loss,
    rms_norm,
    softmax,
)
from recurra.ops._optim import (
    HYPER_LEN,
    HYPER_SLOTS,
    FusedStep,
    adam_step,
    adamw_step,
    grad_clip,
    grad_norm,
    lion_step,
    pack_hyper,
    sgd_step,
)
from recurra.ops._reduce import max, mean, sum
from recurra.ops._rwkv import gated_linear_attn, rwkv_wkv6, rwkv_wkv7
from recurra.ops._shape import concat, cumsum, pad
from recurra.ops._spec import OpSpec, op_codes, spec
from recurra.ops._ssm import ssm_conv, ssm_scan

__all__ = [
    "apply",
    "apply_multi",
    # elementwise, views
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "abs",
    "sqr",
    "sqrt",
    "exp",
    "log",
    "scale",
    "clamp",
    "pow",
    "relu",
    "silu",
    "gelu",
    "gelu_tanh",
    "sigmoid",
    "tanh",
    "softplus",
    "reshape",
    "permute",
    "transpose",
    "contiguous",
    "broadcast_to",
    "getitem",
    # reductions
    "sum",
    "mean",
    "max",
    # linear algebra
    "matmul",
    "out_prod",
    # neural-network ops
    "softmax",
    "log_softmax",
    "cross_entropy",
    "mse_loss",
    "rms_norm",
    "gated_rms_norm",
    "causal_conv_silu",
    "layer_norm",
    "get_rows",
    # shape
    "concat",
    "pad",
    "cumsum",
    # state-space models
    "ssm_conv",
    "ssm_scan",
    # RWKV and linear attention
    "gated_linear_attn",
    "rwkv_wkv6",
    "rwkv_wkv7",
    # optimizer updates
    "HYPER_LEN",
    "HYPER_SLOTS",
    "FusedStep",
    "adam_step",
    "adamw_step",
    "grad_clip",
    "grad_norm",
    "lion_step",
    "pack_hyper",
    "sgd_step",
    # the op spec (read-only)
    "OpSpec",
    "op_codes",
    "spec",
]
