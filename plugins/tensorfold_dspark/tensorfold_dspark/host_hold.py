"""A hold on the host: the drafter's layers, Markov picks and confidences in NumPy, for the CPU, where each of MLX's
ops costs scheduling time out of all proportion to a hold's few rows (docs/dspark.md, *The hold on the host*). The
target's embedding and head stay the target's own MLX calls, on its weights and its BLAS threads. A draft decides
only how many tokens a verify keeps, never a reply's ids, so its bits need not be MLX's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tensorfold_core.kernels import BUILTIN, DRAFTER_BUILTIN_ENV, backend
from tensorfold_core.protocols import TappedModel

from .model import Model

HOST_HOLD_ENV = "TENSORFOLD_HOST_HOLD"  # "0": a CPU drafter holds with MLX's ops (a measurement's knob)
HOST_LABEL = "numpy (host)"  # what serves the drafter's ops where the host holds, for `capabilities`
# BLAS's GEMM packs its whole matrix at every call: up to this many rows a product a row (GEMV) costs less
GEMV_ROWS = 4


def _matrix(module: nn.Module) -> np.ndarray | None:
    """A linear's or embedding's float32 weights on the host: its codes unpacked once (quantized.serve_codes), or its
    plain weights; None where the codes were left packed."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        unpacked = getattr(module, "unpacked", None)
        return None if unpacked is None else _host(unpacked)
    return _host(module.weight)


def _host(a: mx.array) -> np.ndarray:
    """The array's float32 values, read in place where they are float32 already."""
    a = a.astype(mx.float32)
    mx.eval(a)
    return np.array(a, copy=False)


def _bias(module: nn.Module) -> np.ndarray | float:
    return _host(module["bias"]) if "bias" in module else 0.0


