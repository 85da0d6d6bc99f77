"""SiteKey: the structured name of a calibration's quantization sites."""

import flax.linen as nn
import jax
import numpy as np
import pytest

import qlitert
from qlitert import SiteKey


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(4, name="proj")(x)) + x[:, :4]


def test_calibration_keys_are_site_keys_in_computation_order():
    model = Block()
    x = np.random.default_rng(0).normal(size=(2, 6)).astype(np.float32)
    params = model.init(jax.random.key(0), x)
    cal = qlitert.calibrate(lambda x: model.apply(params, x), [x])
    keys = [SiteKey.parse(k) for k in cal.ranges]
    assert [str(k) for k in keys] == list(cal.ranges)  # parse inverts str
    assert sorted(k.index for k in keys) == list(range(len(keys)))
    first = min(keys, key=lambda k: k.index)
    assert (first.label, first.name_stack, first.module_path) == ("input0", "", "")
    # The Dense output (fused with the ReLU) is quantized where the add reads it, and
    # the add's output is a site of its own; both are in the root module Block.
    labels = {k.label: k for k in keys}
    assert labels["add"].scopes == ("Block",) and labels["add"].module_path == ""


def test_parse_round_trips_name_stacks_with_separators():
    key = SiteKey(12, "dot_general.lhs", "Net/tag:a#0@b/proj")
    assert SiteKey.parse(str(key)) == key
    assert key.module_path == "tag:a#0@b/proj" and key.scopes[-1] == "proj"


@pytest.mark.parametrize("bad", ["input0@", "x:add@Net", "3:add", "3:@Net", ""])
def test_parse_refuses_what_is_not_a_site_key(bad):
    with pytest.raises(ValueError, match=r"is not a site key; allowed: '<index>:<label>@"):
        SiteKey.parse(bad)
