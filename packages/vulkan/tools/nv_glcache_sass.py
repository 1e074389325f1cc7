"""Disassembles the shaders NVIDIA's Vulkan driver compiled, from its shader disk cache.

    python nv_glcache_sass.py [--nvdisasm PATH] [--arch SM90] CACHE OUTDIR

CACHE is the driver's cache directory (``~/.cache/nvidia/GLCache``, or a tarball of it) or one
of its ``.bin`` files. Each entry of a ``.bin`` file is a zstd frame (decompressed with the
``zstd`` program); an entry that holds a compiled shader starts with ``NVDA`` and a table of
sections, one of type 1 holding the machine code (offsets counted from byte 8). Each such
section goes to OUTDIR/entryN.sass through ``nvdisasm -b ARCH`` (raw instruction mode; the
``nvidia-cuda-nvdisasm`` wheel has one). The layout was read off driver 580 on an H200 (the
code sizes match the "Binary Size" statistic of VK_KHR_pipeline_executable_properties, see
tools/coopmat_probe.cpp); it is not documented, so this is a developer's tool (issue 18).
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def cache_files(cache: Path, scratch: Path) -> list[Path]:
    if cache.is_file() and cache.suffix != ".bin":  # a tarball of the cache directory
        with tarfile.open(cache) as t:
            t.extractall(scratch, filter="data")
        cache = scratch
    return [cache] if cache.is_file() else sorted(cache.rglob("*.bin"))


def entries(blob: bytes) -> list[bytes]:
    """The decompressed zstd frames of one cache file."""
    out, at = [], blob.find(ZSTD_MAGIC)
    while at >= 0:
        nxt = blob.find(ZSTD_MAGIC, at + 4)
        p = subprocess.run(["zstd", "-d", "-c"], input=blob[at:], capture_output=True)
        if p.stdout:  # zstd decodes the first frame and complains about what follows
            out.append(p.stdout)
        at = nxt
    return out


def code_section(entry: bytes) -> bytes | None:
    """The machine code of a compiled-shader entry: the section table's type 1 entry."""
    if not entry.startswith(b"NVDA"):
        return None
    for i in range(0x20, min(len(entry), 0x400) - 12, 4):
        kind, size, off = struct.unpack_from("<III", entry, i)
        if kind == 1 and size and size % 16 == 0 and off + 8 + size <= len(entry):
            return entry[off + 8 : off + 8 + size]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    ap.add_argument("--arch", default="SM90")
    args = ap.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    n = 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in cache_files(args.cache, Path(tmp)):
            for entry in entries(f.read_bytes()):
                code = code_section(entry)
                if code is None:
                    continue
                raw = Path(tmp) / "code.bin"
                raw.write_bytes(code)
                p = subprocess.run(
                    [args.nvdisasm, "-b", args.arch, str(raw)], capture_output=True, text=True
                )
                out = args.outdir / f"entry{n}.sass"
                out.write_text(p.stdout + p.stderr)
                hmma = p.stdout.count("HMMA")
                print(f"{out}: {len(code)} bytes of code, {hmma} HMMA")
                n += 1
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
