"""Float64 NumPy references of Brevitas 0.13.4's shifted (zero-point) and MSE quantizers.

NumPy only (no JAX, no qtorchlike), so the same functions can run next to real
Brevitas: every rule here was checked against Brevitas 0.13.4 (torch CPU) on the
inputs that test_shifted_mse.py uses. The Brevitas files each rule comes from
(paths under ``brevitas/``) are named in the docstrings.

Blocks: ``x`` is viewed as ``(blocks, -1)`` (one row per output channel, or one
row for a per-tensor scale); statistics, searches and losses are per row.
"""

import math

import numpy as np

MSE_ITERS = 20  # quant/base.py MSE*SubInjector.mse_iters
SCALING_MIN_VAL = 1e-10  # quant/base.py *Scaling.scaling_min_val


def rows(x, per_channel: bool):
    """``x`` as float64 ``(blocks, n)``: per output channel (axis 0) or one row."""
    x = np.asarray(x, np.float64)
    return x.reshape(x.shape[0], -1) if per_channel else x.reshape(1, -1)


def kth(row, k: int) -> float:
    """torch.kthvalue: the k-th smallest value (1-indexed)."""
    return float(np.sort(row)[k - 1])


def percentile_interval(row, low_q=0.001, high_q=99.999) -> float:
    """core/stats/stats_op.py ``PercentileInterval``: ``|x_(hk) - min(x_(lk), 0)|``.

    ``lk = ceil(low_q/100 * n)``, ``hk = floor(high_q/100 * n + 1/2)`` (nearest ranks
    of the signed values, not of ``|x|``).

    Example:
        >>> percentile_interval(np.arange(-3.0, 7.0), 10.0, 90.0)  # lk = 1, hk = 9
        8.0
    """
    n = row.size
    low = min(kth(row, math.ceil(0.01 * low_q * n)), 0.0)
    return abs(kth(row, math.floor(0.01 * high_q * n + 0.5)) - low)


def negative_percentile_or_zero(row, low_q=0.001) -> float:
    """core/stats/stats_op.py ``NegativePercentileOrZero``: ``min(x_(ceil(q/100 n)), 0)``."""
    return min(kth(row, math.ceil(0.01 * low_q * row.size)), 0.0)


def abs_min_max(row) -> float:
    """core/stats/stats_op.py ``AbsMinMax``: ``|max(x) - min(min(x), 0)|``."""
    return abs(row.max() - min(row.min(), 0.0))


def negative_min_or_zero(row) -> float:
    """core/stats/stats_op.py ``NegativeMinOrZero``: ``min(min(x), 0)``."""
    return min(row.min(), 0.0)


def round_even(v):
    """torch.round: to nearest, ties to even."""
    return np.round(v)


def zero_point_int(low, scale, bits=8):
    """core/zero_point.py ``_ScaleShiftZeroPoint`` (quantize_zero_point=True).

    ``clamp(round(|low| / scale), 0, 2^bits - 1)``: the weights' statistic is
    negated, the activations' goes through ``abs_binary_sign_grad``; both are <= 0.
    """
    return np.clip(round_even(np.abs(low) / scale), 0, 2**bits - 1)


def fake_quant(x, scale, zp, lo, hi):
    """core/quant/int_base.py ``IntQuant``: ``(clamp(round(x / s + zp), lo, hi) - zp) * s``."""
    return (np.clip(round_even(x / scale + zp), lo, hi) - zp) * scale


def mse_grid(init: float):
    """core/stats/stats_op.py ``MSE.mse_search`` + ``mse_grid_search``: the 20 candidates.

    ``base = init / 20`` (``MSEUniformStepBase``); the interval is ``[min(base, init),
    max(base, init)]`` and the candidates ``xl + (xr - xl) * t`` for ``t = 0`` and
    ``t in linspace(1/19, 1, 19)``, in that order.

    Example:
        >>> [round(float(c), 6) for c in mse_grid(20.0)[[0, 1, -1]]]
        [1.0, 2.0, 20.0]
    """
    base = init / MSE_ITERS
    xl, xr = min(base, init), max(base, init)
    ts = np.concatenate([[0.0], np.linspace(1.0 / (MSE_ITERS - 1), 1.0, MSE_ITERS - 1)])
    return xl + (xr - xl) * ts


