"""Activation statistics for static-range quantization, and the scales made from them.

A statistic is ``{"lo": f32[], "hi": f32[], "count": i32[]}``: the moving average of
the calibrated range ends of one activation, over all its axes (per tensor), and
the number of batches seen. Per-tensor ranges make the stored scale independent of
the activation's shape: a ``(B, T, D)`` input calibrated at ``T = 16`` serves at
``T = 128``.

The average is cumulative for the first ``1 / (1 - momentum)`` batches and
exponential after, so a short calibration run is not dominated by its first batch.

Example:
    >>> import jax.numpy as jnp
    >>> from qflax import stats
    >>> s = stats.empty()
    >>> s = stats.update(s, jnp.array([-1.0, 3.0]), "absmax", momentum=0.9)
    >>> s = stats.update(s, jnp.array([-1.0, 1.0]), "absmax", momentum=0.9)
    >>> float(s["hi"]), int(s["count"])
    (2.0, 2)
    >>> float(stats.scale(s, "int8")) * 127.5
    2.0
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import qcore
from qflax.qparam import nonfinite_count

Stat = dict[str, jax.Array]


class QuantStat(nnx.Variable):
    """NNX variable type holding a statistic (filter it like ``nnx.BatchStat``)."""


def empty() -> Stat:
    """A statistic that has seen nothing (count 0)."""
    return {
        "lo": jnp.zeros((), jnp.float32),
        "hi": jnp.zeros((), jnp.float32),
        "count": jnp.zeros((), jnp.int32),
    }


@partial(jax.jit, static_argnames=("calibration",))
def observe(x: jax.Array, calibration: str) -> tuple[jax.Array, jax.Array]:
    """The per-tensor calibrated range ``(lo, hi)`` of one batch, as float32 scalars.

    A statistic: no gradient flows through it (calibrating a bf16 batch rounds a
    scale with ``nextafter``, which has no derivative).
    """
    how = qcore.HowToQuantize(qtype="int8", calibration=calibration, symmetric=False)
    *_, lo, hi = qcore.calibrate(jax.lax.stop_gradient(x), how)
    return lo.reshape(()), hi.reshape(())


def update(stat: Stat, x: jax.Array, calibration: str, *, momentum: float) -> Stat:
    """``stat`` after observing batch ``x`` (see the module docstring)."""
    lo, hi = observe(x, calibration)
    count = stat["count"]
    rate = jnp.maximum(1.0 / (count.astype(jnp.float32) + 1.0), 1.0 - momentum)
    return {
        "lo": stat["lo"] + (lo - stat["lo"]) * rate,
        "hi": stat["hi"] + (hi - stat["hi"]) * rate,
        "count": count + 1,
    }


@partial(jax.jit, static_argnames=("qtype",))
def _scale(lo: jax.Array, hi: jax.Array, qtype: str) -> jax.Array:
    scale, _ = qcore.numerics.scale_from_range(lo, hi, qcore.qtypes.get(qtype))
    return scale


def scale(stat: Stat | Any, qtype: str) -> jax.Array:
    """The symmetric per-tensor scale of ``qtype`` for a statistic's range (float32)."""
    return _scale(stat["lo"], stat["hi"], qtype)


def check_seen(stat: Stat, path: str) -> None:
    """Raises if a concrete statistic has count 0 or a non-finite range.

    Raises:
        ValueError: Naming the statistic's path.
    """
    try:
        seen = int(jnp.min(stat["count"]))
    except jax.errors.ConcretizationTypeError:  # traced: checked when run concretely
        return
    if seen == 0:
        raise ValueError(
            f"quant_stats {path!r} has count 0: no calibration batch reached it. Run the "
            "QtProvider model on calibration data with quant_stats mutable first"
        )
    bad = nonfinite_count(jnp.stack([stat["lo"], stat["hi"]]))
    if bad:
        raise ValueError(
            f"quant_stats {path!r} has a non-finite range (lo={stat['lo']}, hi={stat['hi']}): "
            "a calibration batch held NaN or inf (under jax.jit nothing could stop it); "
            "allowed: statistics of finite calibration data, so calibrate again on clean batches"
        )


def check_batch(x: Any, site: str) -> None:
    """Raises if a concrete calibration batch reaching static site ``site`` is not finite.

    Raises:
        ValueError: Naming the site and how many values are NaN or inf.
    """
    bad = nonfinite_count(x)
    if bad:
        raise ValueError(
            f"calibration batch at static activation site {site!r} has {bad} non-finite "
            "values (NaN or inf) of its input; the range would be NaN. Allowed: finite "
            "calibration data (drop or clean the batch)"
        )
