"""Shared helpers of qort's tests."""

from __future__ import annotations

import numpy as np


def assert_close_to(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    """``got`` within ``rtol`` of the largest magnitude of ``want``, elementwise."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    tol = rtol * max(float(np.max(np.abs(want))), 1e-30)
    assert float(np.max(np.abs(got - want))) <= tol, float(np.max(np.abs(got - want)))
