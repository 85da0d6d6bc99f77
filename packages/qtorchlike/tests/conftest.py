"""Strict dtype promotion and rank checks in every qtorchlike test (library code never does)."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _strict_jax():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield
