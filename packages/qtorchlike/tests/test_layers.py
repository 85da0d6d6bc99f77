"""QuantConvTranspose2d, QuantEltwiseAdd, QuantCat, TruncAvgPool2d, QuantEmbedding, QuantUpsample.

References are independent float64 NumPy computations: a direct scatter for the
transposed convolution, closed-form integer codes for the truncated average
pool, a gather of fake-quantized weights for the embedding.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtorchlike.nn as qnn
from qtorchlike import QuantTensor
from qtorchlike.func import functional_call
from qtorchlike.quant import (
    Int8ActPerTensorFloat,
    Int8WeightPerChannelFloat,
)

RNG = np.random.default_rng(0)


def _normal(*shape, scale=1.0):
    return jnp.asarray(RNG.normal(0.0, scale, shape), jnp.float32)


def _qt(codes, scale, signed, bits=8.0):
    codes = jnp.asarray(codes, jnp.float32)
    s = jnp.asarray(scale, jnp.float32)
    return QuantTensor(codes * s, s, jnp.zeros((), jnp.float32), bits, signed, False)


def _fake_quant_np(w, bits=8, narrow=True):
    """Per-tensor symmetric max-abs fake quantization in float64."""
    w = np.asarray(w, np.float64)
    hi = 2 ** (bits - 1) - 1
    s = np.abs(w).max() / hi
    return np.clip(np.round(w / s), -hi if narrow else -hi - 1, hi) * s, s


def _jit_equal(layer, *args):
    """Runs ``layer`` under jax.jit through functional_call and eagerly; both from one state."""
    state = layer.state_dict()
    jitted, _ = jax.jit(lambda st, *a: functional_call(layer, st, *a))(state, *args)
    eager = layer(*args)
    leaves_j, leaves_e = jax.tree.leaves(jitted), jax.tree.leaves(eager)
    assert len(leaves_j) == len(leaves_e)
    for a, b in zip(leaves_j, leaves_e, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# -- QuantConvTranspose2d ------------------------------------------------------------------


def _conv_transpose_ref(x, w, b, stride, padding, output_padding, groups, dilation):
    """Transposed convolution by direct scatter: each input pixel adds ``x * w`` to the output."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, cin, h, wd = x.shape
    _, cout_g, kh, kw = w.shape
    (sh, sw), (ph, pw), (oph, opw), (dh, dw) = stride, padding, output_padding, dilation
    hout = (h - 1) * sh - 2 * ph + dh * (kh - 1) + oph + 1
    wout = (wd - 1) * sw - 2 * pw + dw * (kw - 1) + opw + 1
    out = np.zeros((n, cout_g * groups, hout, wout))
    cin_g = cin // groups
    for ci in range(cin):
        g = ci // cin_g
        for i in range(h):
            for j in range(wd):
                for a in range(kh):
                    for c in range(kw):
                        oi, oj = i * sh - ph + a * dh, j * sw - pw + c * dw
                        if 0 <= oi < hout and 0 <= oj < wout:
                            contrib = x[:, ci, i, j][:, None] * w[ci, :, a, c][None, :]
                            out[:, g * cout_g : (g + 1) * cout_g, oi, oj] += contrib
    if b is not None:
        out += np.asarray(b, np.float64)[None, :, None, None]
    return out


CT_CASES = [
    # out, kernel, stride, padding, output_padding, groups, dilation (in_channels 4)
    (4, 3, 2, 1, 1, 1, 1),
    (4, 3, 2, 1, 1, 2, 1),
    (4, 3, (2, 1), (1, 0), (1, 0), 2, (2, 1)),
]
# Few distinct shapes keep the file fast: each new shape costs XLA compilations
# (random initialisation alone takes ~0.5 s per weight shape on CPU).
X4 = _normal(2, 4, 4, 4)


def _pairs(*vals):
    return [(v, v) if isinstance(v, int) else tuple(v) for v in vals]


