"""The DSpark drafter's op table: which implementation backs each of its ops on each backend."""

from tensorfold_core.kernels import BUILTIN

# A draft only decides how many tokens a verify keeps, never a reply's ids, so the table is chosen for speed: on CUDA
# a hold's Markov step is the pick record's one launch where MLX's ops took a dozen (each launch is host time there);
# on the CPU MLX's ops. The drafter's other records (block attention, confidence head, tap copy, draft ids) are proven
# but not yet served: MLX's ops back them on every backend.
OPS = {
    "markov pick": {"cpu": BUILTIN, "cuda": "dspark markov pick", "metal": "dspark markov pick"},
}
