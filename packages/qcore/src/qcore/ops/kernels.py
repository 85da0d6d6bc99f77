"""Fast quantized matmul kernels for XLA:CPU (jax 0.10.x), in pure jax.numpy / lax.

:func:`qcore.dot_general` routes 2-D weight matmuls here (see :func:`fast_dot_general`)
when it is traced for the CPU (the default device's platform, else
``jax.default_backend()``); everything else, and every product traced for another
backend (GPU, TPU), takes the general path of :mod:`qcore.ops.dot_general`. Measured on a
2-core AMD EPYC (Zen 5, AVX-512 + VNNI + BF16) with 4096x4096 weights; the numbers are in
``benchmarks/README.md``.

What matters on this backend (found by reading the compiled HLO):

* A dot whose *both* free dimensions are >= 2 is handed to YNNPACK (``__ynn_fusion``) for f32,
  bf16 and int8xint8->int32. YNNPACK packs its **right-hand** operand on every call, which
  costs about as much as reading a 4096x4096 weight several times. So the weight must be the
  *left* operand with its contraction axis minor, i.e. stored **(N, K)** ("nk", out-features
  first, like torch ``nn.Linear.weight``): ``dot_general(w_nk, x, contract K of both) -> (N, M)``.
  Then YNNPACK packs only the small activation. With the canonical (K, N) layout every call
  re-packs the weight and is 2-5x slower at M = 8..64.
* A dot with a free dimension of 1 (M = 1) is NOT given to YNNPACK: it goes to a
  single-threaded legacy GEMV that first *upcasts* int8/bf16 operands to s32/f32 in a full-size
  temporary (64 MiB -> ~2 us per 4 KiB page of fresh memory: 20-30 ms). Never do M = 1 dots
  on non-f32 operands; make the free dimension >= 2 instead (see the digit trick below).
* Converts are not fused into YNNPACK dots; a whole-matrix convert to f32 is a 64 MiB temporary
  (page-fault bound). Blocking (``lax.scan`` over row blocks of the weight) keeps each converted
  block small (<= 8 MiB) and cache-resident.

The key trick for weight-only int8/int4 at small M ("int8 digits"): an f32 activation row is
split exactly-enough into ``nd`` signed base-256 int8 digits with one f32 scale per row,
``x ~= s * sum_d digit_d * 256**(nd-1-d)`` (nd=3 -> 23-bit fixed point relative to max|x_row|,
error <= 6e-8 * max|x_row|). The weight codes stay int8 and the product is one int8xint8->int32
YNNPACK GEMM with ``nd*M`` right-hand columns (exact integer arithmetic), combined in f32.
It reads only the 1-byte weights and uses VNNI, so at M = 1 it is ~2.5x faster than the f32
GEMV and *more* accurate than it (max rel err ~2e-7 vs ~2e-6). Its cost grows with nd*M, so
for M >~ 16 a blocked float (bf16 or f32) YNNPACK dot is used instead.

With the optional ``qkernels`` package installed, the weight-only products with a
(K, N) weight, one activation row and per-column scales call its native kernels,
which compute these functions' float expressions in the same order, bit for bit, and
so do w8a8 products on CPUs without VNNI from 16 rows, and with one row and a (K, N)
weight (exact int8 sums; see :func:`native_kernels`).

All functions are jittable; every shape-dependent choice is static (Python ints).
Weights: "nk" layout = (N, K) codes (recommended); "kn" = (K, N) codes (fallback paths).
Scales: per output column, shape (1, N); int4 sub-channel scales (K // group, N).
"""

import contextlib
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from qcore import numerics
from qcore.ops import _backend

f32, bf16, i8, i32 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32

# contract the last axis of both operands: (n, k) . (m, k) -> (n, m)
_DN_LAST = (((1,), (1,)), ((), ()))


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _x_digits(x, nd):
    """(M, K) f32 -> ((nd*M, K) int8 digits, most significant first, (M, 1) f32 scale).

    Balanced base-256 digits of round(x / s), s = max|x_row| / (127 * 256**(nd-1)).
    A row holding NaN or inf gets a NaN or inf scale, so its outputs are not finite;
    an all-zero or empty (K = 0) row gets scale 1.
    """
    top = 127 * 256 ** (nd - 1)
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True, initial=0.0)
    scale = jnp.where(amax == 0, jnp.ones_like(amax), amax / top).astype(f32)
    v = jnp.round(x / scale).astype(i32)
    digits = []
    for _ in range(nd - 1):
        d = ((v + 128) & 255) - 128  # in [-128, 127]
        digits.append(d)
        v = (v - d) >> 8  # exact division by 256
    digits.append(jnp.clip(v, -127, 127))
    return jnp.concatenate([d.astype(i8) for d in digits[::-1]], axis=0), scale


def _combine_digits(acc_nc, m, nd):
    """(N, nd*M) per-digit results (int32 or f32) -> (M, N) f32, Horner in f32."""
    a = acc_nc.astype(f32).reshape(acc_nc.shape[0], nd, m)
    y = a[:, 0]
    for d in range(1, nd):
        y = y * 256.0 + a[:, d]
    return y.T


def _sum_of_products(terms):
    """``a0 * b0 + a1 * b1 + ...`` over ``(a, b)`` pairs, added left to right.

    This is the expression qkernels' batch-1 kernels reproduce bit for bit. XLA:CPU
    fuses each add with a product: the first add with its left product,
    ``fma(a0, b0, a1 * b1)``, every later add with the new product,
    ``fma(aj, bj, sum)`` (read off its compiled code for jax 0.10; ``nox -s kernels``
    checks that the two still agree).
    """
    (a0, b0), rest = terms[0], terms[1:]
    out = a0 * b0
    for a, b in rest:
        out = out + a * b
    return out


def _pairwise_sum(rows):
    """``(P, N) -> (1, N)``: rows ``2i`` and ``2i + 1`` added, level after level.

    At each level an odd last row is carried to the next. The order of the adds is
    fixed, so qkernels can reproduce the sum exactly (XLA's dot or reduce would choose
    its own), and in that order the partial rows are consumed first to last, so a
    kernel reads the weight front to back.
    """
    if rows.shape[0] == 0:  # K = 0: the sum of nothing
        return jnp.zeros((1, rows.shape[1]), rows.dtype)
    while rows.shape[0] > 1:
        p = rows.shape[0]
        h = p // 2
        pairs = rows[: 2 * h].reshape(h, 2, rows.shape[1])
        half = pairs[:, 0] + pairs[:, 1]
        rows = jnp.concatenate([half, rows[2 * h :]], 0) if p % 2 else half
    return rows


