"""The DSpark confidence head under contract: each draft row's sigmoid(w . features + b), in float32."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import (Control, Finding, KernelRecord, Launch, Shape, Source, Tolerance,
                                 oversize_threadgroup, swap, variant)
from tensorfold_contract.helpers import EPS32, WIDEST, int_array, mx_dtype, rounded, spacing

from .confidence_sources import CUDA, METAL

THREADS = 256  # one group per row: 8 warps, so the served widths take 2..9 products a thread
TINY = dict(width=256 + 32)  # the tests' tiny drafter: hidden 256 and W1[previous] of rank 32
LFM2_24B = dict(width=2048 + 256)  # LiquidAI's LFM2.5-24B-A2B drafter: hidden 2048 and rank 256
MILD = (4.0, 20.0)  # |logit| of rows pushed into the sigmoid's tails, where its slope is small but not nil
SATURATED = (100.0, 200.0)  # |logit| past float32's exp range (88.7): exp(-x) overflows, the output must not


def _free_row(rng, w: np.ndarray) -> np.ndarray:
    """A row like a normed final row, scaled so its sum of |products| stays under 0.9 sqrt(width)."""
    f = rng.standard_normal(w.shape[0])
    weight = np.abs(f * w).sum()
    limit = 0.9 * np.sqrt(w.shape[0])
    return f * (limit / weight) if weight > limit else f


def _aligned_row(rng, w: np.ndarray, logit: float) -> np.ndarray:
    """A row whose every product has the logit's sign, so its sum of |products| is |logit| itself."""
    g = np.abs(rng.standard_normal(w.shape[0]))
    return np.sign(logit) * np.sign(w) * g * (abs(logit) / max(np.abs(w * g).sum(), 1e-30))


def make(dims, rows, rng):
    """Every 8 rows: 4 free rows (logits about N(0, 1)), then 2 driven to +-4..20, then 2 to +-100..200."""
    width, dtype = dims["width"], dims["dtype"]
    w = rounded(rng.standard_normal(width) / np.sqrt(width), dtype).astype(np.float64)
    bias = rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5)
    features = np.zeros((rows, width))
    for r in range(rows):
        kind = r % 8
        if kind < 4:
            features[r] = _free_row(rng, w)
        else:
            span = MILD if kind < 6 else SATURATED
            features[r] = _aligned_row(rng, w, (1.0 if kind % 2 == 0 else -1.0) * rng.uniform(*span))
    return {"features": rounded(features, dtype), "w": rounded(w, dtype),
            "bias": rounded(np.array([bias]), dtype)}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """The float64 sigmoid, written so neither tail overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def reference(case):
    logit = case["features"].astype(np.float64) @ case["w"].astype(np.float64) + float(case["bias"][0])
    return {"out": _sigmoid(logit)}


def tolerance(dims):
    # The float32 dot plus the bias drifts by at most (width + 1) EPS32 times the sum of |products| and |bias|, twice
    # that where each fp32 product is rounded before it is added (a bf16 product is exact in fp32). make keeps that
    # sum under sqrt(width) + 1.5 on free rows and at |logit| + 1.5 on driven ones; the sigmoid's slope (at most 1/4,
    # and |x| s'(x) at most 0.23) turns either into under 2 (width + 1) EPS32 (sqrt(width) + 4) / 4. MLX's bf16
    # linear rounds the logit to bf16, up to twice: a relative 2^-8, under spacing / 4 once through the slope. The
    # float32 sigmoid itself, a fast-math exp included, costs a few ulps of an output under 1.
    width = dims["width"]
    dot = 0.5 * (width + 1) * EPS32 * (np.sqrt(width) + 4)
    return Tolerance(atol=dot + 0.25 * spacing(dims["dtype"]) + 32 * EPS32)


# --- mlx: the drafter's own Model.confidence, on a drafter whose head holds the case's weights ------------------------


def _drafter(case, bias: bool = True):
    """A drafter whose confidence head reads `width` features as they come (the Markov part already joined)."""
    import mlx.core as mx

    from ..model import Model, ModelArgs

    dt = mx_dtype(case.dims["dtype"])
    # no layers, a one-token vocabulary: nothing but the confidence head is ever evaluated (MLX builds lazily)
    args = ModelArgs(model_type="qwen3", hidden_size=case.dims["width"], num_hidden_layers=0, num_attention_heads=1,
                     intermediate_size=1, vocab_size=1,
                     dflash_config={"mask_token_id": 0, "target_layer_ids": [0], "num_target_layers": 1,
                                    "block_size": 1, "markov_rank": 1, "enable_confidence_head": True,
                                    "confidence_head_with_markov": False})
    model = Model(args)
    proj = model.confidence_head.proj
    # a loaded Linear's strides: a [None] view of w takes another BLAS path on the CPU, whose sums round otherwise
    proj.weight = case.array("w", dt).reshape(1, -1)
    proj.bias = case.array("bias", dt) if bias else mx.zeros((1,), dt)
    return model


def _confidence(case, features=None, bias: bool = True):
    import mlx.core as mx

    features = case.array("features", mx_dtype(case.dims["dtype"])) if features is None else features
    previous = mx.zeros((features.shape[0],), mx.uint32)  # read only where the head joins W1[previous] itself
    return {"out": _drafter(case, bias).confidence(features, previous)}


def mlx_confidence(case):
    return _confidence(case)


def bias_dropped(case):
    """Planted: the head's bias never reaches the logit."""
    return _confidence(case, bias=False)


