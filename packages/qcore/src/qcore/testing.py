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

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
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


def snapshot(value: Any) -> Any:
    """A deep copy of ``value`` to compare with later (see :func:`assert_unchanged`).

    A ``str``/``os.PathLike`` names a file or directory: the snapshot holds every file's
    bytes and every directory's name by relative path (``None`` if nothing is there),
    so a snapshot of a file's directory also sees a temporary left beside it. Anything
    else is a pytree: its leaves are copied as NumPy arrays (other leaves with
    ``copy.deepcopy``).

    Example:
        >>> import numpy as np
        >>> params = {"w": np.ones(2)}
        >>> before = snapshot(params)
        >>> assert_unchanged(before, params)
    """
    if isinstance(value, str | os.PathLike):
        return ("files", _files(Path(value)))
    leaves, treedef = jax.tree_util.tree_flatten(value)
    copies = [np.array(x, copy=True) if _is_array(x) else copy.deepcopy(x) for x in leaves]
    return ("tree", treedef, copies)


def assert_unchanged(before: Any, value: Any) -> None:
    """Asserts that ``value`` equals its :func:`snapshot` ``before``: same files, bytes, leaves.

    Arrays compare by dtype, shape and bytes, so NaNs in the same places count as equal.
    """
    if before[0] == "files":
        after = _files(Path(value))
        assert after == before[1], f"{value}: files changed ({_diff(before[1], after)})"
        return
    _, treedef, copies = before
    leaves, now = jax.tree_util.tree_flatten(value)
    assert now == treedef, f"the tree's structure changed: {treedef} -> {now}"
    for i, (old, new) in enumerate(zip(copies, leaves, strict=True)):
        if isinstance(old, np.ndarray):
            new = np.asarray(new)
            same = old.dtype == new.dtype and old.shape == new.shape
            assert same and old.tobytes() == new.tobytes(), f"leaf {i} changed"
        else:
            assert old == new, f"leaf {i} changed: {old!r} -> {new!r}"


def assert_rejects(
    call: Callable[[], Any],
    error: type[BaseException] | tuple[type[BaseException], ...],
    *fragments: str,
    unchanged: tuple[Any, ...] = (),
) -> BaseException:
    """Asserts that ``call()`` raises ``error`` naming every fragment, touching nothing.

    Args:
        call: A function of no arguments that should fail.
        error: The exception type(s) it should raise.
        *fragments: Strings the message must contain (the argument's name, the bad
            value, what is allowed).
        unchanged: Pytrees, files or directories the call must leave as they were
            (compared with :func:`snapshot` taken before the call).

    Returns:
        The exception, for further checks.

    Example:
        >>> def f():
        ...     raise ValueError("axis=5 is out of range for rank 2; allowed: -2..1")
        >>> assert_rejects(f, ValueError, "axis", "5", "-2..1")
        ValueError('axis=5 is out of range for rank 2; allowed: -2..1')
    """
    befores = [snapshot(x) for x in unchanged]
    try:
        call()
    except error as e:
        message = str(e)
        missing = [f for f in fragments if f not in message]
        assert not missing, f"{type(e).__name__} message lacks {missing}: {message!r}"
        for before, value in zip(befores, unchanged, strict=True):
            assert_unchanged(before, value)
        return e
    raise AssertionError(f"expected {error}, but the call returned")


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray | jax.Array | np.generic)


def _files(path: Path) -> dict[str, bytes | None] | None:
    """Every file (its bytes) and directory (``None``) under ``path``, by relative path."""
    if path.is_file():
        return {".": path.read_bytes()}
    if not path.exists():
        return None
    return {
        str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
        for p in sorted(path.rglob("*"))
    }


def _diff(old: dict[str, bytes | None] | None, new: dict[str, bytes | None] | None) -> str:
    old, new = old or {}, new or {}
    gone = sorted(set(old) - set(new))
    added = sorted(set(new) - set(old))
    edited = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    return f"removed {gone}, added {added}, modified {edited}"
