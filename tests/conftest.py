"""Fixtures shared by the repository-level tests."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits


@pytest.fixture(scope="module")
def digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's digits as NCHW float32 in [0, 1]: (train, test) of 1400 and 397 images."""
    data = load_digits()
    x = (data.images[:, None] / 16.0).astype(np.float32)  # (N, 1, 8, 8)
    y = data.target.astype(np.int32)
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])
