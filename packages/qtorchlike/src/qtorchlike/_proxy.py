"""Quantizer proxies (internal; the public names are in :mod:`qtorchlike.proxy`).

A layer turns each quantizer class it is given into a proxy: a
:class:`WeightQuantProxy`, :class:`ActQuantProxy` or :class:`BiasQuantProxy`.
The proxy owns the learned scale (a parameter named ``value``) and the running
statistics (buffers), and its forward pass returns a
:class:`~qtorchlike.QuantTensor`. The arithmetic is qcore's:
:func:`qcore.fake_quant_with_scale` quantizes with straight-through gradients
(LSQ gradients for learned scales), :func:`qcore.calibrate` computes statistics.

A weight proxy can be shared between layers (``weight_quant=layer1.weight_quant``):
it then tracks every weight it serves and computes statistics over all of them.

Threshold and scale: statistics and ``scaling_const``/``scaling_init`` give a
*threshold* (e.g. ``max|w|``); the scale is ``threshold / int_scaling``
(``int_scaling`` is 127 for narrow int8, 128 for int8, 255 for uint8, 448 for
fp8 e4m3, 1 for binary and ternary), restricted to a power of two when asked
(rounded up, so the threshold is never clipped).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

import qcore
from qcore import numerics
from qtorchlike import inject, random
from qtorchlike._errors import MissingInputScaleError
from qtorchlike.nn.module import Module, Parameter, path_of
from qtorchlike.quant_tensor import QuantTensor
from qtorchlike.solver import (
    QuantSpec,
    QuantType,
    RestrictValueType,
    ScalingImplType,
    ScalingPerOutputType,
    StatsOp,
    solve,
)


@dataclasses.dataclass(frozen=True)
class _MeanAbs:
    """A qcore calibrator: ``±mean|x|`` (Brevitas' ``StatsOp.AVE``)."""

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        m = jnp.mean(jnp.abs(x), axis=tuple(axes), keepdims=True)
        return -m, m


@dataclasses.dataclass(frozen=True)
class _NearestRankPercentile:
    """A qcore calibrator: ``±`` the k-th smallest ``|x|``, ``k = floor(q/100 * n + 1/2)``.

    Brevitas' ``AbsPercentile`` rule (1-indexed nearest rank, no interpolation).
    """

    q: float

    def __call__(self, x, axes, *, qtype, symmetric=True, narrow_range=False):  # noqa: D102
        axes = tuple(a % x.ndim for a in axes)
        kept = [a for a in range(x.ndim) if a not in axes]
        flat = jnp.abs(jnp.transpose(x, (*kept, *axes)))
        flat = flat.reshape(*(x.shape[a] for a in kept), -1)
        n = flat.shape[-1]
        k = min(max(int(math.floor(0.01 * self.q * n + 0.5)), 1), n)
        hi = jnp.sort(flat, axis=-1)[..., k - 1]
        hi = jnp.expand_dims(hi, axes) if axes else hi
        return -hi, hi


def _calibration(spec: QuantSpec) -> Any:
    if spec.stats_op is StatsOp.AVE:
        return _MeanAbs()
    if spec.stats_op is StatsOp.PERCENTILE:
        return _NearestRankPercentile(spec.percentile)
    return "absmax"


def _threshold(x: jax.Array, spec: QuantSpec, channelwise=(), tiled=None) -> jax.Array:
    """The statistic of ``|x|`` per scale block, through qcore.calibrate (no gradient).

    Statistics are of magnitudes for signed and unsigned quantizers alike, as in
    Brevitas (``AbsMax``, ``AbsPercentile``, ``AbsAve``).
    """
    how = qcore.HowToQuantize(
        qtype="int8",  # only the range (lo, hi) is used, not the type's scale
        channelwise_axes=channelwise,
        tiled_axes=tiled or {},
        calibration=_calibration(spec),
    )
    *_, hi = qcore.calibrate(jax.lax.stop_gradient(x.astype(jnp.float32)), how)
    return hi


def _check_finite(x: Any, describe: Any) -> None:
    """Raises ValueError(``describe(n)``) if concrete ``x`` holds ``n > 0`` NaN or ±inf values.

    Under tracing (``jax.jit``) nothing can be raised; the non-finite values then
    make their blocks' scales NaN (:func:`_poison`).
    """
    if isinstance(x, Tracer):
        return
    with jax.ensure_compile_time_eval():  # a concrete array, also while tracing
        if bool(jnp.all(jnp.isfinite(x))):
            return
    n = int(np.sum(~np.isfinite(np.asarray(x))))
    raise ValueError(describe(f"{n} non-finite value{'s' if n != 1 else ''} (NaN or inf)"))


def _poison(x: jax.Array, out: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NaN for every block of ``x`` (the values one scale serves) that holds NaN or ±inf.

    Returns ``out`` (the quantized ``x``) and ``scale`` with those blocks' values and
    scales NaN: quantization never turns a non-finite value into a finite one.
    """
    shape = (1,) * (x.ndim - scale.ndim) + tuple(scale.shape)
    blocks = [d for s, n in zip(shape, x.shape, strict=True) for d in (s, n // s)]
    inner = tuple(range(1, 2 * x.ndim, 2))
    bad = jnp.any(~jnp.isfinite(x.reshape(blocks)), axis=inner, keepdims=True)
    out = jnp.where(bad, jnp.nan, out.reshape(blocks)).reshape(x.shape)
    return out, jnp.where(bad.reshape(scale.shape), jnp.nan, scale)


def _const_shape(spec: QuantSpec) -> tuple[int, ...]:
    """Brevitas' shape of a per-tensor scale: ``(1,)`` for binary quantizers, else 0-d.

    (Brevitas' binary quantizers divide their scale by a ``(1,)`` threshold.)
    """
    return (1,) if spec.quant_type is QuantType.BINARY else ()


_POT_ROUNDING = {"round": jnp.round, "ceil": jnp.ceil, "floor": jnp.floor}


def _round_log2_ste(x: jax.Array, how: str) -> jax.Array:
    """``x`` (a log2) rounded as ``how`` says; the gradient passes straight through."""
    return x + jax.lax.stop_gradient(_POT_ROUNDING[how](x) - x)


def to_scale(
    threshold: jax.Array, spec: QuantSpec, log_domain: bool = False, restrict: bool = True
) -> jax.Array:
    """Scale from a threshold (given as log2 when ``log_domain``).

    With ``restrict=False`` a power-of-two quantizer's scale is ``threshold /
    int_scaling``, the threshold not rounded (Brevitas' scale while it collects
    statistics).
    """
    if spec.scaling_min_val is not None:  # Brevitas' clamp of the threshold
        floor = math.log2(max(spec.scaling_min_val, 1e-45)) if log_domain else spec.scaling_min_val
        threshold = jnp.maximum(threshold, floor)
    if not restrict or spec.restrict is not RestrictValueType.POWER_OF_TWO:
        t = jnp.exp2(threshold) if log_domain else threshold
        # An all-zero block gives threshold 0: fall back to scale 1 (qcore's rule).
        scale = jnp.where(t > 0, t, jnp.ones_like(t) * spec.int_scaling) / spec.int_scaling
    else:
        # 2^round(log2 t) / int_scaling, int_scaling a power of two; the fixed-point
        # quantizers round up (Brevitas' CeilSte), others to nearest (RoundSte).
        log_t = threshold if log_domain else jnp.log2(jnp.maximum(threshold, 1e-30))
        log_t = _round_log2_ste(log_t, spec.pot_rounding)
        scale = jnp.exp2(log_t - math.log2(spec.int_scaling))
    # A non-finite threshold (statistics of a NaN or inf block under jax.jit) gives a
    # NaN scale, never a finite fallback.
    return jnp.where(jnp.isfinite(threshold), scale, jnp.nan)


def _log_param(spec: QuantSpec) -> bool:
    return spec.restrict is not RestrictValueType.FP


def _fake_quant(x: jax.Array, scale: jax.Array, spec: QuantSpec) -> jax.Array:
    key = random.next_key() if spec.rounding == "stochastic" else None
    if spec.clamped:  # ClampedBinaryQuant: same values, no gradient beyond the scale
        x = jnp.clip(x, -scale, scale)
    if spec.quant_type is QuantType.TERNARY and spec.threshold != 0.5:
        # Brevitas' TernaryQuant: sign(x) where |x| > threshold * scale (0.5 is rounding).
        sign = x + jax.lax.stop_gradient(jnp.sign(x) - x)  # straight-through
        return jnp.where(jnp.abs(x) > spec.threshold * scale, sign, 0.0 * x) * scale
    if spec.bit_width > 16:  # wide biases: no qcore type, plain round-and-clip
        lo, hi = -(2.0 ** (spec.bit_width - 1)), 2.0 ** (spec.bit_width - 1) - 1
        return numerics.saturate(numerics.round_ste(x / scale), lo, hi) * scale
    return qcore.fake_quant_with_scale(
        x,
        spec.qtype,
        scale,
        narrow_range=spec.narrow_range,
        rounding=spec.rounding,
        key=key,
    )


class QuantProxy(Module):
    """Shared machinery: the quantizer class, its spec, on/off switches."""

    is_quantizer = True  # its state may be missing from float checkpoints

    def __init__(self, quant: type | None, module: Any = None) -> None:
        super().__init__()
        self.quant = quant
        # ``module`` (the layer, or the tuple of layers a shared proxy serves) is what
        # a quantizer's @value functions receive when they ask for ``module``.
        spec = (
            None if quant is None else solve(quant if module is None else quant.let(module=module))
        )
        self.spec: Any = spec
        self.enabled = quant is not None

    def _start_delay(self) -> None:
        """A ``delay`` buffer counting the calls left that pass their input through."""
        if self.spec is not None and self.spec.quant_delay_steps:
            self.register_buffer("delay", jnp.asarray(self.spec.quant_delay_steps, jnp.int32))

    def _delayed(self, x: jax.Array, out: QuantTensor) -> QuantTensor:
        """Brevitas' DelayWrapper: the first ``quant_delay_steps`` calls give ``x`` as is.

        Every call counts, in any mode; the scale is computed all the same.
        """
        if "delay" not in self._buffers:
            return out
        delayed = self.delay > 0
        self.delay = jnp.where(delayed, self.delay - 1, self.delay)
        return out._like(jnp.where(delayed, x, out.value))

    @property
    def is_quant_enabled(self) -> bool:
        """Whether this proxy quantizes: it has a quantizer and is not disabled.

        A layer given no quantizer (``bias_quant=None``) holds a proxy for which
        this is False, as in Brevitas.
        """
        return self.spec is not None and bool(self.enabled)

    @property
    def is_signed(self) -> bool | None:
        """Whether the codes are signed (None when not quantizing)."""
        return None if not self.is_quant_enabled else self.spec.signed

    @property
    def is_narrow_range(self) -> bool | None:
        """Whether signed codes skip their most negative value (None when not quantizing)."""
        return None if not self.is_quant_enabled else self.spec.narrow_range

    def bit_width(self) -> jax.Array | None:
        """The codes' bit width (None when not quantizing)."""
        if not self.is_quant_enabled:
            return None
        return jnp.asarray(float(self.spec.bit_width), jnp.float32)

    def zero_point(self) -> jax.Array | None:
        """The zero point (0-d zero; None when not quantizing)."""
        if not self.is_quant_enabled:
            return None
        return jnp.zeros((), jnp.float32)

    def trace_flags(self) -> tuple:
        """Python-level switches a jitted trace depends on."""
        return (self.enabled,)

    def _check_load(self, name: str, value: Any, key: str) -> None:
        """Rejects a loaded learned scale (``value``) or statistic (``running``) that is unusable.

        ``key`` is the state-dict key, for the message. A log-domain ``value`` (log2
        of the threshold) may be any finite number; a linear one must be > 0 and a
        ``running`` statistic >= 0 (0: an all-zero input, scale 1).
        """
        if name not in ("value", "running") or isinstance(value, Tracer):
            return
        arr = np.asarray(value, np.float64)
        if name == "value" and _log_param(self.spec):
            ok, allowed = np.isfinite(arr), "finite values (the log2 of the threshold)"
        elif name == "value":
            ok, allowed = np.isfinite(arr) & (arr > 0), "values that are finite and > 0"
        else:
            ok, allowed = np.isfinite(arr) & (arr >= 0), "values that are finite and >= 0"
        if not ok.all():
            what = "learned scale" if name == "value" else "scale statistic"
            raise ValueError(
                f"load_state_dict: {key!r} ({what} of {self.spec.name}) has {int((~ok).sum())} "
                f"of {arr.size} value{'s' if arr.size != 1 else ''} unusable as a scale "
                f"(e.g. {arr[~ok].flat[0]}); allowed: {allowed}; nothing was loaded"
            )

    def _site(self) -> str:
        """``'<dotted name>' (<quantizer> of <layer type>)``, for error messages."""
        owner = _owner(self)
        of = f" of {type(owner).__name__}" if owner is not None else ""
        name = self.spec.name if self.spec is not None else "no quantizer"
        return f"{path_of(self)!r} ({name}{of})"

    def _quantize(self, x: jax.Array, scale: jax.Array) -> QuantTensor:
        """``x`` fake-quantized with ``scale`` (NaN blocks where ``x`` is not finite)."""
        full = scale.reshape((1,) * (x.ndim - scale.ndim) + scale.shape)  # qcore: same rank
        value, full = _poison(x, _fake_quant(x, full, self.spec), full)
        return self._qt(value, full.reshape(scale.shape))

    def _qt(self, value: jax.Array, scale: jax.Array) -> QuantTensor:
        return QuantTensor(
            value,
            scale,
            jnp.zeros((), value.dtype),
            jnp.asarray(float(self.spec.bit_width)),
            self.spec.signed,
            self.training,
        )

    def extra_repr(self) -> str:
        s = self.spec
        if s is None:
            return "no quantizer"
        return f"{s.name}: {s.qtype}, {s.scaling.value} scaling, per {s.per.value}"


def _owner(module: Module) -> Module | None:
    owner = module.__dict__.get("_owner")
    return owner[0]() if owner is not None else None


def _check_param(layer: Module | None, name: str, x: Any) -> None:
    """Policy for weights: a concrete non-finite value is an error naming the parameter."""
    prefix = path_of(layer) if layer is not None else ""
    where = f"{type(layer).__name__} " if layer is not None else ""
    param = f"{prefix}.{name}" if prefix else name
    _check_finite(
        x,
        lambda bad: (
            f"param {param!r} of {where}has {bad}; quantizing would hide them: "
            "fix or mask the weights first"
        ),
    )


class WeightQuantProxy(QuantProxy):
    """Quantizes weights; tracks the layers whose weights it serves.

    Args:
        quant: The quantizer class.
        layer: The first layer whose weight it quantizes.
        channel_axis: The output-channel axis of that weight (0 for
            ``(out, in, ...)``, 1 for transposed convolutions' ``(in, out, ...)``).
        input_axis: The input-channel axis (groups run along it).
    """

    def __init__(
        self, quant: type | None, layer: Module, channel_axis: int = 0, input_axis: int = 1
    ):
        super().__init__(quant, layer)
        self._tracked: list[tuple[weakref.ref, int, int]] = []
        if self.spec is None:
            return
        if self.spec.requires_input_scale:
            raise ValueError(
                f"weight_quant={self.spec.name} needs an input scale (it is a bias "
                "quantizer); use e.g. Int8WeightPerTensorFloat"
            )
        self._start_delay()
        self.track(layer, channel_axis, input_axis)

    def track(self, layer: Module, channel_axis: int = 0, input_axis: int = 1) -> None:
        """Adds a layer whose ``weight`` this proxy also quantizes (a shared quantizer)."""
        weight = getattr(layer, "weight", None)
        if weight is not None:
            self._blocks(weight, channel_axis, input_axis)  # group_size must divide it
        self._tracked.append((weakref.ref(layer), channel_axis, input_axis))
        if self.spec.scaling in (ScalingImplType.PARAMETER_FROM_STATS, ScalingImplType.PARAMETER):
            self.init_scale()

    def _weights(self) -> list[tuple[jax.Array, int, int]]:
        out = []
        for ref, c, i in self._tracked:
            layer = ref()
            if layer is not None and getattr(layer, "weight", None) is not None:
                _check_param(layer, "weight", layer.weight)
                out.append((layer.weight, c, i))
        return out

    def _blocks(self, w: jax.Array, c: int, i: int) -> tuple[tuple[int, ...], dict[int, int]]:
        per = self.spec.per
        if per is ScalingPerOutputType.TENSOR:
            return (), {}
        if per is ScalingPerOutputType.CHANNEL:
            return (c,), {}
        g = self.spec.group_size
        assert g is not None  # the solver sets it for per-group scales
        if w.shape[i] % g:
            raise ValueError(
                f"{self.spec.name}: group_size={g} must divide the weight's input-channel "
                f"dimension {w.shape[i]} (weight shape {w.shape})"
            )
        return (c,), {i: g}

    def _stat_threshold(self, w: jax.Array, c: int, i: int) -> jax.Array:
        weights = self._weights()
        if len(weights) <= 1:
            return _threshold(w, self.spec, *self._blocks(w, c, i))
        if self.spec.per is ScalingPerOutputType.TENSOR:
            flat = jnp.concatenate([jnp.ravel(x) for x, *_ in weights])
            return _threshold(flat, self.spec).reshape((1,) * w.ndim)
        if self.spec.per is ScalingPerOutputType.CHANNEL:
            rows = [jnp.moveaxis(x, cx, 0).reshape(x.shape[cx], -1) for x, cx, _ in weights]
            if len({r.shape[0] for r in rows}) != 1:
                raise ValueError(
                    f"a shared per-channel quantizer ({self.spec.name}) needs the same number "
                    f"of output channels in every layer; got {[r.shape[0] for r in rows]}"
                )
            t = _threshold(jnp.concatenate(rows, axis=1), self.spec, (0,))
            shape = [1] * w.ndim
            shape[c] = w.shape[c]
            return t.reshape(shape)
        raise ValueError(f"{self.spec.name}: per-group scales cannot be shared between layers")

    def _he_threshold(self) -> jax.Array:
        """He's ``sqrt(2 / fan_in)``, averaged over the tracked weights (Brevitas' ``HE``)."""
        fans = [math.prod(w.shape) // w.shape[c] for w, c, _ in self._weights()]
        return jnp.asarray(sum(math.sqrt(2.0 / f) for f in fans) / len(fans), jnp.float32)

    def _layers(self) -> list[Module]:
        return [m for m in (ref() for ref, *_ in self._tracked) if m is not None]

    def _scaling_init(self, shape: tuple[int, ...]) -> jax.Array:
        """``scaling_init`` resolved now, with ``module`` the layer (a tuple when shared)."""
        layers = self._layers()
        module = layers[0] if len(layers) == 1 else tuple(layers)
        quant: Any = self.quant  # set: only proxies with a quantizer initialise scales
        init = jnp.asarray(inject.resolve(quant.let(module=module), "scaling_init"))
        try:
            return jnp.broadcast_to(init.astype(jnp.float32), shape)
        except ValueError as e:
            raise ValueError(
                f"{self.spec.name}.scaling_init of shape {init.shape} does not fit the scale's "
                f"shape {shape}"
            ) from e

    def init_scale(self) -> None:
        """(Re-)initialises a learned scale from the tracked weights (``init_tensor_quant``).

        Statistics-based scales take the weights' statistic again; ``PARAMETER``
        scales take ``scaling_init`` again, resolved with the current weights (so
        ``@value def scaling_init(module): ...`` sees them).
        """
        weights = self._weights()
        if not weights:
            return
        w, c, i = weights[0]
        per_tensor = self.spec.per is ScalingPerOutputType.TENSOR
        if self.spec.scaling is ScalingImplType.PARAMETER:
            shape = [1] * w.ndim
            if not per_tensor:
                shape[c] = w.shape[c]
            t = self._scaling_init(tuple(shape))
        else:
            t = self._stat_threshold(w, c, i)
        if per_tensor:
            t = t.reshape(())  # Brevitas' 0-d per-tensor scale
        value = jnp.log2(jnp.maximum(t, 1e-30)) if _log_param(self.spec) else t
        if "value" in self._parameters:
            self.value = value
        else:
            self.value = Parameter(value)

    def _after_load(self, loaded: set[str]) -> None:
        from qtorchlike import config

        # New float weights arrived but no stored scale: re-initialise it (Brevitas'
        # REINIT_ON_STATE_DICT_LOAD), from statistics or from scaling_init resolved
        # with the loaded weights; a loaded scale is kept as is.
        learned = (ScalingImplType.PARAMETER_FROM_STATS, ScalingImplType.PARAMETER)
        if (
            config.REINIT_ON_STATE_DICT_LOAD
            and self.is_quant_enabled
            and self.spec.scaling in learned
            and "value" not in loaded
        ):
            self.init_scale()

    def scale_for(self, w: jax.Array, c: int = 0, i: int = 1) -> jax.Array:
        """The scale this proxy gives weight ``w`` now."""
        spec = self.spec
        if spec.scaling is ScalingImplType.CONST:
            t = jnp.asarray(spec.scaling_value, jnp.float32)
            return to_scale(t, spec).reshape(_const_shape(spec))
        if spec.scaling is ScalingImplType.HE:
            return to_scale(self._he_threshold(), spec).reshape(())
        if spec.scaling is ScalingImplType.STATS:
            scale = to_scale(self._stat_threshold(w, c, i), spec)
        else:
            scale = to_scale(self.value, spec, log_domain=_log_param(spec))
        return (
            scale.reshape(_const_shape(spec)) if spec.per is ScalingPerOutputType.TENSOR else scale
        )

    def forward(self, w: jax.Array, channel_axis: int = 0, input_axis: int = 1) -> Any:
        """Returns ``w`` quantized as a QuantTensor (``w`` itself when disabled).

        Raises:
            ValueError: If ``w`` is concrete and holds NaN or ±inf (the message names
                the parameter). Under ``jax.jit`` such a block's scale is NaN instead.
        """
        if not self.is_quant_enabled:
            return w
        layers = (ref() for ref, *_ in self._tracked)
        layer = next(
            (m for m in layers if m is not None and m._parameters.get("weight") is w), None
        )
        _check_param(layer, "weight", w)
        scale = self.scale_for(w, channel_axis, input_axis)
        return self._delayed(w, self._quantize_weight(w, scale, channel_axis))

    def _quantize_weight(self, w: jax.Array, scale: jax.Array, channel_axis: int) -> QuantTensor:
        """``w`` quantized with ``scale`` (a zero point's proxy adds it)."""
        return self._quantize(w, scale)

    def scale(self) -> jax.Array | None:
        """The scale of the (first) weight it serves, as ``quant_weight()`` gives it.

        None when not quantizing.
        """
        if not self.is_quant_enabled:
            return None
        weights = self._weights()
        if not weights:
            raise RuntimeError(f"weight quantizer {self._site()} serves no layer with a weight")
        return self.scale_for(*weights[0])

    def init_tensor_quant(self) -> None:
        """Brevitas' name for :meth:`init_scale`."""
        self.init_scale()


class ActQuantProxy(QuantProxy):
    """Quantizes activations with a constant, running-statistics or learned scale.

    Buffers: ``running`` (the threshold statistic) and ``counter`` (training
    steps seen). With ``PARAMETER_FROM_STATS`` the first
    ``collect_stats_steps`` training steps use each batch's statistic and
    accumulate ``running``; at the last of them the learned parameter ``value``
    takes ``running`` and from then on is trained. All of it is traced code
    (``jnp.where`` on ``counter``), so it runs under ``jax.jit``.
    """

    def __init__(self, quant: type | None) -> None:
        super().__init__(quant)
        self.calibrating = False
        spec = self.spec
        if spec is None:
            return
        if spec.per is ScalingPerOutputType.GROUP:
            raise ValueError(
                f"act_quant={spec.name}: activation scales are per tensor or per channel; got "
                "scaling_per_output_type=GROUP"
            )
        if spec.per is ScalingPerOutputType.CHANNEL and spec.channel_shape is None:
            raise inject.DependencyError(
                f"act_quant={spec.name}: per-channel activation scales need "
                "per_channel_broadcastable_shape (e.g. (1, C, 1, 1) for NCHW inputs), as in "
                "Brevitas; scaling_stats_permute_dims, if given, must move that channel axis "
                "first (e.g. (1, 0, 2, 3))"
            )
        if spec.requires_input_scale:
            raise ValueError(f"act_quant={spec.name} is a bias quantizer")
        if spec.scaling is ScalingImplType.HE:
            raise ValueError(
                f"act_quant={spec.name}: scaling_impl_type=HE is for weights (He's "
                "sqrt(2 / fan_in) needs a weight); Brevitas refuses it on activations too. "
                "Allowed here: CONST, STATS, PARAMETER, PARAMETER_FROM_STATS"
            )
        shape = self._scale_shape()
        if spec.scaling in (ScalingImplType.STATS, ScalingImplType.PARAMETER_FROM_STATS):
            # 1 until statistics arrive (scale 1/int_scaling, Brevitas' starting point).
            self.register_buffer("running", jnp.ones(shape, jnp.float32))
            self.register_buffer("counter", jnp.zeros((), jnp.int32))
        if spec.scaling in (ScalingImplType.PARAMETER, ScalingImplType.PARAMETER_FROM_STATS):
            init = spec.scaling_value if spec.scaling_value is not None else 1.0
            self.value = Parameter(
                jnp.full(shape, math.log2(init) if _log_param(spec) else init, jnp.float32)
            )
        self._start_delay()

    def _scale_shape(self) -> tuple[int, ...]:
        """``()`` per tensor, ``per_channel_broadcastable_shape`` per channel (Brevitas')."""
        if self.spec.per is ScalingPerOutputType.CHANNEL:
            assert self.spec.channel_shape is not None  # checked in __init__
            return self.spec.channel_shape
        return ()

    def _stat(self, x: jax.Array) -> jax.Array:
        """The statistic of batch ``x`` in the scale's shape."""
        shape = self._scale_shape()
        if not shape:
            return _threshold(x, self.spec).reshape(())
        axis = self.spec.channel_axis
        assert axis is not None
        if x.ndim != len(shape) or x.shape[axis] != shape[axis]:
            raise ValueError(
                f"activation quantizer {self._site()} has per-channel scales of shape {shape} "
                f"(per_channel_broadcastable_shape); it got an input of shape {x.shape}"
            )
        return _threshold(x, self.spec, (axis,)).reshape(shape)

    def trace_flags(self) -> tuple:  # noqa: D102
        return (self.enabled, self.calibrating)

    def _update_running(self, stat: jax.Array, momentum: float | None) -> None:
        self.running, self.counter = _running(self.running, self.counter, stat, momentum)

    def _check_batch(self, x: jax.Array) -> None:
        _check_finite(
            x,
            lambda bad: (
                f"activation quantizer {self._site()} got {bad} while collecting "
                "statistics; they would make its scale NaN: fix or mask the input first"
            ),
        )

    def _collect(self, x: jax.Array) -> jax.Array:
        """The statistic of batch ``x``, which must be finite when concrete."""
        self._check_batch(x)
        return self._stat(x)

    def start_collection(self) -> None:
        """Starts fresh statistics (used by :func:`qtorchlike.calibration_mode`)."""
        if "running" in self._buffers:
            self.running = jnp.ones(self._scale_shape(), jnp.float32)
            self.counter = jnp.zeros((), jnp.int32)

    def finish_collection(self) -> None:
        """Ends the statistics phase now: a learned scale takes the running statistic."""
        if self.spec.scaling is ScalingImplType.PARAMETER_FROM_STATS:
            running = self.running
            self.value = jnp.log2(running) if _log_param(self.spec) else running
            self.counter = jnp.asarray(max(self.spec.collect_stats_steps, 1), jnp.int32)

    def threshold(self, x: jax.Array | None = None) -> jax.Array:
        """The linear-domain threshold used now (updating statistics when training on ``x``)."""
        return self._threshold_now(x)[0]

    def _threshold_now(self, x: jax.Array | None) -> tuple[jax.Array, Any]:
        """The threshold and whether its scale is restricted (False: a collecting batch)."""
        t = self._threshold_of(x)
        return t if isinstance(t, tuple) else (t, True)

    def _threshold_of(self, x: jax.Array | None) -> Any:
        spec = self.spec
        if spec.scaling is ScalingImplType.CONST:
            return jnp.asarray(spec.scaling_value, jnp.float32)
        log = _log_param(spec)
        learned = None
        if "value" in self._parameters:
            learned = jnp.exp2(self.value) if log else self.value
        if learned is None:  # no learned value: statistics only (STATS)
            learned = self.running
        if spec.scaling is ScalingImplType.PARAMETER:
            return learned
        if self.calibrating and x is not None:
            batch = self._collect(x)
            # Calibration: an exact running mean over every batch, no phase limit.
            self._update_running(batch, None)
            return batch
        if spec.scaling is ScalingImplType.STATS:
            if self.training and x is not None:
                batch = self._collect(x)
                self._update_running(batch, spec.momentum)
                return batch
            self._warn_if_empty()
            return self.running
        # PARAMETER_FROM_STATS: batch statistics for the first collect_stats_steps
        # training calls, then the learned value (which takes the running statistic).
        steps = max(spec.collect_stats_steps, 1)
        if self.training and x is not None:
            if not isinstance(self.counter, Tracer) and int(self.counter) < steps:
                self._check_batch(x)

            # lax.cond, not jnp.where: the percentile (a sort) runs only while collecting.
            # A collecting batch's scale is its statistic over int_scaling, not
            # restricted to a power of two (Brevitas restricts only the learned value).
            def collect(state):
                running, counter, value = state
                batch = self._stat(x)
                running, counter = _running(running, counter, batch, spec.momentum)
                handover = jnp.log2(running) if log else running
                value = jnp.where(counter == steps, handover, value)
                return (running, counter, value), batch, jnp.asarray(False)

            def learn(state):
                return state, jnp.exp2(state[2]) if log else state[2], jnp.asarray(True)

            state = (self.running, self.counter, self.value)
            (self.running, self.counter, self.value), t, restricted = jax.lax.cond(
                self.counter < steps, collect, learn, state
            )
            return t, restricted
        self._warn_if_empty()
        return jnp.where(self.counter < steps, self.running, learned)

    def scale(self) -> jax.Array | None:
        """The scale an eval-mode call would use now (statistics are not updated).

        None when not quantizing.
        """
        if not self.is_quant_enabled:
            return None
        shape = self._scale_shape() or _const_shape(self.spec)
        return to_scale(self._threshold_of(None), self.spec).reshape(shape)

    def _warn_if_empty(self) -> None:
        # Brevitas silently uses scale 1/128 here; say what is going on instead.
        counter = self.counter
        if not isinstance(counter, Tracer) and int(counter) == 0:
            warnings.warn(
                f"{self.spec.name}: evaluating an activation quantizer that has seen no "
                "statistics yet (its scale falls back to 1/int_scaling); run "
                "qtorchlike.calibration_mode(model) on a few batches, or train first",
                stacklevel=3,
            )

    def forward(self, x: Any) -> Any:
        """Returns ``x`` quantized as a QuantTensor (``x`` itself when disabled).

        Non-finite values make the (per-tensor) scale and every output value NaN.

        Raises:
            ValueError: If statistics are being collected (training with statistics,
                :func:`qtorchlike.calibration_mode`) and concrete ``x`` holds NaN or
                ±inf; the statistics are left as they were. Under ``jax.jit`` such a
                batch is left out of the running statistics instead.
        """
        xv = x.value if isinstance(x, QuantTensor) else jnp.asarray(x)
        if not self.is_quant_enabled:
            return x
        t, restricted = self._threshold_now(xv)
        if self.calibrating:
            return xv  # observe only: the model runs in float during calibration
        shape = self._scale_shape() or _const_shape(self.spec)
        scale = to_scale(t, self.spec).reshape(shape)
        if restricted is not True:
            unrestricted = to_scale(t, self.spec, restrict=False).reshape(shape)
            scale = jnp.where(restricted, scale, unrestricted)
        out = self._quantize(xv, scale)
        return self._delayed(xv, out)


class BiasQuantProxy(QuantProxy):
    """Quantizes biases; with ``requires_input_scale`` the scale is input × weight scale."""

    def scale(self) -> jax.Array | None:
        """The scale of a constant bias quantizer; None otherwise (it depends on the call)."""
        if not self.is_quant_enabled or self.spec.scaling is not ScalingImplType.CONST:
            return None
        return to_scale(jnp.asarray(self.spec.scaling_value, jnp.float32), self.spec).reshape(1)

    def forward(self, bias: jax.Array, input_scale: Any = None, weight_scale: Any = None) -> Any:
        """Returns ``bias`` quantized (a QuantTensor) or ``bias`` when disabled.

        Raises:
            ValueError: If the quantizer needs an input scale and the input was
                not quantized (give the layer an ``input_quant``), or if a concrete
                ``bias`` holds NaN or ±inf (the message names the parameter).
        """
        if not self.is_quant_enabled:
            return bias
        _check_param(_owner(self), "bias", bias)
        spec = self.spec
        if spec.requires_input_scale:
            if input_scale is None or weight_scale is None:
                raise MissingInputScaleError(
                    f"bias_quant={spec.name} needs the input's scale (bias scale = input "
                    "scale x weight scale) but the layer's input is not a QuantTensor: set "
                    "input_quant=... on the layer, feed it a QuantTensor, or use a bias "
                    "quantizer with its own scale"
                )
            if jnp.size(input_scale) != 1:
                raise ValueError(
                    f"bias_quant={spec.name} scales the bias by input scale x weight scale, "
                    f"but the input has {jnp.size(input_scale)} scales (per channel), which "
                    "give the sum no single grid: use a per-tensor input quantizer or a bias "
                    "quantizer with its own scale (e.g. Int8BiasPerTensorFloatInternalScaling)"
                )
            scale = jnp.reshape(input_scale, (-1,)) * jnp.reshape(weight_scale, (-1,))
            scale = jax.lax.stop_gradient(jnp.broadcast_to(scale, bias.shape))
        elif spec.scaling is ScalingImplType.CONST:
            scale = to_scale(jnp.asarray(spec.scaling_value, jnp.float32), spec).reshape(1)
        else:
            scale = to_scale(_threshold(bias, spec), spec)
        return self._quantize(bias, scale)


def _running(
    running: jax.Array, counter: jax.Array, stat: jax.Array, momentum: float | None
) -> tuple[jax.Array, jax.Array]:
    """Running statistic and count after ``stat``; a non-finite ``stat`` is left out.

    Eagerly a non-finite batch is an error before this runs; under ``jax.jit`` the
    batch's own output is NaN and the running statistic stays clean.
    """
    n = counter.astype(jnp.float32)
    if momentum is None:  # cumulative average
        new = (running * n + stat) / (n + 1)
    else:
        new = jnp.where(counter == 0, stat, (1 - momentum) * running + momentum * stat)
    ok = jnp.all(jnp.isfinite(stat))  # per-channel statistics: the batch counts whole
    return jnp.where(ok, new, running), jnp.where(ok, counter + 1, counter)


def scale_threshold(proxy: WeightQuantProxy) -> np.ndarray:
    """The linear-domain threshold of a learned weight scale (``max|w|`` at init)."""
    value = np.asarray(proxy.value, np.float64)
    return np.exp2(value) if _log_param(proxy.spec) else value


def has_quant(proxy: QuantProxy | None) -> bool:
    """Whether ``proxy`` has a quantizer (a layer given none holds a disabled proxy)."""
    return proxy is not None and proxy.spec is not None


# Brevitas' class names.
WeightQuantProxyFromInjector = WeightQuantProxy
ActQuantProxyFromInjector = ActQuantProxy
BiasQuantProxyFromInjector = BiasQuantProxy


def is_quant(spec: QuantSpec) -> bool:
    """Whether codes are integers (so the integer kernels of qcore apply)."""
    return spec.quant_type is QuantType.INT
