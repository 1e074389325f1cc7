"""GPU benchmark of the recurrent ops: ours on Vulkan against Triton (fla) and PyTorch on CUDA.

    python bench/gpu_recurrent.py [--small] [--only mamba2,wkv6] [--reps 7] [--deadline 220]
                                  [--ssm-path auto|seq|chunk] [--dispatches]

ssm_scan path on Vulkan (mamba2_* cases): --ssm-path sets RECURRA_VK_SSM for the run. "auto"
(the default, also when the variable is unset) takes the chunked (state-space-duality) kernels
of shaders/ssd.comp for one decay per head and n_tok >= 128 (so at the full sizes; --small's 32
tokens run the sequential ones), "chunk" forces them for any Mamba-2 shape, "seq" forces the
sequential kernels of shaders/ssm_scan.comp. Mamba-1 (one decay per state) is always sequential.
Tuning knob of the chunked backward: RECURRA_VK_SSD_HBLK=1|2|4 heads per dC/dB workgroup
(default: 2 while >= 512 workgroups remain, else 1; 2 at the full size).

Cases (issue 5; shapes in numpy order, docs/ops.md):

- mamba2_fb / mamba2_fwd: ssm_scan, Mamba-2 (d_state 128, head_dim 64, 32 heads, 1 group),
  4 sequences of 1024 tokens, forward + backward / forward only. Peers: flash-linear-
  attention's chunk_simple_gla (per-head scalar decay: exactly this recurrence with
  q = C, k = B, v = x softplus(dt), log decay softplus(dt) A, K = d_state, V = head_dim) and
  chunk_gla (the same decay broadcast over K), and a per-token PyTorch loop (fb only).
- wkv6_*_fb, wkv7_*_fb: head size 64, 32 heads, 1 x 4096 and 4 x 1024 tokens, forward +
  backward, against fla's chunk_rwkv6 / chunk_rwkv7 (the latter as fla's RWKV-7 layer calls
  it: safe_gate, lower_bound -0.6065, chunk 64; our decays are drawn inside that bound).
- mamba1_fb: ssm_scan, Mamba-1 (d_state 16, d_inner 1536), 4 x 1024 tokens, fwd + bwd,
  against the per-token PyTorch loop; target >= 50x.
- conv_fb / conv_fwd: ssm_conv (d_inner 1536, d_conv 4), 4 x 1024 tokens, against
  torch.nn.functional.conv1d (groups = d_inner, cuDNN).

Every peer computes the same function of the same inputs as ours (the softplus, the log of
the decays, the head broadcast of B and C happen inside the timed peer step) and its output
and gradients are compared with ours (normalised MSE, printed, never fatal). The loss of
every backward is sum(y * R) with a fixed random R.

Our figures, per case:
- "<case>" (fb: wall clock of one full lazy-API training step on device tensors: record the
  ops, plan-cache hit, run forward + loss + backward as one Vulkan submission, copy the
  gradients into fresh device buffers, read the loss; the note adds the time of the graph's
  compute() alone). fwd: GPU timestamps of the op's node.
- "<case> gpu" / "<case> wall": the other figure: GPU timestamps of the op's forward node
  plus its backward node (recurra_vulkan._vk.profile_node; the fair match for CUDA-event
  times), or the wall clock of a forward-only lazy step.
Peers are timed with CUDA events after warm-up (TF32 off: torch's flags, and
TRITON_F32_DEFAULT=ieee for Triton unless already set in the environment). Medians.

Each case and each peer runs in its own try/except: a failure costs one row, never the run.
Peers still waiting after --deadline seconds are skipped (one line each). --small runs tiny
shapes (for lavapipe); without CUDA the PyTorch peers then run on the CPU and fla prints
n/a. Reference constants measured elsewhere (ggml's Vulkan forward) are printed as peer rows
labelled "(ref)"; they are not timed here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Before anything imports triton: fp32 dots in IEEE precision (no TF32), as for torch.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from common import Case, Table, Timing, cuda_measure, environment, measure  # noqa: E402

RWKV7_LOWER_BOUND = -0.6065306597126334  # log decay bound of fla's RWKV-7 layer

# --- shapes -------------------------------------------------------------------------------
FULL: dict[str, dict[str, int]] = {
    "mamba2": {"ns": 4, "nt": 1024, "nh": 32, "hd": 64, "ds": 128},
    "mamba1": {"ns": 4, "nt": 1024, "nh": 1536, "hd": 1, "ds": 16},
    "conv": {"ns": 4, "nt": 1024, "d": 1536, "w": 4},
    "rwkv_t4096": {"ns": 1, "T": 4096, "H": 32, "S": 64},
    "rwkv_b4": {"ns": 4, "T": 4096, "H": 32, "S": 64},
}
SMALL: dict[str, dict[str, int]] = {
    "mamba2": {"ns": 2, "nt": 32, "nh": 2, "hd": 16, "ds": 32},
    "mamba1": {"ns": 2, "nt": 32, "nh": 64, "hd": 1, "ds": 16},
    "conv": {"ns": 2, "nt": 32, "d": 64, "w": 4},
    "rwkv_t4096": {"ns": 1, "T": 32, "H": 2, "S": 64},
    "rwkv_b4": {"ns": 2, "T": 32, "H": 2, "S": 64},
}


@dataclass
class Spec:
    """One case: op family, shape key, mode, peers, target, reference constants."""

    family: str  # mamba2 | mamba1 | conv | wkv6 | wkv7
    shape: str  # key of FULL / SMALL
    backward: bool
    peers: list[str]
    target: str = "(no target)"
    target_ms: float | None = None
    target_ratio: float | None = None  # against the first peer
    refs: dict[str, float] = field(default_factory=dict)  # label -> ms, full sizes only


SPECS: dict[str, Spec] = {
    "mamba2_fb": Spec(
        "mamba2",
        "mamba2",
        True,
        ["fla-simple-gla", "fla-gla", "torch-loop"],
        "<= 2.7 ms",
        target_ms=2.7,
    ),
    "mamba2_fwd": Spec(
        "mamba2",
        "mamba2",
        False,
        ["fla-simple-gla", "fla-gla"],
        "(none; ggml-vk fwd 1.11 ms)",
        refs={"ggml-vk (ref)": 1.11},
    ),
    "mamba1_fb": Spec(
        "mamba1", "mamba1", True, ["torch-loop"], ">= 50x torch loop", target_ratio=50.0
    ),
    "conv_fb": Spec("conv", "conv", True, ["torch-conv1d"]),
    "conv_fwd": Spec(
        "conv",
        "conv",
        False,
        ["torch-conv1d"],
        "(none; ggml-vk fwd 0.075 ms)",
        refs={"ggml-vk (ref)": 0.075},
    ),
    "wkv6_t4096_fb": Spec("wkv6", "rwkv_t4096", True, ["fla-rwkv6"]),
    "wkv6_b4_fb": Spec("wkv6", "rwkv_b4", True, ["fla-rwkv6"], "(fla ~3 ms)"),
    "wkv7_t4096_fb": Spec("wkv7", "rwkv_t4096", True, ["fla-rwkv7"]),
    "wkv7_b4_fb": Spec("wkv7", "rwkv_b4", True, ["fla-rwkv7"], "(fla ~3 ms)"),
}

OP_NAME = {
    "mamba2": "ssm_scan",
    "mamba1": "ssm_scan",
    "conv": "ssm_conv",
    "wkv6": "rwkv_wkv6",
    "wkv7": "rwkv_wkv7",
}
INPUT_NAMES = {
    "mamba2": ["s", "x", "dt", "A", "B", "C", "ids"],
    "mamba1": ["s", "x", "dt", "A", "B", "C", "ids"],
    "conv": ["sx", "c"],
    "wkv6": ["k", "v", "r", "tf", "td", "state"],
    "wkv7": ["r", "w", "k", "v", "a", "b", "state"],
}


# --- inputs (numpy order, docs/ops.md) ------------------------------------------------------
def make_inputs(family: str, d: dict[str, int], seed: int = 0) -> list[np.ndarray]:
    """Returns the op's array arguments in recurra's argument order, drawn so that decays
    stay in the ranges real models use (no underflow to denormals)."""
    rng = np.random.default_rng(seed)

    def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    def unif(lo: float, hi: float, *shape: int) -> np.ndarray:
        return rng.uniform(lo, hi, shape).astype(np.float32)

    if family in ("mamba2", "mamba1"):
        ns, nt, nh, hd, ds = d["ns"], d["nt"], d["nh"], d["hd"], d["ds"]
        a_cols = 1 if family == "mamba2" else ds
        return [
            randn(ns, nh, hd, ds, scale=0.1),
            randn(ns, nt, nh, hd),
            randn(ns, nt, nh) - np.float32(1.0),
            -unif(0.5, 4.5, nh, a_cols),
            randn(ns, nt, 1, ds, scale=ds**-0.5),
            randn(ns, nt, 1, ds, scale=ds**-0.5),
            np.arange(ns, dtype=np.int32),
        ]
    if family == "conv":
        return [randn(d["ns"], d["d"], d["w"] - 1 + d["nt"]), randn(d["d"], d["w"], scale=0.5)]
    T, H, S, ns = d["T"], d["H"], d["S"], d["ns"]
    if family == "wkv6":  # k, v, r, tf, td, state
        return [
            randn(T, H, S, scale=S**-0.5),
            randn(T, H, S),
            randn(T, H, S),
            randn(H, S, scale=0.5),
            unif(0.5, 1.0, T, H, S),
            randn(ns, H, S, S, scale=0.1),
        ]
    if family == "wkv7":  # r, w, k, v, a, b, state; a = -kk, b = kk * gate as RWKV-7 does
        kk = rng.standard_normal((T, H, S)).astype(np.float32)
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        sig = 1.0 / (1.0 + np.exp(-rng.standard_normal((T, H, S))))
        w = np.exp(-0.6 * sig).astype(np.float32)  # log w in (-0.6, 0): inside fla's bound
        return [
            randn(T, H, S),
            w,
            randn(T, H, S, scale=S**-0.5),
            randn(T, H, S),
            -kk,
            kk * unif(0, 1, T, H, S),
            randn(ns, H, S, S, scale=0.1),
        ]
    raise ValueError(family)


def output_shape(family: str, arrays: list[np.ndarray]) -> tuple[int, ...]:
    """Shape of y, the op's first result."""
    if family == "conv":
        sx, c = arrays
        return (sx.shape[0], sx.shape[2] - c.shape[1] + 1, sx.shape[1])
    if family in ("mamba2", "mamba1"):
        return arrays[1].shape
    return arrays[0].shape


