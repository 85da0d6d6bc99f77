"""Random Hadamard rotation (qflax.rotation) and its wiring into the providers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
import qflax
from qflax.rotation import Hadamard, block_size, matrix, rotate


def sylvester(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


@pytest.mark.parametrize("k", [1, 7, 8, 12, 96, 128])
def test_rotation_matrix_is_orthogonal_and_block_hadamard(k):
    r = matrix(k, seed=3)
    np.testing.assert_allclose(r @ r.T, np.eye(k), atol=1e-12)
    b = block_size(k)
    assert k % b == 0 and b & (b - 1) == 0 and (k // b) % 2 == 1
    # |entries| are 1/sqrt(b) on the diagonal blocks and 0 elsewhere.
    mask = np.kron(np.eye(k // b), np.ones((b, b)))
    np.testing.assert_allclose(np.abs(r), mask / np.sqrt(b), atol=1e-12)
    # R = D H_b (blockwise) with random signs D.
    d = np.diag(r[:, :1].ravel() * np.sqrt(b)) if b == k else None
    if d is not None:
        np.testing.assert_allclose(d @ sylvester(b) / np.sqrt(b), r, atol=1e-12)


@pytest.mark.parametrize("k", [8, 12, 96])
def test_fast_transform_matches_the_matrix_and_inverts(k):
    x = np.random.default_rng(0).normal(size=(3, k, 5))
    got = np.asarray(rotate(jnp.asarray(x, jnp.float32), axis=1, seed=1), np.float64)
    want = np.einsum("akc,kj->ajc", x, matrix(k, 1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    back = rotate(rotate(jnp.asarray(x, jnp.float32), 1, 1), 1, 1, inverse=True)
    np.testing.assert_allclose(np.asarray(back), x, atol=1e-5)


def test_rotating_both_operands_preserves_the_float_product():
    rng = np.random.default_rng(1)
    x, w = rng.normal(size=(4, 96)), rng.normal(size=(96, 10))
    xr = rotate(jnp.asarray(x, jnp.float32), axis=1, seed=5)
    wr = rotate(jnp.asarray(w, jnp.float32), axis=0, seed=5)
    got = np.asarray(jnp.matmul(xr, wr, precision=jax.lax.Precision.HIGHEST), np.float64)
    np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4)


K, N = 96, 24  # K is not a power of two: blocks of 32


def outlier_inputs(key, batches=2, rows=64):
    channels = jnp.ones(K).at[jnp.array([2, 40, 77])].set(jnp.array([50.0, 80.0, 30.0]))
    return [z * channels[None] for z in jax.random.normal(key, (batches, rows, K))]


def ptq(rules, x, params):
    qmodel = qflax.quantize_model(nn.Dense(N), qflax.PtqProvider(rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    return qmodel, qflax.quantize_params(params, abstract)


def mae(qmodel, qparams, fparams, xs):
    w = np.asarray(fparams["kernel"], np.float64)
    b = np.asarray(fparams["bias"], np.float64)
    errs = [
        np.mean(
            np.abs(
                np.asarray(qmodel.apply({"params": qparams}, x), np.float64)
                - (np.asarray(x, np.float64) @ w + b)
            )
        )
        for x in xs
    ]
    return float(np.mean(errs))


@pytest.mark.parametrize(
    ("weight", "act", "outlier_acts"),
    [("int4", "int8", True), ("int4", None, False), (None, "int8", True)],
)
def test_hadamard_int4_beats_plain_int4_on_outlier_channels(weight, act, outlier_acts):
    # Outlier weight rows (as trained LLM weights have where activations are large)
    # and/or outlier activation channels. Rotation spreads them over blocks of 32.
    # (With Flax's truncated-normal init and no weight outliers, rotation makes
    # the int4 weight error slightly worse: the rotated weight is fully Gaussian.)
    fparams = nn.Dense(N).init(jax.random.key(1), jnp.ones((1, K)))["params"]
    if weight is not None:
        rows = jnp.ones(K).at[jnp.array([5, 50])].set(20.0)
        fparams = {**fparams, "kernel": fparams["kernel"] * rows[:, None]}
    if outlier_acts:
        xs = outlier_inputs(jax.random.key(0))
    else:
        xs = [jax.random.normal(jax.random.key(i), (64, K)) for i in range(2)]
    plain = [qflax.QuantizationRule(weight_qtype=weight, act_qtype=act)]
    rotated = [qflax.QuantizationRule(weight_qtype=weight, act_qtype=act, rotation="hadamard")]
    m0, p0 = ptq(plain, xs[0], fparams)
    m1, p1 = ptq(rotated, xs[0], fparams)
    e0, e1 = mae(m0, p0, fparams, xs), mae(m1, p1, fparams, xs)
    print(f"weight={weight} act={act} MAE: plain {e0:.5f} Hadamard {e1:.5f}")
    assert e1 < 0.5 * e0


def test_weight_is_stored_rotated_bit_identically_and_mismatches_error():
    xs = outlier_inputs(jax.random.key(0), batches=1)
    fparams = nn.Dense(N).init(jax.random.key(1), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int4", act_qtype="int8", rotation="hadamard")]
    qmodel, q = ptq(rules, xs[0], fparams)
    recipe = q["kernel"].recipe
    assert recipe.rotation == Hadamard(seed=0, axis=0)
    # The stored weight is Q(R^T W): dequantized, within half a step of the rotated float.
    wr = matrix(K, 0).T @ np.asarray(fparams["kernel"], np.float64)
    got = np.asarray(qcore.dequantize(q["kernel"].qarray), np.float64)
    step = np.max(np.abs(wr), axis=0, keepdims=True) / 7.0
    assert np.all(np.abs(got - wr) <= 0.5 * step * (1 + 1e-4))
    # In-model quantization (init with the float params, mutable) is bit-identical.
    _, inmodel = qmodel.apply({"params": fparams}, xs[0], mutable=["params"])
    for a, b in zip(
        jax.tree.leaves(inmodel["params"]["kernel"]), jax.tree.leaves(q["kernel"]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A checkpoint quantized without the rotation does not load into the rotated model,
    # nor the other way round.
    plain_model, plain = ptq([qflax.QuantizationRule(weight_qtype="int4")], xs[0], fparams)
    with pytest.raises(ValueError, match="rotation=None.*needs rotation=Hadamard"):
        qmodel.apply({"params": plain}, xs[0])
    with pytest.raises(ValueError, match="rotation=Hadamard.*needs rotation=None"):
        plain_model.apply({"params": q}, xs[0])
    # A different seed is a different rotation.
    other = [qflax.QuantizationRule(weight_qtype="int4", rotation="hadamard", rotation_seed=1)]
    with pytest.raises(ValueError, match="seed=0.*seed=1"):
        ptq(other, xs[0], fparams)[0].apply({"params": q}, xs[0])


def test_qat_forward_equals_ptq_forward_with_rotation():
    xs = outlier_inputs(jax.random.key(0), batches=1)
    fparams = nn.Dense(N).init(jax.random.key(1), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int4", act_qtype="int8", rotation="hadamard")]
    qmodel, q = ptq(rules, xs[0], fparams)
    qat = qflax.quantize_model(nn.Dense(N), qflax.QtProvider(rules))
    y_qat = qat.apply({"params": fparams}, xs[0])
    y_ptq = qmodel.apply({"params": q}, xs[0])
    np.testing.assert_allclose(np.asarray(y_qat), np.asarray(y_ptq), rtol=1e-5, atol=1e-4)
    g = jax.grad(lambda p: jnp.sum(qat.apply({"params": p}, xs[0]) ** 2))(fparams)
    assert np.all(np.isfinite(np.asarray(g["kernel"])))


def test_bad_rotation_arguments_are_errors():
    with pytest.raises(ValueError, match=r"rotation='fourier' is not allowed; allowed: \(None"):
        qflax.QuantizationRule(weight_qtype="int4", rotation="fourier")
    with pytest.raises(ValueError, match="rotation_seed=-1 must be a non-negative int"):
        qflax.QuantizationRule(weight_qtype="int4", rotation="hadamard", rotation_seed=-1)
    with pytest.raises(ValueError, match="k=0 must be a positive int"):
        block_size(0)
    conv = qflax.quantize_model(
        nn.Conv(4, (3,)),
        qflax.PtqProvider([qflax.QuantizationRule(weight_qtype="int8", rotation="hadamard")]),
    )
    with pytest.raises(ValueError, match="contracts exactly one axis"):
        conv.init(jax.random.key(0), jnp.ones((1, 8, 4)))
