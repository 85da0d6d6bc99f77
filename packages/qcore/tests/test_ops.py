"""qcore.ops contractions: parity with float references, accuracy, dtypes, transforms, errors.

Every value check compares against a reference that does not go through the code
under test: ``lax`` / ``jnp`` ops (HIGHEST precision) on ``dequantize``-d operands,
or float64 numpy. Sections follow the ops acceptance list; its parity tests of
convolutions (5) and ``ragged_dot`` (6) are in ``test_ops_conv.py``.

Cost: each case quantizes, contracts and computes its reference inside one
``jax.jit``, so it compiles once; data comes from numpy (``jax.random`` would
compile per shape).
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qcore
from qcore import HowToQuantize, QArray, dequantize, quantize, testing
from qcore.metrics import mean_relative_error

HIGHEST = lax.Precision.HIGHEST
MATMUL = (((1,), (0,)), ((), ()))
BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def normal(shape, seed=0, shift=0.0):
    """N(shift, 1) float32 data from numpy (no compilation)."""
    return (np.random.default_rng(seed).standard_normal(shape) + shift).astype(np.float32)


def spec(qtype, channels=(), tiles=None, *, asym=False, calibration=None, **kwargs):
    """A HowToQuantize; asymmetric specs calibrate min/max so the zero point matters."""
    return HowToQuantize(
        qtype=qtype,
        channelwise_axes=channels,
        tiled_axes=tiles or {},
        symmetric=not asym,
        calibration=calibration or ("minmax" if asym else "absmax"),
        **kwargs,
    )


def primitive_dtypes(fn, *args, name="dot_general"):
    return testing.primitive_dtypes(fn, *args, name=name)


INT8_INTO_INT32 = ((jnp.dtype(jnp.int8), jnp.dtype(jnp.int8)), jnp.dtype(jnp.int32))


# -- 1. the integer path equals dequantize-then-contract --------------------------------

# id -> (lhs spec, rhs spec) of an (8, 96) x (96, 24) matmul
UNTILED = {
    "int8 per-tensor": (spec("int8"), spec("int8")),
    "int8 per-channel": (spec("int8", (0,)), spec("int8", (1,))),
    "int4 x int8": (spec("int4", (0,)), spec("int8", (1,))),
    "int4 packed x int4 packed": (spec("int4", (0,), pack=True), spec("int4", (1,), pack=True)),
    "uint8 asym x int8": (spec("uint8", asym=True), spec("int8", (1,))),
    "int8 x uint8 asym per-channel": (spec("int8", (0,)), spec("uint8", (1,), asym=True)),
    "uint8 asym x int8 asym": (spec("uint8", (0,), asym=True), spec("int8", (1,), asym=True)),
    # Symmetric uint8 has no zero point: its codes are re-centred by 128 internally.
    "uint8 symmetric x int4 asym": (spec("uint8"), spec("int4", asym=True)),
    # int1 codes are -1 / +1, also contracted as int8.
    "int1 x int2 asym": (spec("int1", (0,)), spec("int2", (1,), asym=True)),
}
# id -> (lhs spec, rhs spec) of an (8, 128) x (128, 24) matmul with sub-channel tiles
TILED = {
    "lhs tile 16": (spec("int8", (0,), {1: 16}), spec("int8", (1,))),
    "rhs tile 32": (spec("int8", (0,)), spec("int4", (1,), {0: 32})),
    "tiles 16 x 32": (spec("int8", (0,), {1: 16}), spec("int8", (1,), {0: 32})),
    "asym tiles 32 x 16": (
        spec("uint8", (0,), {1: 32}, asym=True),
        spec("int8", (1,), {0: 16}, asym=True),
    ),
    "2-D tile rhs (K 32, N 8)": (spec("int8", (0,), {1: 16}), spec("int8", (), {0: 32, 1: 8})),
    "2-D tiles both (M 4, K 16) x (K 32, N 8)": (
        spec("int4", (), {0: 4, 1: 16}, asym=True),
        spec("int8", (), {0: 32, 1: 8}),
    ),
}
# id -> (lhs shape, rhs shape, dimension numbers, lhs spec, rhs spec, tolerance)
OTHER_LAYOUTS = {
    "batched, transposed rhs": (
        (3, 8, 64),
        (3, 24, 64),
        (((2,), (2,)), ((0,), (0,))),
        spec("uint8", (0, 1), asym=True),
        spec("int8", (0, 1)),
        1e-6,
    ),
    "two tiled contracting axes in swapped order": (
        (4, 8, 16),
        (16, 8, 6),
        (((1, 2), (1, 0)), ((), ())),
        spec("int8", (0,), {1: 4, 2: 8}),
        spec("int8", (2,), {0: 4, 1: 2}),
        1e-4,
    ),
    "tiles and a batch axis in the middle": (
        (8, 3, 64),
        (3, 64, 12),
        (((2,), (1,)), ((1,), (0,))),
        spec("uint8", (0, 1), {2: 16}, asym=True),
        spec("int8", (0, 2), {1: 32}),
        1e-4,
    ),
}


# Tolerances, relative to max |ref|. Untiled, the integer path accumulates exactly
# in int32 and rounds only at the two scale multiplies; the reference rounds K
# products and sums in float32: their gap is observed <= 4e-7 (the reference's own
# error), so 1e-6 holds without hiding a wrong scale or zero point. Tiles add a
# float32 sum over the groups; 1e-4 (the bound) is far above that rounding
# (also observed <= 4e-7) and far below any wrong-tile error (~1e-2).
def _integer_cases():
    for name, (hl, hr) in UNTILED.items():
        yield pytest.param((8, 96), (96, 24), MATMUL, hl, hr, 1e-6, id=name)
    for name, (hl, hr) in TILED.items():
        yield pytest.param((8, 128), (128, 24), MATMUL, hl, hr, 1e-4, id=name)
    for name, case in OTHER_LAYOUTS.items():
        yield pytest.param(*case, id=name)


@pytest.mark.parametrize(("lshape", "rshape", "dims", "hl", "hr", "tol"), list(_integer_cases()))
def test_integer_path_equals_dequantize_then_highest_float(lshape, rshape, dims, hl, hr, tol):
    def run(x, w):
        a, b = quantize(x, hl), quantize(w, hr)
        ref = lax.dot_general(dequantize(a), dequantize(b), dims, precision=HIGHEST)
        return qcore.dot_general(a, b, dims), ref, a, b

    y, ref, a, b = jax.jit(run)(normal(lshape, 1, shift=0.3), normal(rshape, 2))
    assert y.dtype == F32
    assert testing.max_rel_error(y, ref) <= tol
    # ...and the integer path really ran: one int8 x int8 -> int32 contraction, no float one
    # (the kernels' f32 blocks serve only batch 1 with a (K, N) weight above 4 MiB).
    dots = primitive_dtypes(lambda a, b: qcore.dot_general(a, b, dims), a, b)
    assert dots == [INT8_INTO_INT32]


def test_jaxpr_of_jitted_dot_general_contracts_int8_into_int32():
    # Weight stored (N, K): the layout whose w8a8 kernel is an int8 GEMM (qcore.ops.kernels).
    a = quantize(normal((4, 32), 3), spec("int8", (0,)))
    b = quantize(normal((8, 32), 4), spec("int8", (0,)))
    nk = (((1,), (1,)), ((), ()))
    text = str(jax.make_jaxpr(jax.jit(partial(qcore.dot_general, dimension_numbers=nk)))(a, b))
    # Each dot_general equation prints as `out:type = dot_general[params] lhs rhs`.
    dots = re.findall(r"(\w+):(\w+)\[[\d,]*\] = dot_general\[(.*?)\] (\w+) (\w+)", text, re.S)
    assert len(dots) == 1, text
    _, out_type, params, lhs, rhs = dots[0]
    assert out_type == "i32" and "preferred_element_type=int32" in params, text
    for var in (lhs, rhs):
        assert re.search(rf"\b{var}:i8\[", text), (var, text)


def test_float_operand_takes_the_float_path():
    x = normal((4, 32), 5)
    b = quantize(normal((32, 8), 6), spec("int8", (1,)))
    dots = primitive_dtypes(lambda x, b: qcore.dot_general(x, b, MATMUL), x, b)
    assert dots == [((F32, F32), F32)]


# Non-integer qtypes and int16 take the float path: decoded codes contracted in
# float32, then scaled (nvfp4 also by its tensor scale). Same tolerance reasoning.
FLOAT_PATH = {
    "nf4 tile 16": spec("nf4", (), {0: 16}),
    "float8_e4m3fn per-channel": spec("float8_e4m3fn", (1,)),
    "mxfp8": spec("mxfp8", (), {0: 32}),
    "mxfp4": spec("mxfp4", (), {0: 32}),
    "nvfp4 packed": spec("nvfp4", (), {0: 16}, pack=True),
    "int16 per-channel": spec("int16", (1,)),
}


@pytest.mark.parametrize("how", list(FLOAT_PATH.values()), ids=list(FLOAT_PATH))
def test_float_path_qtypes_equal_dequantize_then_highest_float(how):
    def run(x, w):
        q = quantize(w, how)
        ref = lax.dot_general(x, dequantize(q), MATMUL, precision=HIGHEST)
        return qcore.dot_general(x, q, MATMUL), ref, q

    x = normal((8, 64), 30)
    y, ref, q = jax.jit(run)(x, normal((64, 16), 31))
    assert testing.max_rel_error(y, ref) <= 1e-5
    dots = primitive_dtypes(lambda x, q: qcore.dot_general(x, q, MATMUL), x, q)
    assert dots == [((F32, F32), F32)]


# -- 2. accuracy against the unquantized float product ----------------------------------


@pytest.fixture(scope="module")
def normal_matmul():
    """(64, 512) x (512, 256) N(0, 1) operands and their float64 product."""
    x, w = normal((64, 512), 42), normal((512, 256), 43)
    return x, w, x.astype(np.float64) @ w.astype(np.float64)


def _np_dequantize(q):
    """Independent float64 dequantization of an unpacked integer QArray."""
    codes = np.asarray(q.qvalue, np.float64)
    scale = np.asarray(q.scale, np.float64)
    zp = 0.0 if q.zero_point is None else np.asarray(q.zero_point, np.float64)
    for axis, (d, s) in enumerate(zip(codes.shape, scale.shape, strict=True)):
        scale = np.repeat(scale, d // s, axis=axis)
        zp = zp if np.isscalar(zp) else np.repeat(zp, d // s, axis=axis)
    return (codes - zp) * scale


def _accuracy_spec(bits, channel_axis, tiled_axis, tile):
    # int4 with absmax over K = 512 has a mean relative error of 0.128 on N(0, 1)
    # data (step ≈ 3.2σ / 7; Qwix bounds the same case by 0.13), above the issue's
    # 0.12. MSE calibration clips the range: 0.105 per channel, 0.101 with tile 128.
    return spec(
        f"int{bits}",
        (channel_axis,),
        {tiled_axis: tile} if tile else None,
        calibration="mse" if bits == 4 else "absmax",
    )


# (weight bits, activation bits or None = unquantized float32 activation, bound)
ACCURACY = {
    "w8a16": (8, None, 0.009),  # observed 0.0075 per channel, 0.0066 with tile 128
    "w8a8": (8, 8, 0.02),  # 0.0105 / 0.0092
    "w4a16": (4, None, 0.12),  # 0.108 / 0.102
    "w4a8": (4, 8, 0.12),  # 0.109 / 0.103
    "w4a4": (4, 4, 0.17),  # 0.151 / 0.141
}


@pytest.mark.parametrize("tile", [None, 128], ids=["per-channel", "tile128"])
@pytest.mark.parametrize(("wbits", "abits", "bound"), list(ACCURACY.values()), ids=list(ACCURACY))
def test_contraction_error_on_normal_data(normal_matmul, wbits, abits, bound, tile):
    x, w, ref = normal_matmul
    hw = _accuracy_spec(wbits, 1, 0, tile)  # weight: per output channel, tiles along K
    ha = None if abits is None else _accuracy_spec(abits, 0, 1, tile)  # activation: per row

    def run(x, w):
        qx = x if ha is None else quantize(x, ha)
        qw = quantize(w, hw)
        return qcore.dot_general(qx, qw, MATMUL), qx, qw

    y, qx, qw = jax.jit(run)(x, w)
    assert mean_relative_error(ref, y) <= bound
    # All of that error is quantization: against the float64 product of the
    # dequantized operands only float32 rounding is left (observed <= 5e-7).
    dx = x.astype(np.float64) if ha is None else _np_dequantize(qx)
    assert testing.max_rel_error(y, dx @ _np_dequantize(qw)) <= 1e-5


# -- 3. result dtypes -----------------------------------------------------------------------

# (call, lhs shape, rhs shape, lhs block axis, rhs block axis): mxfp4 puts its blocks of
# 32 on the contracting axis (for conv: the input features).
OPS = {
    "dot_general": (
        lambda a, b, **kw: qcore.dot_general(a, b, MATMUL, **kw),
        (4, 32),
        (32, 8),
        1,
        0,
    ),
    "einsum": (lambda a, b, **kw: qcore.einsum("mk,kn->mn", a, b, **kw), (4, 32), (32, 8), 1, 0),
    "dot": (qcore.dot, (4, 32), (32, 8), 1, 0),
    "matmul": (qcore.matmul, (4, 32), (32, 8), 1, 0),
    "conv_general_dilated": (
        lambda a, b, **kw: qcore.conv_general_dilated(
            a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw
        ),
        (1, 5, 5, 32),
        (3, 3, 32, 8),
        3,
        2,
    ),
    "ragged_dot": (
        lambda a, b, **kw: qcore.ragged_dot(a, b, jnp.array([1, 3], jnp.int32), **kw),
        (4, 32),
        (2, 32, 8),
        1,
        1,
    ),
}

# (lhs dtype, lhs kind, rhs dtype, rhs kind, preferred_element_type, expected dtype).
# A kind is "float" (a plain array) or how the array of that dtype is quantized.
DTYPE_TABLE = {
    # float activation x QArray weight
    "bf16 x int8(bf16)": (BF16, "float", BF16, "int8", None, BF16),
    "bf16 x int8(f32, bf16 scale)": (BF16, "float", F32, "int8 bf16 scale", None, BF16),
    "bf16 x int8(f32)": (BF16, "float", F32, "int8", None, F32),
    "bf16 x int8(bf16) preferred f32": (BF16, "float", BF16, "int8", F32, F32),
    "f32 x int8(f32) preferred bf16": (F32, "float", F32, "int8", BF16, BF16),
    "f32 x mxfp4(f32)": (F32, "float", F32, "mxfp4", None, F32),
    "bf16 x mxfp4(f32)": (BF16, "float", F32, "mxfp4", None, F32),
    "bf16 x mxfp4(bf16)": (BF16, "float", BF16, "mxfp4", None, BF16),
    # QArray x QArray
    "int8(bf16) x int8(bf16)": (BF16, "int8", BF16, "int8", None, BF16),
    "int8(bf16) x int8(f32, bf16 scale)": (BF16, "int8", F32, "int8 bf16 scale", None, BF16),
    "int8(bf16) x int8(f32)": (BF16, "int8", F32, "int8", None, F32),
    "int8(bf16) x int8(bf16) preferred f32": (BF16, "int8", BF16, "int8", F32, F32),
    "int8(f32) x int8(f32) preferred bf16": (F32, "int8", F32, "int8", BF16, BF16),
    "mxfp4(f32) x mxfp4(f32)": (F32, "mxfp4", F32, "mxfp4", None, F32),
    "int8(bf16) x mxfp4(f32)": (BF16, "int8", F32, "mxfp4", None, F32),
}


def _dtype_params():
    for op in OPS:
        for row in DTYPE_TABLE:
            yield pytest.param(op, row, id=f"{op}: {row}")


def _operand(x, kind, block_axis):
    if kind == "float":
        return x
    if kind == "mxfp4":
        return quantize(x, spec("mxfp4", (), {block_axis: 32}))
    return quantize(x, spec("int8", scale_dtype=BF16 if kind == "int8 bf16 scale" else None))


# The dtype is decided while tracing, so eval_shape checks it without compiling
# (as Qwix's dtype tests do); values are covered by the parity tests.
@pytest.mark.parametrize(("op", "row"), list(_dtype_params()))
def test_result_dtype(op, row):
    call, lshape, rshape, lblock, rblock = OPS[op]
    ldt, lkind, rdt, rkind, preferred, expected = DTYPE_TABLE[row]
    kw = {} if preferred is None else {"preferred_element_type": preferred}

    def run(x, w):
        return call(_operand(x, lkind, lblock), _operand(w, rkind, rblock), **kw)

    out = jax.eval_shape(run, jax.ShapeDtypeStruct(lshape, ldt), jax.ShapeDtypeStruct(rshape, rdt))
    assert out.dtype == expected


def test_bf16_scale_gives_a_bf16_result_with_values_of_the_reference():
    x = jnp.asarray(normal((4, 64), 9), BF16)
    q = quantize(jnp.asarray(normal((64, 8), 10), BF16), spec("int8", (1,)))
    y = qcore.dot_general(x, q, MATMUL)
    # dequantize in float32: a bf16 dequantization would itself round code * scale.
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(q, F32), np.float64)
    assert y.dtype == BF16
    # One bf16 rounding of the result: 2**-8 relative.
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2**-8, atol=1e-6)


# -- 4. einsum -------------------------------------------------------------------------------

# (subscripts, lhs shape, rhs shape)
EINSUM_CASES = [
    ("ij,jk->ik", (4, 6), (6, 5)),
    ("ij,kj->ik", (4, 6), (5, 6)),  # transposed rhs
    ("ji,jk->ik", (6, 4), (6, 5)),  # transposed lhs
    ("ji,kj->ki", (6, 4), (5, 6)),  # both transposed, transposed output
    ("bij,bjk->bik", (2, 4, 6), (2, 6, 5)),  # batch
    ("ibj,bjk->bki", (4, 2, 6), (2, 6, 5)),  # batch axis not leading
    ("bhqd,bhkd->bhqk", (2, 2, 3, 8), (2, 2, 5, 8)),  # attention scores
    ("bhqk,bhkd->bhqd", (2, 2, 3, 5), (2, 2, 5, 8)),  # attention values
    ("ij,bjk->bik", (4, 6), (2, 6, 5)),
    ("ijk,kjl->il", (3, 4, 6), (6, 4, 5)),  # two contracting axes, swapped order
    ("ij,jk->ikj", (4, 6), (6, 5)),  # shared letter kept: batch, not contracted
    ("...ij,jk->...ik", (2, 3, 4, 6), (6, 5)),  # ellipsis
    ("b...d,bdf->b...f", (2, 3, 6), (2, 6, 5)),  # ellipsis after a batch letter
    ("...ij,...jk->...ik", (2, 3, 4, 6), (3, 6, 5)),  # ellipses of different widths
    ("ij...,jk->ik...", (4, 6, 2), (6, 5)),  # trailing ellipsis
    ("...i,...i->...", (2, 3, 4), (2, 3, 4)),  # ellipsis as batch
    ("ij,jk", (4, 6), (6, 5)),  # implicit output
    ("Bi,iA", (4, 6), (6, 5)),  # implicit output is sorted: (A, B)
    ("...j,jk", (2, 3, 6), (6, 5)),  # implicit output with ellipsis
    ("i,j->ij", (4,), (5,)),  # outer product
    ("ij,k->kji", (2, 3), (4,)),  # outer product, permuted
    ("i,i->", (6,), (6,)),  # inner product
    ("ij,ij->", (4, 6), (4, 6)),  # full contraction
    ("ij,ij->i", (4, 6), (4, 6)),  # row-wise dot
    ("ij,ij->ij", (4, 6), (4, 6)),  # elementwise product (batch only)
    ("ij,j->i", (4, 6), (6,)),  # matrix-vector
    (" ij , jk -> ik ", (4, 6), (6, 5)),  # spaces
    # Fallbacks (dequantize, then jnp.einsum):
    ("ij,jk->k", (4, 6), (6, 5)),  # i summed out of one operand
    ("ii,ij->j", (4, 4), (4, 5)),  # letter repeated in one operand (diagonal)
    ("...ij,...jk->...ik", (2, 1, 4, 6), (3, 6, 5)),  # ellipsis needs broadcasting
    ("bij,bjk->bik", (1, 4, 6), (3, 6, 5)),  # batch letter of size 1 broadcasts
]

EINSUM_LHS = spec("int8", (0,))  # per-channel along the first axis, whatever it is
EINSUM_RHS = spec("uint8", (-1,), asym=True)  # zero points


# Few-term float32 contractions on both sides; relative to max |ref| the gap is
# observed <= 2e-7, so 1e-5 leaves margin while catching any wrong scale (~1e-2).
@pytest.mark.parametrize(("subscripts", "lshape", "rshape"), EINSUM_CASES, ids=lambda v: str(v))
def test_einsum_matches_jnp_einsum_on_dequantized_operands(subscripts, lshape, rshape):
    def run(x, w):
        qx, qw = quantize(x, EINSUM_LHS), quantize(w, EINSUM_RHS)
        dx, dw = dequantize(qx), dequantize(qw)
        ref = partial(jnp.einsum, subscripts, precision=HIGHEST)
        return {
            "lhs": (qcore.einsum(subscripts, qx, w), ref(dx, w)),
            "rhs": (qcore.einsum(subscripts, x, qw), ref(x, dw)),
            "both": (qcore.einsum(subscripts, qx, qw), ref(dx, dw)),
        }

    results = jax.jit(run)(normal(lshape, 11, shift=0.2), normal(rshape, 12, shift=0.4))
    for side, (y, ref) in results.items():
        assert y.dtype == F32, side
        assert testing.max_rel_error(y, ref) <= 1e-5, side


def test_einsum_of_plain_arrays_is_jnp_einsum():
    x, w = normal((3, 4), 13), normal((4, 2), 14)
    np.testing.assert_array_equal(qcore.einsum("ij,jk->ik", x, w), jnp.einsum("ij,jk->ik", x, w))


# -- 7. dot and matmul -------------------------------------------------------------------------

# (function, lhs shape, rhs shape)
DOT_CASES = [
    ("dot", (32,), (32,)),
    ("dot", (32,), (32, 5)),
    ("dot", (4, 32), (32,)),
    ("dot", (4, 32), (32, 5)),
    ("dot", (2, 4, 32), (3, 32, 5)),  # N-D: a's last axis with b's second-to-last
    ("matmul", (32,), (32,)),
    ("matmul", (32,), (3, 32, 5)),
    ("matmul", (3, 4, 32), (32,)),
    ("matmul", (3, 4, 32), (3, 32, 5)),  # equal batch dims
    ("matmul", (2, 3, 4, 32), (2, 3, 32, 5)),
    ("matmul", (4, 32), (3, 32, 5)),  # (M, K) x (B, K, N)
    ("matmul", (3, 4, 32), (32, 5)),  # (B, M, K) x (K, N)
]


@pytest.mark.parametrize(("fn", "lshape", "rshape"), DOT_CASES, ids=lambda v: str(v))
def test_dot_and_matmul_match_jnp_on_dequantized_operands(fn, lshape, rshape):
    op, ref_op = getattr(qcore, fn), partial(getattr(jnp, fn), precision=HIGHEST)
    ha = spec("uint8", (0,), asym=True)
    hb = spec("int8", (-1,))

    def run(x, w):
        qx, qw = quantize(x, ha), quantize(w, hb)
        dx, dw = dequantize(qx), dequantize(qw)
        return {
            "rhs": (op(x, qw), ref_op(x, dw)),
            "both": (op(qx, qw), ref_op(dx, dw)),
        }

    for side, (y, ref) in jax.jit(run)(normal(lshape, 15, 0.3), normal(rshape, 16)).items():
        assert testing.max_rel_error(y, ref) <= 1e-5, side


def test_dot_with_a_0d_operand_scales_the_dequantized_array():
    q = quantize(normal((3, 4), 17), spec("int8", (1,)))
    np.testing.assert_allclose(qcore.dot(jnp.float32(2.0), q), 2 * dequantize(q), rtol=1e-6)
    np.testing.assert_allclose(qcore.dot(q, jnp.float32(-0.5)), -0.5 * dequantize(q), rtol=1e-6)


def test_dot_with_a_python_scalar():
    q = quantize(normal((3, 4), 17), spec("int8", (1,)))
    np.testing.assert_allclose(qcore.dot(2.0, q), 2 * dequantize(q), rtol=1e-6)


def test_matmul_with_a_packed_1d_qarray():
    x = normal((4, 32), 18)
    v = quantize(normal((32,), 19), spec("int4", pack=True))
    np.testing.assert_allclose(qcore.matmul(x, v), qcore.dot(x, v), rtol=1e-6)


def test_matmul_refuses_a_qarray_with_broadcasting_batch_dims():
    q = QArray(np.ones((3, 32, 5), np.int8), np.ones((1, 1, 1), np.float32), qtype="int8")
    with pytest.raises(ValueError, match=r"equal batch dims.*\(1, 4, 32\) and \(3, 32, 5\)"):
        qcore.matmul(normal((1, 4, 32)), q)
    with pytest.raises(ValueError, match=r"rank >= 1, got ranks 0 and 3"):
        qcore.matmul(jnp.float32(1.0), q)
    # Plain arrays still broadcast, as in jnp.matmul. (Two XLA programs: on some CPUs
    # their float32 sums round differently, by ~1e-7 relative.)
    x, w = normal((1, 4, 32), 20), normal((3, 32, 5), 21)
    np.testing.assert_allclose(qcore.matmul(x, w), jnp.matmul(x, w), rtol=1e-6, atol=1e-6)


# -- 8. jit, vmap and sharding -----------------------------------------------------------------

CONV_DN = ("NHWC", "HWIO", "NHWC")


def _jit_case(name):
    """(function, arguments) of one op call on QArrays; quantized here, not at import."""
    x, w = normal((8, 64), 22, 0.3), normal((64, 16), 23)
    xc, kc = normal((2, 6, 6, 4), 24, 0.3), normal((3, 3, 4, 6), 25)
    xr, wr = normal((10, 32), 26, 0.3), normal((3, 32, 8), 27)
    u8 = spec("uint8", (0,), asym=True)
    dg = partial(qcore.dot_general, dimension_numbers=MATMUL)
    conv = partial(
        qcore.conv_general_dilated, window_strides=(1, 1), padding="SAME", dimension_numbers=CONV_DN
    )
    gs = jnp.array([3, 0, 7], jnp.int32)
    cases = {
        "dot_general float x int8": lambda: (dg, x, quantize(w, spec("int8", (1,)))),
        "dot_general uint8 x int8": lambda: (
            dg,
            quantize(x, u8),
            quantize(w, spec("int8", (1,))),
        ),
        "dot_general int8 x int4 tiled": lambda: (
            dg,
            quantize(x, spec("int8", (0,))),
            quantize(w, spec("int4", (1,), {0: 16})),
        ),
        "einsum float x int8": lambda: (
            partial(qcore.einsum, "ik,kn->ni"),
            x,
            quantize(w, spec("int8", (1,))),
        ),
        "einsum uint8 x int8": lambda: (
            partial(qcore.einsum, "ik,kn->ni"),
            quantize(x, u8),
            quantize(w, spec("int8", (1,))),
        ),
        "conv float x int8": lambda: (conv, xc, quantize(kc, spec("int8", (3,)))),
        "conv uint8 x int8 asym": lambda: (
            conv,
            quantize(xc, spec("uint8", asym=True)),
            quantize(kc, spec("int8", (3,), asym=True)),
        ),
        "conv sub-channel kernel": lambda: (conv, xc, quantize(kc, spec("int8", (3,), {2: 2}))),
        "ragged_dot float x int8 tiled": lambda: (
            partial(qcore.ragged_dot, group_sizes=gs),
            xr,
            quantize(wr, spec("int8", (0, 2), {1: 16})),
        ),
        "ragged_dot uint8 x int8 asym": lambda: (
            partial(qcore.ragged_dot, group_sizes=gs),
            quantize(xr, u8),
            quantize(wr, spec("int8", (0, 2), asym=True)),
        ),
    }
    return cases[name]()


JIT_CASES = [
    "dot_general float x int8",
    "dot_general uint8 x int8",
    "dot_general int8 x int4 tiled",
    "einsum float x int8",
    "einsum uint8 x int8",
    "conv float x int8",
    "conv uint8 x int8 asym",
    "conv sub-channel kernel",
    "ragged_dot float x int8 tiled",
    "ragged_dot uint8 x int8 asym",
]


@pytest.mark.parametrize("name", JIT_CASES)
def test_jit_equals_eager_bit_for_bit(name):
    fn, a, b = _jit_case(name)
    np.testing.assert_array_equal(fn(a, b), jax.jit(fn)(a, b))


# id -> (activation spec or None, weight spec, rows) of a (rows, 64) x (64, 64) matmul
CONSTANT_CASES = {
    "int8 x int4 tiles 32, 40 rows": (
        spec("int8", (0,)),
        spec("int4", (1,), {0: 32}, pack=True, pack_axis=0),
        40,
    ),
    "int8 x int4 tiles 32, 4 rows": (
        spec("int8", (0,)),
        spec("int4", (1,), {0: 32}, pack=True, pack_axis=0),
        4,
    ),
    "int8 x int8 tiles 16, 40 rows": (spec("int8", (0,), {1: 16}), spec("int8", (1,), {0: 16}), 40),
    "int8 x int8 per-channel, 40 rows": (spec("int8", (0,)), spec("int8", (1,)), 40),
    "weight-only int4 tiles 16, 40 rows": (None, spec("int4", (1,), {0: 16}), 40),
    "weight-only nf4 tiles 16, 4 rows": (None, spec("nf4", (1,), {0: 16}), 4),
}


@pytest.mark.parametrize("name", list(CONSTANT_CASES))
def test_weights_closed_over_as_constants_give_the_same_product(name):
    """``jax.jit(lambda x: f(x, q))`` equals ``jax.jit(f)(x, q)`` bit for bit.

    Closing over a model's params makes them constants of the jit, and XLA:CPU then
    compiled the grouped product's scale multiplies and sum with the scales as a
    constant, rounding differently (int4 tiles with int8 activations at 40 rows: 690
    of 2560 outputs differed).
    """
    how_x, how_w, rows = CONSTANT_CASES[name]
    q = quantize(normal((64, 64), 32, 0.1), how_w)
    x = normal((rows, 64), 33)

    def f(x, q):
        return qcore.dot_general(x if how_x is None else quantize(x, how_x), q, MATMUL)

    np.testing.assert_array_equal(jax.jit(lambda x: f(x, q))(x), jax.jit(f)(x, q))


@pytest.mark.parametrize("activation", ["float", "int8"])
def test_vmap_over_stacked_qarrays_equals_a_loop(activation):
    ws = normal((5, 64, 16), 28)
    qs = jax.vmap(lambda w: quantize(w, spec("int4", (1,), {0: 16})))(ws)
    x = normal((8, 64), 29)
    if activation == "int8":
        x = quantize(x, spec("int8", (0,)))
    batched = jax.vmap(lambda q: qcore.dot_general(x, q, MATMUL))(qs)
    loop = np.stack([qcore.dot_general(x, qs[i], MATMUL) for i in range(5)])
    assert batched.shape == (5, 8, 16)
    # Identical arithmetic per slice; only the float32 sum order may differ.
    np.testing.assert_allclose(batched, loop, rtol=1e-6, atol=1e-6)


SHARDING_SCRIPT = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import qcore
assert jax.device_count() == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
expected = NamedSharding(mesh, P("a", "b"))
rng = np.random.default_rng(0)
x = rng.standard_normal((8, 64)).astype(np.float32)
w = rng.standard_normal((64, 16)).astype(np.float32)
dims = (((1,), (0,)), ((), ()))
f = jax.jit(lambda x, q: qcore.dot_general(x, q, dims))
xq = qcore.quantize(x, qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,)))
for how in (
    qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
    qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,), tiled_axes={0: 16}),
):
    q = qcore.quantize(w, how)
    for lhs in (x, xq):
        lhs_s = jax.device_put(lhs, NamedSharding(mesh, P("a", None)))  # batch axis
        q_s = jax.device_put(q, NamedSharding(mesh, P(None, "b")))  # along N
        assert q_s.qvalue.sharding.spec == P(None, "b"), q_s.qvalue.sharding
        y = f(lhs_s, q_s)
        assert y.sharding.is_equivalent_to(expected, 2), y.sharding
        # Sharded and unsharded programs may sum in another order (float32 rounding).
        np.testing.assert_allclose(np.asarray(y), np.asarray(f(lhs, q)), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_sharded_operands_give_a_sharded_result_on_a_simulated_8_device_mesh():
    assert testing.run_on_cpu_devices(SHARDING_SCRIPT, 8).strip() == "ok"


# id -> (activation spec or None, weight spec) of a (b, 64) x (64, 16) matmul
EXPORT_CASES = {
    "weight-only int8 per-channel": (None, spec("int8", (1,))),
    "weight-only int4 packed": (None, spec("int4", (1,), pack=True, pack_axis=0)),
    "weight-only int4 tile 16 (grouped)": (None, spec("int4", (1,), {0: 16})),
    "weight-only nf4 tile 16 (grouped)": (None, spec("nf4", (1,), {0: 16})),
    "int8 x int8 per-channel": (spec("int8", (0,)), spec("int8", (1,))),
    "int8 x int8 tiles 16 (grouped)": (spec("int8", (0,), {1: 16}), spec("int8", (1,), {0: 16})),
    "uint8 asym x int8": (spec("uint8", (0,), asym=True), spec("int8", (1,))),
    "conv int8 per-channel": (None, spec("int8", (3,))),
    "conv uint8 asym x int8 sub-channel": (spec("uint8", asym=True), spec("int8", (3,), {2: 2})),
}


@pytest.mark.parametrize("name", list(EXPORT_CASES))
def test_jax_export_with_a_symbolic_batch_equals_the_jitted_op(name):
    how_x, how_w = EXPORT_CASES[name]
    conv = name.startswith("conv")
    wq = quantize(normal((3, 3, 4, 6) if conv else (64, 16), 30), how_w)

    def f(x, wq):
        xq = x if how_x is None else quantize(x, how_x)
        if conv:
            return qcore.conv_general_dilated(xq, wq, (1, 1), "SAME", dimension_numbers=CONV_DN)
        return qcore.dot_general(xq, wq, MATMUL)

    shape = "b, 6, 6, 4" if conv else "b, 64"
    x_spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape(shape), jnp.float32)
    exported = jax.export.export(jax.jit(f))(x_spec, wq)
    # Either side of the weight-only dispatch threshold (32 rows).
    for b in (3, 40):
        x = normal((b, *x_spec.shape[1:]), 31 + b, 0.3)
        ref = jax.jit(f)(x, wq)
        y = exported.call(x, wq)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        # The exported op may pick another path (one float dot): float rounding only.
        assert testing.max_rel_error(y, ref) < 1e-5, b


# -- 9. bad inputs ---------------------------------------------------------------------------


def qarray(shape, scale_shape, qtype="int8"):
    """A QArray built from its parts (no quantize, no compilation)."""
    return QArray(np.ones(shape, np.int8), np.ones(scale_shape, np.float32), qtype=qtype)


def test_mismatched_dims_are_refused():
    q = qarray((5, 8), (1, 1))
    msg = r"contracting dims do not match: lhs axes \(1,\) have sizes \[6\], rhs axes \(0,\) "
    with pytest.raises(ValueError, match=msg + r"have sizes \[5\]"):
        qcore.dot_general(normal((4, 6)), q, MATMUL)
    batched = qarray((3, 6, 8), (1, 1, 1))
    with pytest.raises(ValueError, match=r"batch dims do not match: .*\[2\], .*\[3\]"):
        qcore.dot_general(normal((2, 4, 6)), batched, (((2,), (1,)), ((0,), (0,))))
    with pytest.raises(ValueError, match=r"lhs contracting: axis 5 is out of range for rank 2"):
        qcore.dot_general(q, q, (((5,), (0,)), ((), ())))
    with pytest.raises(ValueError, match=r"lhs contracting=\(0, 0\) repeats an axis"):
        qcore.dot_general(q, q, (((0, 0), (0, 0)), ((), ())))
    with pytest.raises(ValueError, match="both contracting and batch"):
        qcore.dot_general(q, q, (((0,), (0,)), ((0,), (0,))))


def test_incompatible_tiles_are_refused():
    # K = 6 in tiles of 3 (2 tiles) against tiles of 2 (3 tiles): neither count
    # divides the other, so no common grouping exists.
    lhs, rhs = qarray((4, 6), (1, 2)), qarray((6, 8), (3, 1))
    msg = r"\(size 6\): lhs has 2 scale tiles \(tile 3\) and rhs has 3 \(tile 2\)"
    with pytest.raises(ValueError, match=msg):
        qcore.dot_general(lhs, rhs, MATMUL)
    with pytest.raises(ValueError, match=msg):
        qcore.einsum("ik,kn->in", lhs, rhs)
    with pytest.raises(
        ValueError, match=r"along k \(size 6\): lhs has 2 scale tiles and rhs has 3"
    ):
        qcore.ragged_dot(lhs, qarray((2, 6, 8), (1, 3, 1)), jnp.array([1, 3]))


def test_bad_ragged_dot_arguments_are_refused():
    x, q = normal((10, 6)), qarray((3, 6, 8), (3, 1, 8))
    with pytest.raises(ValueError, match=r"group_sizes \[2, 3, 1\] sum to 6, but lhs has 10 rows"):
        qcore.ragged_dot(x, q, jnp.array([2, 3, 1], jnp.int32))
    for sizes, shape, dtype in [
        ([2, 8], r"\(2,\)", "int32"),
        ([[2, 3, 5]], r"\(1, 3\)", "int32"),
        ([2.0, 3.0, 5.0], r"\(3,\)", "float32"),
    ]:
        with pytest.raises(ValueError, match=rf"must be 3 integers .* {shape} and dtype {dtype}"):
            qcore.ragged_dot(x, q, jnp.array(sizes))
    with pytest.raises(ValueError, match=r"shapes \(10, 6, 1\) and \(3, 6, 8\)"):
        qcore.ragged_dot(normal((10, 6, 1)), q, jnp.array([2, 3, 5]))


def test_bad_einsum_subscripts_are_refused():
    a, b = qarray((4, 6), (1, 1)), normal((6, 5))
    with pytest.raises(ValueError, match=r"'ij,jk,kl->il' must name exactly two operands"):
        qcore.einsum("ij,jk,kl->il", a, b)
    with pytest.raises(ValueError, match=r"operand term 'ijk' does not match its rank 2"):
        qcore.einsum("ijk,jk->i", a, b)
    with pytest.raises(ValueError, match=r"operand term 'ab\.\.\.c' does not match its rank 2"):
        qcore.einsum("ab...c,bd->ad", a, b)
    with pytest.raises(ValueError, match=r"output letter 'z' is in no operand"):
        qcore.einsum("ij,jk->iz", a, b)


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("dot_general", (MATMUL,)),
        ("einsum", ()),
        ("dot", ()),
        ("matmul", ()),
        ("conv_general_dilated", ((1,), "SAME")),
        ("ragged_dot", (np.array([3]),)),
    ],
)
def test_non_numeric_operands_are_refused(op, args):
    q = qarray((3, 4), (1, 1))
    fn = getattr(qcore, op)
    if op == "einsum":
        fn = partial(fn, "ij,jk->ik")

    def call(a, b):
        return fn(a, b, *args)

    first, second = ("a", "b") if op in ("dot", "matmul") else ("lhs", "rhs")
    with pytest.raises(ValueError, match=rf"{first} must be an array or a QArray, got str 'abc'"):
        call("abc", q)
    with pytest.raises(
        ValueError, match=rf"{second} must be an array or a QArray, got dtype complex64"
    ):
        call(q, np.ones((4, 3), np.complex64))


def test_per_input_channel_activation_scales_do_not_blow_up_memory():
    # One scale per input channel (SmoothQuant-style) would make 2048 groups of a
    # (64, 1024) result (512 MiB of f32); qcore dequantizes instead. Checked for value.
    x = normal((64, 2048), 40, 0.3)
    w = normal((2048, 1024), 41)
    xq = quantize(x, spec("int8", (1,)))
    wq = quantize(w, spec("int8", (1,)))
    y = qcore.dot_general(xq, wq, MATMUL)
    ref = np.asarray(dequantize(xq), np.float64) @ np.asarray(dequantize(wq), np.float64)
    assert testing.max_rel_error(y, ref) < 1e-5
