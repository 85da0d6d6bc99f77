"""Proxies for Brevitas' shifted (zero-point) and MSE quantizers (internal).

The layers build these instead of the plain proxies of :mod:`qtorchlike._proxy`
when a quantizer has a zero point, an MSE search, or a ``MIN_MAX`` /
``PERCENTILE_INTERVAL`` statistic (:func:`make_weight_proxy`,
:func:`make_act_proxy`). Statistics are taken per block: the values sharing one
scale, viewed as rows ``(blocks, n)`` (one row per tensor, or per output
channel).

Brevitas 0.13.4's rules, with the file each comes from (under ``brevitas/``):

* core/stats/stats_op.py ``AbsMinMax`` ``|max - min(min, 0)|``, ``PercentileInterval``
  ``|x_(hk) - min(x_(lk), 0)|`` with ``lk = ceil(q_lo/100 n)``, ``hk = floor(q_hi/100 n
  + 1/2)`` (ranks of the signed values), ``NegativeMinOrZero`` ``min(min, 0)``,
  ``NegativePercentileOrZero`` ``min(x_(lk), 0)``.
* core/zero_point.py ``_ScaleShiftZeroPoint``: the integer zero point is
  ``clamp(round(-stat / scale), 0, 2^bits - 1)``, rounded half to even; codes are
  ``clamp(round(x / scale + zp), 0, 2^bits - 1)`` and values ``(codes - zp) * scale``
  (core/quant/int_base.py ``IntQuant``); the QuantTensor holds that integer zero
  point, in the scale's shape.
* core/stats/stats_op.py ``MSE`` with ``mse_grid_search``: candidates
  ``xl + (xr - xl) t`` over ``[init/iters, init]`` (ordered, so a negative zero-point
  statistic works too), ``t = 0`` then torch's float32 ``linspace(1/(iters-1), 1,
  iters-1)``; each candidate is evaluated with the whole quantizer (its own
  rounding and clamping; the scale is the candidate over the integer range, clamped
  below at 1e-10) and the first with the least ``sum((x - q)^2)`` per block wins.
  A shifted quantizer searches the scale first, with the zero point of the
  zero point search's stored candidate (``min(min(x), 0)`` before the first search),
  then the zero point at the chosen scale.
* core/scaling/standalone.py ``ParameterFromRuntimeStatsScaling`` and
  core/zero_point.py ``ParameterFromRuntimeZeroPoint``: activations collect both
  statistics for ``collect_stats_steps`` training calls (momentum 0.1), then learn
  them. The zero point's MSE search on the last collecting call runs after the
  scale's counter reached ``collect_stats_steps``, so it sees the running scale
  (the value the learned scale takes), not the batch's.

Cost of the MSE search: the ``mse_iters`` (20) candidates are evaluated at once
(vectorised), so a search holds 20 quantized copies of the tensor (or block
rows) in memory and does 20 fake-quantizations; a shifted quantizer searches
twice (scale, then zero point). Weights search once, at construction and on
``load_state_dict``; activations on each of their ``collect_stats_steps``
training calls (inside ``jax.lax.cond``, so not afterwards).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

import qcore
from qcore import numerics
from qtorchlike import random
from qtorchlike._proxy import (
    ActQuantProxy,
    WeightQuantProxy,
    _log_param,
    _poison,
    _running,
    to_scale,
)
from qtorchlike.nn.module import Module, Parameter
from qtorchlike.quant_tensor import QuantTensor
from qtorchlike.solver import (
    QuantSpec,
    ScalingImplType,
    ScalingPerOutputType,
    StatsOp,
    ZeroPointImplType,
    ZeroPointStatsOp,
    solve,
)

_MIN_SCALE = 1e-10  # Brevitas' scaling_min_val for these quantizers
# torch.linspace(1/19, 1, 19) in float32, bit for bit (NumPy's linspace differs in one
# value), preceded by 0: the grid of Brevitas' 20-candidate MSE search.
_GRID_20 = np.array(
    [0.0]
    + [
        float.fromhex(h)
        for h in (
            "0x1.af286cp-5", "0x1.af286cp-4", "0x1.435e50p-3", "0x1.af286cp-3",
            "0x1.0d7944p-2", "0x1.435e50p-2", "0x1.79435ep-2", "0x1.af286cp-2",
            "0x1.e50d7ap-2", "0x1.0d7944p-1", "0x1.286bcap-1", "0x1.435e50p-1",
            "0x1.5e50d8p-1", "0x1.79435ep-1", "0x1.9435e4p-1", "0x1.af286cp-1",
            "0x1.ca1af2p-1", "0x1.e50d7ap-1", "0x1.000000p+0",
        )
    ],
    np.float32,
)  # fmt: skip


@jax.tree_util.register_pytree_node_class
class ShiftedQuantTensor(QuantTensor):
    """A QuantTensor from a quantizer with a zero point.

    The same data as a :class:`~qtorchlike.QuantTensor`; its type tells layers,
    also under ``jax.jit`` where the zero point's value is unknown, that the zero
    point may be nonzero (so the integer path and the accumulator's grid, which
    assume zero, do not apply).
    """

    __slots__ = ()


def has_zero_point(spec: QuantSpec) -> bool:
    """Whether a quantizer's codes have a zero point."""
    return spec.zero_point is not ZeroPointImplType.ZERO


