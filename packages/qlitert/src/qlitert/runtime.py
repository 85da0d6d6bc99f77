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

from typing import Any

import jax.numpy as jnp
import numpy as np

from qlitert.qdq import round_half_away


class LiteRTModel:
    """A ``.tflite`` model ready to run (``ai_edge_litert`` interpreter).

    Args:
        tflite: The flatbuffer bytes.
        num_threads: Interpreter threads.
        quantize_io: For integer inputs/outputs: quantize float inputs and
            dequantize outputs with the tensors' own parameters (default True);
            False passes and returns the integer codes.
    """

    def __init__(self, tflite: bytes, *, num_threads: int = 2, quantize_io: bool = True) -> None:
        from ai_edge_litert.interpreter import Interpreter  # noqa: PLC0415 - heavy import

        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads} must be >= 1")
        self.tflite = bytes(tflite)
        self.quantize_io = quantize_io
        self._interpreter = Interpreter(model_content=self.tflite, num_threads=num_threads)
        self._interpreter.allocate_tensors()
        self.inputs = self._interpreter.get_input_details()
        self.outputs = self._interpreter.get_output_details()

    def __call__(self, *inputs: Any) -> Any:
        """Runs the model; returns one array, or a tuple for several outputs.

        Raises:
            ValueError: For a wrong number of inputs or a shape the model does not take.
        """
        if len(inputs) != len(self.inputs):
            raise ValueError(f"the model takes {len(self.inputs)} inputs, got {len(inputs)}")
        it = self._interpreter
        for detail, x in zip(self.inputs, inputs, strict=True):
            x = np.asarray(x)
            shape = tuple(int(d) for d in detail["shape"])
            if tuple(x.shape) != shape:
                raise ValueError(
                    f"input {detail['name']!r} has shape {shape} "
                    f"(models are exported at a static shape), got {tuple(x.shape)}"
                )
            it.set_tensor(detail["index"], self._to_model(x, detail))
        it.invoke()
        outs = tuple(self._from_model(it.get_tensor(d["index"]), d) for d in self.outputs)
        return outs[0] if len(outs) == 1 else outs

    def _to_model(self, x: np.ndarray, detail: dict) -> np.ndarray:
        dtype = np.dtype(detail["dtype"])
        if not np.issubdtype(dtype, np.integer) or not self.quantize_io:
            return x.astype(dtype)
        scale, zp = detail["quantization"]
        info = np.iinfo(dtype)
        q = np.asarray(round_half_away(jnp.asarray(x / np.float32(scale)))) + zp  # as QUANTIZE
        return np.clip(q, info.min, info.max).astype(dtype)

    def _from_model(self, y: np.ndarray, detail: dict) -> np.ndarray:
        if not np.issubdtype(y.dtype, np.integer) or not self.quantize_io:
            return y
        scale, zp = detail["quantization"]
        return (y.astype(np.float32) - zp) * np.float32(scale)
