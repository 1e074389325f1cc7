"""The CPU thread pool under several Python threads: graphs computed at once from 2-4
threads (graph API and lazy API), set_num_threads while another thread computes, and the
pool's behaviour when the system refuses threads (in a subprocess, with a timeout).

Every concurrent result is compared with the same program run alone in one thread (which is
itself checked against float64 numpy). A deadlock fails the test by timeout instead of
hanging the suite.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import recurra as rc
from recurra import ops

TIMEOUT_S = 120
R, C = 256, 256  # 65536 elements: the elementwise kernels split over the pool


def run_threads(fns, timeout: float = TIMEOUT_S) -> None:
    """Runs each callable in its own thread at once; re-raises the first error, fails when a
    thread is still running after `timeout` (a deadlock)."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(fns))

    def wrap(fn):
        def body():
            try:
                start.wait()
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        return body

    threads = [threading.Thread(target=wrap(f), daemon=True) for f in fns]
    # A deadlock that keeps the GIL (the joins below could not time out) ends the process
    # with every thread's stack instead of hanging the suite.
    faulthandler.dump_traceback_later(timeout + 60, exit=True, file=sys.__stderr__)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        faulthandler.cancel_dump_traceback_later()
    stuck = sum(t.is_alive() for t in threads)
    assert not stuck, f"{stuck} of {len(threads)} threads still computing after {timeout} s"
    if errors:
        raise errors[0]


# ---- a random program: the same ops on the graph API, the lazy API and float64 numpy ------

UNARY = ["tanh", "sigmoid", "relu", "neg"]
BINARY = ["add", "sub", "mul"]


def program_steps():
    step = st.one_of(
        st.tuples(st.just("unary"), st.sampled_from(UNARY), st.integers(0, 7)),
        st.tuples(st.just("binary"), st.sampled_from(BINARY), st.integers(0, 7), st.integers(0, 7)),
        st.tuples(st.just("matmul"), st.integers(0, 7)),
        st.tuples(st.just("rowsum"), st.integers(0, 7)),
    )
    return st.lists(step, min_size=1, max_size=8)


def run_program(steps, vals, w, lib):
    """Applies `steps` to the value list `vals` (operands picked modulo its length) with
    `lib` (ops, or the float64 numpy twins below); returns the loss."""
    vals = list(vals)
    for s in steps:
        kind = s[0]
        if kind == "unary":
            out = getattr(lib, s[1])(vals[s[2] % len(vals)])
        elif kind == "binary":
            out = getattr(lib, s[1])(vals[s[2] % len(vals)], vals[s[3] % len(vals)])
        elif kind == "matmul":
            out = lib.tanh(lib.scale(lib.matmul(vals[s[1] % len(vals)], w), C**-0.5))
        else:  # x + mean over the row, broadcast back
            x = vals[s[1] % len(vals)]
            out = lib.add(x, lib.scale(lib.sum(x, axis=1, keepdims=True), 1.0 / C))
        vals.append(out)
    return lib.mean(lib.sqr(vals[-1]))


class np64:
    tanh = staticmethod(np.tanh)
    neg = staticmethod(np.negative)
    add = staticmethod(np.add)
    sub = staticmethod(np.subtract)
    mul = staticmethod(np.multiply)
    matmul = staticmethod(np.matmul)
    sqr = staticmethod(np.square)
    mean = staticmethod(np.mean)

    @staticmethod
    def sigmoid(x):
        return 1 / (1 + np.exp(-x))

    @staticmethod
    def relu(x):
        return np.maximum(x, 0)

    @staticmethod
    def scale(x, s):
        return x * s

    @staticmethod
    def sum(x, axis, keepdims):
        return np.sum(x, axis=axis, keepdims=keepdims)


def lazy_run(steps, xs, w):
    """(loss, gradients of the inputs and of w) through the lazy API."""
    leaves = [rc.param(x) for x in xs]
    wt = rc.param(w)
    loss = run_program(steps, leaves, wt, ops)
    loss.backward()
    grads = [p.grad.numpy() if p.grad is not None else np.zeros_like(x) for p, x in zip(leaves, xs)]
    return loss.item(), grads, wt.grad.numpy() if wt.grad is not None else np.zeros_like(w)


class GraphRunner:
    """The program as an explicit graph, built once and computed many times."""

    def __init__(self, steps, xs, w):
        g = rc.Graph()
        self.g = g
        self.leaves = [g.param(x.shape) for x in xs]
        self.w = g.param(w.shape)
        self.loss = run_program(steps, self.leaves, self.w, ops)
        g.build_backward(self.loss)
        for leaf, x in zip(self.leaves, xs):
            g.set_data(leaf, x)
        g.set_data(self.w, w)
        self.xs, self.wv = xs, w

    def __call__(self):
        self.g.compute()

        def grad(t, like):
            return t.grad.numpy() if t.grad is not None else np.zeros_like(like)

        return (
            self.loss.item(),
            [grad(p, x) for p, x in zip(self.leaves, self.xs)],
            grad(self.w, self.wv),
        )