def packed_sizes(family: str, arrays: list[np.ndarray]) -> tuple[int, int]:
    """(elements of the packed forward result, elements of the packed backward result)."""
    floats = sum(a.size for a in arrays if a.dtype == np.float32)
    if family == "conv":
        return int(np.prod(output_shape(family, arrays))), floats
    if family in ("mamba2", "mamba1"):
        s, x = arrays[0], arrays[1]
        return x.size + x.shape[0] * int(np.prod(s.shape[1:])), floats
    state = arrays[-1]
    return arrays[0].size + state.size, floats


def checkpoint_floats(arrays: list[np.ndarray]) -> int:
    """Floats of the checkpoints ssm_scan saves with ip [1] (one decay per head): the state
    entering each 64-token chunk, (n_seqs, n_head, ceil(n_tok / 64), head_dim, d_state)."""
    s, x = arrays[0], arrays[1]
    return x.shape[0] * x.shape[2] * -(-x.shape[1] // 64) * x.shape[3] * s.shape[3]


def nmse(got: Any, want: Any) -> float:
    """sum((got - want)^2) / sum(want^2), in float64."""
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    return float(np.sum((g - w) ** 2) / max(float(np.sum(w * w)), 1e-300))


# --- time budget ----------------------------------------------------------------------------
class Deadline:
    """Seconds since start against a budget; past it, pending peers are skipped."""

    def __init__(self, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


class Skipped(Exception):
    """A side that was not run (no CUDA, not installed, out of time); the text says why."""


# --- our side: recurra on Vulkan ------------------------------------------------------------
@dataclass
class Ours:
    """recurra, its ops, the Vulkan device and the raw backend module for profile_node."""

    rc: Any
    vk: Any
    device: str
    index: int


def load_ours(vk_index: int) -> tuple[Ours | None, str]:
    """Imports recurra and its Vulkan backend; returns (Ours or None, a line describing it)."""
    try:
        import recurra as rc
        import recurra_vulkan
    except Exception as exc:  # reported; the peers still run
        return None, f"import recurra / recurra_vulkan failed: {type(exc).__name__}: {exc}"
    try:
        info = recurra_vulkan.backend_info()
        devs = info.get("devices") or []
        if not devs:
            return None, f"no Vulkan device: {info.get('reason', '?')}"
        if vk_index >= len(devs):
            return None, f"--vk-device {vk_index}: only {len(devs)} Vulkan device(s)"
        dev = devs[vk_index]
        rc.set_strict_placement(True)
        line = (
            f"vulkan:{vk_index} {dev['name']} ({dev['kind']}, {dev['driver']}, "
            f"{dev['memory_bytes'] / 2**30:.1f} GiB); recurra from {rc.__file__}"
        )
        return Ours(rc, recurra_vulkan._vk, f"vulkan:{vk_index}", vk_index), line
    except Exception as exc:
        return None, f"Vulkan setup failed: {type(exc).__name__}: {exc}"


def _latest_plan(rc: Any) -> Any:
    """The native graph of the lazy API's most recently used plan (None if unreachable)."""
    try:
        from recurra._tensor import LAZY

        return next(reversed(LAZY._plans.values())).graph
    except Exception:
        return None


@dataclass
class OursResult:
    """Our figures of one case (ms) and our results for the check."""

    step: Timing | None = None
    graph: Timing | None = None
    gpu_fwd: float | None = None
    gpu_bwd: float | None = None
    y: np.ndarray | None = None
    grads: list[np.ndarray] | None = None
    errors: list[str] = field(default_factory=list)


def _err(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:140] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


def run_ours(
    ours: Ours, family: str, arrays: list[np.ndarray], R: np.ndarray, backward: bool, args: Any
) -> OursResult:
    """Times our op: the lazy step (wall), the graph's compute() alone (wall), and the op's
    node(s) with GPU timestamps. Each part in its own try; failures land in .errors."""
    rc, res = ours.rc, OursResult()
    op = getattr(rc.ops, OP_NAME[family])
    timing = {"reps": args.reps, "warmup": args.warmup, "budget_s": args.budget}
    dev = ours.device
    try:
        fl = [a.dtype == np.float32 for a in arrays]
        if backward:
            ts = [
                rc.param(a, device=dev) if f else rc.tensor(a, device=dev)
                for a, f in zip(arrays, fl)
            ]
        else:
            ts = [rc.tensor(a, device=dev) for a in arrays]
        params = [t for t, f in zip(ts, fl) if f and backward]
        r_dev = rc.tensor(R, device=dev)

        def first(out: Any) -> Any:
            return out[0] if isinstance(out, tuple) else out

        if backward:

            def step() -> float:
                for p in params:
                    p.grad = None
                loss = (first(op(*ts)) * r_dev).sum()
                loss.backward()
                return loss.item()  # the loss is on the device: this reads 4 bytes

        else:

            def step() -> float:
                with rc.no_grad():
                    first(op(*ts)).detach()  # runs the graph; y stays on the device
                return 0.0

        step()
        res.step = measure(step, **timing)
        g = _latest_plan(rc)
        if g is not None:
            res.graph = measure(g.compute, **timing)
        if backward:
            res.grads = [np.asarray(p.grad) for p in params]
        with rc.no_grad():
            res.y = np.asarray(first(op(*ts)))
    except Exception as exc:
        res.errors.append(f"lazy step: {_err(exc)}")
    try:
        n_fwd, n_bwd = packed_sizes(family, arrays)
        name = OP_NAME[family]
        iters, warm = max(3, args.reps), max(1, args.warmup)
        fwd_shape = output_shape(family, arrays) if family == "conv" else (n_fwd,)
        ip: list[int] = []
        if family == "mamba2" and backward:
            # as the lazy API does when a gradient follows on the GPU: the forward saves the
            # state entering each 64-token chunk, the backward reads them (a 9th source)
            ip = [1]
            fwd_shape = (n_fwd + checkpoint_floats(arrays),)
        t = ours.vk.profile_node(
            name, arrays, ip, [], fwd_shape, "float32", iters, warm, ours.index
        )
        res.gpu_fwd = statistics.median(t) * 1e3
        if backward:
            if family == "conv":
                srcs = [R, *arrays]  # (dy, sx, c)
            else:
                grad = np.zeros(n_fwd, np.float32)
                grad[: R.size] = R.reshape(-1)  # dL/dy = R, dL/d(final state) = 0
                # ssm_scan_back takes (grad, srcs...), the RWKV ops (srcs..., grad)
                srcs = [grad, *arrays] if family in ("mamba2", "mamba1") else [*arrays, grad]
                if ip:
                    srcs.append(
                        ours.vk.run_node(name, arrays, ip, [], fwd_shape, "float32", 0, ours.index)
                    )
            t = ours.vk.profile_node(
                name + "_back", srcs, [], [], (n_bwd,), "float32", iters, warm, ours.index
            )
            res.gpu_bwd = statistics.median(t) * 1e3
        if args.dispatches:
            print_dispatches(ours, name, arrays, ip, fwd_shape, iters, warm)
            if backward:
                print_dispatches(ours, name + "_back", srcs, [], (n_bwd,), iters, warm)
    except Exception as exc:
        res.errors.append(f"profile_node: {_err(exc)}")
    return res


def print_dispatches(
    ours: Ours,
    op: str,
    srcs: list[np.ndarray],
    ip: list[int],
    shape: tuple[int, ...],
    iters: int,
    warm: int,
) -> None:
    """--dispatches: the GPU time of each dispatch of one node (median over iters runs;
    each dispatch runs alone, behind a barrier, so the sum exceeds the node's time)."""
    recs = ours.vk.profile_dispatches(op, srcs, ip, [], shape, "float32", iters, warm, ours.index)
    per = len(recs) // iters
    total = 0.0
    for k in range(per):
        label = recs[k][0]
        ms = statistics.median(recs[j * per + k][1] for j in range(iters)) * 1e3
        total += ms
        print(f"#   {label:<44} {ms:8.3f} ms", flush=True)
    print(f"#   {op}: {per} dispatches, {total:.3f} ms in all", flush=True)


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


def check_line(peer: str, family: str, ours: OursResult, theirs: PeerResult, backward: bool) -> str:
    """NMSE of our y (and gradients) against the peer's; "" when there is nothing to compare."""
    parts = []
    if ours.y is not None and theirs.y is not None and ours.y.shape == theirs.y.shape:
        parts.append(f"y {nmse(ours.y, theirs.y):.1e}")
    if backward and ours.grads is not None and theirs.grads is not None:
        names = [n for n in INPUT_NAMES[family] if n != "ids"]
        errs = [
            (n, nmse(a, b))
            for n, a, b in zip(names, ours.grads, theirs.grads)
            if a.shape == b.shape
        ]
        if errs:
            worst = max(errs, key=lambda e: e[1])
            parts.append(
                f"grads max {worst[1]:.1e} ({worst[0]}; "
                + ", ".join(f"{n} {e:.0e}" for n, e in errs)
                + ")"
            )
    return f"nmse vs {peer}: " + ", ".join(parts) if parts else ""


# --- driver ---------------------------------------------------------------------------------
def run_case(
    name: str, spec: Spec, ours: Ours | None, why_not: str, tc: Torch, args: Any, table: Table,
    clock: Deadline,
) -> None:  # fmt: skip
    """Runs one case (ours, then each peer) and prints its rows; never raises."""
    dims = (SMALL if args.small else FULL)[spec.shape]
    arrays = make_inputs(spec.family, dims)
    R = (
        np.random.default_rng(1)
        .standard_normal(output_shape(spec.family, arrays))
        .astype(np.float32)
    )
    res: OursResult | None = None
    if ours is None:
        res = OursResult(errors=[why_not])
    else:
        try:
            res = run_ours(ours, spec.family, arrays, R, spec.backward, args)
        except Exception as exc:
            res = OursResult(errors=[_err(exc)])

    peers: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    checks: list[str] = []
    for peer in spec.peers:
        # a Triton peer's first run compiles and autotunes (tens of seconds): start one only
        # with --compile-reserve seconds left
        need = args.compile_reserve if peer.startswith("fla-") and peer not in tc.warmed else 0.0
        if clock.left() < need or clock.left() <= 0:
            peers[peer] = None
            notes[peer] = f"n/a: skipped at {clock.elapsed():.0f} s (--deadline)"
            continue
        try:
            t0 = time.perf_counter()
            pr = run_peer(tc, peer, spec.family, arrays, R, spec.backward, args)
            tc.warmed.add(peer)
            if tc.cuda:
                tc.torch.cuda.empty_cache()  # the peer's tensors died with run_peer
            peers[peer] = pr.timing.median_ms
            notes[peer] = (
                f"{'' if pr.where == 'cuda' else 'on the CPU, '}{len(pr.timing.runs_ms)} runs, "
                f"{time.perf_counter() - t0:.1f} s with warm-up/compile"
            )
            if not args.no_check:
                line = check_line(peer, spec.family, res, pr, spec.backward)
                if line:
                    checks.append(line)
        except Skipped as exc:
            peers[peer], notes[peer] = None, f"n/a: {exc}"
        except Exception as exc:
            peers[peer], notes[peer] = None, f"error: {_err(exc)}"
            print(f"# {name} {peer}: {_err(exc)}", flush=True)
    if not args.small:
        for label, ms in spec.refs.items():
            peers[label] = ms
            notes[label] = "reference constant measured elsewhere, not timed in this run"

    gpu = None
    if res.gpu_fwd is not None and (not spec.backward or res.gpu_bwd is not None):
        gpu = res.gpu_fwd + (res.gpu_bwd or 0.0)
    gpu_note = (
        f"GPU timestamps: fwd node {res.gpu_fwd:.3f} + bwd node {res.gpu_bwd:.3f} ms"
        if spec.backward and gpu is not None
        else "GPU timestamps of the op's node"
    )
    wall = res.step.median_ms if res.step is not None else None
    graph_note = f"graph compute() alone {res.graph.median_ms:.3f} ms" if res.graph else ""
    err_note = "; ".join(res.errors)
    if spec.backward:
        wall_note = "lazy step fwd+bwd, wall" + (f"; {graph_note}" if graph_note else "")
        rows = [(name, wall, wall_note), (f"{name} gpu", gpu, gpu_note)]
    else:
        wall_note = "lazy forward step, wall" + (f"; {graph_note}" if graph_note else "")
        rows = [(name, gpu, gpu_note), (f"{name} wall", wall, wall_note)]
    for i, (row, ms, note) in enumerate(rows):
        case = Case(
            row,
            ours_ms=ms,
            ours_note=note if ms is not None else ("error: " + err_note if err_note else "n/a"),
            peers=dict(peers),
            peer_notes=dict(notes) if i == 0 else {},
            target=spec.target,
            target_ms=spec.target_ms,
            target_ratio=spec.target_ratio,
            check="; ".join(checks) if i == 0 else "",
        )
        table.add(case)
    if err_note and (wall is not None or gpu is not None):
        print(f"# {name}: {err_note}", flush=True)


def parse_args() -> argparse.Namespace:
    """The options; returns them with `.cases`, the selected case names."""
    names = list(SPECS)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (a check on lavapipe)")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per measurement (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    ap.add_argument(
        "--budget", type=float, default=10.0, help="seconds one wall-clock measurement may take"
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=210.0,
        help="seconds after which peers not yet run are skipped (default 210)",
    )
    ap.add_argument(
        "--compile-reserve",
        type=float,
        default=50.0,
        help="seconds that must be left to start a Triton peer's first (compiling) run",
    )
    ap.add_argument("--vk-device", type=int, default=0, help="Vulkan device index (0: best)")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated case names or prefixes; of: " + ", ".join(names),
    )
    ap.add_argument("--no-check", action="store_true", help="skip comparing results with peers")
    ap.add_argument(
        "--dispatches", action="store_true", help="print each dispatch's GPU time of our nodes"
    )
    ap.add_argument(
        "--ssm-path",
        choices=["auto", "seq", "chunk"],
        default=None,
        help="Vulkan ssm_scan kernels (sets RECURRA_VK_SSM; default: the environment's, else auto)",
    )
    args = ap.parse_args()
    if args.ssm_path is not None:
        os.environ["RECURRA_VK_SSM"] = args.ssm_path
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    args.cases = [
        n
        for n in names
        if not wanted or any(n == w or (w not in names and n.startswith(w)) for w in wanted)
    ]
    if not args.cases:
        ap.error(f"--only {args.only!r} selects no case; cases: {', '.join(names)}")
    return args


