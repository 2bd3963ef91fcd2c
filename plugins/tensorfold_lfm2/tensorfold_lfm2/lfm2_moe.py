"""The LFM2-MoE architecture: LFM2 whose layers past the first dense ones route each row to sigmoid-gated experts."""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from tensorfold_core.errors import CheckpointError
from tensorfold_core.families import swiglu

from . import lfm2


@dataclass
class ModelArgs(lfm2.ModelArgs):
    moe_intermediate_size: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    num_dense_layers: int = 2
    norm_topk_prob: bool = True
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0

    def check(self, source: str) -> None:
        super().check(source)
        needed = ("moe_intermediate_size", "num_experts", "num_experts_per_tok")
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(missing)}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(f"{source}: {self.num_experts_per_tok} experts per token of {self.num_experts}")


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def top_k(choice: mx.array, k: int) -> mx.array:
    """Each row's k best experts, best first; an exact tie goes to the lower expert id."""
    # negation is exact and keeps ties tied; MLX's argsort is stable (ties keep index order), so no key is needed
    return mx.argsort(-choice, axis=-1)[..., :k]


class SwitchLinear(nn.Module):
    """Every expert's weight [experts, out, in]; each (row, chosen expert) pair is its own product."""

    def __init__(self, dims: int, out_dims: int, experts: int):
        super().__init__()
        self.weight = mx.zeros((experts, out_dims, dims))

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        w = self.weight
        if w.dtype == mx.float32 or mx.default_device() != mx.cpu:
            return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=experts)
        # mlx 0.32's CPU gather_mm reads float32 only: gathered weights give the same per-pair products
        return x @ mx.take(w, experts, axis=0).swapaxes(-1, -2)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_) -> nn.Module:
        experts, out_dims, dims = self.weight.shape
        return QuantizedSwitchLinear(dims, out_dims, experts, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """Every expert's affine-packed weight, read in place by `mx.gather_qmm`."""

    def __init__(self, dims: int, out_dims: int, experts: int, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight = mx.zeros((experts, out_dims, dims * bits // 32), mx.uint32)
        self.scales = mx.zeros((experts, out_dims, dims // group_size))
        self.biases = mx.zeros((experts, out_dims, dims // group_size))

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=experts, transpose=True,
                             group_size=self.group_size, bits=self.bits, mode=self.mode)


class SwitchGLU(nn.Module):
    # from this many rows every expert runs over every row and each row keeps its picks (None: never): the same
    # products as one a (row, pick), bit for bit where the matmul is row-invariant, and where a matmul costs little a
    # row (OpenBLAS) cheaper past a few rows; set at load on the CPU by `time_all_experts`, which checks both
    all_experts_from: int | None = None

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(dim, hidden, experts)
        self.up_proj = SwitchLinear(dim, hidden, experts)
        self.down_proj = SwitchLinear(hidden, dim, experts)

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        if self.all_experts_from is not None and x.ndim == 2 and x.shape[0] >= self.all_experts_from:
            return self.all_experts(x, experts)
        return self.picked(x, experts)

    def picked(self, x: mx.array, experts: mx.array) -> mx.array:
        """Each (row, pick) its own product: [rows, k, dim]."""
        # rows are never sorted by expert (mlx-lm does, for speed): that would batch rows and break row invariance
        x = mx.expand_dims(x, (-2, -3))
        up, gate = self.up_proj(x, experts), self.gate_proj(x, experts)
        return self.down_proj(swiglu(gate, up), experts).squeeze(-2)

    def all_experts(self, x: mx.array, experts: mx.array) -> mx.array:
        """Every expert over every row ([rows, D] x [D, experts * hidden], then one product an expert), then each
        row's picks in order: [rows, k, dim]."""
        count, hidden, dims = self.gate_proj.weight.shape
        rows = x.shape[0]
        gate = (x @ self.gate_proj.weight.reshape(count * hidden, dims).T).reshape(rows, count, hidden)
        up = (x @ self.up_proj.weight.reshape(count * hidden, dims).T).reshape(rows, count, hidden)
        down = swiglu(gate, up).swapaxes(0, 1) @ self.down_proj.weight.swapaxes(-1, -2)  # [experts, rows, dim]
        return mx.take_along_axis(down.swapaxes(0, 1), experts[..., None].astype(mx.uint32), axis=1)


class SparseMoeBlock(nn.Module):
    """A sigmoid router picks each row's top-k experts (ties to the lower id); their unbiased scores weigh them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        if args.use_expert_bias:
            self.expert_bias = mx.zeros((args.num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        scores = mx.sigmoid(self.gate(x))
        # the expert bias only balances which experts are chosen; the weights stay the unbiased scores
        choice = scores.astype(mx.float32) + self["expert_bias"] if "expert_bias" in self else scores
        experts = top_k(choice, self.top_k)
        weights = mx.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-6)
        weights = (weights * self.routed_scaling_factor).astype(x.dtype)
        # both k-term sums run over the picks best first: a fixed order, so a row's rounding is fixed too
        return (self.switch_mlp(x, experts) * weights[..., None]).sum(axis=-2)


ALL_EXPERTS_ENV = "TENSORFOLD_ALL_EXPERTS_FROM"  # N: every expert over every row from N rows; 0: never; unset: timed
ALL_EXPERTS_ROWS = (4, 8, 16)  # the window sizes `time_all_experts` tries, fewest first
TIMING_REPS = 5


def time_all_experts(model: nn.Module) -> int | None:
    """From how many rows the MoE blocks run every expert over every row (`SwitchGLU.all_experts_from`), on the CPU
    with float32 experts only (MLX's gather_mm path): the knob's count, else the fewest of ALL_EXPERTS_ROWS from which
    it times faster here than one product a pick, and at every larger one, both giving the same bits on random rows
    at each (None: never). The load probe then checks the served windows as ever."""
    blocks = [layer.feed_forward for layer in model.model.layers if isinstance(layer.feed_forward, SparseMoeBlock)]
    glus = [block.switch_mlp for block in blocks]
    chosen = os.environ.get(ALL_EXPERTS_ENV, "")
    if chosen and not chosen.isdigit():
        raise CheckpointError(f"{ALL_EXPERTS_ENV}={chosen!r}: set it to a row count (0: never) or leave it unset")
    if (not glus or not all(type(g.gate_proj) is SwitchLinear for g in glus) or mx.default_device() != mx.cpu
            or glus[0].gate_proj.weight.dtype != mx.float32):
        return None
    rows = (int(chosen) or None) if chosen else _timed_rows(glus[0], blocks[0].top_k)
    for glu in glus:
        glu.all_experts_from = rows
    return rows


def _timed_rows(glu: SwitchGLU, top_k: int) -> int | None:
    count, _, dims = glu.gate_proj.weight.shape
    faster = []
    for rows in ALL_EXPERTS_ROWS:
        x = mx.random.normal((rows, dims), key=mx.random.key(rows))
        experts = mx.random.randint(0, count, (rows, top_k), key=mx.random.key(rows + 1)).astype(mx.uint32)
        if not mx.array_equal(glu.picked(x, experts), glu.all_experts(x, experts)).item():
            return None
        times = {}
        for way in (glu.picked, glu.all_experts):
            spent = []
            for _ in range(TIMING_REPS):
                start = time.perf_counter()
                mx.eval(way(x, experts))
                spent.append(time.perf_counter() - start)
            times[way.__name__] = statistics.median(spent)
        faster.append(times["all_experts"] < times["picked"])
    return next((rows for i, rows in enumerate(ALL_EXPERTS_ROWS) if all(faster[i:])), None)


HF_DENSE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT = re.compile(r"(.*\.feed_forward)\.experts\.(\d+)\.(w[123])\.weight$")


class Model(lfm2.Model):
    """An LFM2-MoE checkpoint as a tensorfold Model."""

    def feed_forward(self, layer: int) -> nn.Module:
        if layer < self.args.num_dense_layers:
            return MLP(self.args.hidden_size, self.args.intermediate_size)
        return SparseMoeBlock(self.args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Transformers' names onto mlx-lm's: dense w1/w3/w2 to gate/up/down, experts stacked per projection."""
        out, experts = {}, {}
        for name, w in super().sanitize(weights).items():
            dense = re.fullmatch(r"(.*\.feed_forward)\.(w[123])\.weight", name)
            expert = EXPERT.fullmatch(name)
            if dense:
                out[f"{dense[1]}.{HF_DENSE[dense[2]]}.weight"] = w
            elif expert:
                experts.setdefault((expert[1], HF_DENSE[expert[3]]), {})[int(expert[2])] = (name, w)
            elif name.endswith(".experts.gate_up_proj"):  # transformers' packed form: [experts, 2 * hidden, dim]
                prefix, half = name[:-len(".experts.gate_up_proj")], w.shape[1] // 2
                out[f"{prefix}.switch_mlp.gate_proj.weight"] = w[:, :half]
                out[f"{prefix}.switch_mlp.up_proj.weight"] = w[:, half:]
            elif name.endswith(".experts.down_proj"):
                out[f"{name[:-len('.experts.down_proj')]}.switch_mlp.down_proj.weight"] = w
            else:
                out[name] = w
        for (prefix, proj), parts in experts.items():
            if sorted(parts) == list(range(self.args.num_experts)):
                out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([parts[e][1] for e in sorted(parts)])
            else:  # leave them for the loader to name
                out.update(dict(parts.values()))
        return out
