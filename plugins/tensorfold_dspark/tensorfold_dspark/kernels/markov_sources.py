"""Kernel text of the DSpark Markov pick: CUDA (mx.fast.cuda_kernel) and Metal (mx.fast.metal_kernel)."""

# Both bodies take logits [rows, V] float32, previous [rows] uint32, each of W1 and W2 as 8-bit MLX affine codes
# [V, RANK / 4] uint32 with scales and biases [V, RANK / GROUP] in T, and dims [rows, V]; ids and flags [rows] are
# int32. Template constants: RANK (a multiple of 16), GROUP (a multiple of 16 dividing RANK), TEAM (lanes that share
# one vocab entry's dot product: a power of two up to 16, set by RANK alone) and T (the case dtype).

HEADER = """
// (score, id) pairs ordered by score, then by the lower id: the maximum under this order is unique, so no fold
// order can change which id wins.
#define TF_BETTER(v, i, bv, bi) ((v) > (bv) || ((v) == (bv) && (i) < (bi)))
"""

CUDA = """
// One block per row. W1[previous] is dequantized once, each lane of a team holding its chunks (16 codes, a uint4 that
// lies within one group) rounded to T, as the embedding gives them. Team t of the block takes vocab entries t,
// t + teams, ...; for each, a lane sums its chunks of that W2 row in code order, the team's partial sums are folded by
// a fixed xor tree, and the sum is rounded to T (the quantized product's output) before it meets the logit. Each
// thread keeps its best (score, id) and whether it met a NaN; a fixed tree folds them, lanes then warps. Every order
// depends on RANK alone, never on the row count.
constexpr int CHUNKS = RANK / 16;
constexpr int PER_LANE = (CHUNKS + TEAM - 1) / TEAM;
constexpr int WORDS = RANK / 4;
constexpr int GROUPS = RANK / GROUP;
const int rows = dims[0];
const int V = dims[1];
const int row = blockIdx.x;
if (row >= rows) return;
const int part = threadIdx.x % TEAM;
const int team = threadIdx.x / TEAM;
const int teams = blockDim.x / TEAM;
const size_t prev = previous[row];
float h[PER_LANE][16];
#pragma unroll
for (int k = 0; k < PER_LANE; ++k) {
  const int c = part + TEAM * k;
  if (c < CHUNKS) {
    const uint4 q = reinterpret_cast<const uint4*>(w1_codes + prev * WORDS)[c];
    const float s = static_cast<float>(w1_scales[prev * GROUPS + c * 16 / GROUP]);
    const float b = static_cast<float>(w1_biases[prev * GROUPS + c * 16 / GROUP]);
    const unsigned int words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      h[k][j] = static_cast<float>(static_cast<T>(fmaf(s, (float)((words[j / 4] >> (8 * (j % 4))) & 255u), b)));
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) h[k][j] = 0.0f;
  }
}
const float* x = logits + (size_t)row * V;
float best = -__int_as_float(0x7f800000);
int idx = 0x7fffffff;
int hasnan = 0;
// the loop runs alike on every warp (all lanes meet each shuffle); a team past the vocab reads the last entry and
// drops it
for (int v0 = 0; v0 < V; v0 += teams) {
  const int v = v0 + team;
  const size_t w = (size_t)min(v, V - 1);
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const int c = part + TEAM * k;
    if (c < CHUNKS) {
      const uint4 q = reinterpret_cast<const uint4*>(w2_codes + w * WORDS)[c];
      const float s = static_cast<float>(w2_scales[w * GROUPS + c * 16 / GROUP]);
      const float b = static_cast<float>(w2_biases[w * GROUPS + c * 16 / GROUP]);
      const unsigned int words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc = fmaf(h[k][j], fmaf(s, (float)((words[j / 4] >> (8 * (j % 4))) & 255u), b), acc);
      }
    }
  }
#pragma unroll
  for (int o = TEAM / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  const float score = x[w] + static_cast<float>(static_cast<T>(acc));
  if (v < V) {
    if (isnan(score)) {
      hasnan = 1;
    } else if (TF_BETTER(score, v, best, idx)) {
      best = score;
      idx = v;
    }
  }
}
for (int o = 16; o > 0; o >>= 1) {
  const float ob = __shfl_xor_sync(0xffffffffu, best, o);
  const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
  hasnan |= __shfl_xor_sync(0xffffffffu, hasnan, o);
  if (TF_BETTER(ob, oi, best, idx)) { best = ob; idx = oi; }
}
__shared__ float wbest[32];
__shared__ int widx[32];
__shared__ int wnan[32];
const int warp = threadIdx.x >> 5;
if ((threadIdx.x & 31) == 0) { wbest[warp] = best; widx[warp] = idx; wnan[warp] = hasnan; }
__syncthreads();
if (threadIdx.x == 0) {
  for (int k = 1; k < (int)(blockDim.x >> 5); ++k) {
    if (TF_BETTER(wbest[k], widx[k], best, idx)) { best = wbest[k]; idx = widx[k]; }
    hasnan |= wnan[k];
  }
  // a row of NaN scores only ends at id 0, as on the host
  ids[row] = idx == 0x7fffffff ? 0 : idx;
  flags[row] = hasnan;
}
"""

