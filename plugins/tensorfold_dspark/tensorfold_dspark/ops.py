"""The DSpark drafter's op table: which implementation backs each of its ops on each backend."""

from tensorfold_core.kernels import BUILTIN

# A draft only decides how many tokens a verify keeps, never a reply's ids, so the table is chosen for speed: on CUDA
# a hold's Markov step is the pick record's one launch where MLX's ops took a dozen (each launch is host time there),
# and a block's attention the record's launch over the lane's buffer, where MLX's SDPA (at head dims its vector kernel
# does not take) builds a cuDNN graph for each new context length; on the CPU MLX's ops. The drafter's other records
# (confidence head, tap copy, draft ids) are proven but not yet served: MLX's ops back them on every backend.
OPS = {
    "markov pick": {"cpu": BUILTIN, "cuda": "dspark markov pick", "metal": "dspark markov pick"},
    "block attention": {"cpu": BUILTIN, "cuda": "dspark block attention", "metal": "dspark block attention"},
    # every block of a hold in one launch a layer (up to 8), the same sums per row: a hold's launches and its per-block
    # slicing no longer grow with its streams
    "block attention streams": {"cpu": BUILTIN, "cuda": "dspark block attention streams",
                                "metal": "dspark block attention streams"},
}
