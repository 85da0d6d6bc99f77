"""Outputs that are inputs, constants, repeats or None; the output structure everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qort

X = jax.random.normal(jax.random.key(0), (2, 3))

PASS_THROUGH = {
    "input": lambda x: x,
    "input_twice": lambda x: (x, x),
    "constant": lambda x: jnp.ones(3),
    "computed_twice": lambda x: (lambda y: (y, y))(x + 1),
    "mixed": lambda x: {"a": x, "b": None, "c": (jnp.arange(3), x * 2), "d": [x]},
}


def _same(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, np.asarray(w))


@pytest.mark.parametrize("name", sorted(PASS_THROUGH))
def test_outputs_that_are_inputs_or_constants(name: str) -> None:
    fn = PASS_THROUGH[name]
    exported = qort.export_function(fn, X)
    assert exported.report is not None and exported.report.ok
    _same(qort.Session(exported)(X), fn(X))


def test_a_function_without_outputs_is_refused() -> None:
    with pytest.raises(
        qort.ExportError,
        match=r"returns no arrays \(output structure PyTreeDef\(None\)\); allowed: at least one",
    ):
        qort.export_function(lambda x: None, X)


@pytest.mark.parametrize("name", ["input", "input_twice", "mixed"])
def test_a_saved_model_returns_the_same_structure(name: str, tmp_path: Path) -> None:
    """The output structure travels in the file's metadata (it was a flat tuple)."""
    fn = PASS_THROUGH[name]
    path = qort.export_function(fn, X).save(tmp_path / "m.onnx")
    _same(qort.Session(path)(X), fn(X))


def test_one_element_tuple_and_nested_outputs_from_a_file(tmp_path: Path) -> None:
    fn = lambda x: ((x * 2,), {"z": [x + 1, {"y": x.sum()}], "a": ()})  # noqa: E731
    path = qort.export_function(fn, X).save(tmp_path / "m.onnx")
    _same(qort.Session(path)(X), fn(X))


def test_pytree_inputs_are_taken_as_leaves_in_jax_tree_order(tmp_path: Path) -> None:
    fn = lambda d: d["b"] - d["a"]  # noqa: E731
    inputs = {"b": X, "a": X * 3}
    exported = qort.export_function(fn, inputs)
    assert exported.input_names == ["input_0", "input_1"]  # "a" then "b": sorted keys
    got = qort.Session(exported)(*jax.tree.leaves(inputs))
    np.testing.assert_array_equal(got, np.asarray(fn(inputs)))
