r"""Quantization rules: which ops of which modules get quantized, and how.

A :class:`QuantizationRule` selects ops by the ``/``-joined path of the module
that calls them (a regex that must match the whole path, integer indices
included, e.g. ``"layers/\d+/mlp/.*"``; or a callable predicate) and by op
name. A :class:`RuleMatcher` applies a list of rules with first-match-wins
precedence and remembers which rules ever matched, so a typo in a path shows up
as an unused rule instead of a silently float model.

A rule turns into qcore specs for an op's operands with :meth:`weight_spec` and
:meth:`act_spec`: weights get one scale per output channel (every axis that is
not contracted), optionally tiled along the innermost contracting axis; activations get
one scale per row by default (every axis the op does not contract: per token for
``(batch, seq, features)`` inputs, per example for convolutions), or per index of
``act_batch_axes``.

Example:
    >>> from qflax import QuantizationRule, RuleMatcher
    >>> rules = [
    ...     QuantizationRule(module_path="head", weight_qtype="int8"),
    ...     QuantizationRule(module_path=r"layers/\d+/.*", weight_qtype="int4", tile_size=32),
    ... ]
    >>> m = RuleMatcher(rules)
    >>> m.match("layers/3/dense", "dot_general").weight_qtype
    'int4'
    >>> m.match("embed", "dot_general") is None
    True
    >>> [r.module_path for r in m.unused_rules()]
    ['head']
    >>> rules[1].weight_spec(shape=(64, 16), contracting_axes=(0,)).tiled_axes
    ((0, 32),)
    >>> conv = rules[1].weight_spec(shape=(3, 3, 64, 16), contracting_axes=(0, 1, 2))
    >>> conv.scale_shape((3, 3, 64, 16))  # blocks of 32 input channels, per tap
    (3, 3, 2, 16)
    >>> rules[1].weight_spec(shape=(3, 3, 3, 16), contracting_axes=(0, 1, 2)).channelwise_axes
    (3,)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import qcore
import qcore.rules
from qcore import HowToQuantize
from qflax._engine import registry

TileSize = int | float | Mapping[int, int | float] | None
ROTATIONS = (None, "hadamard")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationRule:
    """How to quantize the ops of the modules a path selects.

    Attributes:
        module_path: Regex fullmatched against the module's ``/``-joined path
            (``".*"`` matches everything), or a callable ``path -> bool``. Regexes
            that can backtrack catastrophically are refused (a repeat or an
            alternation inside a repeated group, a backreference, more than four
            repeats), since rules are also read from files.
        op_names: Ops the rule applies to, a non-empty selection of
            :func:`qflax.op_names` (default: every contraction and convolution,
            and registered ops that are selected by default).
            ``"take"`` (``jnp.take``, e.g. the lookup of ``nn.Embed`` /
            ``nnx.Embed``) must be named to quantize a table: the
            table gets one scale per row (plus ``tile_size`` tiles along the row),
            and a tied output projection (``attend``) reuses it if its rule gives
            the same type and tiles.
        weight_qtype: qtype of the weight operand, or None to keep it float.
        act_qtype: qtype of the activation operand, or None (weight-only).
        tile_size: Sub-channel blocks (GPTQ's groups): an int (tile length), a float
            in (0, 1) (fraction = 1 / number of tiles), or ``{axis: size}``; None for
            one scale per output channel. An int or fraction tiles one axis, the
            weight's innermost (last) contracting axis in the layout the op sees
            (a Dense kernel's inputs, the ``head_dim`` of a ``(heads, head_dim, d)``
            projection, the input channels of an HWIO conv kernel, the row of a
            looked-up table); every other axis keeps one scale per index, so a block
            holds ``tile_size`` values. An innermost axis no longer than the tile is
            one block, which then takes in whole contracting axes before it
            (innermost first) while it holds at most ``tile_size`` values: a 3x3
            stem conv with 3 input channels gets one scale per output channel (27
            values), a depthwise kernel ``(3, 3, 1, C)`` one per channel (9). An
            innermost axis longer than the tile must be a multiple of it (a
            ``ValueError`` names the param, the axis, its size and the tile). A
            mapping tiles exactly the axes it names (each must be contracted; an
            axis out of range or not contracted raises) and shares one scale along
            the other contracting axes. Activations are not tiled.
        act_static_scale: Use stored (calibrated) activation scales instead of
            computing them per call.
        weight_calibration_method: Calibration of weight scales (qcore string).
        act_calibration_method: Calibration of activation scales (qcore string).
        act_batch_axes: Activation axes that get their own scale; other axes
            share one. None (the default): every axis the op does not contract,
            i.e. one scale per token of a ``(batch, seq, features)`` input, per
            row of a matrix, per example of a convolution's input. ``(0,)``: one
            scale per example (per sequence), ``()``: one per tensor. Naming an
            axis twice raises; axes out of range for an op's activation, or
            that the op contracts, raise when the op is met.
        rotation: ``"hadamard"`` rotates the contracting axis of both operands by
            a random-sign block Hadamard matrix before quantizing them (see
            :mod:`qflax.rotation`; ops must contract exactly one axis), or None.
        rotation_seed: Seed of the rotation's random signs.
    """

    module_path: str | Callable[[str], bool] = ".*"
    op_names: Sequence[str] = dataclasses.field(
        default_factory=lambda: registry.names(default=True)
    )
    weight_qtype: str | qcore.QType | None = None
    act_qtype: str | qcore.QType | None = None
    tile_size: TileSize = None
    act_static_scale: bool = False
    weight_calibration_method: str = "absmax"
    act_calibration_method: str = "absmax"
    act_batch_axes: Sequence[int] | None = None
    rotation: str | None = None
    rotation_seed: int = 0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        qcore.rules.check_module_path(self.module_path)
        names = (self.op_names,) if isinstance(self.op_names, str) else tuple(self.op_names)
        known = registry.names()
        unknown = sorted(set(names) - set(known), key=str)
        if unknown or not names:
            what = f"{unknown} are not ops qflax intercepts" if unknown else "names no op"
            raise ValueError(f"op_names={names}: {what}; allowed: a non-empty sequence of {known}")
        set_(self, "op_names", names)
        for field in ("weight_qtype", "act_qtype"):
            value = getattr(self, field)
            if value is not None:
                try:
                    qcore.qtypes.get(value)
                except ValueError as err:
                    raise ValueError(f"{field}: {err}") from None
        for field in ("weight_calibration_method", "act_calibration_method"):
            try:
                qcore.calibration.parse(getattr(self, field))
            except ValueError as err:
                raise ValueError(f"{field}: {err}") from None
        _check_tile_size(self.tile_size)
        if isinstance(self.tile_size, Mapping):
            set_(self, "tile_size", tuple(sorted(self.tile_size.items())))
        if self.act_batch_axes is not None:
            axes = self.act_batch_axes
            if isinstance(axes, str | int) or not all(
                isinstance(a, int) and not isinstance(a, bool) for a in axes
            ):
                raise ValueError(
                    f"act_batch_axes={axes!r} must be None (one scale per row) or a sequence "
                    "of ints (activation axes with their own scale)"
                )
            if len(set(axes)) < len(axes):
                raise ValueError(
                    f"act_batch_axes={tuple(axes)!r} names an axis twice; allowed: distinct axes"
                )
            set_(self, "act_batch_axes", tuple(axes))
        if self.act_static_scale and self.act_qtype is None:
            raise ValueError("act_static_scale=True needs act_qtype (there is nothing to scale)")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation={self.rotation!r} is not allowed; allowed: {ROTATIONS}")
        seed = self.rotation_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"rotation_seed={seed!r} must be a non-negative int")

    def matches(self, path: str, op_name: str) -> bool:
        """Whether this rule applies to op ``op_name`` called by the module at ``path``."""
        return op_name in self.op_names and qcore.rules.path_matches(self.module_path, path)

    def weight_spec(
        self, shape: Sequence[int], contracting_axes: Sequence[int]
    ) -> HowToQuantize | None:
        """The qcore spec of a weight of ``shape`` contracted over ``contracting_axes``.

        One scale per output channel (every non-contracting axis); ``tile_size``
        tiles the innermost (last) contracting axis, see :attr:`tile_size`.

        Raises:
            ValueError: A ``tile_size`` that does not fit the weight (an innermost
                axis longer than the tile but not a multiple of it, a mapping that
                names an axis out of range or not contracted).
        """
        if self.weight_qtype is None:
            return None
        ndim = len(shape)
        contracting = tuple(a % ndim for a in contracting_axes)
        pack_axis = contracting[0] if contracting else -1
        return self._spec(shape, contracting, "contracted axis", pack_axis)

    def lookup_spec(self, shape: Sequence[int], axis: int) -> HowToQuantize | None:
        """The qcore spec of a table of ``shape`` looked up along ``axis``.

        One scale per row (index along ``axis``); ``tile_size`` tiles the row's last
        axis as it tiles a weight's innermost contracting axis (see
        :attr:`tile_size`); sub-byte codes packed along it.

        Raises:
            ValueError: A ``tile_size`` that does not fit the table (as for
                :meth:`weight_spec`).
        """
        if self.weight_qtype is None:
            return None
        axis %= len(shape)
        rest = tuple(a for a in range(len(shape)) if a != axis)
        return self._spec(shape, rest, "row axis", rest[-1] if rest else None)

    def _spec(
        self, shape: Sequence[int], axes: tuple[int, ...], kind: str, pack_axis: int | None
    ) -> HowToQuantize:
        """The spec of a weight whose scales may be shared along ``axes`` (``kind`` of axis).

        Sub-byte codes are packed along ``pack_axis`` (None: not packed).
        """
        tiles, shared = self._blocks(tuple(shape), tuple(sorted(axes)), kind)
        return HowToQuantize(
            qtype=cast(str | qcore.QType, self.weight_qtype),
            channelwise_axes=tuple(a for a in range(len(shape)) if a not in {*tiles, *shared}),
            tiled_axes=tiles,
            calibration=self.weight_calibration_method,
            pack=_packable(self.weight_qtype) and pack_axis is not None,
            pack_axis=-1 if pack_axis is None else pack_axis,
        )

    def act_spec(self, ndim: int, contracting_axes: Sequence[int] = ()) -> HowToQuantize | None:
        """The qcore spec of an activation of rank ``ndim`` (one scale per row or batch index).

        Axes that the op contracts (e.g. the ``b`` of ``"bi,bj->ij"``) share one scale:
        with ``act_batch_axes=None`` they are left out, and naming one (or naming an
        axis twice, e.g. ``(0, -2)`` for rank 2) raises, as does an axis out of range.
        """
        if self.act_qtype is None:
            return None
        contracting = sorted({a % ndim for a in contracting_axes})
        if self.act_batch_axes is None:
            batch = tuple(a for a in range(ndim) if a not in contracting)
        else:
            batch = self._act_batch(ndim, contracting)
        return HowToQuantize(
            qtype=self.act_qtype,
            channelwise_axes=batch,
            calibration=self.act_calibration_method,
        )

    def _act_batch(self, ndim: int, contracting: list[int]) -> tuple[int, ...]:
        """``act_batch_axes`` checked against an activation of rank ``ndim``, sorted, >= 0."""
        axes = cast(tuple[int, ...], self.act_batch_axes)
        bad = [a for a in axes if not -ndim <= a < ndim]
        if bad:
            raise ValueError(
                f"act_batch_axes={axes} is out of range for an activation of "
                f"rank {ndim} (axes {bad}); allowed: axes in {-ndim}..{ndim - 1}"
            )
        batch = sorted(a % ndim for a in axes)
        allowed = tuple(a for a in range(ndim) if a not in contracting)
        named = [a for a in batch if a in contracting]
        twice = [a for a, b in zip(batch, batch[1:], strict=False) if a == b]
        if named or twice:
            what = (
                f"names axis {', '.join(map(str, named))}, which the op contracts "
                "(contracted axes share one scale)"
                if named
                else f"axis {twice[0]} is named twice"
            )
            raise ValueError(
                f"act_batch_axes={axes}: {what} (activation of rank {ndim}); "
                f"allowed: axes {allowed} (or a subset, () for one scale per tensor)"
            )
        return tuple(batch)

    def _blocks(
        self, shape: tuple[int, ...], axes: tuple[int, ...], kind: str
    ) -> tuple[dict[int, int | float], tuple[int, ...]]:
        """``(tiles by axis, axes a block spans whole)`` over ``axes`` (sorted, >= 0).

        Axes of ``axes`` in neither get one scale per index.
        """
        tile = self.tile_size
        if tile is None or not axes:
            return {}, axes
        if not isinstance(tile, int | float):
            tiles = self._named_tiles(len(shape), axes)
            return tiles, tuple(a for a in axes if a not in tiles)
        *outer, inner = axes
        n = shape[inner]
        if isinstance(tile, float) or n > tile:
            if isinstance(tile, int) and n % tile:
                raise ValueError(
                    f"tile_size={tile}: {kind} {inner} (the one tiled) has size {n}, which is "
                    f"not a multiple of the tile {tile}; allowed: a tile_size that divides {n}, "
                    f"or one of at least {n} (one block along the axis)"
                )
            return {inner: tile}, ()
        whole, size = [inner], n  # no longer than a tile: one block, grown by whole axes
        while outer and size * shape[outer[-1]] <= tile:
            size *= shape[outer[-1]]
            whole.append(outer.pop())
        return {}, tuple(sorted(whole))

    def _named_tiles(self, ndim: int, axes: tuple[int, ...]) -> dict[int, int | float]:
        """A ``tile_size`` mapping checked against a weight of rank ``ndim``."""
        pairs = cast(tuple[tuple[int, int | float], ...], self.tile_size)  # see __post_init__
        allowed = f"allowed: axes {axes} (or {tuple(a - ndim for a in axes)})"
        tiles: dict[int, int | float] = {}
        for a, t in pairs:
            if not -ndim <= a < ndim or a % ndim not in axes:
                where = "out of range" if not -ndim <= a < ndim else "not a tileable axis"
                raise ValueError(
                    f"tile_size={dict(pairs)}: axis {a} is {where} for a weight of rank "
                    f"{ndim}; {allowed}"
                )
            if a % ndim in tiles:
                raise ValueError(
                    f"tile_size={dict(pairs)} names axis {a % ndim} twice ({a % ndim} and "
                    f"{a % ndim - ndim}); {allowed}"
                )
            tiles[a % ndim] = t
        return tiles


def _packable(qtype: Any) -> bool:
    return qcore.qtypes.get(qtype).packable


def _check_tile_size(tile: TileSize) -> None:
    def ok(t: Any) -> bool:
        if isinstance(t, bool):
            return False
        return isinstance(t, int) and t > 0 or isinstance(t, float) and 0 < t < 1

    if tile is None:
        return
    if isinstance(tile, Mapping):
        bad = {a: t for a, t in tile.items() if not (isinstance(a, int) and ok(t))}
    else:
        bad = {} if ok(tile) else {"tile_size": tile}
    if bad:
        raise ValueError(
            f"tile_size={tile!r} is invalid ({bad}); allowed: a positive int (tile length), "
            "a float in (0, 1) (1 / number of tiles), or {axis: size}"
        )


class RuleMatcher:
    """First-match-wins rule lookup that records which rules were used (thread-safe).

    Built on :class:`qcore.rules.RuleMatcher` (which qlitert's rules share), with
    op names: a rule applies when its path matches and it names the op.
    """

    def __init__(self, rules: Sequence[QuantizationRule]) -> None:
        if isinstance(rules, QuantizationRule | str | Mapping) or not hasattr(rules, "__iter__"):
            raise TypeError(
                f"rules={rules!r} is not allowed; allowed: a sequence of qflax.QuantizationRule "
                "(wrap a single rule in a list)"
            )
        rules = list(rules)
        for i, r in enumerate(rules):
            if not isinstance(r, QuantizationRule):
                raise ValueError(f"rules[{i}]={r!r} is not a qflax.QuantizationRule")
        self._matcher = qcore.rules.RuleMatcher(rules, applies=QuantizationRule.matches)
        self.rules = self._matcher.rules

    def match(self, path: str, op_name: str) -> QuantizationRule | None:
        """The first rule matching ``(path, op_name)``, or None (the op stays float)."""
        return self._matcher.match(path, op_name)

    def unused_rules(self) -> list[QuantizationRule]:
        """Rules that have not matched any op so far."""
        return self._matcher.unused_rules()

    def warn_unused(self) -> None:
        """Warns (``UserWarning``) about every rule that matched nothing."""
        self._matcher.warn_unused(_unused_message, stacklevel=2)

    def warn_once(self, key: str, message: str) -> None:
        """Warns (``UserWarning``) ``message`` the first time this matcher sees ``key``."""
        self._matcher.warn_once(key, message, stacklevel=3)


def _unused_message(index: int, rule: QuantizationRule) -> str:
    return (
        f"quantization rule with module_path={rule.module_path!r} and op_names="
        f"{rule.op_names} matched no op; check the path (module paths look like "
        "'layers/0/mlp/Dense_0')"
    )
