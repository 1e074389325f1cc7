"""Training: a loop over next-token batches, evaluation, atomic resumable checkpoints.

Batches are a pure function of (seed, step) (:func:`batch_at`), the checkpoint holds the
exact float32 weights, the optimizer state and the step, so a run resumed from a checkpoint
computes the same loss curve as the uninterrupted run.

A checkpoint is a folder of four files, each written atomically (see
:mod:`recurra_models.checkpoint`).

:class:`Trainer` keeps ``ckpt-<step>`` folders under ``out_dir`` and a ``latest.json``
pointer, written atomically after the folder is complete. ``latest.json`` also lists the
folders the trainer wrote (``"checkpoints"``, oldest first): pruning to ``keep`` deletes only
those, never another folder (a ``ckpt-best`` copied there by the user).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import recurra as rc
from recurra_models.checkpoint import (
    CheckpointError,
    _fail,
    _written_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from recurra_models.loading import write_atomic

__all__ = [
    "CheckpointError",
    "Trainer",
    "batch_at",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

# -- data ----------------------------------------------------------------------------------


def _check_data(data: Any, seq_len: int, what: str) -> np.ndarray:
    arr = np.asarray(data)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D integer token array, got {arr.dtype} {arr.shape}")
    if arr.size < seq_len + 1:
        raise ValueError(
            f"{what} has {arr.size} tokens; at least seq_len + 1 = {seq_len + 1} are needed"
        )
    if arr.dtype in (np.uint16, np.int32) and arr.flags.c_contiguous:
        return arr  # a memory-mapped token file stays mapped (batches are cast on use)
    return np.ascontiguousarray(arr, dtype=np.int32)


def batch_at(
    data: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int
) -> tuple[np.ndarray, np.ndarray]:
    """The training batch of ``step``: (inputs, targets), int32 (batch_size, seq_len) each,
    windows of ``data`` at offsets drawn from ``np.random.default_rng([seed, step])``;
    targets are the inputs shifted by one token. A pure function of its arguments."""
    n = int(data.shape[0]) - seq_len
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(step)])
    starts = rng.integers(0, n, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = data[idx].astype(np.int32, copy=False)
    return np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])


def data_hash(data: np.ndarray) -> str:
    """SHA-256 (hex) of the int32 token array (read in pieces: no copy of a whole mapped
    token file)."""
    h = hashlib.sha256()
    for i in range(0, int(data.shape[0]), 1 << 24):
        h.update(np.ascontiguousarray(data[i : i + (1 << 24)], dtype=np.int32).tobytes())
    return h.hexdigest()


# -- the loop ------------------------------------------------------------------------------

Callback = Callable[[dict[str, Any]], Any]


_PRECISIONS = {
    "fp32": ("fp32", None),
    "float32": ("fp32", None),
    "bf16": ("bf16", rc.bfloat16),
    "bfloat16": ("bf16", rc.bfloat16),
    "f16": ("f16", rc.float16),
    "fp16": ("f16", rc.float16),
    "float16": ("f16", rc.float16),
}


def _parse_precision(precision: Any) -> tuple[str, Any]:
    """("fp32" | "bf16" | "f16", the autocast dtype or None). Raises ValueError."""
    got = _PRECISIONS.get(str(precision).lower()) if isinstance(precision, str) else None
    if got is None:
        raise ValueError(f"Trainer: precision must be 'fp32', 'bf16' or 'f16', got {precision!r}")
    return got


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _ProgressLog:
    """Prints Trainer.fit's progress on stderr: the first step, every ``every`` steps, the
    last one, evaluations and checkpoints (``every`` 0: nothing)."""

    def __init__(self, steps: int, start: int, every: int) -> None:
        self.steps, self.start, self.every = steps, start, every
        self.t0 = time.perf_counter()

    def __call__(self, ev: dict[str, Any]) -> None:
        if not self.every:
            return
        kind, step = ev.get("kind"), ev.get("step", 0)
        if kind == "step":
            if not (step == self.start + 1 or step % self.every == 0 or step == self.steps):
                return
            elapsed = time.perf_counter() - self.t0
            left = elapsed / (step - self.start) * (self.steps - step)
            line = (
                f"step {step}/{self.steps}  loss {ev['loss']:.4f}  "
                f"{ev['tokens_per_s']:.0f} tokens/s  elapsed {_duration(elapsed)}"
                + (f"  ETA {_duration(left)}" if step < self.steps else "")
                + (
                    f"  exchange {1e3 * ev['exchange_s']:.1f} ms "
                    f"({100 * ev['exchange_s'] / ev['time']:.0f}% of the step)"
                    if "exchange_s" in ev and ev.get("time")
                    else ""
                )
            )
        elif kind == "eval":
            line = f"step {step}/{self.steps}  eval loss {ev['eval_loss']:.4f}"
        elif kind == "checkpoint":
            line = f"step {step}/{self.steps}  checkpoint {ev['path']}"
        else:
            return
        print(line, file=sys.stderr, flush=True)


class Trainer:
    """Trains a causal LM on a token array with next-token cross-entropy.

    Args:
        model: a CausalLM (``model.loss(x, y)``, ``state_dict()``...), on its device.
        optimizer: a recurra_optim optimizer over ``model.parameters()``.
        data: 1-D int token array (e.g. ``ByteTokenizer().encode_file(path)``).
        batch_size, seq_len: batch shape; batch ``i`` is ``batch_at(data, ..., seed, i)``.
        steps: the total number of optimizer steps of the run.
        eval_data: optional token array; every ``eval_every`` steps (and after the last) the
            mean loss over ``eval_batches`` fixed batches of it is recorded.
        out_dir: where checkpoints go (``ckpt-<step>`` folders + ``latest.json``); every
            ``checkpoint_every`` steps and after the last step. ``checkpoint_every``
            None (the default): about every tenth of the run, at most 1000 steps apart;
            0: only at the end.
        keep: how many checkpoint folders to keep (older ones are deleted).
        scheduler: optional LR scheduler stepped after every optimizer step; its state is
            saved in checkpoints.
        seed: seeds the batch order.
        gradient_checkpointing: True recomputes each block's forward in the backward
            instead of keeping it (``model.gradient_checkpointing(True)``: less activation
            memory, the same gradients, about one more forward per step); False turns it
            off; None (the default) leaves the model as it is.
        log_every: a progress line on stderr (step, loss, tokens/s, ETA, checkpoints)
            after the first step and every ``log_every`` steps; None (the default): about
            every twentieth of the run, at most 100 steps apart; 0: silent.
        parallel: data-parallel training across processes (a ``recurra_dist.DataParallel``
            over ``model`` and ``optimizer``, or anything with its ``rank``, ``world_size``,
            ``shard(batch_size)``, ``step()``, ``mean(x)``, ``any(flag)``, ``barrier()``
            and ``last_exchange_s``). ``batch_size`` is then the global batch: every rank draws
            the batch of the step and computes its ``shard`` of the rows, the gradients are
            averaged across the ranks before the optimizer updates, and the recorded loss
            is the mean over the ranks (the same on every rank). Only rank 0 writes
            checkpoints and prints progress; the callback runs on every rank with the same
            records, and a stop it asks for on any rank stops every rank. The data position
            is the step, so a checkpoint resumes with another number of ranks, as long as
            it divides the batch size. Records get ``"exchange_s"`` (the time spent
            averaging gradients in that step).
        precision: ``"fp32"`` (the default), ``"bf16"`` or ``"f16"``: mixed precision, the
            forward (and so the backward) under ``recurra.autocast(bfloat16 / float16)``
            (matmuls and elementwise work in the 2-byte dtype, scans, norms, softmax,
            cross-entropy and reductions in float32). The parameters stay float32 (the
            optimizer's master weights; their gradients come back float32), so checkpoints
            hold float32 weights as before. ``"f16"`` adds a dynamic loss scale
            (``recurra_optim.DynamicLossScale``; pass ``loss_scale=`` for another one): a
            step whose gradients overflow is skipped (recorded with ``"skipped": True``)
            and the scale halved; its state is saved in checkpoints.
        capture: run each training step (forward and backward, one graph) through
            ``recurra.capture`` instead of running the model's Python again: the first
            step of a batch shape traces ``model.loss``, later steps compute its cached
            plan with the new batch and the current weights (the same bits as uncaptured,
            without the host time of recording thousands of ops per step). True (the
            default) uses it where it is safe: a ``CausalLM`` of recurra_models (whose
            loss builds the same graph for the same shapes) with no loss scale or a
            ``DynamicLossScale`` (whose scale is passed as a tensor), with or without
            ``parallel`` (a captured step tells it when each bucket's gradients are final,
            as backward() does); the model's ``training``, gradient checkpointing and loss
            chunking settings are part of the capture's signature (changing them traces
            again), and a parameter replaced by a new tensor is noticed. Evaluation
            batches are captured the same way (forward only). False: every step runs
            ``model.loss`` as written (needed for a subclass whose loss depends on
            host-side state that changes between steps).

    Raises ValueError for bad sizes or data too short for ``seq_len``, TypeError for
    ``gradient_checkpointing`` on a model without ``gradient_checkpointing()``.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        data: Any,
        batch_size: int = 8,
        seq_len: int = 64,
        steps: int = 100,
        eval_data: Any = None,
        eval_every: int = 0,
        eval_batches: int = 4,
        out_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep: int = 2,
        scheduler: Any = None,
        seed: int = 0,
        gradient_checkpointing: bool | None = None,
        log_every: int | None = None,
        parallel: Any = None,
        precision: str = "fp32",
        loss_scale: Any = None,
        capture: bool = True,
    ) -> None:
        self.precision, self.autocast_dtype = _parse_precision(precision)
        if loss_scale is None and self.precision == "f16":
            from recurra_optim import DynamicLossScale

            loss_scale = DynamicLossScale()
        self.loss_scale = loss_scale
        for name, v in (
            ("batch_size", batch_size),
            ("seq_len", seq_len),
            ("keep", keep),
            ("eval_batches", eval_batches),
        ):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Trainer: {name} must be a positive integer, got {v!r}")
        if checkpoint_every is None:
            checkpoint_every = min(1000, max(1, int(steps) // 10)) if _is_int(steps) else 0
        if log_every is None:
            log_every = min(100, max(1, int(steps) // 20)) if _is_int(steps) else 0
        for name, v in (
            ("steps", steps),
            ("eval_every", eval_every),
            ("checkpoint_every", checkpoint_every),
            ("log_every", log_every),
        ):
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"Trainer: {name} must be an integer >= 0, got {v!r}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data = _check_data(data, seq_len, "data")
        self.eval_data = (
            _check_data(eval_data, seq_len, "eval_data") if eval_data is not None else None
        )
        self.batch_size, self.seq_len, self.steps = int(batch_size), int(seq_len), int(steps)
        self.eval_every, self.eval_batches = int(eval_every), int(eval_batches)
        self.out_dir = Path(os.fspath(out_dir)) if out_dir is not None else None
        self.checkpoint_every, self.keep, self.seed = int(checkpoint_every), int(keep), int(seed)
        self.log_every = int(log_every)
        self.parallel = parallel
        self._rows = slice(None)
        if parallel is not None:
            if getattr(parallel, "optimizer", optimizer) is not optimizer:
                raise ValueError("Trainer: parallel wraps another optimizer than the trainer's")
            try:
                self._rows = parallel.shard(self.batch_size)
            except ValueError as e:
                raise ValueError(f"Trainer: {e} (batch_size is the global batch)") from None
            if parallel.rank != 0:
                self.log_every = 0  # rank 0 prints the progress
        if parallel is not None and loss_scale is not None:
            raise ValueError(
                "Trainer: loss scaling (precision='f16') is not supported with parallel yet; "
                "use precision='bf16'"
            )
        self.last_skipped = False  # whether the last train_step skipped its update
        self._inputs: dict[Any, tuple[Any, Any]] = {}  # see _on_device
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._data_hash = data_hash(self.data)
        if gradient_checkpointing is not None:
            if not callable(getattr(model, "gradient_checkpointing", None)):
                raise TypeError(
                    f"Trainer: gradient_checkpointing needs a model with a "
                    f"gradient_checkpointing() method; {type(model).__name__} has none"
                )
            model.gradient_checkpointing(bool(gradient_checkpointing))
        self._train_fn: Any = None
        self._eval_fn: Any = None
        if capture:
            from recurra_models.lm import CausalLM
            from recurra_optim import DynamicLossScale

            scaled_ok = loss_scale is None or type(loss_scale) is DynamicLossScale
            if isinstance(model, CausalLM) and scaled_ok:
                self._train_fn = rc.capture(
                    self._captured_loss, backward=True, params=model.parameters, key=self._key
                )
                self._eval_fn = rc.capture(self._model_loss, params=model.parameters, key=self._key)
        self._scale: Any = None  # the loss scale as a tensor (captured steps), see train_step

    @property
    def captured(self) -> bool:
        """Whether training steps run through ``recurra.capture`` (see ``capture``)."""
        return self._train_fn is not None

    def _key(self) -> Any:
        """The host-side settings of the model that change its loss graph."""
        m = self.model
        return (
            m.training,
            m.is_gradient_checkpointing,
            m.loss_chunk_bytes,
            m.loss_chunk_above,
            self.precision,
        )

    def _captured_loss(self, x: Any, y: Any, scale: Any = None) -> Any:
        loss = self._model_loss(x, y)
        # The loss scale is an argument (a tensor), so that its changing value is not frozen
        # into the capture; ``loss * scale`` is the op DynamicLossScale.scale records.
        return loss if scale is None else (loss * scale, loss)

    # -- pieces --------------------------------------------------------------------------
    def _on_device(self, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
        """The batch in input tensors of the model's device kept from step to step: each step
        writes its tokens into the same buffers, so a device can replay the step's recorded
        work instead of recording it again (its node list names the same buffers)."""
        vocab = getattr(self.model, "vocab_size", None)
        for a in (x, y):  # as the model checks arrays (tensors it takes as they are)
            if vocab is not None and a.size and (int(a.min()) < 0 or int(a.max()) >= vocab):
                raise ValueError(
                    f"token ids must be in [0, {vocab}), got min {int(a.min())}, max {int(a.max())}"
                )
        key = (x.shape, y.shape)
        held = self._inputs.get(key)
        if held is None:
            dev = getattr(self.model, "device", None)
            held = (rc.tensor(x, device=dev), rc.tensor(y, device=dev))
            self._inputs = {key: held}  # the batch shape of the step before is let go
        else:
            held[0].assign_(x)
            held[1].assign_(y)
        return held

    def _model_loss(self, xt: Any, yt: Any) -> Any:
        """The model's loss on input tensors, under the trainer's precision."""
        if self.autocast_dtype is None:
            return self.model.loss(xt, yt)
        with rc.autocast(self.autocast_dtype):
            return self.model.loss(xt, yt)

    def _forward_loss(self, x: np.ndarray, y: np.ndarray) -> Any:
        return self._model_loss(*self._on_device(x, y))

    def train_step(self, step: int) -> float:
        """One optimizer step on batch ``step``; returns the loss (before the update)."""
        x, y = batch_at(self.data, self.batch_size, self.seq_len, self.seed, step)
        self.model.train()
        scaler = self.loss_scale
        if self._train_fn is not None:
            xt, yt = self._on_device(x[self._rows], y[self._rows])
            if scaler is None:
                loss = self._train_fn(xt, yt)
            else:
                if self._scale is None or self._scale.device != xt.device:
                    self._scale = rc.tensor(np.float32(1), device=xt.device)
                self._scale.assign_(np.float32(scaler.scale_value))  # the same buffer each step
                loss = self._train_fn(xt, yt, self._scale)[1]
        else:
            loss = self._forward_loss(x[self._rows], y[self._rows])
            (scaler.scale(loss) if scaler is not None else loss).backward()
        value = float(loss.item())
        self.last_skipped = False
        if self.parallel is not None:
            value = self.parallel.mean(value)
            self.parallel.step()  # averages the gradients across the ranks, then updates
        elif scaler is not None:
            self.last_skipped = not scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        return value

    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` fixed batches of the eval data (no gradients).

        Raises ValueError when there is no eval data."""
        if self.eval_data is None:
            raise ValueError("Trainer.evaluate: no eval_data was given")
        was = self.model.training
        self.model.eval()
        total = 0.0
        try:
            with rc.no_grad():
                for k in range(self.eval_batches):
                    x, y = batch_at(
                        self.eval_data, self.batch_size, self.seq_len, self.seed + 1_000_003, k
                    )
                    x, y = x[self._rows], y[self._rows]
                    if self._eval_fn is not None:
                        loss = self._eval_fn(*self._on_device(x, y))
                    else:
                        loss = self._forward_loss(x, y)
                    total += float(loss.item())
        finally:
            self.model.train(was)
        if self.parallel is not None:
            total = self.parallel.mean(total)
        return total / self.eval_batches

    def _lr(self) -> float | None:
        try:
            return float(self.optimizer.param_groups[0]["lr"])
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            return None

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Writes a checkpoint of the current step into ``directory`` (default:
        ``out_dir/ckpt-<step>``, then ``latest.json`` and pruning to ``keep``); returns it.

        Raises ValueError when neither ``directory`` nor ``out_dir`` is set."""
        if directory is None and self.out_dir is None:
            raise ValueError("Trainer.save: give a directory or set out_dir")
        sched = self.scheduler.state_dict() if self.scheduler is not None else None
        extra = {
            "seed": self.seed,
            "data_hash": self._data_hash,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "history": self.history,
            "scheduler": sched,
            "world_size": self.parallel.world_size if self.parallel is not None else 1,
            "precision": self.precision,
            "loss_scale": self.loss_scale.state_dict() if self.loss_scale is not None else None,
        }
        if self.parallel is not None and self.parallel.rank != 0:
            # rank 0 writes (the ranks hold the same weights and optimizer state)
            if directory is not None:
                return Path(os.fspath(directory))
            assert self.out_dir is not None
            return self.out_dir / f"ckpt-{self.step:08d}"
        if directory is not None:
            return save_checkpoint(directory, self.model, self.optimizer, self.step, extra)
        assert self.out_dir is not None
        d = save_checkpoint(
            self.out_dir / f"ckpt-{self.step:08d}", self.model, self.optimizer, self.step, extra
        )
        written = [n for n in _written_checkpoints(self.out_dir) if n != d.name] + [d.name]
        kept, drop = written[-self.keep :], written[: -self.keep]
        write_atomic(
            self.out_dir / "latest.json",
            json.dumps({"step": self.step, "path": d.name, "checkpoints": kept}).encode(),
        )
        for name in drop:
            shutil.rmtree(self.out_dir / name, ignore_errors=True)
        return d

    def resume(self, directory: str | os.PathLike[str] | None = None) -> int:
        """Restores model, optimizer, scheduler, step and history from a checkpoint: a
        checkpoint folder, or an ``out_dir`` (its ``latest.json``; default: this trainer's
        ``out_dir``). Returns the restored step.

        Raises FileNotFoundError when there is no checkpoint, CheckpointError naming the
        file when it is corrupted or does not match the model, optimizer, data, seed or
        batch shape. With ``parallel``, every rank reads the checkpoint (a folder every
        host can read), which may have been written by another number of ranks."""
        base = Path(os.fspath(directory)) if directory is not None else self.out_dir
        if base is None:
            raise ValueError("Trainer.resume: give a directory or set out_dir")
        d = latest_checkpoint(base)
        meta = read_checkpoint_meta(d)
        extra = meta.get("extra") or {}
        tj = d / "trainer.json"
        if extra.get("data_hash") != self._data_hash:
            raise _fail(tj, "the checkpoint was trained on different data (data hash differs)")
        for k, mine in (
            ("seed", self.seed),
            ("batch_size", self.batch_size),
            ("seq_len", self.seq_len),
        ):
            if extra.get(k) != mine:
                raise _fail(tj, f"{k} differs: checkpoint {extra.get(k)!r}, trainer {mine!r}")
        # The scheduler state is tried first and put back when the checkpoint then fails to
        # load, so that a failed resume changes nothing.
        old_sched = None
        if self.scheduler is not None and extra.get("scheduler") is not None:
            old_sched = self.scheduler.state_dict()
            try:
                self.scheduler.load_state_dict(extra["scheduler"])
            except (ValueError, KeyError, TypeError) as e:
                self.scheduler.load_state_dict(old_sched)
                raise _fail(tj, f"the scheduler state does not match ({e})") from None
        scale_state = extra.get("loss_scale")
        if self.loss_scale is not None and scale_state is not None:
            try:
                self.loss_scale.load_state_dict(scale_state)
            except ValueError as e:
                if old_sched is not None:
                    self.scheduler.load_state_dict(old_sched)
                raise _fail(tj, str(e)) from None
        try:
            out = load_checkpoint(d, self.model, self.optimizer)
        except BaseException:
            if old_sched is not None:
                self.scheduler.load_state_dict(old_sched)
            raise
        self.step = out["step"]
        self.history = list(extra.get("history") or [])
        return self.step

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, callback: Callback | None = None) -> list[dict[str, Any]]:
        """Runs from the current step to ``steps``; returns the history: one record per step
        ``{"step", "loss", "lr", "tokens_per_s", "time"}`` (plus ``"eval_loss"`` on eval
        steps), including records restored by :meth:`resume`.

        ``callback(event)`` is called with ``{"kind": "step", **record}`` after every step,
        ``{"kind": "eval", "step", "eval_loss"}``, ``{"kind": "checkpoint", "step", "path"}``
        and finally ``{"kind": "done", "step", "history"}``; a callback returning False
        stops the run after the current step (a checkpoint is written if out_dir is set).

        Raises FloatingPointError when the loss becomes NaN or infinite."""
        user = callback if callback is not None else (lambda e: None)
        log = _ProgressLog(self.steps, self.step, self.log_every)

        def emit(event: dict[str, Any]) -> Any:
            log(event)
            return user(event)

        tokens = self.batch_size * self.seq_len  # over all ranks
        par = self.parallel
        stop = False
        while self.step < self.steps and not stop:
            t0 = time.perf_counter()
            loss = self.train_step(self.step)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"the loss became {loss} at step {self.step + 1}")
            self.step += 1
            rec: dict[str, Any] = {
                "step": self.step,
                "loss": loss,
                "lr": self._lr(),
                "tokens_per_s": tokens / dt if dt > 0 else float("inf"),
                "time": dt,
            }
            if par is not None:
                rec["exchange_s"] = float(par.last_exchange_s)
            if self.loss_scale is not None:
                rec["loss_scale"] = float(self.loss_scale.scale_value)
                if self.last_skipped:
                    rec["skipped"] = True
            self.history.append(rec)
            stop = emit({"kind": "step", **rec}) is False
            if par is not None:
                stop = par.any(stop)
            last = self.step == self.steps or stop
            if self.eval_data is not None and (
                (self.eval_every and self.step % self.eval_every == 0) or last
            ):
                rec["eval_loss"] = self.evaluate()
                emit({"kind": "eval", "step": self.step, "eval_loss": rec["eval_loss"]})
            if self.out_dir is not None and (
                (self.checkpoint_every and self.step % self.checkpoint_every == 0) or last
            ):
                path = self.save()
                if par is not None:
                    par.barrier()  # no rank goes on (or exits) before rank 0 has written it
                emit({"kind": "checkpoint", "step": self.step, "path": str(path)})
        emit({"kind": "done", "step": self.step, "history": self.history})
        return self.history
