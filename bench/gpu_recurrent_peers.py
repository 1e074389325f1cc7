"""The peers of bench/gpu_recurrent.py: PyTorch (a per-token loop, conv1d) and flash-linear-
attention's Triton kernels, on CUDA (on the CPU for --small without CUDA), each computing the
same function of the same inputs as ours (see gpu_recurrent.py's docstring)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from common import Timing, cuda_measure, measure

RWKV7_LOWER_BOUND = -0.6065306597126334  # log decay bound of fla's RWKV-7 layer


def _err(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:140] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


class Skipped(Exception):
    """A side that was not run (no CUDA, not installed, out of time); the text says why."""


# --- peers: PyTorch and fla on CUDA ---------------------------------------------------------
class Torch:
    """torch (and fla) if importable; CUDA if present."""

    def __init__(self) -> None:
        self.torch: Any = None
        self.cuda = False
        self.why = ""
        self.fla: dict[str, Any] = {}
        self.fla_why = ""
        self.warmed: set[str] = set()  # peers that ran once (compiled)
        try:
            import torch
        except Exception as exc:
            self.why = f"no torch ({type(exc).__name__}: {exc})"
            return
        self.torch = torch
        self.cuda = bool(torch.cuda.is_available())
        if not self.cuda:
            self.why = "no CUDA"
            self.fla_why = "no CUDA"
            return
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def describe(self) -> str:
        if self.torch is None:
            return f"torch: {self.why}"
        t = self.torch
        if not self.cuda:
            return f"torch {t.__version__}: no CUDA (torch peers run on the CPU in --small)"
        try:
            import triton

            tv = triton.__version__
        except Exception:
            tv = "not importable"
        return (
            f"torch {t.__version__} on {t.cuda.get_device_name()} (TF32 off), triton {tv}, "
            f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT')}"
        )

    def _fla_blocked(self) -> str:
        """Why fla cannot run here, found without compiling anything ("" if it may): fla
        0.6 refuses Triton < 3.7 on Hopper (compute capability 9) only after compiling its
        forward kernels, minutes per case."""
        try:
            import triton

            major, minor = (int(v) for v in triton.__version__.split(".")[:2])
        except Exception:
            return ""
        if self.torch.cuda.get_device_capability()[0] == 9 and (major, minor) < (3, 7):
            return f"blocked: fla needs Triton >= 3.7 on Hopper, this has {triton.__version__}"
        return ""

    def fla_fn(self, name: str) -> Any:
        """fla's chunk_* function `name` (imported on first use); raises Skipped if absent."""
        if not self.cuda:
            raise Skipped(self.fla_why or "no CUDA")
        if name in self.fla:
            return self.fla[name]
        if not self.fla_why:
            self.fla_why = self._fla_blocked()
        if self.fla_why:
            raise Skipped(self.fla_why)
        _einops_stub()
        try:
            if name == "chunk_simple_gla":
                from fla.ops.simple_gla import chunk_simple_gla as fn
            elif name == "chunk_gla":
                from fla.ops.gla import chunk_gla as fn
            elif name == "chunk_rwkv6":
                from fla.ops.rwkv6 import chunk_rwkv6 as fn
            else:
                from fla.ops.rwkv7 import chunk_rwkv7 as fn
        except Exception as exc:
            raise Skipped(f"fla not importable: {_err(exc)}") from exc
        self.fla[name] = fn
        return fn


def _einops_stub() -> None:
    """fla's package __init__ imports modules that import einops at the top, though the
    chunk kernels timed here never call it. When einops is not installed, a stand-in whose
    functions raise lets those imports succeed."""
    try:
        import einops  # noqa: F401
    except ImportError:
        stub = types.ModuleType("einops")

        def missing(*_a: Any, **_k: Any) -> Any:
            raise NotImplementedError("einops is not installed (stand-in from gpu_recurrent.py)")

        for n in ("rearrange", "repeat", "reduce", "einsum", "pack", "unpack"):
            setattr(stub, n, missing)
        sys.modules["einops"] = stub


