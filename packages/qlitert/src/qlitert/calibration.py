"""Activation ranges of a function's quantization sites: moving averages of min/max.

A :class:`Calibration` belongs to one function and one set of rules: its sites
are named by the order in which the function computes them, the op and the
module path, so :func:`qlitert.annotate` and :func:`qlitert.qat` read it back
with the rules it was made with.

During QAT the ranges are a pytree (:meth:`Calibration.state`) that the training
step updates (:func:`update_range`) and returns; :meth:`Calibration.with_state`
turns the trained state back into a calibration for export.

Example:
    >>> import numpy as np
    >>> from qlitert import Calibration
    >>> cal = Calibration(momentum=0.5)
    >>> cal.observe("s", np.array([-1.0, 3.0]))
    >>> cal.observe("s", np.array([-3.0, 1.0]))  # a cumulative average for 2 batches
    >>> cal.ranges["s"]
    [-2.0, 2.0]
    >>> scale, zero_point = cal.params("s")
    >>> round(float(scale[0]) * 255, 6), int(zero_point[0])
    (4.0, 0)
    >>> scale, zero_point = cal.params("s", qtype="int16")  # symmetric
    >>> round(float(scale[0]) * 32767, 6), int(zero_point[0])
    (2.0, 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qcore
from qlitert import qdq
from qlitert.rules import Rule


class NonFiniteError(ValueError):
    """Calibration data holds NaN or inf (the message names the site)."""


def _rate(count: Any, momentum: float, xp: Any) -> Any:
    """Weight of a new batch: a cumulative average until ``1 / (1 - momentum)`` batches."""
    return xp.maximum(1.0 / (count + 1.0), 1.0 - momentum)


@dataclasses.dataclass
class Calibration:
    """Per-site activation ranges: moving averages of per-batch min and max.

    Attributes:
        ranges: ``site -> [lo, hi]``.
        counts: ``site -> batches seen``.
        momentum: Weight of the old value once ``1 / (1 - momentum)`` batches were
            seen (a cumulative average before that).
        rules: The rules the sites were found with (see :mod:`qlitert.rules`).
        strict: Whether unsupported ops raised (else they stayed float).
        module_ops: How many ops each module path (as rules match them) computes,
            counted on the first batch by :func:`qlitert.calibrate`.
    """

    ranges: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    momentum: float = 0.99
    rules: tuple[Rule, ...] = ()
    strict: bool = True
    module_ops: dict[str, int] = dataclasses.field(default_factory=dict)

    def observe(self, site: str, x: Any) -> None:
        """Folds one batch's range of ``x`` into ``site``'s moving average.

        An empty ``x`` changes nothing.

        Raises:
            NonFiniteError: If ``x`` holds NaN or inf: a range that skipped them
                would hide them, and one that kept them would make the site's
                scale NaN.
        """
        x = np.asarray(x)
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            raise NonFiniteError(
                f"site {site!r} has {bad} non-finite values (NaN or inf) of {x.size}; "
                "calibrating would hide them: fix the model or drop the batch"
            )
        if x.size == 0:
            return
        lo, hi = float(np.min(x)), float(np.max(x))
        n = self.counts.get(site, 0)
        rate = float(_rate(n, self.momentum, np))
        old = self.ranges.get(site, [lo, hi])
        self.ranges[site] = [old[0] + (lo - old[0]) * rate, old[1] + (hi - old[1]) * rate]
        self.counts[site] = n + 1

    def params(
        self, site: str, qtype: str | qcore.QType | None = None, *, dtype: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """TFLite ``(scale, zero_point)`` of a calibrated site (see :mod:`qlitert.qdq`).

        Args:
            site: The site's name (a rendered :class:`qlitert.SiteKey`).
            qtype: ``"int8"`` (the default), ``"int16"`` or ``"int4"``, or a
                :class:`qcore.QType` of those (:func:`qlitert.qdq.qtype_name`).
            dtype: Deprecated spelling of ``qtype`` (``"i8"``, ``"i16"``, ``"i4"``).

        Raises:
            KeyError: If no calibration batch reached the site.
            ValueError: For another type, or both ``qtype`` and ``dtype``.
        """
        qtype = qdq.qtype_name(qtype, dtype=dtype)
        if site not in self.ranges:
            raise KeyError(
                f"site {site!r} was never calibrated: run calibrate() on the same function "
                f"(calibrated sites: {sorted(self.ranges)[:5]}...)"
            )
        lo, hi = self.ranges[site]
        return qdq.activation_params(lo, hi, qtype)

    def state(self) -> dict[str, jax.Array]:
        """The ranges as a pytree for training: ``site -> [lo, hi, count]`` (float32)."""
        return {
            site: jnp.array([lo, hi, self.counts[site]], jnp.float32)
            for site, (lo, hi) in self.ranges.items()
        }

    def with_state(self, state: dict[str, Any]) -> Calibration:
        """A copy whose ranges and counts come from a (trained) :meth:`state`.

        Raises:
            ValueError: If ``state`` has other sites than this calibration, or a
                range that is not finite.
        """
        if set(state) != set(self.ranges):
            missing, extra = set(self.ranges) - set(state), set(state) - set(self.ranges)
            raise ValueError(
                f"state does not fit this calibration: missing sites {sorted(missing)}, "
                f"unknown sites {sorted(extra)}"
            )
        values = {site: np.asarray(v, np.float64) for site, v in state.items()}
        for site, v in values.items():
            if not np.all(np.isfinite(v)):
                raise ValueError(
                    f"state[{site!r}]={v.tolist()} is not finite (a NaN or inf batch in "
                    "training); allowed: finite [lo, hi, count]"
                )
        return dataclasses.replace(
            self,
            ranges={site: [float(v[0]), float(v[1])] for site, v in values.items()},
            counts={site: int(v[2]) for site, v in values.items()},
        )


def update_range(entry: jax.Array, x: jax.Array, momentum: float) -> jax.Array:
    """One batch folded into a traced ``[lo, hi, count]`` entry, as ``Calibration.observe``.

    Traced values cannot raise: a batch holding NaN or inf makes the range NaN (so
    the site's scale and everything computed from it are NaN, as in float).
    """
    if x.size == 0:
        return entry
    x = jax.lax.stop_gradient(x)
    finite = jnp.all(jnp.isfinite(x))
    lo, hi = jnp.where(finite, jnp.min(x), jnp.nan), jnp.where(finite, jnp.max(x), jnp.nan)
    rate = _rate(entry[2], momentum, jnp)
    new = jnp.stack([entry[0] + (lo - entry[0]) * rate, entry[1] + (hi - entry[1]) * rate])
    return jnp.concatenate([new.astype(entry.dtype), entry[2:] + 1])
