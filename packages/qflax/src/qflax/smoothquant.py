"""SmoothQuant: migrate activation outliers into the weights with a per-channel scale.

SmoothQuant (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models") makes activations easier to quantize
(w8a8): a few input channels of ``x`` carry values far larger than the rest, and
one activation scale per token must cover them, so the other channels get few
levels. With one positive scale ``s_j`` per input channel ``j``,
``x W = (x / s) (s W)``, and

    ``s_j = max|x_j| ** alpha / max|W_j| ** (1 - alpha)``

(``max|x_j|`` over the calibration data, ``max|W_j|`` over weight row ``j``, i.e.
all output channels of every weight sharing the input) balances the two ranges:
``alpha = 0`` leaves the activations alone, ``alpha = 1`` moves all of their range
into the weights; 0.5 is the paper's default. A channel with ``max|x_j| = 0`` or
``max|W_j| = 0`` keeps ``s_j = 1``.

As in :func:`qflax.awq.awq`, ``s`` is either **carried** in the
:class:`~qflax.QuantizedParam` (the default, and for every weight not named in
``fold_into``: the PTQ model divides the op's input by ``s``, then quantizes it
per token as usual, so the int8 x int8 path still runs) or **folded** into
previous model params named per weight in ``fold_into`` (a norm's scale and
bias, the previous Dense's kernel columns and bias, when they feed only these
weights; weights sharing targets share ``s``). The weight ``s W`` is quantized
with the rule's spec. With static-range rules (``act_static_scale``), the scales
must be computed from ``x / s``: initialise the PTQ model's static scales with
the SmoothQuant params in place (``mutable=["params"]`` on calibration data),
not from statistics collected on the float model.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.smoothquant import smoothquant
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         g = self.param("g", nn.initializers.ones, (x.shape[-1],))
    ...         return nn.Dense(8, name="dense")(x * g[None])
    >>> outliers = jnp.ones(16).at[:2].set(30.0)
    >>> batches = [
    ...     jax.random.normal(jax.random.key(i), (64, 16)) * outliers[None] for i in range(4)
    ... ]
    >>> model = Block()
    >>> params = model.init(jax.random.key(0), batches[0])["params"]
    >>> rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    >>> data = qflax.CalibrationData(model, params, batches)
    >>> q = smoothquant(data, rules, progress=False)  # s carried
    >>> q["dense"]["kernel"]
    QuantizedParam(int8, shape=(16, 8), compute shape=(16, 8), input-scaled)
    >>> bool(q["dense"]["kernel"].input_scale[0] > 2.0)  # outlier channels: s > 1
    True
    >>> folded = smoothquant(data, rules, fold_into={"dense/kernel": "g"}, progress=False)
    >>> bool(folded["g"][0] < 0.5)  # 1/s folded into g
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from qflax import _folding as folding
from qflax._calibration_data import CalibrationData, accepts_legacy
from qflax.layer_stats import LayerStats, stats_or_collect
from qflax.rule import QuantizationRule


@accepts_legacy()
def smoothquant(
    data: CalibrationData,
    rules: Sequence[QuantizationRule],
    *,
    fold_into: Mapping[str, str | Sequence[str]] | None = None,
    alpha: float = 0.5,
    stats: dict[str, LayerStats] | None = None,
    progress: bool = True,
) -> dict:
    """Quantizes the selected weights with SmoothQuant scales folded into ``fold_into``.

    Args:
        data: The model (not modified), its float params and the batches
            (:class:`~qflax.CalibrationData`); the batches may be None when
            ``stats`` is given.
        rules: The rules of the PTQ model that will serve the result (typically
            ``weight_qtype="int8", act_qtype="int8"``).
        fold_into: ``{weight param path: param path(s)}``: the params whose last
            axis (one entry per input channel of the weight) is divided by ``s``.
            They must act linearly and only on this input (a norm's scale and
            bias, the previous Dense's kernel and bias). Weights not named here
            (all of them by default) carry their ``s``.
        alpha: Migration strength in ``[0, 1]``.
        stats: Statistics from :func:`~qflax.layer_stats.collect` (``abs_max`` is
            used; the Hessian is not needed).
        progress: Show progress over batches and layers.

    Returns:
        A new nested dict of params like :func:`qflax.awq.awq`'s, with quantized
        ``s W`` as :class:`~qflax.QuantizedParam` (with their ``input_scale`` if
        carried), folded params divided by ``s``, everything else unchanged.
        Inputs are never modified.

    Raises:
        ValueError: ``alpha`` outside ``[0, 1]``, no calibration data, unknown or
            misshaped ``fold_into`` entries, a fold target that is itself
            quantized, or rules the collection cannot handle.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise ValueError(
            f"alpha={alpha!r} is not allowed: SmoothQuant's migration strength must be a "
            "number in [0, 1] (0: activations unchanged, 1: all of their range moved into "
            "the weights; 0.5 is the usual choice)"
        )
    stats = stats_or_collect(
        stats,
        data,
        rules,
        hessian=False,
        progress=progress,
    )
    folds = folding.plan(data, stats, fold_into)
    return folding.apply(
        folds, stats, lambda weights: smoothing_scale(weights, alpha), "SmoothQuant", progress
    )


def smoothing_scale(weights: Sequence[tuple[jax.Array, LayerStats]], alpha: float) -> jax.Array:
    """SmoothQuant's per-input-channel scale of weights sharing one input.

    Args:
        weights: ``(compute-layout float weight, its LayerStats)`` pairs.
        alpha: Migration strength in ``[0, 1]``.

    Returns:
        ``s = max|x| ** alpha / max|W| ** (1 - alpha)`` per input channel (``(K,)``
        float32); 1 where either maximum is 0 or the result is not finite.

    Example:
        >>> import jax.numpy as jnp
        >>> from types import SimpleNamespace
        >>> from qflax.smoothquant import smoothing_scale
        >>> layer = SimpleNamespace(
        ...     abs_max=jnp.array([16.0, 1.0, 0.0]), site=SimpleNamespace(axis=0)
        ... )
        >>> w = jnp.array([[1.0, -4.0], [0.25, 0.0], [2.0, 1.0]])
        >>> smoothing_scale([(w, layer)], 0.5).tolist()  # sqrt(16 / 4), sqrt(1 / 0.25), guard
        [2.0, 2.0, 1.0]
    """
    x_max = jnp.max(jnp.stack([layer.abs_max.astype(jnp.float32) for _, layer in weights]), 0)
    w_max = jnp.max(jnp.stack([_row_max(w, layer.site.axis) for w, layer in weights]), 0)
    s = x_max**alpha / w_max ** (1.0 - alpha)
    ok = (x_max > 0) & (w_max > 0) & jnp.isfinite(s) & (s > 0)
    return jnp.where(ok, s, 1.0).astype(jnp.float32)


def _row_max(w: jax.Array, axis: int) -> jax.Array:
    a = jnp.moveaxis(jnp.abs(w.astype(jnp.float32)), axis, 0)
    return jnp.max(a.reshape(a.shape[0], -1), axis=1)
