"""The norm folded into the bf16 GEMV against the two launches it replaces, on CUDA under Nsight Compute: each kernel's
device time, bits checked first."""

# python bench/bench_normed_gemv.py [--ablations]
# Per shape (N x 2048, 1 and 4 rows): the normed GEMV's output must equal the rmsnorm record's then the plain GEMV's
# bit for bit before any time is printed. Then each kernel runs five times under `ncu --clock-control none
# --cache-control none` (a child per shape) and the median gpu__time_duration is printed: the normed GEMV as served,
# and apart, MLX's rms_norm (served on CUDA) then the plain GEMV. --ablations adds texts edited to find where the normed
# kernel's time goes (timing only, their outputs unchecked): no norms worked out (inv = 1), the norms worked out but
# plain loads, and eps read from an input array of its own (4 bytes), as the first served text did: that read cost
# 13 us a launch on the H200 (contract/receipts/h200-2026-12-04b), so eps rides in the dims array.

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import mlx.core as mx
from ncu import kernel_medians

from tensorfold_contract.serving import Prepared
from tensorfold_core.row_kernels import gemv, gemv_normed, rmsnorm
from tensorfold_core.row_kernels.gemv import OUT

K = 2048
SHAPES = ((3072, 1), (3072, 4), (16384, 1))  # the 1B's q|k|v and gate|up widths
SHAPE_ENV = "TF_BENCH_NORMED_SHAPE"  # set in the profiled child


def texts(ablations: bool) -> dict:
    """The normed GEMV's cuda texts by label: as served, and the ablations' edits of it."""
    served = gemv_normed.source("cuda", "norm")
    out = {"normed": served}
    if ablations:
        body = served.body
        first, loop = body.index("  if (tf_first) {"), body.index("#pragma unroll\n  for (int u = 0; u < U; ++u) {\n")
        out["no-norms"] = dataclasses.replace(served, body=body[:first] + "  if (tf_first) { tf_first = 0; if "
                                              "(threadIdx.x < RB) tf_inv[threadIdx.x] = 1.0f; __syncthreads(); }\n"
                                              + body[loop:])
        out["plain-loads"] = dataclasses.replace(served, body=body.replace(
            "tf_norm8(x, nw, tf_inv[r - row0], r, k, K, vec)", "tf_load8(x, r, k, K, vec)"))
        out["eps-array"] = dataclasses.replace(
            served, body=body.replace("__int_as_float(dims[3])", "eps_in[0]"),
            input_names=("x", "w", "nw", "eps_in", "dims"),
            inputs=lambda case: [*served.inputs(case)[:3], mx.array([1e-5], mx.float32), served.inputs(case)[3]])
    return {label: dataclasses.replace(src, name=f"gemv16_bench_{label.replace('-', '_')}")
            for label, src in out.items()}


def run_shape(n: int, rows: int, ablations: bool, check: bool) -> None:
    mx.random.seed(0)
    x = (mx.random.normal((rows, K)) * 3).astype(mx.bfloat16)
    w = (mx.random.normal((n, K)) / 45).astype(mx.bfloat16)
    nw = (1 + 0.1 * mx.random.normal((K,))).astype(mx.bfloat16)
    eps = mx.array([1e-5], mx.float32)
    dims = {"n": n, "k": K, "eps": 1e-5, "out": OUT}
    normed = {label: Prepared("cuda", src, dims, lambda: {"w": w, "nw": nw}, "x")
              for label, src in texts(ablations).items()}
    plain = Prepared("cuda", gemv.source("cuda", 16), {"n": n, "k": K, "out": OUT}, lambda: {"w": w}, "x")
    norm = Prepared("cuda", rmsnorm.source("cuda"), {"d": K, "dtype": "bfloat16", "eps": 1e-5},
                    lambda: {"w": nw, "eps": eps}, "x")
    if check:
        ours, apart = normed["normed"](x)["y"], plain(norm(x)["out"])["y"]
        if not mx.array_equal(ours, apart).item():
            raise SystemExit(f"N={n} rows={rows}: the normed GEMV differs from the rmsnorm record then the GEMV")
        print(f"N={n} rows={rows}: the normed GEMV equals the rmsnorm record then the GEMV, bit for bit")
    for _ in range(5):
        for launch in normed.values():
            mx.eval(launch(x)["y"])
        mx.eval(plain(mx.fast.rms_norm(x, nw, 1e-5))["y"])


def profile(shape: int, labels: list[str]) -> dict[str, float]:
    """Median device us per kernel label, from a child of this script under ncu."""
    ours = {f"gemv16_bench_{label.replace('-', '_')}_": label for label in labels}

    def label_of(name: str) -> str | None:
        label = next((label for key, label in ours.items() if key in name), None)
        return label or ("rms_norm (MLX)" if "rms_norm" in name else "gemv (plain)" if "gemv16" in name else None)

    return kernel_medians(__file__, sys.argv[1:], {SHAPE_ENV: str(shape)}, label_of)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ablations", action="store_true", help="add the edited texts (timing only)")
    args = parser.parse_args()
    if SHAPE_ENV in os.environ:  # the profiled child
        run_shape(*SHAPES[int(os.environ[SHAPE_ENV])], args.ablations, check=False)
        return 0
    for index, (n, rows) in enumerate(SHAPES):
        run_shape(n, rows, args.ablations, check=True)
        us = profile(index, list(texts(args.ablations)))
        apart = us["rms_norm (MLX)"] + us["gemv (plain)"]
        cells = "  ".join(f"{label} {value:.2f}" for label, value in sorted(us.items()))
        print(f"N={n} rows={rows}: {cells} us; apart {apart:.2f} us = {apart / us['normed']:.2f}x the normed launch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
