"""The Vulkan backend against the CPU: every op with a Vulkan kernel, run as one node through
the backend's C table (``recurra_vulkan._vk.run_node``), compared with the same op computed
by the core on the CPU (``recurra.ops.apply``).

The per-op cases come from the op-case registry (recurra.opcases): each runs through the
core's scheduler on the device against the CPU and its float64 reference, and each case that
is one node runs on the kernel with dense, misaligned and strided sources. The tests below
the registry's are about layouts, ops and answers of the backend itself.

Metric: normalized mean squared error sum((vk - cpu)^2) / sum(cpu^2) <= 1e-7 (integer
results: exact). Odd sizes (1, 3, 17, 1000), broadcasting, strided sources (transposed,
sliced, broadcast numpy views keep their strides on the device) and misaligned buffers
(``src_offset``) exercise every shader variant.

Without a Vulkan device these tests fail in the Vulkan session unless
RECURRA_SKIP_VULKAN=1 (tests/conftest.py).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from vk_util import cpu

recurra_vulkan = pytest.importorskip("recurra_vulkan")
rc = pytest.importorskip("recurra")
cb = pytest.importorskip("recurra.check_backends")
opcases = pytest.importorskip("recurra.opcases")

pytestmark = pytest.mark.vulkan

NMSE_MAX = 1e-7
RNG = np.random.default_rng(20261129)


# ---- helpers ----------------------------------------------------------------------------


def vk(
    name: str,
    srcs: list[np.ndarray],
    ip=(),
    fp=(),
    *,
    out_shape,
    out_dtype="float32",
    src_offset: int = 0,
) -> np.ndarray:
    """The op on the Vulkan device (sources keep their numpy strides)."""
    return recurra_vulkan.run_node(
        name, srcs, list(ip), list(fp), tuple(out_shape), out_dtype, src_offset
    )


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    want64 = want.astype(np.float64)
    den = float(np.sum(want64 * want64))
    num = float(np.sum((got.astype(np.float64) - want64) ** 2))
    return num / den if den > 0 else num


def check(name: str, srcs: list[np.ndarray], ip=(), fp=(), *, src_offset: int = 0) -> np.ndarray:
    """Runs `name` on both backends and asserts they agree (check-backends' comparison: the
    same NaN and infinity positions, NMSE of the finite values); returns the Vulkan result."""
    want = cpu(name, srcs, ip, fp)
    dtype = "int32" if want.dtype == np.int32 else "float32"
    got = vk(name, srcs, ip, fp, out_shape=want.shape, out_dtype=dtype, src_offset=src_offset)
    assert got.shape == want.shape
    err = cb.compare(got, want)
    assert err <= NMSE_MAX, f"{name}: normalized MSE {err:.3g} > {NMSE_MAX} (inf: NaN/inf differ)"
    return got


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return np.asarray(RNG.standard_normal(shape) * scale, dtype=np.float32)


# ---- the op-case registry --------------------------------------------------------------
# Every case of recurra.opcases (the cases the CPU tests and check-backends run): through the
# core's scheduler on the Vulkan device against the CPU (forward, gradients, placement) and
# the float64 reference, and each case that is one node with a Vulkan kernel straight on the
# kernel with dense, misaligned and strided sources.

CASES = opcases.cases()


def _ids(cases):
    return [c.id for c in cases]


@pytest.fixture(scope="module")
def device() -> str:
    return cb.resolve_backends(["vulkan"])[0]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_case_on_vulkan_against_the_cpu(case, vulkan, device):
    r = cb.check_case(case, device)
    assert r.verdict in ("ok", "unsupported"), (r.message, r.placement)
    # A node may fall back to the CPU only where the backend has no kernel for its op.
    kernels = set(recurra_vulkan.op_names())
    assert not set(r.fallback_ops) & kernels, (r.fallback_ops, r.placement)


WITH_REF = [c for c in CASES if c.ref is not None]


@pytest.mark.parametrize("case", WITH_REF, ids=_ids(WITH_REF))
def test_case_on_vulkan_against_the_reference(case, vulkan):
    assert opcases.reference_errors(case, vulkan) == []
    if case.nan_grad:
        assert opcases.nan_grad_errors(case, vulkan) == []


# run_node holds float32/int32 tensors only: cast (whose other side is 2-byte) runs through
# the scheduler above and in test_vulkan_half_elementwise.py.
KERNEL_CASES = [
    c
    for c in CASES
    if c.node is not None and c.node.op in set(recurra_vulkan.op_names()) and c.node.op != "cast"
]


def _layout(a: np.ndarray, how: str) -> np.ndarray:
    """The same values in another memory layout (the reference does not change)."""
    if a.dtype != np.float32 or a.ndim == 0 or how == "dense":
        return a
    if how == "transposed" and a.ndim >= 2:
        return np.asfortranarray(a)  # every stride reversed
    wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1] + 1), a.dtype)
    wide[..., 1::2] = a  # a step of 2 along the last axis, not at offset 0
    return wide[..., 1::2]


# Kernels that take dense sources only: the backend may decline other layouts (the core makes
# them dense first), it never computes them wrong. Every other kernel takes any layout.
DENSE_ONLY = {"softmax", "log_softmax", "rms_norm", "layer_norm", "cross_entropy", "get_rows"}
DENSE_ONLY |= {"cumsum"}


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids(KERNEL_CASES))
def test_case_node_on_the_kernel(case, vulkan):
    """Dense, misaligned (offset 4), transposed and step-2 sources. The NaN rows and the
    large cases (past 32768 elements: the layouts do not depend on size) run dense only."""
    data = case.make_inputs()
    small = sum(a.size for a in data.values()) <= 1 << 15
    layouts = ["dense", "offset", "transposed", "step2"] if small and not case.nonfinite else []
    for layout in layouts or ["dense"]:
        srcs = [_layout(a, layout) for a in data.values()]
        offset = 4 if layout == "offset" else 0
        node = case.node
        relaid = offset or any(s is not a for s, a in zip(srcs, data.values()))
        try:
            check(node.op, srcs, ip=node.ip, fp=node.fp, src_offset=offset)
        except NotImplementedError as e:  # declined: only a dense-only kernel, new layout
            assert node.op in DENSE_ONLY and relaid and "dense" in str(e), (layout, e)


def test_op_names_are_in_the_spec():
    spec = rc.ops.spec()
    names = recurra_vulkan.op_names()
    assert names and set(names) <= set(spec)
    # every elementwise unary op of the spec has a Vulkan kernel (registered from the spec)
    assert {n for n, s in spec.items() if s.unary >= 0} <= set(names)


@pytest.mark.parametrize("name", ["neg", "sqr", "exp", "scale"])
def test_act_grad_refuses_an_op_without_act_grad(name):
    x = randn(8)
    with pytest.raises(NotImplementedError, match="act_grad"):
        vk("act_grad", [x, x, x], ip=(rc.ops.spec()[name].unary,), out_shape=(8,))


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
def test_binary_stride_zero_source(name):
    """A broadcast numpy view (stride 0) as a source: a layout no case's values can take."""
    e = np.broadcast_to(randn(1, 5), (4, 5))
    b = randn(4, 5)
    check(name, [e, np.where(np.abs(b) < 0.3, 0.7, b).astype(np.float32)])


