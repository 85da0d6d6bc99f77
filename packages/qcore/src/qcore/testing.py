"""Helpers for the tests of qcore and the packages built on it.

Not imported by ``import qcore``; use ``from qcore import testing``.

Example:
    >>> import jax.numpy as jnp
    >>> from qcore import testing
    >>> testing.primitive_dtypes(
    ...     lambda a, b: a @ b, jnp.ones((2, 3)), jnp.ones((3, 4)), name="dot_general"
    ... )
    [((dtype('float32'), dtype('float32')), dtype('float32'))]
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def primitive_dtypes(fn: Callable[..., Any], *args: Any, name: str) -> list[tuple]:
    """``(operand dtypes, preferred_element_type)`` of every ``name`` equation in fn's jaxpr.

    Nested jaxprs (jit, scan, custom rules) are searched too, so a test can check
    which contraction really ran (e.g. int8 × int8 → int32).
    """
    found: list[tuple] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == name:
                dtypes = tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars)
                pref = eqn.params.get("preferred_element_type")
                found.append((dtypes, None if pref is None else jnp.dtype(pref)))
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def run_on_cpu_devices(script: str, devices: int = 8) -> str:
    """Runs ``script`` in a fresh Python with ``devices`` simulated CPU devices.

    The device count is fixed when JAX starts, hence the subprocess. Returns the
    script's stdout; raises AssertionError with its stderr if it fails.
    """
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def max_rel_error(actual: Any, reference: Any) -> float:
    """``max|actual - reference| / max|reference|`` in float64."""
    a, r = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    return float(np.max(np.abs(a - r)) / np.max(np.abs(r)))
