"""Quantization rules: validation, matching precedence, unused-rule reports, specs."""

import subprocess
import sys
import warnings

import pytest

from qflax import QuantizationRule, RuleMatcher


def test_importing_qflax_does_not_import_downstream_packages():
    code = (
        "import sys, qflax; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'qlitert', 'qtorchlike', 'tensorflow', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_first_match_wins_and_paths_include_indices():
    rules = [
        QuantizationRule(module_path=r"layers/0/.*", weight_qtype="int8"),
        QuantizationRule(module_path=r"layers/\d+/.*", weight_qtype="int4"),
        QuantizationRule(module_path=".*", weight_qtype="nf4"),
    ]
    m = RuleMatcher(rules)
    assert m.match("layers/0/mlp", "dot_general") is rules[0]
    assert m.match("layers/12/mlp", "einsum") is rules[1]
    assert m.match("head", "dot_general") is rules[2]
    # fullmatch: a prefix is not enough.
    assert RuleMatcher([rules[0]]).match("layers/0", "dot_general") is None
    assert RuleMatcher([rules[0]]).match("xlayers/0/mlp", "dot_general") is None


def test_op_names_filter_and_unmatched_ops_stay_float():
    convs = QuantizationRule(op_names=("conv_general_dilated",), weight_qtype="int8")
    m = RuleMatcher([convs])
    assert m.match("encoder/Conv_0", "conv_general_dilated") is convs
    assert m.match("encoder/Dense_0", "dot_general") is None
    assert QuantizationRule(op_names="einsum").op_names == ("einsum",)


def test_callable_module_path():
    rule = QuantizationRule(module_path=lambda p: p.endswith("attn"), weight_qtype="int8")
    m = RuleMatcher([rule])
    assert m.match("block/attn", "einsum") is rule
    assert m.match("block/mlp", "einsum") is None


def test_unused_rule_report_catches_a_typo():
    rules = [
        QuantizationRule(module_path="decoder/.*", weight_qtype="int8"),
        QuantizationRule(module_path="decodr/head", weight_qtype="int4"),  # typo
    ]
    m = RuleMatcher(rules)
    m.match("decoder/layer", "dot_general")
    assert m.unused_rules() == [rules[1]]
    with pytest.warns(UserWarning, match=r"module_path='decodr/head'.*matched no op"):
        m.warn_unused()
    m2 = RuleMatcher(rules[:1])
    m2.match("decoder/x", "dot")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2.warn_unused()


def test_weight_and_activation_specs():
    rule = QuantizationRule(weight_qtype="int4", act_qtype="int8", tile_size=32)
    w = rule.weight_spec(shape=(128, 64), contracting_axes=(0,))
    assert w is not None
    assert (w.channelwise_axes, w.tiled_axes, w.pack, w.pack_axis) == ((1,), ((0, 32),), True, 0)
    assert w.scale_shape((128, 64)) == (4, 64)
    # HWIO kernel: tiles along the innermost contracted axis (cin), one scale per tap
    # (this tiled every contracted axis, and a tile of 32 failed on kh=3).
    conv = rule.weight_spec(shape=(3, 3, 64, 16), contracting_axes=(0, 1, 2))
    assert conv is not None and (conv.channelwise_axes, conv.tiled_axes) == ((0, 1, 3), ((2, 32),))
    frac = QuantizationRule(weight_qtype="int8", tile_size=0.25).weight_spec((128, 64), (0,))
    assert frac is not None and frac.scale_shape((128, 64)) == (4, 64)
    explicit = QuantizationRule(weight_qtype="int8", tile_size={1: 16}).weight_spec(
        (4, 32, 8), (1,)
    )
    assert explicit is not None and explicit.tiled_axes == ((1, 16),)
    # Default: one scale per row (per token of a (batch, seq, features) input).
    a = rule.act_spec(ndim=3, contracting_axes=(2,))
    assert a is not None and a.channelwise_axes == (0, 1) and a.scale_shape((2, 5, 64)) == (2, 5, 1)
    conv_x = rule.act_spec(ndim=4, contracting_axes=(1, 2, 3))  # NHWC, all but N contracted
    assert conv_x is not None and conv_x.channelwise_axes == (0,)
    per_seq = QuantizationRule(act_qtype="int8", act_batch_axes=(0,)).act_spec(3, (2,))
    assert per_seq is not None and per_seq.scale_shape((2, 5, 64)) == (2, 1, 1)
    per_tensor = QuantizationRule(act_qtype="int8", act_batch_axes=[]).act_spec(3, (2,))
    assert per_tensor is not None and per_tensor.channelwise_axes == ()
    for bad in ("0", 0, (0.5,), (True,)):
        with pytest.raises(ValueError, match=r"act_batch_axes=.* must be None .* or a sequence"):
            QuantizationRule(act_qtype="int8", act_batch_axes=bad)
    assert QuantizationRule(weight_qtype="int8").act_spec(3) is None
    assert QuantizationRule(act_qtype="int8").weight_spec((128, 64), (0,)) is None
    int8 = QuantizationRule(weight_qtype="int8").weight_spec((128, 64), (0,))
    assert int8 is not None and not int8.pack  # only sub-byte weights are packed


def test_a_tile_that_does_not_divide_a_longer_axis_fails():
    rule = QuantizationRule(weight_qtype="int8", tile_size=48)
    with pytest.raises(ValueError, match="tile_size=48: contracted axis 0 .* has size 128"):
        rule.weight_spec((128, 64), (0,))
    short = rule.weight_spec((32, 64), (0,))  # an axis no longer than the tile: one block
    assert short is not None and short.scale_shape((32, 64)) == (1, 64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(module_path="layers/(\\d+"), r"module_path='layers/\(\\\\d\+' is not a valid regex"),
        (dict(module_path=3), r"module_path=3 must be a regex string or a callable"),
        (dict(op_names=("conv",)), r"\['conv'\] are not ops qflax intercepts; allowed:"),
        (dict(weight_qtype="int9"), r"weight_qtype: qtype='int9' is not a known"),
        (dict(act_qtype="fp9"), r"act_qtype: qtype='fp9' is not a known"),
        (
            dict(weight_calibration_method="absmx"),
            r"weight_calibration_method: calibration='absmx'",
        ),
        (dict(tile_size=0), r"tile_size=0 is invalid"),
        (dict(tile_size=1.5), r"tile_size=1.5 is invalid"),
        (dict(tile_size={0: -2}), r"tile_size=\{0: -2\} is invalid"),
        (dict(act_static_scale=True), r"act_static_scale=True needs act_qtype"),
    ],
)
def test_bad_rules_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizationRule(**kwargs)


def test_matcher_refuses_non_rules():
    with pytest.raises(ValueError, match=r"rules\[1\]=.* is not a qflax.QuantizationRule"):
        RuleMatcher([QuantizationRule(), {"module_path": ".*"}])  # type: ignore[list-item]


def test_rules_are_hashable_and_frozen():
    a = QuantizationRule(module_path="x", weight_qtype="int8", tile_size={0: 32})
    b = QuantizationRule(module_path="x", weight_qtype="int8", tile_size={0: 32})
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.weight_qtype = "int4"  # type: ignore[misc]