def _ct(cout, k, s, p, op, g, d, **kw):
    return qnn.QuantConvTranspose2d(
        4, cout, k, stride=s, padding=p, output_padding=op, groups=g, dilation=d,
        key=jax.random.key(1), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("case", CT_CASES)
def test_conv_transpose_matches_scatter_reference(case):
    cout, k, s, p, op, g, d = case
    layer = _ct(*case, weight_quant=None)
    y = layer(X4)
    k2, s2, p2, op2, d2 = _pairs(k, s, p, op, d)
    ref = _conv_transpose_ref(X4, layer.weight, layer.bias, s2, p2, op2, g, d2)
    assert layer.weight.shape == (4, cout // g, *k2)
    assert y.shape == ref.shape == (2, cout, *layer.output_size((4, 4)))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    if case == CT_CASES[0]:
        assert y.shape == (2, 4, 8, 8)  # (4 - 1) * 2 - 2 * 1 + (3 - 1) + 1 + 1


@pytest.mark.parametrize("case", CT_CASES[:2], ids=["groups1", "groups2"])
def test_conv_transpose_quantized_is_float_op_on_fake_quant_weight(case):
    layer = _ct(*case)  # default Int8WeightPerTensorFloat
    wq = layer.quant_weight()
    expect_w, s = _fake_quant_np(layer.weight)
    assert isinstance(wq, QuantTensor) and wq.is_valid
    np.testing.assert_allclose(np.asarray(wq.value), expect_w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(wq.scale.reshape(())), s, rtol=1e-6)
    g = case[5]
    ref = _conv_transpose_ref(X4, expect_w, layer.bias, (2, 2), (1, 1), (1, 1), g, (1, 1))
    np.testing.assert_allclose(np.asarray(layer(X4)), ref, rtol=1e-5, atol=1e-5)
    if g == 2:  # jit equals eager; gradients reach weight and bias
        _jit_equal(layer, X4)
        params = dict(layer.named_parameters())
        loss = lambda p: jnp.sum(functional_call(layer, p, X4)[0] ** 2)  # noqa: E731
        grads = jax.jit(jax.grad(loss))(params)
        for name in ("weight", "bias"):
            assert bool(jnp.all(jnp.isfinite(grads[name]))) and bool(jnp.any(grads[name] != 0))


def test_conv_transpose_prefixed_kwargs_and_per_channel():
    layer = _ct(*CT_CASES[0], weight_quant=Int8WeightPerChannelFloat, weight_bit_width=4)
    wq = layer.quant_weight()
    assert float(wq.bit_width) == 4.0
    assert wq.scale.shape == (1, 4, 1, 1)  # output channels sit on weight axis 1
    assert int(jnp.abs(wq.int()).max()) == 7
    w = np.asarray(layer.weight, np.float64)
    np.testing.assert_allclose(
        np.asarray(wq.scale).ravel(), np.abs(w).max(axis=(0, 2, 3)) / 7, rtol=1e-6
    )
    with pytest.raises(TypeError, match="bit_width"):
        _ct(*CT_CASES[0], bit_width=4)


def test_conv_transpose_quant_tensor_output_and_accumulator_bits():
    layer = qnn.QuantConvTranspose2d(
        4, 2, 3, stride=2, bias=False, input_quant=Int8ActPerTensorFloat, return_quant_tensor=True
    )
    layer(X4)  # one training step of input statistics
    y = layer.eval()(X4)
    assert isinstance(y, QuantTensor) and y.is_valid
    # 4 inputs times at most ceil(3 / 2)^2 = 4 overlapping taps per output position
    # (not weight axis 1 times the kernel, 2 * 9, as for a direct convolution)
    assert float(y.bit_width) == math.ceil(math.log2(255 * 255 * 4 * 4)) == 20


def test_conv_transpose_argument_errors():
    with pytest.raises(ValueError, match="output_padding=2 must be smaller than the stride"):
        qnn.QuantConvTranspose2d(2, 2, 3, stride=2, output_padding=2)
    with pytest.raises(ValueError, match="groups=3 must divide in_channels=4"):
        qnn.QuantConvTranspose2d(4, 6, 3, groups=3)
    with pytest.raises(ValueError, match="kernel_size="):
        qnn.QuantConvTranspose2d(4, 6, (3, 3, 3))
    layer = _ct(*CT_CASES[0])
    with pytest.raises(ValueError, match=r"expects input of shape \(N, 4, H, W\)"):
        layer(jnp.ones((1, 3, 4, 4)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stride": 0}, r"stride=0: every entry must be >= 1"),
        ({"kernel_size": (3, 0)}, r"kernel_size=\(3, 0\): every entry must be >= 1"),
        ({"padding": -1}, r"padding=-1: every entry must be >= 0"),
        ({"dilation": 1.5}, r"dilation=1.5 must be an int or a tuple of 2 ints"),
        ({"groups": 0}, r"groups=0 must be a positive int"),
        ({"in_channels": True}, r"in_channels=True must be a positive int"),
        ({"groups": 3}, r"groups=3 must divide in_channels=4 and out_channels=6"),
    ],
)
def test_conv2d_argument_errors(kwargs, match):
    args = {"in_channels": 4, "out_channels": 6, "kernel_size": 3} | kwargs
    with pytest.raises(ValueError, match=match):
        qnn.QuantConv2d(**args)


# -- QuantEltwiseAdd, QuantCat --------------------------------------------------------------


def _train(layer, *args, steps=3):
    for _ in range(steps):
        layer(*args)
    return layer.eval()


def _act_fake_quant_np(x, proxy):
    """int8 fake quantization with the proxy's eval scale (running threshold / 128)."""
    s = float(proxy.running) / 128
    return np.clip(np.round(np.asarray(x, np.float64) / s), -128, 127) * s, s


B4 = _normal(2, 4, 4, 4, scale=10.0)  # a second operand on a 10x wider range


def test_eltwise_add_shares_one_grid_in_eval():
    add = _train(qnn.QuantEltwiseAdd(output_quant=None, return_quant_tensor=True), X4, B4)
    y = add(X4, B4)
    assert isinstance(y, QuantTensor) and y.is_valid
    assert float(y.bit_width) == 9.0
    qa, s = _act_fake_quant_np(X4, add.input_quant)
    qb, _ = _act_fake_quant_np(B4, add.input_quant)
    np.testing.assert_allclose(float(y.scale.reshape(())), s, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y.value), qa + qb, rtol=1e-5, atol=1e-5)

    # With its default output quantizer the sum is re-quantized to 8 bits, still valid.
    add8 = _train(qnn.QuantEltwiseAdd(return_quant_tensor=True), X4, B4)
    y8 = add8(X4, B4)
    assert y8.is_valid and float(y8.bit_width) == 8.0

    # Separately quantized operands live on different grids: eval addition refuses.
    qid_a = _train(qnn.QuantIdentity(return_quant_tensor=True), X4)
    qid_b = _train(qnn.QuantIdentity(return_quant_tensor=True), B4)
    with pytest.raises(ValueError, match="different scales"):
        qid_a(X4) + qid_b(B4)


def test_eltwise_add_prefixed_kwargs():
    add = qnn.QuantEltwiseAdd(
        input_bit_width=4, output_bit_width=6, output_quant=Int8ActPerTensorFloat
    )
    assert add.input_quant.spec.bit_width == 4
    assert add.output_quant.spec.bit_width == 6
    add4 = qnn.QuantEltwiseAdd(input_bit_width=4, output_quant=None, return_quant_tensor=True)
    assert float(add4(X4, B4).bit_width) == 5.0
    plain = qnn.QuantEltwiseAdd(input_quant=None, output_quant=None)(X4, B4)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(X4 + B4))
    with pytest.raises(TypeError, match="bit_width"):
        qnn.QuantEltwiseAdd(bit_width=4)


