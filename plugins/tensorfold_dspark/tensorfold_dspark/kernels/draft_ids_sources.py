"""Kernel text of the DSpark draft ids: the verify's ids with each stream's window written from the drafter's picks."""

# Inputs: ids [verify] uint32 (the verify's ids as the host packed them), and per stream starts, pending and counts
# [streams] int32 and picks [streams, depth] int32; dims = (streams, verify, depth, vocab). Output: out [verify]
# uint32. One thread a row of the verify: it takes the id of the window that holds it, else the host's id. Windows
# never overlap, so each row is written once, by one thread: no row races between the host's id and a draft, which
# one thread a draft would have to settle (MLX's custom kernels cannot write into the host's ids in place).

CUDA = """
const int streams = dims[0];
const int verify = dims[1];
const int depth = dims[2];
const int vocab = dims[3];
const int p = blockIdx.x * blockDim.x + threadIdx.x;
if (p >= verify) return;
unsigned int id = ids[p];
for (int s = 0; s < streams; ++s) {
  const int j = p - starts[s];
  if (j >= 0 && j <= counts[s]) {
    const int pick = j == 0 ? pending[s] : picks[(size_t)s * depth + j - 1];
    // a pick off the vocabulary (a NaN row's flag is negative) would index past the embedding
    id = j > 0 && (pick < 0 || pick >= vocab) ? 0u : (unsigned int)pick;
    break;
  }
}
out[p] = id;
"""

METAL = """
const int streams = dims[0];
const int verify = dims[1];
const int depth = dims[2];
const int vocab = dims[3];
const int p = (int)thread_position_in_grid.x;
if (p >= verify) return;
uint id = ids[p];
for (int s = 0; s < streams; ++s) {
  const int j = p - starts[s];
  if (j >= 0 && j <= counts[s]) {
    const int pick = j == 0 ? pending[s] : picks[(ulong)s * depth + j - 1];
    id = j > 0 && (pick < 0 || pick >= vocab) ? 0u : (uint)pick;
    break;
  }
}
out[p] = id;
"""
