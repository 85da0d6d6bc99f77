"""Atomic file writes: a file is either its old self or completely new, never half written.

The packages built on qcore (checkpoints, ``.tflite`` models, reports) and the
examples and benchmarks write through :func:`write_atomic`: it writes a temporary
sibling of the target, flushes it to disk, then renames it over the target in one
step. A failure at any point (a full disk, an exception while producing the bytes,
an interrupted process) leaves the target as it was and removes the temporary.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from qcore.files import write_atomic
    >>> target = Path(tempfile.mkdtemp()) / "results.json"
    >>> write_atomic(target, b'{"ok": true}')
    PosixPath('.../results.json')
    >>> target.read_bytes()
    b'{"ok": true}'
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

__all__ = ["fsync", "write_atomic"]


def write_atomic(
    path: str | os.PathLike,
    data: bytes | Callable[[Path], object],
    *,
    replace: Callable[[Path], bool] | None = None,
) -> Path:
    """Writes ``data`` to ``path`` atomically; returns the path written.

    Args:
        path: The file to write. Its directory must exist.
        data: The bytes to write, or a function that writes the file at the
            temporary path it is given (e.g. ``lambda p: fig.savefig(p, format="png")``
            or ``lambda p: safetensors.numpy.save_file(tensors, p)``); anything it
            raises aborts the write.
        replace: Decides whether an existing file at ``path`` may be replaced (it is
            given the path). ``None`` replaces any regular file. A directory, a
            symbolic link or other non-file at ``path`` is never replaced.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        FileExistsError: If ``path`` is a directory, a symbolic link or another
            non-file, or an existing file that ``replace`` refuses; nothing is
            written then.
        FileNotFoundError: If the directory of ``path`` does not exist.
        PermissionError: If the directory of ``path`` is not writable (the message
            names the path and the directory).
    """
    target = Path(path)
    if target.is_symlink():  # replacing it would leave the file it points to stale
        raise FileExistsError(
            f"path={str(target)!r} is a symbolic link; pass the path it points to"
        )
    if target.exists():
        if not target.is_file():
            raise FileExistsError(f"path={str(target)!r} exists and is not a file; not replaced")
        if replace is not None and not replace(target):
            raise FileExistsError(f"path={str(target)!r} exists and may not be replaced")
    directory = target.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"path={str(target)!r}: its directory does not exist")
    fd, tmp = _create_temporary(target)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes | bytearray | memoryview):
                f.write(data)
        if callable(data):
            data(tmp)
        fsync(tmp)  # reopened: a writer may have replaced the file at tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # some file systems cannot sync a directory
        fsync(directory)  # the rename
    return target


def _create_temporary(target: Path) -> tuple[int, Path]:
    """Creates a new hidden sibling of ``target`` with the permissions a new file gets."""
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:  # 0o666 less the umask, like open(); mkstemp would make it 0o600
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # pragma: no cover - a 32-bit name collision
            continue
        except OSError as err:
            message = f"path={str(target)!r}: cannot write in {target.parent}: {err.strerror}"
            raise type(err)(err.errno, message) from err


def fsync(path: str | os.PathLike) -> None:
    """Flushes a file, or a directory's entries (e.g. a rename in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
