"""The FFI calls: registration once per process, and one jax function per kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkernels import _native  # pyright: ignore[reportAttributeAccessIssue]


@functools.cache
def _registered() -> None:
    for name, capsule in _native.handlers().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")


def simd() -> bool:
    """Whether this CPU runs the kernels' AVX2 + FMA code (else their portable code).

    Returns:
        True on an x86-64 CPU with AVX2 and FMA.
    """
    return bool(_native.simd())


def _check(x, w, bk, w_dtype, codes_per_byte: int) -> None:
    """Raises ValueError naming the argument, its value and what is allowed."""
    if jnp.dtype(w.dtype) != jnp.dtype(w_dtype) or jnp.ndim(w) != 2:
        raise ValueError(
            f"w: {jnp.dtype(w.dtype)} array of shape {tuple(jnp.shape(w))}; allowed: a 2-D "
            f"{jnp.dtype(w_dtype)} array"
        )
    rows, _ = w.shape
    k = rows * codes_per_byte
    if tuple(jnp.shape(x)) != (1, k):
        raise ValueError(f"x: shape {tuple(jnp.shape(x))}; allowed: (1, {k}) for w {w.shape}")
    if isinstance(bk, bool) or not isinstance(bk, int | np.integer) or bk < 1 or rows % bk:
        raise ValueError(f"bk={bk!r}; allowed: a positive int dividing w's {rows} rows")


def _group_scales(scales, w, bk: int):
    """``scales`` as float32 after checking it is ``(G, N)`` with G dividing the partial rows.

    Raises ValueError naming the argument, its value and what is allowed.
    """
    rows, n = w.shape
    partial = rows // bk
    try:
        scales = jnp.asarray(scales)
    except (TypeError, ValueError) as e:
        raise ValueError(f"scales: {scales!r}; allowed: a (G, {n}) float array") from e
    shape = tuple(scales.shape)
    if not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(f"scales: {scales.dtype}; allowed: a floating dtype")
    if len(shape) != 2 or shape[1] != n or shape[0] < 1 or partial % shape[0]:
        raise ValueError(
            f"scales: shape {shape}; allowed: (G, {n}) with G dividing the {partial} "
            f"partial rows (w's {rows} rows / bk={bk})"
        )
    return scales.astype(jnp.float32)


def _varying(*arrays) -> set[str]:
    """The ``shard_map`` mesh axes any of ``arrays`` varies over (none outside it)."""
    return set().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))


def _ffi(target: str, shape, dtype, *operands, **attrs):
    """The kernel ``target``'s result, typed as varying where its operands vary.

    Inside ``jax.shard_map`` a foreign call's result is typed as the same on every
    device, whatever its operands; this one is computed from them, so it varies over
    every mesh axis any of them varies over (else ``shard_map`` raised on a scan or
    conditional around it, or could have taken one device's result for all).
    """
    _registered()
    out = jax.ShapeDtypeStruct(shape, dtype)
    y = jax.ffi.ffi_call(target, out, vmap_method="sequential")(*operands, **attrs)
    axes = _varying(*operands) - _varying(y)
    return lax.pcast(y, tuple(sorted(axes)), to="varying") if axes else y


def _call(target: str, x, w, bk: int, *extra):
    return _ffi(
        target, (1, w.shape[1]), jnp.float32, x.astype(jnp.float32), w, *extra, bk=np.int64(bk)
    )


# Why the kernels leave per-column scales to the caller: XLA fuses a scale multiply
# with an add that follows it (a layer's bias, a residual) into one fused
# multiply-add. A kernel that multiplied by the scale itself would round that product
# first, and the model's outputs would differ from qcore's XLA path in the last bit.
# Group scales are different: on qcore's path each code is multiplied by its scale,
# rounded, before it enters the sums, so the kernels apply those.


def int8_kn_batch1(x, w, bk: int):
    """``x @ w`` for one activation row and int8 codes stored ``(K, N)``, unscaled.

    The value of qcore's pure-XLA formulation (``qcore.ops.kernels``) before its
    per-column scale, bit for bit: partial rows of ``bk`` weight rows each, summed by
    a pairwise tree. The caller multiplies by the scales (in XLA, as qcore does).

    Args:
        x: ``(1, K)`` float32 activations.
        w: ``(K, N)`` int8 codes.
        bk: Weight rows per partial row (divides K).

    Returns:
        ``(1, N)`` float32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.
    """
    _check(x, w, bk, jnp.int8, 1)
    return _call("qkernels_int8_kn_batch1", x, w, bk)


def int4_kn_batch1(x, w, bk: int, *, scales=None):
    """``x @ codes`` for one activation row and int4 codes packed along K.

    ``w`` is ``(K/2, N)`` uint8, byte row ``i`` holding K rows ``2i`` (low nibble) and
    ``2i + 1`` (high nibble), qcore's packing. The value of qcore's pure-XLA
    formulation, bit for bit: unscaled (qcore multiplies by per-column scales after),
    or with group scales, each code multiplied by its scale before it is summed.

    Args:
        x: ``(1, K)`` float32 activations.
        w: ``(K/2, N)`` packed codes.
        bk: Packed rows per partial row (divides K/2).
        scales: None, or ``(G, N)`` group scales (tiles of ``K / G`` weight rows; G
            divides the ``K / 2 / bk`` partial rows).

    Returns:
        ``(1, N)`` float32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.
    """
    _check(x, w, bk, jnp.uint8, 2)
    if scales is None:
        return _call("qkernels_int4_kn_batch1", x, w, bk)
    return _call("qkernels_int4_kn_batch1_groups", x, w, bk, _group_scales(scales, w, bk))


def codebook4_kn_batch1(x, w, bk: int, levels, *, scales=None):
    """``x @ levels[codes]`` for one activation row, 4-bit codebook codes (nf4).

    ``w`` is packed as for :func:`int4_kn_batch1`, each nibble an index into the 16
    ``levels``. The value of qcore's pure-XLA formulation, bit for bit: unscaled, or
    with group scales as for :func:`int4_kn_batch1`.

    Args:
        x: ``(1, K)`` float32 activations.
        w: ``(K/2, N)`` packed level indices.
        bk: Packed rows per partial row (divides K/2).
        levels: The 16 levels (a sequence of floats or a ``(16,)`` array).
        scales: None, or ``(G, N)`` group scales (see :func:`int4_kn_batch1`).

    Returns:
        ``(1, N)`` float32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.
    """
    _check(x, w, bk, jnp.uint8, 2)
    table = jnp.asarray(levels, jnp.float32)
    if table.shape != (16,):
        raise ValueError(f"levels: shape {table.shape}; allowed: 16 levels")
    if scales is None:
        return _call("qkernels_codebook4_kn_batch1", x, w, bk, table)
    scales = _group_scales(scales, w, bk)
    return _call("qkernels_codebook4_kn_batch1_groups", x, w, bk, table, scales)


def vnni() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX-VNNI or AVX-512 VNNI).

    XLA's own int8 GEMM uses them; :func:`int8_gemm` does not, so qcore calls it only
    on CPUs without them.

    Returns:
        True on an x86-64 CPU with AVX-VNNI or AVX-512 VNNI.
    """
    return bool(_native.vnni())


def _check_gemm(x, w, w_layout: str) -> tuple[int, int]:
    """``(M, N)`` of an int8 GEMM's operands; raises ValueError as :func:`_check` does."""
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"w_layout={w_layout!r}; allowed: 'kn' or 'nk'")
    for name, a in (("x", x), ("w", w)):
        if jnp.dtype(a.dtype) != jnp.int8 or jnp.ndim(a) != 2:
            raise ValueError(
                f"{name}: {jnp.dtype(a.dtype)} array of shape {tuple(jnp.shape(a))}; "
                "allowed: a 2-D int8 array"
            )
    m, k = x.shape
    kw, n = w.shape if w_layout == "kn" else w.shape[::-1]
    if kw != k:
        raise ValueError(
            f"w: shape {tuple(w.shape)} ({w_layout}); allowed: {k} rows of K for x {x.shape}"
        )
    return m, n


