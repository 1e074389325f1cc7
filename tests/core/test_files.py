"""recurra.write_atomic: atomic, and the file's permissions are those a plain open() gives."""

from __future__ import annotations

import os
import stat

import pytest

import recurra


@pytest.fixture
def umask():
    """Sets the process umask for one test and restores it."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield lambda m: os.umask(m)
    os.umask(saved)


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_honours_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    target = tmp_path / "state.bin"
    recurra.write_atomic(target, b"abc")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"abc")
    assert stat.S_IMODE(target.stat().st_mode) == mode == stat.S_IMODE(plain.stat().st_mode)
    assert target.read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.bin", "state.bin"]


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
def test_an_existing_file_keeps_its_mode(tmp_path, umask):
    umask(0o077)
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    target.chmod(0o640)
    recurra.write_atomic(target, b"new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert target.read_bytes() == b"new"