# ---- data movement ----------------------------------------------------------------------


def test_contiguous():
    x = randn(5, 6, 7)
    check("contiguous", [x.transpose(2, 0, 1)])
    check("contiguous", [x[1:4, ::2, 3:]])
    check("contiguous", [x[:, :, 2]])
    check("contiguous", [np.broadcast_to(randn(1, 7), (3, 7))])
    check("contiguous", [randn(2, 3, 4, 5).transpose(3, 1, 0, 2)], src_offset=4)
    ints = RNG.integers(-100, 100, (4, 9)).astype(np.int32)
    check("contiguous", [ints.T])


@pytest.mark.parametrize("shape", [(1,), (3, 17), (1000,)], ids=str)
def test_fill(shape):
    want = cpu("fill", [], ip=shape, fp=(2.5, 0))
    np.testing.assert_array_equal(vk("fill", [], shape, (2.5, 0), out_shape=shape), want)
    want_i = cpu("fill", [], ip=shape, fp=(-7, 1))
    got_i = vk("fill", [], shape, (-7, 1), out_shape=shape, out_dtype="int32")
    np.testing.assert_array_equal(got_i, want_i)


def test_slice_grad():
    g = randn(3, 3)
    check("slice_grad", [g], ip=(7, 9, 1, 6, 2, 0, 9, 3))
    check("slice_grad", [randn(17)], ip=(17, 0, 17, 1))
    check("slice_grad", [randn(2, 1, 4)], ip=(3, 5, 8, 1, 3, 1, 2, 3, 1, 0, 8, 2))
    check("slice_grad", [randn(4, 2).T], ip=(2, 9, 0, 2, 1, 1, 9, 2))  # strided gradient


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_concat_int32(axis):
    shape_a, shape_b = [3, 4, 5], [3, 4, 5]
    shape_b[axis] = 2
    ia = RNG.integers(0, 9, shape_a).astype(np.int32)
    ib = RNG.integers(0, 9, shape_b).astype(np.int32)
    check("concat", [ia, ib], ip=(axis,))


