"""The CPU matmul kernels behind qcore.dot_general: taken when they apply, and exact."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
from qcore import QArray, qtypes
from qcore.ops import kernels

K, N = 512, 256
W = jax.random.normal(jax.random.key(0), (K, N))

# name -> (HowToQuantize kwargs, layout); "kn" stores (K, N), "nk" stores (N, K).
WEIGHTS = {
    "int8 kn": (dict(qtype="int8", channelwise_axes=(1,)), "kn"),
    "int8 nk": (dict(qtype="int8", channelwise_axes=(0,)), "nk"),
    "int3 kn": (dict(qtype="int3", channelwise_axes=(1,)), "kn"),
    "int4 packed kn": (dict(qtype="int4", channelwise_axes=(1,), pack=True, pack_axis=0), "kn"),
    "int4 packed nk": (dict(qtype="int4", channelwise_axes=(0,), pack=True, pack_axis=1), "nk"),
    "int4 packed kn tile 128": (
        dict(qtype="int4", channelwise_axes=(1,), tiled_axes={0: 128}, pack=True, pack_axis=0),
        "kn",
    ),
    "int4 packed nk tile 128": (
        dict(qtype="int4", channelwise_axes=(0,), tiled_axes={1: 128}, pack=True, pack_axis=1),
        "nk",
    ),
}


def _weight(name):
    how, layout = WEIGHTS[name]
    q = qcore.quantize(W if layout == "kn" else W.T, qcore.HowToQuantize(**how))
    w64 = np.asarray(qcore.dequantize(q), np.float64)
    return q, (w64 if layout == "kn" else w64.T), (0 if layout == "kn" else 1)


@pytest.mark.parametrize("m", [1, 5, 16, 40])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_weight_only_kernels_match_the_float64_product(name, m):
    q, w64, k_axis = _weight(name)
    x = jax.random.normal(jax.random.key(m), (m, K))
    dims = (((1,), (k_axis,)), ((), ()))
    y = kernels.fast_dot_general(x, q, dims, None)
    assert y is not None
    ref = np.asarray(x, np.float64) @ w64
    # The int8-digit trick carries ~23 bits of each activation row: f32-level error.
    assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-6


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("name", ["int8 kn", "int8 nk", "int3 kn"])
def test_w8a8_kernel_matches_the_float64_product(name, m):
    q, w64, k_axis = _weight(name)
    x = jax.random.normal(jax.random.key(m), (2, m, K))
    xq = qcore.quantize(x, qcore.HowToQuantize(qtype="int8", channelwise_axes=(0, 1)))
    dims = (((2,), (k_axis,)), ((), ()))
    assert kernels.fast_dot_general(xq, q, dims, None) is not None
    y = qcore.dot_general(xq, q, dims)
    assert y.shape == (2, m, N)
    ref = np.asarray(qcore.dequantize(xq), np.float64) @ w64
    assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-6


# Flax einsum weights: (d, heads, head_dim) contracting d ("kn"), (heads, head_dim, d)
# contracting both leading axes ("kn"), (heads, head_dim, d) contracting d ("nk"); then
# weights whose contracted axes are elsewhere, whose codes are transposed per call:
# Gemma's fused k/v projection (2, d, kv_heads, head_dim) contracting d, a contraction
# out of the weight's axis order and one over axes that are not adjacent.
EINSUM_WEIGHTS = {
    "dhk,d": ((64, 4, 16), (0,)),
    "hkd,hk": ((4, 16, 64), (0, 1)),
    "hkd,d": ((4, 16, 64), (2,)),
    "cdke,d": ((2, 64, 4, 16), (1,)),
    "hkd,kh": ((4, 16, 64), (1, 0)),
    "hdk,hk": ((4, 64, 16), (0, 2)),
}


@pytest.mark.parametrize("act", ["float", "int8"])
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("name", list(EINSUM_WEIGHTS))
def test_weights_with_more_axes_take_the_kernels(name, m, act):
    shape, contracting = EINSUM_WEIGHTS[name]
    free = tuple(a for a in range(len(shape)) if a not in contracting)
    w = jax.random.normal(jax.random.key(3), shape)
    q = qcore.quantize(w, qcore.HowToQuantize(qtype="int8", channelwise_axes=free))
    k_shape = tuple(shape[a] for a in contracting)
    x = jax.random.normal(jax.random.key(m), (2, m, *k_shape))
    if act == "int8":
        x = qcore.quantize(x, qcore.HowToQuantize(qtype="int8", channelwise_axes=(0, 1)))
    lc = tuple(range(2, 2 + len(contracting)))
    dims = ((lc, contracting), ((), ()))
    assert kernels.fast_dot_general(x, q, dims, None) is not None
    y = qcore.dot_general(x, q, dims)
    x64 = np.asarray(qcore.dequantize(x) if act == "int8" else x, np.float64)
    ref = np.tensordot(x64, np.asarray(qcore.dequantize(q), np.float64), (lc, contracting))
    assert y.shape == ref.shape == (2, m, *(shape[a] for a in free))
    assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-6


def test_weights_without_a_matrix_view_use_the_general_path():
    # packed int4 with the contracted axis in the middle: its codes cannot be transposed
    w = jax.random.normal(jax.random.key(3), (4, 64, 16))
    q = qcore.quantize(
        w, qcore.HowToQuantize(qtype="int4", channelwise_axes=(0, 2), pack=True, pack_axis=1)
    )
    x = jax.random.normal(jax.random.key(4), (3, 64))
    dims = (((1,), (1,)), ((), ()))
    assert kernels.fast_dot_general(x, q, dims, None) is None
    # one scale per head, shared by head_dim: not one per output element
    q2 = qcore.quantize(
        jax.random.normal(jax.random.key(5), (64, 4, 16)),
        qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
    )
    dims2 = (((1,), (0,)), ((), ()))
    assert kernels.fast_dot_general(x, q2, dims2, None) is None
    for w, d in ((q, dims), (q2, dims2)):
        ref = np.tensordot(
            np.asarray(x, np.float64), np.asarray(qcore.dequantize(w), np.float64), d[0]
        )
        y = qcore.dot_general(x, w, d)
        assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-5


@pytest.mark.parametrize("n", [1024, 2048])
def test_w8a8_batch_one_kn_is_exact_on_both_sides_of_the_int8_gemm_limit(n):
    # Up to 2**22 weight elements one int8 GEMM, above it f32 blocks.
    k = 4096
    assert (k * n <= kernels._W8A8_KN_INT8_MAX_WEIGHT) == (n == 1024)
    w = qcore.quantize(
        jax.random.normal(jax.random.key(6), (k, n)),
        qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
    )
    x = qcore.quantize(
        jax.random.normal(jax.random.key(7), (1, k)),
        qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,)),
    )
    codes = np.asarray(x.qvalue, np.int64) @ np.asarray(w.qvalue, np.int64)  # exact
    ref = codes * np.asarray(x.scale, np.float64) * np.asarray(w.scale, np.float64)
    y = kernels.fast_dot_general(x, w, (((1,), (0,)), ((), ())), None)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=3e-7)


@pytest.mark.parametrize("n", [1024, 2048])
def test_w8a8_batch_one_kn_sums_exactly_past_float32s_integers(n):
    # Sums above 2**24, where adding float32 block sums would round: the product is
    # float32(exact integer sum) * x_scale * w_scale on both sides of the int8 GEMM limit.
    k = 4096
    rng = np.random.default_rng(3)
    xc = jnp.asarray(rng.integers(120, 128, (1, k)), jnp.int8)
    wc = jnp.asarray(rng.integers(100, 128, (k, n)) * rng.choice([-1, 1], n), jnp.int8)
    xs = jnp.full((1, 1), 0.37, jnp.float32)
    ws = jnp.asarray(rng.uniform(0.5, 2.0, (1, n)), jnp.float32)
    exact = np.asarray(xc, np.int64) @ np.asarray(wc, np.int64)
    assert np.abs(exact).min() > 2**25  # float32's spacing there is 4
    want = exact.astype(np.float32) * np.asarray(xs) * np.asarray(ws)
    with kernels.native_kernels(False):
        got = jax.jit(lambda *a: kernels.w8a8(*a, layout="kn"))(xc, xs, wc, ws)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_layouts_the_kernels_do_not_take_use_the_general_path():
    x = jax.random.normal(jax.random.key(1), (4, K))
    dims = (((1,), (0,)), ((), ()))
    cases = [
        qcore.quantize(
            W, qcore.HowToQuantize(qtype="uint8", symmetric=False, channelwise_axes=(1,))
        ),
        qcore.quantize(
            W, qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,), tiled_axes={0: 64})
        ),
        qcore.quantize(W, qcore.HowToQuantize(qtype="nf4", channelwise_axes=(1,))),
        qcore.quantize(W, qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,), pack=True)),
    ]
    for q in cases:
        assert kernels.fast_dot_general(x, q, dims, None) is None
        ref = np.asarray(x, np.float64) @ np.asarray(qcore.dequantize(q), np.float64)
        y = qcore.dot_general(x, q, dims)
        assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-5
    # Batch dims and an asymmetric activation also go the general way.
    q = qcore.quantize(W, qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    xa = qcore.quantize(
        x, qcore.HowToQuantize(qtype="uint8", symmetric=False, calibration="minmax")
    )
    assert kernels.fast_dot_general(xa, q, dims, None) is None


def test_kernel_path_keeps_dtype_rules_and_jit_equality():
    q, _, _ = _weight("int8 nk")
    x = jax.random.normal(jax.random.key(2), (3, K)).astype(jnp.bfloat16)
    dims = (((1,), (1,)), ((), ()))
    assert qcore.dot_general(x, q, dims).dtype == jnp.float32
    assert qcore.dot_general(x, q, dims, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16
    f = jax.jit(lambda x, q: qcore.dot_general(x, q, dims))
    np.testing.assert_array_equal(f(x, q), qcore.dot_general(x, q, dims))


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(("k", "tile"), [(8, None), (8, 4), (12, 6), (6, 3), (40, 10)])
def test_packed_int4_with_short_or_odd_contractions_is_exact(k, tile, m):
    # Small K and tiles of any even or odd length: the kernels' blocks must divide
    # K / 2 and each tile's half (an odd tile goes to the general path).
    w = jax.random.normal(jax.random.key(k), (k, 5))
    tiles = {} if tile is None else {0: tile}
    how = qcore.HowToQuantize(
        qtype="int4", channelwise_axes=(1,), tiled_axes=tiles, pack=True, pack_axis=0
    )
    q = qcore.quantize(w, how)
    x = jax.random.normal(jax.random.key(m), (m, k))
    y = qcore.dot_general(x, q, (((1,), (0,)), ((), ())))
    ref = np.asarray(x, np.float64) @ np.asarray(qcore.dequantize(q), np.float64)
    assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-6


EXPLICIT_SHARDING = """
import jax, jax.numpy as jnp, numpy as np
import qcore
from qcore import QArray
from qcore import qtypes
from qcore.ops import kernels
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
x = jax.random.normal(jax.random.key(0), (8, 64))
q = qcore.quantize(jax.random.normal(jax.random.key(1), (64, 32)),
                   qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))
