"""Fault injection for every qflax writer: a failure at any step keeps what was there.

Each writer (orbax :func:`checkpoint.save`, :func:`checkpoint.export_safetensors`,
:meth:`QuantizationReport.plot`) is run once with every file-system step counted,
then once per step with that step failing. After each failure the parent directory
must be byte-identical to before: the previous checkpoint or file is intact and no
temporary is left beside it.
"""

import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import qflax
from qcore.testing import assert_rejects, assert_unchanged, snapshot
from qflax import QuantizationRule as Rule
from qflax import _files, checkpoint
from qflax.report import QuantizationReport, ReportRow

X = jnp.ones((2, 16))
RULES = [Rule(weight_qtype="int8")]
QMODEL = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider(RULES))


class Injected(OSError):
    """The failure the tests inject (an OSError, like a full disk)."""


@pytest.fixture(scope="module")
def params():
    return QMODEL.init(jax.random.key(0), X)["params"]


@pytest.fixture(scope="module")
def other(params):
    return jax.tree.map(lambda a: a + jnp.ones_like(a), params)


def abstract():
    return jax.eval_shape(QMODEL.init, jax.random.key(0), X)["params"]


def assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Steps a failure is injected into: (owner, attribute, whether the step runs before failing).
STEPS = [
    (os, "replace", False),
    (os, "rename", False),
    (os, "fsync", False),
    (os, "mkdir", False),
    (shutil, "rmtree", False),
    (ocp.Checkpointer, "save", False),
    (ocp.Checkpointer, "save", True),  # the arrays are on disk when it fails
    (_files, "write_new", False),  # the metadata file qflax.json
    (_files, "write_new", True),
]


