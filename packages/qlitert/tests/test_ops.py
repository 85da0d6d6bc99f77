"""Op coverage: each op becomes the TFLite int8 kernel it should, validated against JAX."""

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_annotate import assert_integer_kernels, convert

import qlitert

RNG = np.random.default_rng(3)


class ConvThen(nn.Module):
    """A convolution (one int8 kernel), then the op under test on its output."""

    op: object

    @nn.compact
    def __call__(self, x):
        return self.op(nn.Conv(4, (3, 3))(x))


@pytest.mark.parametrize(
    ("op", "kernels"),
    [
        (lambda h: jnp.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0))), ["PAD"]),
        (lambda h: jnp.pad(h, ((0, 0), (1, 1), (0, 0), (0, 0)), constant_values=0.5), ["PADV2"]),
        (lambda h: jax.image.resize(h, (2, 8, 8, 4), "nearest"), ["GATHER_ND"]),
        (lambda h: jax.image.resize(h, (2, 8, 8, 4), "linear"), ["FULLY_CONNECTED"]),
        (lambda h: jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2), ["BROADCAST_TO"]),
        (lambda h: jnp.sum(h, axis=-1), ["SUM"]),
        (lambda h: jnp.clip(h, -0.5, 2.0), ["MAXIMUM", "MINIMUM"]),
        (lambda h: jax.nn.leaky_relu(h, 0.1), ["LEAKY_RELU"]),
        (jax.nn.silu, ["LOGISTIC", "MUL"]),
        (jax.nn.hard_silu, ["HARD_SWISH"]),
        (lambda h: h[:, 1:3, ::2], ["STRIDED_SLICE"]),
        (lambda h: h[:, 0], ["SLICE", "RESHAPE"]),
        (lambda h: jnp.transpose(h, (0, 3, 1, 2)), ["TRANSPOSE"]),
        (lambda h: jnp.concatenate([h, jnp.tanh(h)], axis=-1), ["TANH", "CONCATENATION"]),
        (lambda h: jnp.max(h, axis=(1, 2)), ["REDUCE_MAX"]),  # global max pooling
        (lambda h: jnp.max(h, axis=(1, 2), initial=-jnp.inf), ["REDUCE_MAX"]),
        (lambda h: h[..., ::-1], ["GATHER_ND"]),  # REVERSE_V2 stays float in the converter
        (jax.nn.log_softmax, ["LOG_SOFTMAX"]),
        (lambda h: jnp.log(jnp.abs(h) + 1.0), ["ABS", "ADD", "LOG"]),
        (lambda h: h - jnp.max(h, axis=-1, keepdims=True), ["REDUCE_MAX", "SUB"]),
    ],
    ids=[
        "pad", "pad-value", "resize-nearest", "resize-linear", "repeat", "sum", "clip",
        "leaky-relu", "silu", "hard-silu", "strided-slice", "index", "transpose", "concat",
        "global-max", "global-max-initial", "reverse", "log-softmax", "log", "minus-max",
    ],
)  # fmt: skip
def test_op_becomes_an_int8_kernel(op, kernels):
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    model = ConvThen(op)
    params = model.init(jax.random.key(0), x)
    batches = [RNG.normal(size=x.shape).astype(np.float32) for _ in range(3)]
    _, report = convert(lambda v: model.apply(params, v), batches)  # export validates
    names = report.op_names()
    assert set(kernels) <= set(names), names
    assert names[0] == "QUANTIZE" and names[-1] == "DEQUANTIZE"
    assert "DEQUANTIZE" not in names[:-1]
    for op in report.ops[1:]:  # later QUANTIZE ops requantize int8 (e.g. concat inputs)
        assert op.name != "QUANTIZE" or report.op_types(op) == (["INT8"], ["INT8"])
    assert_integer_kernels(report)


def test_relu_and_relu6_fuse_into_the_convolution():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    for op in (nn.relu, jax.nn.relu6, lambda h: jnp.clip(h, -1.0, 1.0)):
        model = ConvThen(op)
        params = model.init(jax.random.key(0), x)
        _, report = convert(lambda v, m=model, p=params: m.apply(p, v), [x])
        assert report.op_names() == ["QUANTIZE", "CONV_2D", "DEQUANTIZE"]