dims = (((1,), (0,)), ((), ()))
ref = np.asarray(qcore.dot_general(x, q, dims))
with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    qs = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P(None, "model"))), q)
    assert kernels.fast_dot_general(xs, qs, dims, None) is None
    y = jax.jit(lambda a, b: qcore.dot_general(a, b, dims))(xs, qs)
np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
# Tiles along K with int8 activations: the grouped integer path, also placed by XLA.
how = qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,), tiled_axes={0: 16})
q4 = qcore.quantize(jax.random.normal(jax.random.key(2), (64, 32)), how)
act = qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,))
f = jax.jit(lambda a, b: qcore.dot_general(qcore.quantize(a, act), b, dims))
ref = np.asarray(f(x, q4))
with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    q4s = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P(None, "model"))), q4)
    y = f(xs, q4s)
np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
print("ok")
"""


SPLIT_N = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import qcore
from qcore.ops import kernels
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
rng = np.random.default_rng(0)
dims = (((1,), (0,)), ((), ()))
w = rng.standard_normal((512, 256)).astype(np.float32)
x = rng.standard_normal((1, 512)).astype(np.float32)
for qtype in ("int8", "int4", "nf4"):
    how = qcore.HowToQuantize(qtype=qtype, channelwise_axes=(1,), pack=qtype != "int8")
    q = qcore.quantize(w, how)
    qs = jax.device_put(q, NamedSharding(mesh, P(None, "b")))
    with kernels.native_kernels(False):
        f = jax.jit(lambda x, q: qcore.dot_general(x, q, dims))
        hlo = f.lower(x, qs).compile().as_text()
        assert "all-gather" not in hlo, qtype
        y = f(x, qs)
        assert y.sharding.spec == P(None, "b"), y.sharding
        np.testing.assert_array_equal(np.asarray(y), np.asarray(f(x, q)))
print("ok")
"""


