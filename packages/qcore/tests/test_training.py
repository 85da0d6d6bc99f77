"""Quantized-training ops: forward, straight-through gradients, quantized gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qcore
from qcore import BackwardQuant, HowToQuantize, TrainingQuant, testing

INT8_ROWS = HowToQuantize(qtype="int8", channelwise_axes=(0,))
INT8_COLS = HowToQuantize(qtype="int8", channelwise_axes=(1,))
DIMS = (((1,), (0,)), ((), ()))
X = jax.random.normal(jax.random.key(0), (16, 64))
W = jax.random.normal(jax.random.key(1), (64, 32))
T = jax.random.normal(jax.random.key(2), (16, 32))  # regression target


def test_forward_is_the_quantized_op():
    cfg = TrainingQuant(lhs=INT8_ROWS, rhs=INT8_COLS)
    y = qcore.train_dot_general(X, W, DIMS, cfg)
    ref = qcore.dot_general(qcore.quantize(X, INT8_ROWS), qcore.quantize(W, INT8_COLS), DIMS)
    np.testing.assert_array_equal(y, ref)


def _loss(op):
    return lambda x, w: jnp.sum((op(x, w) - T) ** 2)


def test_gradients_match_the_fake_quant_ste_reference():
    # Reference: autodiff through fake_quant (STE) of both operands. Ours uses the
    # float residuals in the backward pass, so the two differ by the int8 error of
    # the other operand, well inside 0.03.
    cfg = TrainingQuant(lhs=INT8_ROWS, rhs=INT8_COLS)
    ours = jax.grad(_loss(lambda x, w: qcore.train_dot_general(x, w, DIMS, cfg)), (0, 1))(X, W)

    def fake(x, w):
        return qcore.fake_quant(x, INT8_ROWS) @ qcore.fake_quant(w, INT8_COLS)

    ref = jax.grad(_loss(fake), (0, 1))(X, W)
    for a, b in zip(ours, ref, strict=True):
        assert testing.max_rel_error(a, b) < 0.03


def test_gradients_match_finite_differences_of_the_surrogate():
    # With float backward residuals, the surrogate whose derivative we return is
    # L(x, w) = |Q(x)Q(w) - T|^2 differentiated as if Q were the identity *inside
    # the contraction*: dL/dw = x^T (2 (y_q - T)). Check that against central
    # finite differences of w -> |x w + (y_q - x w)|... i.e. of the linearisation
    # at the quantized output, computed in float64 numpy.
    cfg = TrainingQuant(lhs=INT8_ROWS, rhs=INT8_COLS)

    def op(x, w):
        return qcore.train_dot_general(x, w, DIMS, cfg)

    gx, gw = jax.grad(_loss(op), (0, 1))(X, W)
    x, w, t = (np.asarray(a, np.float64) for a in (X, W, T))
    yq = np.asarray(op(X, W), np.float64)

    def surrogate(x_, w_):
        return np.sum((yq + (x_ @ w_ - x @ w) - t) ** 2)

    eps = 1e-3
    for idx in [(0, 0), (5, 17), (63, 31)]:
        d = np.zeros_like(w)
        d[idx] = eps
        fd = (surrogate(x, w + d) - surrogate(x, w - d)) / (2 * eps)
        assert abs(fd - float(gw[idx])) < 1e-3 * max(1.0, abs(fd))
    for idx in [(0, 0), (7, 40)]:
        d = np.zeros_like(x)
        d[idx] = eps
        fd = (surrogate(x + d, w) - surrogate(x - d, w)) / (2 * eps)
        assert abs(fd - float(gx[idx])) < 1e-3 * max(1.0, abs(fd))


def test_quantized_backward_contractions():
    sr8 = HowToQuantize(qtype="int8", rounding="stochastic", channelwise_axes=(0,))
    cfg = TrainingQuant(
        lhs=INT8_ROWS,
        rhs=INT8_COLS,
        dlhs=BackwardQuant(grad=sr8, operand=INT8_COLS),
        drhs=BackwardQuant(grad=sr8, operand=INT8_ROWS),
    )
    g = jax.random.normal(jax.random.key(3), (16, 32))
    key = jax.random.key(4)
    _, vjp = jax.vjp(lambda x, w: qcore.train_dot_general(x, w, DIMS, cfg, key=key), X, W)
    dx, dw = vjp(g)
    # An independent reconstruction of what the config asks for, in float64.
    k3, k4 = jax.random.split(key, 4)[2:]
    k3a, _ = jax.random.split(k3)
    k4a, _ = jax.random.split(k4)

    def deq(a, how, k=None):
        return np.asarray(qcore.dequantize(qcore.quantize(a, how, key=k)), np.float64)

    np.testing.assert_allclose(dx, deq(g, sr8, k3a) @ deq(W, INT8_COLS).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, deq(X, INT8_ROWS).T @ deq(g, sr8, k4a), rtol=1e-5, atol=1e-5)
    # And it is a gradient estimate: close to the float one.
    assert testing.max_rel_error(dw, np.asarray(X).T @ np.asarray(g)) < 0.05


def test_stochastically_rounded_gradients_are_unbiased():
    sr4 = HowToQuantize(qtype="int4", rounding="stochastic")
    cfg = TrainingQuant(dlhs=BackwardQuant(grad=sr4), drhs=BackwardQuant(grad=sr4))
    g = jax.random.normal(jax.random.key(5), (16, 32))

    def dw(key):
        _, vjp = jax.vjp(lambda w: qcore.train_dot_general(X, w, DIMS, cfg, key=key), W)
        return vjp(g)[0]

    draws = jax.vmap(dw)(jax.random.split(jax.random.key(6), 400))
    exact = np.asarray(X, np.float64).T @ np.asarray(g, np.float64)
    single = np.mean(np.abs(np.asarray(draws[0]) - exact))
    mean = np.mean(np.abs(np.asarray(draws.mean(0)) - exact))
    # Averaging 400 unbiased draws shrinks the error by ~sqrt(400) = 20.
    assert mean < single / 10


def test_conv_gradients_are_not_zero_and_match_float():
    x = jax.random.normal(jax.random.key(7), (2, 8, 8, 3))
    k = jax.random.normal(jax.random.key(8), (3, 3, 3, 4))
    cfg = TrainingQuant(
        lhs=HowToQuantize(qtype="int8"), rhs=HowToQuantize(qtype="int8", channelwise_axes=(3,))
    )
    conv = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def loss_q(x, k):
        return jnp.sum(qcore.train_conv_general_dilated(x, k, config=cfg, **conv) ** 2)

    def loss_f(x, k):
        return jnp.sum(lax.conv_general_dilated(x, k, **conv) ** 2)

    gq = jax.grad(loss_q, (0, 1))(x, k)
    gf = jax.grad(loss_f, (0, 1))(x, k)
    for a, b in zip(gq, gf, strict=True):
        assert np.all(np.asarray(a) != 0.0) or np.count_nonzero(np.asarray(a)) > 0.9 * a.size
        assert testing.max_rel_error(a, b) < 0.03


def test_einsum_and_ragged_dot_training():
    cfg = TrainingQuant(lhs=INT8_ROWS, rhs=HowToQuantize(qtype="int8", channelwise_axes=(0, 2)))
    experts = jax.random.normal(jax.random.key(9), (3, 64, 8))
    gs = jnp.array([5, 0, 11], jnp.int32)
    gq = jax.grad(lambda e: jnp.sum(qcore.train_ragged_dot(X, e, gs, cfg) ** 2))(experts)
    gf = jax.grad(lambda e: jnp.sum(lax.ragged_dot(X, e, gs) ** 2))(experts)
    assert testing.max_rel_error(gq, gf) < 0.03
    np.testing.assert_array_equal(gq[1], 0.0)  # the empty group gets no gradient
    cfg2 = TrainingQuant(lhs=HowToQuantize(qtype="int8"), rhs=INT8_COLS)
    ge = jax.grad(lambda w: jnp.sum(qcore.train_einsum("bd,df->bf", X, w, cfg2) ** 2))(W)
    gr = jax.grad(lambda w: jnp.sum((X @ w) ** 2))(W)
    assert testing.max_rel_error(ge, gr) < 0.03


def test_jit_equals_eager_and_dtypes():
    cfg = TrainingQuant(lhs=INT8_ROWS, rhs=INT8_COLS)

    def f(x, w):
        return jax.grad(_loss(lambda a, b: qcore.train_dot_general(a, b, DIMS, cfg)), (0, 1))(x, w)

    eager, jitted = f(X, W), jax.jit(f)(X, W)
    for a, b in zip(eager, jitted, strict=True):
        # The forward is bit-identical; float gradient sums may be reassociated by XLA.
        assert testing.max_rel_error(a, b) < 1e-6
    xb = X.astype(jnp.bfloat16)
    g = jax.grad(lambda x: jnp.sum(qcore.train_dot_general(x, W, DIMS, cfg).astype(jnp.float32)))(
        xb
    )
    assert g.dtype == jnp.bfloat16


def test_errors():
    sr = HowToQuantize(qtype="int8", rounding="stochastic")
    with pytest.raises(ValueError, match="stochastic rounding: pass key="):
        qcore.train_dot_general(X, W, DIMS, TrainingQuant(dlhs=BackwardQuant(grad=sr)))
    with pytest.raises(ValueError, match="must be a qcore.TrainingQuant"):
        qcore.train_dot_general(X, W, DIMS, {"lhs": INT8_ROWS})  # type: ignore[arg-type]


def test_clip_gradient_zeroes_gradients_where_the_forward_saturates():
    fixed = HowToQuantize(qtype="int8", calibration="fixed,-1,1")
    cfg = TrainingQuant(lhs=fixed, rhs=fixed, clip_gradient=True)
    x = jnp.array([[0.5, 3.0, -0.2]])
    w = jnp.array([[1.5], [0.3], [-0.9]])
    dx, dw = jax.grad(lambda x, w: jnp.sum(qcore.train_dot_general(x, w, DIMS, cfg)), (0, 1))(x, w)
    # dx = w^T and dw = x^T (the gradient of a sum), zeroed where the operand itself
    # lies outside [-1, 1]: x[1] = 3.0 and w[0] = 1.5.
    np.testing.assert_allclose(dx, [[1.5, 0.0, -0.9]])
    np.testing.assert_allclose(dw, [[0.0], [3.0], [-0.2]])
    np.testing.assert_array_equal(
        qcore.fakequant.in_calibrated_range(x, fixed), [[True, False, True]]
    )
