"""16x8 models (int16 activations, int8 weights) with the ops transformers use.

LiteRT's int16 kernels are stricter than its int8 ones: an int16 ``ADD`` takes two
operands of one shape (litert-converter refuses a broadcast), and ``TANH`` needs the
output scale 2^-15. Each model here is exported (validated layer by layer) and
compared with the float model.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlitert
from qlitert import qdq

INT16 = [qlitert.Rule(module_path=".*", act_qtype="int16", weight_qtype="int8")]
ROW = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(1, 1, 16)


class LayerNormDense(nn.Module):
    """A pre-norm residual block without attention: LayerNorm, Dense, gelu, Dense, add."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32)(nn.LayerNorm()(x))
        return x + nn.Dense(16)(nn.gelu(h))


def block(x):
    variables = LayerNormDense().init(jax.random.key(0), x)
    return LayerNormDense().apply(variables, x)


CASES = {
    "tanh": (lambda x: jnp.tanh(x), {"TANH"}),
    "add a scalar": (lambda x: jnp.tanh(x) + 0.5, {"TANH", "ADD"}),
    "add a row": (lambda x: jnp.tanh(x) + ROW, {"TANH", "ADD"}),
    "residual": (lambda x: x + jnp.tanh(x), {"TANH", "ADD"}),
    "layer norm block": (block, {"MEAN", "SUB", "MUL", "ADD", "RSQRT", "FULLY_CONNECTED"}),
}
# Relative L2 error of the 16x8 model against the float model, calibrated on the
# input itself, measured: 4e-5 to 1e-4 for the single ops; 3.7e-3 for the block,
# whose int8 weights dominate.
REL_ERR = {"layer norm block": 1e-2}


@pytest.mark.parametrize("name", list(CASES))
def test_int16_ops_export_and_track_the_float_model(name):
    fn, expected_ops = CASES[name]
    x = np.random.default_rng(0).normal(size=(2, 8, 16)).astype(np.float32)
    # Calibrated on x itself: nothing is clipped, the error is int16 rounding alone.
    annotated = qlitert.annotate(fn, qlitert.calibrate(fn, [x], rules=INT16))
    tflite = qlitert.export(annotated, x)  # validated layer by layer
    report = qlitert.inspect(tflite)
    assert expected_ops <= set(report.op_names())
    # (A layer norm's RSQRT is float: test_an_int16_layer_norm_computes_its_rsqrt_in_float.)
    computing = [op for op in report.ops if op.name not in ("QUANTIZE", "DEQUANTIZE", "RSQRT")]
    assert all(report.tensors[op.outputs[0]].dtype == "INT16" for op in computing)
    got = qlitert.LiteRTModel(tflite)(x)
    want = np.asarray(fn(x))
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error < REL_ERR.get(name, 1e-3), error


def test_litert_int16_rsqrt_is_rejected_where_it_misses_jax():
    """LiteRT 2.3.0's int16 RSQRT: 44 int16 steps off on inputs in [0.5, 1.7] (15 of
    4,096 values over four steps) and thousands on [0.01, 10]; the validation must
    reject such a model, naming the op (annotated by hand: qlitert's interpreter
    computes an int16 module's rsqrt in float)."""
    s_in, z_in = qdq.activation_params(0.0, 10.0, qtype="int16")
    s_out, z_out = qdq.activation_params(0.0, 10.0, qtype="int16")

    def fn(x):
        v = qdq.fake_quant(x, s_in, z_in, qtype="int16")
        return qdq.fake_quant(jax.lax.rsqrt(v), s_out, z_out, qtype="int16")

    x = np.linspace(0.01, 10.0, 4096, dtype=np.float32).reshape(1, 4096)
    with pytest.raises(qlitert.ExportError, match=r"at op \d+ RSQRT .* more than 4 step"):
        qlitert.export(fn, x)


def test_an_int16_layer_norm_computes_its_rsqrt_in_float():
    """One value per row between a DEQUANTIZE and a QUANTIZE; everything else int16."""

    def fn(x):
        return jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * x

    x = (np.random.default_rng(0).normal(size=(2, 8, 16)) * np.geomspace(0.05, 20, 16)).astype(
        np.float32
    )
    tflite = qlitert.export(qlitert.annotate(fn, qlitert.calibrate(fn, [x], rules=INT16)), x)
    report = qlitert.inspect(tflite)
    (rsqrt,) = [op for op in report.ops if op.name == "RSQRT"]
    assert report.op_types(rsqrt) == (["FLOAT32"], ["FLOAT32"])
    assert report.tensors[rsqrt.outputs[0]].shape == (2, 8, 1)
    others = [op for op in report.ops if op.name not in ("RSQRT", "QUANTIZE", "DEQUANTIZE")]
    assert all(report.op_types(op)[1] == ["INT16"] for op in others)
    got = qlitert.LiteRTModel(tflite)(x)
    want = np.asarray(fn(x))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3