def first_argmin(losses) -> int:
    """The first minimum: ``mse_grid_search`` keeps a candidate only if its loss is smaller."""
    return int(np.argmin(losses))


def mse_scale_search(row, int_scaling, lo, hi, init, zp_of_scale=None) -> float:
    """The threshold (``scale * int_scaling``) the MSE search picks for one block.

    ``zp_of_scale(scale)`` gives the integer zero point used with each candidate
    scale (None: zero), as Brevitas evaluates the whole quantizer in local-loss
    mode; the loss is the sum of squared errors of the block.
    """
    cands = mse_grid(init)
    losses = []
    for c in cands:
        s = max(c, SCALING_MIN_VAL) / int_scaling
        zp = 0.0 if zp_of_scale is None else zp_of_scale(s)
        losses.append(np.sum((row - fake_quant(row, s, zp, lo, hi)) ** 2))
    return float(cands[first_argmin(losses)])


def mse_zero_point_search(row, scale, init_low, bits=8) -> float:
    """The (negative) zero-point statistic the MSE search picks for one block at ``scale``.

    Candidates run from ``init_low = min(min(x), 0)`` to ``init_low / 20``.
    """
    cands = mse_grid(init_low)
    hi = 2**bits - 1
    losses = [
        np.sum((row - fake_quant(row, scale, zero_point_int(c, scale, bits), 0, hi)) ** 2)
        for c in cands
    ]
    return float(cands[first_argmin(losses)])


def momentum(buffer, stat, counter, m=0.1):
    """core/utils.py ``inplace_momentum_update`` as the runtime statistics use it.

    The first statistic is taken as is, later ones as ``(1 - m) * buffer + m * stat``.
    """
    return stat if counter == 0 else (1 - m) * buffer + m * stat


# -- whole quantizers ---------------------------------------------------------------------


def shifted_weight(w, per_channel: bool, bits=8):
    """``ShiftedUint8Weight*Float``: scale ``AbsMinMax / 255``, zero point from the minimum.

    quant/shifted_scaled_int.py with quant/base.py ``ShiftedMinUintQuant`` and
    ``MinMaxStatsScaling`` (core/zero_point.py ``StatsFromParameterZeroPoint``).
    Returns (value, scale, zero_point) per block, in ``w``'s shape.
    """
    r = rows(w, per_channel)
    hi = 2**bits - 1
    scale = np.array([max(abs_min_max(b), SCALING_MIN_VAL) / hi for b in r])[:, None]
    zp = zero_point_int(np.array([negative_min_or_zero(b) for b in r])[:, None], scale, bits)
    value = fake_quant(r, scale, zp, 0, hi)
    return value.reshape(np.shape(w)), scale, zp


def mse_weight(w, per_channel: bool, bits=8):
    """``Int8Weight*FloatMSE``: narrow int8, threshold from the MSE search over ``max|w|``.

    quant/scaled_int.py with quant/base.py ``MSESymmetricScale`` (init ``AbsMax``).
    Returns (value, scale) per block.
    """
    r = rows(w, per_channel)
    n = 2 ** (bits - 1) - 1
    t = np.array([mse_scale_search(b, n, -n, n, np.abs(b).max()) for b in r])[:, None]
    scale = t / n
    return fake_quant(r, scale, 0.0, -n, n).reshape(np.shape(w)), scale


def shifted_mse_weight(w, per_channel: bool, bits=8):
    """``ShiftedUint8Weight*FloatMSE``: the scale searched first, then the zero point.

    quant/base.py ``MSEAsymmetricScale`` (init ``AbsMinMax``) and
    ``MSEWeightZeroPoint`` (init ``NegativeMinOrZero``). While the scale is searched
    the zero point is the one of ``min(min(w), 0)``; the zero point's search then uses
    the chosen scale. Returns (value, scale, zero_point).
    """
    r = rows(w, per_channel)
    hi = 2**bits - 1
    scales, zps = [], []
    for b in r:
        low = negative_min_or_zero(b)
        t = mse_scale_search(
            b, hi, 0, hi, abs_min_max(b), lambda s, low=low: zero_point_int(low, s)
        )
        s = max(t, SCALING_MIN_VAL) / hi
        scales.append(s)
        zps.append(zero_point_int(mse_zero_point_search(b, s, low, bits), s, bits))
    scale, zp = np.array(scales)[:, None], np.array(zps)[:, None]
    return fake_quant(r, scale, zp, 0, hi).reshape(np.shape(w)), scale, zp


