"""Kernel text of the DSpark block attention: CUDA (mx.fast.cuda_kernel) and Metal (mx.fast.metal_kernel)."""

# Both bodies take q [rows, H, D], the lane's context_keys and context_values [KV, C, D] (C: the buffer's capacity,
# which only sets the stride; keys past n are never read), the block's block_keys and block_values [KV, B, D], scale
# [1] and dims [rows, H, KV, C, n, B]; out [rows, H, D] is float32. Template constants: D (head dim, a multiple of 32
# dividing SPLIT), SPLIT (keys a split, one thread each) and GROUPS (splits a block runs side by side).

def _values(fma: str) -> str:
    """The value loop's text: the context's keys jb..jm-1, then the block's jm..je-1, in chunks of 16 keys whose loads
    all go out before the chunk's first sum (a whole chunk unpredicated; a short one loads nothing past its end)."""
    runs = (("context_values + c0 * D + d", "jb", "jm", "j"), ("block_values + b0 * D + d", "jm", "je", "j - n"))
    text = ""
    for pointer, start, stop, key in runs:
        text += f"""  {{
    const auto vd = {pointer};
    for (int j16 = {start}; j16 < {stop}; j16 += 16) {{
      float vs[16];
      if (j16 + 16 <= {stop}) {{
#pragma unroll
        for (int i = 0; i < 16; ++i) {{ const int j = j16 + i; vs[i] = static_cast<float>(vd[(size_t)({key}) * D]); }}
      }} else {{
#pragma unroll
        for (int i = 0; i < 16; ++i) {{
          const int j = j16 + i;
          vs[i] = j < {stop} ? static_cast<float>(vd[(size_t)({key}) * D]) : 0.0f;
        }}
      }}
#pragma unroll
      for (int i = 0; i < 16; ++i) {{
        if (j16 + i < {stop}) acc = {fma}(ew[g][j16 + i - base], vs[i], acc);
      }}
    }}
  }}
"""
    return text



