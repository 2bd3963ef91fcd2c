"""The llama family's op table: which implementation backs each row-path op on each backend."""

from tensorfold_core.kernels import BUILTIN

# Which implementation backs each row-path op on each backend: MLX's built-in, or a kernel record (its cuda or
# metal implementation there; the contract proves exactly these). Elementwise ops, the embedding gather and rope
# at absolute offsets are row-wise on every backend and stay built-in; the draw runs on the host in float64.
OPS = {
    "projection bf16": {"cpu": BUILTIN, "cuda": "llama gemv bf16", "metal": "llama gemv bf16"},
    # a layer's o_proj with the residual added, and its down_proj reading the gate and up halves through swiglu: a
    # launch (two) fewer each, the same sums as the GEMV's (served where the layers are compiled on one machine)
    "projection bf16 residual": {"cpu": BUILTIN, "cuda": "llama gemv bf16 + residual",
                                 "metal": "llama gemv bf16 + residual"},
    "projection bf16 swiglu residual": {"cpu": BUILTIN, "cuda": "llama gemv bf16 swiglu + residual",
                                        "metal": "llama gemv bf16 swiglu + residual"},
    # gate|up storing swiglu of its halves, each computed once (down_proj then adds the residual as o_proj does),
    # where the fused down_proj computes it again in each of its blocks; the default where it serves
    "projection bf16 swiglu": {"cpu": BUILTIN, "cuda": "llama gemv bf16 gate|up swiglu",
                               "metal": "llama gemv bf16 gate|up swiglu"},
    # a layer's norms folded into the launches that read them (q|k|v; gate|up storing swiglu): each block norms its
    # rows in the rmsnorm record's order as it loads them, a launch fewer each (where the layers are compiled)
    "projection bf16 rmsnorm": {"cpu": BUILTIN, "cuda": "llama gemv bf16 rmsnorm", "metal": "llama gemv bf16 rmsnorm"},
    "projection bf16 rmsnorm swiglu": {"cpu": BUILTIN, "cuda": "llama gemv bf16 rmsnorm gate|up swiglu",
                                       "metal": "llama gemv bf16 rmsnorm gate|up swiglu"},
    # the input norm, q|k|v and rope in one launch (neox pairs): each block holds both elements of 16 pairs, so the
    # roped heads are stored from the GEMV's rounded sums, the bits of the two launches (where the layers are compiled
    # and TENSORFOLD_ROPE_IN=1 asks it: slower on the H200 than the two launches so far)
    "projection bf16 rmsnorm rope neox": {"cpu": BUILTIN, "cuda": "llama gemv bf16 rmsnorm rope qkv neox",
                                          "metal": "llama gemv bf16 rmsnorm rope qkv neox"},
    "projection q4": {"cpu": BUILTIN, "cuda": "llama gemv q4", "metal": "llama gemv q4"},
    "projection q8": {"cpu": BUILTIN, "cuda": "llama gemv q8", "metal": "llama gemv q8"},
    # MLX's fast rms_norm is row-invariant on CUDA (the record's mlx implementation passes gate 4 there, and the load
    # probe with it): it serves, a launch cheaper than the record's
    "rms_norm": {"cpu": BUILTIN, "cuda": BUILTIN, "metal": "llama rmsnorm"},
    # where rope runs by rows in the compiled layer parts: q and k roped and v copied into their heads straight from
    # the q|k|v launch's rows, one launch (where slices, reshapes and two ropes were ten ops)
    "rope qkv neox": {"cpu": BUILTIN, "cuda": "llama rope qkv neox", "metal": "llama rope qkv neox"},
    "rope qkv interleaved": {"cpu": BUILTIN, "cuda": "llama rope qkv interleaved",
                             "metal": "llama rope qkv interleaved"},
    # MLX's fast SDPA is not row-invariant on CUDA: each row over its own keys in fixed splits of 256 instead
    "attention": {"cpu": BUILTIN, "cuda": "llama window attention", "metal": "llama window attention"},
    # the same sums for every stream of a forward in one launch, the caches written once after the last layer: where
    # it serves (with the layers compiled), a forward's launches no longer grow with its streams in every layer
    "attention streams": {"cpu": BUILTIN, "cuda": "llama window attention streams",
                          "metal": "llama window attention streams"},
    # where the streams attention serves, the layers' new keys and values stacked for the caches in one launch (MLX's
    # stack launches a copy a layer, for keys and values apart)
    "stack kv": {"cpu": BUILTIN, "cuda": "llama stack kv", "metal": "llama stack kv"},
}
