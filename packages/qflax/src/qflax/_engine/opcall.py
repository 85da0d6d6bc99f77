"""One intercepted op call, in a form the providers can quantize.

:func:`bind` turns ``(op, original, args, kwargs)`` into an :class:`OpCall` (a
contraction: its two array operands, for each the axes it is contracted over (a
weight gets one scale per remaining axis), and functions that run the op with
qcore (operands may be QArrays) or with qcore's training ops) or a
:class:`TakeCall` (a table lookup). ``jnp.dot`` / ``jnp.matmul`` / ``@`` /
``jnp.vecdot`` become the equivalent two-operand einsum, ``lax.dot`` a
``dot_general``. Calls qflax does not quantize (an ``out_sharding``, a
``group_offset``, 0-d operands, complex ``vecdot``, indexing by slices or masks)
bind to None and run as they are; an einsum of more than two operands is split
(:func:`einsum_splits`) into the contractions it calls.

The binders here are the built-in ops' entries of :mod:`qflax._engine.registry`.
"""

from __future__ import annotations

import dataclasses
import inspect
import string
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qcore

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class OpCall:
    """A bound two-operand op.

    Attributes:
        name: The op's registry name (see :func:`qflax.op_names`).
        operands: ``(lhs, rhs)``.
        contracting: Contracted axes of each operand.
        batch: Batch axes of each operand (``dot_general``'s batch dimensions, an
            einsum's letters in both operands and the output), paired in order.
        run: ``run(lhs, rhs)`` computes the op with qcore (QArrays allowed).
        train: ``train(lhs, rhs, config, key)`` computes it with qcore's training
            op for a :class:`qcore.TrainingQuant`.
        forward_float: ``forward_float(lhs, rhs)``: the float op, for gradients.
    """

    name: str
    operands: tuple[Array, Array]
    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    run: Callable[[Any, Any], Array]
    train: Callable[[Array, Array, qcore.TrainingQuant, Array | None], Array]
    forward_float: Callable[[Array, Array], Array]
    batch: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @classmethod
    def from_einsum(cls, name: str, subscripts: str, lhs: Array, rhs: Array) -> OpCall | None:
        """The call ``jnp.einsum(subscripts, lhs, rhs)`` under the op name ``name``.

        For an op registered with :func:`qflax.register_op` that computes a
        two-operand einsum; None (the call runs float) for operands that are not
        arrays of rank >= 1 or subscripts that do not fit them.
        """
        if not (_is_array(lhs) and _is_array(rhs)):
            return None
        return _einsum_call(name, _explicit(subscripts, lhs.ndim, rhs.ndim), lhs, rhs, {})


@dataclasses.dataclass(frozen=True)
class TakeCall:
    """A bound table lookup (``jnp.take`` or indexing ``table[ids]``), as ``jnp.take``'s.

    Indexing becomes a ``jnp.take`` along axis 0 with indexing's out-of-range rule:
    negative ids count from the end, then ids out of range are clamped
    (``mode="clip"``) or give ``fill_value`` (``mode="fill"``).

    Attributes:
        name: The op's name (``"take"``).
        table: The array looked up in.
        indices: The integer ids.
        axis: The axis of ``table`` the ids index.
        mode: ``jnp.take``'s out-of-range mode.
        fill_value: The value of out-of-range ids under ``mode="fill"``.
        unique_indices: ``jnp.take``'s hint.
        indices_are_sorted: ``jnp.take``'s hint.
    """

    name: str
    table: Array
    indices: Any  # an integer jax.Array or np.ndarray
    axis: int
    mode: str | None
    fill_value: Any
    unique_indices: bool
    indices_are_sorted: bool

    def take(self, table: Array) -> Array:
        """The lookup in ``table`` (a float array, e.g. fake-quantized), not ``self.table``."""
        return jax.numpy.take(
            table,
            self.indices,
            self.axis,
            mode=self.mode,
            unique_indices=self.unique_indices,
            indices_are_sorted=self.indices_are_sorted,
            fill_value=self.fill_value,
        )

    def take_quantized(self, table: qcore.QArray) -> Array:
        """The lookup in a quantized table, dequantized to ``self.table``'s dtype."""
        return qcore.take(
            table,
            self.indices,
            self.axis,
            mode=self.mode,
            fill_value=self.fill_value,
            dtype=self.table.dtype,
        )


Call = OpCall | TakeCall
Binder = Callable[[dict[str, Any]], "Call | None"]


def bind(
    binder: Binder, original: Callable[..., Any], args: tuple, kwargs: dict
) -> OpCall | TakeCall | None:
    """The call's arguments bound by name (``original``'s signature), then ``binder(arguments)``.

    None (the call runs as it is) for a call with an ``out_sharding`` or one the
    binder leaves float.
    """
    a = arguments(original, args, kwargs)
    if a.get("out_sharding") is not None:
        return None
    return binder(a)


