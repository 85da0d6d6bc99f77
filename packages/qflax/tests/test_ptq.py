"""PtqProvider on Linen and NNX models: accuracy, schemas, every call style, model shapes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs import small as zoo
from flax import nnx

import qflax
from qflax import QuantizationRule as Rule

X = jax.random.normal(jax.random.key(1), (8, 128))
W8A8 = [Rule(weight_qtype="int8", act_qtype="int8")]
W4T32 = [Rule(weight_qtype="int4", tile_size=32)]


def rel(y, ref):
    return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def quantized_leaves(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, qflax.QuantizedParam))
    return [x for x in leaves if isinstance(x, qflax.QuantizedParam)]


def linen_ptq(model, rules, x, **init_kwargs):
    """(float output, quantized output, quantized variables) of a Linen model."""
    fp = model.init(jax.random.key(0), x, **init_kwargs)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    qv = qmodel.init(jax.random.key(0), x, **init_kwargs)
    return model.apply(fp, x), jax.jit(qmodel.apply)(qv, x), qv


def nnx_ptq(cls, rules, x):
    model = cls(nnx.Rngs(0))
    ref = model(x)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules), x)
    return ref, nnx.jit(lambda m, x: m(x))(qmodel, x), qmodel


@pytest.mark.parametrize(("rules", "bound"), [(W8A8, 0.02), (W4T32, 0.15)])
def test_mlp_error_is_within_the_issue_bounds(rules, bound):
    ref, y, qv = linen_ptq(zoo.LinenMLP(), rules, X)
    assert 0 < rel(y, ref) <= bound
    assert len(quantized_leaves(qv)) == 2
    ref, y, qmodel = nnx_ptq(zoo.NnxMLP, rules, X)
    assert 0 < rel(y, ref) <= bound
    assert len(quantized_leaves(nnx.state(qmodel))) == 2


def test_w8a8_dense_is_the_exact_product_of_per_row_and_per_column_int8_operands():
    model = nn.Dense(16, use_bias=False)
    x = jax.random.normal(jax.random.key(3), (4, 32))
    _, y, qv = linen_ptq(model, W8A8, x)
    w = np.asarray(model.init(jax.random.key(0), x)["params"]["kernel"], np.float64)
    qw = qv["params"]["kernel"].qarray
    # One scale per output column, every weight within half a step of its value.
    assert qw.scale.shape == (1, 16)
    w_deq = np.asarray(qw.qvalue, np.float64) * np.asarray(qw.scale, np.float64)
    assert np.all(np.abs(w_deq - w) <= np.asarray(qw.scale) * (0.5 + 1e-4))  # f32 division
    # Activations: one absmax scale per row (numpy, float64), codes within one step.
    x64 = np.asarray(x, np.float64)
    sx = np.max(np.abs(x64), axis=1, keepdims=True) / 127.5
    x_codes = np.clip(np.round(x64 / sx), -128, 127)
    x_deq = x_codes * sx
    # The integer path is exact up to float32 rounding; a code may differ by one
    # where float32 and float64 round a .5 differently.
    ref = x_deq @ w_deq
    step = np.max(sx) * np.max(np.abs(w_deq)) * 2
    assert np.max(np.abs(np.asarray(y, np.float64) - ref)) <= step


def test_packed_int4_weights_cost_half_a_byte():
    _, _, qv = linen_ptq(zoo.LinenMLP(), W4T32, X)
    kernel = qv["params"]["Dense_1"]["kernel"]  # Dense(256) is built second
    assert kernel.qarray.qvalue.dtype == jnp.uint8
    assert kernel.qarray.qvalue.size == 128 * 256 // 2
    assert kernel.shape == (128, 256)  # the float parameter's shape


@pytest.mark.parametrize("warm", [False, True])
def test_every_call_style_is_quantized_with_cold_and_warm_caches(warm):
    x = jax.random.normal(jax.random.key(2), (4, 32))
    model = zoo.LinenStyles()
    fp = model.init(jax.random.key(0), x)
    if warm:  # trace every jitted wrapper (matmul, dot, einsum) in float first
        jax.jit(model.apply)(fp, x)
        nnx.jit(lambda m, x: m(x))(zoo.NnxStyles(nnx.Rngs(0)), x)
    rules = [Rule(weight_qtype="int4")]  # coarse, so a float op would show
    ref, y, qv = linen_ptq(model, rules, x)
    assert len(quantized_leaves(qv)) == 5
    # Reference: the same chain with every weight replaced by its dequantized value.
    ws = [qflax.qparam.stand_in(qv["params"][f"w{i}"]) for i in range(1, 6)]
    expected = zoo._styles(x, *ws)
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=1e-6)
    assert rel(y, ref) > 0.01
    ref, y, qmodel = nnx_ptq(zoo.NnxStyles, rules, x)
    assert len(quantized_leaves(nnx.state(qmodel))) == 5
    ws = [qflax.qparam.stand_in(getattr(qmodel, f"w{i}").get_raw_value()) for i in range(1, 6)]
    np.testing.assert_allclose(y, zoo._styles(x, *ws), rtol=2e-5, atol=1e-6)


LINEN_MODELS = {
    "cnn with batchnorm": (zoo.LinenCNN, (2, 8, 8, 1), 3),
    "transformer block": (zoo.LinenAttention, (2, 6, 32), 6),
    "nn.scan stack": (zoo.LinenScan, (2, 32), 1),
    "reshaped kernel": (zoo.LinenReshaped, (2, 32), 1),
    "submodule called twice": (zoo.LinenTwice, (2, 32), 1),
    "ragged_dot experts": (zoo.LinenMoE, (8, 32), 1),
}
NNX_MODELS = {
    "cnn with batchnorm": (zoo.NnxCNN, (2, 8, 8, 1), 3),
    "nnx.scan stack": (zoo.NnxScan, (2, 32), 1),
    "reshaped + transposed kernel": (zoo.NnxReshaped, (2, 32), 1),
    "submodule called twice": (zoo.NnxTwice, (2, 32), 1),
}


@pytest.mark.parametrize("name", list(LINEN_MODELS))
def test_linen_models(name):
    cls, shape, n_quantized = LINEN_MODELS[name]
    x = jax.random.normal(jax.random.key(2), shape)
    ref, y, qv = linen_ptq(cls(), W8A8, x)
    assert len(quantized_leaves(qv)) == n_quantized
    assert 0 < rel(y, ref) < 0.03


@pytest.mark.parametrize("name", list(NNX_MODELS))
def test_nnx_models(name):
    cls, shape, n_quantized = NNX_MODELS[name]
    x = jax.random.normal(jax.random.key(2), shape)
    ref, y, qmodel = nnx_ptq(cls, W8A8, x)
    assert len(quantized_leaves(nnx.state(qmodel))) == n_quantized
    assert 0 < rel(y, ref) < 0.03
    np.testing.assert_array_equal(qmodel(x), y)  # eager == jitted


def test_scanned_layers_get_one_scale_row_per_layer():
    x = jax.random.normal(jax.random.key(2), (2, 32))
    _, _, qv = linen_ptq(zoo.LinenScan(), [Rule(weight_qtype="int8")], x)
    kernel = qv["params"]["layers"]["Dense_0"]["kernel"]
    assert kernel.qarray.qvalue.shape == (4, 32, 32)
    assert kernel.qarray.scale.shape == (4, 1, 32)


def test_reshaped_kernel_is_stored_in_the_layout_the_op_uses():
    x = jax.random.normal(jax.random.key(2), (2, 32))
    _, _, qv = linen_ptq(zoo.LinenReshaped(), [Rule(weight_qtype="int8")], x)
    kernel = qv["params"]["kernel"]
    assert kernel.shape == (4, 8, 16)  # the parameter
    assert kernel.qarray.shape == (32, 16)  # the compute layout: one scale per output
    assert kernel.qarray.scale.shape == (1, 16)


def test_weight_only_conv_and_activation_only_rules():
    x = jax.random.normal(jax.random.key(2), (2, 8, 8, 1))
    model = zoo.LinenCNN()
    ref, y, qv = linen_ptq(model, [Rule(op_names=["conv_general_dilated"], weight_qtype="int8")], x)
    assert len(quantized_leaves(qv)) == 2  # the two convs; the Dense head stays float
    assert 0 < rel(y, ref) < 0.02
    ref, y, qv = linen_ptq(model, [Rule(act_qtype="int8")], x)
    assert quantized_leaves(qv) == []
    assert 0 < rel(y, ref) < 0.03


def test_bf16_compute_keeps_its_dtype():
    model = nn.Dense(16, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(2), (4, 32))
    ref, y, qv = linen_ptq(model, W8A8, x)
    assert y.dtype == jnp.bfloat16
    kernel = qv["params"]["kernel"]
    assert kernel.dtype == jnp.float32 and kernel.qarray.dtype == jnp.bfloat16
    assert rel(y.astype(jnp.float32), ref.astype(jnp.float32)) < 0.03


def test_static_scales_calibrated_at_one_length_serve_another():
    model = zoo.LinenSeq()
    rules = [Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    qat = qflax.quantize_model(model, qflax.QtProvider(rules))
    short = jax.random.normal(jax.random.key(3), (2, 16, 8))
    variables = qat.init(jax.random.key(0), short)
    _, stats = qat.apply(variables, short, mutable=["quant_stats"])
    ptq = qflax.quantize_model(model, qflax.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), short)["params"]
    params = qflax.quantize_params(variables["params"], abstract, stats["quant_stats"])
    scale = params["Dense_0"]["dot_general0_lhs_scale"]
    assert isinstance(scale, qflax.ActScale) and scale.scale.shape == ()
    long = jax.random.normal(jax.random.key(4), (2, 128, 8)) * 0.5
    y = jax.jit(ptq.apply)({"params": params}, long)
    ref = model.apply({"params": variables["params"]}, long)
    assert y.shape == (2, 128, 16)
    assert 0 < rel(y, ref) < 0.03


def test_unmatched_modules_stay_float_and_paths_include_indices():
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.Dense(32, name=f"layers_{i}")(x)
            return nn.Dense(4, name="head")(x)

    x = jax.random.normal(jax.random.key(2), (2, 32))
    rules = [Rule(module_path=r"layers_[02]", weight_qtype="int8")]
    _, _, qv = linen_ptq(Stack(), rules, x)
    kinds = {k: isinstance(v["kernel"], qflax.QuantizedParam) for k, v in qv["params"].items()}
    assert kinds == {"layers_0": True, "layers_1": False, "layers_2": True, "head": False}


def test_nnx_list_indices_and_first_match_precedence():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(3)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    rules = [
        Rule(module_path=r"layers/1", weight_qtype="int4"),
        Rule(module_path=r"layers/\d+", weight_qtype="int8"),
    ]
    x = jax.random.normal(jax.random.key(2), (2, 16))
    _, _, qmodel = nnx_ptq(Net, rules, x)
    qtypes = [layer.kernel.get_raw_value().qarray.qtype.name for layer in qmodel.layers]
    assert qtypes == ["int8", "int4", "int8"]


def test_op_names_filter_and_unused_rule_warning():
    x = jax.random.normal(jax.random.key(2), (2, 6, 32))
    rules = [
        Rule(module_path="Dense_.*", op_names=["einsum"], weight_qtype="int8"),  # Dense: no einsum
        Rule(module_path="", op_names=["einsum"], weight_qtype="int8"),
        Rule(module_path="Dnese_0", weight_qtype="int8"),  # a typo
    ]
    qmodel = qflax.quantize_model(zoo.LinenAttention(), qflax.PtqProvider(rules))
    with pytest.warns(UserWarning, match="matched no op") as record:
        qv = qmodel.init(jax.random.key(0), x)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2  # the typo and the op_names mismatch
    assert "'Dense_.*'" in messages[0] and "'Dnese_0'" in messages[1]
    assert not isinstance(qv["params"]["Dense_0"]["kernel"], qflax.QuantizedParam)
    assert isinstance(qv["params"]["wq"], qflax.QuantizedParam)
    assert [r.module_path for r in qmodel.provider.unused_rules()] == ["Dense_.*", "Dnese_0"]