def test_concat_strided():
    a = randn(6, 3)
    check("concat", [a.T, randn(3, 17)], ip=(1,))
    check("concat", [randn(17, 3)[::2], randn(1, 3)], ip=(0,))


def test_pad_strided_and_int32():
    check("pad", [randn(2, 3, 4)[:, ::2, :].transpose(1, 0, 2)], ip=(0, 1, 1, 1, 3, 0), fp=(7.0,))
    check("pad", [RNG.integers(0, 9, (3, 5)).astype(np.int32)], ip=(1, 1, 0, 2), fp=(4.0,))


# ---- reductions -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sum", "max"])
def test_reduce_strided_and_long(name):
    x = randn(17, 30)
    check(name, [x.T], ip=(0,))
    check(name, [x.T], ip=(1,))
    check(name, [x[::3, 1::2]], ip=(1,))
    check(name, [randn(100_003)], ip=(0,))  # split into chunks, two passes
    check(name, [randn(1000, 300)], ip=(0,))  # column reduction, two passes
    check(name, [randn(3, 1000, 2)], ip=(1,))


def test_sum_to():
    check("sum_to", [randn(3, 17)], ip=(17,))
    check("sum_to", [randn(3, 17)], ip=(3, 1))
    check("sum_to", [randn(4, 3, 5)], ip=(3, 1))
    check("sum_to", [randn(2, 3, 4, 5)], ip=(1, 3, 1, 5))
    check("sum_to", [randn(1000)], ip=(1,))
    check("sum_to", [randn(5, 7).T], ip=(1, 5))
    check("sum_to", [randn(2, 3)], ip=(2, 3))


@pytest.mark.parametrize(
    "shape,axis", [((17,), 0), ((3, 17, 5), 1), ((3, 17, 5), 2), ((4, 6), 0)], ids=str
)
def test_max_grad(shape, axis):
    x = randn(*shape)
    x.flat[::4] = 1.0  # ties: the first maximum takes the gradient
    m = cpu("max", [x], ip=(axis,))
    g = randn(*m.shape)
    check("max_grad", [g, x, m], ip=(axis,))


# lavapipe (Mesa 22.3) ends the loops of one shader invocation after 65535 iterations in all,
# silently: max_grad, which walked the axis in one thread per (o, i), lost the maximum or put
# the gradient on garbage past that.
@pytest.mark.parametrize("n,at", [(65_537, 40_000), (65_537, 65_536), (100_003, 99_999)])
def test_max_grad_long_axis_one_hot(n, at):
    x = np.zeros(n, np.float32)
    x[at] = 1.0
    g = np.asarray([2.5], np.float32)
    got = vk("max_grad", [g, x, np.ones(1, np.float32)], ip=(0,), out_shape=(n,))
    want = np.zeros(n, np.float32)
    want[at] = 2.5
    np.testing.assert_array_equal(got, want)


def test_max_grad_long_axis_against_the_cpu():
    x = randn(70_001, 3)
    x[[3, 69_000, 65_535], [0, 1, 2]] = 9.0
    x[69_500, 1] = 9.0  # a later tie: the first maximum takes the gradient
    m = cpu("max", [x], ip=(0,))
    check("max_grad", [randn(1, 3), x, m], ip=(0,))


@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum_of_a_long_inner_axis(reverse):
    """cumsum along a non-last axis walked each column in one thread: past 65535 rows the
    rest of the column was left unwritten (lavapipe's loop limit, as for max_grad)."""
    x = randn(70_001, 3)
    got = check("cumsum", [x], ip=(0, reverse))
    x64 = np.flip(x, 0) if reverse else x
    want = np.cumsum(x64.astype(np.float64), 0)
    want = np.flip(want, 0) if reverse else want
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-2)


def test_max_backward_of_a_long_axis_through_the_tensor_api(vulkan):
    n = 100_003
    x = np.zeros(n)
    x[40_000] = 1.0
    p = rc.param(x, device=vulkan)
    rc.ops.sum(rc.ops.max(p, axis=0) * 3.0).backward()
    want = np.zeros(n, np.float32)
    want[40_000] = 3.0
    np.testing.assert_array_equal(p.grad.numpy(), want)