def test_automatic_sharding_keeps_a_weight_split_along_n_at_batch_1():
    """GSPMD on 8 simulated devices: the XLA path's batch-1 products gather no weight.

    Each device multiplies its own columns (qkernels' calls, opaque to the partitioner,
    gather the weight instead: ``packages/qkernels/README.md``).
    """
    from qcore import testing

    assert testing.run_on_cpu_devices(SPLIT_N, 8).strip() == "ok"


def test_explicitly_sharded_operands_take_the_general_path():
    from qcore import testing

    assert testing.run_on_cpu_devices(EXPLICIT_SHARDING, 8).strip() == "ok"


def _dots(f, *args):
    """The dot_general equations of ``f``'s jaxpr, nested jaxprs (scan, pjit) included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


@pytest.mark.parametrize("name", ["int8 kn", "int4 packed kn tile 128", "nf4 tile 64"])
def test_weight_only_products_with_many_rows_run_one_float_dot(name):
    how = (
        dict(qtype="nf4", channelwise_axes=(1,), tiled_axes={0: 64}, pack=True, pack_axis=0)
        if name == "nf4 tile 64"
        else WEIGHTS[name][0]
    )
    q = qcore.quantize(W, qcore.HowToQuantize(**how))
    w64 = np.asarray(qcore.dequantize(q), np.float64)
    dims = (((2,), (0,)), ((), ()))
    many = jax.random.normal(jax.random.key(3), (2, 16, K))  # 32 rows: compute-bound
    dots = _dots(lambda x, q: qcore.dot_general(x, q, dims), many, q)
    # One dot, of the activation with the whole dequantized float32 weight.
    assert [tuple(v.aval.shape) for v in dots[0].invars] == [(2, 16, K), (K, N)]
    assert len(dots) == 1 and dots[0].invars[1].aval.dtype == jnp.float32
    y = qcore.dot_general(many, q, dims)
    ref = np.asarray(many, np.float64) @ w64
    assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-6
    # Fewer rows keep the kernels / the grouped path, which never dequantize the weight.
    few = many[:1, :8]
    few_dots = _dots(lambda x, q: qcore.dot_general(x, q, dims), few, q)
    assert few_dots and all((K, N) not in [tuple(v.aval.shape) for v in d.invars] for d in few_dots)


# -- every product path at sizes that are not multiples of the kernels' blocks -----------
# Rows M cover each branch of the kernels (1, <= 16, > 16) and the weight-only dequantize
# path (>= 32 rows); K and N are off every block size; N cycles with M. Operands are built
# from random codes and scales in numpy (the reference is their float64 value); float
# activations hold a NaN (row 1) and an inf (row 2). One jit per K, compiled without
# costly optimisations, runs every case.
ROWS, COLS = (1, 2, 3, 31, 33), (1, 3, 5)
F32_EPS = float(np.finfo(np.float32).eps)


def _tile(k, even=False):
    """The longest tile that splits K into several tiles (an even one if asked), or None."""
    return next((t for t in range(k // 2, 1, -1) if k % t == 0 and not (even and t % 2)), None)


def _expand(a, shape):
    """A scale-shaped array repeated up to ``shape``."""
    for axis, d in enumerate(shape):
        a = np.repeat(a, d // a.shape[axis], axis)
    return a


def _qarray(rng, shape, spec):
    """A QArray of random codes, scales (and zero points) and its float64 value.

    ``spec`` is ``(qtype, tiles, asymmetric)``: ``tiles[i]`` elements along axis i
    share a scale (``None``: the whole axis).
    """
    qtype, tiles, asymmetric = spec
    qt = qtypes.get(qtype)
    sshape = tuple(d // (d if t is None else t) for d, t in zip(shape, tiles, strict=True))
    scale = rng.uniform(0.01, 0.1, sshape).astype(np.float32)
    zp = rng.integers(0, 256, sshape).astype(np.uint8) if asymmetric else None
    if qt.codebook:
        codes = rng.integers(0, len(qt.codebook), shape).astype(np.uint8)
        values = np.asarray(qt.codebook, np.float64)[codes]
    else:
        codes = rng.integers(qt.qmin, qt.qmax + 1, shape).astype(qt.storage_dtype)
        values = codes.astype(np.float64)
    if zp is not None:
        values = values - _expand(zp, shape)
    return QArray(codes, scale, zp, qtype=qtype), values * _expand(scale, shape)


def _path_cases(k):
    """id -> (activation spec, weight spec, layout, pack the weight?, kernel applies?).

    Specs are those of :func:`_qarray` for (rows, K) activations and (K, N) weights;
    a None activation is float. Layout "nk" stores the weight transposed. The kernels,
    which depend on the layout, are tried in both; the general paths in "kn".
    """
    row, col = ("int8", (1, None), False), ("int8", (None, 1), False)
    cases = {}
    for layout in ("kn", "nk"):
        cases[f"int8 {layout}"] = (None, col, layout, False, True)
        cases[f"w8a8 {layout}"] = (row, col, layout, False, True)
        cases[f"int4 packed {layout}"] = (
            None,
            ("int4", (None, 1), False),
            layout,
            True,
            k % 2 == 0,
        )
        tile = _tile(k, even=True)
        if tile is not None:  # sub-channel scales: the grouped int4 kernels
            grouped = ("int4", (tile, 1), False)
            cases[f"int4 packed tile {tile} {layout}"] = (None, grouped, layout, True, True)
    # nf4 packed along K (K even): the lookup kernels (a loop fusion for one row, a scan).
    cases["nf4 packed"] = (None, ("nf4", (None, 1), False), "kn", True, k % 2 == 0)
    cases["uint8 asymmetric x int8"] = (("uint8", (1, None), True), col, "kn", False, False)
    tile = _tile(k)
    if tile is not None:  # the grouped general path: weight-only, float and int8 x int8
        cases[f"int8 tile {tile}"] = (None, ("int8", (tile, 1), False), "kn", False, False)
        cases[f"nf4 tile {tile}"] = (None, ("nf4", (tile, 1), False), "kn", False, False)
        tiled = (("int8", (1, tile), False), ("int8", (tile, 1), False))
        cases[f"w8a8 tile {tile}"] = (*tiled, "kn", False, False)
    return cases


@pytest.mark.parametrize("k", [1, 7, 8, 15, 17, 100])
def test_every_product_path_is_exact_for_sizes_off_the_kernel_blocks(k):
    cases = _path_cases(k)
    rng = np.random.default_rng(k)
    shapes = [(m, COLS[(i + k) % len(COLS)]) for i, m in enumerate(ROWS)]
    operands, values = {}, {}
    for name, (spec_x, spec_w, layout, _, _) in cases.items():
        for m, n in shapes:
            w, w64 = _qarray(rng, (k, n), spec_w)
            if layout == "nk":
                w = QArray(w.qvalue.T, w.scale.T, qtype=w.qtype)
            if spec_x is None:
                x = rng.standard_normal((m, k)).astype(np.float32)
                x[1:2, k // 2] = np.nan  # row 1, if any
                x[2:3, 0] = np.inf  # row 2, if any
                x64 = x.astype(np.float64)
            else:
                x, x64 = _qarray(rng, (m, k), spec_x)
            operands[name, m], values[name, m] = (x, w), (x64, w64)
    taken = {}

    def run(operands):
        out = {}
        for (name, m), (x, w) in operands.items():
            layout, packed = cases[name][2:4]
            k_axis = 0 if layout == "kn" else 1
            w = qcore.pack(w, axis=k_axis) if packed else w
            dims = (((1,), (k_axis,)), ((), ()))
            out[name, m] = [qcore.dot_general(x, w, dims)]
            fast = kernels.fast_dot_general(x, w, dims, None)
            taken[name, m] = fast is not None
            if fast is not None and m >= 32:  # the op dequantizes (weight-only): the kernel too
                out[name, m].append(fast)
        return out

    options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    out = jax.jit(run).lower(operands).compile(compiler_options=options)(operands)
    for (name, m), ys in out.items():
        assert taken[name, m] == cases[name][4], (name, m)
        x64, w64 = values[name, m]
        finite_rows = np.isfinite(x64).all(1, keepdims=True)
        x64 = np.where(finite_rows, x64, 0.0)
        ref = x64 @ w64
        # float32 rounding of K products and their sum; the kernels' 23-bit activation
        # digits err by at most 2**-23 of the row's largest value.
        bound = np.max(np.abs(x64), 1, keepdims=True) * np.sum(np.abs(w64), 0)
        bound *= (k + 4) * F32_EPS
        for y in ys:
            assert y.shape == ref.shape
            y = np.asarray(y, np.float64)
            # A NaN or inf activation makes its whole output row non-finite, as in float
            # (where a zero weight times inf gives NaN); the other rows stay exact.
            finite = np.broadcast_to(finite_rows, y.shape)
            np.testing.assert_array_equal(np.isfinite(y), finite, f"{name}, M={m}")
            err = np.abs(y - ref)[finite]
            assert np.all(err <= bound[finite]), (name, m, float(np.max(err / bound[finite])))


@pytest.mark.parametrize("tile", [None, 64])
@pytest.mark.parametrize("rows", [1, 2, 8, 31])  # from 32 rows: dequantize first
def test_packed_nf4_takes_the_select_lookup_kernels(tile, rows):
    """Packed nf4 with a (K, N) weight: no gather, exact lookup, at one row or several."""
    tiles = {0: tile} if tile else ()
    how = qcore.HowToQuantize(
        qtype="nf4", channelwise_axes=(1,), tiled_axes=tiles, pack=True, pack_axis=0
    )
    q = qcore.quantize(W, how)
    x = jax.random.normal(jax.random.key(3), (rows, K))
    dims = (((1,), (0,)), ((), ()))
    assert kernels.fast_dot_general(x, q, dims, None) is not None
    with kernels.native_kernels(False):
        lowered = jax.jit(lambda x, q: qcore.dot_general(x, q, dims)).lower(x, q)
    assert "gather" not in lowered.as_text()
    y = np.asarray(lowered.compile()(x, q))
    ref = np.asarray(x, np.float64) @ np.asarray(qcore.dequantize(q), np.float64)
    assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-6
    # An (N, K) weight takes the general path.
    qt = qcore.quantize(W.T, qcore.HowToQuantize(qtype="nf4", channelwise_axes=(0,), pack=True))
    assert kernels.fast_dot_general(x, qt, (((1,), (1,)), ((), ())), None) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 256, 688])
def test_pairwise_sum_adds_in_its_documented_order(rows):
    """Rows 2i and 2i + 1 added level by level, an odd last row carried: the order the
    optional qkernels package reproduces bit for bit (float addition is not associative,
    so any other order gives other bits)."""
    v = np.asarray(jax.random.normal(jax.random.key(rows), (rows, 33)), np.float32) * 1e3
    expected = v
    while len(expected) > 1:
        half = len(expected) // 2
        pairs = expected[0 : 2 * half : 2] + expected[1 : 2 * half : 2]
        expected = np.concatenate([pairs, expected[2 * half :]]) if len(expected) % 2 else pairs
    got = np.asarray(jax.jit(kernels._pairwise_sum)(jnp.asarray(v)))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("qtype", ["int8", "int4", "nf4"])
def test_an_empty_contraction_gives_zeros_like_jnp(qtype, rows):
    """K = 0: the product is all zeros, as ``jnp.ones((M, 0)) @ jnp.zeros((0, N))``."""
    how = qcore.HowToQuantize(qtype=qtype, channelwise_axes=(1,), pack=qtype != "int8")
    q = qcore.quantize(jnp.zeros((0, 5)), how)
    x = jnp.ones((rows, 0))
    dims = (((1,), (0,)), ((), ()))
    for native in (False, True):
        with kernels.native_kernels(native):
            y = jax.jit(lambda x, q: qcore.dot_general(x, q, dims))(x, q)
        np.testing.assert_array_equal(np.asarray(y), np.zeros((rows, 5), np.float32))


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_the_batch1_kernels_broadcast_a_single_scale(kind):
    """A ``(1, 1)`` scale multiplies every column: the result keeps the weight's N."""
    x, s = jnp.ones((1, 4)), jnp.full((1, 1), 0.5)
    call = {
        "int8": lambda: kernels.int8_weight_only(x, jnp.full((4, 3), 2, jnp.int8), s, layout="kn"),
        "int4": lambda: kernels.int4_packed_weight_only(
            x, jnp.full((2, 3), 0x22, jnp.uint8), s, layout="kn"
        ),
        "nf4": lambda: kernels.codebook4_packed_weight_only(
            x, jnp.full((2, 3), 0xFF, jnp.uint8), s, qtypes.get("nf4").codebook
        ),
    }[kind]
    for native in (False, True):
        with kernels.native_kernels(native):
            y = jax.jit(call)()
        np.testing.assert_array_equal(np.asarray(y), np.full((1, 3), 4.0 if kind != "nf4" else 2.0))