def arguments(original: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (``original``'s signature), defaults included."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _pet(a: dict) -> dict[str, Any]:
    return {
        "precision": a.get("precision"),
        "preferred_element_type": a.get("preferred_element_type"),
    }


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.ndim > 0


def dot_general(a: dict) -> OpCall | None:
    """``lax.dot_general``, and ``lax.dot`` (whose dimension numbers may be left out)."""
    lhs, rhs, dn = a["lhs"], a["rhs"], a["dimension_numbers"]
    if not (_is_array(lhs) and _is_array(rhs)):
        return None
    if dn is None:  # lax.dot's default: a matrix/vector product
        if lhs.ndim > 2 or rhs.ndim > 2:
            return None  # lax.dot raises
        dn = (((lhs.ndim - 1,), (0,)), ((), ()))
    (lc, rc), (lb, rb) = dn
    lc, rc = tuple(int(i) % lhs.ndim for i in lc), tuple(int(i) % rhs.ndim for i in rc)
    kw = _pet(a)

    def train(x, w, config, key):
        return qcore.train_dot_general(x, w, dn, config, key=key, **kw)

    return OpCall(
        "dot_general",
        (lhs, rhs),
        (lc, rc),
        lambda x, w: qcore.dot_general(x, w, dn, **kw),
        train,
        lambda x, w: lax.dot_general(x, w, dn, **kw),
        (tuple(int(i) % lhs.ndim for i in lb), tuple(int(i) % rhs.ndim for i in rb)),
    )


def _einsum_call(name: str, subscripts: str, lhs: Array, rhs: Array, kw: dict) -> OpCall | None:
    spec = subscripts.replace(" ", "")
    if "->" not in spec or "." in spec:
        return None
    ins, out = spec.split("->")
    terms = ins.split(",")
    if len(terms) != 2 or len(terms[0]) != lhs.ndim or len(terms[1]) != rhs.ndim:
        return None
    contracting = tuple(tuple(i for i, c in enumerate(t) if c not in out) for t in terms)
    shared = [c for c in terms[0] if c in terms[1] and c in out]

    def train(x, w, config, key):
        return qcore.train_einsum(spec, x, w, config, key=key, **kw)

    return OpCall(
        name,
        (lhs, rhs),
        (contracting[0], contracting[1]),
        lambda x, w: qcore.einsum(spec, x, w, **kw),
        train,
        lambda x, w: jax.numpy.einsum(spec, x, w, **kw),
        (tuple(terms[0].index(c) for c in shared), tuple(terms[1].index(c) for c in shared)),
    )


def einsum(a: dict) -> OpCall | None:
    """``jnp.einsum`` of two operands, with subscripts or in the sublist form."""
    found = _einsum_operands(a)
    if found is None:
        return None
    subscripts, operands = found
    if len(operands) != 2:
        return None
    lhs, rhs = operands
    if not (_is_array(lhs) and _is_array(rhs)):
        return None
    return _einsum_call("einsum", _explicit(subscripts, lhs.ndim, rhs.ndim), lhs, rhs, _pet(a))


def einsum_splits(a: dict) -> bool:
    """Whether an einsum call has more than two operands (it is their pairwise contractions)."""
    found = _einsum_operands(a)
    return found is not None and len(found[1]) > 2


# Sublist labels as letters, in the order of the labels (sorted, like numpy's output).
_LABELS = string.ascii_uppercase + string.ascii_lowercase


def _einsum_operands(a: dict) -> tuple[str, tuple[Any, ...]] | None:
    """An einsum call's subscripts and operands; the sublist form becomes subscripts.

    ``einsum(x, [0, 1], w, [1, 2], [0, 2])`` (as ``jnp.linalg.multi_dot`` calls it)
    is ``einsum("AB,BC->AC", x, w)``. None for what cannot be read (labels that are
    not small ints or ``...``).
    """
    first, rest = a["subscripts"], tuple(a["operands"])
    if isinstance(first, str):
        return first, rest
    items = (first, *rest)
    out = items[-1] if len(items) % 2 else None
    items = items[: len(items) - len(items) % 2]
    arrays, sublists = items[0::2], items[1::2]

    def letters(labels: Any) -> str | None:
        try:
            return "".join("..." if i is Ellipsis else _LABELS[int(i)] for i in labels)
        except (TypeError, ValueError, IndexError):
            return None

    terms = [letters(s) for s in sublists]
    tail = None if out is None else letters(out)
    if None in terms or (out is not None and tail is None):
        return None
    spec = ",".join(t for t in terms if t is not None)
    return (spec if tail is None else f"{spec}->{tail}"), arrays


def _explicit(subscripts: str, n_lhs: int, n_rhs: int) -> str:
    """Subscripts with ``...`` expanded and the output written out (numpy's rules)."""
    spec = subscripts.replace(" ", "")
    ins, out = spec.split("->") if "->" in spec else (spec, None)
    terms = ins.split(",")
    if len(terms) != 2:
        return spec
    free = [c for c in string.ascii_letters if c not in spec]
    width = max(n - len(t.replace("...", "")) for t, n in zip(terms, (n_lhs, n_rhs), strict=True))
    ell = "".join(free[:width]) if width > 0 else ""
    expanded = []
    for t, n in zip(terms, (n_lhs, n_rhs), strict=True):
        k = n - len(t.replace("...", ""))
        expanded.append(t.replace("...", ell[width - k :] if k > 0 else ""))
    if out is None:
        letters = expanded[0] + expanded[1]
        out = ell + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell)
        )
    else:
        out = out.replace("...", ell)
    return f"{expanded[0]},{expanded[1]}->{out}"


