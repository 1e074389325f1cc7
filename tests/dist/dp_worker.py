"""Training runs for the recurra_dist tests: imported by the tests (the one-process
reference) and run under ``mpiexec`` (the data-parallel runs).

    mpiexec -n 2 python dp_worker.py equal OUT.npz [vulkan]   # every case with and without
                                                             # overlap ("CASE" / "CASE/late"),
                                                             # sgd with MPI_Allreduce too
    mpiexec -n 2 python dp_worker.py fail {raise,exit,kill,sysexit,hang} OUT_DIR
    mpiexec -n 3 python dp_worker.py train OUT_DIR STEPS [--resume]
    mpiexec -n 2 python dp_worker.py exchange [vulkan]  # argument checks, profile_exchange()
    mpiexec -n 3 python dp_worker.py sums  # pairwise_sum: pieces, shared memory, threads

Rank 0 writes the losses and final weights of every case to the .npz file, with whether the
ranks ended bit-identical.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import numpy as np

BATCH, SEQ, STEPS, SEED = 6, 8, 4, 0  # 6 rows: divisible by 1, 2 and 3 ranks

# name -> (optimizer, keyword arguments)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.05, "momentum": 0.9}),
    "sgd_clip_accum": ("SGD", {"lr": 0.05, "max_grad_norm": 0.05, "accumulate_steps": 2}),
    "adamw_clip": ("AdamW", {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 0.05}),
    "adamw_accum": ("AdamW", {"lr": 3e-3, "weight_decay": 0.01, "accumulate_steps": 2}),
}


#: DataParallel settings that cut buckets into pieces: summed and written back in pieces of
#: 262 elements, each by messages in pieces of 131, not through shared memory
PIECES = {"stream_mb": 0.001, "piece_mb": 0.0005, "shared_memory": False}


def tokens() -> np.ndarray:
    rng = np.random.default_rng(1234)
    # a learnable pattern with noise: the loss falls within a few steps
    base = np.tile(np.arange(32, dtype=np.int32), 40)
    noise = rng.integers(0, 64, size=base.size).astype(np.int32)
    return np.where(rng.random(base.size) < 0.2, noise, base).astype(np.int32)


def make(case: str, device: str = "cpu") -> tuple[Any, Any]:
    import recurra_models as rm
    import recurra_optim

    model = rm.create("mamba", seed=SEED, vocab_size=64, d_model=16, n_layer=1, d_state=4)
    model.to(device)
    name, kw = CASES[case]
    return model, getattr(recurra_optim, name)(list(model.parameters()), **kw)


def run(
    case: str,
    parallel: bool,
    steps: int = STEPS,
    out_dir: str | None = None,
    resume: bool = False,
    callback: Any = None,
    timeout: float | None = 600.0,
    device: str = "cpu",
    overlap: bool = True,
    capture: bool = True,
    collective: str = "auto",
    exchange_thread: bool = True,
    settings: dict[str, Any] | None = None,
) -> tuple[list[float], dict[str, np.ndarray], bool]:
    """Trains ``case`` on ``device`` (``capture``: the Trainer's captured steps); returns
    (losses, final weights, ranks bit-identical).
    With ``parallel``, the weights get the entries ``"@overlapped"``: how many exchanges began
    during the backward, and ``"@threaded"``: whether the buckets were summed in the
    exchange thread. ``settings``: DataParallel attributes to set (stream_mb, ...)."""
    import recurra_models as rm

    model, opt = make(case, device)
    dp = None
    if parallel:
        import recurra_dist

        if recurra_dist.init().rank != 0:  # other weights elsewhere: rank 0's must win
            for p in model.parameters():
                p.assign_(p.numpy() + 1.0)
        dp = recurra_dist.DataParallel(
            model,
            opt,
            bucket_mb=0.01,
            timeout=timeout,
            overlap=overlap,
            collective=collective,
            exchange_thread=exchange_thread,
        )
        for name, value in (settings or {}).items():
            setattr(dp, name, value)
    trainer = rm.Trainer(
        model,
        opt,
        tokens(),
        batch_size=BATCH,
        seq_len=SEQ,
        steps=steps,
        seed=SEED,
        out_dir=out_dir,
        checkpoint_every=1 if out_dir else 0,
        log_every=0,
        parallel=dp,
        capture=capture,
    )
    if resume:
        trainer.resume()
    hist = trainer.fit(callback)
    same = dp.consistent() if dp is not None else True
    weights = model.state_dict()
    if dp is not None:
        weights["@overlapped"] = np.asarray(dp.overlapped)
        weights["@threaded"] = np.asarray(dp.exchange_thread)
        weights["@streamed"] = np.asarray(dp.streamed)
        if steps and dp.world_size > 1:  # the last step exchanged: its timers make sense
            assert dp.last_span_s >= dp.last_exchange_s > 0, (dp.last_span_s, dp.last_exchange_s)
    return [float(r["loss"]) for r in hist], weights, same


def _save(path: str, results: dict[str, tuple[list[float], dict[str, np.ndarray], bool]]) -> None:
    flat: dict[str, np.ndarray] = {}
    for case, (losses, weights, same) in results.items():
        flat[f"{case}/losses"] = np.asarray(losses, np.float64)
        flat[f"{case}/consistent"] = np.asarray(same)
        for k, v in weights.items():
            flat[f"{case}/w/{k}"] = v
    np.savez(path, **flat)


def exchange_checks(ctx: Any, device: str) -> None:
    """DataParallel's argument checks, and profile_exchange(): per bucket and in total,
    leaving the mean of the ranks' gradients (float32 sum of the gathered gradients times
    1/N, an independent reference) bitwise as sync_gradients() does."""
    import recurra_dist

    model, opt = make("sgd", device)
    for bad in ("allgather", ""):
        try:
            recurra_dist.DataParallel(model, opt, collective=bad)
        except ValueError as e:
            assert "collective" in str(e), e
        else:
            raise AssertionError(f"collective={bad!r} was taken")
    try:
        recurra_dist.DataParallel(model, opt, add_threads=0)
    except ValueError as e:
        assert "add_threads" in str(e), e
    else:
        raise AssertionError("add_threads=0 was taken")
    for collective in ("auto", "pairwise", "pairwise/messages", "pairwise/copied"):
        profile_checks(ctx, model, opt, collective)
    if ctx.rank == 0:
        print("EXCHANGE OK", flush=True)


def profile_checks(ctx: Any, model: Any, opt: Any, collective: str) -> None:
    """profile_exchange() and sync_gradients() leave the float32 mean of the gathered
    gradients (summed in rank order), bitwise: with any number of ranks for "pairwise",
    which adds in that order, with 2 for MPI's sums."""
    import recurra_dist
    import recurra_models as rm

    from recurra_dist._buckets import Bucket

    how, _, way = collective.partition("/")
    messages = way == "messages"
    # "copied": a device's buckets in host-visible memory, not imported (copied into the
    # window for the sums)
    Bucket.import_host = way != "copied"
    try:
        dp = recurra_dist.DataParallel(model, opt, bucket_mb=0.01, overlap=False, collective=how)
    finally:
        Bucket.import_host = True
    assert dp.shared_memory  # the ranks share this host
    if messages:  # pipelined messages, buckets in pieces (the last ones shorter)
        for name, value in PIECES.items():
            setattr(dp, name, value)
    try:
        dp.profile_exchange()
    except ValueError as e:
        assert "no gradient" in str(e), e
    else:
        raise AssertionError("profile_exchange without gradients ran")
    x, y = rm.batch_at(tokens(), BATCH, SEQ, 0, 0)
    rows = dp.shard(BATCH)
    n = ctx.world_size
    mine = []
    for _ in range(2):
        model.loss(x[rows], y[rows]).backward()
        mine.append([np.array(p.grad.numpy(), np.float32) for p in dp.params])
        if len(mine) == 1:
            prof = dp.profile_exchange()
            got = [p.grad.numpy().copy() for p in dp.params]
        else:
            dp.sync_gradients()
            again = [p.grad.numpy().copy() for p in dp.params]
        dp.zero_grad()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(mine[0], mine[1]))  # same backward
    everyone = ctx.comm.allgather(mine[0])
    for i, g in enumerate(got):
        total = everyone[0][i].copy()
        for r in range(1, n):
            total = total + everyone[r][i]  # float32, rank order (MPICH's order for 2 ranks)
        ref = total * np.float32(1.0 / n)
        if n == 2 or how == "pairwise":
            assert g.tobytes() == ref.tobytes(), i
        else:
            np.testing.assert_allclose(g, ref, rtol=1e-6, atol=1e-7)
        assert g.tobytes() == again[i].tobytes(), (i, collective)
    assert len(prof) == len(dp.buckets) + 1 and prof[-1]["bucket"] == -1
    assert prof[-1]["tail_s"] > 0
    assert prof[-1]["bytes"] == 4 * sum(int(p.size) for p in dp.params)
    for row in prof:
        assert row["download_s"] >= 0 and row["allreduce_s"] > 0 and row["upload_s"] > 0, row
    # the pairwise sums went through shared memory: in place in the window (host buffers),
    # or copied into it (host-visible device memory); the others are no pairwise sums
    sh = dp.shared
    if messages or how == "auto":
        assert sh.in_place == sh.copied == 0, (sh.in_place, sh.copied)
    elif ctx.world_size > 1:
        # buckets of a device that imports host memory live in the window: summed in place
        from recurra import _core

        dev = [b for b in dp.buckets if b.staged is not None]
        imports = bool(dev) and _core.can_import_host(dev[0].device) and way != "copied"
        assert all(b.imported == imports for b in dev), [b.imported for b in dev]
        staged = bool(dev) and not imports  # host-visible device memory, copied in
        assert (sh.in_place > 0, sh.copied > 0) == (not staged, staged), (sh.in_place, sh.copied)
    # without the windows (freed): messages, the same bits
    dp.close()
    assert not dp.shared_memory and not sh.usable
    counts = (sh.in_place, sh.copied)
    model.loss(x[rows], y[rows]).backward()
    dp.sync_gradients()
    for i, p in enumerate(dp.params):
        assert p.grad.numpy().tobytes() == again[i].tobytes(), (i, collective)
    dp.zero_grad()
    assert (sh.in_place, sh.copied) == counts


