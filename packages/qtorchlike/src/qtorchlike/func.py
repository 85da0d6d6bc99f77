"""Run a stateful module as a pure function, so ``jax.jit`` and ``jax.grad`` apply.

:func:`functional_call` swaps the given arrays into the model for one forward
pass and returns the outputs together with the buffers the pass updated (running
statistics, step counters) and any parameter it re-initialised (the end of a
statistics-collection phase). The model itself is left as it was.
:func:`train_step` builds a jitted step (forward, gradients, optimizer update)
that writes the results back to the model and the optimizer, for an eager-style
training loop at compiled speed.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import qtorchlike.nn as qnn
    >>> from qtorchlike.func import functional_call
    >>> layer = qnn.QuantLinear(4, 2, bias=True)
    >>> x = jnp.ones((3, 4))
    >>> params = dict(layer.named_parameters())
    >>> out, new_state = jax.jit(lambda p, x: functional_call(layer, p, x))(params, x)
    >>> bool(jnp.allclose(out, layer(x)))
    True
    >>> grads = jax.grad(lambda p: functional_call(layer, p, x)[0].sum())(params)
    >>> sorted(grads)
    ['bias', 'weight']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import jax

from qtorchlike import random
from qtorchlike.nn.module import Module, set_state


def _snapshot(model: Module) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        for store in ("_parameters", "_buffers"):
            for name, value in module.__dict__[store].items():
                if value is not None:
                    state[f"{prefix}.{name}" if prefix else name] = value
    return state


@contextlib.contextmanager
def _swapped(
    model: Module, state: Mapping[str, Any], rngs: jax.Array | None, updates: dict[str, Any]
) -> Iterator[None]:
    before = _snapshot(model)
    unknown = [k for k in state if k not in before]
    if unknown:
        raise KeyError(
            f"state has keys {unknown} that are neither parameters nor buffers of "
            f"{type(model).__name__}; its keys are {sorted(before)}"
        )
    for key, value in state.items():
        shape, want = getattr(value, "shape", None), getattr(before[key], "shape", None)
        if shape is not None and want is not None and tuple(shape) != tuple(want):
            raise ValueError(
                f"state[{key!r}] has shape {tuple(shape)} but the model's {key!r} has "
                f"{tuple(want)}; allowed: the model's shapes"
            )
    set_state(model, state)
    try:
        passed = _snapshot(model)
        with random.using(rngs):
            yield
        params = {k for k, _ in model.named_parameters()}
        for key, value in _snapshot(model).items():
            if key not in params or value is not passed[key]:
                updates[key] = value
    finally:
        set_state(model, before)


def functional_call(
    model: Module,
    state: Mapping[str, Any],
    *args: Any,
    rngs: jax.Array | None = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """Calls ``model(*args, **kwargs)`` with ``state``'s arrays in place of its own.

    Args:
        model: The module.
        state: Arrays by dotted name (any subset of ``state_dict()`` keys, plus
            non-persistent buffers); the rest keep the model's current values.
        *args: Forward arguments.
        rngs: A PRNG key for dropout and stochastic rounding inside the call.
        **kwargs: Forward keyword arguments.

    Returns:
        ``(outputs, new_state)``: ``new_state`` maps every buffer name to its value
        after the call, plus the parameters the forward pass assigned. The model
        is unchanged.

    Raises:
        KeyError: If ``state`` has a name the model does not.
    """
    updates: dict[str, Any] = {}
    with _swapped(model, state, rngs, updates):
        out = model(*args, **kwargs)
    return out, updates


def trainable(model: Module) -> dict[str, jax.Array]:
    """The parameters that receive gradients, by dotted name."""
    params = dict(model.named_parameters())
    return {k: params[k] for k in model.trainable_names()}


def static_key(model: Module) -> tuple:
    """What a trace of ``model`` depends on besides arrays: modes and quantizer switches.

    Jitted wrappers take it as a static argument so that ``model.eval()`` or
    :func:`qtorchlike.calibration_mode` after a first call compile a new trace.
    """
    return tuple(
        (name, m.training, getattr(m, "trace_flags", lambda: ())())
        for name, m in model.named_modules()
    )


class Optimizer(Protocol):
    """What :func:`train_step` needs from an optimizer (see :mod:`qtorchlike.optim`)."""

    state: Any

    def apply(self, grads: Any, state: Any, params: Any, hp: Any) -> tuple[Any, Any]:
        """Returns ``(new_params, new_state)``; pure, jit-able."""
        ...

    def hyperparams_array(self) -> dict[str, jax.Array]:
        """The current settings as arrays."""
        ...

    def sync(self, model: Module) -> None:
        """Makes ``state`` match the model's trainable parameters."""
        ...


def train_step(
    model: Module, loss_fn: Callable[..., jax.Array], optimizer: Optimizer
) -> Callable[..., jax.Array]:
    """A jitted training step that updates ``model`` and ``optimizer`` in place.

    Args:
        model: The module to train.
        loss_fn: ``loss_fn(model, *batch) -> scalar``; it calls the model as usual.
        optimizer: An optimizer from :mod:`qtorchlike.optim` built on ``model``.

    Returns:
        ``step(*batch, rngs=None) -> loss``. Each call runs the forward pass,
        differentiates the loss with respect to the trainable parameters, applies
        the optimizer, and writes parameters, buffers and optimizer state back.

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike import optim
        >>> from qtorchlike.func import train_step
        >>> model = qnn.QuantLinear(2, 1, bias=True)
        >>> opt = optim.SGD(model, lr=0.1)
        >>> step = train_step(model, lambda m, x, y: jnp.mean((m(x) - y) ** 2), opt)
        >>> x, y = jnp.ones((8, 2)), jnp.ones((8, 1))
        >>> losses = [float(step(x, y)) for _ in range(50)]
        >>> losses[-1] < 1e-3 < losses[0]
        True
    """
    if not callable(loss_fn):
        raise TypeError(
            f"train_step(loss_fn={loss_fn!r}): loss_fn must be callable as "
            "loss_fn(model, *batch) -> scalar"
        )

    def pure(params, others, opt_state, hp, rngs, key, *batch):
        def loss_of(params):
            updates: dict[str, Any] = {}
            with _swapped(model, {**others, **params}, rngs, updates):
                loss = loss_fn(model, *batch)
            return loss, updates

        (loss, updates), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        # A parameter the forward pass re-initialised starts from its new value.
        params = {k: updates.get(k, v) for k, v in params.items()}
        params, opt_state = optimizer.apply(grads, opt_state, params, hp)
        return loss, params, {k: v for k, v in updates.items() if k not in params}, opt_state

    compiled = jax.jit(pure, static_argnums=(5,))

    def step(*batch: Any, rngs: jax.Array | None = None) -> jax.Array:
        optimizer.sync(model)
        params = trainable(model)
        others = {k: v for k, v in _snapshot(model).items() if k not in params}
        loss, params, buffers, optimizer.state = compiled(
            params,
            others,
            optimizer.state,
            optimizer.hyperparams_array(),
            rngs,
            static_key(model),
            *batch,
        )
        set_state(model, {**params, **buffers})
        return loss

    return step
