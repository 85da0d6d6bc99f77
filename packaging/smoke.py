"""Smoke examples run against installed wheels (``nox -s build``), one per package.

Run as ``python packaging/smoke.py <package>`` in an environment where only that
package's wheel (and the wheels of the local packages it depends on, or for the
optional qkernels, of qcore, which calls it) are installed:
it checks that the import comes from site-packages, not from this checkout, and runs
a small end-to-end example whose result it asserts.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np


def qcore_smoke() -> None:
    import jax  # noqa: PLC0415

    import qcore  # noqa: PLC0415

    w = jax.random.normal(jax.random.key(0), (64, 32))
    q = qcore.quantize(w, qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,), pack=True))
    err = float(np.max(np.abs(np.asarray(qcore.dequantize(q)) - np.asarray(w))))
    assert err <= float(np.max(np.asarray(q.scale))) * 0.5 + 1e-6, err
    assert q.nbytes < w.size  # packed: half a byte per code plus scales


def qflax_smoke() -> None:
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415

    import qflax  # noqa: PLC0415

    x = jax.random.normal(jax.random.key(1), (4, 16))
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    qmodel = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider(rules))
    params = nn.Dense(8).init(jax.random.key(0), x)["params"]
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    qparams = qflax.quantize_params(params, abstract)
    assert isinstance(qparams["kernel"], qflax.QuantizedParam)
    y, ref = qmodel.apply({"params": qparams}, x), nn.Dense(8).apply({"params": params}, x)
    assert float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) < 0.05


def qlitert_smoke() -> None:
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415

    import qlitert  # noqa: PLC0415

    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(8, 16)).astype(np.float32) for _ in range(4)]
    params = nn.Dense(4).init(jax.random.key(0), batches[0])

    def fn(x):
        return nn.Dense(4).apply(params, x)

    tflite = qlitert.export(qlitert.annotate(fn, qlitert.calibrate(fn, batches)), batches[0])
    y = qlitert.LiteRTModel(tflite)(batches[0])
    ref = np.asarray(fn(batches[0]))
    assert float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) < 0.1


def qtorchlike_smoke() -> None:
    import jax.numpy as jnp  # noqa: PLC0415

    import qtorchlike  # noqa: PLC0415
    import qtorchlike.nn as qnn  # noqa: PLC0415

    qtorchlike.manual_seed(0)
    layer = qnn.QuantLinear(16, 4, bias=True)
    layer.eval()
    y = layer(jnp.ones((2, 16)))
    assert y.shape == (2, 4) and bool(jnp.all(jnp.isfinite(y)))


def qort_smoke() -> None:
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415

    import qflax  # noqa: PLC0415
    import qort  # noqa: PLC0415

    x = jax.random.normal(jax.random.key(1), (4, 16))
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    qmodel = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider(rules))
    variables = qmodel.init(jax.random.key(0), x)
    exported = qort.export(qmodel, variables, x)
    assert exported.report is not None and exported.report.integer_kernels == 1
    y, ref = qort.Session(exported)(x), np.asarray(qmodel.apply(variables, x))
    assert float(np.max(np.abs(y - ref))) < 1e-2 * float(np.max(np.abs(ref)))


def qkernels_smoke() -> None:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import qcore  # noqa: PLC0415
    import qkernels  # noqa: F401, PLC0415
    from qcore.ops import kernels  # noqa: PLC0415

    def same_on_both_paths(f, x) -> None:
        """qcore calls the installed kernels, and they give its pure-XLA path's bits."""
        outs = []
        for native in (True, False):
            with kernels.native_kernels(native):  # a new function: jit caches traces per one
                lowered = jax.jit(lambda x: f(x)).lower(x)
            assert ("qkernels_" in lowered.as_text()) == native
            outs.append(np.asarray(lowered.compile()(x)))
        np.testing.assert_array_equal(outs[0], outs[1])

    x = jax.random.normal(jax.random.key(0), (1, 64))
    w = jax.random.randint(jax.random.key(1), (64, 48), -128, 128).astype(jnp.int8)
    s = jnp.full((1, 48), 0.01) + jnp.arange(48) * 1e-3
    b = jax.random.normal(jax.random.key(2), (48,))
    same_on_both_paths(lambda x: kernels.int8_weight_only(x, w, s, layout="kn") + b, x)
    # The 4-bit kernel, over a strip of 32 columns and a tail of 8.
    w4 = qcore.quantize(
        jax.random.normal(jax.random.key(3), (64, 40)),
        qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,), pack=True, pack_axis=0),
    )
    same_on_both_paths(lambda x: qcore.dot_general(x, w4, (((1,), (0,)), ((), ()))), x)


def main(package: str) -> int:
    module = importlib.import_module(package)
    location = Path(module.__file__ or "").resolve()
    sources = Path(__file__).resolve().parent.parent / "packages"
    assert "site-packages" in location.parts and sources not in location.parents, location
    {"qcore": qcore_smoke, "qflax": qflax_smoke, "qlitert": qlitert_smoke,
     "qtorchlike": qtorchlike_smoke, "qort": qort_smoke,
     "qkernels": qkernels_smoke}[package]()  # fmt: skip
    print(f"{package} {module.__version__} from {location.parent}: smoke example passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
