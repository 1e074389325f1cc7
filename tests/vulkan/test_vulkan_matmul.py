"""Every matmul shader variant of the Vulkan backend (chosen per dispatch by the environment
variable RECURRA_VK_MATMUL, see packages/vulkan/csrc/ops/matmul.cpp) against float64 numpy.

Each variant runs the four load paths of its shader (specialization constants: operand k-
or row-contiguous, vec4 or scalar loads, vec4 or scalar stores of C): dense and aligned,
transposed and aligned, odd sizes (1, 3, 17, 130: edge tiles, K shorter than a K step,
sliced operands with general strides), odd sizes transposed through out_prod, with batch
axes broadcast both ways. Metric: normalized mean squared error against float64 <= 1e-10
(fp32 accumulation over K <= 130 stays near 1e-13).

The SPIR-V of the register-blocked variants (matmul_reg.comp) must keep every register
array out of Function storage (local memory on NVIDIA): checked on the built modules.

Without a Vulkan device these tests fail in the Vulkan session unless
RECURRA_SKIP_VULKAN=1 (tests/conftest.py). Pipelines are compiled by lavapipe on first use
(a few seconds per variant when its cache is cold).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

recurra_vulkan = pytest.importorskip("recurra_vulkan")

pytestmark = pytest.mark.vulkan

ENV = "RECURRA_VK_MATMUL"
VARIANTS = ["legacy", "r128k8", "r128", "r128x64", "r64", "auto"]
REG_MODULES = ["matmul_r128k8", "matmul_r128", "matmul_r128x64", "matmul_r64"]
NMSE_MAX = 1e-10
VK_DIR = Path(__file__).resolve().parents[2] / "packages" / "vulkan"


def randn(*shape: int, seed: int = 0) -> np.ndarray:
    """Returns float32 standard normal samples of `shape`."""
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Returns sum((got - want)^2) / sum(want^2) in float64."""
    want64 = want.astype(np.float64)
    den = float(np.sum(want64 * want64))
    num = float(np.sum((got.astype(np.float64) - want64) ** 2))
    return num / den if den > 0 else num


def run(op: str, a: np.ndarray, b: np.ndarray, src_offset: int = 0) -> None:
    """Runs matmul (a @ b) or out_prod (a^T @ b) on the device (numpy strides kept) and
    asserts it matches float64 numpy; raises AssertionError otherwise."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = a64 @ b64 if op == "matmul" else np.swapaxes(a64, -1, -2) @ b64
    got = recurra_vulkan.run_node(op, [a, b], [], [], want.shape, "float32", src_offset)
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    err = nmse(got, want)
    assert err <= NMSE_MAX, f"{op} {a.shape} {b.shape}: nmse {err:.3e}"


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Selects the matmul variant for the test (the backend reads it at every dispatch)."""
    monkeypatch.setenv(ENV, request.param)
    return request.param


def test_dense_aligned_batched(variant: str) -> None:
    # vec4 loads of A (k-contiguous) and B (n-contiguous), vec4 stores; M = 130 leaves a
    # partial row tile, K = 36 a partial K step; batch axes broadcast from both sides.
    run("matmul", randn(3, 1, 130, 36), randn(4, 36, 68))
    run("matmul", randn(130, 36), randn(2, 36, 68, seed=1))


def test_transposed_aligned(variant: str) -> None:
    # A m-contiguous and B k-contiguous, both vec4 (the x @ W^T and a^T @ g layouts).
    a = randn(2, 20, 132).transpose(0, 2, 1)
    b = randn(68, 20).T
    run("matmul", a, b)
    run("matmul", randn(20, 132, seed=3).T, randn(2, 68, 20, seed=2).transpose(0, 2, 1))


def test_odd_sizes(variant: str) -> None:
    # Scalar loads and stores: sizes 1, 3, 17, 130, K below and above one K step, general
    # strides (every other column), a misaligned buffer.
    run("matmul", randn(17, 3), randn(3, 130))
    run("matmul", randn(1, 17), randn(17, 3))
    run("matmul", randn(130, 34)[:, ::2], randn(17, 130))
    run("matmul", randn(2, 1, 17, 3), randn(3, 3, 130), src_offset=4)


def test_odd_sizes_transposed(variant: str) -> None:
    # out_prod reads a (k, m) as A(m, k) with m contiguous; B k-contiguous (a transposed
    # view); N = 1 and N = 130, batched with broadcast.
    run("out_prod", randn(17, 3), randn(1, 17).T)
    run("out_prod", randn(2, 17, 3), randn(130, 17).T)
    run("out_prod", randn(130, 17), randn(3, 3, 130).transpose(0, 2, 1))


def test_auto_large_enough_for_big_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # 264 batch matrices: auto picks the 128x128 variant, legacy matmul_128.
    for name in ("auto", "legacy"):
        monkeypatch.setenv(ENV, name)
        run("matmul", randn(264, 9, 8), randn(8, 12))


def test_unknown_variant_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "no-such-variant")
    with pytest.raises(ValueError, match="no-such-variant"):
        recurra_vulkan.run_node("matmul", [randn(3, 4), randn(4, 5)], [], [], (3, 5), "float32")
    monkeypatch.setenv(ENV, "")
    run("matmul", randn(3, 4), randn(4, 5))