@pytest.mark.parametrize("kind", ["int8", "int8 nk", "int4", "nf4"])
def test_the_batch1_kernels_give_one_row_of_zeros_for_k_0(kind):
    """``kernels.*_weight_only`` at K = 0 and one row: ``(1, N)`` zeros on both paths.

    ``int8 nk`` (an ``(N, K)`` weight) raised: its activations' digits took a maximum
    over no elements.
    """
    x, s = jnp.ones((1, 0)), jnp.ones((1, 5))
    call = {
        "int8": lambda: kernels.int8_weight_only(x, jnp.zeros((0, 5), jnp.int8), s, layout="kn"),
        "int8 nk": lambda: kernels.int8_weight_only(x, jnp.zeros((5, 0), jnp.int8), s, layout="nk"),
        "int4": lambda: kernels.int4_packed_weight_only(
            x, jnp.zeros((0, 5), jnp.uint8), s, layout="kn"
        ),
        "nf4": lambda: kernels.codebook4_packed_weight_only(
            x, jnp.zeros((0, 5), jnp.uint8), s, qtypes.get("nf4").codebook
        ),
    }[kind]
    for native in (False, True):
        with kernels.native_kernels(native):
            y = jax.jit(call)()
        np.testing.assert_array_equal(np.asarray(y), np.zeros((1, 5), np.float32))


