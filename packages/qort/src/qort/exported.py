"""Export a qflax-quantized Flax model, or any JAX function, to ONNX.

Example:
    A two-layer MLP with int8 weights and per-token int8 activations (qflax's dynamic
    range), exported, validated op by op and run:

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import qflax, qort
    >>> class Mlp(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(4)(jax.nn.gelu(nn.Dense(32)(x)))
    >>> rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    >>> qmodel = qflax.quantize_model(Mlp(), qflax.PtqProvider(rules))
    >>> x = jax.random.normal(jax.random.key(0), (8, 16))
    >>> variables = qmodel.init(jax.random.key(1), x)
    >>> exported = qort.export(qmodel, variables, x)
    >>> exported.report.ok, exported.report.integer_sites, exported.report.integer_kernels
    (True, 2, 2)
    >>> y = qort.Session(exported)(x)
    >>> float(jnp.max(jnp.abs(y - qmodel.apply(variables, x)))) < 1e-2  # float ulps move codes
    True
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.errors
import jax
import onnx
from flax import nnx

import qflax
from qcore.files import write_atomic
from qcore.ops.kernels import for_export
from qort import _converter
from qort._capture import CaptureProvider
from qort._errors import ExportError, ExportWarning, ValidationError, kind
from qort.validation import ValidationReport, validate


@dataclasses.dataclass
class Exported:
    """An exported model.

    Attributes:
        model: The ONNX model (opset 21).
        report: The op-by-op validation (None when exported with ``validate=False``).
        input_names: Graph input names, in argument order.
        output_names: Graph output names.
        out_tree: The exported function's output structure (a :class:`~qort.Session`
            made from this object returns outputs in it).
    """

    model: onnx.ModelProto
    report: ValidationReport | None
    input_names: list[str]
    output_names: list[str]
    out_tree: Any = None

    @property
    def nbytes(self) -> int:
        """Size of the serialized model in bytes."""
        return self.model.ByteSize()

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Writes the model to ``path``, atomically.

        The file is written next to ``path`` under a temporary name and renamed, so a
        failed save leaves an existing file untouched.

        Args:
            path: The ``.onnx`` file to write (``~`` is expanded).
            overwrite: Replace an existing file (else an existing file raises).

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is False.
            ValueError: ``path`` is a directory, or its directory does not exist.
        """
        path = Path(path).expanduser()
        if path.is_dir():
            raise ValueError(f"path={str(path)!r} is a directory; allowed: a file path")
        if path.exists() and not overwrite:
            raise FileExistsError(f"path={str(path)!r} exists; pass overwrite=True to replace it")
        if not path.parent.is_dir():
            raise ValueError(
                f"path={str(path)!r}: the directory {str(path.parent)!r} does not exist"
            )
        return write_atomic(path, self.model.SerializeToString())


