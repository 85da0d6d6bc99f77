"""Turn a quantizer class's declarative attributes into a frozen, hashable :class:`QuantSpec`.

Enum attributes may be given as enum members or as strings, case-insensitively
(``scaling_impl_type = "parameter_from_stats"``), as Brevitas accepts them.

Example:
    >>> from qtorchlike.quant import Int8WeightPerChannelFloat
    >>> spec = solve(Int8WeightPerChannelFloat.let(bit_width=4))
    >>> spec.qtype, spec.narrow_range, spec.per.name, spec.int_scaling
    ('int4', True, 'CHANNEL', 7.0)
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import numpy as np

from qtorchlike import inject


class _StrEnum(enum.StrEnum):
    @classmethod
    def parse(cls, raw: Any, name: str) -> Any:
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, str):
            for member in cls:
                if member.value == raw.strip().lower():
                    return member
        allowed = ", ".join(m.name for m in cls)
        raise ValueError(f"{name}={raw!r} is not a {cls.__name__}; allowed: {allowed}")


class QuantType(_StrEnum):
    """What the codes are: integers, ±1, {-1, 0, 1}, or minifloats."""

    INT = "int"
    BINARY = "binary"
    TERNARY = "ternary"
    FP = "fp"


class ScalingImplType(_StrEnum):
    """Where the scale comes from.

    ``CONST``: ``scaling_init`` if given, else ``scaling_const`` (activations
    without it: ``max(|min_val|, |max_val|)``). ``HE``: weights only, the
    constant ``sqrt(2 / fan_in)`` (He's initialisation; averaged over the
    weights a proxy serves). ``STATS``:
    statistics of the tensor, every call (weights) or running statistics
    (activations). ``PARAMETER``: a learned
    parameter starting at ``scaling_init``. ``PARAMETER_FROM_STATS``: a learned
    parameter initialised from statistics (weights: at construction and on
    state-dict load; activations: after ``collect_stats_steps`` training steps).
    """

    CONST = "const"
    HE = "he"
    STATS = "stats"
    PARAMETER = "parameter"
    PARAMETER_FROM_STATS = "parameter_from_stats"


class StatsOp(_StrEnum):
    """The statistic behind a scale (Brevitas').

    ``MAX``, ``AVE``, ``PERCENTILE``: the max, mean or a high percentile of ``|x|``.
    ``MIN_MAX``: ``|max(x) - min(min(x), 0)|`` (``AbsMinMax``). ``PERCENTILE_INTERVAL``:
    ``|x_(hk) - min(x_(lk), 0)|`` between a low and a high percentile of ``x``.
    """

    MAX = "max"
    AVE = "ave"
    PERCENTILE = "percentile"
    MIN_MAX = "min_max"
    PERCENTILE_INTERVAL = "percentile_interval"


class ZeroPointImplType(_StrEnum):
    """Where a zero point comes from (the kinds of Brevitas' ``zero_point_impl`` classes).

    ``ZERO``: none (``ZeroZeroPoint``). ``STATS``: a weight statistic on every call
    (``StatsFromParameterZeroPoint``). ``PARAMETER_FROM_STATS``: a learned value
    initialised from statistics, of the weight at construction
    (``ParameterFromStatsFromParameterZeroPoint``) or of the first
    ``collect_stats_steps`` training batches (``ParameterFromRuntimeZeroPoint``).
    """

    ZERO = "zero"
    STATS = "stats"
    PARAMETER_FROM_STATS = "parameter_from_stats"


class ZeroPointStatsOp(_StrEnum):
    """The statistic behind a zero point (Brevitas' ``zero_point_stats_impl``).

    ``NEGATIVE_MIN_OR_ZERO``: ``min(min(x), 0)``. ``NEGATIVE_PERCENTILE_OR_ZERO``:
    ``min(x_(k), 0)``, ``k = ceil(low_percentile_q/100 * n)``. ``MSE``: a grid search
    between that minimum and a twentieth of it (see :class:`QuantSpec`).
    The integer zero point is ``clamp(round(-stat / scale), 0, 2^bits - 1)``.
    """

    NEGATIVE_MIN_OR_ZERO = "negative_min_or_zero"
    NEGATIVE_PERCENTILE_OR_ZERO = "negative_percentile_or_zero"
    MSE = "mse"


class RestrictValueType(_StrEnum):
    """Restriction on scales: any float, learned in log2 domain, or powers of two."""

    FP = "fp"
    LOG_FP = "log_fp"
    POWER_OF_TWO = "power_of_two"


class ScalingPerOutputType(_StrEnum):
    """Scale granularity: one per tensor, per output channel, or per group of inputs."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"


class FloatToIntImplType(_StrEnum):
    """Rounding of scaled values: to nearest (ties to even) or stochastic."""

    ROUND = "round"
    STOCHASTIC_ROUND = "stochastic_round"


# Every attribute solve() reads (a layer's keyword overrides must name one of
# these, an attribute of the quantizer, or a name its @value functions take).
ATTRIBUTES = frozenset({
    "bit_width", "collect_stats_steps", "exponent_bit_width", "float_to_int_impl_type",
    "group_size", "high_percentile_q", "mantissa_bit_width", "narrow_range", "quant_type",
    "requires_input_scale", "restrict_scaling_type", "scaling_const", "scaling_impl",
    "scaling_impl_type", "scaling_init", "scaling_per_output_channel",
    "scaling_per_output_type", "scaling_stats_momentum", "scaling_stats_op", "signed",
    "tensor_quant", "min_val", "max_val", "per_channel_broadcastable_shape",
    "scaling_stats_permute_dims", "quant_delay_steps", "threshold", "scaling_min_val",
    "bit_width_impl_type", "affine_rescaling", "restrict_value_float_to_int_impl",
    # zero points and MSE searches (Brevitas' Shifted* and *MSE quantizers)
    "zero_point_impl", "zero_point_stats_impl", "low_percentile_q", "quantize_zero_point",
    "scaling_stats_impl", "mse_init_op", "mse_iters", "mse_search_method",
})  # fmt: skip

_FP_TYPES = {(4, 3): "float8_e4m3fn", (5, 2): "float8_e5m2", (2, 1): "float4_e2m1fn"}
_FP_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "float4_e2m1fn": 6.0}


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """Everything a quantizer proxy needs, resolved from a quantizer class.

    Attributes:
        name: The quantizer class's name (for messages).
        quant_type: Integer, binary, ternary or minifloat codes.
        qtype: The qcore type name the codes use (``"int8"``, ``"int1"``, ``"float8_e4m3fn"``...).
        bit_width: Bits per code.
        signed: Whether codes can be negative (None: a binary quantizer without
            ``signed``, whose QuantTensors are not valid, as in Brevitas).
        narrow_range: Signed codes skip their most negative value.
        scaling: Where the threshold comes from.
        scaling_value: ``scaling_const`` or ``scaling_init`` (None for statistics).
        stats_op: The statistic for statistics-based scales.
        percentile: ``high_percentile_q`` for :attr:`StatsOp.PERCENTILE`.
        per: One scale per tensor, per output channel, or per group.
        group_size: Inputs per group for per-group scales.
        restrict: Restriction on scales.
        collect_stats_steps: Training steps that collect activation statistics
            before a learned scale takes over.
        momentum: Momentum of running statistics (None: cumulative average).
        rounding: qcore rounding mode.
        requires_input_scale: Bias scale is input scale × weight scale.
        channel_shape: Per-channel activation scales: the scale's shape
            (``per_channel_broadcastable_shape``, e.g. ``(1, C, 1, 1)``); None otherwise.
        channel_axis: The axis of ``channel_shape`` that holds the channels.
        clamped: Binary codes of the input clamped to ``[-scale, scale]`` first
            (``ClampedBinaryQuant``: the gradient is zero beyond).
        threshold: Ternary codes are 0 where ``|x| <= threshold * scale``.
        quant_delay_steps: Calls that return the input unquantized before
            quantization starts (Brevitas' ``DelayWrapper``; 0: none).
        int_scaling: The threshold is divided by this to give the scale.
        pot_rounding: How a power-of-two scale rounds ``log2`` of the threshold:
            ``"round"`` (Brevitas' default for ``restrict_scaling_type=POWER_OF_TWO``),
            ``"ceil"`` (its fixed-point quantizers: the threshold is never clipped) or
            ``"floor"`` (``restrict_value_float_to_int_impl``).
        scaling_min_val: The threshold's lower bound (Brevitas' clamp; None: an
            all-zero block's threshold falls back to ``int_scaling``, scale 1).
        zero_point: Where the zero point comes from (``ZERO``: none).
        zero_point_stats: The zero point's statistic (None without a zero point).
        low_percentile: ``low_percentile_q`` of ``PERCENTILE_INTERVAL`` and
            ``NEGATIVE_PERCENTILE_OR_ZERO`` (Brevitas' default 0.001).
        mse: The threshold is Brevitas' MSE grid search, started from ``stats_op``
            (``MAX``, or ``MIN_MAX`` for shifted quantizers): ``mse_iters``
            candidates from a ``1/mse_iters`` fraction of it up to it, keeping the
            first with the least sum of squared quantization errors.
        mse_iters: Candidates of the MSE search (Brevitas' ``mse_iters``, 20).
    """

    name: str
    quant_type: QuantType
    qtype: str
    bit_width: int
    signed: bool | None
    narrow_range: bool
    scaling: ScalingImplType
    scaling_value: float | None
    stats_op: StatsOp
    percentile: float
    per: ScalingPerOutputType
    group_size: int | None
    restrict: RestrictValueType
    collect_stats_steps: int
    momentum: float | None
    rounding: str
    requires_input_scale: bool
    channel_shape: tuple[int, ...] | None
    channel_axis: int | None
    clamped: bool
    threshold: float
    quant_delay_steps: int
    int_scaling: float
    scaling_min_val: float | None = None
    pot_rounding: str = "round"
    zero_point: ZeroPointImplType = ZeroPointImplType.ZERO
    zero_point_stats: ZeroPointStatsOp | None = None
    low_percentile: float = 0.001
    mse: bool = False
    mse_iters: int = 20


def _get(q: type, name: str, default: Any = inject._MISSING) -> Any:
    if default is not inject._MISSING and not inject.has(q, name):
        return default
    return inject.resolve(q, name)


def _marked(q: type, impl: str, enum_name: str, default: Any = inject._MISSING) -> Any:
    """The enum attribute, or the kind of an implementation marker (``tensor_quant``...)."""
    if inject.has(q, impl) and not inject.has(q, enum_name):
        marker = inject.resolve(q, impl, instantiate=False)
        kind = getattr(marker, "kind", None)
        if kind is None:
            raise ValueError(
                f"{q.__name__}.{impl}={marker!r} is not an implementation qtorchlike knows; "
                "allowed: the classes in qtorchlike.core"
            )
        return kind
    return _get(q, enum_name, default)


def _int(q: type, name: str, raw: Any, lo: int, hi: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not lo <= raw <= hi:
        raise ValueError(f"{q.__name__}.{name}={raw!r} must be an int in [{lo}, {hi}]")
    return raw


def _channel_shape(q: type, per: ScalingPerOutputType) -> tuple[Any, Any]:
    """``per_channel_broadcastable_shape`` and its channel axis, checked (None, None if unset).

    Brevitas takes the statistics of per-channel activations over every axis but
    the channel one, which ``scaling_stats_permute_dims`` moves first; both must
    agree with the shape.
    """
    if not inject.has(q, "per_channel_broadcastable_shape"):
        return None, None
    raw = _get(q, "per_channel_broadcastable_shape")
    shape = tuple(raw) if isinstance(raw, tuple | list) else None
    channels = [i for i, n in enumerate(shape or ()) if n != 1]
    if shape is None or not all(isinstance(n, int) and n >= 1 for n in shape) or len(channels) > 1:
        raise ValueError(
            f"{q.__name__}.per_channel_broadcastable_shape={raw!r} must be a tuple of "
            "positive ints with at most one entry above 1 (e.g. (1, C, 1, 1))"
        )
    axis = channels[0] if channels else 0
    perm = _get(q, "scaling_stats_permute_dims", None)
    if per is ScalingPerOutputType.CHANNEL and perm is not None:
        perm = tuple(perm) if isinstance(perm, tuple | list) else perm
        if perm != (axis, *(i for i in range(len(shape)) if i != axis)):
            raise ValueError(
                f"{q.__name__}.scaling_stats_permute_dims={perm!r} must move the channel axis "
                f"{axis} of per_channel_broadcastable_shape={shape} first, keeping the others "
                "in order"
            )
    return shape, axis


def _scaling_min_val(q: type) -> float | None:
    """``scaling_min_val`` checked, after refusing the settings qtorchlike does not implement.

    Brevitas honours ``bit_width_impl_type="parameter"`` (a learned bit width) and
    ``affine_rescaling=True``; qtorchlike refuses them rather than ignore them.
    """
    name = q.__name__
    bits_impl = _get(q, "bit_width_impl_type", "const")
    if str(getattr(bits_impl, "name", bits_impl)).lower() != "const":
        raise ValueError(
            f"{name}.bit_width_impl_type={bits_impl!r}: learned bit widths are not implemented; "
            "allowed: 'const' (a fixed bit_width)"
        )
    if _get(q, "affine_rescaling", False):
        raise ValueError(
            f"{name}.affine_rescaling=True: an affine rescaling of the scale is not "
            "implemented; allowed: False"
        )
    low = _get(q, "scaling_min_val", None)
    if low is None:
        return None
    if isinstance(low, bool) or not isinstance(low, int | float) or not 0 <= low < math.inf:
        raise ValueError(f"{name}.scaling_min_val={low!r} must be a number >= 0 or None")
    return float(low)


def _pot_rounding(q: type) -> str:
    """``restrict_value_float_to_int_impl`` as ``"round"``, ``"ceil"`` or ``"floor"``."""
    raw = _get(q, "restrict_value_float_to_int_impl", "round")
    name = getattr(raw, "__name__", raw)
    key = str(name).lower().removesuffix("ste") if isinstance(name, str) else None
    if key not in ("round", "ceil", "floor"):
        raise ValueError(
            f"{q.__name__}.restrict_value_float_to_int_impl={raw!r}; allowed: 'round', 'ceil' "
            "or 'floor' (Brevitas' RoundSte, CeilSte, FloorSte)"
        )
    return key


def solve(q: type) -> QuantSpec:
    """Resolves quantizer class ``q`` into a :class:`QuantSpec`.

    Raises:
        inject.DependencyError: A required attribute is missing (the message
            shows the chain and the nearest names).
        ValueError: An attribute has a value outside what is allowed.
    """
    if not (isinstance(q, type) and issubclass(q, inject.ExtendedInjector)):
        raise TypeError(
            f"quantizer {q!r} must be a subclass of qtorchlike.inject.ExtendedInjector "
            "(e.g. qtorchlike.quant.Int8WeightPerTensorFloat) or None"
        )
    name = q.__name__
    quant_type = _marked(q, "tensor_quant", "quant_type", QuantType.INT)
    quant_type = QuantType.parse(quant_type, f"{name}.quant_type")
    signed: bool | None = bool(_get(q, "signed", True))
    narrow = bool(_get(q, "narrow_range", False))
    if quant_type is QuantType.BINARY:
        # Brevitas leaves a binary quantizer's sign unset unless `signed` is given,
        # and its QuantTensors are then not valid; the walkthrough sets signed=True.
        signed = bool(_get(q, "signed")) if inject.has(q, "signed") else None
        bits, qtype, int_scaling, narrow = 1, "int1", 1.0, False
    elif quant_type is QuantType.TERNARY:
        bits, qtype, int_scaling, signed, narrow = 2, "int2", 1.0, True, True
    elif quant_type is QuantType.FP:
        e = _int(q, "exponent_bit_width", _get(q, "exponent_bit_width"), 1, 8)
        m = _int(q, "mantissa_bit_width", _get(q, "mantissa_bit_width"), 0, 7)
        if (e, m) not in _FP_TYPES:
            raise ValueError(
                f"{name}: exponent_bit_width={e}, mantissa_bit_width={m} is not a supported "
                f"minifloat; allowed (exponent, mantissa): {sorted(_FP_TYPES)}"
            )
        qtype = _FP_TYPES[e, m]
        bits, int_scaling, signed, narrow = 1 + e + m, _FP_MAX[qtype], True, False
    else:
        bits = _int(q, "bit_width", _get(q, "bit_width"), 2, 32)
        if bits > 8 and bits != 16 and not _get(q, "requires_input_scale", False):
            raise ValueError(
                f"{name}.bit_width={bits}: weight and activation codes have 2-8 or 16 bits "
                "(biases, which use input scale x weight scale, up to 32)"
            )
        qtype = f"{'int' if signed else 'uint'}{bits}"
        # Brevitas' IntScaling: a signed threshold maps to -min_int (2^(b-1), or
        # 2^(b-1) - 1 when narrow), an unsigned one to max_int (2^b - 1, or 2^b - 2
        # when narrow). Its PowerOfTwoIntScaling divides by 2^(b-1) (2^b unsigned)
        # whatever the range, so the scale stays a power of two.
        int_scaling = float(2 ** (bits - 1) - narrow if signed else 2**bits - 1 - narrow)
    restrict = RestrictValueType.parse(
        _get(q, "restrict_scaling_type", RestrictValueType.FP), f"{name}.restrict_scaling_type"
    )
    if quant_type is QuantType.INT and restrict is RestrictValueType.POWER_OF_TWO:
        int_scaling = float(2 ** (bits - 1) if signed else 2**bits)
    scaling = _marked(q, "scaling_impl", "scaling_impl_type")
    scaling = ScalingImplType.parse(scaling, f"{name}.scaling_impl_type")
    scaling_value = None
    if scaling is ScalingImplType.CONST:
        # Brevitas' ConstScaling takes scaling_init when given; otherwise it is
        # scaling_const, or for activations max(|min_val|, |max_val|).
        if inject.has(q, "scaling_init"):
            scaling_value = float(_get(q, "scaling_init"))
        elif inject.has(q, "scaling_const"):
            scaling_value = float(_get(q, "scaling_const"))
        elif not inject.has(q, "max_val"):
            raise inject.DependencyError(
                f"{name}: scaling_impl_type=CONST needs the constant: give scaling_init "
                "(or scaling_const), or for activations max_val (and min_val)"
            )
        else:  # Brevitas' activations: the larger bound (QuantReLU(max_val=6, ...))
            low = _get(q, "min_val", None)
            scaling_value = max(abs(float(low or 0.0)), abs(float(_get(q, "max_val"))))
    elif scaling is ScalingImplType.PARAMETER:
        init = np.asarray(_get(q, "scaling_init"), np.float64)
        if init.size != 1:  # one per channel: the proxy resolves it again for its shape
            if not np.all(init > 0):
                raise ValueError(f"{name}: every scaling_init must be > 0; got {init.ravel()}")
        else:
            scaling_value = float(init.ravel()[0])
    if scaling_value is not None and not scaling_value > 0:
        raise ValueError(f"{name}: the scaling constant/init {scaling_value!r} must be > 0")
    # Brevitas' rule: the boolean scaling_per_output_channel, when set, wins over
    # scaling_per_output_type (so weight_scaling_per_output_channel=True on a per-tensor
    # quantizer makes it per channel).
    per_channel = _get(q, "scaling_per_output_channel", None)
    per_raw = _get(q, "scaling_per_output_type", None)
    if per_channel is not None:
        per_raw = ScalingPerOutputType.CHANNEL if per_channel else ScalingPerOutputType.TENSOR
    elif per_raw is None:
        per_raw = ScalingPerOutputType.TENSOR
    per = ScalingPerOutputType.parse(per_raw, f"{name}.scaling_per_output_type")
    group_size = None
    if per is ScalingPerOutputType.GROUP:
        group_size = _int(q, "group_size", _get(q, "group_size"), 1, 1 << 20)
    channel_shape, channel_axis = _channel_shape(q, per)
    clamped = False
    if inject.has(q, "tensor_quant"):
        clamped = bool(getattr(inject.resolve(q, "tensor_quant", instantiate=False), "clamped", 0))
    threshold = float(_get(q, "threshold", 0.5))
    if quant_type is QuantType.TERNARY and not 0 <= threshold < 1:
        raise ValueError(f"{name}.threshold={threshold!r} must be in [0, 1)")
    momentum = _get(q, "scaling_stats_momentum", None)
    if momentum is not None and not 0 < momentum <= 1:
        raise ValueError(f"{name}.scaling_stats_momentum={momentum!r} must be in (0, 1] or None")
    percentile = float(_get(q, "high_percentile_q", 99.999))
    if not 0 < percentile <= 100:
        raise ValueError(f"{name}.high_percentile_q={percentile!r} must be in (0, 100]")
    rounding = FloatToIntImplType.parse(
        _get(q, "float_to_int_impl_type", FloatToIntImplType.ROUND), f"{name}.float_to_int"
    )
    stats_op = StatsOp.parse(_get(q, "scaling_stats_op", StatsOp.MAX), f"{name}.stats_op")
    zero_point, mse = _solve_zero_point_and_mse(q, quant_type, signed, scaling, restrict, per)
    if mse["mse"]:
        stats_op = mse.pop("init_op")
    else:
        mse.pop("init_op")
    return QuantSpec(
        name=name,
        quant_type=quant_type,
        qtype=qtype,
        bit_width=bits,
        signed=signed,
        narrow_range=narrow,
        scaling=scaling,
        scaling_value=scaling_value,
        stats_op=stats_op,
        percentile=percentile,
        per=per,
        group_size=group_size,
        restrict=restrict,
        collect_stats_steps=_int(
            q, "collect_stats_steps", _get(q, "collect_stats_steps", 0), 0, 1 << 30
        ),
        momentum=None if momentum is None else float(momentum),
        rounding="stochastic"
        if rounding is FloatToIntImplType.STOCHASTIC_ROUND
        else "nearest_even",
        requires_input_scale=bool(_get(q, "requires_input_scale", False)),
        channel_shape=channel_shape,
        channel_axis=channel_axis,
        clamped=clamped,
        threshold=threshold,
        quant_delay_steps=_int(
            q, "quant_delay_steps", _get(q, "quant_delay_steps", None) or 0, 0, 1 << 30
        ),
        int_scaling=int_scaling,
        scaling_min_val=_scaling_min_val(q),
        pot_rounding=_pot_rounding(q),
        **zero_point,
        **mse,
    )


def _kind(q: type, attr: str, enum: type[_StrEnum], default: Any) -> Any:
    """The enum value of attribute ``attr`` (``default`` when unset).

    The attribute is an implementation marker (``zero_point_impl =
    StatsFromParameterZeroPoint``, whose kind counts), an enum member or its string.
    """
    if not inject.has(q, attr):
        return default
    raw = _get(q, attr)
    if raw is None:
        return default
    kind = getattr(raw, "kind", raw)
    return enum.parse(kind, f"{q.__name__}.{attr}")


def _solve_zero_point_and_mse(
    q: type,
    quant_type: QuantType,
    signed: bool | None,
    scaling: ScalingImplType,
    restrict: RestrictValueType,
    per: ScalingPerOutputType,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The zero-point and MSE fields of a :class:`QuantSpec`, checked.

    What qtorchlike implements of Brevitas' shifted and MSE quantizers: integer
    zero points (``quantize_zero_point=True``) on unsigned integer codes, per tensor
    or per channel; MSE grid searches (``mse_search_method="grid"``) for float
    scales learned from statistics. Anything else is refused here, by name.
    """
    name = q.__name__
    zp = _kind(q, "zero_point_impl", ZeroPointImplType, ZeroPointImplType.ZERO)
    zp_stats = _kind(q, "zero_point_stats_impl", ZeroPointStatsOp, None)
    low = float(_get(q, "low_percentile_q", 0.001))
    if not 0 <= low < 100:
        raise ValueError(f"{name}.low_percentile_q={low!r} must be in [0, 100)")
    scaling_stats = _get(q, "scaling_stats_impl", None)
    mse = scaling_stats is not None
    if mse and getattr(scaling_stats, "kind", scaling_stats) != ZeroPointStatsOp.MSE:
        raise ValueError(
            f"{name}.scaling_stats_impl={scaling_stats!r}: only qtorchlike.core.MSE is "
            "supported here; other statistics are chosen with scaling_stats_op"
        )
    if zp is not ZeroPointImplType.ZERO:
        if zp_stats is None:
            raise ValueError(f"{name}.zero_point_impl needs zero_point_stats_impl")
        if quant_type is not QuantType.INT or signed is not False:
            raise ValueError(
                f"{name}: a zero point needs unsigned integer codes (signed=False, as "
                f"Brevitas' Shifted* quantizers); got quant_type={quant_type.value}, "
                f"signed={signed}"
            )
        if not _get(q, "quantize_zero_point", True):
            raise ValueError(
                f"{name}.quantize_zero_point=False (a float zero point) is not supported; "
                "qtorchlike implements integer zero points only (quantize_zero_point=True)"
            )
        if per is ScalingPerOutputType.GROUP:
            raise ValueError(f"{name}: zero points are per tensor or per channel, not per group")
        if zp_stats is ZeroPointStatsOp.MSE and not mse:
            raise ValueError(
                f"{name}: an MSE zero point (zero_point_stats_impl=MSE) needs an MSE scale "
                "(scaling_stats_impl=MSE, e.g. the MSEAsymmetricScale mixin)"
            )
    if mse:
        method = _get(q, "mse_search_method", "grid")
        if method != "grid":
            raise ValueError(
                f"{name}.mse_search_method={method!r}: only 'grid' (Brevitas' default for "
                "its MSE quantizers) is implemented"
            )
        if restrict is not RestrictValueType.FP:
            raise ValueError(
                f"{name}: an MSE search of a {restrict.value} scale (e.g. power-of-two, the "
                "*FixedPointMSE quantizers) is not implemented; allowed: "
                "restrict_scaling_type=FP"
            )
        if quant_type is not QuantType.INT or scaling is not ScalingImplType.PARAMETER_FROM_STATS:
            raise ValueError(
                f"{name}: the MSE search needs integer codes and "
                f"scaling_impl_type=PARAMETER_FROM_STATS; got {quant_type.value}, {scaling.value}"
            )
        if per is ScalingPerOutputType.GROUP:
            raise ValueError(f"{name}: MSE scales are per tensor or per channel, not per group")
    init = _kind(q, "mse_init_op", StatsOp, StatsOp.MAX)
    if mse and init not in (StatsOp.MAX, StatsOp.MIN_MAX):
        raise ValueError(f"{name}.mse_init_op={init.value!r}: allowed: MAX, MIN_MAX")
    iters = _int(q, "mse_iters", _get(q, "mse_iters", 20), 2, 1 << 16)
    return (
        {
            "zero_point": zp,
            "zero_point_stats": zp_stats if zp is not ZeroPointImplType.ZERO else None,
            "low_percentile": low,
        },
        {"mse": mse, "mse_iters": iters, "init_op": init},
    )
