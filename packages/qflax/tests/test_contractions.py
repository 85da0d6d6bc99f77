"""Every contraction JAX offers is intercepted, and a weight that cannot be followed warns.

Each case is a model whose only op is one JAX contraction function, with an int8
weight rule: the weight must be stored quantized (Linen init and NNX
``quantize_model``) and the output must match a float64 reference computed with
NumPy from the float weight fake-quantized per output channel (qcore's symmetric
int8 maps max |w| over the contracted axes to 127.5 steps).
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import qflax

_NHWC = ("NHWC", "HWIO", "NHWC")


def _np_conv(x, w, stride=1):
    """float64 'SAME' NHWC x HWIO convolution with stride (closed form)."""
    kh, kw = w.shape[:2]
    h, wd = x.shape[1:3]
    oh, ow = -(-h // stride), -(-wd // stride)
    ph = max((oh - 1) * stride + kh - h, 0)
    pw = max((ow - 1) * stride + kw - wd, 0)
    xp = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    out = np.zeros((x.shape[0], oh, ow, w.shape[3]))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, i * stride : i * stride + kh, j * stride : j * stride + kw, :]
            out[:, i, j, :] = np.einsum("bhwi,hwio->bo", patch, w)
    return out


def _np_conv_transpose(x, w, stride):
    """float64 lax.conv_transpose(padding='SAME', transpose_kernel=False), closed form.

    The input dilated by ``stride`` (zeros between pixels), then convolved with
    the kernel unflipped, with lax's 'SAME' padding of a transposed convolution.
    """
    b, h, wd, c = x.shape
    kh, kw = w.shape[:2]
    dil = np.zeros((b, (h - 1) * stride + 1, (wd - 1) * stride + 1, c))
    dil[:, ::stride, ::stride] = x
    pads = []
    for k in (kh, kw):  # lax's 'SAME' padding of a transposed convolution
        pad_len = k + stride - 2
        lo = k - 1 if stride > k - 1 else -(-pad_len // 2)
        pads.append((lo, pad_len - lo))
    xp = np.pad(dil, ((0, 0), pads[0], pads[1], (0, 0)))
    oh, ow = xp.shape[1] - kh + 1, xp.shape[2] - kw + 1
    out = np.zeros((b, oh, ow, w.shape[3]))
    for i in range(oh):
        for j in range(ow):
            out[:, i, j, :] = np.einsum("bhwi,hwio->bo", xp[:, i : i + kh, j : j + kw], w)
    return out


def _nchw(f):
    """``f`` on NCHW inputs, given and returning NHWC arrays (the kernel is OIHW)."""
    return lambda x, w: f(x.transpose(0, 3, 1, 2), w).transpose(0, 2, 3, 1)


def _oihw(reference):
    """An NHWC x HWIO reference given an OIHW kernel."""
    return lambda x, w: reference(x, w.transpose(2, 3, 1, 0))


# name: (fn(x, w), x shape, w shape, contracted axes of w as the op sees it, float64 reference)
CASES = {
    "lax.dot": (lax.dot, (3, 8), (8, 5), (0,), np.dot),
    "jnp.dot": (jnp.dot, (3, 8), (8, 5), (0,), np.dot),
    "jnp.matmul": (jnp.matmul, (3, 8), (8, 5), (0,), np.matmul),
    "operator @": (lambda x, w: x @ w, (3, 8), (8, 5), (0,), np.matmul),
    "jnp.tensordot": (
        lambda x, w: jnp.tensordot(x, w, axes=2),
        (3, 4, 2),
        (4, 2, 5),
        (0, 1),
        lambda x, w: np.tensordot(x, w, axes=2),
    ),
    "jnp.inner": (jnp.inner, (3, 8), (5, 8), (1,), np.inner),
    "jnp.vdot": (jnp.vdot, (8, 5), (8, 5), (0,), np.vdot),  # w raveled: axes as the op sees it
    "jnp.vecdot": (jnp.vecdot, (3, 1, 8), (1, 5, 8), (2,), np.vecdot),
    "jnp.linalg.vecdot": (jnp.linalg.vecdot, (3, 1, 8), (1, 5, 8), (2,), np.linalg.vecdot),
    "jnp.linalg.multi_dot": (
        lambda x, w: jnp.linalg.multi_dot([x, w]),
        (3, 8),
        (8, 5),
        (0,),
        lambda x, w: np.linalg.multi_dot([x, w]),
    ),
    "jnp.matvec": (lambda x, w: jnp.matvec(w, x), (8,), (5, 8), (1,), lambda x, w: w @ x),
    "jnp.vecmat": (jnp.vecmat, (8,), (8, 5), (0,), lambda x, w: x @ w),
    "jnp.einsum": (
        lambda x, w: jnp.einsum("bk,kn->bn", x, w),
        (3, 8),
        (8, 5),
        (0,),
        lambda x, w: np.einsum("bk,kn->bn", x, w),
    ),
    "jnp.einsum sublists": (
        lambda x, w: jnp.einsum(x, [0, 1], w, [1, 2], [0, 2]),
        (3, 8),
        (8, 5),
        (0,),
        lambda x, w: x @ w,
    ),
    "lax.dot_general": (
        lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ()))),
        (3, 8),
        (8, 5),
        (0,),
        np.dot,
    ),
    "lax.conv_general_dilated": (
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_NHWC),
        (2, 5, 5, 4),
        (3, 3, 4, 6),
        (0, 1, 2),
        _np_conv,
    ),
    "lax.conv": (
        _nchw(lambda x, w: lax.conv(x, w, (1, 1), "SAME")),
        (2, 5, 5, 4),
        (6, 4, 3, 3),
        (1, 2, 3),
        _oihw(_np_conv),
    ),
    "lax.conv_with_general_padding": (
        _nchw(
            lambda x, w: lax.conv_with_general_padding(x, w, (2, 2), [(1, 1), (1, 1)], None, None)
        ),
        (2, 5, 5, 4),
        (6, 4, 3, 3),
        (1, 2, 3),
        _oihw(lambda x, w: _np_conv(x, w, stride=2)),
    ),
    "lax.conv_transpose": (
        lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=_NHWC),
        (2, 3, 3, 4),
        (3, 3, 4, 6),
        (0, 1, 2),
        lambda x, w: _np_conv_transpose(x, w, 2),
    ),
}


def _rules():
    return [qflax.QuantizationRule(weight_qtype="int8")]


class _Linen(nn.Module):
    fn: object
    w_shape: tuple

    @nn.compact
    def __call__(self, x):
        return self.fn(x, self.param("w", nn.initializers.normal(1.0), self.w_shape))


class _Nnx(nnx.Module):
    def __init__(self, fn, w_shape, rngs):
        self.fn = fn
        self.w = nnx.Param(jax.random.normal(rngs.params(), w_shape))

    def __call__(self, x):
        return self.fn(x, self.w[...])


def _stored(float_w, qp, contracted):
    """The stored int8 weight dequantized in float64, checked against ``float_w``.

    float64 reference: qcore's symmetric int8 maps max |w| over the contracted axes
    to 127.5 steps, so the scale is ``max |w| / 127.5`` per output channel and every
    code is within half a step of ``w``.
    """
    assert isinstance(qp, qflax.QuantizedParam) and qp.qarray.qvalue.dtype == jnp.int8
    codes = np.asarray(qp.qarray.qvalue, np.float64)
    scale = np.asarray(qp.qarray.scale, np.float64)
    w = np.asarray(float_w, np.float64).reshape(codes.shape)  # as the op saw it
    want = np.abs(w).max(axis=contracted, keepdims=True) / 127.5
    np.testing.assert_allclose(scale, want, rtol=1e-6)
    assert np.all(np.abs(codes * scale - w) <= scale * (0.5 + 1e-4))  # float32 scale
    return (codes * scale).reshape(np.shape(float_w))


def _check(y, x, float_w, qp, case):
    """``y`` is the case's op (float64 reference) on ``x`` and the stored int8 weight."""
    _, _, _, contracted, reference = case
    x = np.asarray(x, np.float64)
    want = reference(x, _stored(float_w, qp, contracted))
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-4, atol=1e-4)
    # the float model differs: the weight really was quantized
    assert np.abs(reference(x, np.asarray(float_w, np.float64)) - want).max() > 1e-4