def test_eltwise_add_jit_and_grad():
    add = qnn.QuantEltwiseAdd(return_quant_tensor=True)
    _jit_equal(add, X4, B4)  # training mode: statistics update inside the trace
    _train(add, X4, B4)
    _jit_equal(add, X4, B4)  # eval
    state = add.state_dict()
    ga = jax.jit(jax.grad(lambda x: jnp.sum(functional_call(add, state, x, B4)[0].value)))(X4)
    assert bool(jnp.all(jnp.isfinite(ga))) and bool(jnp.any(ga != 0))


def test_quant_cat_works_on_one_grid():
    cat = _train(qnn.QuantCat(output_quant=None, return_quant_tensor=True), [X4, B4])
    y = cat([X4, B4])
    assert isinstance(y, QuantTensor) and y.is_valid and y.shape == (2, 8, 4, 4)
    qa, s = _act_fake_quant_np(X4, cat.input_quant)
    qb, _ = _act_fake_quant_np(B4, cat.input_quant)
    np.testing.assert_allclose(np.asarray(y.value), np.concatenate([qa, qb], 1), atol=1e-5)
    np.testing.assert_allclose(float(y.scale.reshape(())), s, rtol=1e-6)
    assert float(y.bit_width) == 8.0
    assert cat([X4, B4], dim=0).shape == (4, 4, 4, 4)
    # Default output quantizer, plain array out.
    plain = _train(qnn.QuantCat(), [X4, B4])([X4, B4])
    assert isinstance(plain, jax.Array) and plain.shape == (2, 8, 4, 4)
    with pytest.raises(ValueError, match="tensors=\\[\\]"):
        cat([])