def may_have_zero_point(q: QuantTensor) -> bool:
    """Whether ``q``'s zero point may be nonzero (by value when concrete, else by type)."""
    zp = q.zero_point
    if not isinstance(zp, Tracer):
        return bool(np.any(np.asarray(zp) != 0))
    return isinstance(q, ShiftedQuantTensor)


def _extended(spec: QuantSpec) -> bool:
    return (
        has_zero_point(spec)
        or spec.mse
        or spec.stats_op in (StatsOp.MIN_MAX, StatsOp.PERCENTILE_INTERVAL)
    )


def make_weight_proxy(q: Any, layer: Module, channel_axis: int, input_axis: int) -> Any:
    """The weight proxy quantizer class ``q`` needs (a disabled one for None)."""
    # ``module`` (the layer) for @value functions that ask for it, as the proxy gives.
    if q is not None and _extended(solve(q.let(module=layer))):
        return ZeroPointWeightQuantProxy(q, layer, channel_axis, input_axis)
    return WeightQuantProxy(q, layer, channel_axis, input_axis)


def make_act_proxy(q: type | None) -> Any:
    """The activation proxy quantizer class ``q`` needs (a disabled one for None)."""
    return ZeroPointActQuantProxy(q) if q is not None and _extended(solve(q)) else ActQuantProxy(q)


# -- statistics of rows (blocks, n), float32, no gradient ------------------------------------


def _kth(rows: jax.Array, k: int) -> jax.Array:
    """torch.kthvalue along the last axis (1-indexed)."""
    n = rows.shape[-1]
    return jnp.sort(rows, axis=-1)[..., min(max(k, 1), n) - 1]


def _neg_min_or_zero(rows: jax.Array) -> jax.Array:
    return jnp.minimum(rows.min(axis=-1), 0.0)


def _neg_percentile_or_zero(rows: jax.Array, q: float) -> jax.Array:
    return jnp.minimum(_kth(rows, math.ceil(0.01 * q * rows.shape[-1])), 0.0)


def _abs_min_max(rows: jax.Array) -> jax.Array:
    return jnp.abs(rows.max(axis=-1) - _neg_min_or_zero(rows))


def _percentile_interval(rows: jax.Array, low_q: float, high_q: float) -> jax.Array:
    n = rows.shape[-1]
    high = _kth(rows, math.floor(0.01 * high_q * n + 0.5))
    return jnp.abs(high - _neg_percentile_or_zero(rows, low_q))


def _abs_percentile(rows: jax.Array, q: float) -> jax.Array:
    return _kth(jnp.abs(rows), math.floor(0.01 * q * rows.shape[-1] + 0.5))


def _init_stat(rows: jax.Array, spec: QuantSpec) -> jax.Array:
    """The threshold statistic per row (the start of an MSE search)."""
    op = spec.stats_op
    if op is StatsOp.MIN_MAX:
        return _abs_min_max(rows)
    if op is StatsOp.PERCENTILE_INTERVAL:
        return _percentile_interval(rows, spec.low_percentile, spec.percentile)
    if op is StatsOp.PERCENTILE:
        return _abs_percentile(rows, spec.percentile)
    if op is StatsOp.AVE:
        return jnp.mean(jnp.abs(rows), axis=-1)
    return jnp.abs(rows).max(axis=-1)