@contextlib.contextmanager
def _never_raise(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        print(f"# {what}: {_err(exc)}", flush=True)


def main() -> int:
    """Runs the selected cases; returns 0 (failures are rows, not exit codes)."""
    args = parse_args()
    ours, line = load_ours(args.vk_device)
    tc = Torch()
    clock = Deadline(args.deadline)  # from here: an import may wait on a rebuild lock
    env: dict[str, Any] = {"cpu": "?", "cores": os.cpu_count(), "threads": 0, "python": "?"}
    with _never_raise("environment"):
        env = environment(os.cpu_count() or 1)
    env["recurra"] = line
    env["peers"] = tc.describe()
    env["sizes"] = "small (--small)" if args.small else "full"
    env.setdefault("env", {})
    env.setdefault("blas", [])
    print(f"# peers: {env['peers']}")
    print(f"# sizes: {env['sizes']}; cases: {', '.join(args.cases)}", flush=True)
    env["vk_ssm_path"] = os.environ.get("RECURRA_VK_SSM") or "auto"
    print(f"# vulkan ssm_scan path: {env['vk_ssm_path']}", flush=True)
    table = Table("gpu_recurrent", env)
    for name in args.cases:
        with _never_raise(name):
            run_case(name, SPECS[name], ours, line, tc, args, table, clock)
    print(f"# total {clock.elapsed():.1f} s", flush=True)
    with _never_raise("json"):
        table.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