def features_of_the_next_row(case):
    """Planted: each row reads the next row's features (the last its own)."""
    import mlx.core as mx

    f = case.array("features", mx_dtype(case.dims["dtype"]))
    return _confidence(case, features=mx.concatenate([f[1:], f[-1:]]) if case.rows > 1 else f)


def overflowing_sigmoid(case):
    """Planted: sigmoid as exp(x) / (1 + exp(x)), which is inf / inf past float32's exp range."""
    import mlx.core as mx

    features = case.array("features", mx_dtype(case.dims["dtype"]))
    logit = _drafter(case).confidence_head.proj(features)[..., 0].astype(mx.float32)
    return {"out": mx.exp(logit) / (1 + mx.exp(logit))}


# --- cuda, metal: confidence_sources ----------------------------------------------------------------------------------


def _inputs(case):
    dt = mx_dtype(case.dims["dtype"])
    return [case.array("features", dt), case.array("w", dt), case.array("bias", dt),
            int_array([case.rows, case.dims["width"]])]


def _launch(case):
    import mlx.core as mx

    return Launch(grid=(case.rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=((case.rows,),),
                  output_dtypes=(mx.float32,), template=(("T", mx_dtype(case.dims["dtype"])),),
                  static_shared=32 * 4)


def source(kind: str) -> Source:
    return Source("dspark_confidence", ("features", "w", "bias", "dims"), ("out",),
                  CUDA if kind == "cuda" else METAL, inputs=_inputs, launch=_launch)


CUDA_LOOP = "for (int j = threadIdx.x; j < width; j += blockDim.x) {"
# Planted: a call of more than one row gives each thread a contiguous run of products instead of a stride
CHUNKED_WHEN_MANY = ("const int run = rows > 1 ? (width + blockDim.x - 1) / blockDim.x : 1;\n"
                     "const int first = rows > 1 ? threadIdx.x * run : threadIdx.x;\n"
                     "const int stop = rows > 1 ? min(width, first + run) : width;\n"
                     "for (int j = first; j < stop; j += rows > 1 ? 1 : blockDim.x) {")

# The mlx implementation is MLX's CUDA matmul, which rounds fp32 inputs TF32-like and picks its kernel by the row
# count, as the markov pick's was seen to do (markov.ON_CUDA): on CUDA a confidence may stray from float64 or from
# its 1-row call. A confidence only prices verify rows; the target still verifies every draft, so no reply changes.
ON_CUDA = (Finding("MLX's CUDA matmul is TF32-like for fp32 inputs and not row-invariant, and the mlx implementation "
                   "is composed of it: a confidence may stray (it prices verify rows, never a reply's tokens)",
                   kind="mlx", gate=2, backend="cuda", symptom=" off by ", mlx="0.32.4"),
           Finding("MLX's CUDA matmul picks its kernel by the row count, and the mlx implementation is composed of it",
                   kind="mlx", gate=4, backend="cuda", symptom="differs from its 1-row call", mlx="0.32.4"))


def _shape(label, width, dtype="float32", rows=WIDEST, heavy=False):
    return Shape(label, {"width": width, "dtype": dtype}, rows, heavy=heavy)


RECORD = KernelRecord(
    name="dspark confidence head",
    family="dspark",
    description="a draft row's confidence: sigmoid(w . features + b) in float32, over features already joined "
                "(the final row and, where the head reads it, W1[previous token]: that 8-bit lookup is not proven here)",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_confidence, "cuda": source("cuda"), "metal": source("metal")},
    shapes=(_shape("tiny drafter", **TINY), _shape("tiny drafter bf16", **TINY, dtype="bfloat16"),
            _shape("LFM2.5-24B-A2B drafter bf16", **LFM2_24B, dtype="bfloat16", heavy=True)),
    edges=(_shape("1 row", **TINY, rows=1), _shape("width 291, off the group", 291, "bfloat16", rows=5),
           _shape("width 1", 1, rows=3), _shape("empty", **TINY, rows=0)),
    tolerance=tolerance,
    row_inputs=("features",),
    findings=ON_CUDA,
    controls=(
        Control("bias dropped", "mlx", 2, variant(bias_dropped)),
        Control("features of the next row", "mlx", 2, variant(features_of_the_next_row)),
        Control("sigmoid as exp(x) / (1 + exp(x))", "mlx", 2, variant(overflowing_sigmoid)),
        Control("dropped tail element", "cuda", 2,
                swap("j < width; j += blockDim.x", "j < width - 1; j += blockDim.x")),
        Control("row-count-dependent reduction order", "cuda", 4, swap(CUDA_LOOP, CHUNKED_WHEN_MANY)),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("dropped tail element", "metal", 2, swap("j < (uint)width; j += n", "j < (uint)width - 1; j += n")),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
