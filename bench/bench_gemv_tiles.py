"""The bf16 GEMV record's tile geometry swept on CUDA: every (MAXT, MT, U) timed per row count and shape, each
output first checked bit-equal to the served geometry's (geometry never changes a sum), the fastest printed."""

# python bench/bench_gemv_tiles.py [--json OUT] [--seconds 240] [--warps 8,16] [--cold] [--rows 1,4,8]
#     [--shapes 2048x2048] [--loads plain,l2-256] [--served-only] [--only 2:*:*,4:1:1]
# The served tiles (gemv.geometry) against every other geometry of the same K split: an output that differs
# in one bit from the served geometry's is a failure, and that geometry is not timed. Other splits change the sums
# (a choice the contract must prove again); their rows are compared with their own first geometry's and with their
# own 1-row call (row invariance, as gate 4 asks), and timed beside. MLX's matmul is timed as the speed to beat.
# --loads times each geometry again with its 16-byte loads as another flavour asks (gemv_sources.LOADS: memory hints
# only, so bit-equal too); --served-only times the served geometry alone, per flavour.
# The sweep stops starting cells after --seconds so a device call ends inside its limit; the JSON is rewritten as
# it goes. --cold cycles each call through copies of the weights filling COLD_BYTES, so that every call reads them
# from HBM as a decode's layers do (the H200's L2 holds 50 MB: a 2048x8192 matrix called again is read from there).

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import mlx.core as mx

from tensorfold_contract.gates import _build
from tensorfold_contract.helpers import groups
from tensorfold_core.row_kernels import gemv
from tensorfold_core.row_kernels.gemv_sources import LOADS, bf16_header
from tensorfold_llama.kernels.bench import timed  # the GEMV bench's timing: a median of evals of many launches

SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192), (8192, 8192))  # (N, K): a 1B's q/o, gate/up, down; the bench's
ROWS = (1, 2, 4, 5, 8, 10, 16, 20, 32, 40, 64, 128)
REPS, LAUNCHES = 3, 20
REGISTERS = 160  # geometries whose accumulators and loads would spill are left out
COLD_BYTES = 512 << 20  # ten times the H200's L2


def geometries(warps: int, served: int) -> list[tuple[int, int, int]]:
    """Every geometry for the `served` split; fewer for the others (each template is a compile of its own)."""
    out = []
    for maxt in (1, 2, 4, 8) if warps == served else (1, 2):
        for mt in (1, 2, 4) if warps == served else (1, 2):
            for u in (1, 2, 4, 8) if warps == served else (1, 2, 4):
                shared = 4 * warps * 8 * maxt * 16
                if 4 * mt * maxt + 8 * u * mt + 4 * maxt <= REGISTERS and shared <= 48 * 1024:
                    out.append((maxt, mt, u))
    return out


def wanted(geometry: tuple[int, int, int], only: str | None) -> bool:
    """Whether `--only MAXT:MT:U,...` (each a value or *) keeps a geometry: every other one costs a build."""
    if not only:
        return True
    return any(all(want in ("*", str(have)) for want, have in zip(pattern.split(":"), geometry))
               for pattern in only.split(","))


