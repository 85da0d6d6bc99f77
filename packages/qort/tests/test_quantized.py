"""qflax-quantized models exported: each format's ONNX ops, validated, against references."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import assert_close_to
from models import Cnn, Encoder, Mlp, token_batch

import qflax
import qort
from qflax.smoothquant import smoothquant

X = jax.random.normal(jax.random.key(0), (6, 16, 32))


def quantized(model: nn.Module, rules: list, *inputs: jax.Array) -> tuple:
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    return qmodel, qmodel.init(jax.random.key(1), *inputs)


def op_types(exported: qort.Exported) -> list[str]:
    return [n.op_type for n in exported.model.graph.node]


def test_w8a8_dense_equals_float64_reference() -> None:
    """One Dense, w8a8 per token, against qcore's formulas evaluated in float64 NumPy."""
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    x = X[0]
    qmodel, variables = quantized(nn.Dense(24), rules, x)
    exported = qort.export(qmodel, variables, x)
    got = qort.Session(exported)(x).astype(np.float64)
    kernel = variables["params"]["kernel"]
    w_codes = np.asarray(kernel.qarray.qvalue, np.float64)
    w_scale = np.asarray(kernel.qarray.scale, np.float64)
    x64 = np.asarray(x, np.float64)
    a_scale = np.max(np.abs(x64), axis=1, keepdims=True) / 127.5
    scaled = x64 / a_scale
    codes = np.clip(np.round(scaled), -128, 127)
    want = codes @ w_codes * a_scale * w_scale + np.asarray(variables["params"]["bias"])
    # float32 scales and the row's bound landing on the tie -127.5 allow one step there.
    tie = np.abs(scaled - np.round(scaled) - 0.5 * np.sign(scaled - np.round(scaled))) < 1e-4
    slack = (tie.astype(np.float64) @ np.abs(w_codes)) * a_scale * w_scale
    assert np.all(np.abs(got - want) <= slack + 1e-5 * np.max(np.abs(want)))
    assert op_types(exported).count("MatMulIntegerToFloat") == 1
    assert "MatMul" not in op_types(exported)


@pytest.mark.parametrize(
    "rule",
    [
        {"weight_qtype": "int8", "act_qtype": "int8"},
        {"weight_qtype": "int8", "act_qtype": "int8", "act_batch_axes": (0,)},
        {"weight_qtype": "int8"},
        {"weight_qtype": "int4", "tile_size": 16},
        {"weight_qtype": "int4"},
        {"weight_qtype": "uint8"},
    ],
    ids=["w8a8_token", "w8a8_sequence", "w8", "w4_t16", "w4", "wu8_asym"],
)
def test_mlp_formats_validate(rule: dict) -> None:
    if rule["weight_qtype"] == "uint8":
        rule = {**rule, "weight_calibration_method": "minmax"}
    qmodel, variables = quantized(Mlp(), [qflax.QuantizationRule(**rule)], X)
    exported = qort.export(qmodel, variables, X)
    report = exported.report
    assert report is not None and report.ok, str(report)
    dynamic = "act_qtype" in rule
    assert report.integer_sites == (3 if dynamic else 0)
    assert report.integer_kernels >= report.integer_sites
    ops = op_types(exported)
    assert ops.count("MatMulIntegerToFloat" if dynamic else "DequantizeLinear") == 3
    y = qort.Session(exported)(X)
    assert_close_to(y, qmodel.apply(variables, X), 2e-2 if dynamic else 1e-5)
    float_bytes = sum(
        np.asarray(p).nbytes for p in jax.tree.leaves(Mlp().init(jax.random.key(1), X))
    )
    assert exported.nbytes < float_bytes * (0.45 if "4" in rule["weight_qtype"] else 0.6)


