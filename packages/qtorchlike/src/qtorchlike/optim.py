"""Eager optimizers that update a module's parameters: :class:`SGD` and :class:`Adam`.

Each optimizer is built on a module and updates its trainable parameters
(``requires_grad``) from a dict of gradients keyed like ``named_parameters()``.
The arithmetic is a pure, jitted ``update(grads, state, params)``, which
:func:`qtorchlike.func.train_step` calls inside its compiled step.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import qtorchlike.nn as qnn
    >>> from qtorchlike import optim
    >>> from qtorchlike.func import functional_call, trainable
    >>> layer = qnn.QuantLinear(3, 1, bias=False)
    >>> opt = optim.Adam(layer, lr=1e-2)
    >>> x = jnp.ones((4, 3))
    >>> grads = jax.grad(lambda p: functional_call(layer, p, x)[0].sum())(trainable(layer))
    >>> before = layer.weight
    >>> opt.step(grads)
    >>> bool((layer.weight < before).all())
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qtorchlike.nn.module import Module, set_state


class _Optimizer:
    """Shared bookkeeping: which parameters, the state, eager :meth:`step`."""

    state: Any

    def __init__(self, model: Module, lr: float) -> None:
        if not isinstance(model, Module):
            raise TypeError(
                f"model={type(model).__name__} must be a qtorchlike.nn.Module (optimizers "
                "update the module's parameters in place)"
            )
        _check_number("lr", lr, 0.0, inclusive=False)
        self.model, self.lr = model, float(lr)
        self.names: tuple[str, ...] = ()
        self.state = None
        self.sync(model)

    def sync(self, model: Module) -> None:
        """(Re)creates the state if the trainable parameters changed (names or shapes)."""
        params = dict(model.named_parameters())
        names = tuple(model.trainable_names())
        shapes = {k: params[k].shape for k in names}
        if names != self.names or getattr(self, "_shapes", None) != shapes:
            self.names, self._shapes = names, shapes
            self.state = self.init({k: params[k] for k in names})

    def init(self, params: Mapping[str, jax.Array]) -> Any:
        """The initial state for ``params``."""
        raise NotImplementedError

    def hyperparams(self) -> dict[str, float]:
        """The current settings (``lr``, ...), passed to the compiled update as arrays.

        They are read at every step, so changing e.g. ``opt.lr`` between steps
        takes effect without recompiling.
        """
        return {"lr": self.lr}

    def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """Returns ``(new_params, new_state)``; pure and jitted."""
        if getattr(self, "_compiled", None) is None:
            self._compiled = jax.jit(self.apply)
        return self._compiled(grads, state, params, self.hyperparams_array())

    def hyperparams_array(self) -> dict[str, jax.Array]:
        """:meth:`hyperparams` as float32 arrays (traced arguments of compiled steps)."""
        return {k: jnp.asarray(v, jnp.float32) for k, v in self.hyperparams().items()}

    def apply(self, grads: Any, state: Any, params: Any, hp: Any) -> tuple[Any, Any]:
        """The pure update: ``(new_params, new_state)`` from gradients and settings ``hp``."""
        raise NotImplementedError

    def step(self, grads: Mapping[str, jax.Array]) -> None:
        """Applies ``grads`` (by dotted parameter name) to the model's parameters.

        Raises:
            KeyError: If ``grads`` lacks a trainable parameter or has an unknown name.
        """
        self.sync(self.model)
        wanted, got = set(self.names), set(grads)
        if wanted != got:
            raise KeyError(
                f"grads must have exactly the trainable parameters; missing "
                f"{sorted(wanted - got)}, unexpected {sorted(got - wanted)}"
            )
        params = dict(self.model.named_parameters())
        new, self.state = self.update(dict(grads), self.state, {k: params[k] for k in self.names})
        set_state(self.model, new)

    def zero_grad(self) -> None:
        """Does nothing (gradients are values here, not accumulated fields)."""


class SGD(_Optimizer):
    """Stochastic gradient descent with optional momentum and weight decay.

    Args:
        model: The module whose parameters are updated.
        lr: Learning rate.
        momentum: Heavy-ball momentum (PyTorch's formulation).
        weight_decay: L2 penalty added to the gradient.
    """

    def __init__(
        self, model: Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ) -> None:
        _check_number("momentum", momentum, 0.0)
        _check_number("weight_decay", weight_decay, 0.0)
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        super().__init__(model, lr)

    def init(self, params):  # noqa: D102
        return {k: jnp.zeros_like(v) for k, v in params.items()}

    def hyperparams(self) -> dict[str, float]:  # noqa: D102
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def apply(self, grads, state, params, hp):  # noqa: D102
        new_params, new_state = {}, {}
        for k, p in params.items():
            g = grads[k] + hp["weight_decay"] * p
            buf = hp["momentum"] * state[k] + g
            new_params[k], new_state[k] = p - hp["lr"] * buf, buf
        return new_params, new_state


class Adam(_Optimizer):
    """Adam (Kingma & Ba, 2015) with PyTorch's defaults.

    Args:
        model: The module whose parameters are updated.
        lr: Learning rate.
        betas: Decay rates of the first and second moment estimates.
        eps: Added to the denominator.
        weight_decay: L2 penalty added to the gradient.
    """

    def __init__(
        self,
        model: Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise TypeError(f"betas={betas!r} must be a pair of numbers in [0, 1)")
        for b in betas:
            _check_number("betas", b, 0.0, upper=1.0)
        _check_number("eps", eps, 0.0)
        _check_number("weight_decay", weight_decay, 0.0)
        self.betas, self.eps, self.weight_decay = tuple(map(float, betas)), float(eps), weight_decay
        super().__init__(model, lr)

    def init(self, params):  # noqa: D102
        zeros = {k: jnp.zeros_like(v) for k, v in params.items()}
        return {"m": zeros, "v": dict(zeros), "t": jnp.zeros((), jnp.int32)}

    def hyperparams(self) -> dict[str, float]:  # noqa: D102
        b1, b2 = self.betas
        return {"lr": self.lr, "b1": b1, "b2": b2, "eps": self.eps, "wd": self.weight_decay}

    def apply(self, grads, state, params, hp):  # noqa: D102
        b1, b2 = hp["b1"], hp["b2"]
        t = state["t"] + 1
        tf = t.astype(jnp.float32)
        m, v, new_params = {}, {}, {}
        for k, p in params.items():
            g = grads[k] + hp["wd"] * p
            m[k] = b1 * state["m"][k] + (1 - b1) * g
            v[k] = b2 * state["v"][k] + (1 - b2) * g * g
            m_hat = m[k] / (1 - b1**tf)
            v_hat = v[k] / (1 - b2**tf)
            new_params[k] = p - hp["lr"] * m_hat / (jnp.sqrt(v_hat) + hp["eps"])
        return new_params, {"m": m, "v": v, "t": t}


def _check_number(
    name: str, v: Any, lower: float, inclusive: bool = True, upper: float | None = None
) -> None:
    """``v`` is a real number ``>= lower`` (``> lower`` unless inclusive), below ``upper``."""
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
        raise TypeError(f"{name}={v!r} must be a number")
    low_ok = v >= lower if inclusive else v > lower
    if not (low_ok and math.isfinite(v) and (upper is None or v < upper)):
        bound = f"{'>=' if inclusive else '>'} {lower:g}"
        allowed = f"{bound} and < {upper:g}" if upper is not None else bound
        raise ValueError(f"{name}={v!r} must be a finite number {allowed}")
