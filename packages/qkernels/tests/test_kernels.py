"""qkernels' kernels give qcore's pure-XLA values bit for bit, and are what qcore calls.

Each case traces the same qcore function twice, with the native kernels bypassed
(``qcore.ops.kernels.native_kernels(False)``) and used, and compares the outputs
with ``np.testing.assert_array_equal``; a float64 product checks that both are the
product at all. Shapes cover partial rows of 16 and of fewer weight rows (K with
small divisors), an odd number of partial rows (the halving tree's carried row),
column counts that are not a multiple of 8, group scales (tiles: each code
multiplied by its scale before it is summed), layers chained inside one jitted
function, as a model runs them, and products followed by scaled residuals.
"""

import os
import platform

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
import qflax
import qkernels
from qcore import qtypes
from qcore.ops import kernels

RNG = np.random.default_rng(7)


def _int8(k, n):
    w = jnp.asarray(RNG.integers(-128, 128, (k, n)), jnp.int8)
    s = jnp.asarray(RNG.random((1, n)) + 0.1, jnp.float32)
    return w, s, lambda x, w, s: kernels.int8_weight_only(x, w, s, layout="kn")


def _int4(k, n, groups):
    w = jnp.asarray(RNG.integers(0, 256, (k // 2, n)), jnp.uint8)
    s = jnp.asarray(RNG.random((groups, n)) + 0.1, jnp.float32)
    group_size = k // groups if groups > 1 else None

    def f(x, w, s):
        return kernels.int4_packed_weight_only(x, w, s, layout="kn", group_size=group_size)

    return w, s, f


NF4 = qtypes.get("nf4").codebook


def _nf4(k, n, groups):
    w = jnp.asarray(RNG.integers(0, 256, (k // 2, n)), jnp.uint8)
    s = jnp.asarray(RNG.random((groups, n)) + 0.1, jnp.float32)
    group_size = k // groups if groups > 1 else None

    def f(x, w, s):
        return kernels.codebook4_packed_weight_only(x, w, s, NF4, group_size=group_size)

    return w, s, f


def _layer(kind, k, n, groups):
    return {"int8": lambda: _int8(k, n), "int4": lambda: _int4(k, n, groups)}.get(
        kind, lambda: _nf4(k, n, groups)
    )()


def _codes(w, k, kind):
    """The code values as float64 (K, N), unpacking 4-bit codes (low nibble = even row)."""
    w = np.asarray(w)
    if kind == "int8":
        return w.astype(np.float64)
    lo, hi = w.astype(np.int64) & 15, w.astype(np.int64) >> 4
    if kind == "int4":
        lo, hi = (lo ^ 8) - 8, (hi ^ 8) - 8
    else:
        lo, hi = np.asarray(NF4)[lo], np.asarray(NF4)[hi]
    out = np.empty((k, w.shape[1]))
    out[0::2], out[1::2] = lo, hi
    return out


def _traced(f, native, *args, calls=None):
    """``f`` jitted afresh (jit shares traces between wrappers of one function).

    ``calls``: whether the lowering must call a qkernels target (default: ``native``).
    """
    with kernels.native_kernels(native):
        lowered = jax.jit(lambda *a: f(*a)).lower(*args)
    assert ("qkernels_" in lowered.as_text()) == (native if calls is None else calls)
    return lowered.compile()


def _both(f, *args, calls=True):
    """``f(*args)`` on the pure-XLA path and with qkernels enabled, as numpy arrays."""
    xla = np.asarray(_traced(f, False, *args)(*args))
    return xla, np.asarray(_traced(f, True, *args, calls=calls)(*args))


CASES = [
    ("int8", 4096, 4096, 1),
    ("int8", 48, 64, 1),  # bk = 16, 3 partial rows (odd: a carried row)
    ("int8", 7, 130, 1),  # bk = 7, one partial row; 130 columns: a scalar tail
    ("int8", 384, 1536, 1),  # MiniLM's FFN
    ("int8", 1536, 384, 1),
    ("int8", 11008, 256, 1),  # 688 partial rows: carries at several levels
    ("int8", 17, 200, 1),  # bk = 1: one weight row per partial row
    ("int8", 34, 72, 1),  # bk = 2: the first pair of rows only
    ("int8", 45, 100, 1),  # bk = 15; 100 columns: a line of 64, 32 more, a scalar tail
    ("int4", 4096, 4096, 1),
    ("int4", 4096, 4096, 32),  # group scales (tiles of 128)
    ("int4", 384, 1536, 3),  # tiles of 128 over 24 partial rows: carried rows
    ("int4", 96, 72, 4),  # tiles of 24: 4 packed rows per partial row, a scalar tail
    ("int4", 64, 48, 32),  # tiles of 2: one packed row per partial row
    ("int4", 6, 64, 1),
    ("int4", 384, 1536, 1),
    ("int4", 256, 192, 2),
    ("int4", 64, 48, 1),  # one strip of 32 columns (4-bit codes), then a scalar tail
    ("int4", 2, 200, 1),  # one packed row: the strip's first row is also its last
    ("nf4", 4096, 4096, 1),
    ("nf4", 4096, 4096, 64),  # tiles of 64 (QLoRA's)
    ("nf4", 256, 130, 4),  # tiles of 64 and a scalar tail
    ("nf4", 6, 64, 1),
    ("nf4", 384, 1536, 1),
    ("nf4", 256, 130, 1),
    ("nf4", 32, 200, 1),
]


@pytest.mark.parametrize(("kind", "k", "n", "groups"), CASES)
def test_native_equals_xla_bit_for_bit(kind, k, n, groups):
    w, s, f = _layer(kind, k, n, groups)
    x = jnp.asarray(RNG.standard_normal((1, k)), jnp.float32)
    xla, native = _both(f, x, w, s)
    np.testing.assert_array_equal(native, xla)
    scale = np.repeat(np.asarray(s, np.float64), k // groups, 0) if groups > 1 else np.asarray(s)
    ref = np.asarray(x, np.float64) @ (_codes(w, k, kind) * scale)
    np.testing.assert_allclose(native, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_chained_layers_equal_bit_for_bit(kind):
    """Four layers with relu between them in one jit: fusion around the calls changes nothing."""
    k = 512
    layers = [_layer(kind, k, k, 1) for _ in range(4)]
    f = layers[0][2]
    params = [(w, s) for w, s, _ in layers]

    def model(x, params):
        for w, s in params:
            x = jax.nn.relu(f(x, w, s)) * 0.05
        return x

    x = jnp.asarray(RNG.standard_normal((1, k)), jnp.float32)
    xla, native = _both(model, x, params)
    assert np.abs(xla).max() > 0
    np.testing.assert_array_equal(native, xla)


RESIDUALS = {
    "y * c + h * d": lambda y, h, b: y * 0.7 + h * 0.25,
    "(y + b) * c + h * d": lambda y, h, b: (y + b) * 0.7 + h * 0.25,
    "y * b + h": lambda y, h, b: y * b + h,
    "y * c - h * d": lambda y, h, b: y * 0.5 - h * 0.3,
}


@pytest.mark.parametrize("residual", list(RESIDUALS))
@pytest.mark.parametrize(("kind", "groups"), [("int8", 1), ("int4", 1), ("int4", 2), ("nf4", 2)])
def test_scaled_residuals_equal_bit_for_bit(kind, groups, residual):
    """A product feeding ``y * c + h * d`` in the same jit, chained over three layers.

    Both sides of the add are products, and XLA:CPU contracts one of them into a
    fused multiply-add. Which one depended on whether the product's own loop fusion
    was merged with the add, so the pure-XLA path (merged) and the kernel path
    (never merged: a call is opaque) rounded differently.
    """
    k = 256
    layers = [_layer(kind, k, k, groups) for _ in range(3)]
    f, step = layers[0][2], RESIDUALS[residual]
    params = [(w, s, jnp.asarray(RNG.standard_normal(k), jnp.float32)) for w, s, _ in layers]

    def model(h, params):
        for w, s, b in params:
            h = step(f(h, w, s), h, b)
        return h

    h = jnp.asarray(RNG.standard_normal((1, k)), jnp.float32)
    xla, native = _both(model, h, params)
    assert np.isfinite(xla).all() and np.abs(xla).max() > 0
    np.testing.assert_array_equal(native, xla)


@pytest.mark.parametrize("weights", ["closed over", "vmapped", "all constant"])
@pytest.mark.parametrize(("kind", "groups"), [("int8", 1), ("int4", 1), ("int4", 2), ("nf4", 2)])
def test_constant_or_vmapped_weights_equal_bit_for_bit(kind, groups, weights):
    """Weights that are constants of the jit, or mapped over by ``vmap``, then a residual.

    ``jax.jit(lambda x: model.apply(params, x))`` makes the weights constants, and
    ``vmap`` over a stack of weights batches everything that reads them: neither may
    undo the isolation that keeps the XLA path's product apart from ``y * c + h * d``.
    With the activations constant too, XLA must not compute the product while
    compiling (its evaluator does not fuse multiply-adds).
    """
    k = 256
    layers = [_layer(kind, k, k, groups) for _ in range(3)]
    f = layers[0][2]
    params = [(w, s) for w, s, _ in layers]

    def model(h, params):
        for w, s in params:
            h = f(h, w, s) * 0.7 + h * 0.25
        return h

    h = jnp.asarray(RNG.standard_normal((1, k)), jnp.float32)
    if weights == "closed over":
        xla, native = _both(lambda h: model(h, params), h)
    elif weights == "all constant":
        xla, native = _both(lambda: model(h, params))
    else:
        stacks = jax.tree.map(lambda a: jnp.stack([a, a[::-1]]), params)
        xla, native = _both(jax.vmap(model, in_axes=(None, 0)), h, stacks)
    assert np.isfinite(xla).all() and np.abs(xla).max() > 0
    np.testing.assert_array_equal(native, xla)


@pytest.mark.parametrize("kind", ["int4", "nf4"])
def test_group_scales_computed_in_the_jit_equal_bit_for_bit(kind):
    """Tile scales that are themselves a sum of products, computed in the same jit."""
    k = 256
    w, s, f = _layer(kind, k, k, 4)
    t = jnp.asarray(RNG.random(s.shape), jnp.float32)

    def model(x, w, s, t):
        return f(x, w, s * 0.75 + t * 0.5) * 0.7 + x * 0.25

    x = jnp.asarray(RNG.standard_normal((1, k)), jnp.float32)
    xla, native = _both(model, x, w, s, t)
    np.testing.assert_array_equal(native, xla)


@pytest.mark.parametrize(
    ("kind", "tile"), [("int8", None), ("int4", None), ("nf4", None), ("int4", 32), ("nf4", 64)]
)
def test_flax_layers_with_biases_equal_bit_for_bit(kind, tile):
    """Dense layers with random biases and a residual add, quantized by qflax.

    XLA fuses an add that follows the scale multiply into one fused multiply-add; a
    zero bias (Flax's default) hides a kernel that rounds the product first. With
    ``tile`` the weights have one scale per ``tile`` input rows (group scales).
    """

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            bias = nn.initializers.normal(1.0)
            h = nn.relu(nn.Dense(256, bias_init=bias)(x))
            return x + nn.Dense(x.shape[-1], use_bias=False)(h)

    x = jnp.asarray(RNG.standard_normal((1, 128)), jnp.float32)
    params = Block().init(jax.random.key(0), x)["params"]
    rule = qflax.QuantizationRule(weight_qtype=kind, tile_size=tile)
    qmodel = qflax.quantize_model(Block(), qflax.PtqProvider([rule]))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    qparams = qflax.quantize_params(params, abstract)
    xla, native = _both(lambda x, p: qmodel.apply({"params": p}, x), x, qparams)
    np.testing.assert_array_equal(native, xla)


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_qcore_dot_general_calls_the_kernel_when_installed(kind):
    """Through qcore's public product, as qflax's layers call it."""
    how = {
        "int8": qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
        "int4": qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,), pack=True, pack_axis=0),
        "nf4": qcore.HowToQuantize(qtype="nf4", channelwise_axes=(1,), pack=True, pack_axis=0),
    }[kind]
    q = qcore.quantize(jnp.asarray(RNG.standard_normal((64, 32)), jnp.float32), how)
    x = jnp.asarray(RNG.standard_normal((1, 64)), jnp.float32)

    def f(x, q):
        return qcore.dot_general(x, q, (((1,), (0,)), ((), ())))

    target = {"int8": "int8", "int4": "int4", "nf4": "codebook4"}[kind]
    native = _traced(f, True, x, q)
    assert f"qkernels_{target}_kn_batch1" in native.as_text()
    np.testing.assert_array_equal(
        np.asarray(native(x, q)), np.asarray(_traced(f, False, x, q)(x, q))
    )


def test_direct_call_and_simd_flag():
    x = jnp.arange(4, dtype=jnp.float32)[None]
    w = jnp.asarray([[1, -2], [3, 4], [-5, 6], [7, -8]], jnp.int8)
    y = qkernels.int8_kn_batch1(x, w, 2)
    np.testing.assert_array_equal(np.asarray(y), [[3 - 10 + 21, 4 + 12 - 24]])
    # The AVX2 + FMA code runs exactly where the CPU has both (Linux reports its flags).
    flags = set()
    if platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next(
                (set(ln.split(":")[1].split()) for ln in f if ln.startswith("flags")), set()
            )
    assert qkernels.simd() == ({"avx2", "fma"} <= flags)


def test_the_handler_checks_shapes_too():
    """Past the Python checks (called directly), the C++ handler refuses and says why."""
    from qkernels import _calls

    x = jnp.ones((1, 8), jnp.float32)
    w = jnp.ones((6, 4), jnp.int8)
    with pytest.raises(Exception, match=r"x has 8 elements, w is \(6, 4\)"):
        jax.block_until_ready(_calls._call("qkernels_int8_kn_batch1", x, w, 2))
    packed, scales = jnp.ones((4, 4), jnp.uint8), jnp.ones((3, 4), jnp.float32)
    with pytest.raises(Exception, match=r"scales must be \(G, 4\) with G dividing the 2"):
        target = "qkernels_int4_kn_batch1_groups"
        jax.block_until_ready(_calls._call(target, x, packed, 2, scales))


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_an_empty_weight_gives_zeros(kind):
    """K = 0 (no weight rows): the sum of nothing, without reading past the buffers."""
    w = jnp.zeros((0, 5), jnp.int8 if kind == "int8" else jnp.uint8)
    x = jnp.ones((1, 0), jnp.float32)
    call = {
        "int8": lambda: qkernels.int8_kn_batch1(x, w, 16),
        "int4": lambda: qkernels.int4_kn_batch1(x, w, 8),
        "nf4": lambda: qkernels.codebook4_kn_batch1(x, w, 8, NF4),
    }[kind]
    np.testing.assert_array_equal(np.asarray(jax.jit(call)()), np.zeros((1, 5), np.float32))


def test_results_vary_where_their_operands_vary_under_shard_map():
    """Under ``shard_map`` a kernel's result varies over the mesh axes its operands vary over.

    A foreign call's result is otherwise typed as the same on every device: a scan or
    conditional around it raised, and ``out_specs=P()`` would take one device's result
    for all of them.
    """
    from jax.sharding import Mesh  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    xf = jnp.asarray(RNG.standard_normal((1, 8)), jnp.float32)
    xi = jnp.asarray(RNG.integers(-128, 128, (3, 8)), jnp.int8)
    w8 = jnp.asarray(RNG.integers(-128, 128, (8, 4)), jnp.int8)
    w4 = jnp.asarray(RNG.integers(0, 256, (4, 4)), jnp.uint8)
    s = jnp.asarray(RNG.random((2, 4)) + 0.1, jnp.float32)
    calls = {
        "int8_kn_batch1": (lambda x: qkernels.int8_kn_batch1(x, w8, 2), xf),
        "int4_kn_batch1": (lambda x: qkernels.int4_kn_batch1(x, w4, 2, scales=s), xf),
        "codebook4_kn_batch1": (lambda x: qkernels.codebook4_kn_batch1(x, w4, 2, NF4), xf),
        "int8_gemm": (lambda x: qkernels.int8_gemm(x, w8), xi),
        "w8a8": (lambda x: qkernels.w8a8(x, jnp.ones((x.shape[0], 1)), w8), xi),
    }
    for name, (f, x) in calls.items():
        axes = []

        def body(x, f=f, axes=axes):
            y = f(x)
            axes.append(jax.typeof(y).manual_axis_type.varying)
            return y

        got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
        assert axes == [{"data"}], name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(x)), err_msg=name)
        replicated = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())
        with pytest.raises(ValueError, match="could not infer replication"):
            jax.jit(replicated)(x)


def test_public_api():
    """The names users may rely on (the repository pins the other packages' APIs)."""
    assert sorted(qkernels.__all__) == [
        "__version__",
        "codebook4_kn_batch1",
        "int4_kn_batch1",
        "int8_gemm",
        "int8_kn_batch1",
        "simd",
        "vnni",
        "w8a8",
    ]


@pytest.mark.parametrize(
    ("kind", "groups"), [("int8", 1), ("int4", 1), ("nf4", 1), ("int4", 4), ("nf4", 2)]
)
def test_gradients_are_those_of_the_xla_path(kind, groups):
    """jax.grad, jvp and vmap(grad) through a covered product equal the XLA path's.

    With group scales the gradient with respect to the scales goes through the kernel
    call too (the scales are one of its operands).
    """
    k, n = 64, 32
    w, s, f = _layer(kind, k, n, groups)
    x = jnp.asarray(RNG.standard_normal((1, k)), jnp.float32)

    def loss(x, s):
        return jnp.sum(jnp.sin(f(x, w, s)))

    def grads(native):
        with kernels.native_kernels(native):
            g = jax.jit(jax.grad(lambda x, s: loss(x, s), argnums=(0, 1)))(x, s)
            xs = jnp.stack([x, 2 * x])
            per_example = jax.jit(jax.vmap(jax.grad(lambda x: loss(x, s))))(xs)
            _, t = jax.jvp(lambda x: f(x, w, s), (x,), (jnp.ones_like(x),))
        return [np.asarray(a) for a in (*g, per_example, t)]

    for native, xla in zip(grads(True), grads(False), strict=True):
        np.testing.assert_array_equal(native, xla)


@pytest.mark.parametrize(
    ("kind", "groups"), [("int8", 1), ("int4", 1), ("nf4", 1), ("int4", 4), ("nf4", 2)]
)
def test_forward_mode_derivatives_equal_bit_for_bit(kind, groups):
    """jvp, linearize and jacfwd with respect to the activations equal the XLA path's.

    Only the activations have tangents: on the XLA path the scales' are symbolic
    zeros, and a derivative rule that adds their zero terms rounds the tangent's sums
    differently. Three layers with a scaled residual after each, as a model runs them.
    """
    k = 64
    layers = [_layer(kind, k, k, groups) for _ in range(3)]
    f = layers[0][2]

    def chain(h, params):
        for w, s in params:
            h = f(h, w, s) * 0.7 + h * 0.25
        return h

    x, t = (jnp.asarray(RNG.standard_normal((1, k)), jnp.float32) for _ in range(2))
    params = [(w, s) for w, s, _ in layers]
    for transform, calls in [
        (lambda x, t, p: jax.jvp(lambda h: chain(h, p), (x,), (t,)), True),
        (lambda x, t, p: jax.linearize(lambda h: chain(h, p), x)[1](t), False),
        (lambda x, t, p: jax.jacfwd(lambda h: chain(h, p))(x), False),
    ]:
        xla, native = (
            jax.tree.leaves(_traced(transform, on, x, t, params, calls=on and calls)(x, t, params))
            for on in (False, True)
        )
        for a, b in zip(native, xla, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(w=jnp.ones((64, 8), jnp.float32)), "w: float32 array"),
        (dict(w=jnp.ones((64,), jnp.int8)), "allowed: a 2-D int8 array"),
        (dict(x=jnp.ones((2, 32))), r"x: shape \(2, 32\); allowed: \(1, 64\)"),
        (dict(x=jnp.ones((64,))), r"x: shape \(64,\)"),
        (dict(bk=0), "bk=0; allowed: a positive int dividing w's 64 rows"),
        (dict(bk=5), "bk=5"),
        (dict(bk=1.5), "bk=1.5"),
    ],
)
def test_bad_arguments_are_refused_when_traced(args, message):
    call = dict(x=jnp.ones((1, 64)), w=jnp.ones((64, 8), jnp.int8), bk=16)
    call.update(args)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda x, w: qkernels.int8_kn_batch1(x, w, call["bk"])).lower(call["x"], call["w"])


