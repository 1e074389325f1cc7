"""Rewrites a SPIR-V module's 16-bit float type to bfloat16 (SPV_KHR_bfloat16).

Usage: python spirv_bf16.py IN.spv OUT.spv

For shaders that only move 16-bit values and multiply them in cooperative matrices
(shaders/matmul_coopmat.comp): compilers that lack GL_EXT_bfloat16 (glslang before 15.3)
compile the f16 shader, and this gives the bf16 one. Every ``OpTypeFloat 16`` becomes
``OpTypeFloat 16 BFloat16KHR``; ``OpCapability Float16`` becomes the capabilities
BFloat16TypeKHR and BFloat16CooperativeMatrixKHR, and ``OpExtension "SPV_KHR_bfloat16"`` is
added. The module must hold no f16 arithmetic, constants or conversions (bf16 allows none of
them): the rewrite refuses a module whose f16 type any instruction other than cooperative
matrix types uses, so a shader edited to compute in f16 fails the build here instead of on
a driver.
"""

from __future__ import annotations

import struct
import sys

MAGIC = 0x07230203
OP_EXTENSION = 10
OP_CAPABILITY = 17
OP_TYPE_FLOAT = 22
OP_TYPE_VECTOR = 23
OP_TYPE_ARRAY = 28
OP_TYPE_RUNTIME_ARRAY = 29
OP_TYPE_STRUCT = 30
OP_TYPE_POINTER = 32
OP_TYPE_FUNCTION = 33
# Instructions whose first operand is a literal or names a target (not a result type): the
# check for f16 results skips them. The rest either have a result type there or an id that
# cannot be the f16 type (a pointer, a label, a scope constant).
NO_RESULT_TYPE = {2, 3, 4, 5, 6, 7, 10, 14, 15, 17, 71, 72, 330, OP_TYPE_FLOAT}
CAP_FLOAT16 = 9
CAP_BFLOAT16_TYPE = 5116
CAP_BFLOAT16_COOPERATIVE_MATRIX = 5118
FP_ENCODING_BFLOAT16 = 0


def _instructions(words: list[int]) -> list[list[int]]:
    out, i = [], 5
    while i < len(words):
        n = words[i] >> 16
        if n == 0 or i + n > len(words):
            raise ValueError(f"malformed SPIR-V: instruction at word {i} has length {n}")
        out.append(words[i : i + n])
        i += n
    return out


def _string_words(s: str) -> list[int]:
    b = s.encode() + b"\0"
    b += b"\0" * (-len(b) % 4)
    return list(struct.unpack(f"<{len(b) // 4}I", b))


def to_bf16(spirv: bytes) -> bytes:
    """The module with its 16-bit float type as bfloat16 (see the module docstring)."""
    if len(spirv) % 4 or len(spirv) < 20:
        raise ValueError("not a SPIR-V module: size is not a multiple of 4 bytes past the header")
    words = list(struct.unpack(f"<{len(spirv) // 4}I", spirv))
    if words[0] != MAGIC:
        raise ValueError("not a little-endian SPIR-V module (bad magic number)")
    insts = _instructions(words)
    f16 = {
        ins[1]
        for ins in insts
        if ins[0] & 0xFFFF == OP_TYPE_FLOAT and len(ins) == 3 and ins[2] == 16
    }
    if len(f16) != 1:
        raise ValueError(f"expected one 16-bit float type, found {len(f16)}")
    (f16_id,) = f16
    for ins in insts:
        op = ins[0] & 0xFFFF
        used = (
            (op not in NO_RESULT_TYPE and len(ins) > 1 and ins[1] == f16_id)  # an f16 result
            or (op in (OP_TYPE_VECTOR, OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY) and ins[2] == f16_id)
            or (op in (OP_TYPE_STRUCT, OP_TYPE_FUNCTION) and f16_id in ins[2:])
            or (op == OP_TYPE_POINTER and ins[3] == f16_id)
        )
        if used:
            raise ValueError(
                f"opcode {op} uses the f16 type %{f16_id}: only cooperative matrices may"
            )
    if not any(ins[0] & 0xFFFF == OP_CAPABILITY and ins[1] == CAP_FLOAT16 for ins in insts):
        raise ValueError("the module declares no Float16 capability")
    ext = _string_words("SPV_KHR_bfloat16")
    caps: list[list[int]] = []
    rest: list[list[int]] = [
        [((1 + len(ext)) << 16) | OP_EXTENSION, *ext]
    ]  # after every OpCapability
    for ins in insts:
        op = ins[0] & 0xFFFF
        if op == OP_CAPABILITY and ins[1] == CAP_FLOAT16:
            caps += [[(2 << 16) | OP_CAPABILITY, CAP_BFLOAT16_TYPE]]
            caps += [[(2 << 16) | OP_CAPABILITY, CAP_BFLOAT16_COOPERATIVE_MATRIX]]
        elif op == OP_CAPABILITY:
            caps.append(ins)
        elif op == OP_TYPE_FLOAT and ins[1] == f16_id:
            rest.append([(4 << 16) | OP_TYPE_FLOAT, f16_id, 16, FP_ENCODING_BFLOAT16])
        else:
            rest.append(ins)
    flat = words[:5] + [w for ins in caps + rest for w in ins]
    return struct.pack(f"<{len(flat)}I", *flat)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[1], "rb") as f:
        data = f.read()
    try:
        out = to_bf16(data)
    except ValueError as e:
        print(f"spirv_bf16.py: {argv[1]}: {e}", file=sys.stderr)
        return 1
    with open(argv[2], "wb") as f:
        f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
