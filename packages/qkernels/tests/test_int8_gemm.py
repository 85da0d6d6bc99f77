"""qkernels' exact int8 GEMM: the integers of numpy's int64 product, and qcore's w8a8.

``qkernels.int8_gemm`` is compared with an int64 numpy product (and XLA's own int8
dot), and ``qkernels.w8a8`` (the same sums times the row scales) with qcore's
pure-XLA expression, over shapes that reach every edge of the kernel: activation rows not a multiple
of the 4-row tile, K not a multiple of 4 and longer than one 512-deep block, columns
not a multiple of 16, K = 0, and codes of -128 in either operand (the weight's are
packed as -127 and corrected afterwards). Then qcore's w8a8 product, through
``qcore.dot_general`` and through a Flax model quantized by qflax, is compared bit
for bit with qkernels used and bypassed.
"""

import os
import platform

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qcore
import qflax
import qkernels
from qcore.ops import kernels

RNG = np.random.default_rng(11)

# Whether qcore routes w8a8 to qkernels on this CPU (it does not where XLA has VNNI).
ROUTED = not qkernels.vnni()


def _codes(shape, low=-128):
    return jnp.asarray(RNG.integers(low, 128, shape), jnp.int8)


SHAPES = [
    (1, 1, 1),
    (3, 5, 7),  # every tail at once: 3 rows, K % 4 = 1, 7 columns
    (4, 16, 16),  # exactly one tile
    (9, 33, 35),
    (130, 100, 17),
    (17, 1100, 40),  # three blocks of K (512, 512, 76)
    (64, 512, 520),  # more column panels than one item holds
    (4096, 384, 384),  # MiniLM's attention projections at 32 x 128 tokens
    # One row with a (K, N) weight takes its own loop: 8 rows by 32 columns, with the
    # rows (K % 8) and columns (N % 32) left over summed apart.
    (1, 5, 7),  # no full step at all
    (1, 8, 32),  # exactly one
    (1, 61, 95),
    (1, 1100, 40),
    (1, 2048, 1024),  # split between threads
]


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_equals_the_int64_product_and_xla(m, k, n, layout):
    x = _codes((m, k))
    w = _codes((k, n) if layout == "kn" else (n, k))
    w_kn = np.asarray(w, np.int64) if layout == "kn" else np.asarray(w, np.int64).T
    got = np.asarray(jax.jit(lambda x, w: qkernels.int8_gemm(x, w, w_layout=layout))(x, w))
    assert got.dtype == np.int32 and got.shape == (m, n)
    np.testing.assert_array_equal(got, np.asarray(x, np.int64) @ w_kn)
    xla = lax.dot(x, jnp.asarray(w_kn, jnp.int8), preferred_element_type=jnp.int32)
    np.testing.assert_array_equal(got, np.asarray(xla))


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 61, 95), (3, 5, 7), (17, 1100, 40), (256, 384, 96)])
def test_w8a8_equals_qcores_xla_expression(m, k, n, layout):
    """The row-scaled product: bit for bit qcore's ``float32(acc) * x_scale``."""
    x = _codes((m, k))
    w = _codes((k, n) if layout == "kn" else (n, k))
    xs = jnp.asarray(RNG.random((m, 1)) * 1e-2, jnp.float32)
    got = jax.jit(lambda *a: qkernels.w8a8(*a, w_layout=layout))(x, xs, w)
    want = jax.jit(lambda *a: kernels._w8a8_rows(*a, layout))(x, xs, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    w_kn = np.asarray(w, np.float64) if layout == "kn" else np.asarray(w, np.float64).T
    ref = (np.asarray(x, np.float64) @ w_kn) * np.asarray(xs, np.float64)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-7, atol=0)


def test_extreme_codes_and_empty_k():
    """-128 x -128 everywhere (the sign trick's overflow case), and a K of zero."""
    x = jnp.full((5, 4096), -128, jnp.int8)
    for fill, expected in (
        (-128, 128 * 128 * 4096),
        (-127, 128 * 127 * 4096),
        (127, -128 * 127 * 4096),
    ):
        w = jnp.full((4096, 18), fill, jnp.int8)
        np.testing.assert_array_equal(np.asarray(qkernels.int8_gemm(x, w)), expected)
    y = qkernels.int8_gemm(jnp.ones((3, 0), jnp.int8), jnp.ones((0, 5), jnp.int8))
    np.testing.assert_array_equal(np.asarray(y), np.zeros((3, 5)))


