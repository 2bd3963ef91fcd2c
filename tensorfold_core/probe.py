"""The row-invariance probe run at load: does a row's logits depend on how many rows or streams share the forward?"""

from __future__ import annotations

import mlx.core as mx

from .protocols import Model


def _tokens(model: Model, n: int, salt: int) -> list[int]:
    return [(17 + salt + 31 * i) % model.vocab_size for i in range(n)]


def _run(model: Model, windows: list[list[int]], caches=None) -> list[mx.array]:
    """One forward over fresh (or given) caches with every row's logits; each stream's rows, all kept."""
    caches = caches or [model.new_cache(32) for _ in windows]
    logits = model.forward(caches, windows, [len(w) for w in windows])
    mx.eval(logits)
    for cache, window in zip(caches, windows):
        model.keep(cache, len(window))
    starts = [sum(len(w) for w in windows[:i]) for i in range(len(windows) + 1)]
    return [logits[a:b] for a, b in zip(starts, starts[1:])]


def _steps(model: Model, tokens: list[int], split: list[int]) -> mx.array:
    """The rows of `tokens` run on one fresh cache as consecutive windows of the given sizes."""
    cache, rows, at = model.new_cache(32), [], 0
    for size in split:
        rows += _run(model, [tokens[at:at + size]], [cache])
        at += size
    return mx.concatenate(rows)


def _differs(a: mx.array, b: mx.array) -> str | None:
    if mx.array_equal(a, b).item():
        return None
    rows = [i for i in range(a.shape[0]) if not mx.array_equal(a[i], b[i]).item()]
    return f"rows {rows} differ (max abs {mx.abs(a - b).max().item():.3g})"


def row_invariance(model: Model, k: int = 8) -> dict:
    """Compare k one-row steps, one k-row window, uneven windows, and a k-row window shared with another
    stream's window, all by `mx.array_equal` on the logits; {"row_invariant": bool, "detail": str}."""
    tokens, other = _tokens(model, k, 0), _tokens(model, k - 3, 5)
    steps = _steps(model, tokens, [1] * k)
    half = k // 2
    checks = [
        (f"one {k}-row window vs {k} one-row steps", _steps(model, tokens, [k])),
        (f"windows of {half}+{k - half} rows vs one-row steps", _steps(model, tokens, [half, k - half])),
    ]
    shared, neighbour = _run(model, [tokens, other])
    checks.append((f"a {k}-row window beside another stream's {len(other)}-row window vs one-row steps", shared))
    for what, rows in checks:
        why = _differs(steps, rows)
        if why:
            return {"row_invariant": False, "detail": f"{what}: {why} on {mx.default_device()}"}
    alone = _steps(model, other, [len(other)])
    why = _differs(alone, neighbour)
    if why:
        return {"row_invariant": False,
                "detail": f"a {len(other)}-row window beside a {k}-row window vs alone: {why} on {mx.default_device()}"}
    return {"row_invariant": True,
            "detail": f"bit-equal logits for 1..{k}-row windows and mixed streams on {mx.default_device()}"}
