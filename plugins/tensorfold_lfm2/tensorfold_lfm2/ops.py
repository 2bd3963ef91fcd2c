"""The LFM2 families' op table: which implementation backs each row-path op on each backend."""

from tensorfold_core.kernels import BUILTIN

# Which implementation backs each row-path op on each backend: MLX's built-in, or a kernel record (its cuda or
# metal implementation there; the contract proves exactly these). Projections cover every Linear of the blocks,
# the router's gate, the tied head, and each MoE expert's matrix on its own (served: every expert on every row,
# then each row's picks in order, so no row's product depends on which rows chose the same expert).
OPS = {
    "projection bf16": {"cpu": BUILTIN, "cuda": "lfm2 gemv bf16", "metal": "lfm2 gemv bf16"},
    # out_proj and w2 adding the residual in their launch, w1|w3 storing swiglu of its halves, and the operator and
    # ffn norms folded into the launches that read them (in_proj or q|k|v; w1|w3): the llama family's fusions, the
    # same shared records at lfm2's shapes (served where the layers are compiled on one machine)
    "projection bf16 residual": {"cpu": BUILTIN, "cuda": "lfm2 gemv bf16 + residual",
                                 "metal": "lfm2 gemv bf16 + residual"},
    "projection bf16 swiglu": {"cpu": BUILTIN, "cuda": "lfm2 gemv bf16 gate|up swiglu",
                               "metal": "lfm2 gemv bf16 gate|up swiglu"},
    "projection bf16 rmsnorm": {"cpu": BUILTIN, "cuda": "lfm2 gemv bf16 rmsnorm", "metal": "lfm2 gemv bf16 rmsnorm"},
    "projection bf16 rmsnorm swiglu": {"cpu": BUILTIN, "cuda": "lfm2 gemv bf16 rmsnorm gate|up swiglu",
                                       "metal": "lfm2 gemv bf16 rmsnorm gate|up swiglu"},
    "projection q4": {"cpu": BUILTIN, "cuda": "lfm2 gemv q4", "metal": "lfm2 gemv q4"},
    "projection q8": {"cpu": BUILTIN, "cuda": "lfm2 gemv q8", "metal": "lfm2 gemv q8"},
    "rms_norm": {"cpu": BUILTIN, "cuda": BUILTIN, "metal": "lfm2 rmsnorm"},  # row-invariant on CUDA, as llama's
    "attention": {"cpu": BUILTIN, "cuda": "lfm2 window attention", "metal": "lfm2 window attention"},
    "short conv": {"cpu": BUILTIN, "cuda": "lfm2 stream conv", "metal": "lfm2 stream conv"},
    # every stream of a forward in one launch a layer (attention by groups of 8), over caches of one buffer for each
    # layer kind that the forward writes once, after its last layer, the layers' new keys and values stacked by one
    # launch: a forward's launches no longer grow with its streams (served with the layers compiled, one machine)
    "attention streams": {"cpu": BUILTIN, "cuda": "lfm2 window attention streams",
                          "metal": "lfm2 window attention streams"},
    "conv streams": {"cpu": BUILTIN, "cuda": "lfm2 streams conv", "metal": "lfm2 streams conv"},
    "stack kv": {"cpu": BUILTIN, "cuda": "lfm2 stack kv", "metal": "lfm2 stack kv"},
    "moe router": {"cpu": BUILTIN, "cuda": "lfm2_moe router top-k", "metal": "lfm2_moe router top-k"},
}
