"""Per-module rules: int16 activations (16x8), int4 weights, float modules, rule errors."""

import dataclasses
import subprocess
import sys
import warnings

import archs
import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import qcore
import qlitert
from qflax import QuantizationRule

RNG = np.random.default_rng(5)


class ConvNet(nn.Module):
    """conv -> relu -> depthwise conv -> relu -> dense (head)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv")(x))
        x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=8, name="dw")(x))
        return nn.Dense(10, name="head")(x.reshape(x.shape[0], -1))


def convert(rules, model=None):
    model = model or ConvNet()
    batches = [RNG.normal(size=(2, 6, 6, 3)).astype(np.float32) for _ in range(4)]
    params = model.init(jax.random.key(0), batches[0])

    def fn(x):
        return model.apply(params, x)

    cal = qlitert.calibrate(fn, batches, rules=rules)
    annotated = qlitert.annotate(fn, cal)
    tfl = qlitert.export(annotated, batches[0])  # validated with the rules' types
    return tfl, qlitert.inspect(tfl), annotated


def kernel(report, name):
    return next(op for op in report.ops if op.name == name)


def test_int16_activations_with_int8_weights():
    rules = [QuantizationRule(act_qtype="int16", weight_qtype="int8")]
    _, report, annotated = convert(rules)
    assert report.op_names() == [
        "QUANTIZE", "CONV_2D", "DEPTHWISE_CONV_2D", "RESHAPE", "FULLY_CONNECTED", "DEQUANTIZE"
    ]  # fmt: skip
    for name in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"):
        op = kernel(report, name)
        x, w = (report.tensors[i] for i in op.inputs[:2])
        y = report.tensors[op.outputs[0]]
        assert (x.dtype, w.dtype, y.dtype) == ("INT16", "INT8", "INT16"), name
        assert set(x.zero_point) == {0} and set(y.zero_point) == {0}  # symmetric int16
        if len(op.inputs) > 2:  # (the converter drops an all-zero dense bias)
            bias = report.tensors[op.inputs[2]]
            # LiteRT's 16x8 convolutions read int64 biases (the converter writes int32;
            # qlitert.converter widens them). Fully connected takes int32.
            assert bias.dtype == ("INT32" if name == "FULLY_CONNECTED" else "INT64"), name
    assert "INT16" in annotated.compute_types


def test_int16_is_finer_than_int8():
    x = RNG.normal(size=(2, 6, 6, 3)).astype(np.float32)
    errors = {}
    for act in ("int8", "int16"):
        tfl, _, _ = convert([QuantizationRule(act_qtype=act, weight_qtype="int8")])
        params = ConvNet().init(jax.random.key(0), x)
        ref = np.asarray(ConvNet().apply(params, x))
        got = qlitert.LiteRTModel(tfl)(x)
        errors[act] = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # Measured 0.053 vs 0.092: most of what is left is the int8 weights' error.
    assert errors["int16"] < 0.75 * errors["int8"], errors


def test_int4_weights_with_int8_activations():
    rules = [QuantizationRule(act_qtype="int8", weight_qtype="int4")]
    _, report, annotated = convert(rules)
    for name in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"):
        op = kernel(report, name)
        w = report.tensors[op.inputs[1]]
        assert w.dtype == "INT4" and len(w.scale) > 1, name  # per output channel
        assert report.tensors[op.inputs[0]].dtype == "INT8"
    head = report.tensors[kernel(report, "FULLY_CONNECTED").inputs[1]]
    assert head.constant_bytes == head.shape[0] * head.shape[1] // 2  # packed: half a byte
    assert "INT4" in annotated.compute_types


def test_rules_select_modules_first_match_wins():
    rules = [
        QuantizationRule(module_path="head"),  # float
        QuantizationRule(module_path="dw", act_qtype="int8", weight_qtype="int4"),
        QuantizationRule(module_path=".*", act_qtype="int8", weight_qtype="int8"),
    ]
    _, report, annotated = convert(rules)
    conv, dw, head = (
        kernel(report, n) for n in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")
    )
    assert report.tensors[conv.inputs[1]].dtype == "INT8"
    assert report.tensors[dw.inputs[1]].dtype == "INT4"
    assert report.op_types(head)[0][:2] == ["FLOAT32", "FLOAT32"]  # a float kernel
    assert report.op_types(head)[1] == ["FLOAT32"]
    assert "FLOAT32" in annotated.compute_types


def test_int8_int16_boundaries_requantize_in_one_quantize_op():
    """int8 -> int16 -> int8 across modules: a QUANTIZE from one integer type to the
    other at each boundary (litert-converter 0.5.0 alone merged the two quantizations
    and converted the producer with the consumer's type)."""
    rules = [
        qlitert.Rule(module_path="dw", act_qtype="int16", weight_qtype="int8"),
        qlitert.Rule(module_path=".*", act_qtype="int8", weight_qtype="int8"),
    ]
    _, report, _ = convert(rules)  # validated layer by layer, both kernel sets
    requantized = [
        tuple(report.op_types(op)[0] + report.op_types(op)[1])
        for op in report.ops[1:]
        if op.name == "QUANTIZE"
    ]
    assert requantized == [("INT8", "INT16"), ("INT16", "INT8")]
    dw = kernel(report, "DEPTHWISE_CONV_2D")
    assert report.op_types(dw)[1] == ["INT16"]
    assert "DEQUANTIZE" not in report.op_names()[:-1]


def test_rules_match_nnx_module_paths():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.relu(layer(x))
            return self.head(x)

    model = Net(nnx.Rngs(0))
    batches = [RNG.normal(size=(4, 8)).astype(np.float32) for _ in range(3)]
    rules = [
        QuantizationRule(module_path=r"layers/1", act_qtype="int8", weight_qtype="int4"),
        QuantizationRule(module_path=".*", act_qtype="int8", weight_qtype="int8"),
    ]
    cal = qlitert.calibrate(lambda x: model(x), batches, rules=rules)
    report = qlitert.inspect(qlitert.export(qlitert.annotate(lambda x: model(x), cal), batches[0]))
    weights = [
        report.tensors[op.inputs[1]].dtype for op in report.ops if op.name == "FULLY_CONNECTED"
    ]
    assert weights == ["INT8", "INT4", "INT8"]


def test_unused_rules_warn_and_bad_rules_raise():
    x = RNG.normal(size=(2, 6, 6, 3)).astype(np.float32)
    params = ConvNet().init(jax.random.key(0), x)

    def fn(v):
        return ConvNet().apply(params, v)

    with pytest.warns(UserWarning, match=r"rules\[0\] \(module_path='typo'\) matched no op"):
        qlitert.calibrate(fn, [x], rules=[QuantizationRule(module_path="typo"), QuantizationRule(
            act_qtype="int8", weight_qtype="int8")])  # fmt: skip
    bad = [
        (dict(act_qtype="int4"), r"act_qtype='int4': LiteRT activations are one of"),
        (dict(weight_qtype="nf4"), r"weight_qtype='nf4': LiteRT weights are one of"),
        (dict(act_qtype="int16", weight_qtype="int4"), "int16 activations need int8 weights"),
        (dict(weight_qtype="int8", tile_size=32), r"tile_size=32: LiteRT fixes this"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            qlitert.calibrate(fn, [x], rules=[QuantizationRule(**kwargs)])
    with warnings.catch_warnings():  # (a qflax rule would warn: DeprecationWarning)
        warnings.simplefilter("error")
        qlitert.calibrate(fn, [x], rules=[qlitert.Rule(act_qtype="int8", weight_qtype="int8")])


def test_int16_model_with_integer_io_takes_and_returns_int16_codes():
    model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
    batches = [RNG.normal(size=(4, 8)).astype(np.float32) for _ in range(3)]
    params = model.init(jax.random.key(0), batches[0])

    def fn(x):
        return model.apply(params, x)

    cal = qlitert.calibrate(
        fn, batches, rules=[QuantizationRule(act_qtype="int16", weight_qtype="int8")]
    )
    scale, zp = cal.params("0:input0@", "i16")
    assert zp[0] == 0
    codes = np.clip(np.round(batches[0] / scale[0]), -32768, 32767).astype(np.int16)
    tfl = qlitert.export(qlitert.annotate(fn, cal, int8_io=True), codes)
    report = qlitert.inspect(tfl)
    assert report.op_names() == ["FULLY_CONNECTED", "FULLY_CONNECTED"]
    assert [report.tensors[i].dtype for i in (*report.inputs, *report.outputs)] == ["INT16"] * 2
    # The same kernels as the float-I/O model, seen through LiteRTModel's conversion.
    float_io = qlitert.export(qlitert.annotate(fn, cal), batches[0])
    np.testing.assert_allclose(
        qlitert.LiteRTModel(tfl)(batches[0]), qlitert.LiteRTModel(float_io)(batches[0]), atol=1e-6
    )


# -- qlitert.Rule, and qflax rules (deprecated) ---------------------------------------


def test_rule_validates_litert_types_at_construction():
    assert qlitert.Rule() == qlitert.Rule(module_path=".*", act_qtype="int8", weight_qtype="int8")
    rule = qlitert.Rule(act_qtype=qcore.qtypes.get("int16"), weight_qtype=None)
    assert (rule.act_qtype, rule.weight_qtype) == ("int16", None)  # a QType becomes its name
    bad = [
        (dict(act_qtype="int4"), r"^act_qtype='int4': LiteRT activations are one of "
         r"\['int8', 'int16'\] or None \(float\)$"),
        (dict(act_qtype="int9"), r"^act_qtype='int9': LiteRT activations are one of"),
        (dict(weight_qtype="int16"), r"^weight_qtype='int16': LiteRT weights are one of "
         r"\['int8', 'int4'\] or None \(float\)$"),
        (dict(weight_qtype=8), r"^weight_qtype=8: LiteRT weights are one of"),
        (dict(act_qtype="int16", weight_qtype="int4"), "int16 activations need int8 weights"),
        (dict(module_path="(a+)+$"), r"module_path='\(a\+\)\+\$' has a repeat inside"),
        (dict(module_path=3), r"module_path=3 must be a regex string or a callable"),
    ]  # fmt: skip
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            qlitert.Rule(**kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.act_qtype = "int8"  # type: ignore[misc]


def small_model():
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])  # layers_0, layers_2
    batches = [RNG.normal(size=(4, 6)).astype(np.float32) for _ in range(3)]
    params = model.init(jax.random.key(0), batches[0])
    return (lambda x: model.apply(params, x)), batches


def annotated_outputs(fn, batches, rules):
    cal = qlitert.calibrate(fn, batches, rules=rules)
    return cal, np.asarray(qlitert.annotate(fn, cal)(batches[0]))


def test_the_default_rule_is_what_no_rules_mean():
    fn, batches = small_model()
    cal_none, y_none = annotated_outputs(fn, batches, None)
    cal_rule, y_rule = annotated_outputs(fn, batches, [qlitert.Rule()])
    assert cal_rule.ranges == cal_none.ranges
    np.testing.assert_array_equal(y_rule, y_none)
    assert np.max(np.abs(y_none - np.asarray(fn(batches[0])))) > 0  # quantized, not float


def test_qflax_rules_still_work_with_a_deprecation_warning():
    fn, batches = small_model()
    new = [
        qlitert.Rule(module_path="layers_2", act_qtype=None, weight_qtype=None),
        qlitert.Rule(weight_qtype="int4"),
    ]
    old = [
        QuantizationRule(module_path="layers_2"),
        QuantizationRule(act_qtype="int8", weight_qtype="int4", act_static_scale=True),
    ]
    cal_new, y_new = annotated_outputs(fn, batches, new)
    with pytest.warns(DeprecationWarning) as record:
        cal_old, y_old = annotated_outputs(fn, batches, old)
    [warning] = [w for w in record if w.category is DeprecationWarning]
    assert str(warning.message) == (
        "qflax.QuantizationRule rules are deprecated in qlitert (rules[0, 1]); use "
        "qlitert.Rule: qlitert.Rule(module_path='layers_2', act_qtype=None, weight_qtype=None), "
        "qlitert.Rule(module_path='.*', act_qtype='int8', weight_qtype='int4')"
    )
    assert warning.filename == __file__  # points at the caller of calibrate
    assert cal_old.rules == tuple(new)
    assert cal_old.ranges == cal_new.ranges
    np.testing.assert_array_equal(y_old, y_new)
    with pytest.warns(DeprecationWarning) as record:
        assert qlitert.rules.check(old[1]) == (new[1],)  # a single rule
    assert record[0].filename == __file__


def test_qflax_rule_fields_that_litert_fixes_must_keep_their_defaults():
    for kwargs, field in [
        (dict(op_names=("dot_general",)), r"op_names=\('dot_general',\)"),
        (dict(weight_calibration_method="mse"), "weight_calibration_method='mse'"),
        (dict(act_batch_axes=(0,)), r"act_batch_axes=\(0,\)"),
    ]:
        with pytest.raises(ValueError, match=rf"^rules\[0\]\.{field}: LiteRT fixes this .*; "
                           "leave it at "):  # fmt: skip
            qlitert.rules.check([QuantizationRule(act_qtype="int8", **kwargs)])
    # Fields that change nothing in a LiteRT model are accepted.
    with pytest.warns(DeprecationWarning):
        rule = QuantizationRule(act_qtype="int8", act_static_scale=True, rotation_seed=3)
        assert qlitert.rules.check([rule]) == (qlitert.Rule(weight_qtype=None),)


def test_any_dataclass_rule_is_read_by_its_dataclass_defaults():
    @dataclasses.dataclass(frozen=True)
    class MyRule:
        module_path: str = ".*"
        act_qtype: str | None = "int16"
        weight_qtype: str | None = "int8"
        tags: list = dataclasses.field(default_factory=lambda: ["a"])
        note: str = "x"

    with pytest.warns(DeprecationWarning, match=r"^test_rules.MyRule rules are deprecated"):
        assert qlitert.rules.check([MyRule(tags=("a",))]) == (qlitert.Rule(act_qtype="int16"),)
    with pytest.raises(ValueError, match=r"^rules\[1\]\.note='y': LiteRT fixes .* leave it at 'x'"):
        qlitert.rules.check([qlitert.Rule(), MyRule(note="y")])
    with pytest.raises(ValueError, match=r"^rules\[0\]\.act_qtype='int4': LiteRT activations"):
        qlitert.rules.check([MyRule(act_qtype="int4")])
    with pytest.warns(DeprecationWarning):  # any iterable, read once
        got = qlitert.rules.check(r for r in [qlitert.Rule(), MyRule()])
    assert got == (qlitert.Rule(), qlitert.Rule(act_qtype="int16"))
    for bad in ({"module_path": ".*"}, "int8", qlitert.Rule):
        with pytest.raises(ValueError, match=r"^rules\[0\]=.* is not a qlitert.Rule"):
            qlitert.rules.check([bad])


def test_qlitert_does_not_import_qflax():
    code = """if True:
        import importlib.abc, sys

        class NoQflax(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "qflax":
                    raise ImportError(f"{name} is blocked")

        sys.meta_path.insert(0, NoQflax())
        import jax.numpy as jnp, numpy as np, qlitert
        x = np.ones((2, 3), np.float32)
        cal = qlitert.calibrate(jnp.tanh, [x], rules=[qlitert.Rule(module_path="")])
        print(sorted(m for m in sys.modules if m.split(".")[0] == "qflax"), len(cal.ranges) > 0)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] True"


def test_a_float_module_between_quantized_ones_stays_float():
    """A float module's convolution between int8 ones: float kernel, float weight."""
    rules = [
        qlitert.Rule(module_path="dw", act_qtype=None, weight_qtype=None),
        qlitert.Rule(module_path=".*", act_qtype="int8", weight_qtype="int8"),
    ]
    _, report, annotated = convert(rules)  # validated, FLOAT32 allowed
    dw = kernel(report, "DEPTHWISE_CONV_2D")
    assert report.op_types(dw) == (["FLOAT32", "FLOAT32", "FLOAT32"], ["FLOAT32"])
    assert report.op_types(kernel(report, "CONV_2D"))[1] == ["INT8"]
    assert report.op_types(kernel(report, "FULLY_CONNECTED"))[1] == ["INT8"]


class _NormThenRelu(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.relu(nn.LayerNorm(name="norm")(x)))


class _NormThenRelu6(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.relu6(nn.LayerNorm(name="norm")(x)))


class _DenseReluDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.relu(nn.Dense(16, name="inner")(x)))


@pytest.mark.parametrize(
    ("model", "rules", "kernels"),
    [
        pytest.param(  # the relu (root, int8) reads the int16 LayerNorm through a QUANTIZE
            _NormThenRelu,
            [qlitert.Rule(module_path="norm", act_qtype="int16"), qlitert.Rule()],
            {"RELU": ["INT8"], "FULLY_CONNECTED": ["INT8"]},
            id="int16-norm-then-int8-relu",
        ),
        pytest.param(  # relu6 is max then min: both keep the requantized parameters
            _NormThenRelu6,
            [qlitert.Rule(module_path="norm", act_qtype="int16"), qlitert.Rule()],
            {"FULLY_CONNECTED": ["INT8"]},
            id="int16-norm-then-int8-relu6",
        ),
        pytest.param(
            _NormThenRelu6,
            [
                qlitert.Rule(module_path="norm"),
                qlitert.Rule(module_path="out", act_qtype="int16"),
                qlitert.Rule(act_qtype="int16"),
            ],
            {"FULLY_CONNECTED": ["INT16"]},
            id="int8-norm-then-int16-relu6",
        ),
        pytest.param(  # the float root's relu: a float RELU between the int8 Dense layers
            _DenseReluDense,
            [
                qlitert.Rule(module_path="inner|out"),
                qlitert.Rule(act_qtype=None, weight_qtype=None),
            ],
            {"FULLY_CONNECTED": ["INT8", "INT8"], "RELU": ["FLOAT32"]},
            id="int8-dense-then-float-relu",
        ),
    ],
)
def test_a_clamp_after_a_module_of_another_type_exports(model, rules, kernels):
    """A relu right after a module of another activation type. Before the fix the first
    case failed in the converter ('tfl.maximum' op quantization parameters violate the
    same scale constraint) and the second in validation (the converter fused the float
    relu into the int8 Dense, requantizing it with the next Dense's parameters; the
    float op's optimization barriers keep it float)."""
    x = np.random.default_rng(0).normal(size=(6, 16)).astype(np.float32)
    variables = model().init(jax.random.key(0), x[:1])

    def fn(v):
        return model().apply(variables, v)

    cal = qlitert.calibrate(fn, [x[:3], x[3:]], rules=rules)
    report = qlitert.inspect(qlitert.export(qlitert.annotate(fn, cal), x[:1]))  # validated
    for name, outputs in kernels.items():
        assert [report.op_types(op)[1][0] for op in report.ops if op.name == name] == outputs
    tflite = qlitert.LiteRTModel(qlitert.export(qlitert.annotate(fn, cal), x[:1]))
    got = np.concatenate([np.asarray(tflite(x[i : i + 1])) for i in range(len(x))])
    want = np.asarray(fn(x))
    # Validated within a step of JAX above; against float, an int8 LayerNorm of 16
    # features alone is 0.05-0.13 off (rel L2) on such draws, the clamps add nothing.
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.2


FLOAT_ACTIVATIONS = {  # name: (function, its LiteRT kernel if it has one)
    "tanh": (jax.numpy.tanh, "TANH"),
    "sigmoid": (jax.nn.sigmoid, "LOGISTIC"),
    "softmax": (jax.nn.softmax, "SOFTMAX"),
    "log_softmax": (jax.nn.log_softmax, "LOG_SOFTMAX"),
    "gelu exact": (lambda h: jax.nn.gelu(h, approximate=False), "GELU"),
    "gelu tanh": (jax.nn.gelu, "GELU"),
    "gelu by hand": (
        lambda h: 0.5 * h * (1 + jax.numpy.tanh(0.79788456 * (h + 0.044715 * h**3))),
        "TANH",
    ),
    "silu": (jax.nn.silu, "LOGISTIC"),
    "softplus": (jax.nn.softplus, None),
    "elu": (jax.nn.elu, None),
    "exp": (jax.numpy.exp, "EXP"),
    "expm1": (jax.numpy.expm1, None),
    "log1p of abs": (lambda h: jax.numpy.log1p(jax.numpy.abs(h)), None),
    "cube": (lambda h: h**3, "MUL"),
    "erf": (jax.scipy.special.erf, None),
    "abs to 1.5": (lambda h: jax.numpy.abs(h) ** 1.5, "POW"),
    "standardize": (
        lambda h: (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5),
        "RSQRT",
    ),
}


@pytest.mark.parametrize("name", list(FLOAT_ACTIVATIONS))
def test_a_float_module_between_int8_dense_layers_computes_in_float(name):
    """A float module's activation read from an int8 Dense and read by one. Before
    its optimization barriers, litert-converter 0.5.0 made the op between the two
    quantizations an int8 kernel: softmax, log_softmax and sigmoid did not load
    (LiteRT wants their fixed output scales), tanh became an int8 TANH."""
    activation, kernel = FLOAT_ACTIVATIONS[name]

    x = RNG.normal(size=(4, 8)).astype(np.float32)
    fn = archs.between_dense_layers(activation, x)

    rules = [qlitert.Rule(module_path="act", act_qtype=None, weight_qtype=None), qlitert.Rule()]
    cal = qlitert.calibrate(fn, [x[:2], x[2:]], rules=rules, strict=False)
    report = qlitert.inspect(qlitert.export(qlitert.annotate(fn, cal), x[:1]))  # validated
    dense = [report.op_types(op) for op in report.ops if op.name == "FULLY_CONNECTED"]
    assert [outs for _, outs in dense] == [["INT8"], ["INT8"]]
    if kernel is not None:
        assert ["FLOAT32"] in [report.op_types(op)[1] for op in report.ops if op.name == kernel]
    assert not [
        op.name for op in report.ops if op.name == kernel and "INT8" in report.op_types(op)[1]
    ]