_NATIVE_BY_DEFAULT = os.environ.get("QCORE_NATIVE_KERNELS", "1") != "0"
# How products are traced, (qkernels enabled, products isolated), as set by
# native_kernels and for_export; None outside them: (_NATIVE_BY_DEFAULT, True). It is a
# JAX user context, so it holds per thread and JAX includes it in every jit's cache key:
# a function traced in one mode (the user's jitted model, qcore's own jitted entry
# points) is traced again in another, and a trace never crosses modes.
_MODE = jax.make_user_context(default_value=None)


def _flags() -> tuple[bool, bool]:
    """(qkernels enabled, products isolated) for a product traced now, in this thread."""
    return _MODE.value or (_NATIVE_BY_DEFAULT, True)


def native_kernels_used() -> bool:
    """Whether a product traced now would call qkernels (installed and not turned off).

    Returns:
        True if the ``qkernels`` package is importable and neither
        ``QCORE_NATIVE_KERNELS=0`` nor :func:`native_kernels` turned it off.

    Example:
        >>> from qcore.ops import kernels
        >>> with kernels.native_kernels(False):
        ...     kernels.native_kernels_used()
        False
    """
    return _native_kernels() is not None


def _native_kernels():
    """The ``qkernels`` module if it is installed and enabled, else None (pure XLA)."""
    return _qkernels() if _flags()[0] else None


@functools.cache
def _qkernels():
    """The ``qkernels`` module, or None if it is not installed (looked up once)."""
    try:
        import qkernels  # pyright: ignore[reportMissingImports]
    except ImportError:
        return None
    return qkernels


def _isolated(fn, x, w, *rest, n, xla=None):
    """``fn(x, w, *rest)`` as an XLA computation of its own, differentiated as ``xla``.

    ``fn`` returns the ``(M, n)`` float32 product, ``M`` the rows of ``x``.

    ``xla`` (default ``fn``) is qcore's formulation of what ``fn`` computes; ``fn`` may
    instead call a qkernels kernel giving the same values. Both paths must compute a
    product qkernels covers this way, so that they agree bit for bit:

    - **Values.** A kernel call's operands and result are always buffers, but XLA:CPU
      merged the pure-XLA product's fusion with the elementwise operations before and
      after it. In ``y * c + h * d`` LLVM contracts one of the two multiplies into a
      fused multiply-add, and which one depended on that merge, so the two paths
      differed in the last bit (most outputs after a few layers). A conditional is
      opaque to fusion, so ``fn`` runs as its branch (:func:`_opaque`). ``fn`` must
      include the multiply by the column scales: outside, it was fused with the add
      differently when the scales were stored (PTQ) and when they were computed in the
      same jit (QAT).
    - **Derivatives.** An FFI call has none, so on both paths the derivative rule is
      ``xla``'s forward-mode derivative, outside the conditional (reverse mode
      transposes it). The rule differentiates only the operands with nonzero tangents:
      JAX's default passes zeros for the others (the scales of a weight held
      constant), and their zero terms changed how the tangent's sums were contracted
      into multiply-adds, so ``jvp`` differed between the paths. Under ``jvp`` the
      primal is still the isolated ``fn``; inside one conditional with its tangent it
      was fused with it and rounded differently.
    """
    xla = xla or fn

    @jax.custom_jvp
    def product(*args):
        return _opaque(fn, (x.shape[0], n), *args)

    def product_jvp(primals, tangents):
        live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]

        def of_live(*values):
            args = list(primals)
            for i, v in zip(live, values, strict=True):
                args[i] = v
            return xla(*args)

        _, tangent = jax.jvp(of_live, [primals[i] for i in live], [tangents[i] for i in live])
        return product(*primals), tangent

    product.defjvp(product_jvp, symbolic_zeros=True)
    return product(x, w, *rest)


def _opaque(fn, shape, x, w, *rest):
    """``fn(x, w, *rest)`` as the branch of a conditional XLA keeps (see :func:`_isolated`).

    ``fn`` returns a float32 array of ``shape``, given by the caller: finding it by
    tracing ``fn`` would trace every product twice.

    The predicate is the constant 1 passed through ``lax.optimization_barrier``: always
    true, but XLA does not look through the barrier, so it keeps the conditional even
    where every operand is a constant of the jit (weights closed over by
    ``jax.jit(lambda x: model.apply(params, x))``). A predicate read from the weight
    was folded there, and under ``vmap`` over the weights became batched, which turns
    a conditional into a select of both branches, fused like any other operation.
    (Reading an activation instead gave it one more reader, and XLA then computed the
    operations that produced the activation twice, in two fusions that rounded
    differently.) The other branch, never taken, is zeros computed from one element of
    every operand: under ``shard_map`` its result then varies over the same mesh axes
    as ``fn``'s, as ``lax.cond`` requires. Inside the branch the operands pass through
    a barrier too: where all of them are constants, XLA would otherwise compute ``fn``
    while compiling, with its evaluator, which rounds every product before adding it
    (no fused multiply-adds). XLA:CPU does not constant-fold through a barrier, and
    its compiled code has none left: six chained 4096² layers at batch 1 and the Flax
    stack at 8 and 64 rows ran 0.95–1.01× the times without the barriers, within the
    noise, and gave the same values.
    """
    if not _flags()[1] or any(a.size == 0 for a in jax.tree.leaves((x, w, rest))):
        return fn(x, w, *rest)  # for export, or nothing to isolate and no element for `never`
    always = lax.optimization_barrier(jnp.int32(1)) != 0

    def never(*operands):
        zero = sum(a[(0,) * a.ndim].astype(f32) * 0 for a in jax.tree.leaves(operands))
        return jnp.broadcast_to(zero, shape)

    def isolated(*operands):
        return fn(*lax.optimization_barrier(operands))

    return lax.cond(always, isolated, never, x, w, *rest)


