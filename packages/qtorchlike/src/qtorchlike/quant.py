"""The quantizer catalogue, with Brevitas' names and defaults (brevitas 0.13).

Quantizers are built from mixins, so a new one is usually a one-line class:
``class MyQuant(Int8WeightPerChannelFloat): bit_width = 4``. Numbers follow
Brevitas: the scale is the threshold divided by 127 for narrow int8 (weights),
128 for int8 activations, 255 for uint8; activations take the 99.999th
percentile of ``|x|`` for 300 training steps (momentum 0.1) and then learn it.

Differences from Brevitas, on purpose:

* ``Int4WeightPerChannelFloat`` and ``Int8WeightPerChannelFloatLSQ`` (learned
  per-channel scale initialised from ``max|w|``) are additions; Brevitas users
  write ``weight_bit_width=4`` and ``weight_scaling_impl_type="parameter_from_stats"``.
* The fp8 e4m3 quantizers use the OCP format (largest value 448), like Brevitas'
  ``Fp8e4m3OCP*``; Brevitas' plain ``Fp8e4m3*`` (largest value 480) has no
  counterpart in ``ml_dtypes``.
* Percentiles interpolate linearly between order statistics (qcore's
  calibrator) where Brevitas takes the nearest one.

Example:
    >>> from qtorchlike.quant import Int8ActPerTensorFloat
    >>> Int8ActPerTensorFloat.bit_width, Int8ActPerTensorFloat.collect_stats_steps
    (8, 300)
"""

from __future__ import annotations

from typing import Any

from qtorchlike import core
from qtorchlike.inject import ExtendedInjector, value
from qtorchlike.solver import (
    FloatToIntImplType,
    QuantType,
    RestrictValueType,
    ScalingImplType,
    ScalingPerOutputType,
    StatsOp,
)

# -- mixins (Brevitas' brevitas.quant.base) ---------------------------------------------


class IntQuant(ExtendedInjector):
    """Signed integer codes, full range, round to nearest."""

    quant_type = QuantType.INT
    float_to_int_impl_type = FloatToIntImplType.ROUND
    narrow_range = False
    signed = True


class NarrowIntQuant(IntQuant):
    """Signed integer codes without the most negative one (``[-127, 127]``)."""

    narrow_range = True


class UintQuant(IntQuant):
    """Unsigned integer codes."""

    signed = False


class MaxStatsScaling(ExtendedInjector):
    """Threshold = ``max|x|``, recomputed on every call."""

    scaling_impl_type = ScalingImplType.STATS
    scaling_stats_op = StatsOp.MAX


class ParamFromRuntimePercentileScaling(ExtendedInjector):
    """99.999th percentile for 300 training steps (momentum 0.1), then learned."""

    scaling_impl_type = ScalingImplType.PARAMETER_FROM_STATS
    scaling_stats_op = StatsOp.PERCENTILE
    high_percentile_q = 99.999
    collect_stats_steps = 300
    scaling_stats_momentum = 0.1


class ParamMinMaxInitScaling(ExtendedInjector):
    """A learned threshold starting at ``max(|min_val|, |max_val|)``."""

    scaling_impl_type = ScalingImplType.PARAMETER

    @value
    def scaling_init(min_val: Any, max_val: Any) -> float:
        """The larger bound's magnitude (injected by name from ``min_val``, ``max_val``)."""
        return max(abs(float(min_val)), abs(float(max_val)))


class PerTensorFloatScaling8bit(ExtendedInjector):
    """One float scale per tensor, 8 bits."""

    scaling_per_output_type = ScalingPerOutputType.TENSOR
    restrict_scaling_type = RestrictValueType.FP
    bit_width = 8


class PerChannelFloatScaling8bit(PerTensorFloatScaling8bit):
    """One float scale per output channel, 8 bits."""

    scaling_per_output_type = ScalingPerOutputType.CHANNEL


