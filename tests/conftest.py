"""Test-suite wide settings: the backend under test, the Vulkan gate, Hypothesis profiles.

Backend selection (set by nox's `tests(<backend>)` session):

    RECURRA_TEST_BACKEND=cpu     the CPU suite; tests marked `vulkan` are deselected
    RECURRA_TEST_BACKEND=vulkan  only tests marked `vulkan` are collected (the cross-backend
                                 cases: the same graph on Vulkan compared with the CPU)
    (unset)                      everything; `vulkan` tests run when a device is there

Writing a Vulkan test: mark it, or take the `vulkan` fixture (which marks it for you)::

    @pytest.mark.vulkan
    def test_add_matches_cpu(vulkan): ...

With no usable Vulkan backend such a test FAILS with the reason when the Vulkan backend is
the one under test (RECURRA_TEST_BACKEND=vulkan, i.e. `nox -s "tests(vulkan)"`), so a broken
driver setup cannot pass as "all skipped"; skipping is the opt-in: RECURRA_SKIP_VULKAN=1.
In a run of everything (backend unset) it is skipped with the reason, unless
RECURRA_EXPECT_VULKAN=1 (then it fails there too).

Hypothesis profiles: RECURRA_HYPOTHESIS_PROFILE=dev|ci|sanitize (default: ci when the CI
variable is set, dev otherwise). `sanitize` runs few examples, for the ASan build.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata

import pytest

BACKEND_ENV = "RECURRA_TEST_BACKEND"
EXPECT_VULKAN_ENV = "RECURRA_EXPECT_VULKAN"
SKIP_VULKAN_ENV = "RECURRA_SKIP_VULKAN"
KNOWN_BACKENDS = ("cpu", "vulkan")


def _test_backend() -> str | None:
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if value and value not in KNOWN_BACKENDS:
        raise pytest.UsageError(f"{BACKEND_ENV}={value!r}: expected one of {KNOWN_BACKENDS}")
    return value or None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _expect_vulkan() -> bool:
    """Whether a missing Vulkan backend fails the Vulkan tests instead of skipping them."""
    if _flag(SKIP_VULKAN_ENV):
        return False
    return _test_backend() == "vulkan" or _flag(EXPECT_VULKAN_ENV)


# --------------------------------------------------------------------------------------------
# Hypothesis
# --------------------------------------------------------------------------------------------
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test dependency; without it those tests fail to import
    settings = None

if settings is not None:
    # No deadlines anywhere: the machine is shared, timings are not what these tests check.
    settings.register_profile("dev", deadline=None)
    settings.register_profile(
        "ci",
        deadline=None,
        derandomize=True,  # the same examples on every run: a red CI is reproducible
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("sanitize", parent=settings.get_profile("ci"), max_examples=10)
    HYPOTHESIS_PROFILE = os.environ.get("RECURRA_HYPOTHESIS_PROFILE") or (
        "ci" if os.environ.get("CI") else "dev"
    )
    settings.load_profile(HYPOTHESIS_PROFILE)
else:
    HYPOTHESIS_PROFILE = "n/a (hypothesis not installed)"


# --------------------------------------------------------------------------------------------
# Vulkan availability
# --------------------------------------------------------------------------------------------
@functools.cache
def vulkan_status() -> tuple[bool, str]:
    """Returns (available, reason): whether the Vulkan backend can run graphs here, and why not.

    Asks the core (`recurra.backends.available()`, which loads the `recurra.backends` entry
    points and lists each plugin with its devices or the reason it has none). Without that
    module it probes the `vulkan` entry point itself: per docs/design.md ("Packages") its
    function returns a dict with `devices` and `reason` and never raises.
    """
    selected = os.environ.get("RECURRA_BACKENDS")
    if selected and "vulkan" not in [s.strip().lower() for s in selected.split(",")]:
        return False, f"RECURRA_BACKENDS={selected} excludes vulkan"
    try:
        import recurra  # noqa: F401 - the core must import before any plugin can
    except Exception as exc:
        return False, f"import recurra failed: {exc!r}"
    try:
        from recurra import backends
    except ImportError:
        backends = None
    if backends is not None and hasattr(backends, "available"):
        try:
            infos = {b.name: b for b in backends.available()}
        except Exception as exc:
            return False, f"recurra.backends.available() failed: {exc!r}"
        info = infos.get("vulkan")
        if info is None:
            return False, "no 'vulkan' backend: recurra-vulkan is not installed"
        if not info.available:
            return False, info.reason or "the vulkan backend reports no usable device"
        names = ", ".join(str(d.get("name", "?")) for d in info.devices)
        return True, f"{len(info.devices)} device(s): {names}"
    eps = [ep for ep in metadata.entry_points(group="recurra.backends") if ep.name == "vulkan"]
    if not eps:
        return False, "no 'vulkan' entry point in group recurra.backends (recurra-vulkan absent)"
    try:
        info = eps[0].load()()
    except Exception as exc:
        return False, f"the vulkan plugin failed: {exc!r}"
    devices = info.get("devices") if isinstance(info, dict) else None
    if not devices:
        reason = info.get("reason") if isinstance(info, dict) else ""
        return False, reason or "the vulkan plugin reports no device"
    return True, f"{len(devices)} device(s)"


def _require_vulkan() -> None:
    available, reason = vulkan_status()
    if available:
        return
    if _expect_vulkan():
        pytest.fail(
            f"Vulkan is unavailable: {reason} (set {SKIP_VULKAN_ENV}=1 to skip the Vulkan "
            "tests instead)",
            pytrace=False,
        )
    pytest.skip(f"Vulkan unavailable: {reason}")


@pytest.fixture
def vulkan() -> str:
    """The device name to pass to recurra ("vulkan"); skips or fails as the module docstring
    says when no Vulkan backend is usable."""
    _require_vulkan()
    return "vulkan"


@pytest.fixture
def test_backend() -> str:
    """The backend this session tests (RECURRA_TEST_BACKEND, default "cpu")."""
    return _test_backend() or "cpu"


# --------------------------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vulkan: needs the Vulkan backend (without one: fails under RECURRA_TEST_BACKEND=vulkan "
        "unless RECURRA_SKIP_VULKAN=1, skips otherwise)",
    )
    _test_backend()  # reject a misspelt backend before collecting anything


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "vulkan" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("vulkan"):
            item.add_marker(pytest.mark.vulkan)
    backend = _test_backend()
    if backend is None:
        return
    keep, drop = [], []
    for item in items:
        wants_vulkan = item.get_closest_marker("vulkan") is not None
        (keep if wants_vulkan == (backend == "vulkan") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vulkan") is not None:
        _require_vulkan()


def pytest_report_header(config: pytest.Config) -> list[str]:
    try:
        import recurra

        where = f"recurra {getattr(recurra, '__version__', '?')} from {recurra.__file__}"
    except Exception as exc:  # the header must never break collection
        where = f"recurra not importable: {exc!r}"
    return [
        where,
        f"backend under test: {_test_backend() or 'all'}; "
        f"without Vulkan the Vulkan tests {'fail' if _expect_vulkan() else 'skip'}; "
        f"hypothesis profile: {HYPOTHESIS_PROFILE}",
    ]
