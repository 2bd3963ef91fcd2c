"""What one launch costs on CUDA in a chain of dependent ops, as a forward makes them: MLX's custom kernels (an empty
one, the rmsnorm and GEMV records) against MLX's own ops at one row, outputs checked before timing."""

# python bench/bench_launch.py [--json OUT] [--chain 200]
# Each cell evaluates a chain of --chain calls, each reading the previous one's output (a forward's ops wait on each
# other), and keeps the median of 5 evaluations; per call = time / chain, building the chain's graph and in all. A
# row copy gives the floor of the custom-kernel path (with 8 KB more text, and with 8 inputs: what a launch's cost
# grows with), mx.abs on one row the floor of MLX's own.

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

from tensorfold_contract.serving import Prepared
from tensorfold_core.row_kernels import gemv, rmsnorm

D = 2048


def per_call(step, x, chain: int) -> tuple[float, float]:
    """(building the chain, building and evaluating it) per call, medians of 5."""
    def run():
        y = x
        for _ in range(chain):
            y = step(y)
        return y

    mx.eval(run())
    built, whole = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        y = run()
        t1 = time.perf_counter()
        mx.eval(y)
        built.append((t1 - t0) / chain)
        whole.append((time.perf_counter() - t0) / chain)
    return statistics.median(built), statistics.median(whole)


def cells(chain: int) -> dict:
    w = (mx.random.normal((D, D), key=mx.random.key(1)) / D ** 0.5).astype(mx.bfloat16)
    norm_w = mx.ones((D,), mx.bfloat16)
    copy_text = f"const int i = blockIdx.x * blockDim.x + threadIdx.x;\nif (i < {D}) y[i] = x[i];\n"
    empty = mx.fast.cuda_kernel(name="tf_copy_row", input_names=["x"], output_names=["y"], source=copy_text)
    # the same copy with 8 KB of comment (MLX hashes a kernel's text at each launch), and with 8 inputs
    padded = mx.fast.cuda_kernel(name="tf_copy_row_padded", input_names=["x"], output_names=["y"],
                                 source=("// " + "x" * 125 + "\n") * 64 + copy_text)
    many = mx.fast.cuda_kernel(name="tf_copy_row_8", input_names=["x", *(f"u{i}" for i in range(7))],
                               output_names=["y"], source=copy_text)
    unused = [mx.zeros((D,), mx.bfloat16) for _ in range(7)]
    gemv_launch = Prepared("cuda", gemv.source("cuda", 16), {"n": D, "k": D, "out": gemv.OUT}, lambda: {"w": w}, "x")
    norm_launch = Prepared("cuda", rmsnorm.source("cuda"),
                           {"d": D, "dtype": "bfloat16", "eps": 1e-5},
                           lambda: {"w": norm_w, "eps": mx.array([1e-5], mx.float32)}, "x")
    x = mx.random.normal((1, D), key=mx.random.key(2)).astype(mx.bfloat16)
    steps = {
        "mlx abs (one row)": lambda y: mx.abs(y),
        "custom kernel, a row copy": lambda y: empty(inputs=[y], grid=(D, 1, 1), threadgroup=(256, 1, 1),
                                                     output_shapes=[y.shape], output_dtypes=[y.dtype])[0],
        "custom kernel, a row copy, 8 KB text": lambda y: padded(inputs=[y], grid=(D, 1, 1), threadgroup=(256, 1, 1),
                                                                output_shapes=[y.shape], output_dtypes=[y.dtype])[0],
        "custom kernel, a row copy, 8 inputs": lambda y: many(inputs=[y, *unused], grid=(D, 1, 1),
                                                               threadgroup=(256, 1, 1), output_shapes=[y.shape],
                                                               output_dtypes=[y.dtype])[0],
        "mlx fast.rms_norm": lambda y: mx.fast.rms_norm(y, norm_w, 1e-5),
        "rmsnorm record (cuda)": lambda y: norm_launch(y)["out"],
        "mlx matmul 2048x2048": lambda y: y @ w.T,
        "gemv record bf16 2048x2048 (cuda)": lambda y: gemv_launch(y)["y"],
    }
    checks = {"rmsnorm": (norm_launch(x)["out"], mx.fast.rms_norm(x, norm_w, 1e-5)),
              "gemv": (gemv_launch(x)["y"], x @ w.T)}
    for name, (ours, theirs) in checks.items():
        if not mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), rtol=2e-2, atol=2e-2).item():
            raise SystemExit(f"{name}: the record's output is not MLX's: nothing timed")
    out = {}
    for name, step in steps.items():
        try:
            out[name] = [round(t * 1e6, 2) for t in per_call(step, x, chain)]
        except RuntimeError as exc:  # one cell's failure costs that cell alone
            print(f"{name}: {exc}", file=sys.stderr)
    out.update(attention_cells(chain))
    return out


def attention_cells(chain: int) -> dict:
    """The streams attention at one stream of the 1B (600 keys): its text naming one cache slot against all eight
    (TENSORFOLD_NARROW_INPUTS=0), bit-equal first."""
    from tensorfold_core.row_kernels.attention_streams import STREAMS_ATTENTION, packed

    heads, kv_heads, head_dim, layers = 32, 8, 64, 16
    cache = mx.random.normal((layers, kv_heads, 1024, head_dim), key=mx.random.key(3)).astype(mx.bfloat16)
    kn = mx.random.normal((1, kv_heads, head_dim), key=mx.random.key(4)).astype(mx.bfloat16)
    q = mx.random.normal((1, heads, head_dim), key=mx.random.key(5)).astype(mx.bfloat16)
    streams = packed([(0, 1, 600)])

    def step(y):
        return STREAMS_ATTENTION["cuda"](y, kn, kn, [cache], [cache], streams, layers - 1, head_dim ** -0.5)

    def under(narrow: str, fn):
        os.environ["TENSORFOLD_NARROW_INPUTS"] = narrow
        try:
            return fn()
        finally:
            os.environ.pop("TENSORFOLD_NARROW_INPUTS")

    modes = (("one slot", "1"), ("all 8 slots", "0"))
    firsts = [under(narrow, lambda: step(q)) for _, narrow in modes]
    if not mx.array_equal(*firsts).item():
        raise SystemExit("streams attention: one slot and eight differ: nothing timed")
    return {f"streams attention 1B, {label} (cuda)":
            [round(t * 1e6, 2) for t in under(narrow, lambda: per_call(step, q, chain))] for label, narrow in modes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--chain", type=int, default=200)
    args = parser.parse_args()
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        print("the launch bench times cuda kernels: no CUDA device here", file=sys.stderr)
        return 2
    results = cells(args.chain)
    print(f"{'us a call in a chain of ' + str(args.chain):<40} {'built':>8} {'in all':>8}")
    for name, (built, whole) in results.items():
        print(f"{name:<40} {built:8.2f} {whole:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mlx": mx.__version__, "chain": args.chain, "us_per_call_built_and_in_all": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
