"""The LFM2 families' kernels under contract: the short conv over a window with per-row states, the MoE router."""


def records() -> list:
    """Every lfm2 kernel record, for the `tensorfold_kernels` hook (imports mlx and the contract on call)."""
    from . import conv, router

    return [conv.RECORD, router.RECORD]