def _matmul_subscripts(name: str, n_a: int, n_b: int) -> str | None:
    """Einsum subscripts equal to ``jnp.dot`` / ``jnp.matmul`` for these ranks.

    ``matmul`` shares (does not broadcast) the leading axes of two >2-D operands.
    """
    if n_a == 0 or n_b == 0:
        return None
    a_lead = string.ascii_lowercase[: n_a - 1]  # a's axes but the contracted last one
    if n_b == 1:
        return f"{a_lead}z,z->{a_lead}"
    if name == "dot" or n_a <= 2:
        b_lead = string.ascii_lowercase[n_a - 1 : n_a - 1 + n_b - 2]
        if name == "matmul" and n_a == 2:  # (r, k) @ (..., k, y) -> (..., r, y)
            return f"{a_lead}z,{b_lead}zy->{b_lead}{a_lead}y"
        return f"{a_lead}z,{b_lead}zy->{a_lead}{b_lead}y"
    if n_b == 2:
        return f"{a_lead}z,zy->{a_lead}y"
    return f"{a_lead}z,{a_lead[:-1]}zy->{a_lead}y"


def dot_like(name: str) -> Callable[[dict], OpCall | None]:
    def binder(a: dict) -> OpCall | None:
        x, y = a["a"], a["b"]
        if not (_is_array(x) and _is_array(y)):
            return None
        if name == "matmul" and x.ndim > 2 and y.ndim > 2 and x.shape[:-2] != y.shape[:-2]:
            return None  # broadcasting batch axes: leave it to jnp.matmul
        subscripts = _matmul_subscripts(name, x.ndim, y.ndim)
        return None if subscripts is None else _einsum_call(name, subscripts, x, y, _pet(a))

    return binder


def vecdot(a: dict) -> OpCall | None:
    """``jnp.vecdot`` / ``jnp.linalg.vecdot`` of real operands, as an einsum.

    The other axes broadcast: right-aligned, equal axes are shared, an axis of size
    1 facing a longer one is summed away (it holds one value), a missing axis is
    the other operand's alone.
    """
    x, y = a["x1"], a["x2"]
    if not (_is_array(x) and _is_array(y)):
        return None
    if jnp.iscomplexobj(x) or jnp.iscomplexobj(y):
        return None  # vecdot conjugates x1
    free = iter(c for c in string.ascii_letters if c != "z")
    terms: list[list[str]] = [[], []]
    out: list[str] = []
    axes = [[i for i in range(v.ndim) if i != int(a["axis"]) % v.ndim] for v in (x, y)]
    for k in range(1, max(map(len, axes)) + 1):
        sizes = [v.shape[ax[-k]] if k <= len(ax) else None for v, ax in zip((x, y), axes)]  # noqa: B905
        shared = next(free)
        out.insert(0, shared)
        for i, size in enumerate(sizes):
            other = sizes[1 - i]
            if size is None:
                continue
            if size == 1 and other not in (None, 1):
                terms[i].insert(0, next(free))  # broadcast: summed over one value
            elif size == other or other in (None, 1):
                terms[i].insert(0, shared)
            else:
                return None  # shapes that do not broadcast: vecdot raises
    for t, v in zip(terms, (x, y), strict=True):
        t.insert(int(a["axis"]) % v.ndim, "z")
    spec = f"{''.join(terms[0])},{''.join(terms[1])}->{''.join(out)}"
    return _einsum_call("vecdot", spec, x, y, _pet(a))