def _code_range(spec: QuantSpec) -> tuple[float, float]:
    b = spec.bit_width
    if not spec.signed:
        return 0.0, float(2**b - 1 - spec.narrow_range)
    return float(-(2 ** (b - 1)) + spec.narrow_range), float(2 ** (b - 1) - 1)


def zero_point_int(low: jax.Array, scale: jax.Array, spec: QuantSpec) -> jax.Array:
    """``clamp(round(|low| / scale), 0, 2^bits - 1)`` with a straight-through rounding.

    ``low`` is the zero-point statistic (<= 0); Brevitas negates it (weights) or
    takes its magnitude (activations), the same for a statistic <= 0.
    """
    z = numerics.divide(jnp.abs(low), scale)
    z = z + jax.lax.stop_gradient(jnp.round(z) - z)
    return jnp.clip(z, 0.0, float(2**spec.bit_width - 1))


def _grid(iters: int) -> np.ndarray:
    if iters == 20:
        return _GRID_20
    # Another mse_iters: NumPy's float32 linspace (torch's may differ by an ulp).
    return np.concatenate([[0.0], np.linspace(1.0 / (iters - 1), 1.0, iters - 1)]).astype(
        np.float32
    )


def _candidates(init: jax.Array, iters: int) -> jax.Array:
    """``(iters, blocks)``: Brevitas' grid between ``init / iters`` and ``init``."""
    base = init / iters
    xl, xr = jnp.minimum(base, init), jnp.maximum(base, init)
    t = jnp.asarray(_grid(iters))[:, None]
    return xl[None] + (xr - xl)[None] * t


def _losses(rows: jax.Array, scale: jax.Array, zp: jax.Array, spec: QuantSpec) -> jax.Array:
    """``sum((x - q)^2)`` per candidate and row; ``scale``, ``zp``: ``(iters, blocks)``."""
    lo, hi = _code_range(spec)
    s, z = scale[..., None], zp[..., None]
    codes = jnp.clip(jnp.round(numerics.divide(rows[None], s) + z), lo, hi)
    return jnp.sum((rows[None] - (codes - z) * s) ** 2, axis=-1)


def _first_best(cands: jax.Array, losses: jax.Array) -> jax.Array:
    """The first candidate with the least loss per row (Brevitas keeps a strictly smaller one)."""
    idx = jnp.argmin(losses, axis=0)
    return jnp.take_along_axis(cands, idx[None], axis=0)[0]


def mse_threshold(rows: jax.Array, spec: QuantSpec, low: jax.Array | None = None) -> jax.Array:
    """The MSE search's threshold per row; ``low``: the zero-point statistic to use."""
    div = spec.int_scaling  # float scales only: no power-of-two rounding to mirror
    cands = _candidates(_init_stat(rows, spec), spec.mse_iters)
    scale = jnp.maximum(cands, _MIN_SCALE) / div
    zp = jnp.zeros_like(scale) if low is None else zero_point_int(low[None], scale, spec)
    return _first_best(cands, _losses(rows, scale, zp, spec))


def mse_zero_point(rows: jax.Array, scale: jax.Array, spec: QuantSpec) -> jax.Array:
    """The MSE search's zero-point statistic (<= 0) per row at ``scale`` (per row)."""
    cands = _candidates(_neg_min_or_zero(rows), spec.mse_iters)
    s = jnp.broadcast_to(scale, cands.shape)
    return _first_best(cands, _losses(rows, s, zero_point_int(cands, s, spec), spec))


def _low_stat(rows: jax.Array, spec: QuantSpec) -> jax.Array:
    if spec.zero_point_stats is ZeroPointStatsOp.NEGATIVE_PERCENTILE_OR_ZERO:
        return _neg_percentile_or_zero(rows, spec.low_percentile)
    return _neg_min_or_zero(rows)


