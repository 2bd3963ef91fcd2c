"""Kernel text of the row-invariant multi-row GEMV: CUDA (bf16 on tensor cores, MLX affine 4/8-bit) and Metal (bf16)."""

# The bf16 kernel. Template constants: WARPS (the K split, fixed), MAXT (8-row tiles a block), MT (16-column tiles
# a warp), U (32-input steps whose loads go out together) and T (the output type). Only the geometry follows the row
# count; no (row, column) sum ever does.
import os

LOAD_ENV = "TENSORFOLD_GEMV_LOAD"  # a measurement: how the bf16 kernels' 16-byte loads ask for memory (read at import)
# The PTX of each flavour's 16-byte load ("plain" is C++'s own). A decode's weights stream from HBM once, and a warp's
# load reads 64 bytes of a weight row whose next 64 another warp reads: an L2 hint of 128 or 256 bytes has one DRAM
# access serve both. Only when bytes arrive changes, never a value or a sum.
LOADS = {"plain": "", "nc": "ld.global.nc.v4.u32", "l2-128": "ld.global.nc.L2::128B.v4.u32",
         "l2-256": "ld.global.nc.L2::256B.v4.u32"}
_PLAIN_LOAD = "if (k < K) return *reinterpret_cast<const uint4*>(a + (size_t)row * K + k);"


def bf16_header(load: str = "plain") -> str:
    """The bf16 kernels' shared header with its 16-byte loads as `load` (one of LOADS) asks."""
    if load not in LOADS:
        raise ValueError(f"{LOAD_ENV}={load!r}: expected one of {', '.join(LOADS)}")
    if not LOADS[load]:
        return _BF16_HEADER
    hinted = ("if (k < K) { uint4 v; asm(\"" + LOADS[load] + " {%0, %1, %2, %3}, [%4];\" : \"=r\"(v.x), "
              "\"=r\"(v.y), \"=r\"(v.z), \"=r\"(v.w) : \"l\"(a + (size_t)row * K + k)); return v; }")
    return _BF16_HEADER.replace(_PLAIN_LOAD, hinted)


