"""Quantizer classes: MRO merge, @value injection, this, let, and the errors when they fail."""

import pytest

from qtorchlike import quant
from qtorchlike.core import BinaryQuant, ConstScaling, ParameterScaling
from qtorchlike.inject import DependencyError, ExtendedInjector, this, value
from qtorchlike.solver import QuantType, ScalingImplType, solve


class Bits(ExtendedInjector):
    bit_width = 8
    narrow_range = False

    @value
    def levels(bit_width, narrow_range):
        return 2**bit_width - narrow_range


class Narrow(ExtendedInjector):
    narrow_range = True


def test_mro_merge_value_and_this():
    class Q(Narrow, Bits):
        bit_width = 4
        copy = this.levels

    assert Q.levels == 15 and Q.copy == 15
    assert Q.let(bit_width=2).levels == 3
    assert Q.levels == 15  # let does not change the original
    assert Q.let.__name__ == "let"  # machinery stays reachable
    assert "levels" in Q.attributes()


def test_value_defaults_apply_only_when_missing():
    class Q(ExtendedInjector):
        @value
        def x(y=5):
            return y * 2

    assert Q.x == 10
    assert Q.let(y=1).x == 2


def test_unresolvable_attribute_shows_the_chain_and_suggestions():
    class Q(ExtendedInjector):
        bit_widht = 8  # typo

        @value
        def levels(bit_width):
            return 2**bit_width

    with pytest.raises(DependencyError) as err:
        _ = Q.levels
    msg = str(err.value)
    assert "Q.levels -> Q.bit_width" in msg
    assert "did you mean 'bit_widht'" in msg


def test_circular_dependency_is_reported():
    class Q(ExtendedInjector):
        a = this.b
        b = this.a

    with pytest.raises(DependencyError, match="circular dependency Q.a -> Q.b -> Q.a"):
        _ = Q.a


def test_quantizers_are_not_instantiated():
    with pytest.raises(TypeError, match="pass the class itself"):
        quant.Int8WeightPerTensorFloat()


def test_strings_and_markers_resolve_like_enums():
    class Q(ExtendedInjector):
        tensor_quant = BinaryQuant
        scaling_impl = ConstScaling
        scaling_const = 0.5
        signed = True

    spec = solve(Q)
    assert spec.quant_type is QuantType.BINARY and spec.scaling is ScalingImplType.CONST
    assert (
        solve(quant.Int8WeightPerTensorFloat.let(scaling_impl_type="Parameter_From_Stats")).scaling
        is ScalingImplType.PARAMETER_FROM_STATS
    )
    assert (
        solve(
            type(
                "P",
                (quant.Int8WeightPerTensorFloat,),
                {"scaling_impl": ParameterScaling, "scaling_impl_type": "stats"},
            )
        ).scaling
        is ScalingImplType.STATS
    )


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            {"scaling_impl_type": "magic"},
            "scaling_impl_type='magic' is not a ScalingImplType; allowed: CONST, HE, STATS",
        ),
        ({"bit_width": 0}, "bit_width=0 must be an int in \\[2, 32\\]"),
        ({"bit_width": 12}, "bit_width=12: weight and activation codes have 2-8 or 16 bits"),
        ({"scaling_stats_momentum": 2.0}, "scaling_stats_momentum=2.0 must be in \\(0, 1\\]"),
        (
            {"quant_type": "fp", "exponent_bit_width": 3, "mantissa_bit_width": 3},
            "not a supported minifloat",
        ),
    ],
)
def test_solver_rejects_bad_values(override, match):
    with pytest.raises(ValueError, match=match):
        solve(quant.Int8ActPerTensorFloat.let(**override))


def test_missing_required_attribute():
    class Q(ExtendedInjector):
        bit_width = 8

    with pytest.raises(DependencyError, match="no attribute 'scaling_impl_type'"):
        solve(Q)
    with pytest.raises(TypeError, match="subclass of qtorchlike.inject.ExtendedInjector"):
        solve(int)