def test_vnni_flag_matches_the_cpu():
    flags = set()
    if platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next(
                (set(ln.split(":")[1].split()) for ln in f if ln.startswith("flags")), set()
            )
    assert qkernels.vnni() == bool({"avx512_vnni", "avx_vnni"} & flags)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(x=jnp.ones((4, 8), jnp.float32)), "x: float32 array of shape"),
        (dict(w=jnp.ones((8,), jnp.int8)), r"w: int8 array of shape \(8,\); allowed: a 2-D"),
        (dict(w=jnp.ones((9, 3), jnp.int8)), r"allowed: 8 rows of K for x \(4, 8\)"),
        (dict(w_layout="mk"), "w_layout='mk'; allowed: 'kn' or 'nk'"),
    ],
)
def test_bad_arguments_are_refused(args, message):
    call = dict(x=jnp.ones((4, 8), jnp.int8), w=jnp.ones((8, 3), jnp.int8), w_layout="kn")
    call.update(args)
    with pytest.raises(ValueError, match=message):
        qkernels.int8_gemm(call["x"], call["w"], w_layout=call["w_layout"])
    with pytest.raises(ValueError, match=message):
        qkernels.w8a8(call["x"], jnp.ones((4, 1)), call["w"], w_layout=call["w_layout"])


def test_bad_scales_are_refused():
    x, w = jnp.ones((4, 8), jnp.int8), jnp.ones((8, 3), jnp.int8)
    with pytest.raises(ValueError, match=r"x_scale: shape \(1, 4\); allowed: \(4, 1\)"):
        qkernels.w8a8(x, jnp.ones((1, 4)), w)


def _w8a8(x, q_w):
    """qcore's w8a8 product: x quantized per row at call time, times an int8 weight."""
    q_x = qcore.quantize(x, qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,)))
    return qcore.dot_general(q_x, q_w, (((1,), (0,)), ((), ())))


def _lowered(f, native, *args):
    with kernels.native_kernels(native):
        return jax.jit(lambda *a: f(*a)).lower(*args).compile()


def test_one_row_sums_codes_of_minus_128_exactly():
    """x = w = -128 everywhere: x's codes are used as -127 and corrected, w's taken as |w|."""
    for k, n in ((64, 64), (67, 70)):
        x, w = jnp.full((1, k), -128, jnp.int8), jnp.full((k, n), -128, jnp.int8)
        got = np.asarray(jax.jit(qkernels.int8_gemm)(x, w))
        np.testing.assert_array_equal(got, np.full((1, n), k * 128 * 128))


