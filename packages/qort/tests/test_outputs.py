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
    with pytest.raises(qort.ExportError, match=r"returns no arrays \(output structure PyTreeDef\(None\)\); allowed: at least one"):
        qort.export_function(lambda x: None, X)
