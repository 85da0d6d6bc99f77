"""functional_call under jit/grad equals eager; straight-through and LSQ gradients; train_step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike import optim, quant
from qtorchlike.func import functional_call, train_step, trainable


def _model():
    qtorchlike.manual_seed(0)
    return qnn.Sequential(
        qnn.QuantIdentity(return_quant_tensor=True, collect_stats_steps=2),
        qnn.QuantConv2d(
            1,
            4,
            3,
            weight_quant=quant.Int8WeightPerChannelFloatLSQ,
            bias_quant=quant.Int32Bias,
            return_quant_tensor=True,
        ),
        qnn.QuantReLU(collect_stats_steps=2),
        qnn.Flatten(),
        qnn.QuantLinear(64, 3, weight_quant=quant.Int4WeightPerChannelFloat),
    )


X = jax.random.normal(jax.random.key(1), (2, 1, 6, 6))


@pytest.mark.parametrize("training", [True, False])
def test_jit_equals_eager_and_leaves_the_model_alone(training):
    model = _model()
    model(X)  # statistics, so eval has scales
    model.train(training)
    state = model.state_dict()
    eager_model = _model()
    eager_model.load_state_dict(state)
    eager_model.train(training)
    want = eager_model(X)
    got, new = jax.jit(lambda s, x: functional_call(model, s, x))(state, X)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():  # unchanged
        np.testing.assert_array_equal(v, state[k])
    # The returned buffers are those the eager pass produced.
    for k, v in eager_model.named_buffers():
        np.testing.assert_allclose(new[k], v, rtol=1e-6)


def test_gradients_reach_every_quantizer_and_are_finite():
    model = _model()
    model(X)
    params = trainable(model)
    assert {"0.act_quant.value", "1.weight_quant.value", "2.act_quant.value"} <= set(params)

    def loss(p):
        out, _ = functional_call(model, p, X)
        return jnp.sum(out**2)

    grads = jax.grad(loss)(params)
    for k, g in grads.items():
        assert np.all(np.isfinite(np.asarray(g))), k
    for k in ("1.weight", "1.bias", "4.weight", "4.bias"):
        assert np.abs(np.asarray(grads[k])).sum() > 0, k


def test_learned_weight_scale_gradient_matches_finite_differences_of_the_surrogate():
    # y = x @ w_hat(s).T with w_hat(s) = s * clip(w/s + stopgrad(round(w/s) - w/s)):
    # with the rounding held at s0, w_hat is w + s*c0 inside the range and s*qmax
    # outside; differentiate that surrogate numerically in float64.
    layer = qnn.QuantLinear(
        8, 3, weight_quant=quant.Int8WeightPerChannelFloatLSQ, weight_bit_width=3
    )
    layer.weight_quant.value = layer.weight_quant.value * 0.6  # some weights saturate
    x = np.asarray(jax.random.normal(jax.random.key(2), (5, 8)), np.float64)
    r = np.asarray(jax.random.normal(jax.random.key(3), (5, 3)), np.float64)
    params = trainable(layer)

    def loss(p):
        return jnp.sum(
            functional_call(layer, p, jnp.asarray(x, jnp.float32))[0] * jnp.asarray(r, jnp.float32)
        )

    g = np.asarray(jax.grad(loss)(params)["weight_quant.value"], np.float64).ravel()
    w = np.asarray(layer.weight, np.float64)
    t0 = np.asarray(layer.weight_quant.value, np.float64)  # thresholds, (3, 1)
    qmax = 3.0  # narrow 3-bit

    def surrogate(t):
        s = t / qmax
        v = w / (t0 / qmax)
        codes = np.clip(np.round(v), -qmax, qmax)
        inside = np.abs(v) <= qmax
        w_hat = np.where(inside, w + s * (codes - v), s * codes)
        b = np.asarray(layer.bias, np.float64)
        return np.sum((x @ w_hat.T + b) * r)

    eps = 1e-6
    fd = []
    for c in range(3):
        d = np.zeros_like(t0)
        d[c] = eps
        fd.append((surrogate(t0 + d) - surrogate(t0 - d)) / (2 * eps))
    np.testing.assert_allclose(g, fd, rtol=1e-4, atol=1e-5)


def test_activation_ste_gradient_is_identity_inside_the_range():
    ident = qnn.QuantIdentity(
        act_quant=quant.Int8ActPerTensorFloatMinMaxInit, min_val=-1.0, max_val=1.0
    )
    x = jnp.array([-3.0, -0.5, 0.2, 0.9, 2.0])
    g = jax.grad(lambda x: jnp.sum(functional_call(ident, {}, x)[0] * jnp.arange(1.0, 6.0)))(x)
    np.testing.assert_array_equal(np.asarray(g), [0, 2, 3, 4, 0])


def test_train_step_reduces_loss_and_updates_model_and_buffers():
    model = _model()
    opt = optim.Adam(model, lr=1e-2)
    y = jnp.array([0, 2])

    def loss_fn(m, x, y):
        logits = m(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    step = train_step(model, loss_fn, opt)
    before = np.asarray(model[1].weight)
    losses = [float(step(X, y)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    assert not np.array_equal(before, np.asarray(model[1].weight))
    assert int(model[0].act_quant.counter) == 2  # phase ended after 2 steps, under jit
    model.eval()  # a new trace for eval mode
    out = model(X)
    assert out.shape == (2, 3)


def test_optimizers_match_closed_form_steps():
    layer = qnn.QuantLinear(2, 1, bias=False, weight_quant=None)
    layer.weight = jnp.array([[1.0, -2.0]])
    g = {"weight": jnp.array([[0.5, -1.0]])}
    sgd = optim.SGD(layer, lr=0.1, momentum=0.9)
    sgd.step(g)
    sgd.step(g)  # buf = 0.9 * g + g
    np.testing.assert_allclose(layer.weight, [[1 - 0.05 - 0.095, -2 + 0.1 + 0.19]], rtol=1e-6)
    layer.weight = jnp.array([[1.0, -2.0]])
    adam = optim.Adam(layer, lr=0.1)
    adam.step(g)  # first Adam step moves each weight by lr * sign(g)
    np.testing.assert_allclose(layer.weight, [[0.9, -1.9]], rtol=1e-6)
    with pytest.raises(KeyError, match="missing \\['weight'\\]"):
        adam.step({})
    with pytest.raises(ValueError, match="lr=0"):
        optim.SGD(layer, lr=0)


def test_functional_call_rejects_unknown_keys():
    layer = qnn.QuantLinear(2, 1)
    with pytest.raises(KeyError, match="'weigth'.*neither parameters nor buffers"):
        functional_call(layer, {"weigth": jnp.ones((1, 2))}, jnp.ones((1, 2)))


def test_changing_the_learning_rate_between_jitted_steps_takes_effect():
    layer = qnn.QuantLinear(2, 1, weight_quant=None)
    opt = optim.SGD(layer, lr=0.1)
    step = train_step(layer, lambda m, x: jnp.sum(m(x)), opt)
    x = jnp.ones((1, 2))
    step(x)
    opt.lr = 0.0
    before = np.asarray(layer.weight)
    step(x)
    np.testing.assert_array_equal(np.asarray(layer.weight), before)
