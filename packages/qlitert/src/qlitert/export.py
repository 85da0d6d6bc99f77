"""``export``: a JAX function with quantization annotations → a validated ``.tflite``.

The function must close over its parameters (passed as arguments they would
become float model inputs and the kernels would stay float) and quantize with
:mod:`qlitert.qdq`. It is exported with ``jax.export`` at the static shapes of
the example inputs (composites with symbolic shapes fail to export in jax 0.10.2,
jax-ml/jax#40486), converted (:mod:`qlitert.converter`), and then validated:

* every op computes in the allowed integer types (``INT32`` is allowed for
  biases and accumulators); float tensors may only enter a ``QUANTIZE`` at the
  inputs or leave a ``DEQUANTIZE`` at the outputs, so there is no ``DEQUANTIZE``
  in the middle of the graph;
* the model loads and runs with XNNPACK and with LiteRT's builtin kernels, and
  under each, every quantized tensor agrees with the JAX function's layer by layer
  on the example inputs: each op, fed the ``.tflite``'s own inputs, is within one
  step of JAX (int8; :mod:`qlitert.validation` states the rule exactly).

A model that fails raises :class:`ExportError` with a report naming the
offending ops.

Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> import qlitert
    >>> from qlitert import qdq
    >>> w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    >>> s_in, z_in = qdq.activation_params(-2, 2)
    >>> s_out, z_out = qdq.activation_params(-4, 4)
    >>> def f(x):
    ...     wq = qdq.fake_quant(
    ...         jnp.asarray(w.T), qdq.weight_scales(w.T, 0), narrow_range=True, axis=0
    ...     )
    ...     return qdq.fake_quant(qdq.fake_quant(x, s_in, z_in) @ wq.T, s_out, z_out)
    >>> tfl = qlitert.export(f, np.ones((2, 4), np.float32))
    >>> qlitert.inspect(tfl).op_names()
    ['QUANTIZE', 'FULLY_CONNECTED', 'DEQUANTIZE']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from qcore.files import write_atomic
from qcore.ops import kernels as qcore_kernels
from qlitert import converter
from qlitert.inspection import ModelReport, from_bytes, inspect
from qlitert.validation import KERNELS, compare_layers

# int8 data, int32 biases and indices, int64 shapes (and 16x8 biases), bool masks.
INTEGER_TYPES = ("INT8", "INT32", "INT64", "BOOL")


class ExportError(ValueError):
    """The export or its validation failed; the message is the report."""


def _spec(x: Any, i: int, validate: bool) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        if validate:
            raise ExportError(
                f"example_inputs[{i}] is a ShapeDtypeStruct; validate=True needs arrays "
                "(or pass validate=False)"
            )
        shape = x.shape
    else:
        x = np.asarray(x)
        shape = x.shape
        if x.dtype.kind not in "biuf":
            raise TypeError(f"example_inputs[{i}] has dtype {x.dtype}; allowed: numeric arrays")
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if validate and bad:
            raise ExportError(
                f"example_inputs[{i}] has {bad} non-finite values (NaN or inf); validation "
                "compares outputs on them: allowed: finite example inputs (or validate=False)"
            )
    if not all(isinstance(d, int) for d in shape):
        raise ExportError(
            f"example_inputs[{i}] has a symbolic shape {shape}: export at a static shape "
            "(e.g. batch 1). jax 0.10.2 cannot export quantization composites with "
            "symbolic shapes (jax-ml/jax#40486)"
        )
    return jax.ShapeDtypeStruct(shape, x.dtype)


def export(
    fn: Callable[..., Any],
    *example_inputs: Any,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    validate: bool = True,
    compute_types: Sequence[str] | None = None,
) -> bytes:
    """Exports, converts and validates ``fn`` (see the module docstring).

    Args:
        fn: The function, parameters closed over, quantization annotated.
        *example_inputs: Arrays (or ``jax.ShapeDtypeStruct`` with ``validate=False``)
            fixing the static shapes; with ``validate`` also the validation inputs.
        input_names: Signature input names (default ``x0, x1, ...``).
        output_names: Signature output names (default ``y0, y1, ...``).
        validate: Check kernel types and agreement with JAX.
        compute_types: Tensor types allowed inside the graph. Default: the types
            an :class:`~qlitert.Annotated` function's rules ask for (e.g.
            ``INT16``/``INT64`` for 16x8, ``INT4`` weights, ``FLOAT32`` for float
            modules), else int8 kernels with int32 biases.

    Returns:
        The ``.tflite`` flatbuffer.

    Raises:
        TypeError: If ``fn`` is not callable or an example input not numeric.
        ExportError: (a ValueError) For symbolic shapes, no example inputs,
            non-finite ones with ``validate``, names or types that do not fit, or
            a failed validation.
    """
    if not callable(fn):
        raise TypeError(f"fn is a {type(fn).__name__}; allowed: a callable")
    if not example_inputs:
        raise ExportError("export(fn, *example_inputs) got no example input; allowed: 1 or more")
    specs = [_spec(x, i, validate) for i, x in enumerate(example_inputs)]
    _check_types(compute_types)
    input_names = _names("input_names", input_names, len(specs), "x")
    # The StableHLO must be portable: traced without qcore's optional native kernels,
    # whose custom calls neither jax.export nor the converter can take, and without the
    # conditional that isolates each CPU product for XLA (the converter makes it an IF).
    with qcore_kernels.for_export():
        exported = jax.export.export(jax.jit(fn), platforms=["cpu"])(*specs)
    # Known once the export has traced fn.
    allowed = compute_types or getattr(fn, "compute_types", None) or INTEGER_TYPES
    tflite = converter.stablehlo_to_tflite(
        exported.mlir_module_serialized,
        input_names=input_names,
        output_names=_names("output_names", output_names, len(exported.out_avals), "y"),
    )
    if validate:
        problems = check_kernels(inspect(tflite), allowed, getattr(fn, "float_islands", None))
        problems += check_agreement(tflite, fn, example_inputs)
        if problems:
            raise ExportError("the converted model failed validation:\n" + "\n".join(problems))
    return tflite


def _names(arg: str, names: Sequence[str] | None, n: int, prefix: str) -> list[str]:
    """Signature names: ``names`` checked (``n`` distinct strings), or ``prefix0...``."""
    if names is None:
        return [f"{prefix}{i}" for i in range(n)]
    names = [names] if isinstance(names, str) else list(names)
    if len(names) != n or len(set(names)) != n or not all(isinstance(s, str) and s for s in names):
        raise ExportError(f"{arg}={names!r}; allowed: {n} distinct non-empty strings")
    return names


def _check_types(compute_types: Sequence[str] | None) -> None:
    """Raises ExportError for a type that is not a LiteRT tensor type name."""
    if compute_types is None:
        return
    from ai_edge_litert import schema_py_generated as schema  # noqa: PLC0415 - heavy import

    known = [k for k in vars(schema.TensorType) if not k.startswith("_")]
    given = [compute_types] if isinstance(compute_types, str) else list(compute_types)
    if isinstance(compute_types, str) or any(t not in known for t in given):
        raise ExportError(
            f"compute_types={compute_types!r} is not a sequence of LiteRT tensor types; "
            f"allowed: names among {known}"
        )


def check_kernels(
    report: ModelReport,
    compute_types: Sequence[str] = INTEGER_TYPES,
    float_islands: Sequence[str] | None = None,
) -> list[str]:
    """Problems with the op types: disallowed types, DEQUANTIZE mid-graph, stray float ops.

    A float matmul or convolution over a dequantized integer weight is a problem
    too: a rule asked for an integer kernel that the converter left float.

    With ``FLOAT32`` allowed (float modules), QUANTIZE / DEQUANTIZE may sit anywhere.
    Integer data entering the quantized graph (``mask.astype(jnp.float32)``: a CAST
    from an integer type to FLOAT32 that only QUANTIZE ops read) is allowed like a
    graph input: it holds integers, and no float arithmetic is done on them.

    ``float_islands`` (an :class:`~qlitert.Annotated` function's
    ``float_islands``: the ops qlitert computes in float on its own, such as an
    int16 LayerNorm's ``rsqrt``, in a model whose rules compute nothing in float)
    are each one float op of the file. A file with more float arithmetic ops
    (ops other than QUANTIZE, DEQUANTIZE and those that only move data) computes
    in float an op a rule asked to be integer, although ``FLOAT32`` is allowed.
    None: not checked (a float module's ops have no fixed count of TFLite ops:
    litert-converter 0.5.0 writes ``x**3`` as two MULs and ``erf`` as more than ten).
    """
    problems = []
    graph_inputs, graph_outputs = set(report.inputs), set(report.outputs)
    allowed = set(compute_types)
    mixed = "FLOAT32" in allowed
    readers: dict[int, list[str]] = {}
    for op in report.ops:
        for i in op.inputs:
            readers.setdefault(i, []).append(op.name)
    entering = {
        o
        for op in report.ops
        if op.name == "CAST"
        and set(report.op_types(op)[0]) <= {"INT8", "INT16", "INT32", "INT64", "BOOL"}
        for o in op.outputs
        if readers.get(o) and set(readers[o]) == {"QUANTIZE"}
    }
    for k, op in enumerate(report.ops):
        ins, outs = report.op_types(op)
        if op.name == "CAST" and op.outputs and set(op.outputs) <= entering:
            continue
        starts = graph_inputs | entering
        if op.name == "QUANTIZE" and (mixed or all(i in starts for i in op.inputs)):
            continue
        if op.name == "DEQUANTIZE":
            if mixed or all(o in graph_outputs for o in op.outputs):
                continue
            problems.append(f"op {k} DEQUANTIZE feeds other ops (a float tensor mid-graph)")
            continue
        bad = sorted({t for t in ins + outs if t not in allowed})
        if bad:
            problems.append(f"op {k} {op.name} computes in {bad} (inputs {ins}, outputs {outs})")
    arithmetic = [
        f"op {k} {op.name}"
        for k, op in enumerate(report.ops)
        if op.name not in _NO_ARITHMETIC and "FLOAT32" in sum(report.op_types(op), [])
    ]
    if float_islands is not None and len(arithmetic) > len(float_islands):
        problems.append(
            f"{len(arithmetic)} float arithmetic ops ({', '.join(arithmetic)}) where no rule "
            f"asks for float and qlitert computes {len(float_islands)} ops in float "
            f"({', '.join(float_islands) or 'none'}): an op a rule asked to be integer "
            "computes in float"
        )
    return problems + _dequantized_weights(report)


def _dequantized_weights(report: ModelReport) -> list[str]:
    """A float matmul/convolution whose weight is an integer constant dequantized.

    A float module's weights are float constants; an integer weight dequantized
    (through layout ops) into a float kernel is a quantized op that
    litert-converter 0.5.0 left float.
    """
    producer = {t: op for op in report.ops for t in op.outputs}
    problems = []
    for k, op in enumerate(report.ops):
        if op.name not in _WEIGHTED or report.op_types(op)[1] != ["FLOAT32"]:
            continue
        src = producer.get(op.inputs[1])
        while src is not None and src.name in ("TRANSPOSE", "RESHAPE"):
            src = producer.get(src.inputs[0])
        if src is not None and src.name == "DEQUANTIZE" and src.inputs[0] not in producer:
            weight = report.tensors[src.inputs[0]].dtype
            problems.append(
                f"op {k} {op.name} computes in FLOAT32 with its {weight} weight dequantized: "
                "a rule asked for an integer kernel"
            )
    return problems


_WEIGHTED = ("FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D", "BATCH_MATMUL")


# Ops that convert or only move data: no float arithmetic of their own.
_NO_ARITHMETIC = frozenset({
    "QUANTIZE", "DEQUANTIZE", "CAST", "RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS",
    "CONCATENATION", "GATHER", "GATHER_ND", "SLICE", "STRIDED_SLICE", "BROADCAST_TO", "PAD",
    "PADV2", "PACK", "UNPACK", "SPLIT", "SPLIT_V", "REVERSE_V2", "TILE", "SELECT",
    "SELECT_V2", "SHAPE", "DEPTH_TO_SPACE", "SPACE_TO_DEPTH",
})  # fmt: skip


def check_agreement(tflite: bytes, fn: Callable[..., Any], inputs: Sequence[Any]) -> list[str]:
    """Problems of the layer-by-layer comparison with ``fn``, under both kernel sets.

    :func:`qlitert.compare_layers` runs under XNNPACK and under LiteRT's builtin
    kernels only, which check quantization parameters that XNNPACK accepts (an int8
    LOGISTIC's output scale must be 1/256) and round their rescaling differently;
    each kernel set must pass the rule of :mod:`qlitert.validation` on its own.
    Each problem names its kernel set.
    """
    problems = []
    for kernels in KERNELS:
        try:
            report = compare_layers(tflite, fn, *inputs, kernels=kernels)
        except ValueError as err:
            problems.append(f"with the {kernels} kernels: {err}")
            continue
        problems += [f"with the {kernels} kernels: {p}" for p in report.problems()]
    return problems


def save(path: str | os.PathLike, tflite: bytes, *, overwrite: bool = False) -> Path:
    """Writes the model ``tflite`` to ``path`` atomically; returns the absolute path.

    ``tflite`` is checked first (as :func:`~qlitert.inspect` does), so garbage never
    replaces a model. The bytes go to a temporary file beside ``path``, are synced
    to disk, and the temporary is renamed over ``path``
    (:func:`qcore.files.write_atomic`): a failure at any step leaves ``path`` as it
    was and no temporary behind. What is at ``path`` is checked as
    :func:`check_path` says: a previous LiteRT model is replaced only with
    ``overwrite=True``, anything else never.

    Args:
        path: The ``.tflite`` file to write.
        tflite: The flatbuffer bytes (from :func:`export`).
        overwrite: Replace a LiteRT model already at ``path``.

    Raises:
        TypeError: If ``tflite`` is not bytes or ``path`` not a path.
        ValueError: If ``tflite`` is not a valid LiteRT model.
        FileExistsError: If ``path`` holds something :func:`check_path` refuses.
        FileNotFoundError: If the directory of ``path`` does not exist.
        OSError: If writing fails (``path`` is then unchanged).
    """
    if not isinstance(tflite, bytes | bytearray | memoryview):
        raise TypeError(
            f"tflite is a {type(tflite).__name__}; allowed: the .tflite bytes from export()"
        )
    from_bytes(bytes(tflite), "tflite")
    return write_atomic(check_path(path, overwrite=overwrite), bytes(tflite))


def check_path(path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Checks that :func:`save` may write ``path``; returns it as an absolute path.

    Call it before a long conversion to fail early (``qtorchlike.export_tflite``
    does). Like every writer of the project, :func:`save` replaces only its own
    previous output, and only when told to: a LiteRT model at ``path`` (an empty
    file counts as free) needs ``overwrite=True``; a directory or any other file is
    never replaced.

    Args:
        path: The ``.tflite`` file to write.
        overwrite: Allow replacing a LiteRT model already at ``path``.

    Raises:
        TypeError: If ``path`` is not a str or ``os.PathLike``, or ``overwrite`` not
            a bool.
        FileExistsError: If ``path`` holds a model and ``overwrite`` is False, or
            holds anything else (a symbolic link is never followed or replaced).
        FileNotFoundError: If the directory of ``path`` does not exist.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> notes = Path(tempfile.mkdtemp()) / "notes.txt"
        >>> _ = notes.write_text("mine")
        >>> check_path(notes, overwrite=True)
        Traceback (most recent call last):
        ...
        FileExistsError: path='.../notes.txt' holds a file that is not a LiteRT model (...)...
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path={path!r} is a {type(path).__name__}; allowed: a str or os.PathLike")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite={overwrite!r}; allowed: True or False")
    target = Path(path).absolute()
    shown = f"path={str(target)!r}"
    if target.is_symlink():
        raise FileExistsError(f"{shown} is a symbolic link; pass the path it points to")
    if target.is_dir():
        raise FileExistsError(f"{shown} is a directory; allowed: a .tflite file path")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"{shown}: its directory does not exist")
    if target.exists():
        if not target.is_file():
            raise FileExistsError(f"{shown} is not a regular file; it is never replaced")
        with open(target, "rb") as f:
            head = f.read(8)
        if head and head[4:8] != b"TFL3":
            raise FileExistsError(
                f"{shown} holds a file that is not a LiteRT model (no 'TFL3' identifier); "
                "it is never replaced"
            )
        if head and not overwrite:
            raise FileExistsError(
                f"{shown} already holds a LiteRT model; pass overwrite=True to replace it"
            )
    return target