def copies(w: mx.array, cold: bool) -> list[mx.array]:
    """The weights once, or (cold) as many copies as fill COLD_BYTES, for calls that cycle through them."""
    out = [w] + [w + 0 for _ in range(-(-COLD_BYTES // w.nbytes) - 1 if cold else 0)]
    mx.eval(out)
    return out


def kernel_call(n: int, k: int, x: mx.array, ws: list[mx.array], warps: int, geometry: tuple[int, int, int],
                load: str = "plain"):
    maxt, mt, u = geometry
    turn = itertools.cycle(ws)
    rows = x.shape[0]
    source = dataclasses.replace(gemv.source("cuda", 16), header=bf16_header(load))
    kernel = _build("cuda", source, 0)
    dims = mx.array([rows, n, k], dtype=mx.int32)
    blocks = groups(n, 16 * mt) * groups(rows, 8 * maxt)

    def call():
        return kernel(inputs=[x, next(turn), dims],
                      template=[("WARPS", warps), ("MAXT", maxt), ("MT", mt), ("U", u), ("T", mx.bfloat16)],
                      grid=(blocks * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
                      output_shapes=[(rows, n)], output_dtypes=[mx.bfloat16])[0]

    return call


def sweep(args) -> tuple[list[dict], list[str]]:
    cells, failures, start, refused = [], [], time.monotonic(), {}
    warps_list = [int(v) for v in args.warps.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    row_counts = [int(v) for v in args.rows.split(",")] if args.rows else ROWS
    loads = args.loads.split(",")
    for n, k in shapes:
        w = mx.random.normal((n, k), key=mx.random.key(1)).astype(mx.bfloat16) / (k ** 0.5)
        x_all = mx.random.normal((max(row_counts), k), key=mx.random.key(2)).astype(mx.bfloat16)
        mx.eval(w, x_all)
        ws = copies(w, args.cold)
        mlx_turn = itertools.cycle(ws)
        weight_bytes = n * k * 2
        split = gemv.geometry(n, 1)[0]  # the served K split of this shape, at any row count
        for rows in row_counts:
            if time.monotonic() - start > args.seconds:
                return cells, failures + [f"cut at {args.seconds} s before N={n} K={k} rows {rows}"]
            x = x_all[:rows]
            mx.eval(x)
            t_mlx = timed(lambda: x @ next(mlx_turn).T, REPS, LAUNCHES)
            cell = {"n": n, "k": k, "rows": rows, "mlx_us": round(t_mlx * 1e6, 1),
                    "served": list(gemv.geometry(n, rows)[1:]), "geometries": []}
            for warps in warps_list:
                own = gemv.geometry(n, rows)[1:] if warps == split else geometries(warps, split)[0]
                try:
                    first = kernel_call(n, k, x, ws, warps, own)()
                    alone = kernel_call(n, k, x[:1], ws, warps, gemv.geometry(n, 1)[1:] if warps == split else own)()
                    mx.eval(first, alone)
                except RuntimeError as exc:
                    failures.append(f"NOTE WARPS={warps} {own} N={n} K={k} rows {rows}: {str(exc)[:160]}")
                    continue
                if not mx.array_equal(first[:1], alone).item():
                    failures.append(f"WARPS={warps} N={n} K={k}: row 0 of {rows} rows differs from its 1-row call")
                swept = [own] if args.served_only else [g for g in geometries(warps, split) if wanted(g, args.only)]
                for load, geometry in itertools.product(loads, swept):
                    if (warps, geometry, load) in refused:
                        continue
                    call = kernel_call(n, k, x, ws, warps, geometry, load)
                    try:
                        same = mx.array_equal(call(), first).item()
                    except RuntimeError as exc:  # more registers or shared memory than a launch may have
                        refused[(warps, geometry, load)] = str(exc)[:160]
                        continue
                    if not same:
                        failures.append(f"WARPS={warps} {geometry} {load} N={n} K={k} rows {rows}: differs from {own}")
                        continue
                    t = timed(call, REPS, LAUNCHES)
                    cell["geometries"].append({"warps": warps, "maxt": geometry[0], "mt": geometry[1],
                                               "u": geometry[2], "load": load, "us": round(t * 1e6, 1),
                                               "gbps": round(weight_bytes / t / 1e9, 1)})
            served = next((g for g in cell["geometries"] if g["warps"] == split and g["load"] == loads[0]
                           and [g["maxt"], g["mt"], g["u"]] == cell["served"]), {"us": float("nan")})
            ours = [g for g in cell["geometries"] if g["warps"] == split]
            if not ours:
                continue
            best = min(ours, key=lambda g: g["us"])
            best_any = min(cell["geometries"], key=lambda g: g["us"])
            cell.update(served_us=served["us"], best=best, best_any_split=best_any)
            cells.append(cell)
            by_load = " ".join(f"{load} {min(g['us'] for g in ours if g['load'] == load):.1f}"
                               for load in loads if any(g["load"] == load for g in ours))
            print(f"N={n:>5} K={k:>5} rows {rows:>3}: mlx {t_mlx * 1e6:7.1f} us | served {cell['served']} "
                  f"{served['us']:7.1f} us | best {best['maxt'], best['mt'], best['u']} {best['load']} "
                  f"{best['us']:7.1f} us ({best['gbps']:6.0f} GB/s) | any split: W{best_any['warps']} "
                  f"{best_any['maxt'], best_any['mt'], best_any['u']} {best_any['us']:7.1f} us | by load: {by_load}",
                  flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"mlx": mx.__version__, "cold": args.cold, "cells": cells, "failures": failures,
                               "refused": {f"WARPS={w} {g} {load}": why for (w, g, load), why in refused.items()}},
                              f, indent=1)
    return cells, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--seconds", type=float, default=240)
    parser.add_argument("--warps", default="8", help="K splits to sweep, e.g. 8,4,16 (each template of another "
                        "split is a compile of its own: on the H200 three splits printed no cell in 110 s)")
    parser.add_argument("--rows", help="row counts to time, e.g. 1,4,8 (default: 1 to 128)")
    parser.add_argument("--shapes", help="N x K shapes to time, e.g. 2048x2048,2048x8192 "
                                         "(default: the 1B's and 8192^2)")
    parser.add_argument("--cold", action="store_true", help="read the weights from HBM in every call, as a decode "
                        "does (calls cycle through copies filling 512 MB)")
    parser.add_argument("--loads", default="plain", help="16-byte load flavours to time, e.g. plain,l2-256 (the "
                        "first is the served one): " + ", ".join(LOADS))
    parser.add_argument("--served-only", action="store_true", help="time the served geometry alone (per flavour)")
    parser.add_argument("--only", help="sweep these geometries alone, MAXT:MT:U with * for any, e.g. 2:*:*,4:1:1 "
                        "(each geometry of a split is a build of its own: the 16-warp sweep's took 70 s a cell)")
    args = parser.parse_args()
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        print("the tile sweep times the cuda source: no CUDA device here", file=sys.stderr)
        return 2
    _, failures = sweep(args)
    for failure in failures:
        print("FAIL" if "differs" in failure else "NOTE", failure, file=sys.stderr)
    return 1 if any("differs" in f for f in failures) else 0


if __name__ == "__main__":
    sys.exit(main())
