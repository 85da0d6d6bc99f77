"""Quantization types: what a code can hold and how it is stored.

A :class:`QType` is a frozen, hashable description of a number format. It is
static metadata (it goes into pytree aux data and ``jax.jit`` static
arguments), never an array.

Kinds:

* ``"int"`` — uniform integer codes ``qmin..qmax`` (``int2``…``int8``,
  ``int16``, ``uint1``…``uint8``). Sub-byte codes are held in an 8-bit container
  until :mod:`qcore.packing` packs them.
* ``"binary"`` — ``int1``: the two values ``-1`` and ``+1`` (times the scale),
  as in Brevitas' binary quantizers. Zero is not a level, so no input collapses
  to zero.
* ``"float"`` — a low-precision float element (fp8 e4m3fn/e5m2, fp4 e2m1);
  the scale maps the calibrated bound onto the element's largest finite value.
* ``"codebook"`` — a fixed table of levels in ``[-1, 1]`` (nf4); the code is
  the index of the nearest level.

Block-scaled types (``mxfp8``, ``mxfp4``, ``nvfp4``) are float types with a
``block_size`` (tile length along the blocked axis) and a ``scale_dtype`` in
which each block's scale is stored. ``nvfp4`` also carries a per-tensor float32
scale (``tensor_scale=True``) so that its e4m3 block scales never overflow.

Example:
    >>> from qcore import qtypes
    >>> int4 = qtypes.get("int4")
    >>> (int4.bits, int4.qmin, int4.qmax, int4.storage)
    (4, -8.0, 7.0, 'int8')
    >>> qtypes.get("nf4").codebook[:3]
    (-1.0, -0.6961928009986877, -0.5250730514526367)
    >>> qtypes.get(int4) is int4
    True
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

Kind = Literal["int", "binary", "float", "codebook"]

# The 16 NormalFloat levels of QLoRA (Dettmers et al. 2023, appendix E): the
# quantiles of N(0, 1) at offset 0.9677 on each side, normalised to [-1, 1], with
# an exact zero. tests/test_qtypes.py re-derives them from scipy's norm.ppf.
NF4_LEVELS: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


@dataclasses.dataclass(frozen=True)
class QType:
    """A quantized number format.

    Attributes:
        name: Canonical name, e.g. ``"int4"``.
        kind: ``"int"``, ``"binary"``, ``"float"`` or ``"codebook"``.
        bits: Bits per element in packed storage.
        signed: Whether negative values are representable.
        storage: Name of the dtype that holds one unpacked code (``"int8"``,
            ``"uint8"``, ``"int16"``, ``"float8_e4m3fn"``, ...).
        qmin: Smallest code (int kinds) or value (float, codebook, binary).
        qmax: Largest code (int kinds) or finite value (float, codebook,
            binary).
        codebook: Levels of a codebook type, ascending; ``None`` otherwise.
        block_size: Elements per scale block of a block-scaled type.
        scale_dtype: Dtype name in which a block-scaled type stores its scales.
        tensor_scale: Whether a float32 per-tensor scale multiplies the block
            scales (nvfp4).
    """

    name: str
    kind: Kind
    bits: int
    signed: bool
    storage: str
    qmin: float
    qmax: float
    codebook: tuple[float, ...] | None = None
    block_size: int | None = None
    scale_dtype: str | None = None
    tensor_scale: bool = False

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy/JAX dtype of one unpacked code."""
        return jnp.dtype(self.storage)

    @property
    def is_uniform(self) -> bool:
        """Whether levels are evenly spaced integer codes (``kind == "int"``)."""
        return self.kind == "int"

    @property
    def supports_asymmetric(self) -> bool:
        """Whether a zero point can be used (only uniform integer types)."""
        return self.kind == "int"

    @property
    def packable(self) -> bool:
        """Whether codes are narrower than their container and can be packed."""
        return self.bits < 8 * self.storage_dtype.itemsize

    def __str__(self) -> str:
        return self.name


def _int(bits: int, signed: bool) -> QType:
    if signed:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    else:
        qmin, qmax = 0, 2**bits - 1
    storage = ("int" if signed else "uint") + ("16" if bits > 8 else "8")
    name = ("int" if signed else "uint") + str(bits)
    return QType(name, "int", bits, signed, storage, float(qmin), float(qmax))


def _float(name: str, storage: str, bits: int, **kw: object) -> QType:
    fmax = float(jnp.finfo(jnp.dtype(storage)).max)
    return QType(name, "float", bits, True, storage, -fmax, fmax, **kw)  # type: ignore[arg-type]


def _builtins() -> dict[str, QType]:
    types = [_int(b, True) for b in range(2, 9)] + [_int(16, True)]
    types += [_int(b, False) for b in range(1, 9)]
    types += [
        QType("int1", "binary", 1, True, "int8", -1.0, 1.0),
        QType("nf4", "codebook", 4, True, "uint8", -1.0, 1.0, codebook=NF4_LEVELS),
        _float("float8_e4m3fn", "float8_e4m3fn", 8),
        _float("float8_e5m2", "float8_e5m2", 8),
        _float("float4_e2m1fn", "float4_e2m1fn", 4),
        _float("mxfp8", "float8_e4m3fn", 8, block_size=32, scale_dtype="float8_e8m0fnu"),
        _float("mxfp4", "float4_e2m1fn", 4, block_size=32, scale_dtype="float8_e8m0fnu"),
        _float(
            "nvfp4",
            "float4_e2m1fn",
            4,
            block_size=16,
            scale_dtype="float8_e4m3fn",
            tensor_scale=True,
        ),
    ]
    return {t.name: t for t in types}


BUILTINS: dict[str, QType] = _builtins()

ALIASES: dict[str, str] = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
    "fp4": "float4_e2m1fn",
    "e2m1": "float4_e2m1fn",
    "binary": "int1",
}


def names() -> list[str]:
    """All accepted qtype names (canonical names and aliases), sorted."""
    return sorted([*BUILTINS, *ALIASES])


def get(qtype: QType | str) -> QType:
    """Returns the :class:`QType` for a name (or the QType itself).

    Args:
        qtype: A QType or one of :func:`names`, case-insensitive.

    Returns:
        The built-in QType.

    Raises:
        ValueError: If the name is unknown; the message lists the valid names.

    Example:
        >>> get("FP8").name
        'float8_e4m3fn'
        >>> get("int9")
        Traceback (most recent call last):
        ...
        ValueError: qtype='int9' is not a known quantization type; valid names: ...
    """
    if isinstance(qtype, QType):
        return qtype
    if not isinstance(qtype, str):
        raise ValueError(
            f"qtype={qtype!r} must be a QType or a name; valid names: {', '.join(names())}"
        )
    key = qtype.strip().lower()
    key = ALIASES.get(key, key)
    if key not in BUILTINS:
        raise ValueError(
            f"qtype={qtype!r} is not a known quantization type; valid names: {', '.join(names())}"
        )
    return BUILTINS[key]
