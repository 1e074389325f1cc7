"""Data-parallel training throughput: tokens/s of 1 rank vs N ranks (recurra_dist over MPI),
the same per-rank batch (weak scaling), and the time of the gradient exchange per step.

    python bench/dist.py --nproc 2                            # CPU, a tiny Mamba-2
    python bench/dist.py --nproc 2 --device vulkan --model mamba2-130m --batch 8 --seq-len 512
    python bench/dist.py --nproc 2 --device vulkan --model mamba2-130m --batch 8 --seq-len 512 \
        --steps 5 --overlap on      # one GPU: both ranks share it; --overlap off for the other

The N-rank run is made twice: with the exchange overlapped with the backward (each bucket
starts as soon as its gradients are final) and after it (--overlap on/off: one of them).
Per step it reports the exchange's exposed time (what the step waits for: the packing and
MPI calls inside the backward plus the wait after it), its span (first bucket packed to
the last one written back; without overlap the same as exposed) and, once, the exchange
alone (after a backward, every rank ready, no overlap).

Each run is `mpiexec -n K python bench/dist.py --worker ...`: every rank builds the model on
its device (`--device vulkan`: vulkan:<local rank % GPUs>), trains --warmup untimed steps,
then --steps timed ones (AdamW, the Trainer's step: forward, backward, gradient averaging,
update); rank 0 reports the median step time and exchange time. Prints one line per run,
the ratio N-rank / 1-rank tokens/s (the target on two GPUs: >= 1.8) and `JSON {...}`.
On the CPU, --threads is per rank (default 1), so N ranks use N times the cores of one.

Where the exchange's time goes (one N-rank run, no training):

    python bench/dist.py --nproc 2 --device vulkan --model mamba2-130m --batch 8 --seq-len 512 \
        --exchange-only      # per bucket: download, allreduce alone, upload (ms and GB/s)

after one backward: per bucket, the gradients to the host buffer (on a device: one packed
download), the MPI sum alone (every rank ready) and the mean back into the gradients (that
bucket alone), then the totals, the upload of every bucket at once (what a step does) and
the whole exchange (sync_gradients) as the step runs it.

The MPI sum alone, without a model (CPU only; --mb of float32 cut into buckets):

    python bench/dist.py --nproc 2 --allreduce --mb 516 --bucket-mb 4,25,100
    python bench/dist.py --nproc 2 --allreduce --cvar MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring

compares, per bucket size, MPI_Allreduce in place (DataParallel's collective="blocking"),
MPI_Allreduce into another buffer, MPI_Iallreduce in place (collective="nonblocking") and
the pairwise sum (collective="pairwise", what the default "auto" takes for buckets of 1 MiB
and more) by messages adding in one thread and in DataParallel's add_threads, by messages
in pieces of 16 MiB (piece_mb), and through MPI's shared memory (shared_memory, the default
on one host): "shared" sums buffers that lie in a shared window (DataParallel's host
buffers), "shared/copy" buffers of their own (host-visible device memory: the parts the
other ranks add are copied into the window first);
each --cvar NAME=VALUE adds a run with that MPICH setting.
--collective picks DataParallel's for the training and --exchange-only runs.
On a GPU machine, `bash bench/h200.sh build bench-dist` runs the three (the mpich wheel's
mpiexec and libmpi set up: MPI4PY_LIBMPI).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the parallel run")
    ap.add_argument("--device", default="cpu", help="cpu or vulkan (one GPU per rank)")
    ap.add_argument("--model", default="mamba2", help="an architecture or a preset")
    ap.add_argument(
        "--config",
        default="",
        help="model fields as JSON (default for an architecture: a small model for the CPU)",
    )
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument(
        "--bucket-mb",
        default="25",
        help="bucket size in MB (--allreduce: a comma-separated list)",
    )
    ap.add_argument(
        "--collective",
        choices=["auto", "blocking", "nonblocking"],
        default="auto",
        help="DataParallel's collective: MPI_Allreduce, MPI_Iallreduce, or by bucket size",
    )
    ap.add_argument(
        "--exchange-thread",
        choices=["on", "off"],
        default="on",
        help="DataParallel's exchange_thread: sum the buckets in a thread of their own",
    )
    ap.add_argument(
        "--staging",
        choices=["on", "off"],
        default="on",
        help="on a device: buckets in host-visible device memory (on) or in MPI's shared "
        "window (off: downloaded into it through a staging copy)",
    )
    ap.add_argument(
        "--add-threads",
        type=int,
        default=0,
        help="DataParallel's add_threads (0: its default)",
    )
    ap.add_argument(
        "--download-pieces",
        choices=["on", "off"],
        default="on",
        help="DataParallel's download_pieces: a device bucket summed in pieces is downloaded "
        "in pieces, each summed while the next one downloads",
    )
    ap.add_argument(
        "--import-host",
        choices=["on", "off"],
        default="on",
        help="with --staging on, where the ranks share a host: the device imports the buckets' "
        "places in MPI's shared window (on; its copies land there) or they are host-visible "
        "device memory copied into the window for the sum (off)",
    )
    ap.add_argument(
        "--exchange-only",
        action="store_true",
        help="time the exchange phase by phase and bucket by bucket (no training)",
    )
    ap.add_argument(
        "--allreduce", action="store_true", help="time MPI's sum alone (no model, no device)"
    )
    ap.add_argument("--mb", type=float, default=516.0, help="--allreduce: megabytes of float32")
    ap.add_argument(
        "--cvar",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="--allreduce: one more run with this MPICH setting (repeatable)",
    )
    ap.add_argument(
        "--overlap",
        choices=["both", "on", "off"],
        default="both",
        help="exchange during the backward, after it, or both runs",
    )
    ap.add_argument("--timeout", type=float, default=580.0, help="seconds per mpiexec run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.nproc < 1 or args.batch < 1 or args.steps < 1:
        ap.error("--nproc, --batch and --steps must be >= 1")
    try:
        sizes = [float(v) for v in str(args.bucket_mb).split(",")]
    except ValueError:
        ap.error(f"--bucket-mb takes numbers, not {args.bucket_mb!r}")
    if not sizes or min(sizes) <= 0 or (len(sizes) > 1 and not args.allreduce):
        ap.error("--bucket-mb: one size > 0 (a list only with --allreduce)")
    args.bucket_sizes = sizes
    for c in args.cvar:
        if "=" not in c:
            ap.error(f"--cvar takes NAME=VALUE, not {c!r}")
    return args


def _config(args: argparse.Namespace) -> dict:
    if args.config:
        return json.loads(args.config)
    import recurra_models as rm

    if args.model in rm.presets():
        return {}
    return {"d_model": 64, "n_layer": 2, "vocab_size": 256}


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import recurra as rc
    import recurra_dist
    import recurra_models as rm
    import recurra_optim

    ctx = recurra_dist.init()
    rc.set_num_threads(args.threads)
    dev = ctx.device(args.device)
    model = rm.create(args.model, seed=0, **_config(args))
    model.to(dev)
    opt = recurra_optim.AdamW(list(model.parameters()), lr=1e-4, weight_decay=0.01)
    overlap = args.overlap == "on"
    from recurra_dist._buckets import Bucket

    Bucket.stage = args.staging == "on"
    Bucket.import_host = args.import_host == "on"
    dp = recurra_dist.DataParallel(
        model,
        opt,
        ctx,
        bucket_mb=args.bucket_sizes[0],
        overlap=overlap,
        collective=args.collective,
        exchange_thread=args.exchange_thread == "on",
        add_threads=args.add_threads or None,
    )
    dp.download_pieces = args.download_pieces == "on"
    vocab = int(model.config.vocab_size)
    data = np.random.default_rng(0).integers(0, vocab, size=1 << 20).astype(np.int32)
    global_batch = args.batch * ctx.world_size
    if args.exchange_only:
        exchange_worker(args, ctx, model, dp, data, global_batch)
        return
    trainer = rm.Trainer(
        model,
        opt,
        data,
        batch_size=global_batch,
        seq_len=args.seq_len,
        steps=args.warmup + args.steps,
        log_every=0,
        checkpoint_every=0,
        parallel=dp,
    )
    times, exchange, span = [], [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            rc.reset_transfer_stats()
        dp.barrier()  # every rank starts the step together
        t0 = time.perf_counter()
        trainer.train_step(step)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
            exchange.append(dp.last_exchange_s)
            span.append(dp.last_span_s)
    moved = rc.transfer_stats()
    # the exchange alone (all ranks ready: no waiting for a slower one), on one backward's
    # gradients
    x, y = rm.batch_at(data, global_batch, args.seq_len, 0, 0)
    dp.overlap = False
    model.loss(x[dp.shard(global_batch)], y[dp.shard(global_batch)]).backward()
    alone = []
    for _ in range(max(3, args.steps)):
        dp.barrier()
        t0 = time.perf_counter()
        dp.sync_gradients()
        alone.append(time.perf_counter() - t0)
    alone = [max(v) for v in zip(*ctx.comm.allgather(alone))]
    # the slowest rank sets the pace
    times = [max(v) for v in zip(*ctx.comm.allgather(times))]
    exchange = [max(v) for v in zip(*ctx.comm.allgather(exchange))]
    span = [max(v) for v in zip(*ctx.comm.allgather(span))]
    if ctx.rank == 0:
        step_s = statistics.median(times)
        out = {
            "ranks": ctx.world_size,
            "device": dev,
            "parameters": int(sum(int(p.size) for p in model.parameters())),
            "batch_per_rank": args.batch,
            "seq_len": args.seq_len,
            "step_s": step_s,
            "overlap": overlap and ctx.world_size > 1,
            "overlapped_steps": dp.overlapped,
            "exchange_s": statistics.median(exchange),
            "exchange_span_s": statistics.median(span),
            "exchange_alone_s": statistics.median(alone) if ctx.world_size > 1 else 0.0,
            "exchange_mb": dp.last_bytes / 1e6,
            "tokens_per_s": global_batch * args.seq_len / step_s,
            # host <-> device copies per step on rank 0 (the batch, the loss, the gradients)
            "uploads_per_step": moved["host_to_device"]["count"] / args.steps,
            "downloads_per_step": moved["device_to_host"]["count"] / args.steps,
            "download_mb_per_step": moved["device_to_host"]["bytes"] / args.steps / 1e6,
        }
        print("RESULT " + json.dumps(out), flush=True)


def exchange_worker(args, ctx, model, dp, data, global_batch: int) -> None:
    """--exchange-only: the phases of the exchange after one backward, per bucket."""
    import recurra_models as rm

    x, y = rm.batch_at(data, global_batch, args.seq_len, 0, 0)
    shard = dp.shard(global_batch)
    dp.overlap = False
    runs = []
    for _ in range(max(2, args.steps)):  # the first run pays for first-time allocations
        model.loss(x[shard], y[shard]).backward()
        runs.append(dp.profile_exchange())
        dp.zero_grad()
    whole = []
    for _ in range(max(2, args.steps)):
        model.loss(x[shard], y[shard]).backward()
        dp.barrier()
        t0 = time.perf_counter()
        dp.sync_gradients()
        whole.append(time.perf_counter() - t0)
        dp.zero_grad()
    keys = ("download_s", "allreduce_s", "upload_s")
    rows = []
    for k in range(len(runs[0])):  # per bucket: the median over runs, the slowest rank's
        row = dict(runs[0][k])
        for key in keys:
            mine = statistics.median(r[k][key] for r in runs[1:])
            row[key] = max(ctx.comm.allgather(mine))
        rows.append(row)
    tail = statistics.median(r[-1]["tail_s"] for r in runs[1:])
    rows[-1]["tail_s"] = max(ctx.comm.allgather(tail))
    whole_s = statistics.median([max(v) for v in zip(*ctx.comm.allgather(whole))])
    if ctx.rank != 0:
        return

    def cell(nbytes: float, sec: float) -> str:
        return f"{1e3 * sec:8.2f} ms {nbytes / max(sec, 1e-12) / 1e9:6.2f} GB/s"

    print(
        f"exchange of {rows[-1]['bytes'] / 1e6:.1f} MB on {ctx.world_size} ranks, {args.device}, "
        f"collective {args.collective}, buckets of {args.bucket_sizes[0]:g} MB "
        f"(median of {len(runs) - 1} runs, slowest rank)"
    )
    print(f"  {'bucket':>6} {'MB':>7}   {'download':>20}   {'allreduce':>20}   {'upload':>20}")
    for r in rows:
        name = "total" if r["bucket"] < 0 else str(r["bucket"])
        print(
            f"  {name:>6} {r['bytes'] / 1e6:7.1f}   {cell(r['bytes'], r['download_s'])}   "
            f"{cell(r['bytes'], r['allreduce_s'])}   {cell(r['bytes'], r['upload_s'])}"
        )
    print(
        "  (total upload: every bucket at once, as a step does; the whole exchange as a step "
        f"runs it after the backward, sync_gradients: {1e3 * whole_s:.1f} ms)"
    )
    last = rows[-2]
    sh = dp.shared
    print(
        f"  pairwise sums through shared memory: {sh.in_place} in place, {sh.copied} copied "
        f"in (host-visible device memory), the others by messages; "
        f"{sum(b.imported for b in dp.buckets)} of {len(dp.buckets)} buckets imported by the "
        "device"
    )
    print(
        f"  the last bucket ({last['bytes'] / 1e6:.1f} MB) downloaded, summed and written back "
        f"as a step does (pieces of {dp.stream_mb:g} MB; with overlap what stays exposed "
        f"after the backward): {1e3 * rows[-1]['tail_s']:.1f} ms"
    )
    print("RESULT " + json.dumps({"buckets": rows, "sync_gradients_s": whole_s}), flush=True)


def allreduce_worker(args: argparse.Namespace) -> None:
    """--allreduce: MPI's sum of --mb of float32, per bucket size and way."""
    import numpy as np
    from mpi4py import MPI

    from recurra_dist._exchange import pairwise_sum
    from recurra_dist._shared import SharedSums

    comm = MPI.COMM_WORLD
    n = int(args.mb * 1e6) // 4
    buf = np.full(n, comm.rank + 1, np.float32)
    out = np.empty_like(buf)
    scratch = np.empty(n, np.float32)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    threads = max(1, min(4, (os.cpu_count() or 1) // local - 1))  # DataParallel's add_threads
    pool = None
    if threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(threads)
    shared = SharedSums(comm)
    inwin = shared.allocate(n)  # where DataParallel keeps the buckets of the host
    inwin.fill(comm.rank + 1)
    ways = [
        "allreduce in place",
        "allreduce out of place",
        "iallreduce in place",
        "pairwise 1 thread",
        "shared 1 thread",
        "shared/copy 1 thread",
    ]
    if pool is not None:
        ways += [f"pairwise {threads} threads", f"pieces {threads} threads"]
        ways += [f"shared {threads} threads", f"shared/copy {threads} threads"]
    res = []
    for bmb in args.bucket_sizes:
        be = max(1, int(bmb * (1 << 20)) // 4)
        cuts = [(a, min(n, a + be)) for a in range(0, n, be)]
        for way in ways:
            times = []
            for _ in range(max(2, args.steps) + 1):
                comm.Barrier()
                t0 = time.perf_counter()
                if way == "allreduce in place":
                    for a, b in cuts:
                        comm.Allreduce(MPI.IN_PLACE, buf[a:b], op=MPI.SUM)
                elif way == "allreduce out of place":
                    for a, b in cuts:
                        comm.Allreduce(buf[a:b], out[a:b], op=MPI.SUM)
                elif way.split()[0] in ("pairwise", "pieces", "shared", "shared/copy"):
                    # DataParallel's collective="pairwise": messages (whole buckets or in
                    # pieces of 16 MiB, piece_mb), or through shared memory, the buffer in
                    # the window (DataParallel's host buffers) or copied in (host-visible
                    # device memory)
                    piece = (16 << 20) // 4 if way.startswith("pieces") else 0
                    src = inwin if way.startswith("shared ") else buf
                    for a, b in cuts:
                        pairwise_sum(
                            comm,
                            src[a:b],
                            MPI.Request.Waitall,
                            lambda k: scratch[:k],
                            pool if "1 thread" not in way else None,
                            threads,
                            piece,
                            shared if way.startswith("shared") else None,
                        )
                else:
                    reqs = [comm.Iallreduce(MPI.IN_PLACE, buf[a:b], op=MPI.SUM) for a, b in cuts]
                    MPI.Request.Waitall(reqs)
                times.append(time.perf_counter() - t0)
                total = comm.size * (comm.size + 1) / 2
                res_buf = out if way == "allreduce out of place" else buf
                res_buf = inwin if way.startswith("shared ") else res_buf
                assert res_buf[0] == total and res_buf[-1] == total, (way, res_buf[0])
                buf.fill(comm.rank + 1)  # the same values every time (no overflow)
                inwin.fill(comm.rank + 1)
            sec = max(comm.allgather(statistics.median(times[1:])))
            if way.startswith("shared") and not shared.usable:
                way += " (ranks on several hosts: messages)"
            res.append({"bucket_mb": bmb, "way": way, "s": sec, "gb_s": 4 * n / sec / 1e9})
    if comm.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    exe = str(beside) if beside.is_file() else shutil.which("mpiexec")
    if exe is None:
        sys.exit("bench/dist.py: no mpiexec (pip install recurra-dist, which brings mpich)")
    return exe


def _run(args: argparse.Namespace, n: int, argv: list[str], extra_env: dict | None = None) -> Any:
    cmd = [_mpiexec(), "-n", str(n), sys.executable, str(HERE), "--worker", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **(extra_env or {}))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        sys.exit(f"bench/dist.py: {n} ranks took more than {args.timeout} s")
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
        if args.exchange_only:  # its table
            print(line)
    sys.exit(f"bench/dist.py: {n} ranks failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag VALUE`` and ``flag=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def allreduce_main(args: argparse.Namespace, argv: list[str], load: float) -> None:
    print(
        f"MPI sum of {args.mb:g} MB float32 on {args.nproc} ranks, load {load:.1f} "
        f"(median of {max(2, args.steps)} runs, slowest rank)"
    )
    argv = _without(argv, "--cvar")
    out = []
    for cvar in [""] + args.cvar:
        env = dict([cvar.split("=", 1)]) if cvar else {}
        for r in _run(args, args.nproc, argv, env):
            r["cvar"] = cvar
            out.append(r)
            print(
                f"  {cvar or 'defaults':<44} bucket {r['bucket_mb']:6g} MB  {r['way']:<24} "
                f"{1e3 * r['s']:9.1f} ms {r['gb_s']:6.2f} GB/s"
            )
    print("JSON " + json.dumps({"allreduce": out, "load": load}))


def main() -> None:
    args = _args()
    if args.worker:
        if args.allreduce:
            allreduce_worker(args)
        else:
            worker(args)
        return
    argv = [a for a in sys.argv[1:] if a != "--worker"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if args.allreduce:
        allreduce_main(args, argv, load)
        return
    if args.exchange_only:
        print(f"recurra_dist exchange: {args.model} on {args.device}, load {load:.1f}")
        res = _run(args, args.nproc, _without(argv, "--overlap"))
        print("JSON " + json.dumps({**res, "load": load}))
        return
    print(
        f"recurra_dist: {args.model} on {args.device}, {args.batch} x {args.seq_len} tokens per "
        f"rank, {args.steps} timed steps, {args.threads} thread(s) per rank, load {load:.1f}"
    )
    argv = _without(argv, "--overlap")  # each run gets its own
    modes = ["off", "on"] if args.overlap == "both" else [args.overlap]
    runs = [(1, "off")] + ([(args.nproc, m) for m in modes] if args.nproc > 1 else [])
    results = []
    for n, mode in runs:
        res = _run(args, n, [*argv, f"--overlap={mode}"])
        results.append(res)
        step_ms, ex_ms = 1e3 * res["step_s"], 1e3 * res["exchange_s"]
        how = "overlapped" if res["overlap"] else "after    " if n > 1 else "         "
        print(
            f"  {n} rank(s) {how}: {res['tokens_per_s']:10.0f} tokens/s   step {step_ms:8.1f} "
            f"ms   exchange exposed {ex_ms:7.1f} ms ({100 * ex_ms / step_ms:.0f}% of the "
            f"step), span {1e3 * res['exchange_span_s']:.1f} ms, alone "
            f"{1e3 * res['exchange_alone_s']:.1f} ms ({res['exchange_mb']:.1f} MB)"
        )
    ratio = results[-1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"  {args.nproc} ranks / 1 rank: {ratio:.2f}x tokens/s (ideal {args.nproc}.00x)")
    for res in results[1:] if args.device != "cpu" else []:
        # With one GPU for all ranks, it computes N steps of one rank, so what the N-rank
        # step takes beyond that is the exchange's exposed time plus the cost of sharing the
        # GPU (the "exposed" timer above counts the waits for the device inside the backward
        # too, which sharing lengthens). With a GPU per rank, compare with the 1-rank step.
        extra = 1e3 * (res["step_s"] - res["ranks"] * results[0]["step_s"])
        how = "overlapped" if res["overlap"] else "after"
        print(
            f"  {how}: step - {res['ranks']} x 1-rank step = {extra:.1f} ms (where the ranks "
            "share one GPU: the exposed exchange plus the cost of sharing it)"
        )
    print("JSON " + json.dumps({"runs": results, "ratio": ratio, "load": load}))


if __name__ == "__main__":
    main()