# ---- matrix products --------------------------------------------------------------------


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_transposed(ta, tb):
    m, k, n = 33, 20, 44
    a = randn(k, m).T if ta else randn(m, k)
    b = randn(n, k).T if tb else randn(k, n)
    check("matmul", [a, b])
    # Batched, transposed inside the batch, and a sliced operand.
    a3 = randn(3, k, m).transpose(0, 2, 1) if ta else randn(3, m, k)
    b3 = randn(3, n, k).transpose(0, 2, 1) if tb else randn(3, k, n)
    check("matmul", [a3, b3])
    check("matmul", [randn(m, 2 * k)[:, ::2], b])


def test_matmul_big_tiles():
    # Enough 128x128 tiles to take the large-tile kernel (small K keeps lavapipe fast).
    check("matmul", [randn(264, 128, 8), randn(8, 128)])
    check("matmul", [randn(264, 8, 130).transpose(0, 2, 1), randn(264, 8, 129)])


def test_out_prod_strided():
    check("out_prod", [randn(5, 17).T, randn(17, 6)])
    check("out_prod", [randn(17, 8)[:, ::2], randn(6, 17).T])


# ---- nn ---------------------------------------------------------------------------------


def test_get_rows_back_unused_rows():
    idx = np.array([4, 4, 0, 4], np.int32)
    got = check("get_rows_back", [randn(4, 3), idx], ip=(9,))
    assert np.all(got[[1, 2, 3, 5, 6, 7, 8]] == 0)


def test_get_rows_back_past_65535_indices():
    """The rank pass walked every earlier index in one thread: past 65535 of them lavapipe's
    loop limit cut the walk, ranks collided and rows got wrong sums. Slow on lavapipe (the
    rank pass is quadratic in N: about 40 s)."""
    n, v = 70_000, 3
    idx = RNG.integers(0, v, n).astype(np.int32)
    g = randn(n, 2)
    got = check("get_rows_back", [g, idx], ip=(v,))
    want = np.zeros((v, 2))
    np.add.at(want, idx, g.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-2)


def test_bad_indices_raise():
    table = randn(5, 3)
    with pytest.raises(ValueError, match="get_rows"):
        vk("get_rows", [table, np.array([0, 5], np.int32)], out_shape=(2, 3))
    with pytest.raises(ValueError, match="get_rows_back"):
        vk("get_rows_back", [randn(2, 3), np.array([-1, 0], np.int32)], (5,), out_shape=(5, 3))
    with pytest.raises(ValueError, match="cross_entropy"):
        vk("cross_entropy", [randn(2, 3), np.array([0, 3], np.int32)], out_shape=())
    # The device is usable afterwards.
    check("add", [randn(3), randn(3)])


# ---- support answers and the C table ----------------------------------------------------


def test_every_kernel_is_a_core_op():
    core_ops = set(rc._core.op_names())
    assert set(recurra_vulkan.op_names()) <= core_ops


def test_unsupported_node():
    with pytest.raises(NotImplementedError):
        vk("no_such_op", [randn(3)], out_shape=(3,))
    with pytest.raises(NotImplementedError):  # act_grad needs dense sources
        vk("act_grad", [randn(3, 4).T] * 3, (4,), out_shape=(4, 3))


class Buffer(ctypes.Structure):
    _fields_ = [
        ("handle", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
        ("nbytes", ctypes.c_size_t),
    ]


class TensorDesc(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * 4),
        ("strides", ctypes.c_int64 * 4),
        ("buffer", Buffer),
        ("offset", ctypes.c_size_t),
    ]


class NodeDesc(ctypes.Structure):
    _fields_ = [
        ("op", ctypes.c_char_p),
        ("dst", TensorDesc),
        ("n_src", ctypes.c_int32),
        ("src", TensorDesc * recurra_vulkan._vk.MAX_SRC),
        ("n_ip", ctypes.c_int32),
        ("ip", ctypes.POINTER(ctypes.c_int64)),
        ("n_fp", ctypes.c_int32),
        ("fp", ctypes.POINTER(ctypes.c_double)),
    ]


_VOIDP = ctypes.c_void_p


