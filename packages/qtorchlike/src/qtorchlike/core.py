"""Implementation names that quantizer classes can point at, as in ``brevitas.core``.

Brevitas quantizers name implementation classes (``tensor_quant = BinaryQuant``,
``scaling_impl = ParameterScaling``). Here these names are markers that the
solver maps to the same behaviour as the enum attributes
(``quant_type``, ``scaling_impl_type``); both spellings can be mixed.

Example:
    >>> from qtorchlike.core import BinaryQuant, ParameterScaling
    >>> from qtorchlike.inject import ExtendedInjector
    >>> from qtorchlike.solver import solve
    >>> class MyBinaryQuantizer(ExtendedInjector):
    ...     tensor_quant = BinaryQuant
    ...     scaling_impl = ParameterScaling
    ...     scaling_init = 0.1
    >>> spec = solve(MyBinaryQuantizer)
    >>> spec.qtype, spec.scaling.name, spec.scaling_value, spec.signed
    ('int1', 'PARAMETER', 0.1, None)
"""

from __future__ import annotations

from qtorchlike.solver import QuantType, ScalingImplType


class _Marker:
    """Names a behaviour; never instantiated."""

    kind: object

    def __init_subclass__(cls, kind: object = None, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls.kind = kind

    def __new__(cls, *args: object, **kwargs: object):  # noqa: D102
        raise TypeError(f"{cls.__name__} is an implementation name for quantizer classes")


class IntQuant(_Marker, kind=QuantType.INT):
    """Integer codes: ``clamp(round(x / scale), min_int, max_int) * scale``."""


class BinaryQuant(_Marker, kind=QuantType.BINARY):
    """Binary codes: ``sign(x) * scale`` (``sign(0) = +1``)."""


class TernaryQuant(_Marker, kind=QuantType.TERNARY):
    """Ternary codes: ``{-1, 0, 1} * scale`` (a 2-bit narrow integer)."""


class ConstScaling(_Marker, kind=ScalingImplType.CONST):
    """A constant scale threshold, ``scaling_const``."""


class ParameterScaling(_Marker, kind=ScalingImplType.PARAMETER):
    """A learned scale threshold starting at ``scaling_init``."""


class StatsFromParameterScaling(_Marker, kind=ScalingImplType.STATS):
    """A threshold computed from the weight's statistics on every call."""


class ParameterFromStatsScaling(_Marker, kind=ScalingImplType.PARAMETER_FROM_STATS):
    """A learned threshold initialised from statistics."""
