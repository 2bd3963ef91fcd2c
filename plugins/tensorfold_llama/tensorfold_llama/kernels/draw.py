"""The keyed draw under contract: Gumbel-max with noise g(seed, position, id), the token core's sampler draws."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, variant
from tensorfold_core.sampling import SamplingParams, draw

from .common import LLAMA_8B, TINY, TINY_DRAFTER, WIDEST, int_array

THREADS = 256
GOLDEN, MIX1, MIX2, TOKEN = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD1B54A32D192ED03

HEADER = f"""
// splitmix64, as tensorfold_core.sampling mixes: uniform 64-bit output from any 64-bit input
__device__ __forceinline__ unsigned long long tf_mix(unsigned long long x) {{
  x += 0x{GOLDEN:X}ull;
  x = (x ^ (x >> 30)) * 0x{MIX1:X}ull;
  x = (x ^ (x >> 27)) * 0x{MIX2:X}ull;
  return x ^ (x >> 31);
}}
#define TF_BETTER(v, i, bv, bi) ((v) > (bv) || ((v) == (bv) && (i) < (bi)))
"""

CUDA = f"""
// One block per row. score = logit / T + g(seed, position, id), all in double as on the host; the largest
// score wins, ties to the lower id (a unique maximum, so the fold order cannot matter).
const int rows = dims[0];
const int V = dims[1];
const int row = blockIdx.x;
if (row >= rows) return;
const double temperature = __longlong_as_double((long long)params[1]);
const unsigned long long key = tf_mix(params[0] ^ tf_mix(positions[row]));
const double neg_inf = -__longlong_as_double(0x7ff0000000000000ll);
const float* p = logits + (size_t)row * V;
double best = neg_inf;
int idx = 0x7fffffff;
for (int i = threadIdx.x; i < V; i += blockDim.x) {{
  const float l = p[i];
  const double scaled = isnan(l) ? neg_inf : (double)l / temperature;
  const unsigned long long bits = tf_mix(key ^ ((unsigned long long)i * 0x{TOKEN:X}ull));
  const double u = ((double)(bits >> 11) + 0.5) * 1.1102230246251565e-16;  // 2^-53: uniform in (0, 1)
  const double score = scaled + -log(-log(u));
  if (TF_BETTER(score, i, best, idx)) {{ best = score; idx = i; }}
}}
for (int o = 16; o > 0; o >>= 1) {{
  const double ob = __shfl_xor_sync(0xffffffffu, best, o);
  const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
  if (TF_BETTER(ob, oi, best, idx)) {{ best = ob; idx = oi; }}
}}
__shared__ double wbest[32];
__shared__ int widx[32];
if ((threadIdx.x & 31) == 0) {{ wbest[threadIdx.x >> 5] = best; widx[threadIdx.x >> 5] = idx; }}
__syncthreads();
if (threadIdx.x == 0) {{
  for (int k = 1; k < (int)(blockDim.x >> 5); ++k) {{
    if (TF_BETTER(wbest[k], widx[k], best, idx)) {{ best = wbest[k]; idx = widx[k]; }}
  }}
  draws[row] = idx == 0x7fffffff ? 0 : idx;
}}
"""


def make(dims, rows, rng):
    """Logits with planted rows (the largest last, NaN and -inf sprinkled, all -inf but one), a seed, positions."""
    v = dims["vocab"]
    x = (2 * rng.standard_normal((rows, v))).astype(np.float32)
    for r in range(rows):
        if r % 4 == 0:
            x[r, -1] = 40.0
        elif r % 4 == 1:
            x[r, rng.choice(v, max(1, v // 9))] = np.nan
            x[r, rng.choice(v, max(1, v // 9))] = -np.inf
        elif r % 4 == 2:
            keep = rng.integers(v)
            x[r, :] = -np.inf
            x[r, keep] = 0.0
    seed = rng.integers(0, 2**64, dtype=np.uint64)
    params = np.array([seed, np.float64(dims["temperature"]).view(np.uint64)], dtype=np.uint64)
    positions = rng.integers(0, 131072, size=rows).astype(np.uint64)  # rows of different streams: any positions
    return {"logits": x, "params": params, "positions": positions}


def reference(case):
    params = SamplingParams(temperature=case.dims["temperature"])
    seed = int(case["params"][0])
    with np.errstate(invalid="ignore"):  # a row of -inf only: the host's logsumexp is -inf, and so is -inf - -inf
        draws = [draw(row, params, seed, int(p)) for row, p in zip(case["logits"], case["positions"])]
    return {"draws": np.array(draws, dtype=np.int64).reshape(case.rows)}


def _u64(value: int):
    import mlx.core as mx

    return mx.array(np.array([value], dtype=np.uint64))


def _mix(x):
    """splitmix64 on uint64 mx.arrays (they wrap as the host's numpy does)."""
    x = x + _u64(GOLDEN)
    x = (x ^ (x >> _u64(30))) * _u64(MIX1)
    x = (x ^ (x >> _u64(27))) * _u64(MIX2)
    return x ^ (x >> _u64(31))


def mlx_draw_for(by_row_index: bool = False, noisy_temperature: bool = False, drop_tail: bool = False):
    def mlx_draw(case):
        """float64 and uint64 ops on the CPU stream (MLX's GPUs have no float64): the host's arithmetic, in MLX."""
        import mlx.core as mx

        if case.rows == 0:  # mx.argmax refuses a zero-size reduction
            return {"draws": mx.zeros((0,), mx.int32)}
        temperature = float(case["params"][1:2].view(np.float64)[0])
        with mx.stream(mx.cpu):
            logits = case.array("logits").astype(mx.float64)
            if drop_tail:
                logits = logits[:, :-1]
            positions = mx.arange(case.rows).astype(mx.uint64) if by_row_index else case.array("positions")
            key = _mix(case.array("params")[0:1] ^ _mix(positions))[:, None]
            ids = mx.arange(logits.shape[-1]).astype(mx.uint64)[None]
            bits = _mix(key ^ (ids * _u64(TOKEN)))
            uniform = ((bits >> _u64(11)).astype(mx.float64) + 0.5) / float(1 << 53)
            noise = -mx.log(-mx.log(uniform))
            clean = mx.where(mx.isnan(logits), -mx.inf, logits)
            scores = (clean + noise) / temperature if noisy_temperature else clean / temperature + noise
            draws = mx.argmax(scores, axis=-1).astype(mx.int32)
            mx.eval(draws)
        return {"draws": draws}

    return mlx_draw


def _inputs(case):
    return [case.array("logits"), case.array("params"), case.array("positions"),
            int_array([case.rows, case.dims["vocab"]])]


def _launch(case):
    import mlx.core as mx

    return Launch(grid=(case.rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=((case.rows,),),
                  output_dtypes=(mx.int32,), static_shared=32 * 8 + 32 * 4)


def _shape(label, vocab, temperature, rows=WIDEST, heavy=False):
    return Shape(label, {"vocab": vocab, "temperature": temperature}, rows, heavy)


RECORD = KernelRecord(
    name="llama keyed draw",
    family="llama",
    description="the sampled token per row: argmax of logit/T + g(seed, position, id) in float64, as "
                "tensorfold_core.sampling draws it without top-k/top-p/min-p (the host applies those). The host "
                "subtracts the row's logsumexp first; that constant moves no argmax unless two scores tie within "
                "an ulp",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_draw_for(),
                     "cuda": Source("keyed_draw", ("logits", "params", "positions", "dims"), ("draws",), CUDA,
                                    inputs=_inputs, launch=_launch, header=HEADER)},
    shapes=(_shape("tiny vocab T=0.7", TINY["vocab"], 0.7),
            _shape("tiny drafter vocab T=1", TINY_DRAFTER["vocab"], 1.0),
            _shape("llama3 vocab T=1.3", LLAMA_8B["vocab"], 1.3, heavy=True)),
    edges=(_shape("1 row", TINY["vocab"], 0.9, 1), _shape("vocab 1", 1, 1.0, 4), _shape("vocab 1000", 1000, 2.0, 5),
           _shape("cold T=0.05", 333, 0.05, 9), _shape("empty", TINY["vocab"], 1.0, 0)),
    row_inputs=("logits", "positions"),
    bit_equal_to={"cuda": "mlx"},
    controls=(
        Control("noise keyed by the row index, not the position", "mlx", 2, variant(mlx_draw_for(by_row_index=True))),
        Control("temperature applied to the noise too", "mlx", 2, variant(mlx_draw_for(noisy_temperature=True))),
        Control("dropped tail token", "mlx", 2, variant(mlx_draw_for(drop_tail=True))),
        Control("seed left out of the key", "cuda", 2, swap("tf_mix(params[0] ^ tf_mix(", "tf_mix(0ull ^ tf_mix(")),
        Control("dropped tail token", "cuda", 2, swap("i < V; i += blockDim.x", "i < V - 1; i += blockDim.x")),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
    ),
)
