"""``einsum`` of two operands, either of which may be a QArray.

The subscripts are turned into ``dot_general`` dimension numbers (letters in both
operands and the output are batch axes, in both operands only contracting axes),
so the integer path and on-the-fly scaling of :mod:`qcore.ops.dot_general` apply.
Ellipses are supported. Subscripts that are not a plain contraction (a letter
repeated inside one operand, a letter summed out of a single operand, or
ellipsis dims that need broadcasting) fall back to dequantizing and calling
``jnp.einsum`` on the float values.
"""

from __future__ import annotations

import string
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from qcore.ops.dot_general import dot_general
from qcore.ops.operand import as_input, operand, preferred_dtype, promote
from qcore.qarray import QArray

Array = jax.Array


def _parse(subscripts: str, ndims: tuple[int, int]) -> tuple[list[str], str]:
    """Returns the two operands' letter lists and the output letters, ellipses expanded."""
    spec = subscripts.replace(" ", "")
    if "->" in spec:
        ins, out = spec.split("->")
    else:
        ins, out = spec, None
    terms = ins.split(",")
    if len(terms) != 2:
        raise ValueError(
            f"subscripts={subscripts!r} must name exactly two operands (e.g. 'ij,jk->ik')"
        )
    used = set(spec) - set(".,->")
    spare = [c for c in string.ascii_letters if c not in used]
    n_ell = []
    for term, nd in zip(terms, ndims, strict=True):
        named = len(term.replace("...", ""))
        if ("..." in term and named > nd) or ("..." not in term and named != nd):
            raise ValueError(
                f"subscripts={subscripts!r}: operand term {term!r} does not match its rank {nd}"
            )
        n_ell.append(nd - named if "..." in term else 0)
    width = max(n_ell)
    ell = spare[:width]
    letters = []
    for term, n in zip(terms, n_ell, strict=True):
        letters.append(list(term.replace("...", "".join(ell[width - n :]))))
    if out is None:
        counts = {c: sum(t.count(c) for t in letters) for c in set(letters[0] + letters[1])}
        out = "".join(ell) + "".join(
            sorted(c for c, k in counts.items() if k == 1 and c not in ell)
        )
    else:
        out = out.replace("...", "".join(ell))
    for c in out:
        if c not in letters[0] and c not in letters[1]:
            raise ValueError(f"subscripts={subscripts!r}: output letter {c!r} is in no operand")
    return letters, out


def check_einsum(subscripts: str, lshape: tuple[int, ...], rshape: tuple[int, ...]) -> None:
    """Raises if ``subscripts`` do not fit the operands' ranks or a letter's sizes differ.

    A size of 1 broadcasts, as in ``jnp.einsum``.
    """
    (la, lb), _ = _parse(subscripts, (len(lshape), len(rshape)))
    for c in dict.fromkeys(la + lb):
        sizes = [
            d
            for ls, sh in ((la, lshape), (lb, rshape))
            for e, d in zip(ls, sh, strict=True)
            if e == c
        ]
        if len(set(sizes) - {1}) > 1:
            what = f"letter {c!r}" if c in subscripts else "an ellipsis dim"
            raise ValueError(
                f"subscripts={subscripts!r}: {what} has sizes {sizes} in the operands of shapes "
                f"{tuple(lshape)} and {tuple(rshape)}; allowed: equal sizes (or 1, which "
                "broadcasts)"
            )


def einsum(
    subscripts: str,
    lhs: Array | QArray,
    rhs: Array | QArray,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``jnp.einsum`` of two operands, either of which may be a QArray.

    Args:
        subscripts: Einstein summation for two operands, e.g. ``"btd,dh->bth"`` or
            ``"...d,df->...f"``.
        lhs: First operand.
        rhs: Second operand.
        precision: Passed to the float contraction.
        preferred_element_type: Result dtype (see :func:`qcore.dot_general`).

    Raises:
        ValueError: For subscripts that do not fit the operands (see the module
            docstring), a letter whose sizes differ, or a non-float
            ``preferred_element_type`` with a QArray operand.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import qcore
        >>> x = jax.random.normal(jax.random.key(0), (2, 3, 32))
        >>> w = qcore.quantize(
        ...     jax.random.normal(jax.random.key(1), (32, 4)),
        ...     qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
        ... )
        >>> qcore.einsum("btd,df->btf", x, w).shape
        (2, 3, 4)
    """
    lhs = as_input(lhs, "lhs")
    rhs = as_input(rhs, "rhs")
    check_einsum(subscripts, tuple(lhs.shape), tuple(rhs.shape))  # before tracing
    if not isinstance(lhs, QArray) and not isinstance(rhs, QArray):
        return jnp.einsum(
            subscripts, lhs, rhs, precision=precision, preferred_element_type=preferred_element_type
        )
    preferred = preferred_dtype(preferred_element_type)
    return _einsum(subscripts, lhs, rhs, precision, preferred)


# One compiled computation per call, so eager results are bit-identical to jitted ones.
@partial(jax.jit, static_argnums=(0, 3, 4))
def _einsum(subscripts, lhs, rhs, precision, preferred_element_type) -> Array:
    (la, lb), out = _parse(subscripts, (lhs.ndim, rhs.ndim))
    shape_a, shape_b = tuple(lhs.shape), tuple(rhs.shape)
    sizes: dict[str, int] = {}
    plain = len(set(la)) == len(la) and len(set(lb)) == len(lb)
    for letters, shape in ((la, shape_a), (lb, shape_b)):
        for c, d in zip(letters, shape, strict=True):
            plain = plain and sizes.setdefault(c, d) == d
    plain = plain and all(c in out or (c in la and c in lb) for c in la + lb)
    if not plain:
        return _fallback(subscripts, lhs, rhs, precision, preferred_element_type)
    batch = [c for c in out if c in la and c in lb]
    contract = [c for c in la if c in lb and c not in out]
    dims = (
        (tuple(la.index(c) for c in contract), tuple(lb.index(c) for c in contract)),
        (tuple(la.index(c) for c in batch), tuple(lb.index(c) for c in batch)),
    )
    y = dot_general(lhs, rhs, dims, precision, preferred_element_type)
    produced = batch + [c for c in la if c not in lb] + [c for c in lb if c not in la]
    return jnp.transpose(y, tuple(produced.index(c) for c in out))


def _fallback(subscripts, lhs, rhs, precision, preferred_element_type) -> Array:
    a, b = operand(lhs), operand(rhs)
    out_dtype = jnp.dtype(preferred_element_type or promote(a.dtype, b.dtype))
    y = jnp.einsum(
        subscripts,
        a.dequantized(),
        b.dequantized(),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)
