"""qtorchlike.functional: which ops keep a QuantTensor, and their numbers."""

import jax.numpy as jnp
import numpy as np
import pytest

import qtorchlike.functional as F
from qtorchlike import QuantTensor


def _qt(values, scale=0.5, bits=8, training=False):
    v = jnp.asarray(values, jnp.float32)
    return QuantTensor(v, jnp.array(scale), jnp.array(0.0), bits, True, training)


def test_nearest_interpolate_matches_pytorch_index_rule():
    x = _qt(np.arange(6.0).reshape(1, 1, 2, 3) * 0.5)
    out = F.interpolate(x, size=(3, 5))
    rows, cols = (np.arange(3) * 2) // 3, (np.arange(5) * 3) // 5  # floor(i * in / out)
    want = np.asarray(x.value)[:, :, rows][:, :, :, cols]
    assert isinstance(out, QuantTensor) and out.is_valid
    np.testing.assert_array_equal(np.asarray(out.value), want)
    with pytest.raises(ValueError, match="scale_factor=0 must be an int >= 1"):
        F.interpolate(x, scale_factor=0)


def test_grid_keeping_ops():
    x = _qt([[[[-1.0, 0.5], [1.5, -0.5]]]])
    for out in (
        F.relu(x),
        F.max_pool2d(x, 2),
        F.flatten(x, 1),
        F.pad(x, (1, 1)),
        F.dropout(x, 0.5, False),
    ):
        assert isinstance(out, QuantTensor) and out.is_valid
    assert not isinstance(F.pad(x, (1, 1), 1.0), QuantTensor)
    assert not isinstance(F.hardtanh(x), QuantTensor)
    np.testing.assert_array_equal(np.asarray(F.max_pool2d(x, 2).value).ravel(), [1.5])


def test_avg_pool_gives_the_sum_grid():
    x = _qt(np.arange(16.0).reshape(1, 1, 4, 4) * 0.5, bits=8)
    out = F.avg_pool2d(x, 2)
    assert float(out.scale) == pytest.approx(0.5 / 4)
    assert float(out.bit_width) == np.ceil(np.log2(255 * 4))
    assert out.is_valid  # the window sums are integers on the s/4 grid


def test_cat_rules():
    a, b = _qt([1.0]), _qt([0.25], scale=0.25)
    with pytest.raises(ValueError, match="different scale"):
        F.cat([a, b])
    with pytest.raises(ValueError, match="different bit_width"):
        F.cat([a, _qt([1.0], bits=4, training=True)])
    mixed = F.cat([_qt([1.0], training=True), _qt([0.25], scale=0.25, training=True)])
    assert float(mixed.scale) == pytest.approx(0.375)  # training: the mean scale
    assert not isinstance(F.cat([a, jnp.ones(1)]), QuantTensor)