def int8_gemm(x, w, *, w_layout: str = "kn"):
    """``x @ w`` for int8 codes, accumulated exactly in int32.

    Integer sums are exact in any order, so this equals XLA's
    ``lax.dot(x, w, preferred_element_type=jnp.int32)`` bit for bit. On a CPU with
    AVX2 it multiplies 32 code pairs per instruction; XLA's own int8 GEMM is faster
    on CPUs with VNNI (:func:`vnni`).

    Args:
        x: ``(M, K)`` int8 activation codes.
        w: int8 weight codes, ``(K, N)`` with ``w_layout="kn"`` or ``(N, K)`` with
            ``"nk"``.
        w_layout: ``"kn"`` or ``"nk"``.

    Returns:
        ``(M, N)`` int32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.

    Example:
        >>> import jax.numpy as jnp
        >>> import qkernels
        >>> x = jnp.array([[1, -2, 3]], jnp.int8)
        >>> qkernels.int8_gemm(x, jnp.full((3, 2), 127, jnp.int8))
        Array([[254, 254]], dtype=int32)
    """
    m, n = _check_gemm(x, w, w_layout)
    return _ffi("qkernels_int8_gemm", (m, n), jnp.int32, x, w, w_nk=np.int64(w_layout == "nk"))


def w8a8(x, x_scale, w, *, w_layout: str = "kn"):
    """``float32(x @ w) * x_scale`` for int8 codes, without an int32 temporary.

    The exact int32 sums of :func:`int8_gemm`, each converted to float32 and
    multiplied by its row's scale: qcore's w8a8 expression up to its last multiply,
    by the column scales, which the caller does in XLA (as qcore does), so that the
    result equals qcore's pure-XLA path bit for bit.

    Args:
        x: ``(M, K)`` int8 activation codes.
        x_scale: ``(M, 1)`` float32 scales, one per row of ``x``.
        w: int8 weight codes, ``(K, N)`` (``w_layout="kn"``) or ``(N, K)`` (``"nk"``).
        w_layout: ``"kn"`` or ``"nk"``.

    Returns:
        ``(M, N)`` float32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.

    Example:
        >>> import jax.numpy as jnp
        >>> import qkernels
        >>> x = jnp.array([[1, -2, 3]], jnp.int8)
        >>> w = jnp.full((3, 2), 127, jnp.int8)
        >>> qkernels.w8a8(x, jnp.array([[0.5]]), w)
        Array([[127., 127.]], dtype=float32)
    """
    m, n = _check_gemm(x, w, w_layout)
    if tuple(jnp.shape(x_scale)) != (m, 1):
        raise ValueError(f"x_scale: shape {tuple(jnp.shape(x_scale))}; allowed: {(m, 1)}")
    x_scale = jnp.asarray(x_scale, jnp.float32)
    return _ffi(
        "qkernels_w8a8", (m, n), jnp.float32, x, x_scale, w, w_nk=np.int64(w_layout == "nk")
    )
