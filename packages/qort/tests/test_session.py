"""The runner's input checks, and saving that never loses a file."""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import onnx
import pytest

import qort

FN = lambda ids, x: x[ids]  # noqa: E731 - a lookup: int32 ids and a float table
IDS = jnp.array([0, 2, 1], jnp.int32)
TABLE = jnp.arange(12.0).reshape(4, 3)


@pytest.fixture(scope="module")
def exported() -> qort.Exported:
    return qort.export_function(FN, IDS, TABLE, input_names=["ids", "table"])


def test_runs_numpy_jax_and_by_name(exported: qort.Exported) -> None:
    session = qort.Session(exported, threads=1)
    np.testing.assert_array_equal(session(IDS, TABLE), np.asarray(FN(IDS, TABLE)))
    np.testing.assert_array_equal(
        session(np.array([3, 3, 0]), np.asarray(TABLE, np.float64))[0], TABLE[3]
    )
    (y,) = session.run({"ids": IDS, "table": TABLE})
    np.testing.assert_array_equal(y, np.asarray(FN(IDS, TABLE)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((IDS,), "got 1 inputs; the model takes 2: ids"),
        ((IDS[:2], TABLE), r"input 'ids' has shape \(2,\); the model takes \(3,\)"),
        ((IDS, TABLE.astype(jnp.int32)), "input 'table' has dtype int32; the model takes float32"),
        ((IDS.astype(jnp.float32), TABLE), "input 'ids' has dtype float32; the model takes int32"),
        ((np.array([0, 1, 2**40]), TABLE), "outside int32's range"),
        ((object(), TABLE), "input 'ids' is an object; allowed: an array"),
        ((None, TABLE), "input 'ids' is None; allowed: an array"),
        (("0 2 1", TABLE), "input 'ids' is a str; allowed: an array"),
        ((IDS, [[0.0] * 3] * 4), None),
    ],
)
def test_bad_inputs_name_the_input(
    exported: qort.Exported, args: tuple, message: str | None
) -> None:
    if message is None:  # nested lists are arrays
        qort.Session(exported)(*args)
        return
    with pytest.raises(ValueError, match=message):
        qort.Session(exported)(*args)


def test_run_by_name_checks_names(exported: qort.Exported) -> None:
    session = qort.Session(exported)
    with pytest.raises(ValueError, match="unknown inputs \\['tabel'\\]"):
        session.run({"ids": IDS, "tabel": TABLE})
    with pytest.raises(ValueError, match="input 'table' is missing"):
        session.run({"ids": IDS})


def test_session_from_file_and_bad_sources(exported: qort.Exported, tmp_path: Path) -> None:
    path = exported.save(tmp_path / "m.onnx")
    np.testing.assert_array_equal(qort.Session(path)(IDS, TABLE), np.asarray(FN(IDS, TABLE)))
    np.testing.assert_array_equal(
        qort.Session(onnx.load(path))(IDS, TABLE), np.asarray(FN(IDS, TABLE))
    )
    with pytest.raises(ValueError, match="is not a file"):
        qort.Session(tmp_path / "missing.onnx")
    with pytest.raises(
        TypeError, match="model is an int; allowed: qort.Exported, onnx.ModelProto or a path"
    ):
        qort.Session(42)
    with pytest.raises(ValueError, match="threads=0; allowed: a positive int"):
        qort.Session(exported, threads=0)


def test_save_replaces_atomically_and_keeps_files_on_failure(
    exported: qort.Exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"the user's previous file")
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / "keep.txt").write_text("kept")
    with pytest.raises(ValueError, match="is a directory"):
        exported.save(directory)
    assert (directory / "keep.txt").read_text() == "kept"
    with pytest.raises(ValueError, match="does not exist"):
        exported.save(tmp_path / "nowhere" / "m.onnx")

    def fail(*args: object) -> None:
        raise OSError("disk full")

    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        exported.save(target)
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        exported.save(target, overwrite=True)
    monkeypatch.undo()
    assert target.read_bytes() == b"the user's previous file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "model.onnx"]
    exported.save(target, overwrite=True)
    assert onnx.load(target).graph.input[0].name == "ids"


def test_saved_file_has_the_permissions_of_a_new_file(
    exported: qort.Exported, tmp_path: Path
) -> None:
    """A saved model is readable like any file the user creates (not the 0600 of a temp file)."""
    reference = tmp_path / "reference"
    reference.write_bytes(b"")
    saved = exported.save(tmp_path / "model.onnx")
    assert saved.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777


def test_save_and_load_expand_the_home_directory(
    exported: qort.Exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    path = exported.save("~/m.onnx")
    assert path == tmp_path / "m.onnx" and path.is_file()
    assert not Path("~").exists()
    np.testing.assert_array_equal(qort.Session("~/m.onnx")(IDS, TABLE), np.asarray(FN(IDS, TABLE)))