class PerTensorPoTScaling8bit(PerTensorFloatScaling8bit):
    """One power-of-two scale per tensor (rounded up), 8 bits."""

    restrict_scaling_type = RestrictValueType.POWER_OF_TWO
    restrict_value_float_to_int_impl = "ceil"  # Brevitas' CeilSte: never clip the max


class PerChannelPoTScaling8bit(PerChannelFloatScaling8bit):
    """One power-of-two scale per output channel (rounded up), 8 bits."""

    restrict_scaling_type = RestrictValueType.POWER_OF_TWO
    restrict_value_float_to_int_impl = "ceil"  # Brevitas' CeilSte: never clip the max


# -- weights ----------------------------------------------------------------------------


class Int8WeightPerTensorFloat(NarrowIntQuant, MaxStatsScaling, PerTensorFloatScaling8bit):
    """int8 weights in ``[-127, 127]``, scale ``max|w| / 127`` per tensor."""


class Int8WeightPerChannelFloat(NarrowIntQuant, MaxStatsScaling, PerChannelFloatScaling8bit):
    """int8 weights, scale ``max|w_c| / 127`` per output channel."""


class Int4WeightPerChannelFloat(Int8WeightPerChannelFloat):
    """int4 weights in ``[-7, 7]``, scale ``max|w_c| / 7`` per output channel."""

    bit_width = 4


class Int8WeightPerChannelFloatLSQ(Int8WeightPerChannelFloat):
    """Learned per-channel int8 scales (LSQ), initialised from ``max|w_c|``.

    Re-initialised from new weights on ``load_state_dict`` when the checkpoint
    has no scale (see :data:`qtorchlike.config.REINIT_ON_STATE_DICT_LOAD`).
    """

    scaling_impl_type = ScalingImplType.PARAMETER_FROM_STATS


class Int4WeightPerGroupFloat(Int8WeightPerChannelFloat):
    """int4 weights with one scale per output channel and group of 32 inputs."""

    bit_width = 4
    scaling_per_output_type = ScalingPerOutputType.GROUP
    group_size = 32


class Int8WeightPerTensorFixedPoint(NarrowIntQuant, MaxStatsScaling, PerTensorPoTScaling8bit):
    """int8 weights with a power-of-two scale ``2^ceil(log2 max|w|) / 128``."""


class Int8WeightPerChannelFixedPoint(NarrowIntQuant, MaxStatsScaling, PerChannelPoTScaling8bit):
    """int8 weights with a power-of-two scale per output channel."""


class SignedBinaryWeightPerTensorConst(ExtendedInjector):
    """Binary weights ``sign(w) * 0.1``."""

    quant_type = QuantType.BINARY
    signed = True
    scaling_impl_type = ScalingImplType.CONST
    scaling_const = 0.1
    scaling_per_output_type = ScalingPerOutputType.TENSOR
    restrict_scaling_type = RestrictValueType.FP


class SignedTernaryWeightPerTensorConst(NarrowIntQuant):
    """Ternary weights ``{-1, 0, 1} * 0.1`` (a 2-bit narrow integer, as in Brevitas)."""

    bit_width = 2
    scaling_impl_type = ScalingImplType.CONST
    scaling_const = 0.1
    scaling_per_output_type = ScalingPerOutputType.TENSOR
    restrict_scaling_type = RestrictValueType.FP


class _Fp8(ExtendedInjector):
    quant_type = QuantType.FP
    bit_width = 8
    scaling_per_output_type = ScalingPerOutputType.TENSOR
    restrict_scaling_type = RestrictValueType.FP


class Fp8e4m3WeightPerTensorFloat(_Fp8, MaxStatsScaling):
    """OCP fp8 e4m3 weights, scale ``max|w| / 448``."""

    exponent_bit_width = 4
    mantissa_bit_width = 3


class Fp8e5m2WeightPerTensorFloat(_Fp8, MaxStatsScaling):
    """OCP fp8 e5m2 weights, scale ``max|w| / 57344``."""

    exponent_bit_width = 5
    mantissa_bit_width = 2


# -- activations ------------------------------------------------------------------------