@pytest.mark.parametrize("name", CASES)
def test_the_only_op_is_quantized_in_a_linen_model(name):
    case = CASES[name]
    fn, x_shape, w_shape = case[:3]
    x = jax.random.normal(jax.random.key(1), x_shape)
    model = _Linen(fn, w_shape)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(_rules()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unused rule, no unfollowed weight
        params = qmodel.init(jax.random.key(0), x)["params"]
        y = qmodel.apply({"params": params}, x)
    float_w = model.init(jax.random.key(0), x)["params"]["w"]
    _check(y, x, float_w, params["w"], case)


@pytest.mark.parametrize("name", CASES)
def test_the_only_op_is_quantized_in_an_nnx_model(name):
    case = CASES[name]
    fn, x_shape, w_shape = case[:3]
    x = jax.random.normal(jax.random.key(1), x_shape)
    model = _Nnx(fn, w_shape, nnx.Rngs(0))
    float_w = model.w[...]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qflax.quantize_model(model, qflax.PtqProvider(_rules()), x)
        y = model(x)
    _check(y, x, float_w, model.w.get_raw_value(), case)


def test_a_multi_dot_of_three_is_two_quantized_contractions():
    x = jax.random.normal(jax.random.key(1), (3, 8))

    class Chain(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = self.param("a", nn.initializers.normal(1.0), (8, 6))
            b = self.param("b", nn.initializers.normal(1.0), (6, 5))
            return jnp.linalg.multi_dot([x, a, b])

    qmodel = qflax.quantize_model(Chain(), qflax.PtqProvider(_rules()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = qmodel.init(jax.random.key(0), x)["params"]
    y = qmodel.apply({"params": params}, x)
    float_p = Chain().init(jax.random.key(0), x)["params"]
    a, b = (_stored(float_p[k], params[k], (0,)) for k in "ab")
    want = np.asarray(x, np.float64) @ a @ b
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-4, atol=1e-4)


# -- transforms between the read and the op: followed ------------------------------

_CKPT = jax.checkpoint(lambda x, w: x @ w)  # made outside any quantized call

# name: (fn(x, w) with w of shape (8, 5), contracted axes of w as the op sees it)
FOLLOWED = {
    "squeeze of w[None]": (lambda x, w: x @ jnp.squeeze(w[None]), (0,)),
    "expand_dims": (lambda x, w: jnp.einsum("bk,kon->bn", x, jnp.expand_dims(w, 1)), (0, 1)),
    "w[...] and w[:, :]": (lambda x, w: x @ w[...][:, :], (0,)),
    "jax.checkpoint made inside": (lambda x, w: jax.checkpoint(lambda a, b: a @ b)(x, w), (0,)),
    "jax.checkpoint made outside": (lambda x, w: _CKPT(x, w), (0,)),
    "jax.checkpoint static argnum": (
        lambda x, w: jax.checkpoint(lambda a, n, b: a @ b, static_argnums=(1,))(x, 3, w),
        (0,),
    ),
}


@pytest.mark.parametrize("name", FOLLOWED)
def test_a_weight_is_followed_through_reshapes_and_checkpoint(name):
    fn, contracted = FOLLOWED[name]
    case = (fn, (3, 8), (8, 5), contracted, np.dot)
    x = jax.random.normal(jax.random.key(1), (3, 8))
    _CKPT(x, jnp.ones((8, 5)))  # a float call first: its trace is cached by jax
    model = _Linen(fn, (8, 5))
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(_rules()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = qmodel.init(jax.random.key(0), x)["params"]
        y = qmodel.apply({"params": params}, x)
    _check(y, x, model.init(jax.random.key(0), x)["params"]["w"], params["w"], case)
    # the float model afterwards is float again (no quantized trace left in a cache)
    float_w = model.init(jax.random.key(0), x)["params"]["w"]
    np.testing.assert_allclose(
        fn(x, float_w),
        np.asarray(x, np.float64) @ np.asarray(float_w, np.float64),
        rtol=1e-5,
        atol=1e-5,
    )


def test_a_weight_is_followed_through_checkpoint_in_nnx():
    model = _Nnx(lambda x, w: jax.checkpoint(lambda a, b: a @ b)(x, w), (8, 5), nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 8))
    float_w = model.w[...]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qflax.quantize_model(model, qflax.PtqProvider(_rules()), x)
        y = model(x)
    _check(y, x, float_w, model.w.get_raw_value(), (None, None, None, (0,), np.dot))


# -- transforms that cannot be followed: one warning per param ----------------------

UNFOLLOWED = {
    "w * 1.0": lambda x, w: x @ (w * 1.0),
    "w + 0": lambda x, w: x @ (w + 0),
    "negated twice": lambda x, w: x @ jnp.negative(-w),
    "w[:, :4] slice": lambda x, w: x @ w[:, :4],
    "jnp.flip": lambda x, w: x @ jnp.flip(w, 0),
}


@pytest.mark.parametrize("name", UNFOLLOWED)
def test_a_weight_through_an_unfollowed_transform_warns_once_naming_param_and_site(name):
    fn = UNFOLLOWED[name]

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(1.0), (8, 5))
            return fn(x, w)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block(name="block")(x)

    x = jax.random.normal(jax.random.key(1), (3, 8))
    qmodel = qflax.quantize_model(Outer(), qflax.PtqProvider(_rules()))
    with pytest.warns(UserWarning) as record:
        params = qmodel.init(jax.random.key(0), x)["params"]
        qmodel.apply({"params": params}, x)
        qmodel.apply({"params": params}, x)
    messages = [str(r.message) for r in record if "block/w" in str(r.message)]
    assert len(messages) == 1, messages
    assert "'block/w'" in messages[0] and "'block/matmul0'" in messages[0]
    assert "float" in messages[0]
    # the param stays float, as the warning says
    assert not isinstance(params["block"]["w"], qflax.QuantizedParam)


def test_params_that_only_scale_activations_do_not_warn():
    """A LayerNorm scale or a bias meets activations, not a weight operand: no warning."""

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            h = nn.Dense(8)(h * self.param("gate", nn.initializers.ones, (8,)))
            return nn.Embed(10, 8)(jnp.array([[1, 2]])).sum() + h

    x = jax.random.normal(jax.random.key(1), (8,))  # one unbatched vector
    qmodel = qflax.quantize_model(Mlp(), qflax.PtqProvider(_rules()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = qmodel.init(jax.random.key(0), x)["params"]
        qmodel.apply({"params": params}, x)
    assert isinstance(params["Dense_0"]["kernel"], qflax.QuantizedParam)


def test_a_learned_query_broadcast_into_a_dense_layer_does_not_warn():
    """A MAP head's probe (a param broadcast to the batch) is the Dense layer's input."""

    class Pool(nn.Module):
        @nn.compact
        def __call__(self, x):
            probe = self.param("probe", nn.initializers.normal(1.0), (1, 1, 8))
            query = jnp.broadcast_to(probe, (x.shape[0], 1, 8))
            return nn.Dense(8)(query) + x.mean(axis=1, keepdims=True)

    x = jax.random.normal(jax.random.key(1), (3, 5, 8))
    qmodel = qflax.quantize_model(Pool(), qflax.PtqProvider(_rules()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = qmodel.init(jax.random.key(0), x)["params"]
        qmodel.apply({"params": params}, x)
    assert isinstance(params["Dense_0"]["kernel"], qflax.QuantizedParam)
    assert not isinstance(params["probe"], qflax.QuantizedParam)


def test_an_unfollowed_weight_warns_in_nnx():
    model = _Nnx(lambda x, w: x @ (w * 1.0), (8, 5), nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 8))
    with pytest.warns(UserWarning, match=r"'w'.*'matmul0'"):
        qflax.quantize_model(model, qflax.PtqProvider(_rules()), x)
    assert not isinstance(model.w.get_raw_value(), qflax.QuantizedParam)


class _Checkpointed(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (8, 5))
        return jax.checkpoint(lambda a, b: a @ b)(x, w)


def test_a_weight_followed_into_checkpoint_under_jit_and_qat():
    x = jax.random.normal(jax.random.key(1), (3, 8))
    qmodel = qflax.quantize_model(_Checkpointed(), qflax.PtqProvider(_rules()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jitted = jax.jit(qmodel.init)(jax.random.key(0), x)["params"]["w"]
    eager = qmodel.init(jax.random.key(0), x)["params"]["w"]
    np.testing.assert_array_equal(jitted.qarray.qvalue, eager.qarray.qvalue)
    float_w = _Checkpointed().init(jax.random.key(0), x)["params"]["w"]
    y = jax.jit(qmodel.apply)({"params": {"w": jitted}}, x)
    _check(y, x, float_w, jitted, (None, None, None, (0,), np.dot))
    # QAT: the checkpointed op trains with the straight-through gradient sum(x) per row
    qat = qflax.quantize_model(_Checkpointed(), qflax.QtProvider(_rules()))
    params = qat.init(jax.random.key(0), x)["params"]
    grad = jax.jit(jax.grad(lambda p: qat.apply({"params": p}, x).sum()))(params)["w"]
    want = np.broadcast_to(np.asarray(x, np.float64).sum(0)[:, None], (8, 5))
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def test_an_opdef_split_must_be_callable():
    with pytest.raises(
        ValueError, match=r"split='yes' is not allowed; allowed: a callable or None"
    ):
        qflax.OpDef(name="mine", targets=lambda: (), bind=lambda a: None, split="yes")
