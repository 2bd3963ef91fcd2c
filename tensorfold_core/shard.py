"""Tensor-parallel shards: a family's plan of which modules split how, applied to a loaded model for one rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import CheckpointError
from .protocols import Model

QUANTIZED_PARTS = ("weight", "scales", "biases")  # an affine-quantized matrix: codes, and per-group scale and bias


@dataclass(frozen=True)
class ShardPlan:
    """What a family splits, by module path in `model.named_modules()`: each rank keeps its 1/size of every split."""

    columns: tuple[str, ...] = ()  # projections split by outputs (q/k/v, gate/up, experts' gate/up)
    blocks: tuple[tuple[str, int], ...] = ()  # projections whose outputs are n blocks split alike (LFM2's B, C, x)
    rows: tuple[str, ...] = ()  # projections split by inputs (o, down): their partial sums need a reduce
    channels: tuple[str, ...] = ()  # depthwise convs: a channel's kernel moves with the channel
    reduce: tuple[str, ...] = ()  # modules whose outputs are summed over the group (each holds or follows a row split)
    divide: tuple[tuple[str, str], ...] = ()  # (module path, attribute): counts split with the matrices (heads, groups)
    # (column paths, row path) sharing one inner width (an MLP's or an expert's): cut at the same bounds, evenly
    # where that keeps the row matrix's quantization groups whole, else in whole groups, the first ranks one more
    pairs: tuple[tuple[tuple[str, ...], str], ...] = ()
    sizes: dict[str, int] = field(default_factory=dict)  # config key -> value the group size must divide


@runtime_checkable
class ShardedModel(Model, Protocol):
    """A Model whose caches size themselves by `shards`: the ranks its heads and channels are split over."""

    shards: int


def fixed_sum(partial: mx.array, group: mx.distributed.Group) -> mx.array:
    """Every rank's partial rows summed rank 0 first, the same order on every rank and for every row count."""
    # all_gather then a left fold, not all_sum: a ring's reduction order depends on the buffer's chunking, so with
    # three ranks or more a row's sum could change with the rows beside it; data movement alone keeps rows apart
    parts = mx.split(mx.distributed.all_gather(partial, group=group), group.size(), axis=0)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


class Trail:
    """The sums a forward's graph holds, in the order its layers run them: evaluated one collective at a time."""

    def __init__(self):
        self.pending: list[mx.array] = []

    def clear(self) -> None:
        self.pending = []

    def evaluate(self, out: mx.array) -> None:
        """Evaluate `out` one sum at a time, in the order the layers made them."""
        # a rank lost mid-forward then fails the one collective waiting on it; a graph holding several collectives
        # hangs instead on the ring backend (mlx 0.32.4: "Failing pending tasks...", then eval never returns)
        pending, self.pending = self.pending, []
        for total in pending:
            mx.eval(total)
        mx.eval(out)


class Reduced(nn.Module):
    """A module whose output is a rank's partial sum, summed over the group (in the forward's trail)."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group, trail: Trail):
        super().__init__()
        self.inner = inner
        self.group = group
        self.trail = trail

    def __call__(self, *args, **kwargs) -> mx.array:
        out = fixed_sum(self.inner(*args, **kwargs), self.group)
        self.trail.pending.append(out)
        return out


def _piece(a: mx.array, axis: int, rank: int, size: int, blocks: int = 1) -> mx.array:
    """This rank's share of each of `blocks` equal blocks along `axis`, the blocks' shares side by side."""
    n = a.shape[axis]
    if n % (blocks * size):
        raise ValueError(f"{n} along axis {axis} does not split into {blocks} blocks over {size} ranks")
    step = n // (blocks * size)
    pieces = [_span(a, axis, (b * size + rank) * step, (b * size + rank + 1) * step) for b in range(blocks)]
    return mx.contiguous(pieces[0] if blocks == 1 else mx.concatenate(pieces, axis=axis))


def _span(a: mx.array, axis: int, lo: int, hi: int) -> mx.array:
    return mx.take(a, mx.arange(lo, hi), axis=axis)


def _split_outputs(module: nn.Module, rank: int, size: int, blocks: int = 1) -> None:
    for name in QUANTIZED_PARTS:
        if name in module:
            module[name] = _piece(module[name], -2, rank, size, blocks)
    if "bias" in module:
        module["bias"] = _piece(module["bias"], -1, rank, size, blocks)


def _split_inputs(module: nn.Module, rank: int, size: int) -> None:
    group = getattr(module, "group_size", None)  # a quantized matrix splits only on whole quantization groups
    if group is not None:
        inputs = module["scales"].shape[-1] * group
        if (inputs // size) % group:
            raise ValueError(f"{inputs} inputs over {size} ranks are not whole groups of {group}")
    for name in QUANTIZED_PARTS:
        if name in module:
            module[name] = _piece(module[name], -1, rank, size)


def width_bounds(width: int, unit: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s [lo, hi) of a width cut into whole units over `size` ranks, the first ones a unit more."""
    units, left = divmod(width, unit)
    if left or units < size:
        raise ValueError(f"{width} is not {size} or more whole groups of {unit}")
    base, extra = divmod(units, size)
    lo = (rank * base + min(rank, extra)) * unit
    return lo, lo + (base + (rank < extra)) * unit


