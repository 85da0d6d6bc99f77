"""Running a ``.tflite`` model with the LiteRT interpreter.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import qlitert
    >>> from qlitert import qdq
    >>> s, z = qdq.activation_params(-1.0, 1.0)
    >>> tfl = qlitert.export(
    ...     lambda x: qdq.fake_quant(jnp.maximum(qdq.fake_quant(x, s, z), 0), s, z),
    ...     np.zeros((1, 4), np.float32),
    ... )
    >>> model = qlitert.LiteRTModel(tfl, num_threads=2)
    >>> model(np.array([[-0.5, 0.25, 0.5, 2.0]], np.float32)).round(3).tolist()
    [[0.0, 0.251, 0.502, 1.0]]
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

from qlitert.inspection import ModelReport, from_bytes, read
from qlitert.qdq import round_half_away

# What the interpreter raises for a model it cannot load (a damaged tensor name
# is a UnicodeDecodeError).
_LOAD_ERRORS = (ValueError, RuntimeError, UnicodeDecodeError)
# LiteRT's error for a lookup outside its table (a token id past the vocabulary):
# "gather_nd index out of boundsNode number 9 (GATHER_ND) failed to invoke."
_OUT_OF_BOUNDS = re.compile(r"index out of bounds.*?Node number (\d+) \((\w+)\)", re.S)


class LiteRTModel:
    """A ``.tflite`` model ready to run (``ai_edge_litert`` interpreter).

    The model is checked (:func:`qlitert.inspect`) before the interpreter sees
    it: a truncated or damaged file is a ValueError, not a crash.

    Non-finite inputs follow qlitert's NaN policy: the model quantizes each
    input with one static scale, so a NaN or inf anywhere in an input makes all
    of it non-finite, and every output computed from that input is NaN (the
    whole output: a ``.tflite`` model has no batch axis to tell examples apart).
    Integer outputs cannot hold NaN: computing one from a non-finite input is a
    ValueError.

    Integer inputs without quantization parameters (token ids) go in as they are,
    with either ``quantize_io``. LiteRT stops at an id outside a lookup's table
    (JAX's lookup returns NaN rows): that is a ValueError naming the input, its
    values and the allowed range.

    Args:
        tflite: The flatbuffer bytes, or the path of a ``.tflite`` file.
        num_threads: Interpreter threads.
        quantize_io: For integer inputs/outputs: quantize float inputs and
            dequantize outputs with the tensors' own parameters (default True);
            False passes and returns the integer codes.
        kernels: ``"xnnpack"`` (the default: LiteRT's XNNPACK delegate where it
            takes an op, the builtin kernels elsewhere) or ``"builtin"`` (the builtin
            kernels only, as on a device without XNNPACK; they check some
            quantization parameters that XNNPACK does not).
        preserve_all_tensors: Keep every intermediate tensor after a call, for
            :meth:`tensors` (LiteRT otherwise reuses their memory).

    Raises:
        TypeError: If ``tflite`` is neither bytes nor a path.
        ValueError: For ``num_threads`` < 1, unknown ``kernels``, or a model that is
            not valid or that LiteRT cannot load (naming the input and what is wrong).
    """

    def __init__(
        self,
        tflite: Any,
        *,
        num_threads: int = 2,
        quantize_io: bool = True,
        kernels: str = "xnnpack",
        preserve_all_tensors: bool = False,
    ) -> None:
        from ai_edge_litert.interpreter import (  # noqa: PLC0415 - heavy import
            Interpreter,
            OpResolverType,
        )

        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r}; allowed: an int >= 1")
        resolvers = {
            "xnnpack": OpResolverType.AUTO,
            "builtin": OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        }
        if kernels not in resolvers:
            raise ValueError(f"kernels={kernels!r}; allowed: 'xnnpack', 'builtin'")
        data, what = read(tflite)
        self._report = from_bytes(data, what)
        self._reaches = _reaches(self._report)
        self.tflite = data
        self.quantize_io = quantize_io
        self.preserve_all_tensors = bool(preserve_all_tensors)
        try:
            with warnings.catch_warnings():
                # LiteRT warns that preserving tensors costs memory: asked for here.
                warnings.filterwarnings("ignore", "Warning: Enabling `experimental_preserve_all")
                self._interpreter = Interpreter(
                    model_content=self.tflite,
                    num_threads=num_threads,
                    experimental_op_resolver_type=resolvers[kernels],
                    experimental_preserve_all_tensors=bool(preserve_all_tensors),
                )
            self._interpreter.allocate_tensors()
            self.inputs = self._interpreter.get_input_details()
            self.outputs = self._interpreter.get_output_details()
        except _LOAD_ERRORS as err:
            raise ValueError(f"{what}: LiteRT cannot load the model ({err})") from None

    def __call__(self, *inputs: Any) -> Any:
        """Runs the model; returns one array, or a tuple for several outputs.

        Outputs computed from an input holding NaN or inf are NaN (see the class).

        Raises:
            TypeError: For an input that is not numeric, or float codes where the
                model takes integer codes (``quantize_io=False``).
            ValueError: For a wrong number of inputs, a shape the model does not
                take, integer codes out of range, a non-finite input that an
                integer output is computed from, or integer inputs (token ids) that
                a lookup (``GATHER_ND``) finds outside its table.
        """
        if len(inputs) != len(self.inputs):
            names = [d["name"] for d in self.inputs]
            raise ValueError(
                f"the model takes {len(self.inputs)} inputs {names}, got {len(inputs)}"
            )
        it = self._interpreter
        nan_outputs: set[int] = set()
        for detail, x in zip(self.inputs, inputs, strict=True):
            x = self._check_input(np.asarray(x), detail)
            if x.dtype.kind == "f" and not np.all(np.isfinite(x)):
                reached = self._reaches[int(detail["index"])]
                self._check_nan_outputs(detail, reached, int(np.sum(~np.isfinite(x))))
                nan_outputs |= reached
            it.set_tensor(detail["index"], self._to_model(x, detail))
        try:
            it.invoke()
        except RuntimeError as err:
            lookup = self._lookup_error(str(err), inputs)
            if lookup is None:
                raise
            raise lookup from None
        outs = tuple(self._from_model(it.get_tensor(d["index"]), d) for d in self.outputs)
        outs = tuple(np.full_like(y, np.nan) if k in nan_outputs else y for k, y in enumerate(outs))
        return outs[0] if len(outs) == 1 else outs

    def tensors(self) -> dict[int, np.ndarray]:
        """Every tensor's value after the last call, by index (as :func:`qlitert.inspect`).

        Integer tensors hold their codes. Needs ``preserve_all_tensors=True``.

        Raises:
            ValueError: If the model was made without ``preserve_all_tensors``.
        """
        if not self.preserve_all_tensors:
            raise ValueError(
                "tensors() needs LiteRTModel(..., preserve_all_tensors=True): LiteRT reuses "
                "the memory of intermediate tensors otherwise"
            )
        values = {}
        for detail in self._interpreter.get_tensor_details():
            try:
                values[int(detail["index"])] = self._interpreter.get_tensor(detail["index"]).copy()
            except ValueError:  # a tensor without data (e.g. an optional input left out)
                continue
        return values

    def _quantized(self, detail: dict) -> bool:
        """Whether the wrapper quantizes / dequantizes this integer tensor."""
        dtype = np.dtype(detail["dtype"])
        return self.quantize_io and dtype.kind in "iu" and detail["quantization"][0] != 0

    def _check_input(self, x: np.ndarray, detail: dict) -> np.ndarray:
        name, dtype = detail["name"], np.dtype(detail["dtype"])
        shape = tuple(int(d) for d in detail["shape"])
        if x.dtype.kind not in "biuf":
            raise TypeError(
                f"input {name!r} has dtype {x.dtype}; allowed: a numeric array ({dtype})"
            )
        if tuple(x.shape) != shape:
            raise ValueError(
                f"input {name!r} has shape {shape} "
                f"(models are exported at a static shape), got {tuple(x.shape)}"
            )
        if dtype.kind in "iu" and not self._quantized(detail):
            # Codes of a quantized tensor (quantize_io=False), or integer data the
            # model takes as it is (token ids: no quantization parameters).
            what = f"{dtype} codes" if detail["quantization"][0] else f"{dtype} values"
            if x.dtype.kind == "f":
                how = (
                    f"quantize_io={self.quantize_io}"
                    if detail["quantization"][0]
                    else "integer data such as token ids: not quantized"
                )
                raise TypeError(
                    f"input {name!r} takes {what} ({how}), got {x.dtype} values; "
                    "allowed: an integer array"
                )
            info = np.iinfo(dtype)
            if x.size and (x.min() < info.min or x.max() > info.max):
                raise ValueError(
                    f"input {name!r} holds values in [{x.min()}, {x.max()}]; "
                    f"allowed: {what} in [{info.min}, {info.max}]"
                )
        return x

    def _lookup_error(self, message: str, inputs: tuple) -> ValueError | None:
        """The error naming the inputs of a lookup LiteRT found outside its table, if it is one.

        LiteRT's ``GATHER_ND`` stops the model with a RuntimeError naming only its node
        (JAX's lookup returns NaN rows instead). The node number is the op's index.
        """
        found = _OUT_OF_BOUNDS.search(message)
        if found is None or int(found.group(1)) >= len(self._report.ops):
            return None
        k, report = int(found.group(1)), self._report
        op = report.ops[k]
        table, indices = (report.tensors[i] for i in op.inputs[:2])
        sources = _sources(report, op.inputs[1])
        named = [
            f"input {d['name']!r}, which holds values in [{np.min(x)}, {np.max(x)}]"
            for d, x in zip(self.inputs, inputs, strict=True)
            if int(d["index"]) in sources and np.size(x)
        ]
        if not named:
            return None
        allowed = "indices within the table"
        if op.name == "GATHER_ND" and indices.shape and indices.shape[-1] == 1:
            n = table.shape[0]  # JAX counts negative indices from the end, and so does the model
            allowed = f"indices in [{-n}, {n - 1}] (negative ones count from the end, as in JAX)"
        return ValueError(
            f"{op.name} (op {k}) looks up a table of shape {table.shape} at an index out of "
            f"range; its indices are computed from {' and '.join(named)}; allowed: {allowed}"
        )

    def _check_nan_outputs(self, detail: dict, outputs: set[int], bad: int) -> None:
        for k in sorted(outputs):
            out = self.outputs[k]
            if np.dtype(out["dtype"]).kind in "iu" and not self._quantized(out):
                raise ValueError(
                    f"input {detail['name']!r} holds {bad} non-finite values (NaN or inf), "
                    f"and output {out['name']!r} is computed from it as "
                    f"{np.dtype(out['dtype'])} codes, which cannot hold NaN; allowed: finite "
                    "inputs (or quantize_io=True for float outputs)"
                )

    def _to_model(self, x: np.ndarray, detail: dict) -> np.ndarray:
        dtype = np.dtype(detail["dtype"])
        if not self._quantized(detail):
            return x.astype(dtype)
        scale, zp = detail["quantization"]
        info = np.iinfo(dtype)
        x = np.where(np.isfinite(x), x, 0)  # the outputs become NaN (see __call__)
        q = np.asarray(round_half_away(jnp.asarray(x / np.float32(scale)))) + zp  # as QUANTIZE
        return np.clip(q, info.min, info.max).astype(dtype)

    def _from_model(self, y: np.ndarray, detail: dict) -> np.ndarray:
        if not self._quantized(detail):
            return y
        scale, zp = detail["quantization"]
        return (y.astype(np.float32) - zp) * np.float32(scale)


def _sources(report: ModelReport, tensor: int) -> set[int]:
    """The graph input tensors that ``tensor`` is computed from."""
    producer = {o: op for op in report.ops for o in op.outputs}
    seen, todo = set(), [tensor]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in producer:
            todo.extend(i for i in producer[t].inputs if i >= 0)
    return seen & set(report.inputs)


def _reaches(report: ModelReport) -> dict[int, set[int]]:
    """For each graph input tensor, the positions of the graph outputs computed from it."""
    reaches = {}
    for i in report.inputs:
        seen = {i}
        for op in report.ops:  # in execution order
            if seen.intersection(op.inputs):
                seen.update(op.outputs)
        reaches[i] = {k for k, o in enumerate(report.outputs) if o in seen}
    return reaches
