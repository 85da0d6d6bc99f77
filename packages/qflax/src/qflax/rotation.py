"""Random Hadamard rotation of a contraction axis (QuaRot-style incoherence processing).

A contraction ``sum_k x_k w_k`` is unchanged when both operands are rotated by
one orthogonal matrix ``R`` along the contracted axis: ``(x R) (R^T w) = x w``.
With ``R = D B`` (``D`` a diagonal of random signs, ``B`` a normalised Hadamard
matrix), a few large channels (outliers) are spread evenly over all channels,
so both operands become much easier to quantize with one scale per row/column
(Ashkboos et al., 2024, "QuaRot"; Chee et al., 2023, "QuIP").

For a contraction size ``K`` that is not a power of two, ``B`` is block
diagonal: ``K / b`` copies of the Sylvester Hadamard matrix ``H_b / sqrt(b)``,
with ``b`` the largest power of two dividing ``K`` (:func:`block_size`; e.g.
``K = 384`` uses blocks of 128, ``K = 96`` blocks of 32). Outliers are then
spread within their block only; an odd ``K`` gets ``b = 1`` (signs only, no
mixing). The signs come from ``numpy.random.default_rng(seed)`` and depend only
on ``(seed, K)``.

Both operands are rotated the same way (``x' = x R`` along the contracting axis
of each, since ``R^T w`` contracts ``w``'s axis with ``R``'s first index too), by
a fast Walsh-Hadamard transform: ``log2(b)`` butterfly stages of reshapes and
adds, ``O(K log b)`` per row; no ``K x K`` matrix is built.

In qflax a rule turns it on with ``QuantizationRule(..., rotation="hadamard",
rotation_seed=0)``: :class:`~qflax.PtqProvider` stores the weight rotated (its
recipe records the :class:`Hadamard`) and rotates the other operand per call;
:class:`~qflax.QtProvider` rotates both operands before fake quantization.

Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> from qflax.rotation import block_size, matrix, rotate
    >>> block_size(96), block_size(64), block_size(7)
    (32, 64, 1)
    >>> r = matrix(12, seed=0)  # blocks of 4
    >>> bool(np.allclose(r @ r.T, np.eye(12)))
    True
    >>> x = jnp.arange(24.0).reshape(2, 12)
    >>> bool(np.allclose(rotate(x, axis=1, seed=0), np.asarray(x) @ r, atol=1e-5))
    True
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Hadamard:
    """A random-sign block Hadamard rotation of one axis (static, hashable).

    Attributes:
        seed: Seed of the random signs.
        axis: The rotated (contracting) axis of the weight, in its compute layout.
    """

    seed: int
    axis: int


def block_size(k: int) -> int:
    """The Hadamard block size for a contraction of size ``k``: its largest power-of-two divisor.

    Raises:
        ValueError: If ``k`` is not a positive int.
    """
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"contraction size k={k!r} must be a positive int")
    return int(k) & -int(k)


def signs(k: int, seed: int) -> np.ndarray:
    """The ``k`` random signs (float64, ±1) of the rotation for ``seed``."""
    return np.random.default_rng(seed).integers(0, 2, size=k).astype(np.float64) * 2.0 - 1.0


def matrix(k: int, seed: int) -> np.ndarray:
    """The rotation ``R = D B`` as a float64 ``(k, k)`` matrix (for tests and reference).

    ``B`` is block diagonal with blocks ``H_b / sqrt(b)``, ``H_b`` the Sylvester
    Hadamard matrix; ``R`` is orthogonal.
    """
    b = block_size(k)
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return signs(k, seed)[:, None] * np.kron(np.eye(k // b), h / math.sqrt(b))


def rotate(x: jax.Array, axis: int, seed: int, *, inverse: bool = False) -> jax.Array:
    """``x R`` along ``axis`` (``x R^T`` with ``inverse=True``), by a fast Walsh-Hadamard transform.

    Computed in float32 (float64 stays float64); the result has ``x``'s dtype.

    Args:
        x: The array (an activation or a weight in its compute layout).
        axis: The contracted axis to rotate.
        seed: Seed of the random signs.
        inverse: Apply ``R^T = B D`` instead of ``R = D B``.
    """
    dtype = x.dtype
    work = jnp.float64 if dtype == jnp.float64 else jnp.float32
    v = jnp.moveaxis(jnp.asarray(x).astype(work), axis, -1)
    k = v.shape[-1]
    b = block_size(k)
    d = jnp.asarray(signs(k, seed), work).reshape((1,) * (v.ndim - 1) + (k,))
    if not inverse:
        v = v * d
    lead = v.shape[:-1]
    h = 1
    while h < b:
        u = v.reshape(*lead, k // (2 * h), 2, h)
        v = jnp.stack([u[..., 0, :] + u[..., 1, :], u[..., 0, :] - u[..., 1, :]], axis=-2)
        v = v.reshape(*lead, k)
        h *= 2
    v = v * jnp.asarray(1.0 / math.sqrt(b), work)
    if inverse:
        v = v * d
    return jnp.moveaxis(v, -1, axis).astype(dtype)
