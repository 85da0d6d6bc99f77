"""qcore.files.write_atomic: the old file or the new one, never half of either, no leftovers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from qcore import files
from qcore.testing import assert_rejects, assert_unchanged, snapshot


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "model.bin").write_bytes(b"old model")
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path


def test_writes_new_file_with_default_permissions(tmp_path: Path) -> None:
    target = files.write_atomic(tmp_path / "a.bin", b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_replaces_a_file_and_accepts_a_writer_function(folder: Path) -> None:
    files.write_atomic(folder / "model.bin", lambda p: p.write_bytes(b"new model"))
    assert (folder / "model.bin").read_bytes() == b"new model"
    assert sorted(p.name for p in folder.iterdir()) == ["model.bin", "notes.txt"]


class Boom(Exception):
    pass


def _raise(*args: object, **kwargs: object) -> None:
    raise Boom


@pytest.mark.parametrize("step", ["write", "fsync", "replace"])
def test_a_failure_at_any_step_leaves_the_old_file_and_no_temporary(
    folder: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    before = snapshot(folder)
    data: object = b"new model"
    if step == "write":
        data = lambda p: (p.write_bytes(b"half"), _raise())  # noqa: E731 - fails after writing
    else:
        monkeypatch.setattr(files.os, step, _raise)
    with pytest.raises(Boom):
        files.write_atomic(folder / "model.bin", data)  # type: ignore[arg-type]
    assert_unchanged(before, folder)


def test_keyboard_interrupt_is_cleaned_up_too(folder: Path) -> None:
    before = snapshot(folder)

    def interrupted(p: Path) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(folder / "model.bin", interrupted)
    assert_unchanged(before, folder)


def test_never_replaces_a_directory_or_what_replace_refuses(folder: Path) -> None:
    (folder / "sub").mkdir()
    (folder / "sub" / "keep.txt").write_text("keep")
    assert_rejects(
        lambda: files.write_atomic(folder / "sub", b"x"),
        FileExistsError,
        "path=",
        "sub",
        "not a file",
        unchanged=(folder,),
    )
    assert_rejects(
        lambda: files.write_atomic(folder / "notes.txt", b"x", replace=lambda p: False),
        FileExistsError,
        "notes.txt",
        "may not be replaced",
        unchanged=(folder,),
    )
    assert_rejects(
        lambda: files.write_atomic(folder / "missing" / "a.bin", b"x"),
        FileNotFoundError,
        "missing",
        "does not exist",
        unchanged=(folder,),
    )


def test_never_replaces_a_symbolic_link(folder: Path) -> None:
    # It used to replace the link by a regular file, leaving its target stale.
    for link, points_to in (("link.bin", "model.bin"), ("dangling.bin", "missing.bin")):
        (folder / link).symlink_to(folder / points_to)
        assert_rejects(
            lambda link=link: files.write_atomic(folder / link, b"new"),
            FileExistsError,
            f"path={str(folder / link)!r}",
            "is a symbolic link; pass the path it points to",
            unchanged=(folder,),
        )
        assert (folder / link).is_symlink()
    assert (folder / "model.bin").read_bytes() == b"old model"


def test_replace_is_asked_only_about_existing_files(tmp_path: Path) -> None:
    asked: list[Path] = []
    files.write_atomic(tmp_path / "a", b"1", replace=lambda p: asked.append(p) or True)
    assert asked == []
    files.write_atomic(tmp_path / "a", b"2", replace=lambda p: asked.append(p) or True)
    assert asked == [tmp_path / "a"]
    assert (tmp_path / "a").read_bytes() == b"2"


def test_an_unwritable_directory_is_named(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> int:
        raise PermissionError(13, "Permission denied")

    before = snapshot(folder)
    monkeypatch.setattr(files.os, "open", refuse)
    assert_rejects(
        lambda: files.write_atomic(folder / "model.bin", b"x"),
        PermissionError,
        str(folder / "model.bin"),
        f"cannot write in {folder}",
        "Permission denied",
    )
    monkeypatch.undo()
    assert_unchanged(before, folder)
