"""The LFM2 families' op table: which implementation backs each row-path op on each backend."""

from tensorfold_core.kernels import BUILTIN

# Which implementation backs each row-path op on each backend. The conv and router records are proven by the
# contract but not wired into the forward yet: every backend serves MLX's built-ins, so on CUDA the probe fails
# and the lfm2 families serve each stream alone and undrafted there (docs/architecture.md, "Kernels served").
OPS = {op: {"cpu": BUILTIN, "cuda": BUILTIN, "metal": BUILTIN}
       for op in ("projection", "rms_norm", "attention", "short conv", "moe router", "moe experts")}