CUDA = """
// One block per (row, head): GROUPS groups of SPLIT threads, thread t of a group owning key t of its split. Every row
// of the block attends the same T = n + B keys, both ways: key j < n is context key j, key j >= n block key j - n.
// The splits are the fixed ranges [s*SPLIT, (s+1)*SPLIT) of 0..T-1, taken GROUPS at a time, group g the g-th of each
// round: each split's max, sum of exp and weighted value sum in fp32, staged in shared memory, then folded in split
// order into the running (M, L, O). Every loop bound and fold order is a function of n and B alone, never of the row
// count or of the context buffer's capacity; the groups only let splits run side by side.
constexpr int WARPS = SPLIT / 32;  // warps a group
constexpr int PARTS = SPLIT / D;  // threads of a group sharing one output element in the value sum
constexpr int PER = SPLIT / PARTS;  // keys each of them sums
const int rows = dims[0];
const int H = dims[1];
const int KV = dims[2];
const int C = dims[3];
const int n = dims[4];
const int B = dims[5];
const int head = blockIdx.x;
const int row = blockIdx.y;
if (row >= rows || head >= H) return;
const int kvh = head / (H / KV);
const int T = n + B;
const int tid = threadIdx.x;
const int g = tid / SPLIT;
const int t = tid % SPLIT;
const int lane = t & 31;
const int warp = t >> 5;
const float NEG_INF = __int_as_float(0xff800000);
__shared__ float wmax[GROUPS][WARPS];
__shared__ float wsum[GROUPS][WARPS];
__shared__ float ew[GROUPS][SPLIT];
__shared__ float part[GROUPS][SPLIT];
__shared__ float smax[GROUPS];
__shared__ float ssum[GROUPS];
__shared__ float sval[GROUPS][D];
float qr[D / 32];
#pragma unroll
for (int c = 0; c < D / 32; ++c) qr[c] = static_cast<float>(q[((size_t)row * H + head) * D + lane + 32 * c]) * scale[0];
const size_t c0 = (size_t)kvh * C;  // the kv head's context key 0
const size_t b0 = (size_t)kvh * B;  // and its block key 0
const int last = (T - 1) / SPLIT;
float M = NEG_INF, L = 0.0f, O = 0.0f;
for (int first = 0; first <= last; first += GROUPS) {
  // a group past the last split holds no key: it loads nothing, and its result is never folded
  const int base = (first + g) * SPLIT;
  // scores: warp w takes keys w*32 .. w*32+31 and its lanes split d; all the loads go out before the 32 fixed xor
  // trees; lane i keeps key i's score, -inf past T. A key past T adds 0 and loads key T - 1 instead (the buffers may
  // end there), its row's pointer chosen by a select: every load is in bounds and unconditional, so none waits on
  // another's use; a warp with no key before T loads nothing
  float dots[32];
  const int wbase = base + warp * 32;
  const bool keyed = wbase < T;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int j = wbase + i;
    const int jk = min(j, T - 1);
    const auto krow = jk < n ? context_keys + (c0 + jk) * D : block_keys + (b0 + jk - n) * D;
    const bool in = j < T;
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      const float kj = keyed ? static_cast<float>(krow[lane + 32 * c]) : 0.0f;
      dot = fmaf(qr[c], in ? kj : 0.0f, dot);
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
  if (base + t >= T) sc = NEG_INF;
  float m = sc;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) wmax[g][warp] = m;
  __syncthreads();
  float ms = wmax[g][0];
  for (int w = 1; w < WARPS; ++w) ms = fmaxf(ms, wmax[g][w]);
  const float e = expf(sc - ms);  // a key past T scores -inf and weighs 0; each split folded holds one before T
  ew[g][t] = e;
  float l = e;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (lane == 0) wsum[g][warp] = l;
  __syncthreads();
  float ls = wsum[g][0];
  for (int w = 1; w < WARPS; ++w) ls += wsum[g][w];
  // weighted values: thread t sums element t % D over keys jb..je-1 of part t / D in key order (those before T): the
  // context's keys jb..jm-1, then the block's jm..je-1, each run from one base pointer at a fixed stride
  const int d = t % D;
  const int jb = base + (t / D) * PER;
  const int je = min(jb + PER, T);
  const int jm = min(max(jb, n), je);
  float acc = 0.0f;
VALUES  part[g][t] = acc;
  __syncthreads();
  if (t < D) {
    float as = part[g][t];
    for (int i = 1; i < PARTS; ++i) as += part[g][i * D + t];
    sval[g][t] = as;
  }
  if (t == 0) {
    smax[g] = ms;
    ssum[g] = ls;
  }
  __syncthreads();
  if (tid < D) {  // the round's splits folded in split order
    for (int h = 0; h < GROUPS && first + h <= last; ++h) {
      const float mh = smax[h];
      const float mn = fmaxf(M, mh);
      const float alpha = expf(M - mn);
      const float beta = expf(mh - mn);
      O = fmaf(O, alpha, sval[h][tid] * beta);
      L = fmaf(L, alpha, ssum[h] * beta);
      M = mn;
    }
  }
  __syncthreads();  // every staged array is rewritten by the next round
}
if (tid < D) out[((size_t)row * H + head) * D + tid] = O / L;
"""