class Int8ActPerTensorFloat(IntQuant, ParamFromRuntimePercentileScaling, PerTensorFloatScaling8bit):
    """int8 activations in ``[-128, 127]``, scale ``p99.999(|x|) / 128``, then learned."""


class Uint8ActPerTensorFloat(
    UintQuant, ParamFromRuntimePercentileScaling, PerTensorFloatScaling8bit
):
    """uint8 activations in ``[0, 255]``, scale ``p99.999(x) / 255``, then learned."""


class Int8ActPerTensorFloatMinMaxInit(IntQuant, ParamMinMaxInitScaling, PerTensorFloatScaling8bit):
    """int8 activations with a learned scale starting at ``max(|min_val|, |max_val|) / 128``.

    Needs ``min_val`` and ``max_val`` (QuantHardTanh passes them).
    """


class Uint8ActPerTensorFloatMaxInit(UintQuant, ParamMinMaxInitScaling, PerTensorFloatScaling8bit):
    """uint8 activations with a learned scale starting at ``max_val / 255``."""

    min_val = 0.0


class Int8ActPerTensorFixedPoint(
    IntQuant, ParamFromRuntimePercentileScaling, PerTensorPoTScaling8bit
):
    """int8 activations with a learned power-of-two scale (log2 domain)."""


class Uint8ActPerTensorFixedPoint(
    UintQuant, ParamFromRuntimePercentileScaling, PerTensorPoTScaling8bit
):
    """uint8 activations with a learned power-of-two scale (log2 domain)."""


class SignedBinaryActPerTensorConst(SignedBinaryWeightPerTensorConst):
    """Binary activations ``sign(x) * 1``."""

    scaling_const = 1.0


class SignedTernaryActPerTensorConst(SignedTernaryWeightPerTensorConst):
    """Ternary activations ``{-1, 0, 1}``."""

    scaling_const = 1.0


class Fp8e4m3ActPerTensorFloat(_Fp8):
    """OCP fp8 e4m3 activations, ``max|x|`` for 300 steps, then learned."""

    exponent_bit_width = 4
    mantissa_bit_width = 3
    scaling_impl_type = ScalingImplType.PARAMETER_FROM_STATS
    scaling_stats_op = StatsOp.MAX
    collect_stats_steps = 300
    scaling_stats_momentum = 0.1


class Fp8e5m2ActPerTensorFloat(Fp8e4m3ActPerTensorFloat):
    """OCP fp8 e5m2 activations."""

    exponent_bit_width = 5
    mantissa_bit_width = 2


# -- shifted (zero-point) and MSE quantizers (Brevitas' quant/shifted_scaled_int.py) -------


class ShiftedMinUintQuant(UintQuant):
    """Unsigned codes with an integer zero point from the weight's minimum, every call.

    ``zero_point = clamp(round(-min(min(w), 0) / scale), 0, 2^bits - 1)``.
    """

    quantize_zero_point = True
    zero_point_impl = core.StatsFromParameterZeroPoint
    zero_point_stats_impl = core.NegativeMinOrZero


class ShiftedParamFromPercentileUintQuant(UintQuant):
    """Unsigned codes with a learned integer zero point from a low runtime percentile.

    The statistic ``min(x_(k), 0)``, ``k = ceil(low_percentile_q/100 * n)``, is
    collected like the scale (``collect_stats_steps``, momentum 0.1), then learned.
    """

    quantize_zero_point = True
    zero_point_impl = core.ParameterFromRuntimeZeroPoint
    zero_point_stats_impl = core.NegativePercentileOrZero
    low_percentile_q = 0.001


class MinMaxStatsScaling(ExtendedInjector):
    """Threshold = ``|max(x) - min(min(x), 0)|``, recomputed on every call."""

    scaling_impl_type = ScalingImplType.STATS
    scaling_stats_op = StatsOp.MIN_MAX


