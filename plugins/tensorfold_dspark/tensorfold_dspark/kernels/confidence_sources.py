"""Kernel text of the DSpark confidence head: one group per draft row, a fixed-order fp32 dot, then the sigmoid."""

# Inputs: features [rows, width] and w [width] of type T, bias [1] of type T, dims = (rows, width). Output: out
# [rows] float32. Thread t sums features[j] * w[j] for j = t, t + group size, ... in order; each warp (simdgroup)
# folds its 32 partials with an xor tree, and the first warp folds the warp partials with the same tree (zeros
# past the last warp, which add exactly). Only the grid follows the row count, never the order of a row's sum.

CUDA = """
const int rows = dims[0];
const int width = dims[1];
const int row = blockIdx.x;
if (row >= rows) return;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const T* f = features + (size_t)row * width;
float acc = 0.0f;
for (int j = threadIdx.x; j < width; j += blockDim.x) {
  acc = fmaf(static_cast<float>(f[j]), static_cast<float>(w[j]), acc);
}
for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
__shared__ float part[32];
if (lane == 0) part[warp] = acc;
__syncthreads();
if (warp == 0) {
  float dot = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0) {
    const float logit = dot + static_cast<float>(bias[0]);
    out[row] = 1.0f / (1.0f + expf(-logit));
  }
}
"""

METAL = """
const int rows = dims[0];
const int width = dims[1];
const int row = (int)threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint n = threads_per_threadgroup.x;
threadgroup float part[32];
if (row >= rows) return;
float acc = 0.0f;
for (uint j = tid; j < (uint)width; j += n) {
  acc = metal::fma(static_cast<float>(features[(size_t)row * width + j]), static_cast<float>(w[j]), acc);
}
for (ushort o = 16; o > 0; o >>= 1) acc += simd_shuffle_xor(acc, o);
if (thread_index_in_simdgroup == 0) part[simdgroup_index_in_threadgroup] = acc;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (simdgroup_index_in_threadgroup == 0) {
  float dot = thread_index_in_simdgroup < n / 32 ? part[thread_index_in_simdgroup] : 0.0f;
  for (ushort o = 16; o > 0; o >>= 1) dot += simd_shuffle_xor(dot, o);
  if (thread_index_in_simdgroup == 0) {
    const float logit = dot + static_cast<float>(bias[0]);
    // precise: under fast math exp(-logit) past float32's range must still give inf (a confidence of 0), not junk
    out[row] = 1.0f / (1.0f + metal::precise::exp(-logit));
  }
}
"""