class RuntimeAct:
    """An activation quantizer with runtime statistics, step by step, as Brevitas runs it.

    core/scaling/standalone.py ``ParameterFromRuntimeStatsScaling`` and
    core/zero_point.py ``ParameterFromRuntimeZeroPoint``: the first
    ``collect_stats_steps`` training calls use the batch's statistics and keep a
    momentum-0.1 running average; the call after takes the averages as the learned
    values (eval before that uses the averages). Power-of-two scales (``pot``) are
    rounded up to a power of two only for the running average and the learned
    value, not for a collecting batch.

    ``kind``: ``"percentile"`` (AbsPercentile 99.999), ``"interval"`` (shifted:
    PercentileInterval + NegativePercentileOrZero), ``"mse"`` (symmetric MSE from
    AbsMax), ``"shifted_mse"`` (MSE scale from AbsMinMax, then MSE zero point from
    NegativeMinOrZero; while the scale is searched the zero point is the previous
    call's chosen candidate, or the batch's ``min(min(x), 0)`` on the first call,
    as ``MSE.forward`` in local-loss mode returns its stored candidate; the zero
    point's search uses this batch's scale, except on the last collecting call,
    where the scale's counter has already reached ``collect_stats_steps`` and the
    search sees the running average, the value the learned scale takes).
    """

    def __init__(self, kind, signed, steps, bits=8, pot=False):
        self.kind, self.signed, self.steps, self.bits, self.pot = kind, signed, steps, bits, pot
        self.shifted = kind in ("interval", "shifted_mse")
        self.int_scaling = 2 ** (bits - 1) if signed else 2**bits - 1
        self.lo = -(2 ** (bits - 1)) if signed else 0
        self.hi = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
        self.counter = 0
        self.buffer = 1.0
        self.zp_buffer = 0.0
        self.zp_candidate = None  # the zero point MSE's stored candidate

    def _pot_int(self):
        return 2 ** math.ceil(math.log2(self.int_scaling))

    def _restricted(self, threshold):
        if not self.pot:
            return threshold / self.int_scaling
        return 2.0 ** math.ceil(math.log2(threshold)) / self._pot_int()

    def _batch_stats(self, row):
        if self.kind == "interval":
            return percentile_interval(row), negative_percentile_or_zero(row)
        if self.kind == "mse":
            t = mse_scale_search(row, self.int_scaling, self.lo, self.hi, np.abs(row).max())
            return t, 0.0
        low_for_scale = self.zp_candidate
        if low_for_scale is None:
            low_for_scale = negative_min_or_zero(row)
        t = mse_scale_search(
            row,
            self.int_scaling,
            self.lo,
            self.hi,
            abs_min_max(row),
            lambda s: zero_point_int(low_for_scale, s, self.bits),
        )
        return t, None  # the zero point is searched after the running scale is updated

    def _zero_point_search(self, row, scale):
        low = mse_zero_point_search(row, scale, negative_min_or_zero(row), self.bits)
        self.zp_candidate = low
        return low

    def __call__(self, x, training: bool):
        """(value, scale, integer zero point) of one call."""
        row = np.asarray(x, np.float64).ravel()
        if training and self.counter < self.steps:
            t, low = self._batch_stats(row)
            t = max(t, SCALING_MIN_VAL)
            self.buffer = momentum(self.buffer, t, self.counter)
            if low is None:
                # The zero point's search runs the whole quantizer after the scale's
                # counter moved on: on the last collecting call the scale is already the
                # running average (the hand-over, ParameterFromRuntimeStatsScaling.init_scale).
                last = self.counter + 1 == self.steps
                search_scale = self._restricted(self.buffer) if last else t / self.int_scaling
                low = self._zero_point_search(row, search_scale)
            self.zp_buffer = momentum(self.zp_buffer, low, self.counter)
            self.counter += 1
            # A collecting batch's scale is not restricted; a power-of-two quantizer still
            # divides by its power-of-two integer range (PowerOfTwoIntScaling: 2^bits unsigned).
            scale = t / (self._pot_int() if self.pot else self.int_scaling)
        else:
            if training and self.counter == self.steps:
                self.counter += 1  # the hand-over: the learned values take the averages
            t, low = self.buffer, self.zp_buffer
            scale = self._restricted(t)
        zp = zero_point_int(low, scale, self.bits) if self.shifted else 0.0
        value = fake_quant(np.asarray(x, np.float64), scale, zp, self.lo, self.hi)
        return value, scale, zp


