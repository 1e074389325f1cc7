"""GPU benchmark of the recurrent ops: ours on Vulkan against Triton (fla) and PyTorch on CUDA.

    python bench/gpu_recurrent.py [--small] [--only mamba2,wkv6] [--reps 7] [--deadline 220]
                                  [--ssm-path auto|seq|chunk] [--dispatches]

ssm_scan path on Vulkan (mamba2_* cases): --ssm-path sets RECURRA_VK_SSM for the run. "auto"
(the default, also when the variable is unset) takes the chunked (state-space-duality) kernels
of shaders/ssm_scan_chunked.comp for one decay per head and n_tok >= 128 (so at the full sizes;
--small's 32 tokens run the sequential ones), "chunk" forces them for any Mamba-2 shape, "seq"
forces the sequential kernels of shaders/ssm_scan.comp. Mamba-1 (one decay per state) is always
sequential. Tuning knobs of the chunked kernels: RECURRA_VK_SSD_HBLK=1|2|4 heads per dC/dB
workgroup of the backward (default: 2 while >= 512 workgroups remain, else 1; 2 at the full
size); RECURRA_VK_SSD_KT=8|16|32 stages their matmuls 8, 16 or 32 steps of K at a time in
every kernel, RECURRA_VK_SSD_KT=MODE:K,... per kernel (default: 16, with 32 for dC/dB and du,
and 8 for y and du where two of their workgroups at 16 do not fit the shared memory limit).

Cases (issue 5; shapes in numpy order, docs/ops.md):

- mamba2_fb / mamba2_fwd: ssm_scan, Mamba-2 (d_state 128, head_dim 64, 32 heads, 1 group),
  4 sequences of 1024 tokens, forward + backward / forward only. Peers: flash-linear-
  attention's chunk_simple_gla (per-head scalar decay: exactly this recurrence with
  q = C, k = B, v = x softplus(dt), log decay softplus(dt) A, K = d_state, V = head_dim) and
  chunk_gla (the same decay broadcast over K), and a per-token PyTorch loop (fb only).
- wkv6_*_fb, wkv7_*_fb: head size 64, 32 heads, 1 x 4096 and 4 x 1024 tokens, forward +
  backward, against fla's chunk_rwkv6 / chunk_rwkv7 (the latter as fla's RWKV-7 layer calls
  it: safe_gate, lower_bound -0.6065, chunk 64; our decays are drawn inside that bound).
- mamba2_step_fb: the same at the shape of one layer of a Mamba2-130m training step at batch
  8 x 512 (bench/mixed_precision.py; 8 sequences of 512 tokens, 24 heads), against
  chunk_simple_gla.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Before anything imports triton: fp32 dots in IEEE precision (no TF32), as for torch.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from common import Case, Table, Timing, environment, measure, vulkan_device  # noqa: E402
from gpu_recurrent_peers import (  # noqa: E402
    PeerResult,
    Skipped,
    Torch,
    _err,
    run_peer,
)

# --- shapes -------------------------------------------------------------------------------
FULL: dict[str, dict[str, int]] = {
    "mamba2": {"ns": 4, "nt": 1024, "nh": 32, "hd": 64, "ds": 128},
    "mamba2_step": {"ns": 8, "nt": 512, "nh": 24, "hd": 64, "ds": 128},
    "mamba1": {"ns": 4, "nt": 1024, "nh": 1536, "hd": 1, "ds": 16},
    "conv": {"ns": 4, "nt": 1024, "d": 1536, "w": 4},
    "rwkv_t4096": {"ns": 1, "T": 4096, "H": 32, "S": 64},
    "rwkv_b4": {"ns": 4, "T": 4096, "H": 32, "S": 64},
}
SMALL: dict[str, dict[str, int]] = {
    "mamba2": {"ns": 2, "nt": 32, "nh": 2, "hd": 16, "ds": 32},
    "mamba2_step": {"ns": 2, "nt": 96, "nh": 2, "hd": 16, "ds": 32},
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
    "mamba2_step_fb": Spec(
        "mamba2", "mamba2_step", True, ["fla-simple-gla"], "(Mamba2-130m training step's scan)"
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
        dev, why = vulkan_device(vk_index, "--vk-device")
        if dev is None:
            return None, why
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