_BF16_HEADER = """
// 8 consecutive bf16 of row `row` from input k on (16 bytes), zeros past K; one 16-byte load where rows are aligned
__device__ __forceinline__ uint4 tf_load8(const __nv_bfloat16* a, int row, int k, int K, bool vec) {
  if (vec) {
    if (k < K) return *reinterpret_cast<const uint4*>(a + (size_t)row * K + k);
    return make_uint4(0u, 0u, 0u, 0u);
  }
  const unsigned short* h = reinterpret_cast<const unsigned short*>(a) + (size_t)row * K;
  unsigned int v[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const unsigned int lo = (k + 2 * e < K) ? h[k + 2 * e] : 0u;
    const unsigned int hi = (k + 2 * e + 1 < K) ? h[k + 2 * e + 1] : 0u;
    v[e] = lo | (hi << 16);
  }
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// d += a b on the tensor cores: a 16x16 bf16 tile of weights, b 16x8 of inputs, d 16x8 in fp32
__device__ __forceinline__ void tf_mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                       unsigned int b0, unsigned int b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""
CUDA_BF16_HEADER = bf16_header(os.environ.get(LOAD_ENV, "plain"))

CUDA_BF16 = """
// y[r, n] = sum_k x[r, k] w[n, k] for any number of rows, the weights read once per 8*MAXT rows.
// K is cut into 32-input steps; warp w of a block takes steps w, w + WARPS, ... (a split fixed by K alone). In a step,
// lane (g = lane / 4, t = lane % 4) loads inputs 8t..8t+7 of weight rows g and g + 8 of each 16-column tile and of
// x row g of each 8-row tile, and two m16n8k16 mma add them into fp32 tiles (inputs 8t..8t+3, then 8t+4..8t+7: the
// same permutation of k on both sides). An output of the tensor cores depends on its own weight row, x row and
// accumulator alone, so each (row, column) is one chain over the warp's steps in order, whatever shares its tile;
// the WARPS chains are then added in warp order. The row count picks MAXT, MT and the grid, never a sum's order.
const int rows = dims[0];
const int N = dims[1];
const int K = dims[2];
constexpr int RB = 8 * MAXT;  // rows a block
constexpr int CB = 16 * MT;  // columns a block
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int row_blocks = (rows + RB - 1) / RB;
// neighbouring blocks share their columns (row blocks vary fastest), so the weights they re-read come from L2
const int row0 = (int)(blockIdx.x % row_blocks) * RB;
const int col0 = (int)(blockIdx.x / row_blocks) * CB;
if (col0 >= N) return;
const bool vec = (K % 8) == 0;  // 16-byte loads need every row 16-byte aligned
const int steps = (K + 31) / 32;
float acc[MT][MAXT][4];
#pragma unroll
for (int m = 0; m < MT; ++m) {
#pragma unroll
  for (int j = 0; j < MAXT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;
  }
}
for (int s0 = warp; s0 < steps; s0 += WARPS * U) {
  uint4 wa[U][MT], wb[U][MT];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = (s0 + u * WARPS) * 32 + 8 * t;  // past K (a step past the last) loads zeros
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      // a column past N repeats the last one; it is never stored
      wa[u][m] = tf_load8(w, min(col0 + 16 * m + g, N - 1), k, K, vec);
      wb[u][m] = tf_load8(w, min(col0 + 16 * m + g + 8, N - 1), k, K, vec);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (s0 + u * WARPS < steps) {
      const int k = (s0 + u * WARPS) * 32 + 8 * t;
      // every row tile's inputs asked for before the first mma, so a deep tile waits on its x loads once a step
      uint4 xb[MAXT];
#pragma unroll
      for (int j = 0; j < MAXT; ++j) {
        const int r = row0 + 8 * j + g;
        xb[j] = r < rows ? tf_load8(x, r, k, K, vec) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int j = 0; j < MAXT; ++j) {
        if (row0 + 8 * j < rows) {
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            tf_mma(acc[m][j], wa[u][m].x, wb[u][m].x, wa[u][m].y, wb[u][m].y, xb[j].x, xb[j].y);
            tf_mma(acc[m][j], wa[u][m].z, wb[u][m].z, wa[u][m].w, wb[u][m].w, xb[j].z, xb[j].w);
          }
        }
      }
    }
  }
}
// the warps' chains, added in warp order: accumulator e of lane (g, t) holds column g + 8 (e / 2), row 2t + e % 2
__shared__ float part[WARPS][RB][16];
#pragma unroll
for (int m = 0; m < MT; ++m) {
#pragma unroll
  for (int j = 0; j < MAXT; ++j) {
    if (row0 + 8 * j < rows) {
#pragma unroll
      for (int e = 0; e < 4; ++e) part[warp][8 * j + 2 * t + (e & 1)][g + 8 * (e >> 1)] = acc[m][j][e];
    }
  }
  __syncthreads();
  for (int o = threadIdx.x; o < RB * 16; o += WARPS * 32) {
    const int row = row0 + o / 16;
    const int col = col0 + 16 * m + o % 16;
    if (row < rows && col < N) {
      float v = part[0][o / 16][o % 16];
      for (int p = 1; p < WARPS; ++p) v += part[p][o / 16][o % 16];
      y[(size_t)row * N + col] = static_cast<T>(v);
    }
  }
  __syncthreads();
}
"""

# The affine kernel, shared by every CUDA variant: which warp owns which rows and columns, the accumulators, the fold
# and the store.
CUDA_HEAD = """
// Multi-row GEMV y[r, n] = sum_k x[r, k] * w[n, k], any number of rows in groups of MAXR: the weights are read once
// a group. One warp per COLS output columns of one row group; lane l takes the 8-input chunks l, l + 32, ...; each
// (row, column) is one chain of fp32 FMAs in chunk order, folded across lanes by a fixed xor tree and stored by lane
// 0. More rows only repeat that chain, so a row's result is the same in a call of any row count.
const int N = dims[1];
const int K = dims[2];
const int row_groups = (dims[0] + MAXR - 1) / MAXR;
const int lane = threadIdx.x & 31;
const int gw = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
// neighbouring warps share their columns (row groups vary fastest), so the weights they re-read come from L2
const int row0 = (gw % row_groups) * MAXR;
const int col0 = (gw / row_groups) * COLS;
if (col0 >= N) return;
const int rows = min(MAXR, dims[0] - row0);
x += (size_t)row0 * K;
y += (size_t)row0 * N;
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
      if (lane == 0 && col0 + c < N) y[(size_t)r * N + col0 + c] = static_cast<T>(v);
    }
  }
}
"""

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
// The CUDA bf16 kernel's decomposition with simdgroup FMAs in place of tensor-core tiles: K in 32-input steps, step s
// to simdgroup s % WARPS of the threadgroup; lane l takes input 32 s + l, each (row, column) one fp32 chain over the
// simdgroup's steps in order, folded across lanes by a fixed xor tree, then the WARPS chains added in simdgroup
// order. Rows come in blocks of 8 * MAXT and columns in blocks of 16 * MT: the geometry follows the row count, no
// sum's order does.
constexpr int RB = 8 * MAXT;
constexpr int CB = 16 * MT;
const int rows = dims[0];
const int N = dims[1];
const int K = dims[2];
const int lane = (int)thread_index_in_simdgroup;
const int warp = (int)simdgroup_index_in_threadgroup;
const int row_blocks = (rows + RB - 1) / RB;
const int row0 = (int)(threadgroup_position_in_grid.x % row_blocks) * RB;
const int col0 = (int)(threadgroup_position_in_grid.x / row_blocks) * CB;
threadgroup float part[WARPS][RB][16];
if (col0 >= N) return;
const int steps = (K + 31) / 32;
for (int m = 0; m < MT; ++m) {
  for (int r0 = 0; r0 < RB; r0 += 8) {
    if (row0 + r0 < rows) {
      float acc[8][16];
      for (int r = 0; r < 8; ++r) {
        for (int c = 0; c < 16; ++c) acc[r][c] = 0.0f;
      }
      for (int s = warp; s < steps; s += WARPS) {
        const int k = s * 32 + lane;
        float wk[16];
        for (int c = 0; c < 16; ++c) {
          const int col = metal::min(col0 + 16 * m + c, N - 1);
          wk[c] = k < K ? static_cast<float>(w[(size_t)col * K + k]) : 0.0f;
        }
        for (int r = 0; r < 8; ++r) {
          const int row = row0 + r0 + r;
          const float xk = (row < rows && k < K) ? static_cast<float>(x[(size_t)row * K + k]) : 0.0f;
          for (int c = 0; c < 16; ++c) acc[r][c] = metal::fma(xk, wk[c], acc[r][c]);
        }
      }
      for (int r = 0; r < 8; ++r) {
        for (int c = 0; c < 16; ++c) {
          float v = acc[r][c];
          for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
          if (lane == 0) part[warp][r0 + r][c] = v;
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int o = (int)thread_position_in_threadgroup.x; o < RB * 16; o += WARPS * 32) {
    const int row = row0 + o / 16;
    const int col = col0 + 16 * m + o % 16;
    if (row < rows && col < N) {
      float v = part[0][o / 16][o % 16];
      for (int p = 1; p < WARPS; ++p) v += part[p][o / 16][o % 16];
      y[(size_t)row * N + col] = static_cast<T>(v);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
"""

