"""The backend seam: CPU-tuned kernels and row thresholds on CPU, the generic path elsewhere."""

import importlib

import jax
import numpy as np
import pytest

import qcore
from qcore.ops import _backend, kernels

dot_general_module = importlib.import_module("qcore.ops.dot_general")

K, N = 256, 48
F32_EPS = float(np.finfo(np.float32).eps)
NK = (((1,), (1,)), ((), ()))  # weights stored (N, K), output features first


def test_platform_is_the_default_devices_else_the_default_backends(monkeypatch):
    assert _backend.platform() == jax.default_backend() == jax.devices()[0].platform
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _backend.platform() == "gpu"
    with jax.default_device(jax.devices("cpu")[0]):
        assert _backend.platform() == "cpu"
    with jax.default_device("tpu"):
        assert _backend.platform() == "tpu"


@pytest.fixture(params=["cpu", "gpu", "tpu"])
def backend(request, monkeypatch):
    """Fakes JAX's default backend; no trace made under another one is reused."""
    jax.clear_caches()
    monkeypatch.setattr(jax, "default_backend", lambda: request.param)
    yield request.param
    monkeypatch.undo()
    jax.clear_caches()


@pytest.fixture
def taken(monkeypatch):
    """The product paths traced since the fixture was set up, in order.

    A kernel or ``scaled_dot_general`` is recorded when called, ``_dequantize_first``
    when it says yes.
    """
    paths = []

    def spy(module, name, record):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            if record(out):
                paths.append(name)
            return out

        monkeypatch.setattr(module, name, wrapper)

    for name in ("int8_weight_only", "int4_packed_weight_only", "w8a8"):
        spy(kernels, name, lambda _: True)
    spy(dot_general_module, "scaled_dot_general", lambda _: True)
    spy(dot_general_module, "_dequantize_first", bool)
    return paths


def _operands(case, rng):
    """``(x, w, x64, w64)``: operands of ``case`` and their float64 values from the codes."""
    kind, rows = case
    bits = 4 if kind == "int4" else 8
    codes = rng.integers(-(2 ** (bits - 1)) + 1, 2 ** (bits - 1), (N, K)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (N, 1)).astype(np.float32)
    w = qcore.QArray(codes, scale, qtype=f"int{bits}")
    if kind == "int4":
        w = qcore.pack(w, axis=1)
    w64 = codes.astype(np.float64) * scale.astype(np.float64)
    if kind == "w8a8":
        x_codes = rng.integers(-127, 128, (rows, K)).astype(np.int8)
        x_scale = rng.uniform(0.01, 0.1, (rows, 1)).astype(np.float32)
        x = qcore.QArray(x_codes, x_scale, qtype="int8")
        x64 = x_codes.astype(np.float64) * x_scale.astype(np.float64)
    else:
        x = rng.standard_normal((rows, K)).astype(np.float32)
        x64 = x.astype(np.float64)
    return x, w, x64, w64


# case -> path on CPU; every other backend takes the generic scaled_dot_general.
CPU_PATH = {
    ("int8", 4): ["int8_weight_only"],  # decoding: the int8-digit kernel
    ("int4", 4): ["int4_packed_weight_only"],
    ("w8a8", 4): ["w8a8"],
    ("int8", 40): ["_dequantize_first"],  # many rows: dequantize, then one float dot
}
GENERIC_PATH = ["scaled_dot_general"]


@pytest.mark.parametrize("case", list(CPU_PATH), ids=lambda c: f"{c[0]}-{c[1]}rows")
def test_cpu_tuned_paths_run_on_cpu_only_and_every_path_matches_float64(backend, taken, case):
    x, w, x64, w64 = _operands(case, np.random.default_rng(case[1]))
    y = np.asarray(qcore.dot_general(x, w, NK), np.float64)
    assert taken == (CPU_PATH[case] if backend == "cpu" else GENERIC_PATH)
    ref = x64 @ w64.T
    # float32 rounding of K products and their sum (the kernels' 23-bit digits err less).
    bound = (K + 4) * F32_EPS * np.max(np.abs(x64), 1, keepdims=True) * np.sum(np.abs(w64), 1)
    assert np.all(np.abs(y - ref) <= bound), float(np.max(np.abs(y - ref) / bound))


def test_fast_dot_general_applies_on_cpu_only(backend):
    x, w, _, _ = _operands(("int8", 4), np.random.default_rng(0))
    assert (kernels.fast_dot_general(x, w, NK, None) is not None) == (backend == "cpu")
