"""CPU generation against llama.cpp: the 130M Mamba / Mamba-2 presets, f32 weights, 2 threads.

    python bench/llamacpp.py --models /work/llama/models \\
        --convert /work/llama/src/convert_hf_to_gguf.py \\
        --llama-bench /work/llama/build/bin/llama-bench \\
        --llama-lib /work/llama/build/bin --llama-py /work/llama/src-py

For each preset (mamba-130m, mamba2-130m) it

1. writes a Hugging Face checkpoint ``MODELS/<preset>-hf`` (transformers' MambaForCausalLM /
   Mamba2ForCausalLM holding recurra_models.create(preset, seed=0)'s weights, safetensors)
   unless one is there, and converts it with llama.cpp's ``convert_hf_to_gguf.py --outtype
   f32`` into ``MODELS/<preset>-f32.gguf`` (``--convert``; gguf-py is taken from the folder
   of the converter);
2. times ours: the checkpoint loaded by ``recurra_models.load_pretrained`` and run on the
   CPU in float32 by ``recurra_models.generate`` (what ``recurra generate`` runs): prefill of
   --prefill (512) tokens, and ms per new token = (time of n+1 tokens - time of 1 token) / n
   with n = --gen-tokens (128), greedy;
3. times llama.cpp on the GGUF: ``llama-bench -t 2 -p 512 -n 128`` (--llama-bench), and/or
   through llama-cpp-python's ctypes binding over the same libllama (--llama-py: a folder
   holding the ``llama_cpp`` package, --llama-lib: the folder of libllama.so), which also
   checks that both libraries agree: logits of a prompt and the greedy tokens after it;
4. times transformers' eager generation of the same checkpoint (--peer-tokens new tokens,
   same difference of two runs; 0 skips it).

Every side runs in a subprocess of its own, one after another, each with --threads threads;
figures are medians of --reps runs after a warm-up. Ratios: theirs / ours (above 1: we are
faster). The load average is printed before and after each side (the machine is shared):
compare figures taken at a low load only. llama.cpp's threads meet at a barrier after every
graph node, so on a busy machine a descheduled thread can stall each node (seen: 1.5 s/token
at a load of 10 on 2 cores, the likely cause), while recurra's pool hands tasks out
dynamically and the calling thread goes on alone.

Building llama.cpp (a Release build with GGML_NATIVE, CPU only; the llama-cpp-python sdist
vendors the sources under vendor/llama.cpp, and its llama_cpp folder is the binding):

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    ninja -C build llama llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import run_worker

HERE = Path(__file__).resolve().parent
PRESETS = ["mamba-130m", "mamba2-130m"]
HOWTO = __doc__.split("Building llama.cpp")[1].rstrip()


def _timed(fn: Any, reps: int) -> list[float]:
    """ms of reps runs of fn after one untimed run."""
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return runs


def per_token(full: list[float], one: list[float], n: int) -> float:
    """ms per new token: the median of n+1 tokens' runs less the median of 1 token's, / n."""
    return (statistics.median(full) - statistics.median(one)) / n


def time_generation(gen: Any, big: Any, short: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Prefill and per-token figures of gen(prompt, k) (a function that generates k tokens
    after prompt): the prefill of ``big`` (one token), n+1 and 1 tokens after ``short``."""
    n, reps = spec["gen_tokens"], spec["reps"]
    prefill = _timed(gen(big, 1), reps)
    full = _timed(gen(short, n + 1), reps)
    one = _timed(gen(short, 1), reps)
    return {
        "prefill_ms": statistics.median(prefill),
        "gen_ms": per_token(full, one, n),
        "runs": len(full),
    }


def prompt_ids(spec: dict[str, Any], length: int) -> np.ndarray:
    """The prompt: token ids below 50k (text in the GPT-NeoX vocabulary), seeded."""
    return np.random.default_rng(spec["seed"]).integers(0, 50000, length).astype(np.int32)


# ------------------------------------------------------------------------------------------
# preparing the weights: a HF checkpoint of our seeded preset, and its f32 GGUF
# ------------------------------------------------------------------------------------------


def write_checkpoint(preset: str, folder: Path) -> None:
    """MODELS/<preset>-hf: transformers' model holding create(preset, seed=0)'s weights."""
    import recurra_models as rm

    sys.path.insert(0, str(HERE))
    from models import make_torch

    ours = rm.create(preset, seed=0)
    peer = make_torch(type(ours).arch, ours)
    peer.save_pretrained(str(folder), safe_serialization=True)


