"""Implementation classes that quantizers name, as in ``brevitas.core``.

A Brevitas quantizer can be assembled from implementations
(``tensor_quant = BinaryQuant``, ``scaling_impl = ParameterScaling``). Here the
same names work two ways:

* as modules you build and call: ``BinaryQuant(scaling_impl=ParameterScaling(
  scaling_init=0.1))(x)`` returns Brevitas' tuple ``(value, scale, zero_point,
  bit_width)``, and reading ``MyQuantizer.tensor_quant`` builds one, its
  constructor's arguments injected from the quantizer's attributes by name;
* inside a quantizer given to a layer, where they mean the same as the enum
  attributes (``quant_type``, ``scaling_impl_type``) and the two spellings mix.

``IntQuant``, ``StatsFromParameterScaling``, ``ParameterFromStatsScaling`` and the
zero-point and statistics names (``StatsFromParameterZeroPoint``, ``MSE``,
``AbsMax``...) are names for layers' quantizers only; build integer quantizers
from :mod:`qtorchlike.quant` (``Int8ActPerTensorFloat.tensor_quant`` is a
:class:`RescalingIntQuant`).

Example:
    >>> import jax.numpy as jnp
    >>> from qtorchlike.core import BinaryQuant, ParameterScaling
    >>> from qtorchlike.inject import ExtendedInjector
    >>> value, scale, zero_point, bit_width = BinaryQuant(
    ...     scaling_impl=ParameterScaling(scaling_init=0.1)
    ... )(jnp.array([-2.0, 0.0, 0.3]))
    >>> value.tolist(), scale.tolist(), float(zero_point), float(bit_width)
    ([-0.1..., 0.1..., 0.1...], [0.1...], 0.0, 1.0)
    >>> class MyBinaryQuantizer(ExtendedInjector):
    ...     tensor_quant = BinaryQuant
    ...     scaling_impl = ParameterScaling
    ...     scaling_init = 0.1
    >>> MyBinaryQuantizer.tensor_quant  # built from the attributes
    BinaryQuant(
      (scaling_impl): ParameterScaling()
    )
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from qtorchlike.nn.module import Module, Parameter
from qtorchlike.solver import (
    QuantType,
    ScalingImplType,
    StatsOp,
    ZeroPointImplType,
    ZeroPointStatsOp,
    solve,
)


class _Marker:
    """Names a behaviour for layers' quantizers; not built on its own."""

    kind: object

    def __init_subclass__(cls, kind: object = None, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls.kind = kind

    def __new__(cls, *args: object, **kwargs: object):  # noqa: D102
        raise TypeError(
            f"{cls.__name__} names a behaviour for quantizers given to layers and is not "
            "built on its own; build a quantizer from qtorchlike.quant (e.g. "
            "Int8ActPerTensorFloat.tensor_quant), or use BinaryQuant, ClampedBinaryQuant, "
            "TernaryQuant, ConstScaling or ParameterScaling"
        )


class _Impl(Module):
    """An implementation module that injectors build (``_injectable``)."""

    _injectable: ClassVar[bool] = True
    kind: ClassVar[object] = None

    def __init_subclass__(cls, kind: object = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.kind = kind


def _sign_ste(x: jax.Array) -> jax.Array:
    """``+1`` for ``x >= 0``, else ``-1``; the gradient passes straight through."""
    return x + jax.lax.stop_gradient(jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype) - x)


class _SignQuant(_Impl):
    """Shared by binary and ternary quantizers: the scale, the delay, the tuple."""

    bits: ClassVar[float] = 1.0

    def __init__(self, scaling_impl: Any, quant_delay_steps: int | None = None) -> None:
        super().__init__()
        if not callable(scaling_impl):
            raise TypeError(
                f"{type(self).__name__}(scaling_impl={scaling_impl!r}): scaling_impl must be "
                "a scaling module, e.g. ParameterScaling(scaling_init=0.1)"
            )
        self.scaling_impl = scaling_impl
        self.delay = int(quant_delay_steps or 0)

    def _codes(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        raise NotImplementedError

    def forward(self, x: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Returns ``(value, scale, zero_point, bit_width)`` for ``x``."""
        x = jnp.asarray(x, jnp.float32)
        scale = jnp.asarray(self.scaling_impl(x), jnp.float32)
        if self.kind is QuantType.BINARY and scale.ndim == 0:
            scale = scale.reshape(1)  # Brevitas' binary scales are (1,)
        lifted = jnp.reshape(scale, (1,) * (x.ndim - scale.ndim) + scale.shape)
        y = self._codes(x, lifted) * lifted
        if self.delay > 0:  # Brevitas' DelayWrapper: counts every call
            self.delay -= 1
            y = x
        return y, scale, jnp.zeros((), jnp.float32), jnp.asarray(self.bits, jnp.float32)


class BinaryQuant(_SignQuant, kind=QuantType.BINARY):
    """Binary codes: ``sign(x) * scale`` (``sign(0) = +1``), straight-through gradient.

    Args:
        scaling_impl: A module returning the scale (``ParameterScaling(...)``).
        quant_delay_steps: Calls that return ``x`` unquantized first.
    """

    def _codes(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        return _sign_ste(x)


class ClampedBinaryQuant(BinaryQuant, kind=QuantType.BINARY):
    """Binary codes of ``x`` clamped to ``[-scale, scale]`` first (no gradient beyond).

    The values equal :class:`BinaryQuant`'s; the gradient is zero where ``|x| > scale``.

    Args:
        scaling_impl: A module returning the scale.
        tensor_clamp_impl: Accepted for Brevitas' signature; the clamp is ``clip``.
        quant_delay_steps: Calls that return ``x`` unquantized first.
    """

    clamped: ClassVar[bool] = True

    def __init__(
        self, scaling_impl: Any, tensor_clamp_impl: Any = None, quant_delay_steps: int | None = None
    ) -> None:
        super().__init__(scaling_impl, quant_delay_steps)

    def _codes(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        return _sign_ste(jnp.clip(x, -scale, scale))


class TernaryQuant(_SignQuant, kind=QuantType.TERNARY):
    """Ternary codes: ``sign(x)`` where ``|x| > threshold * scale``, else 0.

    Args:
        scaling_impl: A module returning the scale.
        threshold: The fraction of the scale below which values become 0.
        quant_delay_steps: Calls that return ``x`` unquantized first.
    """

    bits = 2.0

    def __init__(
        self, scaling_impl: Any, threshold: float, quant_delay_steps: int | None = None
    ) -> None:
        super().__init__(scaling_impl, quant_delay_steps)
        self.threshold = float(threshold)

    def _codes(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        keep = jnp.abs(x) > self.threshold * scale
        return jnp.where(keep, _sign_ste(x), 0.0 * x)


class ConstScaling(_Impl, kind=ScalingImplType.CONST):
    """A constant scale.

    Args:
        scaling_init: The scale (a number or an array).
    """

    def __init__(self, scaling_init: Any) -> None:
        super().__init__()
        self.register_buffer("value", jnp.asarray(scaling_init, jnp.float32))

    def forward(self, x: Any = None) -> jax.Array:
        """Returns the scale (``x``, the tensor being quantized, is not used)."""
        return self.value


class ParameterScaling(_Impl, kind=ScalingImplType.PARAMETER):
    """A learned scale (its magnitude), a parameter named ``value``.

    Args:
        scaling_init: The starting scale: a number, or an array (e.g. one per
            output channel of shape ``(C, 1, 1, 1)``).
        scaling_shape: The parameter's shape when ``scaling_init`` is a number
            (default 0-d).
    """

    def __init__(self, scaling_init: Any, scaling_shape: Any = None) -> None:
        super().__init__()
        init = jnp.asarray(scaling_init, jnp.float32)
        if scaling_shape is not None and init.ndim == 0:
            init = jnp.full(tuple(scaling_shape), init)
        self.value = Parameter(init)

    def forward(self, x: Any = None) -> jax.Array:
        """Returns ``|value|`` (``x``, the tensor being quantized, is not used)."""
        return jnp.abs(self.value)


class TensorQuant(_Impl):
    """A quantizer class of :mod:`qtorchlike.quant` as a callable module.

    Calls return Brevitas' tuple ``(value, scale, zero_point, bit_width)``, with
    the quantizer's activation behaviour (statistics of the input, and for
    learned scales the running statistics of training calls). This is what
    ``Int8ActPerTensorFloat.tensor_quant`` gives.

    Args:
        quant: The quantizer class.
    """

    _injectable = False

    def __init__(self, quant: type) -> None:
        super().__init__()
        from qtorchlike._proxy import ActQuantProxy  # noqa: PLC0415 - import cycle

        self.quant_proxy = ActQuantProxy(quant)

    def forward(self, x: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Returns ``(value, scale, zero_point, bit_width)`` for ``x``."""
        q = self.quant_proxy(jnp.asarray(x, jnp.float32))
        return q.value, q.scale, q.zero_point, q.bit_width


class RescalingIntQuant(TensorQuant):
    """A :class:`TensorQuant` of an integer quantizer (Brevitas' class name for it)."""


def tensor_quant_of(quant: type) -> TensorQuant:
    """``quant`` as a callable module: :class:`RescalingIntQuant` for integer codes."""
    cls = RescalingIntQuant if solve(quant).quant_type is QuantType.INT else TensorQuant
    return cls(quant)


class IntQuant(_Marker, kind=QuantType.INT):
    """Integer codes: ``clamp(round(x / scale), min_int, max_int) * scale``."""


class StatsFromParameterScaling(_Marker, kind=ScalingImplType.STATS):
    """A threshold computed from the weight's statistics on every call."""


class ParameterFromStatsScaling(_Marker, kind=ScalingImplType.PARAMETER_FROM_STATS):
    """A learned threshold initialised from statistics."""


# -- zero points and statistics (Brevitas' brevitas.core.zero_point, brevitas.core.stats) ---


class ZeroZeroPoint(_Marker, kind=ZeroPointImplType.ZERO):
    """No zero point (symmetric codes)."""


class StatsFromParameterZeroPoint(_Marker, kind=ZeroPointImplType.STATS):
    """A weight's zero point from its statistics, on every call."""


class ParameterFromStatsFromParameterZeroPoint(
    _Marker, kind=ZeroPointImplType.PARAMETER_FROM_STATS
):
    """A learned weight zero point, initialised from the weight's statistics."""


class ParameterFromRuntimeZeroPoint(_Marker, kind=ZeroPointImplType.PARAMETER_FROM_STATS):
    """A learned activation zero point, from the first ``collect_stats_steps`` batches."""


class NegativeMinOrZero(_Marker, kind=ZeroPointStatsOp.NEGATIVE_MIN_OR_ZERO):
    """Zero-point statistic ``min(min(x), 0)``."""


class NegativePercentileOrZero(_Marker, kind=ZeroPointStatsOp.NEGATIVE_PERCENTILE_OR_ZERO):
    """Zero-point statistic ``min(x_(k), 0)``, ``k = ceil(low_percentile_q/100 * n)``."""


class MSE(_Marker, kind=ZeroPointStatsOp.MSE):
    """Brevitas' MSE grid search, as ``scaling_stats_impl`` or ``zero_point_stats_impl``."""


class AbsMax(_Marker, kind=StatsOp.MAX):
    """``max|x|``: the start of a symmetric MSE search (``mse_init_op``)."""


class AbsMinMax(_Marker, kind=StatsOp.MIN_MAX):
    """``|max(x) - min(min(x), 0)|``: the start of an asymmetric MSE search."""


__all__ = [
    "AbsMax",
    "AbsMinMax",
    "BinaryQuant",
    "ClampedBinaryQuant",
    "ConstScaling",
    "IntQuant",
    "MSE",
    "NegativeMinOrZero",
    "NegativePercentileOrZero",
    "ParameterFromRuntimeZeroPoint",
    "ParameterFromStatsFromParameterZeroPoint",
    "ParameterFromStatsScaling",
    "ParameterScaling",
    "RescalingIntQuant",
    "StatsFromParameterScaling",
    "StatsFromParameterZeroPoint",
    "TensorQuant",
    "TernaryQuant",
    "ZeroZeroPoint",
    "tensor_quant_of",
]
