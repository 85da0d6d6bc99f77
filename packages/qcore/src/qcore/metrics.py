"""Error metrics between a reference array and its quantized approximation.

Both are computed in float64 with numpy, so they are an independent yardstick
for the float32 JAX arithmetic they judge.

Example:
    >>> import numpy as np
    >>> x = np.array([1.0, -2.0, 3.0, -4.0])
    >>> round(sqnr_db(x, x + 0.01), 2)
    48.75
    >>> mean_relative_error(x, x * 1.1)
    0.1
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def sqnr_db(reference: ArrayLike, approx: ArrayLike) -> float:
    """Signal-to-quantization-noise ratio ``10·log10(Σx² / Σ(x - x̂)²)`` in dB.

    Returns ``inf`` for an exact approximation.
    """
    x = np.asarray(reference, np.float64)
    noise = float(np.sum(np.square(x - np.asarray(approx, np.float64))))
    signal = float(np.sum(np.square(x)))
    if noise == 0.0:
        return float("inf")
    return 10.0 * float(np.log10(signal / noise)) if signal > 0 else float("-inf")


def mean_relative_error(reference: ArrayLike, approx: ArrayLike) -> float:
    """``mean|x - x̂| / mean|x|``, the error measure of the reference bounds."""
    x = np.asarray(reference, np.float64)
    err = float(np.mean(np.abs(x - np.asarray(approx, np.float64))))
    return err / float(np.mean(np.abs(x)))
