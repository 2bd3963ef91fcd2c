"""Kernel text of the fixed-split window attention: CUDA (mx.fast.cuda_kernel) and Metal (mx.fast.metal_kernel)."""

# Both bodies take q [rows, H, D], the cache's k and v [KV, C, D] (C: the buffer's capacity, which only sets the
# stride), scale [1] and dims [rows, H, KV, C, offset, window]; out [rows, H, D] is float32. Template constants:
# D (head dim, a multiple of 32 dividing SPLIT), SPLIT (keys a split, one thread each) and GROUPS (splits a block
# runs side by side: its threads are GROUPS * SPLIT); the CUDA body's KC and VC, the 16-byte key loads and the value
# loads a thread issues together (how many loads are in flight, never the order of a sum).

from tensorfold_contract.kernel_text import select_chain

CUDA = """
// One block per (row, head): GROUPS groups of SPLIT threads, thread t of a group owning key t of its split. Row r sits
// at absolute position p = offset + r and attends keys lo..p (lo = 0, or p - window + 1 under a sliding window). The
// splits are the fixed key ranges [s*SPLIT, (s+1)*SPLIT) that hold those keys, taken GROUPS at a time, group g the
// g-th of each round: each split's max, sum of exp and weighted value sum in fp32, staged in shared memory, then
// folded in split order into the running (M, L, O). Every loop bound and every fold order is a function of p alone,
// never of the row count or of how many keys the cache holds past p; the groups only let splits run side by side.
constexpr int WARPS = SPLIT / 32;  // warps a group
constexpr int PARTS = SPLIT / D;  // threads of a group sharing one output element in the value sum
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
__shared__ float qs[D];
for (int c = tid; c < D; c += GROUPS * SPLIT) qs[c] = static_cast<float>(q[((size_t)row * H + head) * D + c]) * scale[0];
__syncthreads();
const size_t kv0 = (size_t)kvh * C;
const int last = p / SPLIT;
float M = NEG_INF, L = 0.0f, O = 0.0f;
for (int first = lo / SPLIT; first <= last; first += GROUPS) {
  // a group past the last split holds no key of the row: it loads nothing, and its result is never folded
  const int base = (first + g) * SPLIT;
  // scores: thread t owns key base + t and sums its dot product over d = 0..D-1 in order, q read from shared memory
  // (no cross-lane sums: a short loop, so the kernel's code stays small); a key outside lo..p loads key
  // min(max(j, lo), p) instead and is masked below (the cache may end at p); a warp with no key of the row loads nothing
  const int wbase = base + warp * 32;
  const bool keyed = wbase <= p && wbase + 31 >= lo;
  const int j = base + t;
  const auto krow = k + (kv0 + min(max(j, lo), p)) * D;
  float sc = 0.0f;
  if (keyed) {  // the key's row in 16-byte loads, up to KC in flight at once, summed in order c = 0..D-1
    constexpr int VEC = 16 / sizeof(krow[0]);
    constexpr int CHUNK = D / VEC < KC ? D / VEC : KC;
    const uint4* kvec = reinterpret_cast<const uint4*>(krow);  // a row starts D elements in: 16-byte aligned
#pragma unroll
    for (int c0 = 0; c0 < D / VEC; c0 += CHUNK) {
      uint4 raw[CHUNK];
#pragma unroll
      for (int i = 0; i < CHUNK; ++i) raw[i] = kvec[c0 + i];
      const auto kc0 = reinterpret_cast<decltype(&krow[0])>(raw);
#pragma unroll
      for (int c = 0; c < CHUNK * VEC; ++c) sc = fmaf(qs[c0 * VEC + c], static_cast<float>(kc0[c]), sc);
    }
  }
  if (base + t < lo || base + t > p) sc = NEG_INF;
  float m = sc;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) wmax[g][warp] = m;
  __syncthreads();
  float ms = wmax[g][0];
  for (int w = 1; w < WARPS; ++w) ms = fmaxf(ms, wmax[g][w]);
  const float e = expf(sc - ms);  // a key outside lo..p scores -inf and weighs 0; each split folded holds one inside
  ew[g][t] = e;
  float l = e;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (lane == 0) wsum[g][warp] = l;
  __syncthreads();
  float ls = wsum[g][0];
  for (int w = 1; w < WARPS; ++w) ls += wsum[g][w];
  // weighted values: thread t sums element t % D over keys jb..je-1 of part t / D in key order (the part's keys in
  // lo..p). One base pointer and a fixed stride, no branch between keys: the unrolled loop issues its loads together
  const int d = t % D;
  const int jb = max(base + (t / D) * PER, lo);
  const int je = min(base + (t / D) * PER + PER, p + 1);
  float acc = 0.0f;
  {
    const auto vd = v + kv0 * D + d;
    for (int j16 = jb; j16 < je; j16 += VC) {
      float vs[VC];  // a chunk's loads first (keys past je load nothing), so all VC are in flight before the first sum
      if (j16 + VC <= je) {  // a whole chunk: no predicate per load
#pragma unroll
        for (int i = 0; i < VC; ++i) vs[i] = static_cast<float>(vd[(size_t)(j16 + i) * D]);
      } else {
#pragma unroll
        for (int i = 0; i < VC; ++i) vs[i] = j16 + i < je ? static_cast<float>(vd[(size_t)(j16 + i) * D]) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < VC; ++i) {
        const int j = j16 + i;
        const float vj = vs[i];
        if (j < je) acc = fmaf(ew[g][j - base], vj, acc);
      }
    }
  }
  part[g][t] = acc;
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
// thread t of a group owning key t of its split; the fixed splits [s*SPLIT, (s+1)*SPLIT) that hold the row's keys
// taken GROUPS at a time; each key's score summed by its own thread over d in order; split max, sum of exp and weighted value sum in
// fp32, staged, then folded in split order into (M, L, O). Loop bounds and fold orders depend on p alone.
constexpr int WARPS = SPLIT / 32;
constexpr int PARTS = SPLIT / D;
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
threadgroup float qs[D];
if (row >= rows || head >= H) return;
const int kvh = head / (H / KV);
const int p = offset + row;
const int lo = window > 0 ? metal::max(0, p - window + 1) : 0;
for (int c = tid; c < D; c += GROUPS * SPLIT) qs[c] = static_cast<float>(q[((size_t)row * H + head) * D + c]) * scale[0];
threadgroup_barrier(mem_flags::mem_threadgroup);
const size_t kv0 = (size_t)kvh * C;
const int last = p / SPLIT;
float M = -INFINITY, L = 0.0f, O = 0.0f;
for (int first = lo / SPLIT; first <= last; first += GROUPS) {
  const int base = (first + g) * SPLIT;
  const int wbase = base + warp * 32;
  const bool keyed = wbase <= p && wbase + 31 >= lo;
  const int j = base + t;
  const auto krow = k + (kv0 + metal::min(metal::max(j, lo), p)) * D;
  float sc = 0.0f;
  if (keyed) {
    for (int c = 0; c < D; ++c) sc = metal::fma(qs[c], static_cast<float>(krow[c]), sc);
  }
  if (base + t < lo || base + t > p) sc = -INFINITY;
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
  const int jb = metal::max(base + (t / D) * PER, lo);
  const int je = metal::min(base + (t / D) * PER + PER, p + 1);
  float acc = 0.0f;
  {
    const auto vd = v + kv0 * D + d;
    for (int j16 = jb; j16 < je; j16 += 16) {
      float vs[16];  // a chunk's loads first (keys past je load nothing), so all 16 are in flight before the first sum
      if (j16 + 16 <= je) {  // a whole chunk: no predicate per load
        for (int i = 0; i < 16; ++i) vs[i] = static_cast<float>(vd[(size_t)(j16 + i) * D]);
      } else {
        for (int i = 0; i < 16; ++i) vs[i] = j16 + i < je ? static_cast<float>(vd[(size_t)(j16 + i) * D]) : 0.0f;
      }
      for (int i = 0; i < 16; ++i) {
        const int j = j16 + i;
        const float vj = vs[i];
        if (j < je) acc = metal::fma(ew[g][j - base], vj, acc);
      }
    }
  }
  part[g][t] = acc;
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


# The packed-streams form: one launch for every stream's window of a forward. The body above, row for row, but row r
# takes its stream's slot, position p and the packed index of its window's first row from rowmap [rows, 3]; keys and
# values before the window's first position come from the stream's cache, a whole [layers, KV, C, D] buffer (slot s
# is the input pair k<s>, v<s>; dims [rows, H, KV, layer, window, C0, ..., C7]); the window's own keys and values
# from the packed kn, vn [rows, KV, D], so the caches are written once a forward, after the last layer. The keys read
# and the order every sum runs in are the body's: a row's result is the one the single-stream call gives.
STREAM_SLOTS = 8  # streams one launch takes; a forward with more launches once per 8


def _streams(body: str, ns: str = "") -> str:
    """The single-stream body with its position prologue and its key and value loads replaced (`ns`: the namespace of
    min and max in the body's language)."""
    edits = [
        ("const int C = dims[3];\nconst int offset = dims[4];\nconst int window = dims[5];\n",
         "const int layer = dims[3];\nconst int window = dims[4];\n"),
        ("const int p = offset + row;\n",
         "const int slot = rowmap[3 * row];\nconst int p = rowmap[3 * row + 1];\n"
         "const int wrow = rowmap[3 * row + 2];  // the packed index of the window's first row\n"
         "const int off = p - (row - wrow);  // the window's first position: keys from here on are packed rows\n"
         "const int C = dims[5 + slot];\n"
         f"const auto kc = {select_chain('slot', 'k', STREAM_SLOTS)};\n"
         f"const auto vc = {select_chain('slot', 'v', STREAM_SLOTS)};\n"),
        ("const size_t kv0 = (size_t)kvh * C;",
         "const size_t kv0 = ((size_t)layer * KV + kvh) * C;\n"
         "const size_t kn0 = (size_t)kvh * D;  // key j >= off of the row's stream: packed row wrow + j - off"),
        # the row's pointer chosen by a select, then one load: neither side is loaded past its end
        (f"const auto krow = k + (kv0 + {ns}min({ns}max(j, lo), p)) * D;",
         f"const int jk = {ns}min({ns}max(j, lo), p);\n"
         "    const auto krow = jk < off ? kc + (kv0 + jk) * D : kn + (size_t)(wrow + jk - off) * KV * D + kn0;"),
    ]
    for old, new in edits:
        if body.count(old) != 1:
            raise ValueError(f"the attention body holds {old!r} {body.count(old)} times, expected once")
        body = body.replace(old, new)
    return ("// The packed-streams form: row r's stream, position and window from rowmap (attention_sources.py)\n"
            + _split_value_loop(body, ns))


def _split_value_loop(body: str, ns: str) -> str:
    """The value loop run twice in key order: the cache's keys jb..jm-1, then the window's packed rows jm..je-1; each
    half keeps one base pointer and a fixed stride, so its loads still issue together."""
    start = body.find("  {\n    const auto vd = v + kv0 * D + d;\n")
    end = body.find("\n  }\n", start) + len("\n  }\n")
    loop = body[start:end]
    cache_edits = [("vd = v + kv0", "vd = vc + kv0"), ("je", "jm")]
    window_edits = [("vd = v + kv0 * D + d", "vd = vn + kn0 + d"), ("j16 = jb", "j16 = jm"),
                    ("vd[(size_t)(j16 + i) * D]", "vd[(size_t)(wrow + j16 + i - off) * KV * D]")]
    for old, _ in cache_edits + window_edits:
        if start < 0 or old not in loop:
            raise ValueError(f"the attention body's value loop holds no {old!r}: not the loop this edit knows")
    cache, window = loop, loop
    for old, new in cache_edits:
        cache = cache.replace(old, new)
    for old, new in window_edits:
        window = window.replace(old, new)
    split = f"  const int jm = {ns}min({ns}max(jb, off), je);  // keys from off on are the window's packed rows\n"
    return body[:start] + split + cache + window + body[end:]


CUDA_STREAMS = _streams(CUDA)
METAL_STREAMS = _streams(METAL, "metal::")
