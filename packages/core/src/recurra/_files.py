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


def write_atomic(path: str | os.PathLike[str], blob: bytes, what: str = "write the file") -> None:
    """Writes ``blob`` to ``path`` atomically: a temporary file in the same folder, flushed
    and fsync'ed, renamed over ``path``, then the folder fsync'ed.

    Raises OSError "<path>: cannot <what>: <reason>"; an existing file is then left as it
    was and no temporary file stays behind."""
    p = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(p))
    tmp = None
    try:
        prefix = "." + os.path.basename(p) + "."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
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