METAL = """
// The CUDA kernel's decomposition with simdgroup shuffles: one threadgroup per row, W1[previous] dequantized once per
// lane's chunks and rounded to T, team t taking vocab entries t, t + teams, ..., each entry's chunk sums folded by a
// fixed xor tree and rounded to T, then each thread's best (score, id) and NaN flag folded lanes then simdgroups.
constexpr int CHUNKS = RANK / 16;
constexpr int PER_LANE = (CHUNKS + TEAM - 1) / TEAM;
constexpr int WORDS = RANK / 4;
constexpr int GROUPS = RANK / GROUP;
const int rows = dims[0];
const int V = dims[1];
const int row = (int)threadgroup_position_in_grid.x;
const int tid = (int)thread_position_in_threadgroup.x;
const int n = (int)threads_per_threadgroup.x;
threadgroup float wbest[32];
threadgroup int widx[32];
threadgroup int wnan[32];
if (row >= rows) return;
const int part = tid % TEAM;
const int team = tid / TEAM;
const int teams = n / TEAM;
const size_t prev = previous[row];
float h[PER_LANE][16];
for (int k = 0; k < PER_LANE; ++k) {
  const int c = part + TEAM * k;
  if (c < CHUNKS) {
    const uint4 q = ((const device uint4*)(w1_codes + prev * WORDS))[c];
    const float s = static_cast<float>(w1_scales[prev * GROUPS + c * 16 / GROUP]);
    const float b = static_cast<float>(w1_biases[prev * GROUPS + c * 16 / GROUP]);
    for (int j = 0; j < 16; ++j) {
      h[k][j] = static_cast<float>(static_cast<T>(metal::fma(s, (float)((q[j / 4] >> (8 * (j % 4))) & 255u), b)));
    }
  } else {
    for (int j = 0; j < 16; ++j) h[k][j] = 0.0f;
  }
}
float best = -INFINITY;
int idx = 0x7fffffff;
int hasnan = 0;
for (int v0 = 0; v0 < V; v0 += teams) {
  const int v = v0 + team;
  const size_t w = (size_t)metal::min(v, V - 1);
  float acc = 0.0f;
  for (int k = 0; k < PER_LANE; ++k) {
    const int c = part + TEAM * k;
    if (c < CHUNKS) {
      const uint4 q = ((const device uint4*)(w2_codes + w * WORDS))[c];
      const float s = static_cast<float>(w2_scales[w * GROUPS + c * 16 / GROUP]);
      const float b = static_cast<float>(w2_biases[w * GROUPS + c * 16 / GROUP]);
      for (int j = 0; j < 16; ++j) {
        acc = metal::fma(h[k][j], metal::fma(s, (float)((q[j / 4] >> (8 * (j % 4))) & 255u), b), acc);
      }
    }
  }
  for (ushort o = TEAM / 2; o > 0; o >>= 1) acc += simd_shuffle_xor(acc, o);
  const float score = logits[(size_t)row * V + w] + static_cast<float>(static_cast<T>(acc));
  if (v < V) {
    if (metal::isnan(score)) {
      hasnan = 1;
    } else if (TF_BETTER(score, v, best, idx)) {
      best = score;
      idx = v;
    }
  }
}
for (ushort o = 16; o > 0; o >>= 1) {
  const float ob = simd_shuffle_xor(best, o);
  const int oi = simd_shuffle_xor(idx, o);
  hasnan |= simd_shuffle_xor(hasnan, o);
  if (TF_BETTER(ob, oi, best, idx)) { best = ob; idx = oi; }
}
const int sg = (int)simdgroup_index_in_threadgroup;
if (thread_index_in_simdgroup == 0) { wbest[sg] = best; widx[sg] = idx; wnan[sg] = hasnan; }
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  for (int k = 1; k < n / 32; ++k) {
    if (TF_BETTER(wbest[k], widx[k], best, idx)) { best = wbest[k]; idx = widx[k]; }
    hasnan |= wnan[k];
  }
  ids[row] = idx == 0x7fffffff ? 0 : idx;
  flags[row] = hasnan;
}
"""