class Table(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("name", ctypes.c_char_p),
        ("ctx", _VOIDP),
        ("device_count", ctypes.CFUNCTYPE(ctypes.c_int, _VOIDP)),
        ("device_info", ctypes.CFUNCTYPE(ctypes.c_int, _VOIDP, ctypes.c_int, _VOIDP)),
        (
            "alloc",
            ctypes.CFUNCTYPE(
                ctypes.c_int,
                _VOIDP,
                ctypes.c_int,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.POINTER(Buffer),
            ),
        ),
        ("free", ctypes.CFUNCTYPE(ctypes.c_int, _VOIDP, ctypes.c_int, Buffer)),
        (
            "copy_in",
            ctypes.CFUNCTYPE(
                ctypes.c_int, _VOIDP, ctypes.c_int, Buffer, ctypes.c_size_t, _VOIDP, ctypes.c_size_t
            ),
        ),
        (
            "copy_out",
            ctypes.CFUNCTYPE(
                ctypes.c_int, _VOIDP, ctypes.c_int, Buffer, ctypes.c_size_t, _VOIDP, ctypes.c_size_t
            ),
        ),
        (
            "supports_op",
            ctypes.CFUNCTYPE(ctypes.c_int, _VOIDP, ctypes.c_int, ctypes.POINTER(NodeDesc)),
        ),
        (
            "compute",
            ctypes.CFUNCTYPE(
                ctypes.c_int, _VOIDP, ctypes.c_int, ctypes.POINTER(NodeDesc), ctypes.c_int32
            ),
        ),
        ("synchronize", ctypes.CFUNCTYPE(ctypes.c_int, _VOIDP, ctypes.c_int)),
        ("get_last_error", ctypes.CFUNCTYPE(ctypes.c_char_p, _VOIDP)),
        ("shutdown", ctypes.CFUNCTYPE(None, _VOIDP)),
    ]


@pytest.fixture(scope="module")
def table() -> Table:
    cap = recurra_vulkan.backend_info()["table"]
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    t = Table.from_address(get(cap, b"recurra.backend_table"))
    assert t.abi_version == recurra_vulkan._vk.ABI_VERSION
    assert t.name == b"vulkan"
    assert t.device_count(t.ctx) >= 1
    return t


def _desc(buf: Buffer, shape, offset=0) -> TensorDesc:
    d = TensorDesc()
    d.dtype, d.ndim, d.buffer, d.offset = 0, len(shape), buf, offset
    stride = 1
    for i in reversed(range(4)):
        d.shape[i] = shape[i] if i < len(shape) else 1
        d.strides[i] = stride if i < len(shape) else 1
        if i < len(shape):
            stride *= shape[i]
    return d


def test_stale_handles_are_refused(table):
    buf = Buffer()
    assert table.alloc(table.ctx, 0, 64, 1, ctypes.byref(buf)) == 0
    assert buf.generation != 0
    host = (ctypes.c_float * 16)()
    assert table.copy_in(table.ctx, 0, buf, 0, host, 64) == 0
    assert table.copy_in(table.ctx, 0, buf, 8, host, 64) == -1  # past the end
    assert table.free(table.ctx, 0, buf) == 0
    assert table.copy_out(table.ctx, 0, buf, 0, host, 64) == -1
    assert b"stale" in table.get_last_error(table.ctx)
    assert table.free(table.ctx, 0, buf) == -1  # double free
    again = Buffer()
    assert table.alloc(table.ctx, 0, 64, 1, ctypes.byref(again)) == 0
    assert again.generation != buf.generation
    assert table.copy_in(table.ctx, 0, buf, 0, host, 64) == -1  # the old handle stays stale
    assert table.free(table.ctx, 0, again) == 0


def test_dependent_nodes_in_one_compute(table):
    """Three nodes in one compute(): t = a + b; u = t * a (reads t); t2 = u - b written over
    a's memory after a was read (write-after-read): the recorder must order them."""
    n = 1000
    a, b = randn(n), randn(n)
    bufs = []

    def alloc(nbytes):
        buf = Buffer()
        assert table.alloc(table.ctx, 0, nbytes, 0, ctypes.byref(buf)) == 0
        bufs.append(buf)
        return buf

    try:
        ba, bb, bt, bu = alloc(4 * n), alloc(4 * n), alloc(4 * n), alloc(4 * n)
        assert table.copy_in(table.ctx, 0, ba, 0, a.ctypes.data, 4 * n) == 0
        assert table.copy_in(table.ctx, 0, bb, 0, b.ctypes.data, 4 * n) == 0
        nodes = (NodeDesc * 3)()
        plan = [
            (nodes[0], b"add", bt, [ba, bb]),
            (nodes[1], b"mul", bu, [bt, ba]),
            (nodes[2], b"sub", ba, [bu, bb]),
        ]
        for node, op, dst, srcs in plan:
            node.op, node.dst, node.n_src = op, _desc(dst, (n,)), len(srcs)
            for i, s in enumerate(srcs):
                node.src[i] = _desc(s, (n,))
            assert table.supports_op(table.ctx, 0, ctypes.byref(node)) == 1
        assert table.compute(table.ctx, 0, nodes, 3) == 0
        assert table.synchronize(table.ctx, 0) == 0
        out = np.empty(n, np.float32)
        assert table.copy_out(table.ctx, 0, ba, 0, out.ctypes.data, 4 * n) == 0
        want = (a + b) * a - b
        assert nmse(out, want) <= NMSE_MAX
    finally:
        for buf in bufs:
            table.free(table.ctx, 0, buf)