@pytest.mark.parametrize(
    ("qtype", "pack", "act", "rows"),
    [("int8", False, True, 4), ("int8", False, False, 1), ("int4", True, False, 1)],
)
def test_kernel_paths_run_under_shard_map_with_a_split_weight(qtype, pack, act, rows):
    """Tensor parallel on one device: the weight split along N, as under shard_map.

    The isolating conditional's untaken branch must vary over the mesh axis as the
    product does; with constant zeros there, lax.cond raised.
    """
    from jax.sharding import Mesh  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    rng = np.random.default_rng(0)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    dims = (((1,), (0,)), ((), ()))
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    how = qcore.HowToQuantize(qtype=qtype, channelwise_axes=(1,), pack=pack, pack_axis=0)
    q = qcore.quantize(jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), how)

    def f(x, q):
        if act:
            x = qcore.quantize(x, qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,)))
        return qcore.dot_general(x, q, dims)

    spec = jax.tree.map(lambda a: P(None, "model") if a.ndim == 2 else P(), q)
    sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), spec), out_specs=P(None, "model")))
    np.testing.assert_array_equal(np.asarray(sharded(x, q)), np.asarray(jax.jit(f)(x, q)))


SPLIT_BATCH = [  # (qtype, layout, tile along K, int8 activations)
    ("int8", "kn", None, False),
    ("int8", "nk", None, False),
    ("int8", "kn", None, True),
    ("int8", "nk", None, True),
    ("int4", "kn", None, False),
    ("int4", "kn", 32, False),
    ("int4", "nk", None, False),
    ("nf4", "kn", None, False),
    ("nf4", "kn", 32, False),
]


