"""Test configuration: strict dtype promotion and rank checks for every test.

Library code never flips these switches; tests do, so any implicit promotion
(int8 + float32, rank broadcasting) inside qcore fails loudly here.
"""

import jax
import pytest
from hypothesis import settings

settings.register_profile("qcore", max_examples=40, deadline=None, derandomize=True, database=None)
settings.load_profile("qcore")


@pytest.fixture(autouse=True)
def _strict_jax():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield
