"""QAT through JAX transforms that trace the training ops' rules later (``jax.checkpoint``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from archs import vit as zoo_vit

import qflax
from qflax import QuantizationRule as Rule

W8A8 = [Rule(weight_qtype="int8", act_qtype="int8")]
IMAGES = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
LABELS = jnp.array([3, 7])


def _loss(model, params, images=IMAGES):
    logits = model.apply({"params": params}, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()


def _ptq_forward(model, params, images):
    ptq = qflax.quantize_model(model, qflax.PtqProvider(W8A8))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), images)["params"]
    return jax.jit(ptq.apply)({"params": qflax.quantize_params(params, abstract)}, images)


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "no_remat"])
def test_vit_qat_step_under_scan_and_remat(remat):
    # MultiHeadDotProductAttention's q.k and attention.v einsums quantize two
    # activations; under nn.remat the training op's forward rule is traced by
    # jax.checkpoint's JVP after the op's handler returned (issue 20 item 2).
    model = zoo_vit.ViT(remat=remat)
    qat = qflax.quantize_model(model, qflax.QtProvider(W8A8))
    params = qat.init(jax.random.key(1), IMAGES)["params"]
    tx = optax.sgd(0.1)  # adam fails strict dtype promotion (optax bias correction)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: _loss(qat, p))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    new, _, loss, grads = step(params, tx.init(params))
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)  # every param gets a gradient
    # The QAT forward is the PTQ forward (w8a8 quantized by PtqProvider) bit for bit,
    # and the loss under value_and_grad is that forward's loss.
    y_qat = jax.jit(qat.apply)({"params": params}, IMAGES)
    y_ptq = _ptq_forward(model, params, IMAGES)
    np.testing.assert_array_equal(y_qat, y_ptq)
    ref = optax.softmax_cross_entropy_with_integer_labels(y_ptq, LABELS).mean()
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    assert float(_loss(qat, new)) != float(loss)  # the step changed the model


def test_vit_qat_gradients_do_not_depend_on_remat():
    # jax.checkpoint only recomputes the forward: the straight-through gradients
    # with and without remat agree to float32 rounding.
    def grads(remat):
        qat = qflax.quantize_model(zoo_vit.ViT(remat=remat), qflax.QtProvider(W8A8))
        params = qat.init(jax.random.key(1), IMAGES)["params"]
        return jax.jit(jax.grad(lambda p: _loss(qat, p)))(params)

    with_remat, without = grads(True), grads(False)
    # Tolerances relative to the largest gradient of the model: leaves whose
    # gradients are ~1e-9 (the MAP head's probe) differ by float32 rounding there.
    scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(without))
    for a, b in zip(jax.tree.leaves(with_remat), jax.tree.leaves(without), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale)


class _Gram(nn.Module):
    """``x xᵀ`` per batch row: both einsum operands are activations."""

    @nn.compact
    def __call__(self, x):
        return jnp.einsum("bqd,bkd->bqk", x, x)


def test_activation_times_activation_under_remat_is_straight_through():
    # loss = Σ c ⊙ fq(x) fq(x)ᵀ; straight-through: dloss/dx = (c + cᵀ) x, in float64.
    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    c = jax.random.normal(jax.random.key(3), (2, 5, 5))
    qat = qflax.quantize_model(nn.remat(_Gram)(), qflax.QtProvider(W8A8))
    variables = qat.init(jax.random.key(0), x)
    grad = jax.grad(lambda x: jnp.sum(qat.apply(variables, x) * c))(x)
    c64, x64 = np.asarray(c, np.float64), np.asarray(x, np.float64)
    ref = (c64 + c64.transpose(0, 2, 1)) @ x64
    np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)