METAL = """
// One threadgroup per (row, head), the algorithm of the CUDA source step for step: GROUPS groups of SPLIT threads,
// thread t of a group owning key t of its split; the T = n + B keys of the block (context keys 0..n-1, then the block's
// own) cut into the fixed splits [s*SPLIT, (s+1)*SPLIT), taken GROUPS at a time; scores by simdgroup with a fixed xor
// tree; split max, sum of exp and weighted value sum in fp32, staged, then folded in split order into (M, L, O). Loop
// bounds and fold orders depend on n and B alone.
constexpr int WARPS = SPLIT / 32;
constexpr int PARTS = SPLIT / D;
constexpr int PER = SPLIT / PARTS;
const int rows = dims[0];
const int H = dims[1];
const int KV = dims[2];
const int C = dims[3];
const int n = dims[4];
const int B = dims[5];
const int head = (int)threadgroup_position_in_grid.x;
const int row = (int)threadgroup_position_in_grid.y;
const int tid = (int)thread_position_in_threadgroup.x;
const int g = tid / SPLIT;
const int t = tid % SPLIT;
const int lane = (int)thread_index_in_simdgroup;
const int warp = t / 32;
threadgroup float wmax[GROUPS][WARPS];
threadgroup float wsum[GROUPS][WARPS];
threadgroup float ew[GROUPS][SPLIT];
threadgroup float part[GROUPS][SPLIT];
threadgroup float smax[GROUPS];
threadgroup float ssum[GROUPS];
threadgroup float sval[GROUPS][D];
if (row >= rows || head >= H) return;
const int kvh = head / (H / KV);
const int T = n + B;
float qr[D / 32];
for (int c = 0; c < D / 32; ++c) qr[c] = static_cast<float>(q[((size_t)row * H + head) * D + lane + 32 * c]) * scale[0];
const size_t c0 = (size_t)kvh * C;
const size_t b0 = (size_t)kvh * B;
const int last = (T - 1) / SPLIT;
float M = -INFINITY, L = 0.0f, O = 0.0f;
for (int first = 0; first <= last; first += GROUPS) {
  const int base = (first + g) * SPLIT;
  float dots[32];
  const int wbase = base + warp * 32;
  const bool keyed = wbase < T;
  for (int i = 0; i < 32; ++i) {
    const int j = wbase + i;
    const int jk = metal::min(j, T - 1);
    const auto krow = jk < n ? context_keys + (c0 + jk) * D : block_keys + (b0 + jk - n) * D;
    const bool in = j < T;
    float dot = 0.0f;
    for (int c = 0; c < D / 32; ++c) {
      const float kj = keyed ? static_cast<float>(krow[lane + 32 * c]) : 0.0f;
      dot = metal::fma(qr[c], in ? kj : 0.0f, dot);
    }
    dots[i] = dot;
  }
  float sc = -INFINITY;
  for (int i = 0; i < 32; ++i) {
    float dot = dots[i];
    for (ushort o = 16; o > 0; o >>= 1) dot += simd_shuffle_xor(dot, o);
    if (lane == i) sc = dot;
  }
  if (base + t >= T) sc = -INFINITY;
  float m = sc;
  for (ushort o = 16; o > 0; o >>= 1) m = metal::fmax(m, simd_shuffle_xor(m, o));
  if (lane == 0) wmax[g][warp] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float ms = wmax[g][0];
  for (int w = 1; w < WARPS; ++w) ms = metal::fmax(ms, wmax[g][w]);
  const float e = metal::precise::exp(sc - ms);
  ew[g][t] = e;
  float l = e;
  for (ushort o = 16; o > 0; o >>= 1) l += simd_shuffle_xor(l, o);
  if (lane == 0) wsum[g][warp] = l;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float ls = wsum[g][0];
  for (int w = 1; w < WARPS; ++w) ls += wsum[g][w];
  const int d = t % D;
  const int jb = base + (t / D) * PER;
  const int je = metal::min(jb + PER, T);
  const int jm = metal::min(metal::max(jb, n), je);
  float acc = 0.0f;
VALUES  part[g][t] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t < D) {
    float as = part[g][t];
    for (int i = 1; i < PARTS; ++i) as += part[g][i * D + t];
    sval[g][t] = as;
  }
  if (t == 0) {
    smax[g] = ms;
    ssum[g] = ls;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < D) {
    for (int h = 0; h < GROUPS && first + h <= last; ++h) {
      const float mh = smax[h];
      const float mn = metal::fmax(M, mh);
      const float alpha = metal::precise::exp(M - mn);
      const float beta = metal::precise::exp(mh - mn);
      O = metal::fma(O, alpha, sval[h][tid] * beta);
      L = metal::fma(L, alpha, ssum[h] * beta);
      M = mn;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (tid < D) out[((size_t)row * H + head) * D + tid] = O / L;
"""

CUDA = CUDA.replace("VALUES", _values("fmaf"))
METAL = METAL.replace("VALUES", _values("metal::fma"))