class ParamFromRuntimePercentileIntervalScaling(ExtendedInjector):
    """``|p99.999(x) - min(p0.001(x), 0)|`` for 300 training steps, then learned."""

    scaling_impl_type = ScalingImplType.PARAMETER_FROM_STATS
    scaling_stats_op = StatsOp.PERCENTILE_INTERVAL
    high_percentile_q = 99.999
    low_percentile_q = 0.001
    collect_stats_steps = 300
    scaling_stats_momentum = 0.1


class MSESymmetricScale(ExtendedInjector):
    """A learned threshold initialised by Brevitas' MSE grid search from ``max|x|``.

    20 candidates ``max|x| * (1/20 + 19/20 * t)``, ``t`` in ``{0, 1/19, ..., 1}``;
    the first with the least sum of squared quantization errors wins. Weights
    search once (at construction and on ``load_state_dict``), activations on each
    of their ``collect_stats_steps`` training batches.
    """

    scaling_impl_type = ScalingImplType.PARAMETER_FROM_STATS
    scaling_stats_impl = core.MSE
    mse_init_op = core.AbsMax
    mse_iters = 20
    mse_search_method = "grid"


class MSEAsymmetricScale(MSESymmetricScale):
    """The MSE search from ``|max(x) - min(min(x), 0)|`` (for shifted quantizers)."""

    mse_init_op = core.AbsMinMax


class MSEWeightZeroPoint(ExtendedInjector):
    """A learned weight zero point from an MSE search, at the searched scale.

    The candidates run from ``min(min(w), 0)`` to a twentieth of it.
    """

    zero_point_impl = core.ParameterFromStatsFromParameterZeroPoint
    zero_point_stats_impl = core.MSE


class MSEActZeroPoint(ExtendedInjector):
    """An activation zero point searched (MSE) on each collecting batch, then learned."""

    zero_point_impl = core.ParameterFromRuntimeZeroPoint
    zero_point_stats_impl = core.MSE


class ShiftedUint8WeightPerTensorFloat(
    ShiftedMinUintQuant, MinMaxStatsScaling, PerTensorFloatScaling8bit
):
    """uint8 weights, scale ``(max(w) - min(min(w), 0)) / 255``, zero point from ``min(w)``."""


class ShiftedUint8WeightPerChannelFloat(
    ShiftedMinUintQuant, MinMaxStatsScaling, PerChannelFloatScaling8bit
):
    """uint8 weights with a scale and a zero point per output channel."""


class ShiftedUint8ActPerTensorFloat(
    ShiftedParamFromPercentileUintQuant,
    ParamFromRuntimePercentileIntervalScaling,
    PerTensorFloatScaling8bit,
):
    """uint8 activations with a zero point: scale ``(p99.999 - min(p0.001, 0)) / 255``."""


class ShiftedUint8ActPerTensorFixedPoint(
    ShiftedParamFromPercentileUintQuant,
    ParamFromRuntimePercentileIntervalScaling,
    PerTensorPoTScaling8bit,
):
    """uint8 activations with a zero point and a learned power-of-two scale."""


class Int8WeightPerTensorFloatMSE(MSESymmetricScale, Int8WeightPerTensorFloat):
    """int8 weights, a learned per-tensor scale initialised by the MSE search."""


class Int8WeightPerChannelFloatMSE(MSESymmetricScale, Int8WeightPerChannelFloat):
    """int8 weights, learned per-channel scales initialised by the MSE search."""


class Int8ActPerTensorFloatMSE(MSESymmetricScale, Int8ActPerTensorFloat):
    """int8 activations, the MSE search on each collecting batch, then learned."""


class Uint8ActPerTensorFloatMSE(MSESymmetricScale, Uint8ActPerTensorFloat):
    """uint8 activations, the MSE search on each collecting batch, then learned."""


class ShiftedUint8ActPerTensorFloatMSE(
    MSEAsymmetricScale, MSEActZeroPoint, ShiftedUint8ActPerTensorFloat
):
    """uint8 activations, scale then zero point searched (MSE) per collecting batch."""


class ShiftedUint8WeightPerTensorFloatMSE(
    MSEAsymmetricScale, MSEWeightZeroPoint, ShiftedUint8WeightPerTensorFloat
):
    """uint8 weights, learned scale and zero point initialised by MSE searches."""


