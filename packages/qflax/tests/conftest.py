"""Strict dtype promotion and rank checks in every qflax test; the older algorithm form is quiet."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _strict_jax():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


def pytest_configure(config):
    # Most algorithm tests predate qflax.CalibrationData and call the older form
    # (model, params, [rules,] batches) unchanged, which warns; test_calibration_data
    # checks that warning and that both forms give the same result.
    config.addinivalue_line(
        "filterwarnings", "ignore:.*deprecated; pass one qflax.CalibrationData:DeprecationWarning"
    )