# -- the inputs the tests (and the Brevitas check) use -------------------------------------

# (quantizer, bit width): every weight quantizer on a QuantConv2d and a QuantLinear.
WEIGHT_CASES = [
    ("ShiftedUint8WeightPerTensorFloat", 8),
    ("ShiftedUint8WeightPerChannelFloat", 8),
    ("ShiftedUint8WeightPerChannelFloat", 4),
    ("Int8WeightPerTensorFloatMSE", 8),
    ("Int8WeightPerChannelFloatMSE", 8),
    ("Int8WeightPerChannelFloatMSE", 4),
    ("ShiftedUint8WeightPerTensorFloatMSE", 8),
    ("ShiftedUint8WeightPerChannelFloatMSE", 8),
    ("ShiftedUint8WeightPerChannelFloatMSE", 4),
]
# (quantizer, layer, collect_stats_steps, bit width): QuantIdentity ("identity") or
# QuantReLU ("relu").
ACT_CASES = [
    ("ShiftedUint8ActPerTensorFloat", "identity", 3, 8),
    ("ShiftedUint8ActPerTensorFloat", "relu", 3, 8),
    ("ShiftedUint8ActPerTensorFloat", "identity", 3, 4),
    ("ShiftedUint8ActPerTensorFixedPoint", "identity", 3, 8),
    ("Int8ActPerTensorFloatMSE", "identity", 3, 8),
    ("Int8ActPerTensorFloatMSE", "identity", 3, 4),
    ("Uint8ActPerTensorFloatMSE", "relu", 3, 8),
    ("Uint8ActPerTensorFloatMSE", "identity", 3, 8),
    ("ShiftedUint8ActPerTensorFloatMSE", "identity", 3, 8),
    ("ShiftedUint8ActPerTensorFloatMSE", "identity", 3, 4),
    ("ShiftedUint8ActPerTensorFloatMSE", "relu", 3, 8),
]
TRAIN_CALLS = 5  # training calls (collection, hand-over, learned) before one eval call


def weight(layer: str) -> np.ndarray:
    """A conv ``(16, 8, 3, 3)`` or linear ``(12, 20)`` weight with heavy tails (Student's
    t, 3 degrees of freedom), so that the MSE search clips; channels have different
    magnitudes and offsets, so per-channel scales and zero points differ (the last
    channels are all positive: zero point 0)."""
    rng = np.random.default_rng(7 if layer == "conv" else 8)
    shape = (16, 8, 3, 3) if layer == "conv" else (12, 20)
    n = shape[0]
    spread = np.linspace(0.05, 0.3, n).reshape(n, *([1] * (len(shape) - 1)))
    offset = np.linspace(-0.2, 0.5, n).reshape(spread.shape)
    w = rng.standard_t(3.0, shape) * spread + offset
    w[-2:] = np.abs(w[-2:])
    return w.astype(np.float32)


def bias() -> np.ndarray:
    """The linear layer's bias."""
    return np.random.default_rng(9).normal(0.0, 0.1, 12).astype(np.float32)


def act_batches(layer: str) -> list:
    """``TRAIN_CALLS + 1`` activation batches ``(4, 8, 6, 6)``: skewed, shifted values
    with a few outliers on both sides (so the MSE search clips)."""
    rng = np.random.default_rng(10 if layer == "identity" else 11)
    out = []
    for i in range(TRAIN_CALLS + 1):
        x = rng.gamma(2.0, 0.7, (4, 8, 6, 6)) - 1.0 + 0.1 * i
        flat = x.reshape(-1)
        flat[rng.choice(flat.size, 6, replace=False)] *= rng.uniform(3.0, 8.0, 6)
        out.append(x.astype(np.float32))
    return out


def linear_batches() -> list:
    """Inputs ``(6, 20)`` for a shifted activation feeding the linear layer."""
    rng = np.random.default_rng(12)
    return [(rng.gamma(2.0, 0.5, (6, 20)) - 0.4).astype(np.float32) for _ in range(4)]