class ShiftedUint8WeightPerChannelFloatMSE(
    MSEAsymmetricScale, MSEWeightZeroPoint, ShiftedUint8WeightPerChannelFloat
):
    """uint8 weights, learned per-channel scales and zero points from MSE searches."""


# -- biases -----------------------------------------------------------------------------


class IntBias(IntQuant):
    """Integer biases with scale input scale × weight scale (give ``bit_width``)."""

    requires_input_scale = True
    scaling_impl_type = ScalingImplType.STATS
    scaling_per_output_type = ScalingPerOutputType.TENSOR


class Int8Bias(IntBias):
    """8-bit biases at input scale × weight scale."""

    bit_width = 8


class Int16Bias(IntBias):
    """16-bit biases at input scale × weight scale."""

    bit_width = 16


class Int24Bias(IntBias):
    """24-bit biases at input scale × weight scale."""

    bit_width = 24


class Int32Bias(IntBias):
    """32-bit biases at input scale × weight scale (what integer runtimes use)."""

    bit_width = 32


class Int8BiasPerTensorFloatInternalScaling(IntQuant, MaxStatsScaling, PerTensorFloatScaling8bit):
    """8-bit biases with their own scale ``max|b| / 128`` (no input scale needed)."""

    requires_input_scale = False


__all__ = [
    "Fp8e4m3ActPerTensorFloat",
    "Fp8e4m3WeightPerTensorFloat",
    "Fp8e5m2ActPerTensorFloat",
    "Fp8e5m2WeightPerTensorFloat",
    "Int16Bias",
    "Int24Bias",
    "Int32Bias",
    "Int4WeightPerChannelFloat",
    "Int4WeightPerGroupFloat",
    "Int8ActPerTensorFixedPoint",
    "Int8ActPerTensorFloat",
    "Int8ActPerTensorFloatMSE",
    "Int8ActPerTensorFloatMinMaxInit",
    "Int8Bias",
    "Int8BiasPerTensorFloatInternalScaling",
    "Int8WeightPerChannelFixedPoint",
    "Int8WeightPerChannelFloat",
    "Int8WeightPerChannelFloatLSQ",
    "Int8WeightPerChannelFloatMSE",
    "Int8WeightPerTensorFixedPoint",
    "Int8WeightPerTensorFloat",
    "Int8WeightPerTensorFloatMSE",
    "IntBias",
    "IntQuant",
    "MSEActZeroPoint",
    "MSEAsymmetricScale",
    "MSESymmetricScale",
    "MSEWeightZeroPoint",
    "MaxStatsScaling",
    "MinMaxStatsScaling",
    "NarrowIntQuant",
    "ParamFromRuntimePercentileIntervalScaling",
    "ParamFromRuntimePercentileScaling",
    "ParamMinMaxInitScaling",
    "PerChannelFloatScaling8bit",
    "PerChannelPoTScaling8bit",
    "PerTensorFloatScaling8bit",
    "PerTensorPoTScaling8bit",
    "ShiftedMinUintQuant",
    "ShiftedParamFromPercentileUintQuant",
    "ShiftedUint8ActPerTensorFixedPoint",
    "ShiftedUint8ActPerTensorFloat",
    "ShiftedUint8ActPerTensorFloatMSE",
    "ShiftedUint8WeightPerChannelFloat",
    "ShiftedUint8WeightPerChannelFloatMSE",
    "ShiftedUint8WeightPerTensorFloat",
    "ShiftedUint8WeightPerTensorFloatMSE",
    "SignedBinaryActPerTensorConst",
    "SignedBinaryWeightPerTensorConst",
    "SignedTernaryActPerTensorConst",
    "SignedTernaryWeightPerTensorConst",
    "Uint8ActPerTensorFixedPoint",
    "Uint8ActPerTensorFloat",
    "Uint8ActPerTensorFloatMSE",
    "Uint8ActPerTensorFloatMaxInit",
    "UintQuant",
]