@contextlib.contextmanager
def native_kernels(enabled: bool):
    """Use (or bypass) the optional ``qkernels`` package while tracing in this block.

    qcore calls qkernels' native kernels where they apply whenever the package is
    installed; ``QCORE_NATIVE_KERNELS=0`` in the environment (read when qcore is
    imported) turns them off for the process. Both give the same numbers bit for bit,
    and the same derivatives, so this only changes speed. The choice is made when a
    function is traced, and JAX keys its trace caches on it: a function jitted and
    called before the block is traced (and compiled) again inside it, once; outside,
    its earlier trace serves again. The block holds in the thread that enters it.

    Args:
        enabled: False to trace with the pure-XLA formulation even where qkernels is
            installed; True to use qkernels where it is installed.

    Yields:
        None.

    Example:
        >>> import jax.numpy as jnp
        >>> from qcore.ops import kernels
        >>> x, w = jnp.ones((1, 4)), jnp.full((4, 2), 3, jnp.int8)
        >>> with kernels.native_kernels(False):
        ...     kernels.int8_weight_only(x, w, jnp.ones((1, 2)), layout="kn")
        Array([[12., 12.]], dtype=float32)
    """
    with _MODE((enabled, _flags()[1])):
        yield


@contextlib.contextmanager
def for_export():
    """Trace for a runtime other than XLA:CPU in this block (LiteRT, ONNX, StableHLO files).

    Two things qcore's CPU products carry only make sense to XLA:CPU, and converters
    refuse them: calls of the optional ``qkernels`` package's native kernels (custom
    calls ``jax.export`` will not serialize), and the conditional that keeps XLA from
    fusing a product with its neighbours (a LiteRT ``IF`` op). Inside the block
    neither is traced: the products are plain ``jax.numpy`` expressions computing the
    same values (to float32 rounding: XLA may then fuse them differently).
    ``qlitert.export`` and ``qort``'s exports trace their functions in this block.

    As with :func:`native_kernels`, JAX keys its trace caches on the block: a
    function jitted and called before is traced again inside it, and what is traced
    inside never runs outside.

    Yields:
        None.

    Example:
        >>> import jax, jax.numpy as jnp, qcore
        >>> from qcore.ops import kernels
        >>> how = qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,))
        >>> w = qcore.quantize(jnp.ones((4, 2)), how)
        >>> f = jax.jit(lambda x: qcore.dot(x, w))
        >>> "cond" in str(jax.make_jaxpr(f)(jnp.ones((1, 4))))  # isolated for XLA:CPU
        True
        >>> with kernels.for_export():
        ...     "cond" in str(jax.make_jaxpr(f)(jnp.ones((1, 4))))
        False
    """
    with _MODE((False, False)):
        yield


def _pick_block(total, target):
    """Largest power-of-two divisor of `total` that is <= target (static Python ints)."""
    b = 1
    while b * 2 <= target and total % (b * 2) == 0:
        b *= 2
    return b


def _zeros_varying_like(shape, *operands):
    """float32 zeros, typed as varying over every ``shard_map`` axis ``operands`` vary over.

    A scan's carry must keep its type: zeros made from nothing are the same on every
    device, while the sums added to them vary wherever the activations are split, and
    ``lax.scan`` raised. Outside ``shard_map`` these are plain zeros.
    """
    zeros = jnp.zeros(shape, f32)
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in operands))
    return lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def _scan_k(x, w_kn, cdt, bk, exact=False):
    """``x (M, K) @ w_kn (K, N)`` as a scan over K blocks of ``bk`` rows, f32 accumulation.

    Each block of the weight is converted to ``cdt`` inside the scan, so no full-size
    converted copy of the weight exists. With ``exact`` (integer codes whose block
    sums are integers float32 holds exactly) the block sums are added in int32.
    """
    m, k = x.shape
    n = w_kn.shape[1]
    nb = k // bk
    xb = x.reshape(m, nb, bk).transpose(1, 0, 2).astype(cdt)
    acc_dtype = i32 if exact else f32

    def body(acc, xw):
        xi, wi = xw
        block = lax.dot(xi, wi.astype(cdt), preferred_element_type=f32)
        return acc + block.astype(acc_dtype), None

    zeros = _zeros_varying_like((m, n), xb, w_kn).astype(acc_dtype)
    acc, _ = lax.scan(body, zeros, (xb, w_kn.reshape(nb, bk, n)))
    return acc.astype(f32)


def _scan_rows(fn, blocks):
    """lax.scan over the leading axis of `blocks` (a pytree) collecting fn(block) outputs."""
    _, ys = lax.scan(lambda c, b: (c, fn(b)), 0, blocks)
    return ys


