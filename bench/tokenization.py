"""Tokenizing a text corpus: recurra's path (text file -> cached memory-mapped token file)
against the tokenizers library's own batch encoding of the same text.

    python bench/tokenization.py [--mb 100] [--vocab 50000] [--tokenizer path/tokenizer.json]

Without --tokenizer a GPT-NeoX-style byte-level BPE (ByteLevel pre-tokenizer, vocabulary
--vocab) is trained with the tokenizers library on a sample of the synthetic text (no real
tokenizer.json can be downloaded here). The text is --mb MB of synthetic English-like lines
(Zipf-distributed words, punctuation, digits, some non-ASCII).

- ours: ``recurra_models.tokenize_files([file], tokenizer, fresh_cache_dir)``: reads the
  file, hashes it (the cache key), batch-encodes chunks of lines, writes uint16 ids to the
  cache file and maps it (everything a training run does before its first step);
- tokenizers: ``Tokenizer.encode_batch`` over the same chunks of lines, the text already
  in memory and split (only the encoding is timed; the ids are not even collected); and
  ``encode_batch_fast`` (no offsets: what ours calls), for reference.

The target is ours >= 0.8x of tokenizers' speed. Both use every core (Rayon).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def synthetic_text(path: Path, mb: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = np.array(
        [
            12.7,
            9.1,
            8.2,
            7.5,
            7.0,
            6.7,
            6.3,
            6.1,
            6.0,
            4.3,
            4.0,
            2.8,
            2.8,
            2.4,
            2.4,
            2.2,
            2.0,
            2.0,
            1.9,
            1.5,
            1.0,
            0.8,
            0.2,
            0.2,
            0.1,
            0.1,
        ]
    )
    freq /= freq.sum()
    words = [
        "".join(rng.choice(letters, size=int(rng.integers(1, 11)), p=freq)) for _ in range(30000)
    ]
    words += ["naïve", "café", "über", "日本語", "🙂", "—", "1999", "3.14", "e-mail", "Hello"]
    words = np.array(words, dtype=object)
    # a pool of distinct lines (about 10 MB), written in a new random order each round
    lines: list[str] = []
    idx = np.minimum(rng.zipf(1.15, size=1_600_000) - 1, len(words) - 1)
    toks = words[idx]
    ends = rng.choice(np.array(list(".,!?;")), size=100_000)
    start = 0
    for n, end in zip(rng.integers(4, 40, size=100_000), ends):
        if start + n > toks.size:
            break
        line = " ".join(toks[start : start + n])
        lines.append(line[:1].upper() + line[1:] + end + "\n")
        start += n
    pool = np.array(lines, dtype=object)
    target, written = int(mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            block = "".join(pool[rng.permutation(pool.size)])
            f.write(block)
            written += len(block.encode("utf-8"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="MB of synthetic text")
    ap.add_argument("--vocab", type=int, default=50000, help="BPE vocabulary when training one")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json to use")
    ap.add_argument("--reps", type=int, default=1, help="timed runs of each side (best kept)")
    args = ap.parse_args()

    import tokenizers

    import recurra_models as rm
    from recurra_models.textdata import CHUNK_BYTES, _chunks

    work = Path(tempfile.mkdtemp(prefix="recurra-bench-tok-"))
    try:
        text_file = work / "corpus.txt"
        t0 = time.perf_counter()
        synthetic_text(text_file, args.mb)
        size = text_file.stat().st_size
        print(f"corpus: {size / 1e6:.1f} MB of synthetic text ({time.perf_counter() - t0:.1f} s)")
        if args.tokenizer is not None:
            tok_dir = args.tokenizer.parent if args.tokenizer.is_file() else args.tokenizer
        else:
            with open(text_file, encoding="utf-8") as f:
                sample = list(itertools.islice(f, 50_000))
            t0 = time.perf_counter()
            tok_dir = work / "tok"
            rm.train_byte_bpe(sample, args.vocab, tok_dir)
            print(f"trained a byte-level BPE on a sample ({time.perf_counter() - t0:.1f} s)")
        tok = rm.load_tokenizer(tok_dir)
        print(
            f"tokenizer: vocab {tok.vocab_size}, tokenizers {tokenizers.__version__}, "
            f"{os.cpu_count()} cores (RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS')})"
        )
        chunks = [t.splitlines(keepends=True) for t, _ in _chunks(text_file, CHUNK_BYTES)]
        ref = tokenizers.Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))

        fast = getattr(ref, "encode_batch_fast", None)  # no offsets (tokenizers >= 0.20)
        best_ref = best_ours = best_fast = float("inf")
        n_tokens = 0
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for lines in chunks:
                ref.encode_batch(lines, add_special_tokens=False)
            best_ref = min(best_ref, time.perf_counter() - t0)
            if fast is not None:
                t0 = time.perf_counter()
                for lines in chunks:
                    fast(lines, add_special_tokens=False)
                best_fast = min(best_fast, time.perf_counter() - t0)
            cache = work / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            t0 = time.perf_counter()
            ids = rm.tokenize_files([text_file], tok, cache)
            best_ours = min(best_ours, time.perf_counter() - t0)
            n_tokens = int(ids.size)
            del ids
        mbps = size / 1e6
        print(f"tokens: {n_tokens:,} ({size / n_tokens:.2f} bytes per token)")
        print(f"tokenizers encode_batch : {best_ref:7.2f} s  {mbps / best_ref:6.2f} MB/s")
        if fast is not None:
            print(f"tokenizers ..._fast     : {best_fast:7.2f} s  {mbps / best_fast:6.2f} MB/s")
        print(f"recurra file -> memmap  : {best_ours:7.2f} s  {mbps / best_ours:6.2f} MB/s")
        print(f"ratio (ours / tokenizers speed): {best_ref / best_ours:.2f}x  (target >= 0.8x)")
        if fast is not None:
            print(
                f"ratio (ours / encode_batch_fast, which skips offsets as ours does): "
                f"{best_fast / best_ours:.2f}x"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