def pair_bounds(width: int, group: int | None, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s [lo, hi) of a pair's inner width: evenly where that keeps whole quantization groups (`group`
    None: unquantized), else in whole groups."""
    even = width % size == 0 and (group is None or (width // size) % group == 0)
    return width_bounds(width, 1 if even else group, rank, size)


def _split_pair(columns: list[nn.Module], row: nn.Module, rank: int, size: int) -> None:
    group = getattr(row, "group_size", None)
    width = row["scales"].shape[-1] * group if group is not None else row["weight"].shape[-1]
    lo, hi = pair_bounds(width, group, rank, size)
    for module in columns:  # outputs lo..hi
        for name in (*QUANTIZED_PARTS, "bias"):
            if name in module:
                module[name] = mx.contiguous(_span(module[name], -1 if name == "bias" else -2, lo, hi))
    per_input = {"weight": row["weight"].shape[-1] / width}  # packed words (or values) an input takes
    if group is not None:
        per_input.update(scales=1 / group, biases=1 / group)
    for name, rate in per_input.items():  # inputs lo..hi: whole words and groups, as the bounds are whole groups
        row[name] = mx.contiguous(_span(row[name], -1, round(lo * rate), round(hi * rate)))


def _split_channels(module: nn.Module, rank: int, size: int) -> None:
    module["weight"] = _piece(module["weight"], 0, rank, size)
    if "bias" in module:
        module["bias"] = _piece(module["bias"], 0, rank, size)


def _set(root: nn.Module, path: str, value: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    holder = _find(root, parent) if parent else root
    if isinstance(holder, list):
        holder[int(name)] = value
    else:
        setattr(holder, name, value)


def _find(root: nn.Module, path: str):
    node = root
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def check_plan(plan: ShardPlan, size: int, source: str) -> None:
    """Refuse a group the model's shapes cannot split evenly, naming the config key."""
    for key, value in plan.sizes.items():
        if value % size:
            raise CheckpointError(f"{source}: {key} {value} does not split over a group of {size} ranks")


def split(model: Model, plan: ShardPlan, rank: int, size: int, source: str = "the model") -> Model:
    """Keep rank `rank`'s part of each of the plan's splits; a family's load runs it before serving its kernels."""
    check_plan(plan, size, source)
    if not isinstance(getattr(model, "shards", None), int):  # not isinstance(model, ShardedModel): see can_keep_later
        raise CheckpointError(f"{source}: the {model.model_type} family's model has no `shards` to size its caches")
    model.whole_parameters = sum(a.size for _, a in tree_flatten(model.parameters()))  # what every rank agrees on
    steps = ([(path, _split_outputs, ()) for path in plan.columns]
             + [(path, _split_outputs, (blocks,)) for path, blocks in plan.blocks]
             + [(path, _split_inputs, ()) for path in plan.rows]
             + [(path, _split_channels, ()) for path in plan.channels])
    # each cut is evaluated at once: a lazily loaded matrix is read, cut and let go before the next, so a rank never
    # holds the whole model (the family's load leaves its weights lazy for a rank)
    for path, cut, extra in steps:
        try:
            module = _find(model, path)
            cut(module, rank, size, *extra)
            mx.eval(module.parameters())
        except (KeyError, IndexError, ValueError) as exc:
            raise CheckpointError(f"{source}: cannot split {path} over {size} ranks ({exc})") from exc
    for columns, path in plan.pairs:
        try:
            modules = [_find(model, column) for column in columns] + [_find(model, path)]
            _split_pair(modules[:-1], modules[-1], rank, size)
            mx.eval([module.parameters() for module in modules])
        except (KeyError, IndexError, ValueError) as exc:
            raise CheckpointError(f"{source}: cannot split {path} over {size} ranks ({exc})") from exc
    # a row split's bias is rank 0's alone, so the group's sum adds it once
    for path in (*plan.rows, *(row for _, row in plan.pairs)):
        module = _find(model, path)
        if rank and "bias" in module:
            module["bias"] = mx.zeros_like(module["bias"])
    for path, attribute in plan.divide:
        module = _find(model, path)
        setattr(module, attribute, getattr(module, attribute) // size)
    model.shards = size
    mx.eval(model.parameters())
    return model


def reduce(model: Model, plan: ShardPlan, group: mx.distributed.Group) -> Model:
    """Sum the plan's reduced modules over the group (after any kernel swap); leaves `model.reductions`."""
    trail = Trail()
    for path in plan.reduce:
        _set(model, path, Reduced(_find(model, path), group, trail))
    model.reductions = trail  # the group evaluates each forward through it
    return model


def shard(model: Model, plan: ShardPlan, group: mx.distributed.Group, source: str = "the model") -> Model:
    """`split` and `reduce` at once, for a model whose kernels are served already or need no swap."""
    return reduce(split(model, plan, group.rank(), group.size(), source), plan, group)


def split_modules(paths: Sequence[str], names: Sequence[str]) -> tuple[str, ...]:
    """Every `path.name` for the given module paths and child names (a plan's rows are written this way)."""
    return tuple(f"{path}.{name}" for path in paths for name in names)
