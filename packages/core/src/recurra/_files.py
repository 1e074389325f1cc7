"""Atomic file writes, shared by every package that saves state (optimizers, checkpoints)."""

from __future__ import annotations

import os
import tempfile


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename itself is atomic
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where the system allows (Linux shows it
    in /proc/self/status; os.umask can only be read by setting it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode_for(path: str) -> int:
    """The permission bits open(path, "wb") would leave: an existing file keeps its own, a
    new one gets 0o666 minus the umask (tempfile.mkstemp's files are 0o600)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def write_atomic(path: str | os.PathLike[str], blob: bytes, what: str = "write the file") -> None:
    """Writes ``blob`` to ``path`` atomically: a temporary file in the same folder, flushed
    and fsync'ed, renamed over ``path``, then the folder fsync'ed. The file gets the
    permissions a plain ``open(path, "wb")`` would give it (the umask's; an existing file's
    own).

    Raises OSError "<path>: cannot <what>: <reason>"; an existing file is then left as it
    was and no temporary file stays behind."""
    p = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(p))
    tmp = None
    try:
        prefix = "." + os.path.basename(p) + "."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # not on Windows, where modes barely apply
                os.fchmod(f.fileno(), _mode_for(p))
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
        _fsync_dir(folder)
    except OSError as e:
        raise OSError(e.errno, f"{p}: cannot {what}: {e.strerror or e}") from e
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