@pytest.mark.parametrize("rows", [1, 4, 40])
@pytest.mark.parametrize(("qtype", "layout", "tile", "act"), SPLIT_BATCH)
def test_kernel_paths_run_under_shard_map_with_a_split_batch(qtype, layout, tile, act, rows):
    """Data parallel on one device: the activations split along the batch, the weight whole.

    Every product that varies with the activations must be typed as varying over the
    mesh axis: a scan's zeros carry and a native kernel's result were not, and
    shard_map raised. Values and gradients equal the unsharded function's, bit for
    bit, on the XLA path and (where qkernels is installed) the native one.
    """
    from jax.sharding import Mesh  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    rng = np.random.default_rng(1)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    k, n = 64, 32
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    axis = 0 if layout == "kn" else 1  # the weight's K axis
    how = qcore.HowToQuantize(
        qtype=qtype,
        channelwise_axes=(1 - axis,),
        tiled_axes={axis: tile} if tile else (),
        pack=qtype != "int8",
        pack_axis=axis,
    )
    q = qcore.quantize(w if layout == "kn" else w.T, how)
    dims = (((1,), (axis,)), ((), ()))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)

    def f(x, q):
        if act:
            x = qcore.quantize(x, qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,)))
        return qcore.dot_general(x, q, dims)

    def sharded(x, q):
        return jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(x, q)

    def grad(g):
        return jax.grad(lambda x, q: jnp.sum(g(x, q) ** 2))

    for native in (False, True):
        with kernels.native_kernels(native):
            for got, want in [(sharded, f), (grad(sharded), grad(f))]:
                np.testing.assert_array_equal(
                    np.asarray(jax.jit(got)(x, q)), np.asarray(jax.jit(want)(x, q))
                )


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh function", "jitted before"])
@pytest.mark.parametrize("entry", ["dot_general", "einsum"])
def test_each_entry_point_traces_the_path_chosen_when_it_is_traced(entry, fresh):
    """``native_kernels(False)`` takes effect after a trace with the kernels on, and back.

    qcore.einsum's own jit cached its first trace whatever the switch said: with
    qkernels installed, einsum kept calling the native kernel inside
    ``native_kernels(False)`` (so a comparison of the two paths compared the kernel
    with itself); and a function the user had jitted and called kept its trace.
    ``nox -s kernels`` has qkernels installed; without it both traces are pure XLA
    and this checks only that.
    """
    q = qcore.quantize(W, qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    x = jax.random.normal(jax.random.key(0), (1, K))
    fn = {
        "dot_general": lambda x: qcore.dot_general(x, q, (((1,), (0,)), ((), ()))),
        "einsum": lambda x: qcore.einsum("mk,kn->mn", x, q),
    }[entry]
    if fresh:
        traced = lambda: str(jax.make_jaxpr(lambda x: fn(x))(x))  # noqa: E731
    else:
        jitted = jax.jit(fn)
        jitted(x)
        traced = lambda: str(jax.make_jaxpr(jitted)(x))  # noqa: E731
    installed = kernels.native_kernels_used()
    assert ("qkernels" in traced()) == installed
    with kernels.native_kernels(False):
        assert "qkernels" not in traced()
    assert ("qkernels" in traced()) == installed


@pytest.mark.parametrize("name", ["int8 kn", "int4 kn", "nf4 kn", "int4 kn tiles"])
@pytest.mark.parametrize("entry", ["dot_general", "einsum"])
def test_for_export_traces_neither_native_calls_nor_isolating_conditionals(entry, name):
    """Inside ``for_export`` a batch-1 product is plain jax.numpy, also for a function
    jitted and called before; after it, the CPU path (isolated, native if installed)
    is traced again. The values agree with the CPU path's to float32 rounding.

    ``qlitert.export`` of such a product failed validation on the conditional (a
    LiteRT ``IF`` op), and with qkernels installed ``jax.export`` refused its calls.
    """
    how = {
        "int8 kn": {"qtype": "int8", "channelwise_axes": (1,)},
        "int4 kn": {"qtype": "int4", "channelwise_axes": (1,), "pack": True, "pack_axis": 0},
        "nf4 kn": {"qtype": "nf4", "channelwise_axes": (1,), "pack": True, "pack_axis": 0},
        "int4 kn tiles": {
            "qtype": "int4",
            "channelwise_axes": (1,),
            "tiled_axes": {0: 32},
            "pack": True,
            "pack_axis": 0,
        },
    }[name]
    q = qcore.quantize(W, qcore.HowToQuantize(**how))
    x = jax.random.normal(jax.random.key(1), (1, K))
    fn = {
        "dot_general": lambda x: qcore.dot_general(x, q, (((1,), (0,)), ((), ()))),
        "einsum": lambda x: qcore.einsum("mk,kn->mn", x, q),
    }[entry]
    jitted = jax.jit(fn)
    cpu = np.asarray(jitted(x))  # traced, compiled and cached before the block
    assert "cond" in str(jax.make_jaxpr(jitted)(x))
    with kernels.for_export():
        text = str(jax.make_jaxpr(jitted)(x))
        assert "cond" not in text and "qkernels" not in text
        exported = np.asarray(jitted(x))
    after = str(jax.make_jaxpr(jitted)(x))
    assert "cond" in after and ("qkernels" in after) == kernels.native_kernels_used()
    np.testing.assert_allclose(exported, cpu, rtol=1e-5, atol=1e-5 * float(np.abs(cpu).max()))
    np.testing.assert_array_equal(np.asarray(jitted(x)), cpu)


def test_the_kernel_switches_hold_in_the_thread_that_set_them():
    """A thread inside ``for_export`` leaves other threads' traces on the CPU path.

    The switches were process-wide flags while JAX's cache key for them is per
    thread: another thread traced without isolation under the default key, and that
    trace then served every later call outside the block.
    """
    import threading  # noqa: PLC0415

    q = qcore.quantize(W, qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    x = jax.random.normal(jax.random.key(2), (1, K))
    inside, done = threading.Event(), threading.Event()

    def exporter():
        with kernels.for_export():
            inside.set()
            done.wait(timeout=60)

    thread = threading.Thread(target=exporter)
    thread.start()
    try:
        assert inside.wait(timeout=60)
        text = str(jax.make_jaxpr(lambda x: qcore.dot_general(x, q, (((1,), (0,)), ((), ()))))(x))
    finally:
        done.set()
        thread.join()
    assert "cond" in text
