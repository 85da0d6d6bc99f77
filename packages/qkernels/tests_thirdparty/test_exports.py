"""Exports to other runtimes with qkernels installed: no native call reaches them.

qcore's batch-1 products call qkernels' kernels whenever the package is installed;
those calls are custom calls that ``jax.export`` refuses to serialize and that no
converter knows. ``qcore.ops.kernels.for_export`` traces without them (and without
the conditional isolating each product for XLA:CPU), and ``qlitert.export`` and
``qort``'s exports trace there, also for a function that ran jitted before. Run by
``nox -s kernels``, which installs qlitert and qort for it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
from qcore.ops import kernels

DIMS = (((1,), (0,)), ((), ()))


def _product(qtype: str):
    """A jitted batch-1 product qkernels covers, already called once (so traced)."""
    rng = np.random.default_rng(0)
    packed = {"pack": True, "pack_axis": 0} if qtype != "int8" else {}  # along K
    how = qcore.HowToQuantize(qtype=qtype, channelwise_axes=(1,), **packed)
    w = qcore.quantize(jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), how)
    x = jnp.asarray(rng.normal(size=(1, 64)), jnp.float32)
    f = jax.jit(lambda x: qcore.dot_general(x, w, DIMS))
    y = np.asarray(f(x))
    assert "qkernels" in str(jax.make_jaxpr(f)(x))  # the native path is what ran
    return f, x, y


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_jax_export_serializes_the_product_traced_for_export(qtype):
    f, x, y = _product(qtype)
    with kernels.for_export():
        exported = jax.export.export(f, platforms=["cpu"])(x)
    text = exported.mlir_module()
    assert "custom_call" not in text and "stablehlo.case" not in text
    back = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(back.call(x), y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_qort_exports_the_product(qtype):
    import qort  # noqa: PLC0415 - installed by the kernels session only

    f, x, y = _product(qtype)
    exported = qort.export_function(f, x)
    assert exported.report is not None and exported.report.ok
    np.testing.assert_allclose(
        qort.Session(exported)(x), y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max())
    )


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_qlitert_exports_the_product(qtype):
    import qlitert  # noqa: PLC0415 - installed by the kernels session only

    f, x, y = _product(qtype)
    tfl = qlitert.export(f, x, compute_types=["FLOAT32", "INT32", "INT8", "UINT8"])
    assert "IF" not in qlitert.inspect(tfl).op_names()
    got = qlitert.LiteRTModel(tfl)(x)
    np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))