METAL_AFFINE = """
// The CUDA affine kernel's decomposition: one simdgroup per COLS output columns of one row group of MAXR rows; lane
// l takes the 8-input chunks l, l + 32, ...; each (row, column) one fp32 chain of FMAs in chunk order, each weight
// scale * q + bias in fp32 as the CUDA kernel forms it, folded across lanes by the same xor tree. MLX's affine layout:
// BITS-bit values packed low bits first in uint32 words, one bf16 scale and bias per GROUP inputs; K is a multiple of
// GROUP, and GROUP of 8, so a chunk sits in one group.
const int N = dims[1];
const int K = dims[2];
const int row_groups = (dims[0] + MAXR - 1) / MAXR;
const int lane = (int)thread_index_in_simdgroup;
// simdgroups in grid order, as the CUDA kernel counts its warps: neighbours share their columns (row groups vary
// fastest), so the weights they re-read come from the cache
const int per_group = (int)threads_per_threadgroup.x / 32;
const int gw = (int)threadgroup_position_in_grid.x * per_group + (int)simdgroup_index_in_threadgroup;
const int row0 = (gw % row_groups) * MAXR;
const int col0 = (gw / row_groups) * COLS;
if (col0 >= N) return;
const int rows = metal::min(MAXR, dims[0] - row0);
const int words = K * BITS / 32;
const int per_row = K / GROUP;
const int chunks = K / 8;
float acc[MAXR][COLS];
for (int r = 0; r < MAXR; ++r) {
  for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
}
for (int t = lane; t < chunks; t += 32) {
  float wv[COLS][8];
  const int g = (t * 8) / GROUP;
  for (int c = 0; c < COLS; ++c) {
    const int col = metal::min(col0 + c, N - 1);  // a column past N repeats the last one; it is never stored
    const float s = static_cast<float>(scales[(size_t)col * per_row + g]);
    const float b = static_cast<float>(biases[(size_t)col * per_row + g]);
    if (BITS == 4) {
      const uint q = wq[(size_t)col * words + t];
      for (int j = 0; j < 8; ++j) wv[c][j] = metal::fma(s, (float)((q >> (4 * j)) & 15u), b);
    } else {
      const uint2 q = ((const device uint2*)(wq + (size_t)col * words))[t];
      for (int j = 0; j < 4; ++j) {
        wv[c][j] = metal::fma(s, (float)((q.x >> (8 * j)) & 255u), b);
        wv[c][4 + j] = metal::fma(s, (float)((q.y >> (8 * j)) & 255u), b);
      }
    }
  }
  // rows to MAXR with a test, not to `rows`: a bound the compiler knows keeps acc in registers
  for (int r = 0; r < MAXR; ++r) {
    if (r < rows) {
      for (int j = 0; j < 8; ++j) {
        const float xv = static_cast<float>(x[(size_t)(row0 + r) * K + t * 8 + j]);
        for (int c = 0; c < COLS; ++c) acc[r][c] = metal::fma(xv, wv[c][j], acc[r][c]);
      }
    }
  }
}
for (int r = 0; r < MAXR; ++r) {
  if (r < rows) {
    for (int c = 0; c < COLS; ++c) {
      float v = acc[r][c];
      for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
      if (lane == 0 && col0 + c < N) y[(size_t)(row0 + r) * N + col0 + c] = static_cast<T>(v);
    }
  }
}
"""