def convert(hf: Path, gguf: Path, converter: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(converter.parent / "gguf-py"), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, str(converter), str(hf), "--outtype", "f32", "--outfile", str(gguf)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0 or not gguf.is_file():
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{tail}")


# ------------------------------------------------------------------------------------------
# the sides, each in a subprocess: print one RESULT line
# ------------------------------------------------------------------------------------------


def side_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import recurra as rc
    import recurra_models as rm

    rc.set_num_threads(spec["threads"])
    model = rm.load_pretrained(spec["hf"])
    short = prompt_ids(spec, spec["check_prompt"])

    def gen(prompt: np.ndarray, k: int) -> Any:
        return lambda: rm.generate(model, prompt, max_tokens=k, temperature=0.0)

    out = time_generation(gen, prompt_ids(spec, spec["prefill"]), short, spec)
    out["tokens"] = rm.generate(model, short, max_tokens=spec["check_tokens"], temperature=0.0)
    with rc.no_grad():
        out["logits"] = model(rc.tensor(short[None, :])).numpy()[0].tolist()
    return out


def side_peer(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    sys.path.insert(0, str(HERE))
    from models import torch_greedy

    torch.set_num_threads(spec["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32)
    model.eval()
    arch = spec["arch"]
    n = spec["peer_tokens"]
    short = torch.from_numpy(prompt_ids(spec, spec["check_prompt"]).astype(np.int64))[None]
    full = _timed(lambda: torch_greedy(arch, model, short, n + 1), spec["reps"])
    one = _timed(lambda: torch_greedy(arch, model, short, 1), spec["reps"])
    tokens = torch_greedy(arch, model, short, spec["check_tokens"])
    return {"gen_ms": per_token(full, one, n), "runs": len(full), "tokens": tokens}


def _binding(spec: dict[str, Any]) -> Any:
    os.environ["LLAMA_CPP_LIB_PATH"] = spec["llama_lib"]
    sys.path.insert(0, spec["llama_py"])
    import llama_cpp

    return llama_cpp


def side_llama_py(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp through llama-cpp-python's binding: timing and the agreement check."""
    llama_cpp = _binding(spec)
    t = spec["threads"]
    kw = dict(n_threads=t, n_threads_batch=t, n_batch=spec["prefill"], verbose=False)
    lm = llama_cpp.Llama(spec["gguf"], n_ctx=2048, logits_all=True, **kw)
    short = [int(i) for i in prompt_ids(spec, spec["check_prompt"])]
    lm.reset()
    lm.eval(short)
    logits = np.array(lm.scores[: len(short)], np.float32)
    tokens = []
    for _ in range(spec["check_tokens"]):
        tok = int(np.argmax(lm.scores[lm.n_tokens - 1]))
        tokens.append(tok)
        lm.eval([tok])
    del lm
    # Timing: logits of the last token only (a prefill would otherwise run the LM head on
    # every prompt token), read from llama.cpp's buffer (scores is filled only with logits_all).
    lm = llama_cpp.Llama(spec["gguf"], n_ctx=2048, logits_all=False, **kw)
    n_vocab = lm.n_vocab()

    def last() -> int:
        ptr = llama_cpp.llama_get_logits_ith(lm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    def gen(prompt: list[int], k: int) -> Any:
        def run() -> None:
            lm.reset()
            lm.eval(prompt)
            for _ in range(k - 1):
                lm.eval([last()])

        return run

    big = [int(i) for i in prompt_ids(spec, spec["prefill"])]
    out = time_generation(gen, big, short, spec)
    out.update(tokens=tokens, logits=logits.tolist(), version=llama_cpp.__version__)
    return out


def side_llama_bench(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's own llama-bench: pp<prefill> and tg<gen_tokens>, -r reps."""
    cmd = [spec["llama_bench"], "-m", spec["gguf"], "-t", str(spec["threads"])]
    cmd += ["-p", str(spec["prefill"]), "-n", str(spec["gen_tokens"])]
    cmd += ["-r", str(spec["reps"]), "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    out: dict[str, Any] = {"cmd": " ".join(cmd)}
    for test in json.loads(p.stdout):
        ms = statistics.median(test["samples_ns"]) / 1e6
        if test["n_gen"] > 0:
            out["gen_ms"] = ms / test["n_gen"]
            out["runs"] = len(test["samples_ns"])
        else:
            out["prefill_ms"] = ms
        out["build"] = f"{test.get('build_commit', '?')} ({test.get('cpu_info', '')})"
    return out


SIDES = {
    "ours": side_ours,
    "llama-bench": side_llama_bench,
    "llama-py": side_llama_py,
    "transformers": side_peer,
}


def worker(spec: dict[str, Any]) -> None:
    try:
        res = SIDES[spec["side"]](spec)
    except Exception as exc:  # noqa: BLE001 - a failed side is reported, not fatal
        res = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    print("RESULT " + json.dumps(res), flush=True)


def run_side(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    load0 = os.getloadavg()[0]
    t0 = time.time()
    res = run_worker(__file__, spec, timeout)
    res["load"] = (load0, os.getloadavg()[0])
    res["seconds"] = time.time() - t0
    return res


# ------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------


def agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How two sides' prompt logits and greedy tokens compare."""
    parts = []
    if a.get("logits") is not None and b.get("logits") is not None:
        la, lb = np.asarray(a["logits"]), np.asarray(b["logits"])
        n = min(la.shape[-1], lb.shape[-1])  # a GGUF vocabulary may be padded further
        la, lb = la[..., :n], lb[..., :n]
        rel = float(np.abs(la - lb).max() / max(np.abs(lb).max(), 1e-30))
        same_arg = float((la.argmax(-1) == lb.argmax(-1)).mean())
        parts.append(f"prompt logits max|diff|/max|logit| {rel:.1e}, argmax agree {same_arg:.0%}")
    ta, tb = a.get("tokens"), b.get("tokens")
    if ta is not None and tb is not None:
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        same = "same" if ta == tb else f"first {k} of {len(ta)} same"
        parts.append(f"greedy tokens: {same}")
    return "; ".join(parts) or "-"


def report(preset: str, res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    print(f"\n== {preset}, CPU, float32")
    row: dict[str, Any] = {"preset": preset}
    for name, r in res.items():
        if "error" in r:
            print(f"  {name:13s} error: {r['error']}")
            row[name] = {"error": r["error"]}
            continue
        line = f"  {name:13s} generate {r['gen_ms']:7.2f} ms/token"
        if r.get("prefill_ms") is not None:
            line += f"   prefill {r['prefill_ms']:8.1f} ms"
        line += f"   ({r.get('runs')} runs, load {r['load'][0]:.1f} -> {r['load'][1]:.1f})"
        print(line)
        row[name] = {k: r.get(k) for k in ("gen_ms", "prefill_ms", "load", "build", "cmd")}
    ours = res.get("ours", {})
    for name, r in res.items():
        if name == "ours" or "error" in r or "error" in ours or not ours:
            continue
        ratio = r["gen_ms"] / ours["gen_ms"]
        line = f"  {name}/ours: generate {ratio:.2f}x"
        row[f"{name}_gen_ratio"] = ratio
        if r.get("prefill_ms") and ours.get("prefill_ms"):
            pr = r["prefill_ms"] / ours["prefill_ms"]
            line += f", prefill {pr:.2f}x"
            row[f"{name}_prefill_ratio"] = pr
        if r.get("tokens") is not None:
            line += f"; {agreement(ours, r)}"
        print(line)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="/work/llama/models", help="checkpoints and GGUFs")
    ap.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py (makes the GGUFs)")
    ap.add_argument("--llama-bench", help="the llama-bench binary")
    ap.add_argument("--llama-lib", help="the folder holding libllama.so (for --llama-py)")
    ap.add_argument("--llama-py", help="a folder holding llama-cpp-python's llama_cpp package")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--sides", default="ours,llama-bench,llama-py,transformers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--peer-tokens", type=int, default=32, help="transformers' new tokens")
    ap.add_argument("--check-prompt", type=int, default=16)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="of the prompts")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per side")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        ap.error(f"unknown sides {sorted(unknown)}; known: {sorted(SIDES)}")
    if "llama-bench" in sides and not (args.llama_bench and Path(args.llama_bench).is_file()):
        print(f"no llama-bench binary (--llama-bench {args.llama_bench}): side skipped")
        sides.remove("llama-bench")
    if "llama-py" in sides and not (args.llama_py and args.llama_lib):
        print("no --llama-py / --llama-lib: the binding side (and the check) skipped")
        sides.remove("llama-py")
    if {"llama-bench", "llama-py"}.isdisjoint(sides):
        print("llama.cpp is not measured; to build it:" + HOWTO)
    base = {k: getattr(args, k) for k in ("threads", "reps", "prefill", "gen_tokens", "seed")}
    base.update(
        peer_tokens=args.peer_tokens,
        check_prompt=args.check_prompt,
        check_tokens=args.check_tokens,
        llama_bench=args.llama_bench,
        llama_lib=args.llama_lib,
        llama_py=args.llama_py,
    )
    print(f"bench/llamacpp.py: {base}; load average {os.getloadavg()}")
    rows = []
    for preset in [p for p in args.presets.split(",") if p]:
        hf, gguf = models / f"{preset}-hf", models / f"{preset}-f32.gguf"
        if not (hf / "config.json").is_file():
            write_checkpoint(preset, hf)
        if not gguf.is_file():
            if not args.convert:
                raise SystemExit(f"{gguf} is absent: pass --convert convert_hf_to_gguf.py")
            convert(hf, gguf, Path(args.convert))
        arch = json.loads((hf / "config.json").read_text())["model_type"]
        res = {}
        for side in sides:
            spec = dict(base, side=side, hf=str(hf), gguf=str(gguf), arch=arch)
            res[side] = run_side(spec, args.timeout)
            print(f"  [{preset} {side}: {res[side]['seconds']:.0f} s]", flush=True)
        rows.append(report(preset, res))
    print("JSON " + json.dumps({"config": base, "rows": rows}))


if __name__ == "__main__":
    main()
