"""Native CPU kernels for qcore's quantized products, called through ``jax.ffi``.

An optional companion of ``qcore``: when this package is installed, qcore's
weight-only products (int8, int4 and nf4 with one scale per column; int4 and nf4
also with tile scales) with a ``(K, N)`` weight at batch 1 (Flax's ``nn.Dense``
layout, the shape of decoding), and its w8a8 products from 16 rows, or with one row
and a ``(K, N)`` weight, on CPUs without VNNI, run in C++ instead of XLA:CPU's code,
with the same result bit for bit (qcore's tests and ``nox -s kernels`` check it).
Nothing needs to be imported: qcore finds this package by itself. Without it, or
where it cannot run (another backend, a CPU without AVX2 and FMA runs its portable
code), qcore uses its pure-XLA formulation.

Example:
    >>> import jax.numpy as jnp
    >>> import qkernels
    >>> x = jnp.ones((1, 4), jnp.float32)
    >>> w = jnp.full((4, 3), 2, jnp.int8)
    >>> qkernels.int8_kn_batch1(x, w, 4)  # qcore multiplies by the scales after
    Array([[8., 8., 8.]], dtype=float32)
"""

from qkernels._calls import (
    codebook4_kn_batch1,
    int4_kn_batch1,
    int8_gemm,
    int8_kn_batch1,
    simd,
    vnni,
    w8a8,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "codebook4_kn_batch1",
    "int4_kn_batch1",
    "int8_gemm",
    "int8_kn_batch1",
    "simd",
    "vnni",
    "w8a8",
]