def _product(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x @ weight.T, a row at a time where there are few rows."""
    if x.shape[0] > GEMV_ROWS:
        return x @ weight.T
    return np.stack([weight @ row for row in x])


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


class _Layer:
    """One drafter layer's weights on the host."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.linears = [_matrix(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                             mlp.up_proj, mlp.down_proj)]
        self.biases = [_bias(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
        self.norms = [_host(n.weight) for n in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm,
                                                attn.k_norm)]


class HostHold:
    """The hold's arithmetic in NumPy over the drafter's unpacked weights; the lanes' keys and values are read where
    MLX keeps them (evaluated first), the block's embedding and its logits are the target's."""

    def __init__(self, model: Model, target: TappedModel, mask_id: int):
        args = model.args
        attn = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.scale, self.traditional, self.eps = attn.scale, attn.traditional, args.rms_norm_eps
        self.inverse_frequencies = (attn.rope_theta ** (-np.arange(0, self.head_dim, 2) / self.head_dim)
                                    ).astype(np.float32)
        self.layers = [_Layer(layer) for layer in model.layers]
        self.norm = _host(model.norm.weight)
        self.markov_w1, self.markov_w2 = _matrix(model.markov_head.markov_w1), _matrix(model.markov_head.markov_w2)
        self.confidence = None
        if args.confidence:
            proj = model.confidence_head.proj
            self.confidence = (_matrix(proj), _bias(proj))
        self.target, self.mask_id = target, mask_id

    @property
    def complete(self) -> bool:
        """Whether every weight reached the host (a drafter whose codes stayed packed holds with MLX's ops)."""
        weights = [w for layer in self.layers for w in layer.linears] + [self.markov_w1, self.markov_w2]
        return all(w is not None for w in weights) and (self.confidence is None or self.confidence[0] is not None)

    def hold(self, contexts: Sequence[Sequence[int]], lanes: Sequence, depths: Sequence[int]):
        """As the drafter's `_hold` (its blocks deepest first): each step's picks, NaN flags and confidences."""
        ids, positions, starts = [], [], []
        for context, depth in zip(contexts, depths):
            starts.append(len(ids))
            ids += [context[-1]] + [self.mask_id] * (depth - 1)
            positions += range(len(context) - 1, len(context) - 1 + depth)  # the pending token's own position on
        x = np.array(self.target.embed(mx.array(ids, dtype=mx.uint32)), copy=False)
        angles = np.asarray(positions, np.float32)[:, None] * self.inverse_frequencies
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        for i, layer in enumerate(self.layers):
            x = self._layer(x, layer, i, cos, sin, list(zip(starts, depths, lanes)))
        final = _rms(x, self.norm, self.eps)
        logits = np.array(self.target.head(mx.array(final)), copy=False)
        previous = np.asarray([context[-1] for context in contexts])
        steps, flags, rows, before = [], [], [], []
        for step in range(depths[0]):
            m = sum(1 for d in depths if d > step)
            rows.append([start + step for start in starts[:m]])
            previous = previous[:m]
            before.append(previous)
            scores = logits[rows[-1]] + self.markov_w1[previous] @ self.markov_w2.T
            nan = np.isnan(scores)
            steps.append(np.argmax(np.where(nan, -np.inf, scores), axis=-1).tolist())  # ties to the lowest id
            flags.append(nan.any(axis=-1).tolist())
            previous = np.asarray(steps[-1])
        return steps, flags, self._confidences(final, rows, before)

    def _layer(self, x: np.ndarray, layer: _Layer, index: int, cos, sin, blocks) -> np.ndarray:
        q_w, k_w, v_w, o_w, gate_w, up_w, down_w = layer.linears
        q_b, k_b, v_b, o_b = layer.biases
        in_norm, post_norm, q_norm, k_norm = layer.norms
        rows, dim = x.shape[0], self.head_dim
        h = _rms(x, in_norm, self.eps)
        q = self._rope(_rms((_product(h, q_w) + q_b).reshape(rows, self.heads, dim), q_norm, self.eps), cos, sin)
        k = self._rope(_rms((_product(h, k_w) + k_b).reshape(rows, self.kv_heads, dim), k_norm, self.eps), cos, sin)
        v = (_product(h, v_w) + v_b).reshape(rows, self.kv_heads, dim)
        out = np.empty((rows, self.heads * dim), np.float32)
        group = self.heads // self.kv_heads  # query heads share their kv head in runs, as MLX's attention reads them
        for start, n, lane in blocks:  # every block row sees its lane's whole context and its whole block
            keys = np.array(lane.keys[index], copy=False)[0, :, :lane.n]
            values = np.array(lane.values[index], copy=False)[0, :, :lane.n]
            keys = np.concatenate([keys, k[start:start + n].transpose(1, 0, 2)], axis=1)
            values = np.concatenate([values, v[start:start + n].transpose(1, 0, 2)], axis=1)
            queries = q[start:start + n].transpose(1, 0, 2).reshape(self.kv_heads, group * n, dim)
            scores = queries @ keys.transpose(0, 2, 1) * self.scale
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            out[start:start + n] = (weights @ values).reshape(self.heads, n, dim).transpose(1, 0, 2).reshape(n, -1)
        x = x + _product(out, o_w) + o_b
        h = _rms(x, post_norm, self.eps)
        gate = _product(h, gate_w)
        return x + _product(gate / (1.0 + np.exp(-gate)) * _product(h, up_w), down_w)

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Each row rotated at its own position, as MLX's rope (pairs side by side, or halves where not traditional)."""
        if self.traditional:
            first, second = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = first * cos - second * sin, first * sin + second * cos
            return out
        half = self.head_dim // 2
        first, second = x[..., :half], x[..., half:]
        return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)

    def _confidences(self, final: np.ndarray, rows: list[list[int]], before: list[np.ndarray]) -> list[list[float]]:
        """Each step's confidences, as the drafter's `_confidences`; [] with no head."""
        if self.confidence is None:
            return []
        weight, bias = self.confidence
        features = final[[r for step in rows for r in step]]
        if weight.shape[1] > features.shape[1]:  # the head reads W1 of the token before each draft too
            features = np.concatenate([features, self.markov_w1[np.concatenate(before)]], axis=-1)
        chance = (1.0 / (1.0 + np.exp(-(features @ weight.T + bias)[:, 0]))).tolist()
        out, at = [], 0
        for step in rows:
            out.append(chance[at:at + len(step)])
            at += len(step)
        return out


def numpy_blas_on_one_thread() -> None:
    """The BLAS bundled with NumPy's wheel (a library apart from MLX's) on one thread: two BLAS thread pools on the
    same cores spin after their calls and hold each other's threads off, which slowed served holds many times over
    (docs/dspark.md); a hold's products are of few rows and gain nothing from a second thread."""
    from threadpoolctl import ThreadpoolController  # the CPU's alone: a GPU machine's site need not have it

    bundled = str(Path(np.__file__).parent)  # a prefix of numpy/ and of the wheel's numpy.libs/ beside it
    for library in ThreadpoolController().lib_controllers:
        if library.user_api == "blas" and library.filepath.startswith(bundled):
            library.set_num_threads(1)


def host_hold(model: Model, target: TappedModel, mask_id: int, served: Mapping[str, str]) -> HostHold | None:
    """The host's hold where it serves: on the CPU, with float32 activations, every drafter weight unpacked and MLX's
    ops `served` for every op of the drafter's table (a kernel record asked for, or TENSORFOLD_DRAFTER_BUILTIN=1,
    keeps the hold in MLX as asked); None otherwise, or where TENSORFOLD_HOST_HOLD=0."""
    if (backend() != "cpu" or os.environ.get(HOST_HOLD_ENV) == "0" or os.environ.get(DRAFTER_BUILTIN_ENV) == "1"
            or target.dtype != mx.float32 or any(label != BUILTIN for label in served.values())):
        return None
    hold = HostHold(model, target, mask_id)
    if not hold.complete:
        return None
    numpy_blas_on_one_thread()
    return hold
