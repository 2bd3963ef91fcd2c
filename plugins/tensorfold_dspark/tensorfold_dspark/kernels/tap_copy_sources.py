"""Kernel text of the DSpark tap copy: the tapped layers' rows side by side, one thread an output element."""

# Inputs: tap0 .. tap7 [rows, hidden] of type T, the first TAPS of them the call's taps in order (the rest are never
# read), and dims = (rows, hidden). Output: out [rows, TAPS * hidden] of type T. Element c of row r is element
# c - j hidden of tap j's row r, where j = c / hidden: a plain load and store of T, so every bit goes across as it is
# (-0, subnormals, inf), with no arithmetic to round or flush it.

CUDA = """
const int rows = dims[0];
const int hidden = dims[1];
const size_t width = (size_t)TAPS * hidden;
const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
if (i >= (size_t)rows * width) return;
const int c = (int)(i % width);
const size_t r = i / width;
const int j = c / hidden;
const T* tap = j == 0 ? tap0 : j == 1 ? tap1 : j == 2 ? tap2 : j == 3 ? tap3
             : j == 4 ? tap4 : j == 5 ? tap5 : j == 6 ? tap6 : tap7;
out[i] = tap[r * hidden + (c - j * hidden)];
"""

METAL = """
const int rows = dims[0];
const int hidden = dims[1];
const ulong width = (ulong)TAPS * hidden;
const ulong i = thread_position_in_grid.x;
if (i >= (ulong)rows * width) return;
const int c = (int)(i % width);
const ulong r = i / width;
const int j = c / hidden;
const device T* tap = j == 0 ? tap0 : j == 1 ? tap1 : j == 2 ? tap2 : j == 3 ? tap3
                    : j == 4 ? tap4 : j == 5 ? tap5 : j == 6 ? tap6 : tap7;
out[i] = tap[r * hidden + (c - j * hidden)];
"""
