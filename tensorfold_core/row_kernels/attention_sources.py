"""Kernel text of the fixed-split window attention: CUDA (mx.fast.cuda_kernel) and Metal (mx.fast.metal_kernel)."""

# Both bodies take q [rows, H, D], the cache's k and v [KV, C, D] (C: the buffer's capacity, which only sets the
# stride), scale [1] and dims [rows, H, KV, C, offset, window]; out [rows, H, D] is float32. Template constants:
# D (head dim, a multiple of 32), SPLIT (keys a split) and THREADS (threads a group, SPLIT of them: one per key).

CUDA = """
// One block per (row, head); thread t owns key t of each split. Row r sits at absolute position p = offset + r and
// attends keys lo..p (lo = 0, or p - window + 1 under a sliding window). The splits are the fixed key ranges
// [s*SPLIT, (s+1)*SPLIT) that hold those keys, taken in order: each split's max, sum of exp and weighted value sum
// in fp32, then folded into the running (M, L, O). Every loop bound and every fold order is a function of p alone,
// never of the row count or of how many keys the cache holds past p.
constexpr int WARPS = THREADS / 32;
constexpr int PARTS = THREADS / D;  // threads sharing one output element in the value sum
constexpr int PER = SPLIT / PARTS;  // keys each of them sums
const int rows = dims[0];
const int H = dims[1];
const int KV = dims[2];
const int C = dims[3];
const int offset = dims[4];
const int window = dims[5];
const int head = blockIdx.x;
const int row = blockIdx.y;
if (row >= rows || head >= H) return;
const int kvh = head / (H / KV);
const int p = offset + row;
const int lo = window > 0 ? max(0, p - window + 1) : 0;
const int tid = threadIdx.x;
const int lane = tid & 31;
const int warp = tid >> 5;
const float NEG_INF = __int_as_float(0xff800000);
__shared__ float wmax[WARPS];
__shared__ float wsum[WARPS];
__shared__ float ew[SPLIT];
__shared__ float part[THREADS];
float qr[D / 32];
#pragma unroll
for (int c = 0; c < D / 32; ++c) qr[c] = static_cast<float>(q[((size_t)row * H + head) * D + lane + 32 * c]) * scale[0];
const size_t kv0 = (size_t)kvh * C;
float M = NEG_INF, L = 0.0f, O = 0.0f;
for (int s = lo / SPLIT; s <= p / SPLIT; ++s) {
  const int base = s * SPLIT;
  // scores: warp w takes keys w*32 .. w*32+31 and its lanes split d; all the loads go out before the 32 fixed xor
  // trees; lane i keeps key i's score, -inf outside lo..p (where nothing is loaded: the cache may end there)
  float dots[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int j = base + warp * 32 + i;
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      const float kj = (j >= lo && j <= p) ? static_cast<float>(k[(kv0 + j) * D + lane + 32 * c]) : 0.0f;
      dot = fmaf(qr[c], kj, dot);
    }
    dots[i] = dot;
  }
  float sc = NEG_INF;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    float dot = dots[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == i) sc = dot;
  }
  if (base + tid < lo || base + tid > p) sc = NEG_INF;
  float m = sc;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) wmax[warp] = m;
  __syncthreads();
  float ms = wmax[0];
  for (int w = 1; w < WARPS; ++w) ms = fmaxf(ms, wmax[w]);
  const float e = expf(sc - ms);  // a key outside lo..p scores -inf and weighs 0; each split holds one inside
  ew[tid] = e;
  float l = e;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (lane == 0) wsum[warp] = l;
  __syncthreads();
  float ls = wsum[0];
  for (int w = 1; w < WARPS; ++w) ls += wsum[w];
  // weighted values: thread t sums element t % D over keys of part t / D in key order, the ones in lo..p only
  const int d = tid % D;
  const int j0 = (tid / D) * PER;
  float acc = 0.0f;
#pragma unroll 16
  for (int jj = 0; jj < PER; ++jj) {
    const int j = base + j0 + jj;
    if (j >= lo && j <= p) acc = fmaf(ew[j - base], static_cast<float>(v[(kv0 + j) * D + d]), acc);
  }
  part[tid] = acc;
  __syncthreads();
  const float mn = fmaxf(M, ms);
  const float alpha = expf(M - mn);
  const float beta = expf(ms - mn);
  if (tid < D) {
    float as = part[tid];
    for (int i = 1; i < PARTS; ++i) as += part[i * D + tid];
    O = fmaf(O, alpha, as * beta);
  }
  L = fmaf(L, alpha, ls * beta);
  M = mn;
  __syncthreads();  // wmax, wsum, ew and part are rewritten by the next split
}
if (tid < D) out[((size_t)row * H + head) * D + tid] = O / L;
"""