def sum_checks(ctx: Any) -> None:
    """pairwise_sum by messages (whole, or in pieces that mostly do not divide the buffer)
    and through MPI's shared memory: buffers in a window at the same place on every rank
    (summed there: cache chunks of the default size and of 1000 elements), at different
    places or outside it (copied in), and with the ranks on two "hosts" (every rank takes
    the messages); with and without threads. Each gives the float32 rank-order sum of the
    gathered values, bitwise."""
    from concurrent.futures import ThreadPoolExecutor

    from mpi4py import MPI

    from recurra_dist._exchange import pairwise_sum
    from recurra_dist._shared import SharedSums

    comm = ctx.comm
    me, n = comm.Get_rank(), comm.Get_size()
    kept = [np.empty(0, np.float32)]

    def scratch(k: int) -> np.ndarray:
        if kept[0].size < k:
            kept[0] = np.empty(k, np.float32)
        return kept[0]

    shared, small = SharedSums(comm), SharedSums(comm)
    small.CHUNK = 1000
    apart = SharedSums(comm, node=comm.Split(me % 2, me))  # odd and even ranks: two hosts
    assert shared.usable and small.usable and apart.usable == (n == 1)
    top = (1 << 20) + 3
    windows = {id(s): s.allocate(top + 5) for s in (shared, small, apart)}
    ways = [(None, 0), (None, 1), (None, 7), (None, 65_537), (shared, 0), (small, 0), (apart, 0)]
    expect = {id(s): [0, 0] for s in (shared, small, apart)}  # sums in place, copied in
    with ThreadPoolExecutor(3) as pool:
        for size in (0, 1, 5, 1000, 300_007, top):
            rng = np.random.default_rng(100 * size + me)
            mine = rng.standard_normal(size).astype(np.float32)
            mine *= np.float32(10.0) ** rng.integers(-3, 4, size).astype(np.float32)
            everyone = comm.allgather(mine)
            ref = everyone[0].copy()
            for v in everyone[1:]:
                ref = ref + v  # float32, rank order
            for d, piece in ways + [(None, size // 3 + 1)]:
                if piece and size // piece > 200:
                    continue
                # outside any window; in it at the same place; at another place on rank 0
                places = [("out", 0), ("same", 5), ("other", 5 - (me == 0))]
                for how, at in places if d is not None else places[:1]:
                    for p, threads in ((None, 1), (pool, 3)):
                        buf = mine.copy() if how == "out" else windows[id(d)][at : at + size]
                        buf[...] = mine
                        pairwise_sum(comm, buf, MPI.Request.Waitall, scratch, p, threads, piece, d)
                        assert buf.tobytes() == ref.tobytes(), (size, piece, threads, how)
                        if d is not None and d.usable and n > 1:  # (an empty one lies anywhere)
                            expect[id(d)][how == "out" or (how == "other" and size > 0)] += 1
    # which way each took: in place only where every rank's buffer lay at the same place
    for s in (shared, small, apart):
        assert [s.in_place, s.copied] == expect[id(s)], (s.in_place, s.copied, expect[id(s)])
    assert shared.in_place * shared.copied > 0 or n == 1
    if me == 0:
        print("SUMS OK", flush=True)


def small_shm_checks(ctx: Any) -> None:
    """With little room in the host's shared memory (the test mounts a 64 MB /dev/shm, as a
    container's), windows of 32 MB per rank are not allocated (touching their pages would kill
    the process with SIGBUS) and the sums go by messages, the same bits; a small one still
    fits and is summed in place."""
    from mpi4py import MPI

    from recurra_dist._exchange import pairwise_sum
    from recurra_dist._shared import SharedSums

    comm = ctx.comm
    me = comm.Get_rank()
    shared = SharedSums(comm)
    for size in (8 << 20, 1000):
        buf = shared.allocate(size)
        mine = np.random.default_rng(size + me).standard_normal(size).astype(np.float32)
        everyone = comm.allgather(mine)
        ref = everyone[0].copy()
        for v in everyone[1:]:
            ref = ref + v
        for b in (buf, mine.copy()):  # in its place, and outside any window (copied in)
            b[...] = mine
            pairwise_sum(
                comm, b, MPI.Request.Waitall, lambda k: np.empty(k, np.float32), None, 1, 0, shared
            )
            assert b.tobytes() == ref.tobytes(), size
    # the 8M buffer and the copy of it: messages; the 1000 in place and copied in
    assert (shared.in_place, shared.copied) == (1, 1), (shared.in_place, shared.copied)
    if me == 0:
        print("SMALL SHM OK", flush=True)


def main(argv: list[str]) -> None:
    import recurra_dist

    ctx = recurra_dist.init()
    mode = argv[0]
    if mode == "equal":  # [DEVICE]: vulkan puts rank r on vulkan:<local rank % GPUs>
        device = ctx.device(argv[2]) if len(argv) > 2 else "cpu"
        results = {case: run(case, True, device=device) for case in CASES}
        for case in CASES:
            results[f"{case}/late"] = run(case, True, device=device, overlap=False)
        # MPI_Allreduce instead of the MPI_Iallreduce "auto" takes for these small buckets
        # (another sum order on 3 ranks: not bitwise)
        results["sgd/blocking"] = run("sgd", True, device=device, collective="blocking")
        results["sgd/pairwise"] = run("sgd", True, device=device, collective="pairwise")
        # the same, each bucket of more than 524 elements summed and written back in pieces
        # of 262 (stream_mb), by messages in pieces of 131 (piece_mb), not read directly
        results["sgd/pairwise/pieces"] = run(
            "sgd", True, device=device, collective="pairwise", settings=PIECES
        )
        # the buckets summed in the caller's thread, with and without overlap
        for case in ("sgd", "sgd/late"):
            overlap = case == "sgd"
            res = run("sgd", True, device=device, overlap=overlap, exchange_thread=False)
            results[f"{case}/nothread"] = res
        if ctx.rank == 0:
            _save(argv[1], results)
    elif mode == "exchange":  # [DEVICE]
        exchange_checks(ctx, ctx.device(argv[1]) if len(argv) > 1 else "cpu")
    elif mode == "sums":
        sum_checks(ctx)
    elif mode == "small-shm":
        small_shm_checks(ctx)
    elif mode == "fail":
        how, out_dir = argv[1], argv[2]

        def die(ev: dict[str, Any]) -> None:
            if ev["kind"] == "step" and ev["step"] == 2 and ctx.rank == ctx.world_size - 1:
                if how == "raise":
                    raise RuntimeError(f"boom on rank {ctx.rank}")
                if how == "exit":
                    os._exit(3)
                if how == "sysexit":  # ends the job with status 4 (recurra_dist's exit hook)
                    sys.exit(4)
                if how == "hang":
                    time.sleep(600)
                os.kill(os.getpid(), signal.SIGKILL)

        run("adamw_clip", True, steps=6, out_dir=out_dir, callback=die, timeout=5.0)
    elif mode == "train":
        out_dir, steps = argv[1], int(argv[2])
        # backward() as written (the other modes run captured steps)
        resume = "--resume" in argv
        res = run("adamw_accum", True, steps=steps, out_dir=out_dir, resume=resume, capture=False)
        if ctx.rank == 0:
            _save(os.path.join(out_dir, f"result-{steps}.npz"), {"adamw_accum": res})
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