def conv(a: dict) -> OpCall | None:
    lhs, rhs = a["lhs"], a["rhs"]
    if not (_is_array(lhs) and _is_array(rhs)):
        return None
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, a["dimension_numbers"])
    conv = {k: _ints(a[k]) for k in ("lhs_dilation", "rhs_dilation")}
    conv.update({k: a[k] for k in ("feature_group_count", "batch_group_count")})
    conv.update(_pet(a), dimension_numbers=a["dimension_numbers"])
    # lax takes NumPy integers (nn.ConvTranspose passes them); qcore's static args are ints.
    strides, padding = _ints(a["window_strides"]), a["padding"]
    if not isinstance(padding, str):
        padding = tuple((int(lo), int(hi)) for lo, hi in padding)
    out_feature = dn.rhs_spec[0]

    def train(x, w, config, key):
        return qcore.train_conv_general_dilated(x, w, strides, padding, config, key=key, **conv)

    return OpCall(
        "conv_general_dilated",
        (lhs, rhs),
        (
            tuple(i for i in range(lhs.ndim) if i != dn.lhs_spec[0]),
            tuple(i for i in range(rhs.ndim) if i != out_feature),
        ),
        lambda x, w: qcore.conv_general_dilated(x, w, strides, padding, **conv),
        train,
        lambda x, w: lax.conv_general_dilated(x, w, strides, padding, **conv),
    )


def _ints(x: Any) -> Any:
    """A sequence of (NumPy) integers as a tuple of ints; None stays None."""
    return None if x is None else tuple(int(i) for i in x)


def ragged_dot(a: dict) -> OpCall | None:
    lhs, rhs, sizes = a["lhs"], a["rhs"], a["group_sizes"]
    if a.get("group_offset") is not None or not (_is_array(lhs) and _is_array(rhs)):
        return None
    if lhs.ndim != 2 or rhs.ndim != 3:
        return None
    kw = _pet(a)

    def train(x, w, config, key):
        return qcore.train_ragged_dot(x, w, sizes, config, key=key, **kw)

    return OpCall(
        "ragged_dot",
        (lhs, rhs),
        ((1,), (1,)),
        lambda x, w: qcore.ragged_dot(x, w, sizes, **kw),
        train,
        lambda x, w: lax.ragged_dot(x, w, sizes, **kw),
    )


def take(a: dict) -> TakeCall | None:
    """A lookup (``jnp.take``'s or indexing's arguments) as a :class:`TakeCall`, or None.

    Left float: ``jnp.take`` with ``axis=None`` (a lookup in the flattened array)
    or an ``out`` argument; indexing by anything but one integer array (slices,
    several indices, boolean masks, Python ints); a 0-d table.
    """
    if "idx" in a:  # indexing: jax's rewriting_take(arr, idx, ...)
        found = _indexing_as_take(a)
        if found is None:
            return None
        table, indices, axis, mode = found
    else:
        table, indices, axis, mode = a["a"], a["indices"], a["axis"], a["mode"]
        if axis is None or a["out"] is not None:
            return None
    if not _is_array(table):
        return None
    return TakeCall(
        "take",
        table,
        indices,
        int(axis),
        mode,
        a["fill_value"],
        a["unique_indices"],
        a["indices_are_sorted"],
    )


_CLAMPING = (None, "clip", "promise_in_bounds")
_FILLING = ("fill", "drop", "fill_or_drop")


def reshape_index(idx: Any) -> bool:
    """Whether indexing by ``idx`` only adds or keeps axes (``None``, ``...``, ``:``)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)


def static_index(idx: Any) -> bool:
    """Whether ``idx`` holds no arrays (ints, slices, ``None``, ``...``)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    return not any(isinstance(i, jax.Array | np.ndarray | list) for i in items)


def _indexing_as_take(a: dict) -> tuple[Any, Any, int, str] | None:
    """``rewriting_take``'s arguments (``arr[idx]``) as jnp.take's table, ids, axis, mode."""
    idx, table = a["idx"], a["arr"]
    if isinstance(idx, tuple):
        if len(idx) != 1:
            return None
        idx = idx[0]
    mode = a["mode"]
    mode = getattr(mode, "name", mode)
    mode = mode.lower() if isinstance(mode, str) else mode
    integer = isinstance(idx, jax.Array | np.ndarray) and jnp.issubdtype(idx.dtype, jnp.integer)
    if not integer or mode not in _CLAMPING + _FILLING or not _is_array(table):
        return None
    if mode in _CLAMPING:
        # Indexing wraps negative ids once, then clamps: jnp.take(mode="clip") clamps only.
        return table, jnp.where(idx < 0, idx + table.shape[0], idx), 0, "clip"
    return table, idx, 0, "fill"  # "drop" is indexing's name for it; ids wrap in both
