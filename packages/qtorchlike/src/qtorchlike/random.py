"""Random numbers for eager code (a global seed) and for traced code (a passed key).

Eager forward passes (dropout, stochastic rounding) draw from a global key set by
:func:`manual_seed`. :func:`qtorchlike.func.functional_call` with ``rngs=key``
installs that key for the duration of the call, so traced code never touches
global state.

Example:
    >>> import qtorchlike
    >>> qtorchlike.manual_seed(0)
    >>> k1, k2 = qtorchlike.random.next_key(), qtorchlike.random.next_key()
    >>> bool((k1 != k2).any())
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax
import numpy as np

_state = threading.local()


def manual_seed(seed: int) -> None:
    """Seeds the global key that eager code draws from.

    Raises:
        TypeError: If ``seed`` is not an int.
    """
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"manual_seed(seed={seed!r}): seed must be an int")
    _state.key = jax.random.key(seed)


def next_key() -> jax.Array:
    """Returns a fresh key: split from the key of the active :func:`using` scope, else global."""
    stack = getattr(_state, "stack", None)
    if stack:
        stack[-1], key = jax.random.split(stack[-1])
        return key
    if getattr(_state, "key", None) is None:
        manual_seed(0)
    _state.key, key = jax.random.split(_state.key)
    return key


@contextlib.contextmanager
def using(key: jax.Array | None) -> Iterator[None]:
    """Draws keys from ``key`` (split per use) inside the block; ``None`` changes nothing."""
    if key is None:
        yield
        return
    if not hasattr(_state, "stack"):
        _state.stack = []
    _state.stack.append(key)
    try:
        yield
    finally:
        _state.stack.pop()