# ----------------------------------------------------------------------------------------------
# A. weight-only int8
# ----------------------------------------------------------------------------------------------
def int8_weight_only(
    x, w_codes, w_scale, *, layout="nk", precision="highest", digits=None, block=None
):
    """``x @ (codes * scale)`` for int8-coded weights and float activations.

    With ``layout="nk"`` (recommended; ``w_codes`` is ``(N, K)``): up to 16 rows,
    each activation row is split into ``nd`` signed base-256 int8 digits with one
    scale per row (``nd = 3``: 23 bits, f32-level error) and multiplied in one exact
    int8 GEMM with the weight on the left; larger batches scan blocks of 512 weight
    rows, each converted and multiplied in f32 (bf16 with ``precision="bf16"``). With
    ``layout="kn"`` (``(K, N)``): batch 1 runs one loop fusion over 16-row partial
    sums; larger batches scan K blocks of 256 rows. Scales multiply the output only.

    Args:
        x: ``(M, K)`` activations.
        w_codes: ``(N, K)`` or ``(K, N)`` int8 codes (any signed int type up to 8 bits).
        w_scale: ``(1, N)`` float32 scales.
        layout: ``"nk"`` or ``"kn"``.
        precision: ``"highest"`` (3 digits / f32 blocks), ``"high"`` (2 digits, ~4e-5
            relative error) or ``"bf16"`` (2 digits / bf16 blocks, ~2e-3).
        digits: Force the digit path with this many digits.
        block: Rows per scan block (default as above).

    Returns:
        ``(M, N)`` float32.
    """
    m, k = x.shape
    if layout == "nk":
        n = w_codes.shape[0]
        if m <= 16 or digits is not None:
            nd = digits or (3 if precision == "highest" else 2)
            xd, xs = _x_digits(x.astype(f32), nd)
            acc = lax.dot_general(w_codes, xd, _DN_LAST, preferred_element_type=i32)  # (N, nd*M)
            return _combine_digits(acc, m, nd) * xs * w_scale
        cdt = bf16 if precision == "bf16" else f32
        bn = block or _pick_block(n, 512)
        xc = x.astype(cdt)
        ys = _scan_rows(
            lambda w: lax.dot_general(w.astype(cdt), xc, _DN_LAST, preferred_element_type=f32),
            w_codes.reshape(n // bn, bn, k),
        )  # (nb, bn, M)
        return ys.reshape(n, m).T * w_scale
    # ---- (K, N) fallback
    n = w_codes.shape[1]
    if m == 1 and block is None:
        # bk: the largest divisor of K up to 16 (16 for any K a multiple of 16).
        bk = max(d for d in range(1, 17) if k % d == 0)
        native = _native_kernels() if w_codes.dtype == i8 else None  # (its codes are int8)
        return _batch1(
            native and (lambda x, w: native.int8_kn_batch1(x, w, bk)),
            lambda x, w, _: _int8_kn_m1(x, w, bk),
            x,
            w_codes,
            w_scale,
        )
    # scan over K blocks, accumulate in f32
    cdt = bf16 if (precision == "bf16" and m > 1) else f32  # M=1 dots must stay f32 (see top)
    bk = block or _pick_block(k, 512 if m == 1 else 256)
    return _scan_k(x, w_codes, cdt, bk) * w_scale  # scale applied on the output only


# ----------------------------------------------------------------------------------------------
# B. weight-only int4, packed two per byte along K
# ----------------------------------------------------------------------------------------------
def _unpack_nk(p):
    """(rows, K/2) uint8 -> (lo, hi) int8 sign-extended nibbles (codes 2i and 2i+1).

    Arithmetic shifts on the int8 view: lo = (q << 4) >> 4, hi = q >> 4 (== ((v ^ 8) - 8)).
    """
    q = lax.bitcast_convert_type(p, i8)
    return (q << 4) >> 4, q >> 4


def int4_packed_weight_only(
    x, w_packed, w_scale, *, group_size=None, layout="nk", precision="highest", block=None
):
    """``x @ (codes * scale)`` with int4 codes packed two per byte along K.

    With ``layout="nk"`` (recommended) ``w_packed`` is ``(N, K/2)`` uint8, byte ``i``
    of row ``n`` holding codes ``k = 2i`` (low nibble) and ``2i + 1`` (high nibble);
    with ``layout="kn"`` it is ``(K/2, N)`` with byte row ``i`` holding K rows ``2i``
    and ``2i + 1`` (qcore's packing along axis 0). Blocks of 512 weight rows (256
    with group scales) are unpacked by arithmetic shifts inside a ``lax.scan``, and
    the nibbles are never interleaved back into K order: the activation is split into
    its even and odd columns instead. Up to 16 rows with per-column scales use the
    int8-digit GEMM (see :func:`int8_weight_only`); larger batches use f32 dots
    (bf16 with ``precision="bf16"``); group scales are multiplied in during the
    unpack. At batch 1 with ``"kn"`` a single loop fusion over 16-row partial sums
    avoids any weight-size temporary.

    Args:
        x: ``(M, K)`` activations.
        w_packed: Packed codes (see above).
        w_scale: ``(1, N)`` per-column scales or ``(K // group_size, N)`` group scales.
        group_size: K rows per group scale, or None.
        layout: ``"nk"`` or ``"kn"``.
        precision: ``"highest"`` (f32-level error), ``"high"`` or ``"bf16"``.
        block: Weight rows per scan block (default as above).

    Returns:
        ``(M, N)`` float32.
    """
    m, k = x.shape
    x = x.astype(f32)
    if layout == "kn":
        if m == 1:
            # bk packed rows per partial sum must divide K/2 and each group's K/2.
            span = k // 2 if group_size is None else math.gcd(k // 2, group_size // 2)
            bk = block or _pick_block(span, 8)
            native = _native_kernels()
            return _batch1(
                native and (lambda x, w, **s: native.int4_kn_batch1(x, w, bk, **s)),
                lambda x, w, s: _int4_kn_m1(x, w, s, bk),
                x,
                w_packed,
                w_scale,
            )
        return _int4_kn(x, w_packed, w_scale, group_size, precision, block)
    n = w_packed.shape[0]
    grouped = group_size is not None and w_scale.shape[0] > 1
    # block rows: 512 per-column (1 MiB packed in), 256 with group scales (f32 unpack is 4x wider)
    bn = block or _pick_block(n, 256 if grouped else 512)
    pb = w_packed.reshape(n // bn, bn, k // 2)
    if not grouped and m <= 16:
        nd = 3 if precision == "highest" else 2  # see int8_weight_only
        xd, xs = _x_digits(x, nd)
        xe, xo = xd[:, 0::2], xd[:, 1::2]

        def int_blk(p):
            lo, hi = _unpack_nk(p)
            return lax.dot_general(lo, xe, _DN_LAST, preferred_element_type=i32) + lax.dot_general(
                hi, xo, _DN_LAST, preferred_element_type=i32
            )

        acc = _scan_rows(int_blk, pb).reshape(n, nd * m)
        return _combine_digits(acc, m, nd) * xs * w_scale
    # bf16 only pays off for M > 16 (at small M the bf16 YNNPACK kernels are slower than f32)
    cdt = bf16 if (precision == "bf16" and m > 16) else f32
    xe, xo = x[:, 0::2].astype(cdt), x[:, 1::2].astype(cdt)
    if not grouped:

        def float_blk(p):
            lo, hi = _unpack_nk(p)
            return lax.dot_general(
                lo.astype(cdt), xe, _DN_LAST, preferred_element_type=f32
            ) + lax.dot_general(hi.astype(cdt), xo, _DN_LAST, preferred_element_type=f32)

        ys = _scan_rows(float_blk, pb)
        return ys.reshape(n, m).T * w_scale
    g = w_scale.shape[0]
    gs = k // g
    if m == 1:  # a 1-wide float dot is the single-threaded legacy GEMV: pad to 2 columns
        xe = jnp.concatenate([xe, jnp.zeros_like(xe)], 0)
        xo = jnp.concatenate([xo, jnp.zeros_like(xo)], 0)
    sb = w_scale.reshape(g, n // bn, bn).transpose(1, 2, 0)  # (nb, bn, G), tiny

    def blk(ps):
        p, s = ps
        lo, hi = _unpack_nk(p)  # (bn, K/2) each
        s_half = numerics.repeat(s, gs // 2, 1)  # (bn, K/2) scale per code
        wl = (lo.astype(f32) * s_half).astype(cdt)
        wh = (hi.astype(f32) * s_half).astype(cdt)
        return lax.dot_general(wl, xe, _DN_LAST, preferred_element_type=f32) + lax.dot_general(
            wh, xo, _DN_LAST, preferred_element_type=f32
        )

    ys = _scan_rows(blk, (pb, sb))
    return ys.reshape(n, -1)[:, :m].T


def codebook4_packed_weight_only(
    x, w_packed, w_scale, levels, *, group_size=None, block=None, precision="highest"
):
    """``x @ (levels[codes] * scale)`` for 4-bit codebook codes (nf4) stored ``(K/2, N)``.

    ``w_packed`` is ``(K/2, N)`` uint8 (qcore's packing along K: byte row ``i`` holds
    the level indices of K rows ``2i``, low nibble, and ``2i + 1``, high nibble). Each
    nibble is looked up in ``levels`` by a tree of selects on its four bits, where the
    general path gathers the whole weight (``jnp.take``) before a float dot (5.2×
    slower at batch 1 on the Flax PTQ stack: ``benchmarks/README.md``). One
    activation row takes the same loop fusion as int4 at batch 1
    (:func:`int4_packed_weight_only`; qkernels' lookup kernel where installed), more
    rows int4's scan over K blocks, each block looked up and then multiplied in
    float32 (in bf16 with ``precision="bf16"``).

    Args:
        x: ``(M, K)`` activations.
        w_packed: ``(K/2, N)`` packed level indices.
        w_scale: ``(1, N)`` per-column scales or ``(K // group_size, N)`` group scales.
        levels: The 16 levels (a tuple of floats, static).
        group_size: K rows per group scale, or None.
        block: Packed rows per partial row at batch 1 (default: the largest power of two
            up to 8 dividing K/2 and each group's K/2), K rows per scan block above.
        precision: ``"highest"`` or ``"high"`` (float32 blocks) or ``"bf16"``.

    Returns:
        ``(M, N)`` float32.

    Example:
        >>> import jax.numpy as jnp
        >>> from qcore.ops import kernels
        >>> levels = tuple(float(v) for v in range(-8, 8))  # a codebook of 16 levels
        >>> w = jnp.full((2, 3), 0x9F, jnp.uint8)  # low nibble 15 -> 7.0, high 9 -> 1.0
        >>> kernels.codebook4_packed_weight_only(jnp.ones((1, 4)), w, jnp.ones((1, 3)), levels)
        Array([[16., 16., 16.]], dtype=float32)
    """
    m, k = x.shape
    x = x.astype(f32)
    if m != 1:
        return _int4_kn(x, w_packed, w_scale, group_size, precision, block, levels)
    span = k // 2 if group_size is None else math.gcd(k // 2, group_size // 2)
    bk = block or _pick_block(span, 8)
    native = _native_kernels()
    return _batch1(
        native and (lambda x, w, **s: native.codebook4_kn_batch1(x, w, bk, levels, **s)),
        lambda x, w, s: _int4_kn_m1(x, w, s, bk, levels),
        x,
        w_packed,
        w_scale,
    )


def _batch1(native, xla, x, w, w_scale):
    """A batch-1 product and its scales, as one computation fused with nothing around it.

    ``xla(x, w, scales)`` is qcore's formulation: with ``scales`` None the unscaled sums,
    else tile scales multiplied into each code. ``native(x, w[, scales=...])`` is
    qkernels' kernel computing the same, or None without qkernels. Per-column scales
    multiply the sums after either, inside the same isolated computation
    (:func:`_isolated`), so every path rounds the scaled product before anything that
    follows it.
    """
    if w_scale.shape[0] > 1:
        kernel = xla if native is None else (lambda x, w, s: native(x, w, scales=s))
        return _isolated(kernel, x, w, w_scale, n=w.shape[1], xla=xla)

    def per_column(product):
        return lambda x, w, s: product(x, w) * s

    unscaled = per_column(lambda x, w: xla(x, w, None))
    kernel = per_column(native) if native else unscaled
    return _isolated(kernel, x, w, w_scale, n=w.shape[1], xla=unscaled)


def _lookup4(index, levels):
    """``levels[index]`` for int32 indices in 0..15, as selects on the index's bits."""
    values = [jnp.float32(v) for v in levels]
    for bit in range(4):
        on = ((index >> bit) & 1) == 1
        values = [
            lax.select(on, jnp.full(index.shape, hi, f32), jnp.full(index.shape, lo, f32))
            for lo, hi in zip(values[0::2], values[1::2], strict=True)
        ]
    return values[0]


def _int8_kn_m1(x, w_codes, bk):
    """(K, N) int8 at M = 1, before the scales, as one multi-threaded loop fusion.

    P = K/bk partial rows, each the python-unrolled sum of bk ``x[k] * float(w[k, :])``
    terms over static strided slices (vectorised along N), then a pairwise tree of adds
    sums the P rows. Writes no weight-size temporary. (jnp.sum over the major axis
    instead would hit XLA:CPU's pathological column-walk reduce: seconds.) Scaled and
    isolated by :func:`_batch1`.
    """
    k, n = w_codes.shape
    p_rows = k // bk
    w3 = w_codes.reshape(p_rows, bk, n)
    x3 = x.astype(f32).reshape(p_rows, bk)
    terms = [(x3[:, j, None], w3[:, j].astype(f32)) for j in range(bk)]
    return _pairwise_sum(_sum_of_products(terms))


def _nibbles(b):
    """Signed low and high nibbles of uint8 bytes, as int32 (codes 2i and 2i + 1)."""
    v = b.astype(i32)
    return ((v & 15) ^ 8) - 8, ((v >> 4) ^ 8) - 8


def _int4_kn_m1(x, w_packed, w_scale, bk, levels=None):
    """(K/2, N) packed int4 (or 4-bit codebook, ``levels``) at M = 1, as one loop fusion.

    It computes P = K/(2*bk) partial rows
    out1[p, n] = sum_{j<bk} x[2(p*bk+j)] * lo[p*bk+j, n] + x[2(p*bk+j)+1] * hi[p*bk+j, n]
    (python-unrolled FMAs over static strided slices, vectorised along N; with group
    scales each code is multiplied by its scale first), and a pairwise tree of adds sums
    the P rows. No weight-size temporary is ever written. (A reduce over the major axis
    would be pathologically slow in XLA:CPU; the unrolled form is not.) ``w_scale``:
    tile scales ``(G, N)``, or None for the sums before any scale (per-column scales
    are multiplied by :func:`_batch1`, which also isolates the product).
    """
    k = x.shape[1]
    n = w_packed.shape[1]
    p_rows = k // (2 * bk)
    # Slices of the uint8 bytes are decoded inside the fusion: a bitcast of the whole
    # weight to int8 is materialised by XLA, and four such 8 MiB copies in one model
    # pushed its temporaries over the 32 MiB mmap threshold (page faults every call:
    # 4 chained 4096x4096 layers went from 6 to 17 ms).
    q = w_packed.reshape(p_rows, bk, n)
    x3 = x.reshape(p_rows, bk, 2)
    scale = None  # with tile scales, (P, N): partial row p's
    if w_scale is not None:
        scale = numerics.repeat(w_scale, p_rows // w_scale.shape[0], 0)
    terms = []
    for j in range(bk):
        if levels is None:
            lo, hi = (v.astype(f32) for v in _nibbles(q[:, j]))
        else:  # a 4-bit codebook: the nibbles index `levels`
            v = q[:, j].astype(i32)
            lo, hi = _lookup4(v & 15, levels), _lookup4(v >> 4, levels)
        if scale is not None:
            # Each code times its scale, rounded, before the sums. (Scaling the partial
            # rows instead is cheaper, but XLA fused that multiply into the tree's first
            # add for some shapes and not others, so qkernels could not reproduce it.)
            lo, hi = lo * scale, hi * scale
        terms += [(x3[:, j, 0, None], lo), (x3[:, j, 1, None], hi)]
    return _pairwise_sum(_sum_of_products(terms))


def _int4_kn(x, w_packed, w_scale, group_size, precision, block, levels=None):
    """(K/2, N) packed int4 (or 4-bit codebook, ``levels``) fallback: a scan over K blocks.

    Per block it decodes the two nibble rows (shifts, or the select lookup of
    ``levels``) and contracts them with the even / odd activation columns (no
    interleave).
    """
    m, k = x.shape
    n = w_packed.shape[1]
    grouped = group_size is not None and w_scale.shape[0] > 1
    cdt = bf16 if (precision == "bf16" and m > 1) else f32
    # Packed rows per block: divides K / 2 and, with group scales, each group's half
    # (one scale row per block).
    span = math.gcd(k // 2, (k // w_scale.shape[0]) // 2) if grouped else k // 2
    hb = block // 2 if block else _pick_block(span, 256 if m == 1 else 128)
    nb = (k // 2) // hb
    xe = x[:, 0::2].reshape(m, nb, hb).transpose(1, 0, 2).astype(cdt)
    xo = x[:, 1::2].reshape(m, nb, hb).transpose(1, 0, 2).astype(cdt)
    q = w_packed.reshape(nb, hb, n)  # uint8, decoded per block (see _int4_kn_m1)
    if grouped:
        per = (k // w_scale.shape[0]) // (2 * hb)  # blocks per group
        sc = numerics.repeat(w_scale, per, 0)[:, None, :]  # (nb, 1, N)
    else:
        sc = jnp.ones((nb, 1, n), f32)

    def body(acc, a):
        xei, xoi, qi, si = a
        if levels is None:
            lo, hi = (v.astype(f32) for v in _nibbles(qi))
        else:
            v = qi.astype(i32)
            lo, hi = _lookup4(v & 15, levels), _lookup4(v >> 4, levels)
        lo = (lo * si).astype(cdt)
        hi = (hi * si).astype(cdt)
        return acc + lax.dot(xei, lo, preferred_element_type=f32) + lax.dot(
            xoi, hi, preferred_element_type=f32
        ), None

    acc, _ = lax.scan(body, _zeros_varying_like((m, n), xe, xo, q, sc), (xe, xo, q, sc))
    return acc if grouped else acc * w_scale


# Batch-1 w8a8 with a (K, N) weight: the int8 GEMM (which re-packs the weight) up to
# this many weight elements, blocked f32 conversion above (see w8a8).
_W8A8_KN_INT8_MAX_WEIGHT = 2**22

# w8a8 calls qkernels' int8 GEMM from this many activation rows (on CPUs without
# VNNI); below it XLA's int8 dot was as fast or faster (benchmarks/int8_gemm.py).
_W8A8_NATIVE_MIN_ROWS = 16


def _native_w8a8(x_codes, w_codes, layout):
    """Qkernels' w8a8 rows (``float32(x @ w) * x_scale``, exact sums), or None.

    None where qkernels is missing or off, for codes not stored as int8, on CPUs with
    VNNI (whose int8 dot-product instructions XLA's own GEMM uses and qkernels' AVX2
    code does not), and below ``_W8A8_NATIVE_MIN_ROWS`` rows or with a symbolic row
    count, except one row with a ``(K, N)`` weight, which the kernel reads once, row
    by row, instead of repacking it. Integer sums are exact in any order, so with the
    row scales multiplied in the kernel as in :func:`_w8a8_rows` and the column scales
    in XLA, the result is the XLA path's bit for bit.
    """
    native, m = _native_kernels(), x_codes.shape[0]
    if native is None or not isinstance(m, int) or native.vnni():
        return None  # (a symbolic row count, as under jax.export, stays on XLA)
    if m < _W8A8_NATIVE_MIN_ROWS and (m != 1 or layout != "kn"):
        return None
    if x_codes.dtype != i8 or w_codes.dtype != i8:
        return None
    return lambda x, xs, w: native.w8a8(x, xs, w, w_layout=layout)


def _w8a8_scaled(rows):
    """``(x_codes, w_codes, x_scale, w_scale) -> rows(x_codes, x_scale, w_codes) * w_scale``."""
    return lambda x_codes, w_codes, x_scale, w_scale: rows(x_codes, x_scale, w_codes) * w_scale


# ----------------------------------------------------------------------------------------------
# C. w8a8: int8 activations (per-row scale) x int8 weights (per-column scale)
# ----------------------------------------------------------------------------------------------
def w8a8(x_codes, x_scale, w_codes, w_scale, *, layout="nk", block=None):
    """``(x_codes * x_scale) @ (w_codes * w_scale)`` with exact integer accumulation.

    With ``layout="nk"`` (recommended; ``w_codes`` is ``(N, K)``) this is one
    int8 × int8 → int32 GEMM with the weight as the left operand, so XLA does not
    re-pack the weight per call; batch 1 is padded to 2 rows because a 1-wide dot
    falls back to a GEMV that widens the whole weight. With ``layout="kn"``
    (``(K, N)``) the int8 GEMM re-packs the weight on every call, which still beats
    converting it (``benchmarks/w8a8_layout.py``) except at batch 1 on weights above
    4 MiB: there K blocks of 512 rows are converted to f32 and multiplied, each
    block's sum exact in f32 and the blocks added in int32, so the sums are exact as
    the GEMM's are. An explicit ``block`` forces the blocks (bf16 above batch 1:
    codes are exact in bf16, block sums added in f32; also f32 sums of blocks longer
    than 1024 rows at batch 1). With qkernels installed, on a CPU without VNNI,
    either layout's integer product from 16 rows, and one row with a ``(K, N)``
    weight, is qkernels' exact int8 kernel instead (the same integers, so the same
    result bit for bit).

    Args:
        x_codes: ``(M, K)`` int8 activation codes.
        x_scale: ``(M, 1)`` float32 scales.
        w_codes: ``(N, K)`` or ``(K, N)`` int8 weight codes.
        w_scale: ``(1, N)`` float32 scales.
        layout: ``"nk"`` or ``"kn"``.
        block: K block length for ``"kn"`` (default: the largest power of two <= 512).

    Returns:
        ``(M, N)`` float32.
    """
    m, k = x_codes.shape
    if (
        layout == "nk"
        or block is None
        and (m != 1 or k * w_codes.shape[1] <= _W8A8_KN_INT8_MAX_WEIGHT)
    ):
        rows = functools.partial(_w8a8_rows, layout=layout)
    else:
        bk = block or _pick_block(k, 512)
        rows = functools.partial(_w8a8_scan_rows, bk=bk, cdt=f32 if m == 1 else bf16)
    xla = _w8a8_scaled(rows)
    native = _native_w8a8(x_codes, w_codes, layout) if block is None else None
    return _isolated(
        _w8a8_scaled(native) if native else xla,
        x_codes,
        w_codes,
        x_scale,
        w_scale,
        n=_columns(w_codes, layout),
        xla=xla,
    )


def _w8a8_scan_rows(x_codes, x_scale, w_codes, *, bk, cdt):
    """:func:`w8a8`'s blocked ``(K, N)`` product times the row scales (not the columns').

    One row (``cdt`` float32) with blocks of at most 1024 rows sums exactly, as the
    int8 GEMM does: each block's products and sums stay within float32's integers
    (``|sum| <= 1024 * 128 * 128 = 2**24``), and the blocks are added in int32. Longer
    blocks, and bfloat16 blocks at several rows, add float32 block sums.
    """
    return _scan_k(x_codes, w_codes, cdt, bk, exact=cdt == f32 and bk <= 1024) * x_scale


def _w8a8_rows(x_codes, x_scale, w_codes, layout):
    """The int8 GEMM of :func:`w8a8` in XLA, times the row scales (not the columns')."""
    m, k = x_codes.shape
    xp = jnp.concatenate([x_codes, jnp.zeros((1, k), x_codes.dtype)], 0) if m == 1 else x_codes
    if layout == "nk":
        acc = lax.dot_general(w_codes, xp, _DN_LAST, preferred_element_type=i32)[:, :m].T
    else:
        acc = lax.dot(xp, w_codes, preferred_element_type=i32)[:m]  # (M, N)
    return acc.astype(f32) * x_scale


# ----------------------------------------------------------------------------------------------
# dispatch from qcore.dot_general
# ----------------------------------------------------------------------------------------------
def _codebook4(q) -> bool:
    """Whether a QArray holds 4-bit codebook indices (nf4) packed two per byte."""
    qt = q.qtype
    return qt.kind == "codebook" and qt.bits == 4 and len(qt.codebook or ()) == 16


def _signed_int8_codes(q) -> bool:
    qt = q.qtype
    return qt.kind == "int" and qt.signed and qt.bits <= 8 and q.packing is None


def _matrix_view(w, contracting):
    """``(codes, scale, layout, k, free_shape)`` of a weight as a 2-D matrix, or None.

    A weight whose contracted axes are its leading axes (``"kn"``) or its trailing
    axes (``"nk"``), in order, is reshaped for free. Any other unpacked weight (such
    as Gemma's fused k/v projection ``(2, d, kv_heads, head_dim)`` contracting ``d``)
    has its codes transposed to ``"nk"`` on each call: an int8 copy, a quarter of the
    bytes the general path writes when it widens the codes to int32. A weight of more
    than two axes needs one scale per output element (Flax's einsum weights:
    ``(d, heads, head_dim)``, ``(heads, head_dim, d)``).
    """
    c, nd = len(contracting), w.ndim
    free_axes = tuple(a for a in range(nd) if a not in contracting)
    if contracting == tuple(range(c)):
        layout, transpose = "kn", False
    elif contracting == tuple(range(nd - c, nd)):
        layout, transpose = "nk", False
    else:
        layout, transpose = "nk", True
    k = math.prod(w.shape[a] for a in contracting)
    free = tuple(w.shape[a] for a in free_axes)
    n, s = math.prod(free), w.scale
    if nd == 2 and not transpose:
        return w.qvalue, s, layout, k, free
    if w.packing is not None or any(s.shape[a] != 1 for a in contracting):
        return None
    if any(s.shape[a] != w.shape[a] for a in free_axes):
        return None
    codes = jnp.transpose(w.qvalue, free_axes + contracting) if transpose else w.qvalue
    shape = (k, n) if layout == "kn" else (n, k)
    scale = s.reshape((1, n) if layout == "kn" else (n, 1))
    return codes.reshape(shape), scale, layout, k, free


def fast_dot_general(lhs, rhs, dims, precision):
    """The kernel result for ``dot_general(lhs, rhs, dims)``, or None if no kernel applies.

    Applies only when traced for the CPU (the kernels are tuned for XLA:CPU; any
    other backend gets None), and when ``rhs`` is a symmetric signed-integer QArray
    (int2..int8 codes, or int4 packed along K) with one scale per output column
    (int4 packed: or per tile of K), ``lhs`` contracts its last axes with no batch
    axes, and ``lhs`` is a float array with a static (not symbolic) row count
    (weight-only) or a symmetric int8-coded QArray with one scale per row (w8a8). The
    weight may be stored (K, N) ("kn") or (N, K) ("nk", faster: see the module
    docstring); a weight with more axes qualifies with one scale per output element
    (see ``_matrix_view``). A 4-bit codebook weight (nf4) packed along K qualifies
    stored (K, N) with a static number of activation rows
    (:func:`codebook4_packed_weight_only`).
    """
    from qcore.qarray import QArray  # local: kernels is imported by qarray users

    (lc, rc), (lb, rb) = dims
    if _backend.platform() != "cpu":
        return None
    if not isinstance(rhs, QArray) or rhs.ndim < 2 or lb or rb:
        return None
    # The blocked loops carry unsharded accumulators; under explicit sharding the
    # general path lets XLA place the contraction instead.
    if numerics._split_explicitly(*jax.tree.leaves((lhs, rhs))):
        return None
    c = len(lc)
    if tuple(lc) != tuple(range(lhs.ndim - c, lhs.ndim)) or rhs.zero_point is not None:
        return None
    if rhs.tensor_scale is not None or c == rhs.ndim:
        return None
    view = _matrix_view(rhs, tuple(rc))
    if view is None:
        return None
    codes, s, layout, k, free = view
    if k == 0:  # an empty contraction: the general path gives zeros, as jnp does
        return None
    k_axis, n_axis = (0, 1) if layout == "kn" else (1, 0)
    n = math.prod(free)
    groups = s.shape[k_axis]
    if s.shape[n_axis] != n:
        return None
    scale = (s if layout == "kn" else s.T).astype(f32)  # (groups, N)
    packing = rhs.packing
    packed4 = packing is not None and rhs.qtype.name == "int4"
    prec = "highest" if precision in (None, "highest", lax.Precision.HIGHEST) else "high"
    if packing is not None and _codebook4(rhs) and not isinstance(lhs, QArray):
        # 4-bit codebooks (nf4): a (K/2, N) weight and a static number of rows only.
        m = math.prod(lhs.shape[: lhs.ndim - c])
        if not isinstance(m, int) or layout != "kn" or packing.axis % 2 != 0:
            return None
        if k % 2 or (k // groups) % 2:
            return None
        group_size = k // groups if groups > 1 else None
        y = _weight_only(
            lambda x, w, s: codebook4_packed_weight_only(
                x, w, s, rhs.qtype.codebook, group_size=group_size, precision=prec
            ),
            lhs.reshape(m, k),
            codes,
            scale,
            layout,
        )
        return y.reshape(*lhs.shape[: lhs.ndim - c], *free)
    if packing is not None:
        if not packed4 or packing.axis % 2 != k_axis or k % 2 or (k // groups) % 2:
            return None  # a byte's two codes must share a scale row
    elif not _signed_int8_codes(rhs) or groups != 1:
        return None
    lead = lhs.shape[: lhs.ndim - c]
    m = 1
    for d in lead:
        m *= d
    if not isinstance(lhs, QArray) and not isinstance(m, int):
        return None  # a symbolic batch: the weight-only kernels branch on the row count
    if isinstance(lhs, QArray):
        if packed4 or not _signed_int8_codes(lhs) or lhs.zero_point is not None:
            return None
        if lhs.tensor_scale is not None or any(d != 1 for d in lhs.scale.shape[lhs.ndim - c :]):
            return None
        x_scale = jnp.broadcast_to(lhs.scale.astype(f32), (*lead, *lhs.scale.shape[len(lead) :]))
        y = w8a8(lhs.qvalue.reshape(m, k), x_scale.reshape(m, 1), codes, scale, layout=layout)
    elif packed4:
        group_size = k // groups if groups > 1 else None
        y = _weight_only(
            lambda x, w, s: int4_packed_weight_only(
                x, w, s, group_size=group_size, layout=layout, precision=prec
            ),
            lhs.reshape(m, k),
            codes,
            scale,
            layout,
        )
    else:
        y = _weight_only(
            lambda x, w, s: int8_weight_only(x, w, s, layout=layout, precision=prec),
            lhs.reshape(m, k),
            codes,
            scale,
            layout,
        )
    return y.reshape(*lead, *free)


def _weight_only(product, x, w, w_scale, layout):
    """``product(x, w, w_scale)``, isolated (:func:`_isolated`) where it is not already.

    Batch 1 with a ``(K, N)`` weight is isolated inside the product (:func:`_batch1`).
    Every other weight-only formulation is isolated here, with its column-scale
    multiply: outside, that multiply was fused with a following ``y * c + h * d``
    differently when the scales were stored (PTQ) and when they were computed in the
    jit (QAT), so a QAT model's forward differed from its PTQ model's in the last bit.
    """
    if layout == "kn" and x.shape[0] == 1:
        return product(x, w, w_scale)
    return _isolated(product, x, w, w_scale, n=_columns(w, layout))


def _columns(w, layout):
    """N, the product's columns, of a ``(N, K)`` (``"nk"``) or ``(K, N)`` weight."""
    return w.shape[0] if layout == "nk" else w.shape[1]
