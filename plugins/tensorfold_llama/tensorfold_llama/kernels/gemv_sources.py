"""Kernel text of the row-invariant multi-row GEMV: CUDA (bf16 and MLX affine 4/8-bit) and Metal (bf16)."""

# Shared by every CUDA variant: which warp owns which columns, the accumulators, the fold and the store.
CUDA_HEAD = """
// Multi-row GEMV y[r, n] = sum_k x[r, k] * w[n, k], r < rows <= MAXR: the weights are read once for all rows.
// One warp per COLS output columns; lane l takes the 8-input chunks l, l + 32, ...; each (row, column) is one
// chain of fp32 FMAs in chunk order, folded across lanes by a fixed xor tree and stored by lane 0. More rows
// only repeat that chain, so a row's result is the same in a call of any row count.
const int rows = dims[0];
const int N = dims[1];
const int K = dims[2];
const int lane = threadIdx.x & 31;
const int col0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * COLS;
if (col0 >= N) return;
float acc[MAXR][COLS];
#pragma unroll
for (int r = 0; r < MAXR; ++r) {
#pragma unroll
  for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
}
"""

# The x side of one chunk: 8 bf16 inputs of each row (16-byte loads), FMAs into every column's chain.
CUDA_ROWS = """
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    if (r < rows) {
      const uint4 xraw = reinterpret_cast<const uint4*>(x + (size_t)r * K)[t];
      const __nv_bfloat16* xh = reinterpret_cast<const __nv_bfloat16*>(&xraw);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float xv = __bfloat162float(xh[j]);
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[r][c] = fmaf(xv, wv[c][j], acc[r][c]);
      }
    }
  }
}
"""

CUDA_FOLD = """
#pragma unroll
for (int r = 0; r < MAXR; ++r) {
  if (r < rows) {
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      float v = acc[r][c];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && col0 + c < N) y[(size_t)r * N + col0 + c] = v;
    }
  }
}
"""

CUDA_BF16 = CUDA_HEAD + """
const int chunks = (K % 8 == 0) ? K / 8 : 0;  // 16-byte loads need every row 16-byte aligned
for (int t = lane; t < chunks; t += 32) {
  float wv[COLS][8];
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int col = min(col0 + c, N - 1);  // a column past N repeats the last one; it is never stored
    const uint4 wraw = reinterpret_cast<const uint4*>(w + (size_t)col * K)[t];
    const __nv_bfloat16* wh = reinterpret_cast<const __nv_bfloat16*>(&wraw);
#pragma unroll
    for (int j = 0; j < 8; ++j) wv[c][j] = __bfloat162float(wh[j]);
  }
""" + CUDA_ROWS + """
// The inputs past the last whole chunk (all of them where K is not a multiple of 8), one at a time, in order.
for (int k = chunks * 8 + lane; k < K; k += 32) {
  float wk[COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) wk[c] = __bfloat162float(w[(size_t)min(col0 + c, N - 1) * K + k]);
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    if (r < rows) {
      const float xk = __bfloat162float(x[(size_t)r * K + k]);
#pragma unroll
      for (int c = 0; c < COLS; ++c) acc[r][c] = fmaf(xk, wk[c], acc[r][c]);
    }
  }
}
""" + CUDA_FOLD

CUDA_AFFINE = CUDA_HEAD + """
// MLX affine layout: BITS-bit values packed low bits first in uint32 words, one bf16 scale and bias per GROUP
// inputs; w = scale * q + bias in fp32. K is a multiple of GROUP, and GROUP of 8, so a chunk sits in one group.
const int words = K * BITS / 32;
const int per_row = K / GROUP;
const int chunks = K / 8;
for (int t = lane; t < chunks; t += 32) {
  float wv[COLS][8];
  const int g = (t * 8) / GROUP;
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int col = min(col0 + c, N - 1);  // a column past N repeats the last one; it is never stored
    const float s = __bfloat162float(scales[(size_t)col * per_row + g]);
    const float b = __bfloat162float(biases[(size_t)col * per_row + g]);
    if (BITS == 4) {
      const uint32_t q = wq[(size_t)col * words + t];
#pragma unroll
      for (int j = 0; j < 8; ++j) wv[c][j] = fmaf(s, (float)((q >> (4 * j)) & 15u), b);
    } else {
      const uint2 q = reinterpret_cast<const uint2*>(wq + (size_t)col * words)[t];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        wv[c][j] = fmaf(s, (float)((q.x >> (8 * j)) & 255u), b);
        wv[c][4 + j] = fmaf(s, (float)((q.y >> (8 * j)) & 255u), b);
      }
    }
  }
""" + CUDA_ROWS + CUDA_FOLD

METAL_BF16 = """
// One simdgroup per COLS output columns; lane l takes inputs l, l + 32, ...; each (row, column) is one chain
// of fp32 FMAs in input order, folded by a fixed xor tree and stored by lane 0: the same for any row count.
const int rows = dims[0];
const int N = dims[1];
const int K = dims[2];
const int lane = (int)simd_lane_id;
const int col0 = (int)(thread_position_in_grid.x / 32) * COLS;
if (col0 >= N) return;
float acc[MAXR][COLS];
for (int r = 0; r < MAXR; ++r) {
  for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
}
for (int k = lane; k < K; k += 32) {
  float wk[COLS];
  for (int c = 0; c < COLS; ++c) wk[c] = static_cast<float>(w[(size_t)metal::min(col0 + c, N - 1) * K + k]);
  for (int r = 0; r < MAXR; ++r) {
    if (r < rows) {
      const float xk = static_cast<float>(x[(size_t)r * K + k]);
      for (int c = 0; c < COLS; ++c) acc[r][c] = metal::fma(xk, wk[c], acc[r][c]);
    }
  }
}
for (int r = 0; r < MAXR; ++r) {
  if (r < rows) {
    for (int c = 0; c < COLS; ++c) {
      float v = acc[r][c];
      for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
      if (lane == 0 && col0 + c < N) y[(size_t)r * N + col0 + c] = v;
    }
  }
}
"""
