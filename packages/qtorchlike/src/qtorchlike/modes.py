"""Context managers for post-training quantization: calibration, bias correction, float runs.

* :func:`calibration_mode` collects activation statistics over a few batches with
  the model computing in float, then hands them to the activation quantizers.
* :func:`bias_correction_mode` measures, per output channel, the mean error that
  weight (and input) quantization adds to each layer's output and folds it into
  the layer's bias.
* :func:`disable_quant` runs the model with every quantizer switched off.

All three restore every switch they touch when the block ends, also when it
ends with an exception (the statistics and biases are then left as they were).

Under ``jax.jit``: :func:`calibration_mode` works with
:func:`qtorchlike.func.functional_call`, whose returned buffers (the running
statistics) must be written back to the model before the block ends; the
callable the block yields (see :func:`jit_forward`) does that. Bias correction
accumulates in Python and runs eagerly only.

Example:
    >>> import numpy as np
    >>> import qtorchlike.nn as qnn
    >>> from qtorchlike.modes import calibration_mode
    >>> model = qnn.Sequential(qnn.QuantIdentity(), qnn.QuantLinear(4, 2))
    >>> batches = [
    ...     np.random.default_rng(i).normal(size=(16, 4)).astype(np.float32) for i in range(3)
    ... ]
    >>> with calibration_mode(model):
    ...     for x in batches:
    ...         _ = model(x)
    >>> def nearest_rank(x, q=99.999):  # Brevitas' rule: the k-th smallest |x|
    ...     return np.sort(np.abs(x).ravel())[int(np.floor(q / 100 * x.size + 0.5)) - 1]
    >>> expected = np.mean([nearest_rank(x) for x in batches])
    >>> bool(np.isclose(float(model[0].act_quant.value), expected, rtol=1e-6))
    True
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from qtorchlike._proxy import ActQuantProxy, BiasQuantProxy, WeightQuantProxy
from qtorchlike._switches import Switches, check_model, proxies
from qtorchlike.func import functional_call, static_key
from qtorchlike.nn._quant_layer import QuantWBIOL
from qtorchlike.nn.module import Module, Parameter, set_state
from qtorchlike.quant_tensor import QuantTensor

__all__ = ["bias_correction_mode", "calibration_mode", "disable_quant", "jit_forward"]


def _own_state(module: Module) -> dict[str, Any]:
    """The module's own parameters and buffers (not its submodules')."""
    return {**module.__dict__["_parameters"], **module.__dict__["_buffers"]}


def _put_own_state(module: Module, state: dict[str, Any]) -> None:
    for store in ("_parameters", "_buffers"):
        for name in module.__dict__[store]:
            if name in state:
                module.__dict__[store][name] = state[name]


def jit_forward(model: Module) -> Callable[..., Any]:
    """A callable that runs ``model`` under ``jax.jit`` and keeps the state it updates.

    Each call runs :func:`qtorchlike.func.functional_call` on the model's current
    parameters and buffers in a jitted function, then writes the buffers (running
    statistics, step counters) and any parameter the forward pass assigned back to
    the model, as an eager call would have left them. The trace is keyed on
    :func:`qtorchlike.func.static_key`, so changing a mode or a quantizer switch
    compiles a new one. :func:`calibration_mode` yields such a callable.

    Args:
        model: The module.

    Returns:
        ``forward(*args, **kwargs) -> outputs`` (``rngs=key`` is passed on to
        :func:`~qtorchlike.func.functional_call`).

    Raises:
        TypeError: If ``model`` is not a :class:`qtorchlike.nn.Module`.

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike.modes import jit_forward
        >>> model = qnn.QuantReLU()
        >>> forward = jit_forward(model)
        >>> _ = forward(jnp.linspace(0.0, 2.0, 11))
        >>> int(model.act_quant.counter)  # the statistics step was written back
        1
    """
    check_model(model, "jit_forward")

    @functools.partial(jax.jit, static_argnums=0)
    def run(key: tuple, state: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        del key  # only selects the trace
        return functional_call(model, state, *args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        out, updates = run(static_key(model), state, args, kwargs)
        set_state(model, updates)
        return out

    return forward


@contextlib.contextmanager
def calibration_mode(model: Module) -> Iterator[Callable[..., Any]]:
    """Collects activation statistics with the model computing in float.

    Inside the block every enabled activation quantizer observes its input (the
    statistic of its quantizer class, e.g. the 99.999th percentile of ``|x|``),
    keeps an exact running mean over all batches and passes the input on
    unquantized; weight and bias quantizers are off and layers return arrays, so
    the model computes in float. When the block ends, each activation quantizer
    keeps the mean: a learned scale (``parameter_from_stats``) takes it as its
    value and its statistics phase is over; a running-statistics scale
    (``stats``) uses it in evaluation. Every mode and switch is then restored.

    An exception inside the block restores everything, statistics included. An
    activation quantizer that saw no batch keeps its previous state (with a
    warning).

    Args:
        model: The module to calibrate.

    Yields:
        A callable running the model under ``jax.jit`` that writes the collected
        statistics back (:func:`jit_forward`); calling ``model(x)`` eagerly works
        as well. With your own ``jax.jit(functional_call)``, write the returned
        buffers back with ``qtorchlike.nn.module.set_state(model, new_state)``
        before the block ends, and pass :func:`qtorchlike.func.static_key` as a
        static argument so the calibration switches select their own trace.

    Raises:
        TypeError: If ``model`` is not a :class:`qtorchlike.nn.Module`.

    Example:
        >>> import numpy as np
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike.modes import calibration_mode
        >>> model = qnn.Sequential(qnn.QuantLinear(4, 8), qnn.QuantReLU())
        >>> batches = [np.full((2, 4), float(i), np.float32) for i in range(1, 4)]
        >>> with calibration_mode(model) as forward:
        ...     for x in batches:
        ...         _ = forward(x)  # jitted; model(x) does the same eagerly
        >>> int(model[1].act_quant.counter)  # the statistics phase is over
        300
    """
    check_model(model, "calibration_mode")
    switches = Switches(model)
    quantizers = proxies(model)
    collecting = [p for p in quantizers if isinstance(p, ActQuantProxy) and p.enabled]
    before = {id(p): _own_state(p) for p in collecting}
    for p in quantizers:
        if isinstance(p, (WeightQuantProxy, BiasQuantProxy)):
            p.enabled = False
    for p in collecting:
        p.calibrating = True
        p.start_collection()
    switches.plain_outputs()
    try:
        yield jit_forward(model)
    except BaseException:
        switches.restore()
        for p in collecting:
            _put_own_state(p, before[id(p)])
        raise
    switches.restore()
    names = {id(m): n for n, m in model.named_modules()}
    for p in collecting:
        if "counter" in p.__dict__["_buffers"] and int(p.counter) == 0:
            _put_own_state(p, before[id(p)])
            warnings.warn(
                f"calibration_mode: activation quantizer {names[id(p)]!r} ({p.spec.name}) "
                "saw no batch; its previous scale is kept",
                stacklevel=3,
            )
            continue
        p.finish_collection()


@contextlib.contextmanager
def disable_quant(model: Module) -> Iterator[None]:
    """Runs the model in float: every quantizer is off inside the block.

    Weights, biases and activations pass unquantized (activation functions still
    apply) and layers return arrays. Every switch is restored when the block
    ends, also on an exception.

    Args:
        model: The module.

    Raises:
        TypeError: If ``model`` is not a :class:`qtorchlike.nn.Module`.

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike.modes import disable_quant
        >>> layer = qnn.QuantLinear(3, 2, weight_bit_width=2)
        >>> x = jnp.ones((1, 3))
        >>> with disable_quant(layer):
        ...     y = layer(x)
        >>> bool(jnp.allclose(y, x @ layer.weight.T + layer.bias))
        True
        >>> layer.weight_quant.enabled
        True
    """
    check_model(model, "disable_quant")
    switches = Switches(model)
    for p in proxies(model):
        p.enabled = False
    switches.plain_outputs()
    try:
        yield
    finally:
        switches.restore()


def _is_traced(x: Any) -> bool:
    return any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(x))


class _BiasCorrection:
    """The hooks and sums behind :func:`bias_correction_mode`."""

    def __init__(self, model: Module) -> None:
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantWBIOL)]
        self.sums: dict[str, jax.Array] = {}
        self.counts: dict[str, int] = {}
        self.in_pass = False
        self.seen: set[str] = set()

    def start_pass(self, module: Module, args: tuple) -> None:
        self.in_pass, self.seen = True, set()

    def end_pass(self, module: Module, args: tuple, out: Any) -> None:
        self.in_pass, self.seen = False, set()

    def hook(self, name: str) -> Callable[[Module, tuple, Any], Any]:
        def correct(layer: Module, args: tuple, out: Any) -> Any:
            if _is_traced(out):
                raise RuntimeError(
                    "bias_correction_mode runs eagerly: call the model directly, not under "
                    "jax.jit, jax.grad or a jitted functional_call (the mean errors are "
                    "accumulated in Python)"
                )
            if self.in_pass:
                if name in self.seen:
                    raise RuntimeError(
                        f"bias_correction_mode: layer {name!r} ({type(layer).__name__}) was "
                        "called more than once in one forward pass; bias correction supports "
                        "one call per layer and pass (use a separate layer per call)"
                    )
                self.seen.add(name)
            assert isinstance(layer, QuantWBIOL)
            # Both without the output quantizer: the error of the computation itself.
            quant = _rerun(layer, args, (layer.output_quant,))
            ref = _rerun(
                layer,
                args,
                (layer.weight_quant, layer.bias_quant, layer.input_quant, layer.output_quant),
            )
            axis = layer._out_channel_dim % quant.ndim
            others = tuple(a for a in range(quant.ndim) if a != axis)
            err = jnp.mean((ref - quant).astype(jnp.float32), axis=others)
            self.sums[name] = self.sums[name] + err if name in self.sums else err
            self.counts[name] = self.counts.get(name, 0) + 1
            # A QuantTensor keeps its metadata: a later layer may take its bias scale
            # from it (Int32Bias without input_quant).
            return out._like(ref) if isinstance(out, QuantTensor) else ref

        return correct

    def apply(self, skip_if_no_bias: bool) -> None:
        for name, layer in self.layers:
            if name not in self.counts:
                continue
            correction = self.sums[name] / self.counts[name]
            bias = layer.bias
            if bias is not None:
                layer.bias = bias + correction.astype(bias.dtype)
            elif not skip_if_no_bias:
                layer.bias = Parameter(correction.astype(layer.weight.dtype))


def _rerun(layer: QuantWBIOL, args: tuple, off: tuple[Any, ...]) -> jax.Array:
    """The layer's output (as an array) with the quantizers in ``off`` switched off."""
    proxies = [p for p in off if p is not None]
    enabled = [p.enabled for p in proxies]
    rqt = layer.return_quant_tensor
    # A training-mode input quantizer would count these calls as statistics steps.
    state = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    try:
        for p in proxies:
            p.enabled = False
        layer.return_quant_tensor = False
        out = layer.forward(*args)
    finally:
        for p, e in zip(proxies, enabled, strict=True):
            p.enabled = e
        layer.return_quant_tensor = rqt
        set_state(layer, state)
    return out.value if isinstance(out, QuantTensor) else jnp.asarray(out)


