"""The llama family's kernels under contract: RMSNorm, RoPE (alone, on the q|k|v rows, in the normed q|k|v GEMV's
store), the exact-verify GEMV, greedy argmax, keyed draw, window attention, the stack of the layers' new keys and
values."""


def records() -> list:
    """Every llama kernel record, for the `tensorfold_kernels` hook (imports mlx and the contract on call)."""
    from . import argmax, attention, draw, gemv, normed_rope, rmsnorm, rope, rope_qkv, stack

    return [rmsnorm.RECORD, rope.NEOX, rope.INTERLEAVED, rope_qkv.NEOX, rope_qkv.INTERLEAVED, gemv.BF16,
            gemv.RESIDUAL, gemv.SWIGLU_RESIDUAL, gemv.SWIGLU, gemv.NORM, gemv.NORM_SWIGLU, normed_rope.RECORD, gemv.Q4,
            gemv.Q8, argmax.RECORD, draw.RECORD, attention.RECORD, attention.STREAMS, stack.RECORD]