def assert_same(got, want, what: str) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"{what}: loss")
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-9, err_msg=f"{what}: input grad")
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-9, err_msg=f"{what}: w grad")


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((R, C)).astype(np.float32) for _ in range(2)]
    w = rng.standard_normal((C, C)).astype(np.float32)
    return xs, w


@pytest.fixture
def two_threads():
    """At least two pool threads (restored after), so the pool really is shared."""
    before = rc.get_num_threads()
    rc.set_num_threads(max(2, before))
    yield
    rc.set_num_threads(before)


FIXED = [("matmul", 0), ("binary", "mul", 2, 1), ("rowsum", 3), ("unary", "tanh", 4)]


def test_two_graphs_from_two_threads(two_threads):
    xs, w = inputs(0)
    want = GraphRunner(FIXED, xs, w)()
    ref = run_program(FIXED, [x.astype(np.float64) for x in xs], w.astype(np.float64), np64)
    np.testing.assert_allclose(want[0], ref, rtol=1e-5)
    runners = [GraphRunner(FIXED, xs, w) for _ in range(2)]

    def loop(run):
        def body():
            for i in range(15):
                assert_same(run(), want, f"iteration {i}")

        return body

    run_threads([loop(r) for r in runners])


def test_lazy_beside_graph(two_threads):
    xs, w = inputs(1)
    want = lazy_run(FIXED, xs, w)
    graph = GraphRunner(FIXED, xs, w)

    def lazy_loop():
        for i in range(10):
            assert_same(lazy_run(FIXED, xs, w), want, f"lazy iteration {i}")

    def graph_loop():
        for i in range(15):
            assert_same(graph(), want, f"graph iteration {i}")

    run_threads([lazy_loop, graph_loop])


def test_set_num_threads_while_computing(two_threads):
    xs, w = inputs(2)
    want = GraphRunner(FIXED, xs, w)()
    graph = GraphRunner(FIXED, xs, w)
    done = threading.Event()

    def compute_loop():
        try:
            for i in range(20):
                assert_same(graph(), want, f"iteration {i}")
        finally:
            done.set()

    def resize_loop():
        k = 0
        while not done.is_set():
            rc.set_num_threads(1 + k % 3)
            k += 1

    run_threads([compute_loop, resize_loop])


@settings(max_examples=8)
@given(steps=program_steps(), n_threads=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_random_graphs_from_several_threads(steps, n_threads, seed):
    xs, w = inputs(seed)
    want = GraphRunner(steps, xs, w)()  # alone, on the calling thread
    ref = run_program(steps, [x.astype(np.float64) for x in xs], w.astype(np.float64), np64)
    np.testing.assert_allclose(want[0], ref, rtol=1e-4, atol=1e-7)
    # Graph API in every thread but one, which uses the lazy API.
    runners = [GraphRunner(steps, xs, w) for _ in range(n_threads - 1)]
    jobs = [lambda r=r: [assert_same(r(), want, "graph") for _ in range(3)] for r in runners]
    jobs.append(lambda: [assert_same(lazy_run(steps, xs, w), want, "lazy") for _ in range(2)])
    run_threads(jobs)


# ---- threads the system refuses --------------------------------------------------------


# AddressSanitizer reserves terabytes of address space for its shadow memory: under an
# address-space limit the interpreter cannot even import. These cases run in tests(cpu).
needs_plain_address_space = pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="an address-space limit cannot hold AddressSanitizer's shadow memory",
)


def run_limited(code: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Runs `code` in a fresh interpreter under a 6 GiB address-space limit."""
    prelude = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang fails the test here
    )


CHECK_COMPUTE = """
import numpy as np
from recurra import ops
a = np.arange(1 << 17, dtype=np.float32) / (1 << 17)
got = ops.tanh(rc.tensor(a)).numpy()
assert np.allclose(got, np.tanh(a.astype(np.float64)), rtol=1e-6), "wrong result"
print("threads", rc.get_num_threads())
"""


@needs_plain_address_space
def test_set_num_threads_beyond_what_starts_warns():
    out = run_limited(
        textwrap.dedent(
            """
        import warnings
        import recurra as rc
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            rc.set_num_threads(3000)
        assert any("could start only" in str(x.message) for x in w), [str(x.message) for x in w]
        assert 1 <= rc.get_num_threads() < 3000, rc.get_num_threads()
        rc.set_num_threads(2)
        assert rc.get_num_threads() == 2
        """
        )
        + CHECK_COMPUTE
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "threads 2" in out.stdout


@needs_plain_address_space
def test_num_threads_env_beyond_what_starts_warns():
    out = run_limited("import recurra as rc\n" + CHECK_COMPUTE, env={"RECURRA_NUM_THREADS": "2000"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "could start only" in out.stderr
    n = int(out.stdout.split()[-1])
    assert 1 <= n < 2000


def test_default_thread_count_is_the_affinity_count():
    assert rc._core.default_num_threads() == len(os.sched_getaffinity(0))
