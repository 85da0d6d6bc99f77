"""Bad models and arguments: clear errors naming the op, the format or the argument."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from models import Mlp

import qflax
import qort

X = jax.random.normal(jax.random.key(0), (4, 64))


def test_unsupported_primitive_is_named() -> None:
    with pytest.raises(qort.ExportError, match="'nextafter' has no ONNX lowering"):
        qort.export_function(lambda x: jnp.nextafter(x, 0.0), X)


def test_nf4_weights_have_no_onnx_type() -> None:
    rules = [qflax.QuantizationRule(weight_qtype="nf4", tile_size=16)]
    qmodel = qflax.quantize_model(Mlp(), qflax.PtqProvider(rules))
    variables = qmodel.init(jax.random.key(1), X)
    with pytest.raises(
        qort.ExportError, match="dense_0/dot_general0: weight qtype 'nf4' has no ONNX"
    ):
        qort.export(qmodel, variables, X)


def test_w8a8_with_tiled_weights_is_refused() -> None:
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8", tile_size=16)]
    qmodel = qflax.quantize_model(Mlp(), qflax.PtqProvider(rules))
    variables = qmodel.init(jax.random.key(1), X)
    with pytest.raises(qort.ExportError, match="w8a8 export needs .* without tile_size"):
        qort.export(qmodel, variables, X)


def test_qat_model_is_refused() -> None:
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    qmodel = qflax.quantize_model(Mlp(), qflax.QtProvider(rules))
    variables = qmodel.init(jax.random.key(1), X)
    with pytest.raises(
        qort.ExportError, match="provider is a QtProvider; allowed: qflax.PtqProvider"
    ):
        qort.export(qmodel, variables, X)


def test_bad_arguments() -> None:
    with pytest.raises(
        qort.ExportError, match="model is a function; allowed: a Flax Linen or NNX module"
    ):
        qort.export(lambda x: x, {}, X)
    with pytest.raises(qort.ExportError, match="fn is an int; allowed: a callable"):
        qort.export_function(3, X)
    with pytest.raises(qort.ExportError, match="example input 0 is a str"):
        qort.export_function(lambda x: x, "x")
    with pytest.raises(qort.ExportError, match="model is an object; allowed: a Flax Linen"):
        qort.export(object(), {}, X)
    with pytest.raises(qort.ExportError, match=r"input_names=\['a', 'a'\]; allowed: 2 distinct"):
        qort.export_function(lambda x, y: x + y, X, X, input_names=["a", "a"])
    with pytest.raises(
        qort.ExportError, match="output_names has 2 names but the function returns 1"
    ):
        qort.export_function(lambda x: x * 2, X, output_names=["a", "b"])


def test_float_model_exports_without_rules() -> None:
    model = nn.Dense(3)
    variables = model.init(jax.random.key(0), X)
    exported = qort.export(model, variables, X)
    assert exported.report is not None and exported.report.integer_sites == 0
