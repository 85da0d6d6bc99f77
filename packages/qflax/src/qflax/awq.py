"""AWQ: activation-aware per-input-channel weight scaling, carried or folded.

AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization") protects the
weight rows that meet large activations: with ``s`` one positive scale per input
channel, ``x W = (x / s) (s W)``, and quantizing ``s W`` instead of ``W`` gives the
rows of large ``s`` a finer relative grid. The scale is ``s = mean|x|^alpha``
(normalised so ``max(s) min(s) = 1``) with ``alpha`` picked from a grid to minimise
the layer's output error on the calibration data,
``E ||x (W - Q(s W) / s)||^2 = tr(D^T H D)`` with ``H = E[x^T x]`` (so one
Hessian collection serves every candidate; ``alpha = 0`` is plain RTN, so the
chosen scale never does worse than RTN on the calibration data).

Where ``1/s`` goes, per weight:

* **Carried** (the default, and for every weight not named in ``fold_into``): the
  :class:`~qflax.QuantizedParam` holds ``Q(s W)`` and ``s`` (its recipe's
  ``input_scale_axis`` says so), and the PTQ model divides the op's input by
  ``s`` before quantizing it, so weight-only and integer (w8a8, w4a8) paths both
  work unchanged, at the cost of one elementwise division of the input per op.
  Each weight gets its own ``s``. This is always exact: it does not touch the rest
  of the model.
* **Folded** into previous model parameters named in ``fold_into``: params that
  scale the input channels linearly *and feed only the scaled weights* (the
  previous Dense's kernel columns and bias; a LayerNorm/RMSNorm ``scale`` and
  ``bias`` when the norm's output goes only into these weights, as in pre-norm
  transformers). Their last axis is divided by ``s``; the result is an ordinary
  float model plus ordinary PTQ params with no extra op. Weights that share a
  fold target (e.g. the q, k and v projections after one LayerNorm) share one
  ``s``. Folding into a norm whose output also feeds a residual (post-norm BERT)
  changes the model: carry the scale there instead.

The quantized params load into the plain :class:`~qflax.PtqProvider` model
(``qmodel.apply({"params": q}, x)``; a carried scale adds one leaf,
``input_scale``, to the param, so restore checkpoints of them with
``jax.eval_shape(lambda: q)`` as the abstract tree).

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.awq import awq
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
    >>> rules = [qflax.QuantizationRule(weight_qtype="int4")]
    >>> data = qflax.CalibrationData(model, params, batches)
    >>> q = awq(data, rules, progress=False)  # s carried
    >>> q["dense"]["kernel"], q["dense"]["kernel"].input_scale.shape
    (QuantizedParam(int4, shape=(16, 8), compute shape=(16, 8), packed, input-scaled), (16,))
    >>> qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    >>> y = qmodel.apply({"params": q}, batches[0])
    >>> folded = awq(data, rules, fold_into={"dense/kernel": "g"}, progress=False)
    >>> folded["dense"]["kernel"], bool(folded["g"][0] != 1.0)  # 1/s is now in g
    (QuantizedParam(int4, shape=(16, 8), compute shape=(16, 8), packed), True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

import qcore
from qflax import _folding as folding
from qflax._calibration_data import CalibrationData, accepts_legacy
from qflax.layer_stats import LayerStats, stats_or_collect
from qflax.rule import QuantizationRule


@accepts_legacy()
def awq(
    data: CalibrationData,
    rules: Sequence[QuantizationRule],
    *,
    fold_into: Mapping[str, str | Sequence[str]] | None = None,
    grid: int = 20,
    stats: dict[str, LayerStats] | None = None,
    progress: bool = True,
) -> dict:
    """Quantizes the selected weights with AWQ scales folded into ``fold_into`` params.

    Args:
        data: The model (not modified), its float params and the batches
            (:class:`~qflax.CalibrationData`); the batches may be None when
            ``stats`` is given.
        rules: The rules of the PTQ model that will serve the result.
        fold_into: ``{weight param path: param path(s)}``: the params whose last
            axis (one entry per input channel of the weight) is divided by ``s``.
            They must act linearly and only on this input (a norm's scale and
            bias, the previous Dense's kernel and bias). Weights not named here
            (all of them by default) carry their ``s``.
        grid: Number of ``alpha`` values tried in ``[0, 1)``.
        stats: Statistics from :func:`~qflax.layer_stats.collect` (with the Hessian).
        progress: Show progress over batches and layers.

    Returns:
        A new nested dict of params like :func:`qflax.gptq.gptq`'s, with AWQ-quantized
        weights as :class:`~qflax.QuantizedParam` (with their ``input_scale`` if
        carried), folded params divided by ``s``, everything else unchanged.
        Inputs are never modified.

    Raises:
        ValueError: No calibration data, unknown or misshaped ``fold_into``
            entries, a fold target that is itself quantized, or rules the
            collection cannot handle.
    """
    if not (isinstance(grid, int) and grid > 0):
        raise ValueError(f"grid={grid!r} must be a positive int")
    stats = stats_or_collect(stats, data, rules, progress=progress)
    folds = folding.plan(data, stats, fold_into)
    return folding.apply(folds, stats, lambda weights: search_scale(weights, grid), "AWQ", progress)


def search_scale(weights: Sequence[tuple[jax.Array, LayerStats]], grid: int = 20) -> jax.Array:
    """The AWQ input-channel scale ``s`` of weights sharing one input.

    Args:
        weights: ``(compute-layout float weight, its LayerStats)`` pairs.
        grid: ``alpha`` values ``0, 1/grid, ..., (grid-1)/grid`` are tried.

    Returns:
        ``s`` (``(K,)`` float32) minimising the summed output error ``tr(D^T H D)``.
    """
    mean = sum(layer.abs_sum for _, layer in weights) / sum(
        jnp.maximum(layer.count, 1).astype(jnp.float32) for _, layer in weights
    )
    mean = jnp.maximum(mean, 1e-8)
    best, best_s = None, None
    for i in range(grid):
        s = mean ** (i / grid)
        s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
        loss = sum(_output_error(w, layer, s) for w, layer in weights)
        loss = float(loss)
        if best is None or loss < best:
            best, best_s = loss, s
    assert best_s is not None
    return best_s


def _output_error(w: jax.Array, layer: LayerStats, s: jax.Array) -> jax.Array:
    q = qcore.dequantize(folding.quantize_scaled(w, layer, s), jnp.float32)
    axis = layer.site.axis
    d = jnp.moveaxis(w.astype(jnp.float32) - q / folding.along(s, w.ndim, axis), axis, 0)
    d = d.reshape(d.shape[0], -1)
    h = layer.mean_hessian()
    return jnp.sum(d * jnp.matmul(h, d, precision=jax.lax.Precision.HIGHEST))