def test_view_past_buffer_end_is_refused(table):
    buf = Buffer()
    assert table.alloc(table.ctx, 0, 16, 0, ctypes.byref(buf)) == 0
    try:
        node = NodeDesc()
        node.op, node.dst, node.n_src = b"neg", _desc(buf, (4,)), 1
        node.src[0] = _desc(buf, (4,), offset=8)  # reaches 8 bytes past the end
        assert table.compute(table.ctx, 0, ctypes.byref(node), 1) == -1
        assert b"past the end" in table.get_last_error(table.ctx)
    finally:
        table.free(table.ctx, 0, buf)


# ---- through the core's scheduler -------------------------------------------------------


def _mlp_step(device: str | None) -> tuple[float, list[np.ndarray]]:
    """Loss and gradients of a small MLP classifier (matmul, bias broadcast, activations,
    layer_norm, softmax cross-entropy, reductions) on `device`."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((17, 12)).astype(np.float32)
    w1 = (rng.standard_normal((12, 33)) * 0.3).astype(np.float32)
    b1 = (rng.standard_normal(33) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((33, 5)) * 0.3).astype(np.float32)
    targets = rng.integers(0, 5, 17).astype(np.int32)
    ps = [rc.param(v, device=device) for v in (w1, b1, w2)]
    h = rc.ops.gelu(rc.ops.matmul(rc.tensor(x, device=device), ps[0]) + ps[1])
    h = rc.ops.layer_norm(h) if hasattr(rc.ops, "layer_norm") else h
    logits = rc.ops.matmul(h, ps[2])
    loss = rc.ops.cross_entropy(logits, rc.tensor(targets, device=device))
    loss.backward()
    return float(loss.numpy()), [np.asarray(p.grad.numpy()) for p in ps]


def test_training_step_through_the_core():
    """The same graph (forward and backward) placed on Vulkan by the core's scheduler, in
    strict mode (no CPU fallback), against the CPU."""
    try:
        rc.parse_device("vulkan")
    except ValueError as e:
        pytest.skip(f"the core does not offer the vulkan device yet: {e}")
    set_strict = getattr(rc._tensor, "set_strict_placement", None)
    want_loss, want_grads = _mlp_step(None)
    if set_strict is not None:
        set_strict(True)
    try:
        got_loss, got_grads = _mlp_step("vulkan")
    finally:
        if set_strict is not None:
            set_strict(False)
    assert abs(got_loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    for got, want in zip(got_grads, want_grads):
        assert got.shape == want.shape
        assert nmse(got, want) <= NMSE_MAX


# ---- profiling --------------------------------------------------------------------------


def test_profile_dispatches_times_each_dispatch_of_a_node():
    """profile_dispatches labels every dispatch 'op/shader[constants]', once per run, in
    the same order each run, with a positive GPU time; the node's result is unchanged."""
    from recurra_vulkan import _vk

    a = randn(33, 17)
    iters = 3
    recs = _vk.profile_dispatches("silu", [a], [], [], a.shape, "float32", iters, 1, 0)
    assert len(recs) % iters == 0 and len(recs) >= iters
    per = len(recs) // iters
    labels = [lab for lab, _ in recs]
    assert labels == labels[:per] * iters
    assert all(lab.startswith("silu/") for lab in labels)
    assert all(sec > 0 for _, sec in recs)
    # after profiling the node still computes silu (and no profiling mode is left on)
    np.testing.assert_allclose(vk("silu", [a], out_shape=a.shape), a / (1 + np.exp(-a)), rtol=1e-5)
