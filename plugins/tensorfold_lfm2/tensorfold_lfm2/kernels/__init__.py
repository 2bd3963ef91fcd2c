"""The LFM2 families' kernels under contract: the short conv over a window with per-row states, the MoE router, and
their records of the shared row kernels (GEMV, RMSNorm, window attention)."""


def records() -> list:
    """Every lfm2 kernel record, for the `tensorfold_kernels` hook (imports mlx and the contract on call)."""
    from . import conv, conv_streams, projections, router

    return [conv.RECORD, conv_streams.RECORD, router.RECORD, *projections.records()]