@pytest.mark.parametrize("m", [1, 2, 15, 16, 100])
def test_qcore_w8a8_bit_for_bit_and_routed_from_16_rows_or_one(m):
    w = jnp.asarray(RNG.standard_normal((192, 80)), jnp.float32)
    q_w = qcore.quantize(w, qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    assert int(jnp.min(q_w.qvalue)) == -128  # qcore's symmetric int8 reaches -128
    x = jnp.asarray(RNG.standard_normal((m, 192)), jnp.float32)
    native, xla = _lowered(_w8a8, True, x, q_w), _lowered(_w8a8, False, x, q_w)
    assert ("qkernels_w8a8" in native.as_text()) == (ROUTED and (m >= 16 or m == 1))
    assert 'custom_call_target="qkernels_' not in xla.as_text()
    np.testing.assert_array_equal(np.asarray(native(x, q_w)), np.asarray(xla(x, q_w)))


def test_qcore_w8a8_one_row_past_the_int8_gemm_limit_bit_for_bit():
    """Above 2**22 weight elements qcore's XLA path sums blocks of the weight instead."""
    k, n = 4096, 1100
    assert k * n > kernels._W8A8_KN_INT8_MAX_WEIGHT
    w = jnp.asarray(RNG.standard_normal((k, n)), jnp.float32)
    q_w = qcore.quantize(w, qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    x = jnp.asarray(RNG.standard_normal((1, k)), jnp.float32)
    native, xla = _lowered(_w8a8, True, x, q_w), _lowered(_w8a8, False, x, q_w)
    assert ("qkernels_w8a8" in native.as_text()) == ROUTED
    np.testing.assert_array_equal(np.asarray(native(x, q_w)), np.asarray(xla(x, q_w)))


@pytest.mark.parametrize("weights", ["arguments", "closed over"])
@pytest.mark.parametrize("m", [1, 16, 40])
@pytest.mark.parametrize("residual", ["y * c + h * d", "(y + b) * c + h * d"])
def test_scaled_residuals_bit_for_bit(m, residual, weights):
    """Three w8a8 layers, each followed by a scaled residual, in one jit.

    Both sides of the add are products; XLA contracted a different one into a fused
    multiply-add when the XLA path's row-scale multiply was fused with the add. The
    weights are the jitted function's arguments, or constants closed over by it.
    """
    q_ws = [
        qcore.quantize(
            jnp.asarray(RNG.standard_normal((96, 96)), jnp.float32),
            qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
        )
        for _ in range(3)
    ]
    b = jnp.asarray(RNG.standard_normal(96), jnp.float32)

    def model(h, q_ws, b):
        for q_w in q_ws:
            y = _w8a8(h, q_w)
            h = (y * 0.7 if residual == "y * c + h * d" else (y + b) * 0.7) + h * 0.25
        return h

    run = model if weights == "arguments" else (lambda h, _, b: model(h, q_ws, b))
    h = jnp.asarray(RNG.standard_normal((m, 96)), jnp.float32)
    native, xla = _lowered(run, True, h, q_ws, b), _lowered(run, False, h, q_ws, b)
    assert native.as_text().count("qkernels_w8a8") == (3 if ROUTED else 0)
    np.testing.assert_array_equal(np.asarray(native(h, q_ws, b)), np.asarray(xla(h, q_ws, b)))


class _Encoder(nn.Module):
    """Two pre-norm blocks (Dense 4x, gelu, Dense back), as a BERT layer's MLP.

    The biases are random, not Flax's zeros: XLA fuses a bias add with the product's
    last multiply into one fused multiply-add, which a zero bias cannot show.
    """

    @nn.compact
    def __call__(self, x):
        bias = nn.initializers.normal(1.0)
        for _ in range(2):
            h = nn.gelu(nn.Dense(4 * x.shape[-1], bias_init=bias)(nn.LayerNorm()(x)))
            x = x + nn.Dense(x.shape[-1], bias_init=bias)(h)
        return x


@pytest.mark.parametrize("tokens", [(2, 24), (1, 1)])
def test_flax_model_w8a8_bit_for_bit(tokens):
    """qflax's w8a8 on a Flax model at 2 x 24 tokens and at one: same outputs, qkernels called."""
    x = jnp.asarray(RNG.standard_normal((*tokens, 64)), jnp.float32)
    params = _Encoder().init(jax.random.key(0), x)["params"]
    rule = qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")
    qmodel = qflax.quantize_model(_Encoder(), qflax.PtqProvider([rule]))
    qparams = qflax.quantize_params(
        params, jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    )

    def apply(x, p):
        return qmodel.apply({"params": p}, x)

    native, xla = _lowered(apply, True, x, qparams), _lowered(apply, False, x, qparams)
    assert native.as_text().count("qkernels_w8a8") == (4 if ROUTED else 0)
    np.testing.assert_array_equal(np.asarray(native(x, qparams)), np.asarray(xla(x, qparams)))


def test_jax_export_needs_the_kernels_off():
    """jax.export refuses qkernels' custom calls; traced without them it exports."""
    q_w = qcore.quantize(
        jnp.asarray(RNG.standard_normal((64, 32)), jnp.float32),
        qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
    )
    x = jnp.asarray(RNG.standard_normal((32, 64)), jnp.float32)
    f = jax.jit(lambda x: _w8a8(x, q_w))
    if ROUTED:
        with pytest.raises(ValueError, match="custom call"):
            jax.export.export(f)(x)
    with kernels.native_kernels(False):
        exported = jax.export.export(jax.jit(lambda x: _w8a8(x, q_w)))(x)
    assert "@qkernels_" not in exported.mlir_module()
    np.testing.assert_array_equal(np.asarray(exported.call(x)), np.asarray(f(x)))


@pytest.mark.parametrize("m", [1, 32])
def test_gradients_are_those_of_the_xla_path(m):
    """jax.grad and jvp through a routed w8a8 product equal the XLA path's bit for bit."""
    q_w = qcore.quantize(
        jnp.asarray(RNG.standard_normal((64, 32)), jnp.float32),
        qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
    )
    x = jnp.asarray(RNG.standard_normal((m, 64)), jnp.float32)

    t = jnp.asarray(RNG.standard_normal(x.shape), jnp.float32)

    def derivatives(native):
        with kernels.native_kernels(native):
            grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(_w8a8(x, q_w)))))(x)
            _, tangent = jax.jit(lambda x, t: jax.jvp(lambda x: _w8a8(x, q_w), (x,), (t,)))(x, t)
        return np.asarray(grad), np.asarray(tangent)

    for native, xla in zip(derivatives(True), derivatives(False), strict=True):
        assert np.abs(xla).max() > 0
        np.testing.assert_array_equal(native, xla)