def test_group_scales_scale_each_code():
    """Called directly: two groups of two packed rows, against the sums worked by hand."""
    x = jnp.asarray([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    # packed rows 0-3 (K rows 0-7) of two columns: low nibble first; 0xF1 = (1, -1)
    w = jnp.asarray([[0xF1, 0x21]] * 4, jnp.uint8)
    scales = jnp.asarray([[2.0, 10.0], [0.5, 1.0]])
    y = qkernels.int4_kn_batch1(x, w, 2, scales=scales)
    # column 0: codes (1, -1) per packed row; column 1: codes (1, 2)
    col0 = 2.0 * (1 - 2 + 3 - 4) + 0.5 * (5 - 6 + 7 - 8)
    col1 = 10.0 * (1 + 4 + 3 + 8) + 1.0 * (5 + 12 + 7 + 16)
    np.testing.assert_array_equal(np.asarray(y), [[col0, col1]])
    levels = tuple(float(v) for v in range(-8, 8))  # level i is the int4 code i ^ 8 - 8 ...
    moved = jnp.asarray(np.asarray(w) ^ 0x88, jnp.uint8)  # ... so flipping bit 3 matches int4
    y4 = qkernels.codebook4_kn_batch1(x, moved, 2, levels, scales=scales)
    np.testing.assert_array_equal(np.asarray(y4), [[col0, col1]])
    as_lists = qkernels.int4_kn_batch1(x, w, 2, scales=[[2.0, 10.0], [0.5, 1.0]])
    np.testing.assert_array_equal(np.asarray(as_lists), [[col0, col1]])


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        (jnp.ones((3, 8)), r"scales: shape \(3, 8\); allowed: \(G, 8\) with G dividing the 4"),
        (jnp.ones((2, 7)), r"scales: shape \(2, 7\)"),
        (jnp.ones((8,)), r"scales: shape \(8,\)"),
        (jnp.ones((2, 8), jnp.int32), "scales: int32; allowed: a floating dtype"),
    ],
)
def test_bad_group_scales_are_refused(scales, message):
    x, w = jnp.ones((1, 64)), jnp.ones((32, 8), jnp.uint8)
    with pytest.raises(ValueError, match=message):
        qkernels.int4_kn_batch1(x, w, 8, scales=scales)


def test_codebook_needs_sixteen_levels():
    w = jnp.ones((32, 8), jnp.uint8)
    with pytest.raises(ValueError, match=r"levels: shape \(15,\); allowed: 16 levels"):
        qkernels.codebook4_kn_batch1(jnp.ones((1, 64)), w, 8, NF4[:15])