def counting(monkeypatch, owner, name, fail_at=0, after=False):
    """Wraps ``owner.name``; its ``fail_at``-th call raises Injected. Returns the call list."""
    original = getattr(owner, name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == fail_at:
            if after:
                original(*args, **kwargs)
            raise Injected(f"injected failure in {name} (call {fail_at})")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def every_failure(monkeypatch, tmp_path, make, owner, name, after=False):
    """Runs ``make(dir)()`` once per call it makes to ``owner.name``, failing that call.

    ``make`` prepares a fresh directory (the previous checkpoint or file) and returns
    the write to test. Yields ``(call number, directory, snapshot of it before the
    write, warnings, whether the write raised Injected)``.
    """
    with monkeypatch.context() as m:
        write = make(tmp_path / "count")
        calls = counting(m, owner, name)
        write()
    for k in range(1, len(calls) + 1):
        directory = tmp_path / f"fail{k}"
        write = make(directory)
        before = snapshot(directory)
        with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            counting(m, owner, name, fail_at=k, after=after)
            try:
                write()
                failed = False
            except Injected:
                failed = True
        yield k, directory, before, caught, failed


# A failure injected inside orbax makes its asyncio helpers log "Event loop is closed".
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("owner", "name", "after"), STEPS, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("previous", [False, True], ids=["new", "replace"])
def test_a_save_failing_at_any_step_keeps_the_previous_checkpoint(
    params, other, tmp_path, monkeypatch, owner, name, after, previous
):
    def make(directory):
        directory.mkdir()
        if previous:
            checkpoint.save(directory / "ckpt", params, rules=RULES)
        return lambda: checkpoint.save(directory / "ckpt", other, rules=RULES, overwrite=True)

    raised = 0
    for k, directory, before, caught, failed in every_failure(
        monkeypatch, tmp_path, make, owner, name, after
    ):
        if failed:
            raised += 1
            assert_unchanged(before, directory)
            if previous:
                assert_identical(checkpoint.load(directory / "ckpt", abstract()), params)
            continue
        # Only the steps after the swap may fail without an error: syncing the parent
        # (best effort) and deleting the replaced checkpoint (a warning names what is
        # left). The new checkpoint is complete and in place.
        assert (owner, name) in [(shutil, "rmtree"), (os, "fsync")], f"call {k} of {name}"
        if name == "rmtree":
            message = "could not remove the previous qflax checkpoint"
            assert any(message in str(w.message) for w in caught)
        assert_identical(checkpoint.load(directory / "ckpt", abstract()), other)
    if name in ("replace", "save", "fsync", "write_new") or (name == "mkdir" and not previous):
        assert raised  # the step is really taken, and its failure is reported


@pytest.mark.parametrize("name", ["replace", "fsync", "open"])
@pytest.mark.parametrize("previous", [False, True], ids=["new", "replace"])
def test_an_export_failing_at_any_step_keeps_the_previous_file(
    params, other, tmp_path, monkeypatch, name, previous
):
    def make(directory):
        directory.mkdir()
        if previous:
            checkpoint.export_safetensors(directory / "q.safetensors", params, rules=RULES)
        return lambda: checkpoint.export_safetensors(
            directory / "q.safetensors", other, rules=RULES, overwrite=True
        )

    outcomes = list(every_failure(monkeypatch, tmp_path, make, os, name))
    assert outcomes
    for k, directory, before, _, failed in outcomes:
        if failed:
            assert_unchanged(before, directory)
            if previous:
                got = checkpoint.import_safetensors(directory / "q.safetensors", abstract())
                assert_identical(got, params)
        else:  # only syncing the directory (opening it, fsync) after the rename is best effort
            assert name in ("fsync", "open"), f"call {k} of {name} failed silently"
            got = checkpoint.import_safetensors(directory / "q.safetensors", abstract())
            assert_identical(got, other)


def test_an_export_failing_inside_save_file_leaves_no_partial_file(params, tmp_path, monkeypatch):
    import safetensors.numpy

    target = tmp_path / "q.safetensors"
    checkpoint.export_safetensors(target, params)
    before = snapshot(tmp_path)
    original = safetensors.numpy.save_file

    def half(tensors, filename, metadata=None):
        original(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise Injected("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", half)
    with pytest.raises(Injected):
        checkpoint.export_safetensors(target, params, overwrite=True)
    assert_unchanged(before, tmp_path)


def report():
    row = ReportRow("Dense_0", "dot_general", ((2, 16), (16, 8)), ("Dense_0/kernel",),
                    "int8", None, None, 160, 544, 40.0, 38.5)  # fmt: skip
    return QuantizationReport((row,), 38.5, 160, 544)


@pytest.mark.parametrize("name", ["replace", "fsync"])
@pytest.mark.parametrize("previous", [False, True], ids=["new", "replace"])
def test_a_report_plot_failing_at_any_step_keeps_the_previous_png(
    tmp_path, monkeypatch, name, previous
):

    def make(directory):
        directory.mkdir()
        if previous:
            report().plot(directory / "report.png")
        return lambda: report().plot(directory / "report.png", overwrite=True)

    outcomes = list(every_failure(monkeypatch, tmp_path, make, os, name))
    assert outcomes
    for k, directory, before, _, failed in outcomes:
        if failed:
            assert_unchanged(before, directory)
        else:  # only syncing the directory (opening it, fsync) after the rename is best effort
            assert name in ("fsync", "open"), f"call {k} of {name} failed silently"
            assert (directory / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_a_report_plot_never_replaces_other_files(tmp_path):
    notes = tmp_path / "notes.png"
    notes.write_text("not a picture")
    assert_rejects(lambda: report().plot(notes, overwrite=True), FileExistsError,
                   str(notes), "not a PNG", unchanged=(tmp_path,))  # fmt: skip
    theirs = tmp_path / "theirs.png"  # a valid PNG someone else made
    theirs.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x00IEND\xaeB`\x82")
    assert_rejects(
        lambda: report().plot(theirs, overwrite=True),
        FileExistsError,
        str(theirs),
        "not a PNG",
        "QuantizationReport",
        unchanged=(tmp_path,),
    )
    theirs.unlink()
    png = report().plot(tmp_path / "r.png")
    assert_rejects(lambda: report().plot(png), FileExistsError, str(png), "overwrite=True",
                   unchanged=(tmp_path,))  # fmt: skip
    assert report().plot(png, overwrite=True) == png
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.png", "r.png"]


KILL = """
import os, jax, jax.numpy as jnp, flax.linen as nn
import qflax
from qflax import checkpoint

x = jnp.ones((2, 16))
rules = [qflax.QuantizationRule(weight_qtype="int8")]
qmodel = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider(rules))
params = qmodel.init(jax.random.key(0), x)["params"]
checkpoint.save("{dir}", params)
original, calls = os.replace, []

def die(src, dst):
    calls.append(dst)
    if str(dst) == "{dir}":  # the new checkpoint is about to move in: the old one is aside
        os._exit(3)
    return original(src, dst)

os.replace = die
checkpoint.save("{dir}", jax.tree.map(jnp.zeros_like, params), overwrite=True)
"""


def test_a_kill_between_the_two_renames_leaves_the_previous_checkpoint_loadable(params, tmp_path):
    target = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(KILL).format(dir=target)],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 3, out.stderr[-2000:]
    assert not target.exists()
    with pytest.warns(UserWarning, match="loading the previous checkpoint"):
        restored = checkpoint.load(target, abstract())
    assert_identical(restored, params)
    # A new save goes to the free path; the left-over previous checkpoint is not touched.
    left = sorted(p.name for p in tmp_path.iterdir())
    checkpoint.save(target, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*left, "ckpt"])