def torch_scan_loop(s: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, ids: Any) -> Any:
    """The selective scan as a per-token PyTorch loop (eager, autograd through every step).

    Same layouts as ours; Mamba-1 (A (H, N)) and Mamba-2 (A (H, 1)) alike. Returns y."""
    import torch
    import torch.nn.functional as F

    dtp = F.softplus(dt)
    H, G = x.shape[2], B.shape[2]
    Bh = B.repeat_interleave(H // G, dim=2)
    Ch = C.repeat_interleave(H // G, dim=2)
    S = s[ids.long()]
    ys = []
    for t in range(x.shape[1]):
        d = dtp[:, t]
        a = torch.exp(d[:, :, None, None] * A[None, :, None, :])
        u = (x[:, t] * d[:, :, None])[..., None]
        S = S * a + u * Bh[:, t, :, None, :]
        ys.append((S * Ch[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1)


def fla_mamba2(fn: Any, per_key: bool) -> Callable[..., Any]:
    """Mamba-2's scan through fla's GLA kernels: q = C, k = B, v = x softplus(dt), log decay
    softplus(dt) A (per head; per_key broadcasts it over K for chunk_gla), K = d_state,
    V = head_dim, state [K, V] = ours transposed. Returns f(ours' inputs) -> y."""

    def f(s: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, ids: Any) -> Any:
        import torch.nn.functional as F

        H, G = x.shape[2], B.shape[2]
        dtp = F.softplus(dt)
        v = x * dtp[..., None]
        g = dtp * A[:, 0]
        k = B.repeat_interleave(H // G, dim=2)
        q = C.repeat_interleave(H // G, dim=2)
        h0 = s[ids.long()].transpose(-1, -2).contiguous()
        if per_key:
            gk = g[..., None].expand(*g.shape, k.shape[-1]).contiguous()
            o, _ = fn(q, k, v, gk, scale=1.0, initial_state=h0, output_final_state=True)
        else:
            o, _ = fn(q, k, v, g=g, scale=1.0, initial_state=h0, output_final_state=True)
        return o

    return f


def fla_rwkv6(fn: Any) -> Callable[..., Any]:
    """rwkv_wkv6 through fla's chunk_rwkv6 (log decay = log td, u = tf, scale 1)."""

    def f(k: Any, v: Any, r: Any, tf: Any, td: Any, state: Any) -> Any:
        import torch

        T, H, S = k.shape
        ns = state.shape[0]

        def b(t: Any) -> Any:
            return t.reshape(ns, T // ns, H, S)

        o, _ = fn(
            b(r), b(k), b(v), torch.log(b(td)), tf,
            scale=1.0, initial_state=state, output_final_state=True,
        )  # fmt: skip
        return o.reshape(T, H, S)

    return f


def fla_rwkv7(fn: Any) -> Callable[..., Any]:
    """rwkv_wkv7 through fla's chunk_rwkv7 as fla's RWKV-7 layer calls it (log decay = log w,
    state [K, V] = ours transposed, scale 1, safe_gate, lower bound, chunk 64)."""

    def f(r: Any, w: Any, k: Any, v: Any, a: Any, b_: Any, state: Any) -> Any:
        import torch

        T, H, S = r.shape
        ns = state.shape[0]

        def b(t: Any) -> Any:
            return t.reshape(ns, T // ns, H, S)

        o, _ = fn(
            b(r), torch.log(b(w)), b(k), b(v), b(a), b(b_),
            scale=1.0, initial_state=state.transpose(-1, -2).contiguous(),
            output_final_state=True, safe_gate=True, lower_bound=RWKV7_LOWER_BOUND,
            chunk_size=64,
        )  # fmt: skip
        return o.reshape(T, H, S)

    return f


def torch_conv(sx: Any, c: Any) -> Any:
    """ssm_conv as a depthwise conv1d (a correlation, as ours): y (n_seqs, n_tok, d_inner)."""
    import torch.nn.functional as F

    return F.conv1d(sx, c[:, None, :], groups=c.shape[0]).transpose(1, 2)


def peer_function(tc: Torch, peer: str, family: str) -> Callable[..., Any]:
    """The peer's f(inputs in our order, as torch tensors) -> y in our layout."""
    if peer == "torch-loop":
        return torch_scan_loop
    if peer == "torch-conv1d":
        return torch_conv
    if peer == "fla-simple-gla":
        return fla_mamba2(tc.fla_fn("chunk_simple_gla"), per_key=False)
    if peer == "fla-gla":
        return fla_mamba2(tc.fla_fn("chunk_gla"), per_key=True)
    if peer == "fla-rwkv6":
        return fla_rwkv6(tc.fla_fn("chunk_rwkv6"))
    if peer == "fla-rwkv7":
        return fla_rwkv7(tc.fla_fn("chunk_rwkv7"))
    raise ValueError(f"unknown peer {peer!r}")


@dataclass
class PeerResult:
    timing: Timing
    y: np.ndarray | None = None
    grads: list[np.ndarray] | None = None
    where: str = "cuda"


def run_peer(
    tc: Torch,
    peer: str,
    family: str,
    arrays: list[np.ndarray],
    R: np.ndarray,
    backward: bool,
    args: Any,
) -> PeerResult:
    """Times one peer on the case's inputs; raises Skipped when it cannot run here."""
    if tc.torch is None:
        raise Skipped(tc.why)
    torch = tc.torch
    on_cuda = tc.cuda
    if not on_cuda and not (args.small and peer.startswith("torch")):
        raise Skipped("no CUDA")
    fn = peer_function(tc, peer, family)
    dev = "cuda" if on_cuda else "cpu"
    fl = [a.dtype == np.float32 for a in arrays]
    leaves = [torch.tensor(a, device=dev, requires_grad=backward and f) for a, f in zip(arrays, fl)]
    r_t = torch.tensor(R, device=dev)
    slow = peer == "torch-loop"
    reps = min(args.reps, 3) if slow else args.reps
    warmup = 1 if slow else max(args.warmup, 2)  # Triton compiles and autotunes on the first

    def step() -> Any:
        if backward:
            for t in leaves:
                t.grad = None
            y = fn(*leaves)
            (y * r_t).sum().backward()
            return y
        with torch.no_grad():
            return fn(*leaves)

    if on_cuda:
        timing = cuda_measure(torch, step, reps, warmup)
    else:
        timing = measure(step, reps=reps, warmup=warmup, budget_s=args.budget)
    y = step()
    out = PeerResult(timing, y.detach().float().cpu().numpy(), where=dev)
    if backward:
        out.grads = [t.grad.detach().cpu().numpy() for t, f in zip(leaves, fl) if f]
    return out
