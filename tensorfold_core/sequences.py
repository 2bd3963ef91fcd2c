"""Token sequences compared without copying: the common-prefix rule slots, kept states and copies share."""

from __future__ import annotations

from typing import Sequence

CHUNK = 512  # slices this long compare at C speed; a mismatch is then found within one of them


def common_prefix(a: Sequence[int], b: Sequence[int], a_from: int = 0, b_from: int = 0) -> int:
    """Length of the common prefix of a[a_from:] and b[b_from:]."""
    n = max(min(len(a) - a_from, len(b) - b_from), 0)
    same_kind = type(a) is type(b)  # a tuple slice never equals a list slice: those compare as lists
    at = 0
    while at < n:
        left, right = a[a_from + at:a_from + min(at + CHUNK, n)], b[b_from + at:b_from + min(at + CHUNK, n)]
        if not (left == right if same_kind else list(left) == list(right)):
            break
        at += CHUNK
    if at >= n:
        return n
    end = min(at + CHUNK, n)
    return next((i for i in range(at, end) if a[a_from + i] != b[b_from + i]), end)
