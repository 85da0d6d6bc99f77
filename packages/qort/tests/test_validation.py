"""Validation judges each op on its own: deep models pass, one wrong op is named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from models import Mlp
from onnx import numpy_helper

import qflax
import qort
from qort import _converter
from qort._capture import CaptureProvider
from qort.validation import validate

X = jax.random.normal(jax.random.key(0), (4, 32))


def deep(x: jax.Array) -> jax.Array:
    """50 Dense-like layers with tanh: errors would compound end to end."""
    for i in range(50):
        w = jax.random.normal(jax.random.key(i), (32, 32)) / np.sqrt(32)
        x = jnp.tanh(x @ w * 1.5)
    return x


def test_fifty_layers_pass_one_by_one() -> None:
    exported = qort.export_function(deep, X)
    assert exported.report is not None and exported.report.ok
    assert len(exported.report.units) >= 100


def test_one_wrong_weight_is_named() -> None:
    conv = _converter.convert(deep, (X,), {}, ["x"], None)
    # Corrupt the initializer of one MatMul in the middle (layer 30's weight).
    matmuls = [n for n in conv.model.graph.node if n.op_type == "MatMul"]
    _corrupt(conv, matmuls[30].input[1], 1.01)
    report = validate(conv)
    assert not report.ok
    assert len(report.failures) == 1
    assert report.failures[0].label == "dot_general"
    assert "FAIL dot_general" in str(report)


def _corrupt(conv: _converter.Converted, name: str, factor: float) -> None:
    for init in conv.model.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * factor, name))
            conv.graph.initializers[name] = init


def test_wrong_weight_scale_of_quantized_site_is_named() -> None:
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    qmodel = qflax.quantize_model(Mlp(), qflax.PtqProvider(rules))
    variables = qmodel.init(jax.random.key(1), X)
    capture = CaptureProvider(rules)
    model = qflax.quantize_model(qmodel, capture, methods=qmodel.methods)
    conv = _converter.convert(lambda x: model.apply(variables, x), (X,), capture.sites, ["x"], None)
    assert validate(conv).ok
    (unit,) = [u for u in conv.graph.units if u.source == "dense_1/dot_general0"]
    nodes = [conv.graph.nodes[k] for k in unit.nodes]
    (product,) = [n for n in nodes if n.op_type == "MatMulIntegerToFloat"]
    _corrupt(conv, product.input[3], 1.01)  # the weight scales
    report = validate(conv)
    assert [u.source for u in report.failures] == ["dense_1/dot_general0"]
    assert "exact integer product" in report.failures[0].detail
