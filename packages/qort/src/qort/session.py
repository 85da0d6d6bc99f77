"""Run an exported model with ONNX Runtime, fed NumPy or JAX arrays.

Example:
    >>> import jax.numpy as jnp
    >>> import qort
    >>> exported = qort.export_function(lambda x: jnp.tanh(x) * 2.0, jnp.zeros((2, 3)))
    >>> session = qort.Session(exported)
    >>> session(jnp.ones((2, 3))).round(4).tolist()
    [[1.5232, 1.5232, 1.5232], [1.5232, 1.5232, 1.5232]]
    >>> session(jnp.ones((2, 4)))
    Traceback (most recent call last):
    ...
    ValueError: input 'input_0' has shape (2, 4); the model takes (2, 3)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qort import _tree
from qort._errors import kind

_ONNX_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(bool)": np.bool_,
}


def session_options(threads: int | None = None) -> Any:
    """ONNX Runtime session options: all graph optimizations, warnings silenced.

    Args:
        threads: Intra-op threads; None lets ONNX Runtime choose (one per core).
    """
    import onnxruntime as ort  # noqa: PLC0415 - heavy import, needed only here

    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads={threads!r}; allowed: a positive int or None")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ONNX Runtime fuses DequantizeLinear + MatMul into MatMulNBits and by default
    # (accuracy level 4) quantizes its float input to int8 there: a weight-only model
    # would compute something else than it was validated against. Level 1: float32.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    if threads is not None:
        options.intra_op_num_threads = threads
    return options


class Session:
    """An ONNX Runtime session on the CPU that takes and returns arrays.

    Args:
        model: An :class:`~qort.Exported`, an ``onnx.ModelProto`` or the path of a
            ``.onnx`` file.
        threads: Intra-op threads (None: ONNX Runtime's default, one per core).

    Calling it with the model's inputs in order returns its outputs as NumPy arrays
    in the exported function's output structure (one array, or the tuples, lists and
    dicts it returned; a ``.onnx`` file carries that structure in its metadata, and
    a structure with other node types comes back as a flat tuple). The inputs are
    the array *leaves* of the example inputs, in ``jax.tree.leaves`` order (a dict's
    keys sorted): for ``export_function(fn, {"b": x, "a": y})`` call
    ``session(y, x)``, or :meth:`run` by input name. Inputs may be NumPy
    or JAX arrays, or anything ``np.asarray`` takes; float64 inputs of a float32
    model are cast; integer inputs (token ids) may be any integer dtype whose values
    fit the model's. Wrong counts, shapes and dtypes raise ``ValueError`` naming the
    input.
    """

    def __init__(self, model: Any, *, threads: int | None = None) -> None:
        import onnxruntime as ort  # noqa: PLC0415

        self._out_tree = getattr(model, "out_tree", None)
        if hasattr(model, "model") and isinstance(model.model, onnx.ModelProto):
            model = model.model
        if isinstance(model, onnx.ModelProto):
            source: Any = model.SerializeToString()
        elif isinstance(model, str | os.PathLike):
            path = Path(model).expanduser()
            if not path.is_file():
                raise ValueError(f"model={str(model)!r} is not a file; allowed: a .onnx file")
            source = str(path)
        else:
            raise TypeError(
                f"model is {kind(model)}; allowed: qort.Exported, onnx.ModelProto or a path"
            )
        self._session = ort.InferenceSession(
            source, session_options(threads), providers=["CPUExecutionProvider"]
        )
        self.inputs = [
            (i.name, tuple(i.shape), _ONNX_TO_NUMPY.get(i.type)) for i in self._session.get_inputs()
        ]
        self.output_names = [o.name for o in self._session.get_outputs()]
        meta = self._session.get_modelmeta().custom_metadata_map
        self._structure = meta.get(_tree.KEY) if self._out_tree is None else None

    def __call__(self, *args: Any) -> Any:
        """Runs the model (see the class docstring)."""
        if len(args) != len(self.inputs):
            raise ValueError(
                f"got {len(args)} inputs; the model takes {len(self.inputs)}: "
                + ", ".join(f"{n} {s}" for n, s, _ in self.inputs)
            )
        feeds = {n: _checked(n, s, d, a) for (n, s, d), a in zip(self.inputs, args, strict=True)}
        outs = self._session.run(self.output_names, feeds)
        if self._out_tree is not None:
            import jax  # noqa: PLC0415

            return jax.tree.unflatten(self._out_tree, outs)
        if self._structure is not None:
            return _tree.decode(self._structure, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run(self, feeds: dict[str, Any]) -> list[np.ndarray]:
        """Runs the model on inputs given by name; returns every output in order."""
        names = [n for n, _, _ in self.inputs]
        unknown = set(feeds) - set(names)
        if unknown:
            raise ValueError(f"unknown inputs {sorted(unknown)}; the model takes {names}")
        args = []
        for n, _, _ in self.inputs:
            if n not in feeds:
                raise ValueError(f"input {n!r} is missing")
            args.append(feeds[n])
        feeds = {n: _checked(n, s, d, a) for (n, s, d), a in zip(self.inputs, args, strict=True)}
        return [np.asarray(y) for y in self._session.run(self.output_names, feeds)]


def _checked(name: str, shape: Sequence[Any], dtype: Any, value: Any) -> np.ndarray:
    try:
        x = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the caller's input
        raise ValueError(f"input {name!r} is not an array ({type(value).__name__}): {e}") from None
    if x.dtype.kind in "OUS":  # None, a str, an object: np.asarray makes them 0-d arrays
        raise ValueError(f"input {name!r} is {kind(value)}; allowed: an array")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"input {name!r} has shape {tuple(x.shape)}; the model takes {tuple(shape)}"
        )
    if dtype is None or x.dtype == dtype:
        return x
    want = np.dtype(dtype)
    if np.issubdtype(want, np.integer) and np.issubdtype(x.dtype, np.integer):
        info = np.iinfo(want)
        if x.size and (x.min() < info.min or x.max() > info.max):
            raise ValueError(
                f"input {name!r} holds values in [{x.min()}, {x.max()}], outside {want.name}'s "
                f"range [{info.min}, {info.max}]"
            )
        return x.astype(want)
    if np.issubdtype(want, np.floating) and np.issubdtype(x.dtype, np.floating):
        return x.astype(want)
    raise ValueError(f"input {name!r} has dtype {x.dtype.name}; the model takes {want.name}")