def test_encoder_with_flax_attention_w8a8() -> None:
    ids, mask = token_batch()
    rules = [
        qflax.QuantizationRule(
            module_path=r".*(attention|up|down).*",
            op_names=["dot_general"],
            weight_qtype="int8",
            act_qtype="int8",
        )
    ]
    qmodel, variables = quantized(Encoder(), rules, ids, mask)
    exported = qort.export(qmodel, variables, ids, mask, input_names=["ids", "mask"])
    report = exported.report
    assert report is not None and report.ok, str(report)
    # q, k, v, out, up, down in each of 2 layers.
    assert report.integer_sites == 12 and report.integer_kernels >= 12
    # q, k and v read one activation: it is quantized once (ArgMin finds each
    # quantization's row minimum), so 4 quantizations per layer.
    assert op_types(exported).count("ArgMin") == 8
    y = qort.Session(exported)(ids, mask)
    ref = qmodel.apply(variables, ids, mask)
    cos = np.sum(y * ref, -1) / np.linalg.norm(y, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() > 0.999


def test_encoder_every_op_quantized_falls_back_op_by_op() -> None:
    """Activation-by-activation einsums (attention scores) run as integer ops too."""
    ids, mask = token_batch()
    rules = [
        qflax.QuantizationRule(module_path=r".*attention.*", weight_qtype="int8", act_qtype="int8")
    ]
    qmodel, variables = quantized(Encoder(layers=1), rules, ids, mask)
    exported = qort.export(qmodel, variables, ids, mask)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    # Scores and context op by op; query, key, value and output captured.
    assert op_types(exported).count("MatMulInteger") == 2
    assert op_types(exported).count("MatMulIntegerToFloat") == 4


def test_smoothquant_scales_carried_validate() -> None:
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    float_params = Mlp().init(jax.random.key(1), X)["params"]
    data = qflax.CalibrationData(Mlp(), float_params, [X])
    sparams = smoothquant(data, rules, alpha=0.5, progress=False)
    qmodel = qflax.quantize_model(Mlp(), qflax.PtqProvider(rules))
    exported = qort.export(qmodel, {"params": sparams}, X)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    # The carried per-channel scales divide each of the 3 layers' inputs.
    plain = qort.export(qmodel, qmodel.init(jax.random.key(1), X), X)
    assert op_types(exported).count("Div") == op_types(plain).count("Div") + 3
    assert op_types(exported).count("MatMulIntegerToFloat") == 3
    assert_close_to(qort.Session(exported)(X), qmodel.apply({"params": sparams}, X), 2e-2)


def test_weight_only_cnn() -> None:
    images = jax.random.normal(jax.random.key(3), (4, 8, 8, 1))
    rules = [qflax.QuantizationRule(weight_qtype="int8")]
    qmodel, variables = quantized(Cnn(), rules, images)
    exported = qort.export(qmodel, variables, images)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    assert op_types(exported).count("DequantizeLinear") == 3
    assert_close_to(qort.Session(exported)(images), qmodel.apply(variables, images), 1e-5)


def test_w8a8_cnn_convolutions_run_as_integer_ops() -> None:
    images = jax.random.normal(jax.random.key(3), (4, 8, 8, 1))
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    qmodel, variables = quantized(Cnn(), rules, images)
    exported = qort.export(qmodel, variables, images)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    # Both convolutions on int8 codes (ConvInteger), the Dense head captured.
    assert op_types(exported).count("ConvInteger") == 2
    assert op_types(exported).count("MatMulIntegerToFloat") == 1
    assert_close_to(qort.Session(exported)(images), qmodel.apply(variables, images), 2e-2)


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_gptq_and_awq_int4_params_validate(algorithm: str) -> None:
    """Params from qflax's GPTQ and AWQ (int4 in tiles; AWQ carries input scales)."""
    from qflax.awq import awq  # noqa: PLC0415
    from qflax.gptq import gptq  # noqa: PLC0415

    rules = [qflax.QuantizationRule(weight_qtype="int4", tile_size=16)]
    float_params = Mlp().init(jax.random.key(1), X)["params"]
    data = qflax.CalibrationData(Mlp(), float_params, [X])
    params = (gptq if algorithm == "gptq" else awq)(data, rules, progress=False)
    qmodel = qflax.quantize_model(Mlp(), qflax.PtqProvider(rules))
    exported = qort.export(qmodel, {"params": params}, X)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    assert op_types(exported).count("DequantizeLinear") == 3
    assert_close_to(qort.Session(exported)(X), qmodel.apply({"params": params}, X), 1e-5)


@pytest.mark.parametrize(("tile", "fused"), [(8, False), (16, True), (None, True)])
def test_weight_only_products_onnx_runtime_does_not_fuse_are_reported(
    tile: int | None, fused: bool
) -> None:
    """Blocks of 8 stay DequantizeLinear + float MatMul in ONNX Runtime (no MatMulNBits)."""
    rule = {"weight_qtype": "int4"} | ({} if tile is None else {"tile_size": tile})
    qmodel, variables = quantized(Mlp(), [qflax.QuantizationRule(**rule)], X)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = qort.export(qmodel, variables, X)
    report = exported.report
    assert report is not None and report.ok, str(report)
    messages = [str(w.message) for w in caught if issubclass(w.category, qort.ExportWarning)]
    if fused:
        assert report.unfused_weight_only == () and not messages
    else:
        assert report.unfused_weight_only == tuple(f"dense_{i}/dot_general0" for i in range(3))
        assert "3 weight-only products run as DequantizeLinear + float MatMul" in str(report)
        assert len(messages) == 1 and "block_size 8" in messages[0]
        assert "power of two >= 16" in messages[0]
