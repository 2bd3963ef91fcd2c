"""The norm, q|k|v and rope in one launch against the two launches it replaces (the normed GEMV, then the rope qkv
record), on the 1B's shapes: bits checked first, then each path timed in chains of dependent calls, interleaved."""

# python bench/bench_normed_rope.py [--backend cuda|metal|mlx] [--calls 200] [--rounds 5]
# Per row count (1, 4, 16): the one launch's q, k and v must equal the two launches' bit for bit, or the script exits
# 1 with no time printed. A chain feeds each call's q back as the next call's rows (so no call starts before the
# last ended, as a forward's layers do), and the median of `--rounds` interleaved chains gives us a call: the
# device's time and the host's launches together, as a served step pays them.

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from tensorfold_contract.serving import Prepared
from tensorfold_core.row_kernels.gemv import OUT
from tensorfold_llama.kernels import gemv, normed_rope, rope, rope_qkv
from tensorfold_llama.kernels.common import LLAMA_1B

HEADS, KV, D, K = LLAMA_1B["heads"], LLAMA_1B["kv_heads"], LLAMA_1B["head_dim"], LLAMA_1B["hidden"]
N = (HEADS + 2 * KV) * D


def paths(kind: str) -> dict:
    """label -> f(x, positions) giving (q, k, v): the one launch, and the two."""
    mx.random.seed(0)
    w = (mx.random.normal((N, K)) / 45).astype(mx.bfloat16)
    nw = (1 + 0.1 * mx.random.normal((K,))).astype(mx.bfloat16)
    dims = {"n": N, "k": K, "eps": 1e-5, "out": OUT, "heads": HEADS, "kv_heads": KV, "head_dim": D,
            "dtype": OUT, "base": 500000.0, "llama3": rope.LLAMA3}
    freqs = mx.array(rope.freqs(dims))
    one = Prepared(kind, normed_rope.RECORD.implementations[kind], dims,
                   lambda: {"w": w, "nw": nw, "freqs": freqs}, "x")
    normed = Prepared(kind, gemv.NORM.implementations[kind], dims, lambda: {"w": w, "nw": nw}, "x")
    roped = Prepared(kind, rope_qkv.NEOX.implementations[kind], dims, lambda: {"freqs": freqs}, "qkv")

    def folded(x, positions):
        out = one(x, positions=positions)
        return out["yq"], out["yk"], out["yv"]

    def apart(x, positions):
        out = roped(normed(x)["y"], positions=positions)
        return out["q"], out["k"], out["v"]

    return {"one launch": folded, "two launches": apart}


def chain(path, x, positions, calls: int) -> float:
    """us a call over `calls` dependent calls."""
    mx.eval(x)
    start = time.perf_counter()
    for _ in range(calls):
        q, _, _ = path(x, positions)
        x = q.reshape(x.shape[0], K)  # the next call's rows depend on this one's output (q is as wide as x)
    mx.eval(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "metal", "mlx"),
                        help="mlx: the records' composed ops (a CPU's smoke run)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    by_label = paths(args.backend)
    for rows in (1, 4, 16):
        x = (mx.random.normal((rows, K), key=mx.random.key(rows)) * 3).astype(mx.bfloat16)
        positions = mx.array(np.arange(8000, 8000 + rows, dtype=np.int32))
        outs = {label: path(x, positions) for label, path in by_label.items()}
        for name, a, b in zip("qkv", *outs.values()):
            if not mx.array_equal(a, b).item():
                print(f"FAIL rows={rows}: {name} of the one launch differs from the two launches'")
                return 1
        times: dict[str, list[float]] = {label: [] for label in by_label}
        for _ in range(args.rounds):
            for label, path in by_label.items():
                times[label].append(chain(path, x, positions, args.calls))
        us = {label: statistics.median(values) for label, values in times.items()}
        print(f"rows={rows}: q, k, v bit-equal; one launch {us['one launch']:.2f} us a call, two launches "
              f"{us['two launches']:.2f}: {us['two launches'] / us['one launch']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
