"""The FFI calls: registration once per process, and one jax function per kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

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


def _check(x, w, scale, bk, w_dtype, codes_per_byte: int) -> None:
    """Raises ValueError naming the argument, its value and what is allowed."""
    if jnp.dtype(w.dtype) != jnp.dtype(w_dtype) or jnp.ndim(w) != 2:
        raise ValueError(
            f"w: {jnp.dtype(w.dtype)} array of shape {tuple(jnp.shape(w))}; allowed: a 2-D "
            f"{jnp.dtype(w_dtype)} array"
        )
    rows, n = w.shape
    k = rows * codes_per_byte
    if tuple(jnp.shape(x)) != (1, k):
        raise ValueError(f"x: shape {tuple(jnp.shape(x))}; allowed: (1, {k}) for w {w.shape}")
    if tuple(jnp.shape(scale)) != (1, n):
        raise ValueError(f"scale: shape {tuple(jnp.shape(scale))}; allowed: (1, {n})")
    if isinstance(bk, bool) or not isinstance(bk, int | np.integer) or bk < 1 or rows % bk:
        raise ValueError(f"bk={bk!r}; allowed: a positive int dividing w's {rows} rows")


def _call(target: str, x, w, scale, bk: int, *extra):
    _registered()
    n = w.shape[1]
    out = jax.ShapeDtypeStruct((1, n), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        x.astype(jnp.float32), w, scale.astype(jnp.float32), *extra, bk=np.int64(bk)
    )


def int8_kn_batch1(x, w, scale, bk: int):
    """``x @ (w * scale)`` for one activation row and int8 codes stored ``(K, N)``.

    The value of qcore's pure-XLA formulation (``qcore.ops.kernels``), bit for bit:
    partial rows of ``bk`` weight rows each, summed by a pairwise tree, times the
    per-column scale.

    Args:
        x: ``(1, K)`` float32 activations.
        w: ``(K, N)`` int8 codes.
        scale: ``(1, N)`` float32 per-column scales.
        bk: Weight rows per partial row (divides K).

    Returns:
        ``(1, N)`` float32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.
    """
    _check(x, w, scale, bk, jnp.int8, 1)
    return _call("qkernels_int8_kn_batch1", x, w, scale, bk)


def int4_kn_batch1(x, w, scale, bk: int):
    """``x @ (codes * scale)`` for one activation row and int4 codes packed along K.

    ``w`` is ``(K/2, N)`` uint8, byte row ``i`` holding K rows ``2i`` (low nibble) and
    ``2i + 1`` (high nibble), qcore's packing; ``scale`` is ``(1, N)``, one per
    column (qcore keeps group scales on its XLA path). The value of qcore's pure-XLA
    formulation, bit for bit.

    Args:
        x: ``(1, K)`` float32 activations.
        w: ``(K/2, N)`` packed codes.
        scale: ``(1, N)`` float32 scales.
        bk: Packed rows per partial row (divides K/2).

    Returns:
        ``(1, N)`` float32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.
    """
    _check(x, w, scale, bk, jnp.uint8, 2)
    return _call("qkernels_int4_kn_batch1", x, w, scale, bk)


def codebook4_kn_batch1(x, w, scale, bk: int, levels):
    """``x @ (levels[codes] * scale)`` for one activation row, 4-bit codebook codes (nf4).

    ``w`` is packed as for :func:`int4_kn_batch1`, each nibble an index into the 16
    ``levels``. The value of qcore's pure-XLA formulation, bit for bit.

    Args:
        x: ``(1, K)`` float32 activations.
        w: ``(K/2, N)`` packed level indices.
        scale: ``(1, N)`` float32 scales.
        bk: Packed rows per partial row (divides K/2).
        levels: The 16 levels (a sequence of floats or a ``(16,)`` array).

    Returns:
        ``(1, N)`` float32.

    Raises:
        ValueError: If an argument's dtype, shape or value is not the one allowed.
    """
    _check(x, w, scale, bk, jnp.uint8, 2)
    table = jnp.asarray(levels, jnp.float32)
    if table.shape != (16,):
        raise ValueError(f"levels: shape {table.shape}; allowed: 16 levels")
    return _call("qkernels_codebook4_kn_batch1", x, w, scale, bk, table)