def test_embedding_lookup_gathers_an_int8_table():
    class Embedder(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(8)(nn.Embed(50, 16)(ids))

    ids = RNG.integers(0, 50, size=(2, 6)).astype(np.int32)
    params = Embedder().init(jax.random.key(0), ids)
    batches = [RNG.integers(0, 50, size=(2, 6)).astype(np.int32) for _ in range(3)]
    tfl, report = convert(lambda i: Embedder().apply(params, i), batches)
    gather = next(op for op in report.ops if op.name == "GATHER_ND")
    table = report.tensors[gather.inputs[0]]
    assert table.dtype == "INT8" and table.constant_bytes == 50 * 16  # one byte per entry
    assert report.tensors[report.inputs[0]].dtype == "INT32"  # ids go in unquantized
    assert_integer_kernels(report)


def test_unsupported_ops_stay_float_when_not_strict():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    model = ConvThen(jnp.sin)
    params = model.init(jax.random.key(0), x)

    def fn(v):
        return model.apply(params, v)

    with pytest.raises(qlitert.UnsupportedOpError, match="op 'sin'"):
        qlitert.calibrate(fn, [x])
    cal = qlitert.calibrate(fn, [x], strict=False)
    annotated = qlitert.annotate(fn, cal)
    with pytest.raises(qlitert.ExportError, match="DEQUANTIZE feeds other ops"):
        qlitert.export(annotated, x, compute_types=("INT8", "INT32"))
    tfl = qlitert.export(annotated, x)  # the annotation allows the float op it made
    names = qlitert.inspect(tfl).op_names()
    assert names[:3] == ["QUANTIZE", "CONV_2D", "DEQUANTIZE"] and "SIN" in names


_ARGMAX_MODEL = """
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
import qlitert

class Classify(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.argmax(nn.Dense(10)(nn.relu(nn.Dense(16)(x))), axis=-1)

x = np.random.default_rng(0).normal(size=(8, 12)).astype(np.float32)
params = Classify().init(jax.random.key(0), x)
fn = lambda v: Classify().apply(params, v)
cal = qlitert.calibrate(fn, [x], strict=False)
tfl = qlitert.export(qlitert.annotate(fn, cal), x)
report = qlitert.inspect(tfl)
assert report.tensors[report.outputs[0]].dtype == "INT32", report.tensors[report.outputs[0]]
y = qlitert.LiteRTModel(tfl)(x)
assert y.dtype == np.int32 and y.shape == (8,), (y.dtype, y.shape)
print("agree", float(np.mean(y == np.asarray(fn(x)))))
"""


def test_an_integer_result_of_a_float_op_is_not_quantized():
    # Issue 21: a non-strict argmax output got a quantization site, and the converter
    # crashed the process (SIGSEGV) on the int32 fake quant; hence the subprocess.
    run = subprocess.run(
        [sys.executable, "-c", _ARGMAX_MODEL], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    agree = float(run.stdout.split("agree")[-1])
    assert agree >= 0.75  # int8 Dense layers: most of the 8 predicted classes agree


def test_fake_quant_refuses_integer_values():
    with pytest.raises(TypeError, match=r"x has dtype int32; allowed: a floating-point"):
        qlitert.qdq.fake_quant(jnp.arange(4, dtype=jnp.int32), 0.1)


class MaskedDense(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        h = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(h * mask.astype(jnp.float32)[:, :, None])


def test_an_integer_mask_converted_to_float_is_quantized():
    # Issue 21, bug 4: the int -> float convert was skipped, so the mask stayed int32
    # (strict: broadcast_in_dim refused; non-strict: "lax.mul ... float32, int32").
    x = RNG.normal(size=(2, 6, 8)).astype(np.float32)
    mask = (RNG.uniform(size=(2, 6)) > 0.3).astype(np.int32)
    params = MaskedDense().init(jax.random.key(0), x, mask)

    def fn(v, m):
        return MaskedDense().apply(params, v, m)

    cal = qlitert.calibrate(fn, [(x, mask)])
    tfl = qlitert.export(qlitert.annotate(fn, cal), x, mask)  # validated
    report = qlitert.inspect(tfl)
    names = report.op_names()
    cast = names.index("CAST")
    assert names[cast + 1] == "QUANTIZE" and "MUL" in names
    for op in report.ops[1:-1]:
        if op.name not in ("CAST", "QUANTIZE"):  # the mask's way in, as a graph input's
            ins, outs = report.op_types(op)
            assert set(ins + outs) <= {"INT8", "INT32", "INT64"}, (op.name, ins, outs)
    y = qlitert.LiteRTModel(tfl)(x, mask)
    ref = np.asarray(fn(x, mask), np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.03
    assert np.array_equal(y[mask == 0], np.broadcast_to(y[mask == 0][:1], y[mask == 0].shape))


def test_a_mask_feeding_float_arithmetic_is_still_float_compute():
    # The CAST into the quantized graph is allowed; the float op after it is not.
    x = RNG.normal(size=(2, 6, 8)).astype(np.float32)
    mask = (RNG.uniform(size=(2, 6)) > 0.3).astype(np.int32)
    dense = nn.Dense(4)
    params = dense.init(jax.random.key(0), x)

    def fn(v, m):
        return dense.apply(params, v) * jnp.sin(m.astype(jnp.float32))[:, :, None]

    cal = qlitert.calibrate(fn, [(x, mask)], strict=False)
    with pytest.raises(qlitert.ExportError, match=r"SIN computes in \['FLOAT32'\]") as error:
        qlitert.export(qlitert.annotate(fn, cal), x, mask, compute_types=("INT8", "INT32"))
    assert "CAST" not in str(error.value)
    names = qlitert.inspect(qlitert.export(qlitert.annotate(fn, cal), x, mask)).op_names()
    assert "CAST" in names and "SIN" in names  # float allowed where the annotation made it


def test_log_softmax_in_int16_is_refused():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    model = ConvThen(jax.nn.log_softmax)
    params = model.init(jax.random.key(0), x)
    with pytest.raises(qlitert.UnsupportedOpError, match="LOG_SOFTMAX kernel takes int8 only"):
        qlitert.calibrate(
            lambda v: model.apply(params, v), [x], rules=qlitert.Rule(act_qtype="int16")
        )


@pytest.mark.parametrize("act", [jax.nn.sigmoid, jax.nn.silu], ids=["sigmoid", "silu"])
def test_logistic_loads_with_the_builtin_kernels(act):
    # Issue 21, bug 1: LiteRT's builtin int8 LOGISTIC requires output scale 1/256 and
    # zero point -128; a calibrated range loaded only under XNNPACK.
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    model = ConvThen(act)
    params = model.init(jax.random.key(0), x)
    tfl, report = convert(lambda v: model.apply(params, v), [x])  # validated under both
    logistic = next(op for op in report.ops if op.name == "LOGISTIC")
    out = report.tensors[logistic.outputs[0]]
    assert (out.dtype, out.scale[0], out.zero_point[0]) == ("INT8", 1 / 256, -128)
    y = qlitert.LiteRTModel(tfl, kernels="builtin")(x)
    ref = np.asarray(model.apply(params, x), np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05


def test_int16_logistic_has_the_builtin_kernels_parameters():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    model = ConvThen(jax.nn.sigmoid)
    params = model.init(jax.random.key(0), x)

    def fn(v):
        return model.apply(params, v)

    rule = qlitert.Rule(act_qtype="int16")
    tfl = qlitert.export(qlitert.annotate(fn, qlitert.calibrate(fn, [x], rules=rule)), x)
    report = qlitert.inspect(tfl)
    logistic = next(op for op in report.ops if op.name == "LOGISTIC")
    out = report.tensors[logistic.outputs[0]]
    assert (out.dtype, out.scale[0], out.zero_point[0]) == ("INT16", 1 / 32768, 0)


def test_litert_model_kernels_argument_is_checked():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    model = ConvThen(jnp.tanh)
    params = model.init(jax.random.key(0), x)
    tfl, _ = convert(lambda v: model.apply(params, v), [x])
    with pytest.raises(ValueError, match=r"kernels='gpu'; allowed: 'xnnpack', 'builtin'"):
        qlitert.LiteRTModel(tfl, kernels="gpu")


def test_average_pooling_with_padding_is_named_in_strict_mode():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    model = ConvThen(lambda h: nn.avg_pool(h, (3, 3), padding="SAME"))
    with jax.numpy_dtype_promotion("standard"):
        params = model.init(jax.random.key(0), x)
        with pytest.raises(qlitert.UnsupportedOpError, match=r"average pooling with padding"):
            qlitert.calibrate(lambda v: model.apply(params, v), [x])


def test_grouped_convolution_is_one_int8_conv():
    class Grouped(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.relu(nn.Conv(8, (3, 3), feature_group_count=2)(x))

    x = RNG.normal(size=(2, 6, 6, 4)).astype(np.float32)
    params = Grouped().init(jax.random.key(0), x)
    _, report = convert(lambda v: Grouped().apply(params, v), [x])
    assert report.op_names() == ["QUANTIZE", "CONV_2D", "DEQUANTIZE"]
    assert_integer_kernels(report)


def converted(model, shape, batches=3):
    """A Linen ``model`` at its random init, calibrated on random batches and exported.

    Returns ``(fn, x, tflite, report)``: the float function, the example input (also
    the first calibration batch) and the validated export.
    """
    rng = np.random.default_rng(0)  # (the measured errors in the tests are for these)
    x = rng.normal(size=shape).astype(np.float32)
    params = model.init(jax.random.key(0), x)

    def fn(v):
        return model.apply(params, v)

    cal = [rng.normal(size=shape).astype(np.float32) for _ in range(batches)]
    tfl, report = convert(fn, [x, *cal])
    return fn, x, tfl, report


def relative_error(got, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize(
    ("op", "kernels"),
    [
        (lambda h: jnp.tanh(h) / 3.0, ["TANH", "MUL"]),
        (lambda h: jnp.tanh(h) / jnp.array([[[[1.0, 2.0, 3.0, 4.0]]]]), ["TANH", "MUL"]),
        (lambda h: jnp.sum(h, axis=-1) / 3.0, ["SUM", "MUL"]),  # not a mean: 4 channels
        (lambda h: jnp.mean(h, axis=-1), ["MEAN"]),
        (lambda h: jnp.einsum("bhwc,bhvc->bhwv", h, h) / 4.0, ["BATCH_MATMUL", "MUL"]),
    ],
    ids=["scalar", "per-channel", "sum", "mean", "matmul"],
)
def test_division_by_a_constant_is_an_int8_mul(op, kernels):
    # Issue 21, bug 6: every div of a quantized value by a constant was taken for
    # average pooling's (or refused in strict mode); the converter makes it a MUL
    # by the reciprocal, which was left in float after a SUM or BATCH_MATMUL.
    fn, x, tfl, report = converted(ConvThen(op), (2, 4, 4, 3))  # export validates
    names = report.op_names()
    assert set(kernels) <= set(names) and "DIV" not in names, names
    assert_integer_kernels(report)
    # Relative L2 error against the float model, measured: scalar 0.010, per-channel
    # 0.015, sum 0.012, mean 0.012, product 0.096 (its heavy tails are clipped by the
    # averaged per-batch ranges).
    assert relative_error(qlitert.LiteRTModel(tfl)(x), fn(x)) < 0.15


class Heads(nn.Module):
    """A DenseGeneral with two output axes (heads, head size), scaled as attention's query."""

    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral((2, 4), bias_init=nn.initializers.normal(1.0))(x) / 2.0


def test_dense_general_with_several_output_axes_folds_its_bias_and_scale():
    # Issue 21, bug 6: a DenseGeneral with several output axes was not deferred, so its
    # bias add and the division after it were separate ops (strict mode refused the div).
    fn, x, tfl, report = converted(Heads(), (2, 5, 8))  # export validates
    names = report.op_names()  # (reshapes to and from the matmul's 2-d operands)
    assert [n for n in names if n != "RESHAPE"] == ["QUANTIZE", "FULLY_CONNECTED", "DEQUANTIZE"]
    assert_integer_kernels(report)
    fc = report.ops[names.index("FULLY_CONNECTED")]
    weight, bias = report.tensors[fc.inputs[1]], report.tensors[fc.inputs[2]]
    assert len(weight.scale) == 8 and bias.dtype == "INT32"  # one scale per output channel
    # Measured: 0.045 relative L2 error against the float model.
    assert relative_error(qlitert.LiteRTModel(tfl)(x), fn(x)) < 0.08


def test_exact_gelu_is_one_int8_gelu_kernel():
    # Issue 21: jax.nn.gelu(approximate=False) (erfc in jax 0.10's jaxpr) was refused in
    # strict mode (op 'erfc'); the converter expands erfc in float, but makes one GELU
    # of PyTorch's exact-gelu composite.
    model = ConvThen(lambda h: jax.nn.gelu(h, approximate=False))
    fn, x, tfl, report = converted(model, (2, 4, 4, 3))  # export validates
    assert report.op_names() == ["QUANTIZE", "CONV_2D", "GELU", "DEQUANTIZE"]
    assert_integer_kernels(report)
    # Measured: 0.012 relative L2 error against the float model.
    assert relative_error(qlitert.LiteRTModel(tfl)(x), fn(x)) < 0.05


class GRU(nn.Module):
    """A GRU over a short sequence (nn.RNN: a jax.lax.scan), then a Dense head."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.RNN(nn.GRUCell(8))(x))


def test_a_scanned_gru_is_unrolled_into_int8_kernels():
    # Issue 21, bug 3: a scan's body ran once, as a plain call, on the stacked input
    # ("dot_general requires contracting dimensions to have the same shape").
    fn, x, tfl, report = converted(GRU(), (2, 4, 3), batches=5)  # export validates
    names = report.op_names()
    # Unrolled: three gates per step, each a FULLY_CONNECTED on the input and one on
    # the carry (none on the first step's zero carry), then the head.
    assert names.count("LOGISTIC") == 2 * 4 and names.count("TANH") == 4, names
    assert "WHILE" not in names and "FULLY_CONNECTED" in names, names
    assert_integer_kernels(report)
    # Measured: 0.158 relative L2 error against the float model (four int8 steps, each
    # with its own ranges; export's agreement check with JAX passes).
    assert relative_error(qlitert.LiteRTModel(tfl)(x), fn(x)) < 0.25


def test_a_fori_loop_with_static_bounds_is_unrolled():
    # jax.lax.fori_loop with Python bounds is a scan (with an int32 counter in its carry).
    model = ConvThen(lambda h: jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c) + h, h))
    fn, x, tfl, report = converted(model, (2, 4, 4, 3))  # export validates
    names = report.op_names()
    assert names.count("TANH") == 3 and names.count("ADD") == 3, names
    assert_integer_kernels(report)
    # Measured: 0.011 relative L2 error against the float model.
    assert relative_error(qlitert.LiteRTModel(tfl)(x), fn(x)) < 0.05


def test_a_while_loop_is_refused_by_name():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)

    def halve(h):
        return jax.lax.while_loop(lambda c: jnp.max(c) > 1.0, lambda c: c / 2.0, h)

    model = ConvThen(halve)
    params = model.init(jax.random.key(0), x)
    with pytest.raises(qlitert.UnsupportedOpError, match=r"op 'while' .* allowed: jax.lax.scan"):
        qlitert.calibrate(lambda v: model.apply(params, v), [x])


class Up(nn.Module):
    """A convolution, then a transposed one (a decoder's upsampling)."""

    strides: tuple
    padding: object = "SAME"

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(4, (3, 3))(x)
        return nn.ConvTranspose(4, (3, 3), strides=self.strides, padding=self.padding)(h)


@pytest.mark.parametrize(
    ("strides", "padding"),
    [((2, 2), "SAME"), ((2, 2), "VALID"), ((2, 2), ((1, 1), (1, 1))), ((2, 1), "SAME"),
     ((3, 3), "SAME"), ((1, 1), "SAME")],
)  # fmt: skip
def test_a_transposed_convolution_is_an_int8_conv_that_both_kernels_run(strides, padding):
    # Issue 21, bug 10a: strict mode let a strided one through, and litert-converter
    # 0.5.0 made a TRANSPOSE_CONV that LiteRT refused to load (SAME:
    # "computed_input_height != SizeOfDimension(input, 1) (3 != 4)"), a float one
    # (VALID) or failed (explicit padding). Now: zeros inserted in int8, a CONV_2D.
    x = RNG.normal(size=(2, 4, 5, 3)).astype(np.float32)
    model = Up(strides, padding)
    params = model.init(jax.random.key(0), x)
    # Calibrated on x alone: its ranges cover x, so the float model differs by rounding only.
    tfl, report = convert(lambda v: model.apply(params, v), [x])  # validates both kernels
    names = report.op_names()
    assert "TRANSPOSE_CONV" not in names and names.count("CONV_2D") == 2, names
    assert_integer_kernels(report)
    ref = np.asarray(model.apply(params, x))  # the float model
    for kernels in ("xnnpack", "builtin"):
        y = qlitert.LiteRTModel(tfl, kernels=kernels)(x)
        assert y.shape == ref.shape and np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05


def test_lax_conv_transpose_converts_too():
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)
    kernel = jnp.asarray(RNG.normal(size=(3, 3, 3, 4)).astype(np.float32))

    def fn(v):
        dims = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_transpose(v, kernel, (2, 2), "SAME", dimension_numbers=dims)

    tfl, report = convert(fn, [x])
    assert report.op_names()[-2:] == ["CONV_2D", "DEQUANTIZE"]
    ref = np.asarray(fn(x))
    y = qlitert.LiteRTModel(tfl, kernels="builtin")(x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05


@pytest.mark.parametrize("size", [8, 6])
def test_nearest_resize_is_a_gather_per_axis_not_a_resize_kernel(size):
    # Issue 21, bug 10b: JAX lowers jax.image.resize(..., "nearest") to one gather per
    # resized axis, so the model has GATHER_NDs between TRANSPOSEs and no
    # RESIZE_NEAREST_NEIGHBOR; the values are the input's, on its scale.
    x = RNG.normal(size=(2, 4, 4, 3)).astype(np.float32)

    def fn(v):
        return jax.image.resize(v, (2, size, size, 3), "nearest")

    cal = qlitert.calibrate(fn, [x])
    tfl = qlitert.export(qlitert.annotate(fn, cal), x)
    assert qlitert.inspect(tfl).op_names() == [
        "QUANTIZE", "TRANSPOSE", "GATHER_ND", "TRANSPOSE", "GATHER_ND", "TRANSPOSE", "DEQUANTIZE"
    ]  # fmt: skip
    scale, zp = (float(v[0]) for v in cal.params("0:input0@"))
    q = np.clip(np.sign(x) * np.floor(np.abs(x) / scale + 0.5) + zp, -128, 127)  # half away
    idx = np.floor((np.arange(size) + 0.5) * 4 / size).astype(int)  # nearest source pixel
    want = ((q - zp) * scale)[:, idx][:, :, idx]
    np.testing.assert_allclose(qlitert.LiteRTModel(tfl)(x), want, atol=1e-6)


@pytest.mark.parametrize("fill", [float(np.finfo(np.float32).min), -1e9, -10000.0])
def test_an_additive_attention_mask_keeps_the_scores_resolution(fill):
    """BERT's mask as Hugging Face writes it: scores + where(mask, 0, fill), then
    softmax. Quantized as a sum, its range took in the fill (1e38) and the scores
    lost all resolution (NaN with finfo.min); now the add is a select, the fill the
    scores' lowest value."""

    def fn(scores, mask):
        bias = jnp.where(mask[:, None, None, :] > 0, 0.0, fill)
        return jax.nn.softmax(scores + bias, axis=-1)

    rng = np.random.default_rng(0)
    scores = (4 * rng.normal(size=(2, 2, 6, 6))).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], np.int32)
    annotated = qlitert.annotate(fn, qlitert.calibrate(fn, [(scores, mask)]))
    tflite = qlitert.export(annotated, scores, mask)  # validated layer by layer
    assert "SELECT_V2" in qlitert.inspect(tflite).op_names()
    want = np.asarray(fn(scores, mask))
    for got in (np.asarray(annotated(scores, mask)), qlitert.LiteRTModel(tflite)(scores, mask)):
        np.testing.assert_allclose(got, want, atol=2.5 / 256)  # int8 softmax: 1/256 steps


def test_an_rsqrt_of_a_zero_code_is_the_largest_value_as_in_litert():
    """A layer norm over a row whose variance rounds to code zero: LiteRT's RSQRT
    returns its largest code there; JAX's rsqrt(0) is inf, which fake quantization
    (qlitert's NaN policy) made NaN, and the simulation's whole output with it."""

    def fn(x):
        return jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-12) * x

    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    x[1] *= 1e-3  # a variance far below the int8 step of the variances' range
    annotated = qlitert.annotate(fn, qlitert.calibrate(fn, [x]))
    simulated = np.asarray(annotated(x))
    assert np.all(np.isfinite(simulated))
    tflite = qlitert.export(annotated, x)  # validated layer by layer
    np.testing.assert_allclose(qlitert.LiteRTModel(tflite)(x), simulated, atol=0.05)
