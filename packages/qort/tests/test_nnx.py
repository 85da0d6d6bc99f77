"""NNX models, quantized in place by qflax, exported like Linen ones."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import assert_close_to
from flax import nnx

import qflax
import qort

X = jax.random.normal(jax.random.key(0), (2, 8, 32))
W8A8 = [qflax.QuantizationRule(op_names=["dot_general"], weight_qtype="int8", act_qtype="int8")]


class Block(nnx.Module):
    """A transformer block from Flax's own NNX layers."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attention = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x + self.attention(x))
        return x + self.down(nnx.gelu(self.up(x)))


def test_quantized_nnx_model_exports_with_integer_products() -> None:
    model = qflax.quantize_model(Block(nnx.Rngs(0)), qflax.PtqProvider(W8A8), X)
    provider, want = model.qflax_provider, model(X)
    exported = qort.export(model, X)
    report = exported.report
    assert report is not None and report.ok, str(report)
    # query, key, value, out, up, down; query, key and value share one quantization.
    assert report.integer_sites == 6 and report.integer_kernels >= 6
    ops = [n.op_type for n in exported.model.graph.node]
    assert ops.count("MatMulIntegerToFloat") == 6 and ops.count("ArgMin") == 4
    assert_close_to(qort.Session(exported)(X), want, 1e-5)
    # The user's model is untouched: same provider, same outputs.
    assert model.qflax_provider is provider
    np.testing.assert_array_equal(model(X), want)


def test_float_nnx_model_exports() -> None:
    model = Block(nnx.Rngs(1))
    exported = qort.export(model, X)
    assert exported.report is not None and exported.report.ok
    assert_close_to(qort.Session(exported)(X), model(X), 1e-5)


def test_nnx_qat_model_is_refused() -> None:
    model = qflax.quantize_model(Block(nnx.Rngs(0)), qflax.QtProvider(W8A8), X)
    with pytest.raises(qort.ExportError, match="QtProvider; allowed: qflax.PtqProvider"):
        qort.export(model, X)


class TwoMethods(nnx.Module):
    """A classifier with an encoder method of other inputs (from a new user's trial)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(50, 32, rngs=rngs)
        self.body = nnx.Linear(32, 32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.body(x))) + z

    def encode(self, ids: jax.Array) -> jax.Array:
        return self.body(self.embed(ids))


def test_quantized_nnx_model_exports_another_method() -> None:
    x, z = X[0, :4], jax.numpy.ones((4, 4))
    ids = jax.numpy.arange(8).reshape(2, 4)
    rules = [qflax.QuantizationRule(op_names=["dot_general"], weight_qtype="int8")]
    model = qflax.quantize_model(
        TwoMethods(nnx.Rngs(0)), qflax.PtqProvider(rules), x, z, methods=("__call__", "encode")
    )
    exported = qort.export(model, ids, method="encode")
    assert exported.report is not None and exported.report.ok, str(exported.report)
    assert_close_to(qort.Session(exported)(ids), model.encode(ids), 1e-5)
    only_call = qflax.quantize_model(TwoMethods(nnx.Rngs(0)), qflax.PtqProvider(rules), x, z)
    with pytest.raises(qort.ExportError, match="method='encode' is not one of the quantized"):
        qort.export(only_call, ids, method="encode")


class Trainable(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(32, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.norm(self.linear(x)))


def test_nnx_model_in_training_mode_is_refused() -> None:
    model = Trainable(nnx.Rngs(0))
    with pytest.raises(qort.ExportError, match=r"call model\.eval\(\) first"):
        qort.export(model, X)
    model.eval()
    exported = qort.export(model, X)
    assert_close_to(qort.Session(exported)(X), model(X), 1e-5)