# ---- SPIR-V of the register-blocked variants ---------------------------------------------

OP_VARIABLE, OP_LOOP_MERGE, STORAGE_FUNCTION = 59, 246, 7


def spirv_counts(words: bytes) -> tuple[int, int]:
    """Returns (Function-storage variables, loops) of a SPIR-V module; raises ValueError when
    the bytes are not SPIR-V."""
    n = len(words) // 4
    w = struct.unpack(f"<{n}I", words[: 4 * n])
    if n < 5 or w[0] != 0x07230203:
        raise ValueError("not a little-endian SPIR-V module")
    i, fvars, loops = 5, 0, 0
    while i < n:
        count, op = w[i] >> 16, w[i] & 0xFFFF
        if count == 0:
            raise ValueError("corrupt SPIR-V: zero-length instruction")
        if op == OP_VARIABLE and w[i + 3] == STORAGE_FUNCTION:
            fvars += 1
        loops += op == OP_LOOP_MERGE
        i += count
    return fvars, loops


def module_spirv(name: str, tmp_path: Path) -> bytes:
    """Returns the SPIR-V of shader variant `name`: the module the build embedded when the
    build directory is next to the extension (editable installs), else compiled here with
    glslc and the flags of packages/vulkan/meson.build; skips when neither is possible."""
    built = Path(recurra_vulkan._vk.__file__).parent / f"{name}.spv"
    if built.is_file():
        return built.read_bytes()
    meson = VK_DIR / "meson.build"
    glslc = shutil.which("glslc")
    if glslc is None or not meson.is_file():
        pytest.skip("no built SPIR-V next to the extension, and no glslc/meson.build to build it")
    m = re.search(rf"\['{name}', '([^']+)', \[([^\]]*)\]\]", meson.read_text())
    assert m, f"{name} is not in meson.build's shader_variants"
    flags = re.findall(r"'([^']+)'", m.group(2))
    out = tmp_path / f"{name}.spv"
    shaders = VK_DIR / "shaders"
    subprocess.run(
        [
            glslc,
            "--target-env=vulkan1.2",
            "-O",
            "-I",
            str(shaders),
            *flags,
            str(shaders / m.group(1)),
            "-o",
            str(out),
        ],
        check=True,
    )
    return out.read_bytes()


@pytest.mark.parametrize("name", REG_MODULES)
def test_register_arrays_stay_in_registers(name: str, tmp_path: Path) -> None:
    fvars, loops = spirv_counts(module_spirv(name, tmp_path))
    assert fvars == 0, f"{name}: {fvars} Function-storage arrays (spilled to local memory)"
    assert loops == 1, f"{name}: {loops} loops left; only the K loop should remain"


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["weight_t", "dense", "general"])
def test_skinny_products_take_gemv(m: int, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1-4 rows (a token's step) run on gemv.comp under the default variant: x @ W.T of a
    # weight W (N, K) (k-contiguous), a dense (K, N) operand, and sliced general strides;
    # odd K and N, a broadcast batch axis, K shorter and longer than a column's 32 lanes.
    monkeypatch.delenv(ENV, raising=False)
    for k, n in ((1, 5), (17, 130), (130, 17), (768, 300)):
        a = randn(3, m, k, seed=m)
        if layout == "weight_t":
            b = randn(n, k, seed=2).T
        elif layout == "dense":
            b = randn(k, n, seed=3)
        else:
            b = randn(2 * k, 3 * n, seed=4)[::2, ::3]
        run("matmul", a, b)
        run("matmul", a[0], b)


@pytest.mark.parametrize(
    "op, m, k, n",
    [
        ("matmul", 33, 4099, 70),  # 1 tile, K not a multiple of 4: 16 slices + the rest
        ("matmul", 130, 1030, 3),  # 4 slices of 256 + a rest of 6, scalar C stores
        ("out_prod", 40, 2048, 64),  # a^T @ b: A read m-contiguous, slices 8 x 256
    ],
)
def test_split_k_for_few_tiles_and_long_k(
    op: str, m: int, k: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Few C tiles and a long K (weight gradients, a chunked LM head's input gradient) run as
    # slices of K written to scratch and summed in order: results as float64 numpy's, also
    # with a transposed operand, and the dispatches show the slices and the sum.
    monkeypatch.delenv(ENV, raising=False)
    a = randn(k, m, seed=1) if op == "out_prod" else randn(m, k, seed=1)
    b = randn(k, n, seed=2)
    run(op, a, b)
    run(op, a, randn(n, k, seed=3).T)  # B k-contiguous (x @ W.T)
    labels = [
        lbl
        for lbl, _ in recurra_vulkan._vk.profile_dispatches(
            op, [a, b], out_shape=(m, n), iters=1, warmup=0
        )
    ]
    assert sum("matmul_r128k8" in lbl for lbl in labels) >= 1, labels
    assert sum("sum_slices" in lbl for lbl in labels) == 1, labels
    # a forced variant keeps one dispatch (no split)
    monkeypatch.setenv(ENV, "r64")
    run(op, a, b)
    forced = recurra_vulkan._vk.profile_dispatches(op, [a, b], out_shape=(m, n), iters=1, warmup=0)
    assert [lbl for lbl, _ in forced if "sum_slices" in lbl] == []