def test_quant_cat_prefixed_kwargs_jit_and_grad():
    cat = qnn.QuantCat(input_bit_width=4, output_quant=None, return_quant_tensor=True)
    assert float(cat([X4, B4]).bit_width) == 4.0
    _jit_equal(cat, [X4, B4])
    state = cat.state_dict()
    loss = lambda x: jnp.sum(functional_call(cat, state, [x, B4])[0].value ** 2)  # noqa: E731
    g = jax.jit(jax.grad(loss))(X4)
    assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0))


# -- TruncAvgPool2d -------------------------------------------------------------------------

PSHAPE = (2, 2, 6, 6)  # one input shape for every pooling test (6 is a multiple of 2 and 3)


def _window_sums(codes, k):
    n, c, h, w = codes.shape
    return codes.reshape(n, c, h // k, k, w // k, k).sum((3, 5))


@pytest.mark.parametrize(
    "k,signed,bits,rounding",
    [
        (3, False, 8, "round"),
        (2, False, 8, "round"),
        (3, False, 8, "floor"),
        (3, True, 8, "round"),
        (3, True, 4, "round"),
    ],
)
def test_trunc_avg_pool_integer_codes(k, signed, bits, rounding):
    lo, hi = (-128, 127) if signed else (0, 255)
    codes = RNG.integers(lo, hi + 1, PSHAPE).astype(np.float64)
    s = 0.05
    pool = qnn.TruncAvgPool2d(k, bit_width=bits, float_to_int_impl_type=rounding)
    y = pool(_qt(codes, s, signed))
    sums = _window_sums(codes, k)
    bw_acc = math.ceil(math.log2(255 * k * k))
    shift = 2.0 ** max(bw_acc - bits, 0)
    rnd = np.floor if rounding == "floor" else np.round  # np.round: half to even
    olo, ohi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    expect = np.clip(rnd(sums / shift), olo, ohi)
    assert isinstance(y, QuantTensor) and y.is_valid
    assert y.signed is signed and float(y.bit_width) == bits
    np.testing.assert_array_equal(np.asarray(y.int(float_datatype=True)), expect)
    np.testing.assert_allclose(float(y.scale.reshape(())), s / (k * k) * shift, rtol=1e-6)


def test_trunc_avg_pool_scales_and_ties():
    s = 0.5
    # 3x3 window sums 8, 24, 40 over 2^(12 - 8) = 16: 0.5, 1.5, 2.5
    codes = np.zeros(PSHAPE)
    codes[0, 0, 0, 0], codes[0, 0, 0, 3], codes[0, 0, 3, 0] = 8, 24, 40
    q = _qt(codes, s, False)
    y = qnn.TruncAvgPool2d(3)(q)
    assert float(y.scale) == pytest.approx(s * 16 / 9)
    assert y.int()[0, 0].tolist() == [[0, 2], [2, 0]]  # half to even
    y = qnn.TruncAvgPool2d(3, float_to_int_impl_type="floor")(q)
    assert y.int()[0, 0].tolist() == [[0, 1], [2, 0]]
    assert float(qnn.TruncAvgPool2d(2)(q).scale) == pytest.approx(s)  # 2x2 keeps the scale


def test_trunc_avg_pool_plain_and_flags():
    x = _normal(*PSHAPE)
    out = qnn.TruncAvgPool2d(2)(x)
    np.testing.assert_allclose(
        np.asarray(out), _window_sums(np.asarray(x, np.float64), 2) / 4, rtol=1e-5
    )
    q = _qt(RNG.integers(0, 256, PSHAPE), 0.1, False)
    arr = qnn.TruncAvgPool2d(2, return_quant_tensor=False)(q)
    assert isinstance(arr, jax.Array) and arr.shape == (2, 2, 3, 3)
    with pytest.raises(ValueError, match="float_to_int_impl_type='ceil'"):
        qnn.TruncAvgPool2d(2, float_to_int_impl_type="ceil")
    with pytest.raises(ValueError, match="bit_width=0"):
        qnn.TruncAvgPool2d(2, bit_width=0)
    with pytest.raises(ValueError, match="kernel_size="):
        qnn.TruncAvgPool2d((2, 2, 2))


def test_trunc_avg_pool_jit_and_straight_through_grad():
    pool = qnn.TruncAvgPool2d(3)
    q = _qt(RNG.integers(0, 200, PSHAPE), 0.1, False)
    _jit_equal(pool, q)
    g = jax.jit(jax.grad(lambda v: jnp.sum(pool(q._like(v)).value)))(q.value)
    # straight-through rounding: the gradient of a window mean, 1/9 per input
    np.testing.assert_allclose(np.asarray(g), np.full(q.shape, 1 / 9), rtol=1e-5)


# -- QuantEmbedding -------------------------------------------------------------------------

NE, DE = 64, 8  # one table shape for every embedding test


def test_embedding_matches_gather_of_fake_quant_weight():
    emb = qnn.QuantEmbedding(NE, DE, return_quant_tensor=True, key=jax.random.key(3))
    ids = jnp.array([[0, 3, 63], [3, 3, 7]])
    y = emb(ids)
    wq, s = _fake_quant_np(emb.weight)
    assert isinstance(y, QuantTensor) and y.is_valid and y.shape == (2, 3, DE)
    np.testing.assert_allclose(np.asarray(y.value), wq[np.asarray(ids)], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(y.scale.reshape(())), s, rtol=1e-6)
    plain = qnn.QuantEmbedding(NE, DE, weight_quant=None)(ids)
    assert isinstance(plain, jax.Array)


def test_embedding_init_padding_idx_and_grad():
    emb = qnn.QuantEmbedding(NE, DE, padding_idx=-1, key=jax.random.key(4))
    w = np.asarray(emb.weight)
    assert emb.padding_idx == NE - 1 and not w[NE - 1].any()
    assert abs(w[:-1].mean()) < 0.15 and abs(w[:-1].std() - 1) < 0.1  # N(0, 1), 504 samples
    ids = jnp.array([1, 1, 5, NE - 1])
    params = dict(emb.named_parameters())
    g = jax.jit(jax.grad(lambda p: jnp.sum(functional_call(emb, p, ids)[0])))(params)["weight"]
    counts = np.bincount(np.asarray(ids), minlength=NE).astype(np.float64)
    counts[NE - 1] = 0.0  # the padding row gets no gradient
    np.testing.assert_allclose(np.asarray(g), np.repeat(counts[:, None], DE, 1), atol=1e-6)


def test_embedding_per_channel_and_prefixed_kwargs():
    emb = qnn.QuantEmbedding(
        NE, DE, weight_quant=Int8WeightPerChannelFloat, weight_bit_width=4, return_quant_tensor=True
    )
    wq = emb.quant_weight()
    assert wq.scale.shape == (NE, 1) and float(wq.bit_width) == 4.0
    w = np.asarray(emb.weight, np.float64)
    s = np.abs(w).max(axis=1, keepdims=True) / 7
    y = emb(jnp.array([5, 0]))
    assert isinstance(y, jax.Array)  # per-row scales: plain values
    np.testing.assert_allclose(np.asarray(y), (np.round(w / s) * s)[[5, 0]], atol=1e-6)
    per_tensor = qnn.QuantEmbedding(NE, DE, weight_bit_width=4, return_quant_tensor=True)
    assert float(per_tensor(jnp.array([1])).bit_width) == 4.0
    with pytest.raises(TypeError, match="bit_width"):
        qnn.QuantEmbedding(NE, DE, bit_width=4)


def test_embedding_errors_and_jit():
    emb = qnn.QuantEmbedding(NE, DE)
    with pytest.raises(IndexError, match=r"id 64 is out of range; ids must be in \[0, 63\]"):
        emb(jnp.array([0, 64]))
    with pytest.raises(IndexError, match="id -1"):
        emb(jnp.array([-1]))
    with pytest.raises(TypeError, match="integer ids"):
        emb(jnp.array([1.0]))
    with pytest.raises(ValueError, match="padding_idx=64"):
        qnn.QuantEmbedding(NE, DE, padding_idx=64)
    ids = jnp.array([[4, 0], [2, 2]])
    _jit_equal(emb, ids)
    state = emb.state_dict()
    bad, _ = jax.jit(lambda i: functional_call(emb, state, i))(jnp.array([1, 99, -2]))
    assert bool(jnp.isnan(bad[1:]).all()) and not bool(jnp.isnan(bad[0]).any())


# -- QuantUpsample --------------------------------------------------------------------------


def test_upsample_keeps_quant_tensor():
    codes = RNG.integers(-128, 128, (1, 2, 2, 3))
    q = _qt(codes, 0.25, True)
    y = qnn.QuantUpsample(scale_factor=2)(q)
    assert isinstance(y, QuantTensor) and y.is_valid and float(y.scale) == 0.25
    expect = np.repeat(np.repeat(codes, 2, 2), 2, 3)
    np.testing.assert_array_equal(np.asarray(y.int(float_datatype=True)), expect)
    y2 = qnn.QuantUpsamplingNearest2d(size=(4, 6))(q)
    np.testing.assert_array_equal(np.asarray(y2.value), np.asarray(y.value))
    z = qnn.QuantUpsample(scale_factor=(1, 2), return_quant_tensor=False)(q)
    assert isinstance(z, jax.Array) and z.shape == (1, 2, 2, 6)
    assert isinstance(qnn.QuantUpsample(scale_factor=2)(q.value), jax.Array)


def test_upsample_argument_errors():
    with pytest.raises(
        ValueError, match=r"mode='bilinear' is not supported; allowed: \('nearest',\)"
    ):
        qnn.QuantUpsample(scale_factor=2, mode="bilinear")
    with pytest.raises(ValueError, match="exactly one of size= and scale_factor="):
        qnn.QuantUpsample()
    with pytest.raises(ValueError, match="exactly one of size= and scale_factor="):
        qnn.QuantUpsample(size=4, scale_factor=2)
    with pytest.raises(ValueError, match="scale_factor=1.5"):
        qnn.QuantUpsample(scale_factor=1.5)


def test_upsample_jit_and_grad():
    up = qnn.QuantUpsample(scale_factor=2)
    q = _qt(RNG.integers(0, 10, (1, 2, 2, 3)), 0.25, False)
    _jit_equal(up, q)
    g = jax.jit(jax.grad(lambda v: jnp.sum(up(q._like(v)).value)))(q.value)
    np.testing.assert_allclose(np.asarray(g), np.full(q.shape, 4.0))
