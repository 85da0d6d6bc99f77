"""Independent float64 references of Brevitas' statistics rules, for the tests."""

import math

import numpy as np


def nearest_rank(x, q: float = 99.999) -> float:
    """Brevitas' ``AbsPercentile``: the k-th smallest ``|x|``, ``k = floor(q/100 * n + 1/2)``.

    Example:
        >>> nearest_rank(np.arange(1.0, 11.0), 50.0)  # k = 5
        5.0
        >>> nearest_rank(np.arange(1.0, 11.0), 99.999)  # k = floor(10.4999) = 10
        10.0
    """
    flat = np.sort(np.abs(np.asarray(x, np.float64)).ravel())
    k = min(max(math.floor(0.01 * q * flat.size + 0.5), 1), flat.size)
    return float(flat[k - 1])