class _ZeroPointQuantize:
    """Quantization with an integer zero point (mixed into both proxies)."""

    spec: QuantSpec
    training: bool

    def _quantize_zp(self, x: jax.Array, scale: jax.Array, zp: Any) -> QuantTensor:
        if zp is None:
            return self._quantize(x, scale)  # type: ignore[attr-defined]
        spec = self.spec
        full = scale.reshape((1,) * (x.ndim - scale.ndim) + scale.shape)
        zfull = jnp.broadcast_to(zp, scale.shape).reshape(full.shape)
        key = random.next_key() if spec.rounding == "stochastic" else None
        value = qcore.fake_quant_with_scale(
            x,
            spec.qtype,
            full,
            zfull,
            narrow_range=spec.narrow_range,
            rounding=spec.rounding,
            key=key,
        )
        value, full = _poison(x, value, full)
        return ShiftedQuantTensor(
            value,
            full.reshape(scale.shape),
            jnp.broadcast_to(zp, scale.shape).astype(value.dtype),
            jnp.asarray(float(spec.bit_width)),
            spec.signed,
            self.training,
        )


class ZeroPointWeightQuantProxy(_ZeroPointQuantize, WeightQuantProxy):
    """Weights with ``MIN_MAX`` statistics, an MSE-searched scale, and/or a zero point.

    A learned zero point (``ParameterFromStatsFromParameterZeroPoint``) is the
    parameter ``zero_point_value`` (Brevitas' statistic, <= 0), initialised with the
    scale.
    """

    def __init__(self, quant: type, layer: Module, channel_axis: int = 0, input_axis: int = 1):
        spec = solve(quant.let(module=layer))
        if spec.zero_point is ZeroPointImplType.PARAMETER_FROM_STATS and not spec.mse:
            # Brevitas' ParameterFromRuntimeZeroPoint is for activations.
            raise ValueError(
                f"weight_quant={spec.name}: a learned weight zero point is initialised by the "
                "MSE search here (MSEWeightZeroPoint); for a zero point from the weight's "
                "minimum use ShiftedMinUintQuant (StatsFromParameterZeroPoint)"
            )
        if spec.zero_point is ZeroPointImplType.STATS and (
            spec.zero_point_stats is not ZeroPointStatsOp.NEGATIVE_MIN_OR_ZERO
        ):
            raise ValueError(
                f"weight_quant={spec.name}: a weight zero point from statistics uses "
                "NegativeMinOrZero (Brevitas' ShiftedMinUintQuant)"
            )
        super().__init__(quant, layer, channel_axis, input_axis)

    def _rows(self, w: jax.Array, c: int) -> tuple[jax.Array, tuple[int, ...]]:
        """Every tracked weight's values as rows (one per channel or one), and the scale shape."""
        weights = self._weights()
        if len(weights) <= 1:
            weights = [(w, c, 1)]
        per_tensor = self.spec.per is ScalingPerOutputType.TENSOR
        if per_tensor:
            rows = jnp.concatenate([jnp.ravel(x) for x, *_ in weights])[None]
            shape: tuple[int, ...] = (1,) * w.ndim
        else:
            parts = [jnp.moveaxis(x, cx, 0).reshape(x.shape[cx], -1) for x, cx, _ in weights]
            if len({p.shape[0] for p in parts}) != 1:
                raise ValueError(
                    f"a shared per-channel quantizer ({self.spec.name}) needs the same number "
                    f"of output channels in every layer; got {[p.shape[0] for p in parts]}"
                )
            rows = jnp.concatenate(parts, axis=1)
            shape = tuple(w.shape[c] if a == c else 1 for a in range(w.ndim))
        return jax.lax.stop_gradient(rows.astype(jnp.float32)), shape

    def _stat_threshold(self, w: jax.Array, c: int, i: int) -> jax.Array:
        spec = self.spec
        if not spec.mse and spec.stats_op not in (StatsOp.MIN_MAX, StatsOp.PERCENTILE_INTERVAL):
            return super()._stat_threshold(w, c, i)
        rows, shape = self._rows(w, c)
        if spec.mse:
            low = _neg_min_or_zero(rows) if has_zero_point(spec) else None
            t = mse_threshold(rows, spec, low)
        else:
            t = _init_stat(rows, spec)
        return t.reshape(shape)

    def init_scale(self) -> None:
        """(Re-)initialises the learned scale and, if learned, the zero point (MSE searches)."""
        super().init_scale()
        if self.spec.zero_point is not ZeroPointImplType.PARAMETER_FROM_STATS:
            return
        weights = self._weights()
        if not weights:
            return
        w, c, _ = weights[0]
        rows, shape = self._rows(w, c)
        scale = to_scale(self.value, self.spec, log_domain=_log_param(self.spec))
        low = mse_zero_point(rows, scale.reshape(-1), self.spec).reshape(shape)
        if "zero_point_value" in self._parameters:
            self.zero_point_value = low
        else:
            self.zero_point_value = Parameter(low)

    def zero_point(self) -> jax.Array | None:
        """The zero point of the (first) weight it serves (None when not quantizing)."""
        if not self.is_quant_enabled:
            return None
        w, c, i = self._weights()[0]
        return self.zero_point_for(w, self.scale_for(w, c, i), c)

    def zero_point_for(self, w: jax.Array, scale: jax.Array, c: int = 0) -> jax.Array | None:
        """The integer zero point (the scale's shape) for weight ``w`` at ``scale``."""
        spec = self.spec
        if spec.zero_point is ZeroPointImplType.ZERO:
            return None
        if spec.zero_point is ZeroPointImplType.STATS:
            rows, shape = self._rows(w, c)
            low = _neg_min_or_zero(rows).reshape(shape)
        else:
            low = self.zero_point_value
        return zero_point_int(low.reshape(scale.shape), scale, spec)

    def _quantize_weight(self, w: jax.Array, scale: jax.Array, channel_axis: int) -> Any:
        """``w`` quantized with ``scale`` and its zero point."""
        return self._quantize_zp(w, scale, self.zero_point_for(w, scale, channel_axis))


