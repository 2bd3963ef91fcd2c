"""The llama family's kernels under contract: RMSNorm, RoPE, the exact-verify GEMV, greedy argmax, keyed draw."""


def records() -> list:
    """Every llama kernel record, for the `tensorfold_kernels` hook (imports mlx and the contract on call)."""
    from . import argmax, attention, draw, gemv, rmsnorm, rope

    return [rmsnorm.RECORD, rope.NEOX, rope.INTERLEAVED, gemv.BF16, gemv.RESIDUAL, gemv.SWIGLU_RESIDUAL, gemv.Q4, gemv.Q8, argmax.RECORD, draw.RECORD,
            attention.RECORD, attention.STREAMS]
