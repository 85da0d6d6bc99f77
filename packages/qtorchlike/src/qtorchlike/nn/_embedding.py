"""``QuantEmbedding``: a lookup table whose rows are read from the quantized weight."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from qtorchlike import random
from qtorchlike._proxy import has_quant
from qtorchlike.nn._quant_layer import check_bool, split_kwargs, weight_proxy
from qtorchlike.nn.module import Module, Parameter
from qtorchlike.quant import Int8WeightPerTensorFloat
from qtorchlike.quant_tensor import QuantTensor


class QuantEmbedding(Module):
    """An embedding table ``(num_embeddings, embedding_dim)`` with a quantized weight.

    The weight starts ``N(0, 1)`` as in PyTorch (the ``padding_idx`` row at
    zero, and that row receives no gradient). Its quantizer sees rows as output
    channels (a per-channel quantizer gives one scale per embedding). The output
    is a QuantTensor only with ``return_quant_tensor`` and a per-tensor weight
    scale; with per-row scales it is the plain array.

    Args:
        num_embeddings: Rows of the table.
        embedding_dim: Size of each row.
        padding_idx: A row kept at zero without gradient (negative counts from the end).
        weight_quant: Weight quantizer (default ``Int8WeightPerTensorFloat``).
        return_quant_tensor: Return a QuantTensor (per-tensor weight scale) instead of values.
        key: PRNG key for the initial weights (default: the global seed).
        **kwargs: Weight quantizer overrides with the prefix ``weight_`` (``weight_bit_width=4``).

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> emb = qnn.QuantEmbedding(10, 4, weight_bit_width=4, return_quant_tensor=True)
        >>> y = emb(jnp.array([[1, 2, 3]]))
        >>> y.shape, float(y.bit_width), int(abs(y.int()).max()) <= 7
        ((1, 3, 4), 4.0, True)
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        weight_quant: Any = Int8WeightPerTensorFloat,
        return_quant_tensor: bool = False,
        *,
        key: jax.Array | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"padding_idx={padding_idx!r} must be in [-{num_embeddings}, "
                    f"{num_embeddings - 1}] (num_embeddings={num_embeddings}) or None"
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        w = jax.random.normal(
            random.next_key() if key is None else key, (num_embeddings, embedding_dim)
        )
        if padding_idx is not None:
            w = w.at[padding_idx].set(0.0)
        self.weight = Parameter(w)
        groups = split_kwargs(type(self).__name__, kwargs, ("weight_",))
        self.weight_quant = weight_proxy(self, weight_quant, groups["weight_"], 0, 1)
        self.return_quant_tensor = check_bool("return_quant_tensor", return_quant_tensor)

    def quant_weight(self) -> Any:
        """The table as the layer reads it: a QuantTensor, or the float weight."""
        if not has_quant(self.weight_quant):
            return self.weight
        return self.weight_quant(self.weight, 0, 1)

    def _check_ids(self, ids: jax.Array) -> None:
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(
                f"{type(self).__name__} takes integer ids; got dtype {ids.dtype} "
                "(cast with .astype(jnp.int32))"
            )
        if isinstance(ids, Tracer) or ids.size == 0:
            return
        arr = np.asarray(ids)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.num_embeddings:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"{type(self).__name__}: id {bad} is out of range; ids must be in "
                f"[0, {self.num_embeddings - 1}] (num_embeddings={self.num_embeddings})"
            )

    def forward(self, ids: Any) -> Any:
        """Gathers rows of the quantized table.

        Args:
            ids: Integer ids of any shape.

        Returns:
            ``ids.shape + (embedding_dim,)`` values: a QuantTensor (per-tensor weight
            scale and ``return_quant_tensor``) or an array. Under ``jax.jit`` an
            out-of-range id gives a row of NaN.

        Raises:
            TypeError: If ``ids`` are not integers.
            IndexError: If a (concrete) id is outside ``[0, num_embeddings)``.
        """
        ids = ids if isinstance(ids, jax.Array) else jnp.asarray(ids)
        self._check_ids(ids)
        wq = self.quant_weight()
        table = wq.value if isinstance(wq, QuantTensor) else wq
        n = self.num_embeddings
        safe = jnp.where((ids >= 0) & (ids < n), ids, n)  # n: filled with NaN
        out = jnp.take(table, safe, axis=0, mode="fill", fill_value=jnp.nan)
        if self.padding_idx is not None:
            pad = (ids == self.padding_idx)[..., None]
            out = jnp.where(pad, jax.lax.stop_gradient(out), out)
        if not (self.return_quant_tensor and isinstance(wq, QuantTensor) and wq.is_per_tensor):
            return out
        ones = (1,) * out.ndim
        return QuantTensor(
            out,
            wq.scale.reshape(ones),
            wq.zero_point.reshape(()),
            wq.bit_width,
            wq.signed,
            wq.training,
        )

    def extra_repr(self) -> str:  # noqa: D102
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"