METAL = """
// One threadgroup per (row, head), the algorithm of the CUDA source step for step: thread t owns key t of each
// fixed split [s*SPLIT, (s+1)*SPLIT); scores by simdgroup with a fixed xor tree; split max, sum of exp and weighted
// value sum in fp32; splits folded in order into (M, L, O). Loop bounds and fold orders depend on p alone.
constexpr int WARPS = THREADS / 32;
constexpr int PARTS = THREADS / D;
constexpr int PER = SPLIT / PARTS;
const int rows = dims[0];
const int H = dims[1];
const int KV = dims[2];
const int C = dims[3];
const int offset = dims[4];
const int window = dims[5];
const int head = (int)threadgroup_position_in_grid.x;
const int row = (int)threadgroup_position_in_grid.y;
const int tid = (int)thread_position_in_threadgroup.x;
const int lane = (int)thread_index_in_simdgroup;
const int warp = (int)simdgroup_index_in_threadgroup;
threadgroup float wmax[WARPS];
threadgroup float wsum[WARPS];
threadgroup float ew[SPLIT];
threadgroup float part[THREADS];
if (row >= rows || head >= H) return;
const int kvh = head / (H / KV);
const int p = offset + row;
const int lo = window > 0 ? metal::max(0, p - window + 1) : 0;
float qr[D / 32];
for (int c = 0; c < D / 32; ++c) qr[c] = static_cast<float>(q[((size_t)row * H + head) * D + lane + 32 * c]) * scale[0];
const size_t kv0 = (size_t)kvh * C;
float M = -INFINITY, L = 0.0f, O = 0.0f;
for (int s = lo / SPLIT; s <= p / SPLIT; ++s) {
  const int base = s * SPLIT;
  float dots[32];
  for (int i = 0; i < 32; ++i) {
    const int j = base + warp * 32 + i;
    float dot = 0.0f;
    for (int c = 0; c < D / 32; ++c) {
      const float kj = (j >= lo && j <= p) ? static_cast<float>(k[(kv0 + j) * D + lane + 32 * c]) : 0.0f;
      dot = metal::fma(qr[c], kj, dot);
    }
    dots[i] = dot;
  }
  float sc = -INFINITY;
  for (int i = 0; i < 32; ++i) {
    float dot = dots[i];
    for (ushort o = 16; o > 0; o >>= 1) dot += simd_shuffle_xor(dot, o);
    if (lane == i) sc = dot;
  }
  if (base + tid < lo || base + tid > p) sc = -INFINITY;
  float m = sc;
  for (ushort o = 16; o > 0; o >>= 1) m = metal::fmax(m, simd_shuffle_xor(m, o));
  if (lane == 0) wmax[warp] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float ms = wmax[0];
  for (int w = 1; w < WARPS; ++w) ms = metal::fmax(ms, wmax[w]);
  const float e = metal::precise::exp(sc - ms);
  ew[tid] = e;
  float l = e;
  for (ushort o = 16; o > 0; o >>= 1) l += simd_shuffle_xor(l, o);
  if (lane == 0) wsum[warp] = l;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float ls = wsum[0];
  for (int w = 1; w < WARPS; ++w) ls += wsum[w];
  const int d = tid % D;
  const int j0 = (tid / D) * PER;
  float acc = 0.0f;
  for (int jj = 0; jj < PER; ++jj) {
    const int j = base + j0 + jj;
    if (j >= lo && j <= p) acc = metal::fma(ew[j - base], static_cast<float>(v[(kv0 + j) * D + d]), acc);
  }
  part[tid] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float mn = metal::fmax(M, ms);
  const float alpha = metal::precise::exp(M - mn);
  const float beta = metal::precise::exp(ms - mn);
  if (tid < D) {
    float as = part[tid];
    for (int i = 1; i < PARTS; ++i) as += part[i * D + tid];
    O = metal::fma(O, alpha, as * beta);
  }
  L = metal::fma(L, alpha, ls * beta);
  M = mn;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (tid < D) out[((size_t)row * H + head) * D + tid] = O / L;
"""
