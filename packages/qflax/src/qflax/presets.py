"""Presets: ready-made plans that quantize a whole model.

The 4-bit preset, :func:`four_bit`: mixed precision over weights *and* embedding
tables, then GPTQ. It turns a float model into PTQ params of a given size (by default
0.2× the float bytes of *all* params, embeddings included) in three steps, each an
ordinary qflax algorithm:

1. **Mixed precision** (:func:`~qflax.mixed_precision.mixed_precision`) over every
   weight op *and every table lookup* (``op_names`` include ``"take"``): each gets
   one of ``candidates`` (default int8, int4 with tiles of 128, nf4 with tiles of
   32), chosen to minimise the measured output error within the byte budget. In
   small transformers the embedding table is half of the bytes and tolerates 4
   bits far better than the matmuls do, so the search spends the budget on int8
   for the matmuls where it matters and packs the table.
2. **GPTQ** (:func:`~qflax.gptq.gptq`) quantizes the chosen matmul weights (int8
   and 4-bit alike) with second-order error feedback from the same batches.
3. Tables (which GPTQ does not cover: a lookup has no input to feed back) are
   quantized to nearest, one scale per row plus the tiles along it.

The result holds the rules and the quantized params of the plain PTQ model
(``qflax.quantize_model(model, qflax.PtqProvider(result.rules))``), and a report
of which op got which type and method (:meth:`FourBitResult.to_text`).

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.presets import four_bit
    >>> class Tiny(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, ids):
    ...         x = nn.Embed(512, 128, name="embed")(ids)
    ...         x = nn.gelu(nn.Dense(256, name="up")(x))
    ...         return nn.Dense(128, name="down")(x)
    >>> ids = [jax.random.randint(jax.random.key(i), (4, 16), 0, 512) for i in range(2)]
    >>> params = Tiny().init(jax.random.key(0), ids[0])["params"]
    >>> data = qflax.CalibrationData(Tiny(), params, ids)
    >>> result = four_bit(data, budget_ratio=0.25, jit=False, progress=False)
    >>> [(r.module_path, r.qtype, r.method) for r in result.rows]
    [('embed', 'int8', 'nearest'), ('up', 'int8', 'GPTQ'), ('down', 'nf4', 'GPTQ')]
    >>> result.total_bytes <= 0.25 * result.float_bytes
    True
    >>> qmodel = qflax.quantize_model(Tiny(), qflax.PtqProvider(result.rules))
    >>> y = qmodel.apply({"params": result.params}, ids[0])

Tiles run along each weight's innermost contracting axis (a table's row); a width
longer than the tile must be a multiple of it (a clear error names the param
otherwise), a shorter one is one block: pass ``tile_size`` for models with other
widths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from flax import traverse_util

from qflax._calibration_data import CalibrationData, accepts_legacy, check
from qflax._engine.registry import BUILTIN_DEFAULT_NAMES as DEFAULT_OP_NAMES
from qflax._params import is_leaf, plain
from qflax.gptq import gptq
from qflax.mixed_precision import MixedPrecisionResult, mixed_precision
from qflax.qparam import QuantizedParam
from qflax.report import Runner, db_text, text_table
from qflax.rule import TileSize

LOOKUP = "take"
DEFAULT_CANDIDATES = ("int8", "int4", "nf4")
DEFAULT_TILES: Mapping[str, TileSize] = {"int4": 128, "nf4": 32}


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """What the preset chose for one op.

    Attributes:
        module_path: The calling module's path.
        op_name: ``"take"`` for a table lookup, else the contraction's name.
        qtype: The chosen qtype name, or None (float).
        tile_size: The rule's tile size (None: one scale per channel or row).
        method: ``"GPTQ"``, ``"nearest"`` (round to nearest) or ``"float"``.
        bytes: Bytes of its weights as stored.
        alone_sqnr_db: Output SQNR with only this op quantized (the search's table).
    """

    module_path: str
    op_name: str
    qtype: str | None
    tile_size: TileSize
    method: str
    bytes: int
    alone_sqnr_db: float


@dataclasses.dataclass(frozen=True)
class FourBitResult:
    """The result of :func:`four_bit`.

    Attributes:
        rules: The rules of the PTQ model that serves ``params``.
        params: Linen: a params dict shaped like the input; NNX: a pure dict (load
            it with ``nnx.replace_by_pure_dict`` into the abstract PTQ model).
            Quantized weights and tables are :class:`~qflax.QuantizedParam`.
        rows: One :class:`OpChoice` per op, in model order.
        total_bytes: Bytes of all params as stored.
        float_bytes: Bytes of all float params.
        budget_bytes: The budget.
        mixed: The mixed-precision search behind the assignment.
    """

    rules: tuple[Any, ...]
    params: Any
    rows: tuple[OpChoice, ...]
    total_bytes: int
    float_bytes: int
    budget_bytes: int
    mixed: MixedPrecisionResult

    def to_text(self) -> str:
        """The per-op report as an aligned table, plus totals and counts per type."""
        head = ("module path", "op", "qtype", "tile", "method", "bytes", "alone SQNR")
        lines = text_table(
            [head]
            + [
                (
                    r.module_path or "(root)",
                    r.op_name,
                    r.qtype or "float",
                    "-" if r.tile_size is None else str(r.tile_size),
                    r.method,
                    f"{r.bytes:,}",
                    db_text(r.alone_sqnr_db),
                )
                for r in self.rows
            ],
            left=5,
        )
        counts: dict[str, int] = {}
        for r in self.rows:
            kind = f"{r.qtype or 'float'} {'tables' if r.op_name == LOOKUP else 'matmuls'}"
            counts[kind] = counts.get(kind, 0) + 1
        lines.append(
            f"total {self.total_bytes:,} bytes = {self.total_bytes / self.float_bytes:.3f}x float "
            f"(budget {self.budget_bytes:,}); "
            + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        )
        return "\n".join(lines)


@accepts_legacy(between=0)
def four_bit(
    data: CalibrationData,
    *,
    budget_ratio: float | None = 0.2,
    budget_bytes: int | None = None,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    tile_size: Mapping[str, TileSize] = DEFAULT_TILES,
    tables: bool = True,
    module_path: str = ".*",
    use_gptq: bool = True,
    search_batches: int | None = 2,
    jit: bool = True,
    progress: bool = True,
) -> FourBitResult:
    """Quantizes a model's weights and tables to a byte budget (see the module doc).

    Args:
        data: The model (not modified), its float params and the batches
            (:class:`~qflax.CalibrationData`). 128 sentences or so are plenty for
            a small transformer.
        budget_ratio: Maximum bytes of all params as a fraction of their float
            bytes (default 0.2). Pass None with ``budget_bytes``.
        budget_bytes: Or: the maximum in bytes.
        candidates: The qtypes an op may get (a name of qcore's registry).
        tile_size: ``{qtype: tile size}``; missing qtypes get one scale per
            channel (matmuls) or per row (tables).
        tables: Include table lookups (``jnp.take``, ``nn.Embed``, ``table[ids]``)
            in the search; False leaves tables float.
        module_path: Regex of the modules whose ops may be quantized.
        use_gptq: Quantize the matmul weights with GPTQ (False: to nearest).
        search_batches: How many of the batches the mixed-precision search runs
            the model on (it runs it about ``len(candidates) x ops`` times); None
            for all. GPTQ uses all of them.
        jit: Compile the search's runs (see :func:`~qflax.mixed_precision.mixed_precision`).
        progress: Show progress bars.

    Returns:
        A :class:`FourBitResult`.

    Raises:
        ValueError: As :func:`~qflax.mixed_precision.mixed_precision` and
            :func:`~qflax.gptq.gptq` raise them (empty calibration data, a budget
            no assignment fits, which it states with the smallest possible total),
            or an unknown candidate.
    """
    batches = list(check(data).inputs())
    if search_batches is not None and not (isinstance(search_batches, int) and search_batches > 0):
        raise ValueError(f"search_batches={search_batches!r} must be a positive int or None")
    op_names = (*DEFAULT_OP_NAMES, LOOKUP) if tables else DEFAULT_OP_NAMES
    mixed = mixed_precision(
        data.with_batches(batches[:search_batches] if search_batches else batches),
        candidates=candidates,
        budget_bytes=budget_bytes,
        budget_ratio=budget_ratio,
        tile_size=tile_size,
        module_path=module_path,
        op_names=op_names,
        jit=jit,
        progress=progress,
    )
    rules = mixed.rules
    matmul_rules = [r for r in rules if LOOKUP not in r.op_names]
    # Every op of the plan quantized to nearest, in the model: the tables' params
    # (and the matmuls' when GPTQ is off), exactly as PtqProvider makes them.
    rtn = Runner(data.with_batches(batches[:1]), jit=jit).run(rules).quantized
    if use_gptq and matmul_rules:
        tree = gptq(data.with_batches(batches), matmul_rules, progress=progress)
    else:
        tree = data.float_tree()
    flat: dict[Any, Any] = traverse_util.flatten_dict(plain(tree), is_leaf=lambda _, x: is_leaf(x))
    for key, value in flat.items():
        path = "/".join(str(k) for k in key)
        if not isinstance(value, QuantizedParam) and path in rtn:
            flat[key] = rtn[path]
    out = traverse_util.unflatten_dict(flat)
    total = sum(
        int(v.nbytes) if isinstance(v, QuantizedParam) else int(getattr(v, "nbytes", 0))
        for v in flat.values()
    )
    rows = []
    for (path, op_name), qtype in mixed.assignment.items():
        option = next(o for o in mixed.options[(path, op_name)] if o.qtype == qtype)
        if qtype is None:
            method = "float"
        else:
            method = "GPTQ" if use_gptq and op_name != LOOKUP else "nearest"
        rows.append(
            OpChoice(
                module_path=path,
                op_name=op_name,
                qtype=qtype,
                tile_size=None if qtype is None else tile_size.get(qtype),
                method=method,
                bytes=option.bytes,
                alone_sqnr_db=math.inf if option.error == 0 else -10 * math.log10(option.error),
            )
        )
    return FourBitResult(
        rules=tuple(rules),
        params=out,
        rows=tuple(rows),
        total_bytes=total,
        float_bytes=mixed.float_bytes,
        budget_bytes=mixed.budget_bytes,
        mixed=mixed,
    )