class ZeroPointActQuantProxy(_ZeroPointQuantize, ActQuantProxy):
    """Activations with a zero point, an MSE-searched scale, or an interval statistic.

    Per tensor only. Besides ``running``/``counter``/``value`` (the scale's), a
    zero point has the buffer ``zero_point_running`` and the parameter
    ``zero_point_value`` (Brevitas' statistic, <= 0), collected and handed over
    with the scale; an MSE zero point also keeps its last search's result in the
    non-persistent buffer ``zero_point_candidate`` (NaN before the first), which the
    next scale search starts from, as Brevitas does.
    """

    def __init__(self, quant: type) -> None:
        super().__init__(quant)
        spec = self.spec
        if spec.per is not ScalingPerOutputType.TENSOR:
            raise ValueError(
                f"act_quant={spec.name}: zero points, MSE searches and interval statistics of "
                "activations are per tensor here (as Brevitas' Shifted*/ *MSE activation "
                "quantizers)"
            )
        if has_zero_point(spec):
            if spec.zero_point is not ZeroPointImplType.PARAMETER_FROM_STATS or (
                spec.scaling is not ScalingImplType.PARAMETER_FROM_STATS
            ):
                raise ValueError(
                    f"act_quant={spec.name}: an activation zero point is collected from "
                    "training batches and then learned (ParameterFromRuntimeZeroPoint), with a "
                    "scale collected the same way (scaling_impl_type=PARAMETER_FROM_STATS)"
                )
            self.register_buffer("zero_point_running", jnp.zeros((), jnp.float32))
            self.zero_point_value = Parameter(jnp.zeros((), jnp.float32))
            if spec.zero_point_stats is ZeroPointStatsOp.MSE:
                self.register_buffer(
                    "zero_point_candidate", jnp.full((), jnp.nan, jnp.float32), persistent=False
                )
        if spec.mse and spec.scaling is not ScalingImplType.PARAMETER_FROM_STATS:
            raise ValueError(f"act_quant={spec.name}: MSE scales are collected, then learned")

    def _stat(self, x: jax.Array) -> jax.Array:
        spec = self.spec
        rows = jax.lax.stop_gradient(jnp.asarray(x, jnp.float32).reshape(1, -1))
        if not spec.mse:
            return _init_stat(rows, spec).reshape(())
        low = None
        if has_zero_point(spec):
            low = _neg_min_or_zero(rows)
            if "zero_point_candidate" in self._buffers:
                cand = self.zero_point_candidate
                low = jnp.where(jnp.isnan(cand), low, cand)
        return mse_threshold(rows, spec, low).reshape(())

    def start_collection(self) -> None:  # noqa: D102
        super().start_collection()
        if "zero_point_running" in self._buffers:
            self.zero_point_running = jnp.zeros((), jnp.float32)
        if "zero_point_candidate" in self._buffers:
            self.zero_point_candidate = jnp.full((), jnp.nan, jnp.float32)

    def finish_collection(self) -> None:  # noqa: D102
        super().finish_collection()
        if "zero_point_running" in self._buffers:
            self.zero_point_value = self.zero_point_running

    def zero_point(self) -> jax.Array | None:
        """The zero point an eval-mode call would use now (None when not quantizing)."""
        return self.eval_zero_point() if self.is_quant_enabled else None

    def eval_zero_point(self) -> jax.Array | None:
        """The evaluation-mode integer zero point (None without one)."""
        if not has_zero_point(self.spec):
            return None
        scale = to_scale(jnp.asarray(self.threshold(None), jnp.float32), self.spec).reshape(())
        return zero_point_int(self._eval_low(), scale, self.spec)

    def _eval_low(self) -> jax.Array:
        steps = max(self.spec.collect_stats_steps, 1)
        return jnp.where(self.counter < steps, self.zero_point_running, self.zero_point_value)

    def _batch_low(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        rows = jax.lax.stop_gradient(jnp.asarray(x, jnp.float32).reshape(1, -1))
        if self.spec.zero_point_stats is ZeroPointStatsOp.MSE:
            low = mse_zero_point(rows, jax.lax.stop_gradient(scale).reshape(1), self.spec)
            return low.reshape(())
        return _low_stat(rows, self.spec).reshape(())

    def _zero_point_low(self, x: jax.Array, counter0: jax.Array, t: jax.Array) -> jax.Array:
        """This call's zero-point statistic (<= 0), updating the zero point's state.

        ``counter0``: the scale's counter before this call; ``t``: this call's threshold.
        """
        spec = self.spec
        momentum = None if self.calibrating else spec.momentum
        steps = max(spec.collect_stats_steps, 1)
        collected = self.counter > counter0  # the scale's statistic counted (finite)
        if self.calibrating:
            batch_scale = to_scale(t, spec, restrict=False)
            low = self._batch_low(x, batch_scale)
            new, _ = _running(self.zero_point_running, counter0, low, momentum)
            self.zero_point_running = jnp.where(collected, new, self.zero_point_running)
            if "zero_point_candidate" in self._buffers:
                self.zero_point_candidate = low
            return low
        if not self.training:
            return self._eval_low()
        cand = self._buffers.get("zero_point_candidate")

        def collect(state):
            running, value, cand = state
            # The last collecting call: the scale has been handed over already.
            last = counter0 + 1 == steps
            search_scale = jnp.where(
                last, to_scale(self.running, spec), to_scale(t, spec, restrict=False)
            )
            low = self._batch_low(x, search_scale)
            new, _ = _running(running, counter0, low, momentum)
            running = jnp.where(collected, new, running)
            value = jnp.where(last & collected, running, value)
            return (running, value, low), low

        def learn(state):
            return state, state[1]

        state = (self.zero_point_running, self.zero_point_value, cand)
        if cand is None:
            state = (*state[:2], jnp.zeros((), jnp.float32))
        (running, value, new_cand), low = jax.lax.cond(counter0 < steps, collect, learn, state)
        self.zero_point_running, self.zero_point_value = running, value
        if cand is not None:
            self.zero_point_candidate = new_cand
        return low

    def forward(self, x: Any) -> Any:
        """Returns ``x`` quantized (with its zero point) as a QuantTensor (``x`` when disabled)."""
        xv = x.value if isinstance(x, QuantTensor) else jnp.asarray(x)
        if not self.enabled:
            return x
        counter0 = self.counter
        t, restricted = self._threshold_now(xv)
        low = None
        if has_zero_point(self.spec):
            low = self._zero_point_low(xv, counter0, t)
        if self.calibrating:
            return xv
        scale = to_scale(t, self.spec).reshape(())
        if restricted is not True:
            unrestricted = to_scale(t, self.spec, restrict=False).reshape(())
            scale = jnp.where(restricted, scale, unrestricted)
        zp = None if low is None else zero_point_int(low, scale, self.spec)
        out = self._quantize_zp(xv, scale, zp)
        return self._delayed(xv, out)
