"""tensorfold core: lane engine, hookspecs, server, CLI, memory ledger and prompt cache."""

import os

import pluggy

__version__ = "0.1.0"

# MLX's CUDA backend records a round's kernels as CUDA graphs unless told otherwise; with the whole forwards compiled
# and padded, launching without them measured faster in every cell on H100s (docs/gpu.md, "CUDA graphs"). MLX reads
# the variable at its first GPU launch, so it is set here, before anything loads; a caller's own value stands, and
# Metal and the CPU ignore it.
CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"
os.environ.setdefault(CUDA_GRAPHS_ENV, "0")

hookimpl = pluggy.HookimplMarker("tensorfold")
