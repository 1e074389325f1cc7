"""matmul and out_prod: forward against float64 numpy on the BLAS path and on recurra's own
kernel (RECURRA_NO_BLAS=1), strided and transposed operands, broadcasting batch axes,
gradients against finite differences, and errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(77)


@pytest.fixture(params=["blas", "own"])
def kernel(request, monkeypatch):
    """Runs a test on the BLAS path (when a BLAS is loaded) and on the fallback kernel.

    RECURRA_NO_BLAS is read by the matmul kernel at every call, so setting it here is
    enough; results are computed (``.numpy()``) while it is set.
    """
    if request.param == "own":
        monkeypatch.setenv("RECURRA_NO_BLAS", "1")
    else:
        monkeypatch.delenv("RECURRA_NO_BLAS", raising=False)
    return request.param


def _check(got: np.ndarray, want: np.ndarray, k: int) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    # float32 products summed over k terms of size ~1: error grows like sqrt(k) * 6e-8.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * max(1.0, np.sqrt(k)))


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


SHAPES = [
    ((1, 1), (1, 1)),
    ((3, 17), (17, 1)),
    ((17, 3), (3, 17)),
    ((1, 17), (17, 3)),
    ((2, 3, 5), (5, 4)),  # shared b: the batch folds into one product
    ((2, 3, 3, 5), (5, 17)),
    ((5, 4), (2, 3, 4, 6)),  # shared a
    ((2, 1, 3, 5), (4, 5, 2)),  # batch axes broadcast both ways
    ((3, 1, 4), (1, 4, 3)),
    ((70, 300), (300, 270)),  # crosses every block size of the own kernel
    ((3, 0), (0, 4)),  # k = 0: zeros
    ((0, 3), (3, 4)),
]


@pytest.mark.parametrize("sa,sb", SHAPES, ids=str)
def test_matmul_forward(kernel, sa, sb):
    a, b = _rand(*sa), _rand(*sb)
    got = ops.matmul(rc.tensor(a), rc.tensor(b)).numpy()
    _check(got, a.astype(np.float64) @ b.astype(np.float64), sa[-1])
    got = (rc.tensor(a) @ b).numpy()  # the operator, with a numpy operand
    _check(got, a.astype(np.float64) @ b.astype(np.float64), sa[-1])


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((5,), (5, 3)),
        ((5,), (2, 5, 3)),
        ((2, 5, 3), (3,)),
        ((4, 3), (3,)),
        ((3,), (3,)),
        ((1,), (1,)),
    ],
    ids=str,
)
def test_matmul_vectors(kernel, sa, sb):
    a, b = _rand(*sa), _rand(*sb)
    got = ops.matmul(rc.tensor(a), rc.tensor(b)).numpy()
    _check(got, a.astype(np.float64) @ b.astype(np.float64), sa[-1])


def _operands(r: int, c: int) -> list[tuple[rc.Tensor, np.ndarray]]:
    """(r, c) operands as (recurra tensor or view, numpy equivalent) in every memory layout
    the kernel distinguishes."""
    dense = _rand(r, c)
    tr = _rand(c, r)
    wide = _rand(r, 2 * c)
    tall = _rand(2 * r, c + 3)
    tr_wide = _rand(c, r + 5)
    row = _rand(c)
    return [
        (rc.tensor(dense), dense),  # row-major
        (rc.tensor(tr).T, tr.T),  # transposed: the trans flag
        (rc.tensor(wide)[:, ::2], wide[:, ::2]),  # column stride 2: a copy
        (rc.tensor(tall)[::2, 1 : c + 1], tall[::2, 1 : c + 1]),  # long leading dimension
        (rc.tensor(tr_wide)[:, 2 : r + 2].T, tr_wide[:, 2 : r + 2].T),  # transposed, long ld
        (rc.tensor(row).broadcast_to((r, c)), np.broadcast_to(row, (r, c))),  # row stride 0
    ]


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 17, 5), (17, 3, 1), (67, 260, 33)], ids=str)
def test_matmul_strided_operands(kernel, m, k, n):
    for ta, na in _operands(m, k):
        for tb, nb in _operands(k, n):
            got = ops.matmul(ta, tb).numpy()
            _check(got, na.astype(np.float64) @ nb.astype(np.float64), k)


def test_matmul_batched_views(kernel):
    a = _rand(3, 4, 5, 6)
    b = _rand(3, 4, 7, 6)
    ta, tb = rc.tensor(a), rc.tensor(b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cases = [
        (ta, tb.transpose(-1, -2), a64 @ b64.swapaxes(-1, -2)),
        (
            tb.permute(1, 0, 2, 3),
            ta.permute(1, 0, 3, 2),
            b64.transpose(1, 0, 2, 3) @ a64.transpose(1, 0, 3, 2),
        ),
        (ta[:, 1:3, ::2], tb[0, 1].T, a64[:, 1:3, ::2] @ b64[0, 1].T),  # shared b, strided a
        (ta.permute(0, 1, 3, 2)[..., :4], rc.tensor(_rand(4, 2)), None),  # transposed a, shared b
        (rc.tensor(a[0, 0, 0]).broadcast_to((3, 6)), tb[1, 2].T, None),  # rows of stride 0
    ]
    for x, y, want in cases:
        if want is None:
            want = x.numpy().astype(np.float64) @ y.numpy().astype(np.float64)
        _check(ops.matmul(x, y).numpy(), want, x.shape[-1])


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((4, 3), (4, 5)),
        ((17, 1), (17, 3)),
        ((2, 4, 3), (4, 5)),
        ((2, 1, 4, 3), (3, 4, 2)),
        ((0, 3), (0, 2)),
    ],
    ids=str,
)
def test_out_prod_forward(kernel, sa, sb):
    a, b = _rand(*sa), _rand(*sb)
    want = np.swapaxes(a.astype(np.float64), -1, -2) @ b.astype(np.float64)
    _check(ops.out_prod(rc.tensor(a), rc.tensor(b)).numpy(), want, sa[-2])
    # Transposed views as operands.
    at = rc.tensor(np.ascontiguousarray(np.swapaxes(a, -1, -2))).transpose(-1, -2)
    _check(ops.out_prod(at, rc.tensor(b)).numpy(), want, sa[-2])


def test_own_kernel_without_blas_loaded():
    # A fresh interpreter with RECURRA_NO_BLAS set at import: no BLAS is loaded at all, so
    # blas_sgemm itself declines and the own kernel runs. (About a second from an installed
    # wheel; the generous timeout covers an editable install that rebuilds on import.)
    code = textwrap.dedent("""
        import numpy as np, recurra as rc
        assert rc.blas_info() == "none", rc.blas_info()
        rng = np.random.default_rng(0)
        a = rng.standard_normal((2, 37, 300)).astype(np.float32)
        b = rng.standard_normal((300, 259)).astype(np.float32)
        got = (rc.tensor(a) @ rc.tensor(b)).numpy()
        want = a.astype(np.float64) @ b
        assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
        got = (rc.tensor(b).T[::3] @ rc.tensor(a[0]).T).numpy()
        want = b.T[::3].astype(np.float64) @ a[0].T
        assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
        print("ok")
    """)
    env = dict(os.environ, RECURRA_NO_BLAS="1")
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((2, 3), (3, 4)),
        ((1, 1), (1, 3)),
        ((2, 3, 4), (4, 2)),
        ((4, 3), (2, 3, 2)),
        ((2, 1, 2, 3), (3, 3, 2)),
        ((3,), (3, 2)),
        ((2, 3), (3,)),
    ],
    ids=str,
)
def test_matmul_grads(kernel, sa, sb):
    check_grads(lambda x, y: ops.matmul(x, y), [RNG.standard_normal(sa), RNG.standard_normal(sb)])


def test_matmul_grads_through_views(kernel):
    a = RNG.standard_normal((4, 3))
    b = RNG.standard_normal((2, 5, 4))
    check_grads(lambda x, y: ops.matmul(x.T, y.transpose(-1, -2)[..., ::2]), [a, b])
    check_grads(lambda x, y: ops.matmul(y[:, 1:4], x), [a, b])


@pytest.mark.parametrize(
    "sa,sb", [((3, 2), (3, 4)), ((2, 3, 2), (3, 1)), ((3, 2), (2, 3, 2))], ids=str
)
def test_out_prod_grads(kernel, sa, sb):
    check_grads(lambda x, y: ops.out_prod(x, y), [RNG.standard_normal(sa), RNG.standard_normal(sb)])


def test_errors_name_the_op():
    t = rc.tensor
    with pytest.raises(ValueError, match=r"matmul: the contracted dimensions differ \(3 and 4\)"):
        ops.matmul(t(_rand(2, 3)), t(_rand(4, 5)))
    with pytest.raises(ValueError, match="matmul: the batch axes cannot be broadcast"):
        ops.matmul(t(_rand(2, 3, 4)), t(_rand(3, 4, 5)))
    with pytest.raises(ValueError, match="matmul: both inputs need at least 2 axes"):
        ops.apply("matmul", [t(_rand(3)), t(_rand(3, 2))])
    with pytest.raises(ValueError, match="matmul: operands must have at least 1 axis"):
        ops.matmul(t(np.float32(2.0)), t(_rand(3)))
    with pytest.raises(ValueError, match="matmul"):
        ops.matmul(t(_rand(3)), t(_rand(4)))
    with pytest.raises(ValueError, match=r"out_prod: the contracted dimensions differ \(3 and 2\)"):
        ops.out_prod(t(_rand(3, 4)), t(_rand(2, 4)))
    with pytest.raises(ValueError, match="out_prod: both inputs need at least 2 axes"):
        ops.out_prod(t(_rand(3)), t(_rand(3, 4)))


def test_int_inputs_raise_type_error():
    i = rc.tensor(np.ones((2, 2), np.int32))
    f = rc.tensor(_rand(2, 2))
    with pytest.raises(TypeError, match="matmul: input 0 must be float32"):
        ops.matmul(i, f)
    with pytest.raises(TypeError, match="matmul: input 1 must be float32"):
        ops.matmul(f, i)
    with pytest.raises(TypeError, match="out_prod: input 1 must be float32"):
        ops.out_prod(f, i)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize(
    "m,k,n", [(1, 300, 70), (70, 300, 1), (1, 5, 1), (1, 1, 9), (1, 1536, 777), (777, 1536, 1)]
)
def test_matrix_vector_products(ta, tb, m, k, n):
    # One row or one column: the BLAS path uses sgemv; operands given transposed as views.
    # 777 x 1536 is cut into several blocks of uneven length over the threads.
    rng = np.random.default_rng(m * 1000 + n)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    at, bt = rc.tensor(a), rc.tensor(b)
    got = ((at.T if ta else at) @ (bt.T if tb else bt)).numpy()
    want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture(params=[2, 3, 4])
def threads(request):
    before = rc.get_num_threads()
    rc.set_num_threads(request.param)
    yield request.param
    rc.set_num_threads(before)


@pytest.mark.parametrize("split", ["plan", "rows"])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize(
    "m,k,n",
    [
        (96, 3001, 80),  # a long k: cut into slices of k, the partials summed into C
        (1001, 300, 64),  # blocks of rows (B packed once per block)
        (64, 300, 1001),  # blocks of columns
        (300, 333, 520),  # rows x columns tiles on 4 threads
    ],
)
def test_blas_product_cuts(threads, split, monkeypatch, ta, tb, m, k, n):
    # One product through BLAS over the pool, cut as matmul.cpp's plan_split says (or into
    # blocks of rows / columns with RECURRA_GEMM_SPLIT=rows): every cut, with remainders, gives
    # the product.
    if split == "rows":
        monkeypatch.setenv("RECURRA_GEMM_SPLIT", "rows")
    else:
        monkeypatch.delenv("RECURRA_GEMM_SPLIT", raising=False)
    rng = np.random.default_rng(m + 7 * n + 13 * k)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    at, bt = rc.tensor(a), rc.tensor(b)
    got = ((at.T if ta else at) @ (bt.T if tb else bt)).numpy()
    want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    _check(got, want, k)