def test_an_int16_add_broadcasting_an_activation_exports():
    """An attention mask's bias, (batch, 1, 1, keys), added to the scores: LiteRT's
    int16 ADD takes operands of one shape, and litert-converter 0.5.0 folds an
    explicit broadcast back into it (then refuses the ADD), so the broadcast
    operand is requantized to itself after the broadcast, behind a barrier."""

    def fn(scores, mask):
        bias = jnp.where(mask[:, None, None, :] > 0, 0.0, -8.0)
        return jax.nn.softmax(scores + bias, axis=-1)

    rng = np.random.default_rng(0)
    scores = rng.normal(size=(1, 2, 4, 8)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0, 0, 0]], np.int32)  # token ids' mask
    cal = qlitert.calibrate(fn, [(scores, mask)], rules=INT16)
    tflite = qlitert.export(qlitert.annotate(fn, cal), scores, mask)  # validated
    report = qlitert.inspect(tflite)
    (add,) = [op for op in report.ops if op.name == "ADD"]
    assert [report.tensors[i].shape for i in add.inputs] == [(1, 2, 4, 8)] * 2
    assert report.op_types(add)[1] == ["INT16"]
    got = qlitert.LiteRTModel(tflite)(scores, mask)
    np.testing.assert_allclose(got, fn(scores, mask), atol=1e-3)


def test_an_int16_tanh_has_litert_fixed_output_parameters():
    fn = jnp.tanh
    x = np.random.default_rng(0).normal(size=(1, 32)).astype(np.float32)
    tflite = qlitert.export(qlitert.annotate(fn, qlitert.calibrate(fn, [x], rules=INT16)), x)
    report = qlitert.inspect(tflite)
    (tanh,) = [op for op in report.ops if op.name == "TANH"]
    out = report.tensors[tanh.outputs[0]]
    assert out.scale == (2.0**-15,) and out.zero_point == (0,)


@pytest.mark.parametrize("qtype", ["int8", "int16"])
def test_a_cube_is_two_integer_muls(qtype):
    """x**3 (in the tanh gelu, unfused under int16): litert-converter made it two float
    MULs between a DEQUANTIZE and a QUANTIZE; now each product has its own site."""

    def fn(x):
        return x**3

    rules = [qlitert.Rule(module_path=".*", act_qtype=qtype, weight_qtype="int8")]
    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    tflite = qlitert.export(qlitert.annotate(fn, qlitert.calibrate(fn, [x], rules=rules)), x)
    assert qlitert.inspect(tflite).op_names() == ["QUANTIZE", "MUL", "MUL", "DEQUANTIZE"]
    got = qlitert.LiteRTModel(tflite)(x)
    error = np.linalg.norm(got - x**3) / np.linalg.norm(x**3)
    assert error < {"int8": 0.05, "int16": 1e-3}[qtype], error


def test_an_int16_add_at_scales_near_powers_of_two_loads_under_litert():
    """1 + tanh(x) over a saturating input: tanh's fixed 2^-15 output, the constant 1
    at 1/32767 and the sum's [0, 2] at 2/32767 are all within 0.07% of powers of two,
    so LiteRT 2.3.0 took its power-of-two ADD kernel (the options' default) and
    refused the model ("input1_shift == 0 || input2_shift == 0")."""

    def fn(x):
        return 1.0 + jnp.tanh(x)

    x = np.linspace(-8.0, 8.0, 64, dtype=np.float32).reshape(1, 64)
    tflite = qlitert.export(qlitert.annotate(fn, qlitert.calibrate(fn, [x], rules=INT16)), x)
    got = qlitert.LiteRTModel(tflite, kernels="builtin")(x)
    # The int16 TANH kernel's lookup table (up to 16 steps of 2^-15), then the add.
    atol = 16 * 2.0**-15 + 2 * 2.0 / 32767
    np.testing.assert_allclose(got, 1.0 + np.tanh(x.astype(np.float64)), atol=atol)
