"""bfloat16 is refused by name; float16 computes with JAX's rounding after every op."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qort
from qort import _converter

X = jax.random.normal(jax.random.key(0), (64, 64))


def test_bfloat16_inputs_are_refused_by_name() -> None:
    with pytest.raises(
        qort.ExportError,
        match=r"example input 0 \('x'\) has dtype bfloat16; allowed: float32, float16",
    ):
        qort.export_function(jnp.tanh, X.astype(jnp.bfloat16), input_names=["x"])


def test_bfloat16_params_are_refused_by_name() -> None:
    model = nn.Dense(4)
    variables = jax.tree.map(lambda p: p.astype(jnp.bfloat16), model.init(jax.random.key(1), X))
    with pytest.raises(
        qort.ExportError, match=r"variables\['params'\]\['bias'\] has dtype bfloat16; allowed"
    ):
        qort.export(model, variables, X)


def test_bfloat16_computation_is_refused_by_name() -> None:
    model = nn.Dense(4, dtype=jnp.bfloat16)  # float32 params, computed in bfloat16
    variables = model.init(jax.random.key(1), X)
    with pytest.raises(
        qort.ExportError, match=r"'convert_element_type' computes in bfloat16 .*allowed: float32"
    ):
        qort.export(model, variables, X)


EXACT = {  # float16 products and sums: correctly rounded, so ONNX must equal JAX exactly
    "mul": lambda x: (x * 1.0001).astype(jnp.float16) * 3,
    "chain": lambda x: ((x * 1.0001).astype(jnp.float16) * 3 + 1).astype(jnp.float32) * 0.5,
    "two_roundings_of_one_value": lambda x: (x.astype(jnp.float16) * 0.3) + x.astype(jnp.float16),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_float16_keeps_jax_rounding(name: str) -> None:
    """ONNX Runtime dropped the rounding of a float32 -> float16 Cast (off by an ulp)."""
    fn = EXACT[name]
    exported = qort.export_function(fn, X)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    np.testing.assert_array_equal(qort.Session(exported)(X), np.asarray(fn(X)))
    assert exported.report.end_to_end == (0.0,)


def test_float16_transcendentals_validate() -> None:
    fn = lambda x: jnp.tanh(jnp.exp(x.astype(jnp.float16) * 0.5))  # noqa: E731
    exported = qort.export_function(fn, X)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    ulp = np.float32(np.finfo(np.float16).eps)
    got = np.asarray(qort.Session(exported)(X), np.float32)
    assert np.max(np.abs(got - np.asarray(fn(X), np.float32))) <= ulp


def test_validation_catches_a_rounding_onnx_runtime_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Float16 ops written as such: ONNX Runtime computes them in float32 and drops the Cast."""
    monkeypatch.setattr(_converter, "_FLOAT16_IN_FLOAT32", False)
    with pytest.raises(qort.ValidationError, match="roundings to float16 .* removed"):
        qort.export_function(EXACT["mul"], X)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int32, jnp.uint32])
@pytest.mark.parametrize("source", [jnp.float32, jnp.float16])
def test_float_to_integer_saturates_like_xla(dtype: jnp.dtype, source: jnp.dtype) -> None:
    """XLA clamps out-of-range values and sends NaN to 0; ONNX's Cast wrapped them."""
    x = jnp.array([299.6, -5.5, 1e10, -1e10, np.nan, np.inf, -np.inf, 127.9, -128.9, 3e9])
    fn = lambda v: (v * 1.0).astype(source).astype(dtype)  # noqa: E731
    exported = qort.export_function(fn, x)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    np.testing.assert_array_equal(qort.Session(exported)(x), np.asarray(fn(x)))
