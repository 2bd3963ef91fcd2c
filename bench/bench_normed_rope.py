"""The norm, q|k|v and rope in one launch against the two launches it replaces (the normed GEMV, then the rope qkv
record), on the 1B's shapes: bits checked first, then each path timed in chains of dependent calls, interleaved."""

# python bench/bench_normed_rope.py [--backend cuda|metal|mlx] [--calls 200] [--rounds 5] [--ncu]
# Per row count (1, 4, 16): the one launch's q, k and v must equal the two launches' bit for bit, or the script exits
# 1 with no time printed. A chain feeds each call's q back as the next call's rows (so no call starts before the
# last ended, as a forward's layers do), and the median of `--rounds` interleaved chains gives us a call: the
# device's time and the host's launches together, as a served step pays them. `--ncu` (CUDA) then times each kernel
# alone under Nsight Compute at 1 and 4 rows, positions made fresh at every call as a served step makes them: the
# one launch, the two it replaces, and the one launch's text edited to find where its time goes (timing only):
# positions never read (the angle from the row index), no trig (the angle itself as the cosine), and the served text
# given positions made on the device instead of on the host.

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from tensorfold_contract.serving import Prepared
from tensorfold_core.row_kernels.gemv import OUT
from tensorfold_llama.kernels import gemv, normed_rope, rope, rope_qkv
from tensorfold_llama.kernels.common import LLAMA_1B
from ncu import kernel_medians

HEADS, KV, D, K = LLAMA_1B["heads"], LLAMA_1B["kv_heads"], LLAMA_1B["head_dim"], LLAMA_1B["hidden"]
N = (HEADS + 2 * KV) * D
PROFILE_ENV = "TF_BENCH_NORMED_ROPE_ROWS"  # set in the profiled child
# "device-positions" is the served text unchanged, given positions made on the device (mx.arange: device memory)
# where every other path gets them from the host (MLX keeps host-made arrays in CUDA managed memory)
ABLATIONS = {"no-positions": ("(double)positions[row]", "(double)(8000 + row)"),
             "no-trig": ("tf_cos[e] = (float)cos(theta);\n        tf_sin[e] = (float)sin(theta);",
                         "tf_cos[e] = (float)theta;\n        tf_sin[e] = 0.0f;"),
             "device-positions": ("", "")}


def texts() -> dict:
    """Each ablation's edit of the one launch's cuda text, by label, renamed for the profile."""
    served = normed_rope.RECORD.implementations["cuda"]
    out = {}
    for label, (old, new) in ABLATIONS.items():
        assert not old or served.body.count(old) == 1, label
        out[label] = dataclasses.replace(served, body=served.body.replace(old, new) if old else served.body,
                                         name=f"gemv16_bench_{label.replace('-', '_')}")
    return out


def paths(kind: str, ablations: bool = False) -> dict:
    """label -> f(x, positions) giving (q, k, v): the one launch, and the two (and the ablations' texts)."""
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

    out = {"one launch": folded, "two launches": apart}
    for label, source in (texts().items() if ablations else ()):
        edited = Prepared(kind, source, dims, lambda: {"w": w, "nw": nw, "freqs": freqs}, "x")
        out[label] = lambda x, positions, edited=edited: tuple(edited(x, positions=positions).values())
    return out


def profiled_child(rows: int) -> None:
    """Each path five times at `rows` rows, positions made fresh at every call (what ncu times)."""
    by_label = paths("cuda", ablations=True)
    x = (mx.random.normal((rows, K), key=mx.random.key(rows)) * 3).astype(mx.bfloat16)
    for _ in range(6):
        for label, path in by_label.items():
            positions = (mx.arange(8000, 8000 + rows, dtype=mx.int32) if label == "device-positions"
                         else mx.array(np.arange(8000, 8000 + rows, dtype=np.int32)))
            mx.eval(*path(x, positions))


def profile(rows: int) -> dict[str, float]:
    """Median device us a launch by label at `rows` rows, under ncu."""
    renamed = {f"{src.name}_": label for label, src in texts().items()}

    def label_of(name: str) -> str | None:
        if "gemv16_norm_rope_" in name:  # before the normed GEMV's name, which it contains
            return "one launch"
        label = next((label for key, label in renamed.items() if key in name), None)
        return label or ("normed GEMV" if "gemv16_norm_" in name else "rope qkv" if "rope_qkv" in name else None)

    return kernel_medians(__file__, [], {PROFILE_ENV: str(rows)}, label_of)


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
    parser.add_argument("--ncu", action="store_true", help="then each kernel's device time under Nsight Compute")
    args = parser.parse_args()
    if PROFILE_ENV in os.environ:
        profiled_child(int(os.environ[PROFILE_ENV]))
        return 0
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
    for rows in (1, 4) if args.ncu else ():
        us = profile(rows)
        apart = us.get("normed GEMV", 0.0) + us.get("rope qkv", 0.0)
        cells = "  ".join(f"{label} {value:.2f}" for label, value in sorted(us.items()))
        print(f"ncu rows={rows}: {cells} us; apart {apart:.2f} us = {apart / us['one launch']:.2f}x the one launch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
