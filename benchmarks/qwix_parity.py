"""Records Qwix's behaviour that ``tests/test_qwix_compat.py`` checks qcore against.

Run with Qwix installed (never part of the default test run), from the repository root:

    uv venv /tmp/qwixenv --python 3.11 && uv pip install --python /tmp/qwixenv qwix==0.1.8
    /tmp/qwixenv/bin/python benchmarks/qwix_parity.py

It writes ``packages/qcore/tests/fixtures/qwix_parity.json``: the codes, scales and zero points
Qwix's ``quantize`` gives for ``"fixed,..."`` calibration strings, the scale shapes and
tile shapes of its QArray after ``None`` indexing, ``mT`` and ``swapaxes``, and the
codes of a quantized weight and the result of a bool operand times it. The inputs are
written down here (no PRNG), so qcore's test rebuilds them exactly.
"""

import importlib.metadata
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from qwix._src.core import dot_general, einsum, qarray

OUT = pathlib.Path(__file__).parents[1] / "packages/qcore/tests/fixtures/qwix_parity.json"
X = [-4.0, -1.5, 0.0, 0.7, 2.9, 5.0, -0.26, 0.013]
CALIBRATIONS = ["fixed,3", "fixed,-3,3", "fixed,0.5", "fixed,6", "fixed,-2,6", "fixed,-1,0.25"]
REFUSED = ["fixed,0", "fixed,-3"]


def _values(shape, offset=0.0):
    """Deterministic test values: a sine of the flat index (no PRNG)."""
    n = int(np.prod(shape))
    return (np.sin(np.arange(n) * 0.7 + offset) * 3.0).astype(np.float32).reshape(shape)


def calibrations():
    out = {}
    for method in CALIBRATIONS:
        how = qarray.HowToQuantize(qtype=jnp.int8, calibration_method=method)
        q = qarray.quantize(jnp.asarray(X, jnp.float32), how)
        zp = None if q.zero_point is None else np.asarray(q.zero_point).tolist()
        out[method] = {
            "qvalue": np.asarray(q.qvalue).tolist(),
            "scale": np.asarray(q.scale, np.float64).tolist(),
            "zero_point": zp,
        }
    refused = {}
    for method in REFUSED:
        try:
            qarray.quantize(
                jnp.asarray(X), qarray.HowToQuantize(qtype=jnp.int8, calibration_method=method)
            )
            refused[method] = None
        except ValueError as e:
            refused[method] = str(e)
    return out, refused


INDEXES = {
    "[None]": (None,),
    "[:, None]": (slice(None), None),
    "[..., None]": (Ellipsis, None),
    "[None, ..., None]": (None, Ellipsis, None),
    "[1, None]": (1, None),
    "[None, 1:3]": (None, slice(1, 3)),
}


def qarray_views():
    x = jnp.asarray(_values((4, 8, 6)))
    how = qarray.HowToQuantize(qtype=jnp.int8, channelwise_axes=(0,), tiled_axes={1: 4})
    q = qarray.quantize(x, how)
    views = {"base": q}
    views |= {name: q[idx] for name, idx in INDEXES.items()}
    views |= {
        "mT": q.mT,
        "swapaxes(0, 2)": q.swapaxes(0, 2),
        "astype(bfloat16)": q.astype(jnp.bfloat16),
    }
    return {
        name: {
            "shape": list(v.shape),
            "scale_shape": list(v.scale.shape),
            "scale_tile_shape": list(v.scale_tile_shape),
            "dtype": str(v.dtype),
        }
        for name, v in views.items()
    }


def bool_operand():
    w = jnp.asarray(_values((6, 3), 1.0))
    how = qarray.HowToQuantize(qtype=jnp.int8, channelwise_axes=(1,))
    qw = qarray.quantize(w, how)
    mask = np.array([[1, 0, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1]], bool)
    out = {}
    for wdtype in ("float32", "bfloat16"):
        qw_t = qw.astype(wdtype)
        y = dot_general.dot_general(jnp.asarray(mask), qw_t, (((1,), (0,)), ((), ())))
        ye = einsum.einsum("ij,jk->ik", jnp.asarray(mask), qw_t)
        out[wdtype] = {
            "dot_general": np.asarray(y, np.float64).tolist(),
            "einsum": np.asarray(ye, np.float64).tolist(),
            "dtype": str(y.dtype),
        }
    codes = {"qvalue": np.asarray(qw.qvalue).tolist(), "scale": np.asarray(qw.scale).tolist()}
    return {"mask": mask.tolist(), "weight": codes, "results": out}


def main():
    cal, refused = calibrations()
    data = {
        "qwix": importlib.metadata.version("qwix"),
        "jax": jax.__version__,
        "x": X,
        "calibrations": cal,
        "refused": refused,
        "qarray_views": qarray_views(),
        "bool_operand": bool_operand(),
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
