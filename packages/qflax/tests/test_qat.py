"""QtProvider: forward equals PTQ bit for bit, straight-through gradients, statistics."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs import small as zoo
from flax import nnx

import qcore
import qflax
from qflax import QuantizationRule as Rule

X = jax.random.normal(jax.random.key(1), (8, 128))
DYNAMIC = [Rule(weight_qtype="int8", act_qtype="int8")]
STATIC = [Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
W4 = [Rule(weight_qtype="int4", tile_size=32, act_qtype="int8")]


def calibrate(qat, variables, batches):
    for x in batches:
        _, new = jax.jit(lambda v, x: qat.apply(v, x, mutable=["quant_stats"]))(variables, x)
        variables = {**variables, **new}
    return variables


@pytest.mark.parametrize("rules", [DYNAMIC, STATIC, W4], ids=["dynamic", "static", "w4a8"])
def test_linen_qat_forward_equals_ptq_forward_bit_for_bit(rules):
    model = zoo.LinenMLP()
    qat = qflax.quantize_model(model, qflax.QtProvider(rules))
    variables = calibrate(qat, qat.init(jax.random.key(0), X), [X, 2 * X])
    y_qat = jax.jit(qat.apply)(variables, X)
    ptq = qflax.quantize_model(model, qflax.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), X)["params"]
    params = qflax.quantize_params(variables["params"], abstract, variables.get("quant_stats"))
    y_ptq = jax.jit(ptq.apply)({"params": params}, X)
    np.testing.assert_array_equal(y_qat, y_ptq)


class _ScaledResidual(nn.Module):
    """Dense layers with biases, each followed by ``y * c + h * d``."""

    @nn.compact
    def __call__(self, h):
        for _ in range(2):
            y = nn.Dense(h.shape[-1], bias_init=nn.initializers.normal(1.0))(h)
            h = y * 0.7 + h * 0.25
        return h


@pytest.mark.parametrize(
    ("rules", "rows"),
    [
        (DYNAMIC, 1),
        (DYNAMIC, 4),
        ([Rule(weight_qtype="int8")], 1),
        ([Rule(weight_qtype="int8")], 4),
        ([Rule(weight_qtype="int8")], 40),
        ([Rule(weight_qtype="int4")], 4),
        ([Rule(weight_qtype="int4", tile_size=32)], 1),
        ([Rule(weight_qtype="int4", tile_size=32)], 4),
        ([Rule(weight_qtype="nf4", tile_size=32)], 4),
    ],
    ids=[
        "w8a8-1",
        "w8a8-4",
        "w8-1",
        "w8-4",
        "w8-40",
        "w4-4",
        "w4-tiles-1",
        "w4-tiles-4",
        "nf4-tiles-4",
    ],
)
def test_qat_equals_ptq_with_scaled_residuals(rules, rows):
    """Both sides of the residual's add are products; which one XLA contracts into a
    fused multiply-add must not depend on whether the scales are stored (PTQ) or
    computed in the jit (QAT)."""
    x = jax.random.normal(jax.random.key(2), (rows, 64))
    model = _ScaledResidual()
    qat = qflax.quantize_model(model, qflax.QtProvider(rules))
    params = qat.init(jax.random.key(0), x)["params"]
    y_qat = jax.jit(qat.apply)({"params": params}, x)
    ptq = qflax.quantize_model(model, qflax.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
    y_ptq = jax.jit(ptq.apply)({"params": qflax.quantize_params(params, abstract)}, x)
    np.testing.assert_array_equal(y_qat, y_ptq)


def test_nnx_qat_calibrate_convert_in_place_and_match_bit_for_bit():
    x = jax.random.normal(jax.random.key(2), (4, 32))
    model = qflax.quantize_model(zoo.NnxScan(nnx.Rngs(0)), qflax.QtProvider(STATIC), x)
    stat = model.layers.linear.dot_general0_lhs
    assert isinstance(stat, qflax.QuantStat)
    np.testing.assert_array_equal(stat.get_raw_value()["count"], [0, 0, 0, 0])  # per layer
    step = nnx.jit(lambda m, x: m(x))
    for batch in (x, 3 * x):
        step(model, batch)
    np.testing.assert_array_equal(stat.get_raw_value()["count"], [2, 2, 2, 2])
    model.qflax_update_stats = False
    y_qat = step(model, x)
    np.testing.assert_array_equal(stat.get_raw_value()["count"], [2, 2, 2, 2])
    ptq = qflax.quantize_model(model, qflax.PtqProvider(STATIC), x)
    scale = ptq.layers.linear.dot_general0_lhs_scale.get_raw_value()
    assert isinstance(scale, qflax.ActScale) and scale.scale.shape == (4,)
    np.testing.assert_array_equal(step(ptq, x), y_qat)


def test_straight_through_gradient_is_the_float_gradient():
    dense = nn.Dense(16, use_bias=False)
    x = jax.random.normal(jax.random.key(3), (4, 32))
    c = jax.random.normal(jax.random.key(4), (4, 16))
    qat = qflax.quantize_model(dense, qflax.QtProvider(DYNAMIC))
    params = qat.init(jax.random.key(0), x)["params"]
    grad = jax.grad(lambda p: jnp.sum(qat.apply({"params": p}, x) * c))(params)["kernel"]
    ref = np.asarray(x, np.float64).T @ np.asarray(c, np.float64)
    np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)


def test_quantized_backward_pass_with_stochastic_rounding():
    dense = nn.Dense(16, use_bias=False)
    x = jax.random.normal(jax.random.key(3), (4, 32))
    c = jax.random.normal(jax.random.key(4), (4, 16))
    sr8 = qcore.HowToQuantize(qtype="int8", rounding="stochastic")
    provider = qflax.QtProvider(
        DYNAMIC, dlhs=qcore.BackwardQuant(grad=sr8), drhs=qcore.BackwardQuant(grad=sr8)
    )
    qat = qflax.quantize_model(dense, provider)
    params = qat.init({"params": jax.random.key(0), "quant": jax.random.key(9)}, x)["params"]

    def grad(key):
        def loss(p):
            return jnp.sum(qat.apply({"params": p}, x, rngs={"quant": key}) * c)

        return jax.grad(loss)(params)["kernel"]

    ref = np.asarray(x, np.float64).T @ np.asarray(c, np.float64)
    g1, g2 = grad(jax.random.key(1)), grad(jax.random.key(2))
    assert not np.array_equal(g1, g2)  # stochastic rounding draws from the key
    for g in (g1, g2):
        assert 0 < np.linalg.norm(g - ref) / np.linalg.norm(ref) < 0.05
    with pytest.raises(Exception, match="quant"):  # no 'quant' rng given
        jax.grad(lambda p: jnp.sum(qat.apply({"params": p}, x)))(params)


def test_statistics_lifecycle():
    model = zoo.LinenMLP()
    qat = qflax.quantize_model(model, qflax.QtProvider(STATIC))
    variables = qat.init(jax.random.key(0), X)
    first = variables["quant_stats"]["Dense_1"]["dot_general0_lhs"]  # the input layer
    assert int(first["count"]) == 0
    # Not mutable: nothing is updated (and nothing is returned).
    y = qat.apply(variables, X)
    assert y.shape == (8, 64)
    # Mutable: updated with the batch's range; a second batch is averaged in.
    after = calibrate(qat, variables, [X])["quant_stats"]["Dense_1"]["dot_general0_lhs"]
    assert int(after["count"]) == 1
    np.testing.assert_allclose(after["hi"], np.max(np.abs(np.asarray(X))), rtol=1e-6)
    twice = calibrate(qat, variables, [X, 3 * X])["quant_stats"]["Dense_1"]["dot_general0_lhs"]
    np.testing.assert_allclose(twice["hi"], 2 * np.max(np.abs(np.asarray(X))), rtol=1e-6)
    # Converting a statistic that saw nothing raises, naming it.
    ptq = qflax.quantize_model(model, qflax.PtqProvider(STATIC))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), X)["params"]
    with pytest.raises(ValueError, match=r"'Dense_\d/dot_general0_lhs' has count 0"):
        qflax.quantize_params(variables["params"], abstract, variables["quant_stats"])
    with pytest.raises(ValueError, match="needs quant_stats"):
        qflax.quantize_params(variables["params"], abstract)


def test_nnx_conversion_without_statistics_raises():
    with pytest.raises(ValueError, match="act_static_scale needs statistics"):
        qflax.quantize_model(zoo.NnxMLP(nnx.Rngs(0)), qflax.PtqProvider(STATIC), X)


def test_qat_training_reduces_the_loss():
    model = zoo.LinenMLP()
    qat = qflax.quantize_model(model, qflax.QtProvider(W4))
    params = qat.init(jax.random.key(0), X)["params"]
    target = jax.random.normal(jax.random.key(7), (8, 64))

    @jax.jit
    def step(p):
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((qat.apply({"params": p}, X) - target) ** 2)
        )(p)
        return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), loss

    losses = []
    for _ in range(30):
        params, loss = step(params)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