def export(
    model: Any,
    variables: Any,
    *example_inputs: Any,
    method: str | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    validate: bool = True,
    threads: int | None = None,
) -> Exported:
    """Exports a Flax model (Linen or NNX), qflax-quantized or float, to ONNX.

    A model made by :func:`qflax.quantize_model` with a :class:`~qflax.PtqProvider`
    runs with the same rules and params; its weight-quantized products become
    integer ONNX ops (see ``docs/qort.md`` for which format becomes which op), the
    rest of the model float ONNX ops. An NNX model holds its variables, so its
    inputs follow it directly: ``export(nnx_model, x)``; it is not modified (a
    quantized one is cloned to capture its products).

    Args:
        model: A Linen module (``qflax.quantize_model(model, qflax.PtqProvider(...))``
            or a float one), or an NNX module (quantized in place by
            ``quantize_model``, or float).
        variables: Linen: its variables, ``{"params": ...}`` (quantized params for a
            quantized model, as ``qmodel.init`` or ``qflax.quantize_params`` give).
            NNX: the first input.
        *example_inputs: Inputs of one call; the graph has their shapes and dtypes
            (fixed: a model for another batch size is another export).
        method: The model's method to export (default ``__call__``).
        input_names: Names of the graph inputs (default ``input_0``, ...).
        output_names: Names of the graph outputs (default ``output_0``, ...).
        validate: Run :func:`qort.validation.validate` and raise if it fails.
        threads: ONNX Runtime threads for validation.

    Returns:
        The :class:`Exported` model (``.save(path)``, ``qort.Session(exported)``).

    Raises:
        qort.ExportError: An op or quantization format without an ONNX lowering (naming
            it and where it was traced), bfloat16 inputs, params or computations, or a
            bad argument.
        qort.ValidationError: The graph disagrees with JAX (naming the first op).
    """
    if isinstance(model, nnx.Module):
        # NNX models hold their variables: ``variables`` is the first input.
        inputs = example_inputs if variables is None else (variables, *example_inputs)
        try:
            fn, sites = _nnx_function(model, inputs, method)
            return _export(fn, inputs, sites, input_names, output_names, validate, threads)
        except flax.errors.TraceContextError as e:
            raise ExportError(
                f"model ({type(model).__name__}) changes its state while it runs (batch "
                "statistics, dropout's random counts: training mode); call model.eval() "
                "first"
            ) from e
    provider = getattr(model, "qflax_provider", None)
    if provider is not None:
        capture = _capture_provider(model, provider)
        model = qflax.quantize_model(model, capture, methods=model.methods)
        sites = capture.sites
    else:
        sites = {}
    if not hasattr(model, "apply"):
        raise ExportError(
            f"model is {kind(model)}; allowed: a Flax Linen or NNX module (use "
            "qort.export_function for a JAX function)"
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        if _is_bfloat16(leaf):
            raise ExportError(
                f"variables{jax.tree_util.keystr(path)} has dtype bfloat16; {_NO_BFLOAT16} "
                "(cast those leaves: jax.tree.map(lambda p: p.astype(jnp.float32) if "
                "p.dtype == jnp.bfloat16 else p, variables), and compute in float32)"
            )
    kw = {} if method is None else {"method": method}

    def fn(*args: Any) -> Any:
        return model.apply(variables, *args, **kw)

    return _export(fn, example_inputs, sites, input_names, output_names, validate, threads)


def _capture_provider(model: Any, provider: Any) -> CaptureProvider:
    if not isinstance(provider, qflax.PtqProvider) or isinstance(provider, qflax.LoraProvider):
        raise ExportError(
            f"model's provider is {kind(provider)}; allowed: qflax.PtqProvider "
            "(quantize a QAT-trained model's params with qflax.quantize_params and a "
            "PtqProvider model first)"
        )
    return CaptureProvider(provider.rules)


def _nnx_function(model: nnx.Module, inputs: tuple, method: str | None) -> tuple[Any, dict]:
    """A pure function of the inputs running ``model``, and its captured sites.

    A quantized model is cloned and the clone re-quantized with a
    :class:`CaptureProvider` of the same rules (its quantized params stay as they
    are; ``method`` is traced to find its ops), so the user's model is left
    untouched.
    """
    name = method or "__call__"
    if not callable(getattr(model, name, None)):
        raise ExportError(f"method={name!r}: {type(model).__name__} has no such method")
    provider = getattr(model, "qflax_provider", None)
    sites: dict = {}
    if provider is not None:
        methods = tuple(getattr(model, "qflax_methods", ("__call__",)))
        if name not in methods:
            raise ExportError(
                f"method={name!r} is not one of the quantized methods {methods}; allowed: "
                "one of them (quantize the model with methods=(..., {name!r}) to export it)"
            )
        capture = _capture_provider(model, provider)
        model = nnx.clone(model)
        # quantize_model traces its first method on the inputs: the exported one.
        order = (name, *(m for m in methods if m != name))
        qflax.quantize_model(model, capture, *inputs, methods=order)
        sites = capture.sites
    graphdef, state = nnx.split(model)

    def fn(*args: Any) -> Any:
        return getattr(nnx.merge(graphdef, state), name)(*args)

    return fn, sites


def export_function(
    fn: Any,
    *example_inputs: Any,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    validate: bool = True,
    threads: int | None = None,
) -> Exported:
    """Exports a JAX function (float, or with qcore ops lowered one by one) to ONNX.

    Args:
        fn: A function of arrays returning an array or a pytree of arrays.
        *example_inputs: Arrays (or pytrees of arrays) of one call.
        input_names: See :func:`export`.
        output_names: See :func:`export`.
        validate: See :func:`export`.
        threads: See :func:`export`.

    Returns:
        The :class:`Exported` model.
    """
    if not callable(fn):
        raise ExportError(f"fn is {kind(fn)}; allowed: a callable")
    return _export(fn, example_inputs, {}, input_names, output_names, validate, threads)


def _warn_unfused(conv: Any, sites: Sequence[str]) -> None:
    """Warns that ONNX Runtime runs weight-only products in float, and why."""
    blocks = sorted(
        {
            a.i
            for n in conv.model.graph.node
            if n.op_type == "DequantizeLinear"
            for a in n.attribute
            if a.name == "block_size"
        }
    )
    why = f" (block_size {', '.join(map(str, blocks))})" if blocks else ""
    warnings.warn(
        f"{len(sites)} weight-only products run as DequantizeLinear + float MatMul in ONNX "
        f"Runtime, not its MatMulNBits kernel{why}: {', '.join(sites[:5])}"
        f"{', ...' if len(sites) > 5 else ''}; ONNX Runtime fuses weights with one scale per "
        "output channel, or in tiles whose size is a power of two >= 16 (tile_size=16, 32, "
        "...)",
        ExportWarning,
        stacklevel=3,
    )


_NO_BFLOAT16 = (
    "allowed: float32, float16 or integer arrays (ONNX Runtime's CPU provider has no "
    "bfloat16 kernels for most ops)"
)


def _is_bfloat16(x: Any) -> bool:
    return getattr(getattr(x, "dtype", None), "name", None) == "bfloat16"


def _export(
    fn: Any,
    example_inputs: Sequence[Any],
    sites: dict,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
    validate_: bool,
    threads: int | None,
) -> Exported:
    leaves = jax.tree.leaves(example_inputs)
    for i, x in enumerate(leaves):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ExportError(f"example input {i} is {kind(x)}; allowed: arrays (NumPy or JAX)")
    names = (
        list(input_names) if input_names is not None else [f"input_{i}" for i in range(len(leaves))]
    )
    if len(names) != len(leaves) or len(set(names)) != len(names):
        raise ExportError(
            f"input_names={list(names)!r}; allowed: {len(leaves)} distinct names, one per "
            "input array"
        )
    for i, (x, n) in enumerate(zip(leaves, names, strict=True)):
        if _is_bfloat16(x):
            raise ExportError(
                f"example input {i} ({n!r}) has dtype bfloat16; {_NO_BFLOAT16} (cast the "
                "input to float32)"
            )
    # Traced for ONNX: no qkernels custom calls, no conditionals isolating products.
    with for_export():
        conv = _converter.convert(fn, example_inputs, sites, names, output_names)
    report = None
    if validate_:
        expected = [jax.numpy.asarray(y) for y in jax.tree.leaves(jax.jit(fn)(*example_inputs))]
        report = validate(conv, threads=threads, example_outputs=expected)
        if not report.ok:
            raise ValidationError(f"the exported graph disagrees with JAX:\n{report}", report)
        if report.unfused_weight_only:
            _warn_unfused(conv, report.unfused_weight_only)
    return Exported(
        conv.model,
        report,
        [t.name for t in conv.inputs],
        [t.name for t in conv.outputs],
        conv.out_tree,
    )