@contextlib.contextmanager
def bias_correction_mode(model: Module, skip_if_no_bias: bool = False) -> Iterator[None]:
    """Folds each layer's mean output error from quantization into its bias.

    Inside the block, each quantized layer with a weight
    (:class:`~qtorchlike.nn.QuantLinear`, :class:`~qtorchlike.nn.QuantConv2d`...)
    computes its output again twice, both without its output quantizer: with its
    other quantizers as configured, and with all of them off. It accumulates the
    per-output-channel mean of ``float - quantized`` (channels on axis 1 for
    convolutions, the last axis for linear layers; the mean runs over every
    other axis, then over the batches) and passes the *float* output on (as a
    QuantTensor with the quantized output's metadata when the layer returns
    QuantTensors), so the errors of earlier layers do not pile up in later ones.
    When the block ends normally the mean is added to each layer's bias; a layer
    without a bias gets one (unless ``skip_if_no_bias``). On an exception no bias
    changes. Every switch is restored either way.

    Run it eagerly (the sums are kept in Python), typically in eval mode after
    :func:`calibration_mode`.

    Args:
        model: The module to correct.
        skip_if_no_bias: Leave layers without a bias alone instead of adding one.

    Raises:
        TypeError: If ``model`` is not a :class:`qtorchlike.nn.Module`, or
            ``skip_if_no_bias`` is not a bool.
        RuntimeError: Inside the block, if a layer is called twice in one forward
            pass of ``model`` or the model runs under a JAX transformation.

    Example:
        >>> import numpy as np
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike.modes import bias_correction_mode, disable_quant
        >>> layer = qnn.QuantLinear(16, 4, bias=False, weight_bit_width=3).eval()
        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(1.0, 1.0, size=(256, 16)).astype(np.float32)
        >>> with disable_quant(layer):
        ...     ref = np.asarray(layer(x))
        >>> before = np.abs(np.mean(ref - np.asarray(layer(x)), axis=0))
        >>> with bias_correction_mode(layer):
        ...     _ = layer(x)
        >>> after = np.abs(np.mean(ref - np.asarray(layer(x)), axis=0))
        >>> layer.bias.shape, bool(np.all(after < 1e-5)), bool(np.all(before > after))
        ((4,), True, True)
    """
    check_model(model, "bias_correction_mode")
    if not isinstance(skip_if_no_bias, bool):
        raise TypeError(
            f"bias_correction_mode(skip_if_no_bias={skip_if_no_bias!r}): must be True or False"
        )
    switches = Switches(model)
    state = _BiasCorrection(model)
    handles = [layer.register_forward_hook(state.hook(name)) for name, layer in state.layers]
    handles.append(model.register_forward_pre_hook(state.start_pass))
    handles.append(model.register_forward_hook(state.end_pass))
    try:
        yield
    except BaseException:
        for h in handles:
            h.remove()
        switches.restore()
        raise
    for h in handles:
        h.remove()
    switches.restore()
    state.apply(skip_if_no_bias)
