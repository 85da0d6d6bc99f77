"""Crash-safe writes for qflax's writers (private).

A writer builds its output in a temporary sibling of the target (same directory, so
the final rename is atomic), flushes it to disk and renames it into place. What is
at the target is replaced only when it is the writer's own kind of output and the
caller passed ``overwrite=True``; anything else is an error that touches nothing.
After a failure the directory holds exactly what it held before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from qcore.files import fsync, write_atomic


def check_target(
    target: Path,
    arg: str,
    *,
    overwrite: bool,
    what: str,
    problem: Callable[[Path], str | None],
    directory: bool = False,
) -> None:
    """Raises unless ``target`` is free or (with ``overwrite``) holds ``what``.

    Args:
        target: The absolute path to write.
        arg: The argument's name, for messages.
        overwrite: Whether the caller allows replacing a previous ``what``.
        what: What the writer writes, e.g. ``"qflax checkpoint"``.
        problem: Why an existing path is not a ``what`` (None if it is one).
        directory: Whether a ``what`` is a directory (then an empty directory at
            ``target`` counts as free).

    Raises:
        FileExistsError: If something is at ``target`` that may not be replaced.
        NotADirectoryError: If a parent of ``target`` is a file.
    """
    shown = f"{arg}={str(target)!r}"
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{shown}: {parent} is not a directory")
            break
    if target.is_symlink():
        raise FileExistsError(f"{shown} is a symbolic link; pass the path it points to")
    if not target.exists() or (directory and target.is_dir() and not any(target.iterdir())):
        return  # free, or an empty directory: nothing to lose
    why = problem(target)
    if why is not None:
        raise FileExistsError(f"{shown} is not a {what} ({why}); it was left untouched")
    if not overwrite:
        raise FileExistsError(f"{shown} already holds a {what}; pass overwrite=True to replace it")


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f"{target.name}.{kind}-{uuid.uuid4().hex[:8]}")


def _make_parents(target: Path, arg: str) -> list[Path]:
    """Creates the missing parents of ``target``; returns them (outermost first)."""
    missing = [p for p in reversed(target.parents) if not p.exists()]
    for i, p in enumerate(missing):
        try:
            p.mkdir()
        except OSError as err:
            _remove_dirs(missing[:i])
            raise _unwritable(target, arg, p.parent, err) from err
    return missing


def _remove_settled(path: Path, settle: float = 0.25, limit: float = 10.0) -> None:
    """Removes ``path``, again while a writer's unfinished work recreates files in it.

    When orbax's save raises, tensorstore may still be finishing writes it had
    started (in its own threads, a few milliseconds later); the directory is gone
    once nothing has reappeared for ``settle`` seconds.
    """
    end = time.monotonic() + limit
    while True:
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(settle)
        if not os.path.lexists(path) or time.monotonic() > end:
            return


def _remove_dirs(created: list[Path]) -> None:
    for p in reversed(created):
        with contextlib.suppress(OSError):
            p.rmdir()


def _unwritable(target: Path, arg: str, parent: Path, err: OSError) -> OSError:
    message = f"{arg}={str(target)!r}: cannot write in {parent}: {err.strerror or err}"
    return type(err)(message)


def _sync_entries(directory: Path) -> None:
    """Flushes a rename in ``directory`` to disk, if the file system can.

    Best effort: the output is complete and in place by then (some file systems
    cannot sync a directory), so a failure here does not undo the write.
    """
    with contextlib.suppress(OSError):
        fsync(directory)


def write_file(target: Path, arg: str, write: Callable[[Path], object]) -> None:
    """Writes a file with ``write(temporary path)``, then moves it onto ``target``.

    Call :func:`check_target` first. On any failure the temporary is removed (and
    parents created for it) and ``target`` is as it was
    (:func:`qcore.files.write_atomic`).
    """
    created = _make_parents(target, arg)
    try:
        write_atomic(target, write)
    except BaseException:
        _remove_dirs(created)
        raise


@contextlib.contextmanager
def new_directory(target: Path, arg: str, what: str) -> Iterator[Path]:
    """Yields an empty temporary directory that replaces ``target`` when the block ends.

    Call :func:`check_target` first. An existing ``target`` is renamed aside, the
    new directory renamed in, and only then the old one deleted; if the second
    rename fails the old one is put back. If the block or a rename fails, the
    temporary is removed and ``target`` is as it was. (A process killed between
    the two renames leaves the old directory at ``<target>.old-*``.)
    """
    created = _make_parents(target, arg)
    tmp = _sibling(target, "tmp")
    try:
        try:
            tmp.mkdir()
        except OSError as err:
            raise _unwritable(target, arg, target.parent, err) from err
        yield tmp
        fsync(tmp)
        old = None
        if target.exists():
            old = _sibling(target, "old")
            os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException as err:
            if old is not None:
                try:
                    os.replace(old, target)
                except OSError:
                    err.add_note(f"the previous {what} is at {old}")
            raise
    except BaseException:
        _remove_settled(tmp)
        _remove_dirs(created)
        raise
    _sync_entries(target.parent)
    if old is not None:
        try:
            shutil.rmtree(old)
        except OSError as err:
            warnings.warn(
                f"saved {target}, but could not remove the previous {what} (moved to {old}): {err}",
                UserWarning,
                stacklevel=3,
            )


def write_new(file: Path, data: bytes) -> None:
    """Writes ``data`` to a new file (inside a temporary directory) and flushes it."""
    with open(file, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
