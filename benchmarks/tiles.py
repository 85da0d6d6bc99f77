"""Weight error of int4 tiles of 32 on weights with several contracted axes.

Compares three layouts of the scales on an attention output projection
``(heads, head_dim, d) = (8, 64, 256)`` whose heads differ in scale (each head's
weights times ``exp(0.5 * N(0, 1))``) and on a ``(3, 3, 64, 64)`` conv kernel whose
centre tap is 3x larger than the others (random normal weights otherwise):

* ``qflax``: ``QuantizationRule(weight_qtype="int4", tile_size=32)``'s spec: tiles
  of 32 along the innermost contracted axis, one scale per index of every other axis;
* ``shared``: the same tiles with the scale shared along the other contracted axes
  (Qwix 0.1.8's layout for ``dot_general``/``einsum`` weights; Qwix does not tile
  convolutions);
* ``per channel``: one scale per output channel.

The error is ``|dequantize(quantize(w)) - w| / |w|`` (Frobenius norms); "values per
scale" is the weight's size over the scale's. Deterministic (fixed keys); no timing.

Run: ``python benchmarks/tiles.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import qcore
from qflax import QuantizationRule


def _error(w: jax.Array, spec: qcore.HowToQuantize) -> tuple[float, int]:
    q = qcore.quantize(w, spec)
    err = jnp.linalg.norm(qcore.dequantize(q) - w) / jnp.linalg.norm(w)
    return float(err), w.size // q.scale.size


def main() -> None:
    k = jax.random.split(jax.random.key(0), 4)
    head_scale = jnp.exp(0.5 * jax.random.normal(k[1], (8, 1, 1)))
    out = jax.random.normal(k[0], (8, 64, 256)) * head_scale
    taps = jnp.array([[1.0, 1.0, 1.0], [1.0, 3.0, 1.0], [1.0, 1.0, 1.0]])[:, :, None, None]
    conv = jax.random.normal(k[2], (3, 3, 64, 64)) * taps
    rule = QuantizationRule(weight_qtype="int4", tile_size=32)
    print(f"{'weight':24} {'layout':12} {'rel. error':>10} {'values per scale':>17}")
    for name, w, contracted in (
        ("out proj (8, 64, 256)", out, (0, 1)),
        ("conv (3, 3, 64, 64)", conv, (0, 1, 2)),
    ):
        free = tuple(a for a in range(w.ndim) if a not in contracted)
        layouts = {
            "qflax": rule.weight_spec(w.shape, contracted),
            "shared": qcore.HowToQuantize(
                qtype="int4", channelwise_axes=free, tiled_axes={contracted[-1]: 32}
            ),
            "per channel": qcore.HowToQuantize(qtype="int4", channelwise_axes=free),
        }
        for label, spec in layouts.items():
            assert spec is not None
            err, per_scale = _error(w, spec)
            print(f"{name:24} {label:12} {err:10.3f} {per_scale:17d}")


if __name__ == "__main__":
    main()
