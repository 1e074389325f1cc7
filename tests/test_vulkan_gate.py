"""tests/conftest.py's Vulkan gate: the Vulkan session cannot pass as "all skipped"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs a one-test suite that needs Vulkan under this conftest, with Vulkan disabled
    (RECURRA_BACKENDS=cpu) and ``env`` set."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_one.py").write_text("def test_needs_vulkan(vulkan):\n    pass\n")
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RECURRA_TEST_BACKEND", "RECURRA_SKIP_VULKAN", "RECURRA_EXPECT_VULKAN")
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**base, "RECURRA_BACKENDS": "cpu", **env},
    )


@pytest.mark.parametrize(
    "env, code, word",
    [
        ({"RECURRA_TEST_BACKEND": "vulkan"}, 1, "RECURRA_SKIP_VULKAN=1"),
        ({"RECURRA_TEST_BACKEND": "vulkan", "RECURRA_SKIP_VULKAN": "1"}, 0, "1 skipped"),
        ({}, 0, "1 skipped"),
        ({"RECURRA_EXPECT_VULKAN": "1"}, 1, "Vulkan is unavailable"),
    ],
)
def test_vulkan_session_fails_without_a_device_unless_told_to_skip(tmp_path, env, code, word):
    p = _run(tmp_path, **env)
    assert p.returncode == code, p.stdout + p.stderr
    assert word in p.stdout, p.stdout
