"""Check every metal source and planted metal control as C++, wrapped as MLX wraps it, on a machine with no Metal."""

# MLX's metal_kernel wraps a body in a signature of its own (mlx/backend/common/metal_kernel.cpp): a template over
# the launch's template arguments, an argument per input and output, and an argument for each thread attribute whose
# name the body holds. This writes that text over a C++ stand-in for the Metal Shading Language (metal_shim.py) and
# has the host's C++ compiler check its syntax and types, so a kernel author learns of an undeclared name or a type
# slip before the kernel meets an Apple GPU. `--emulate` then runs each metal source on the host's threads
# (metal_emu.py) against its record's reference: what it reads, writes and sums, not Metal's own rounding; with
# `--gate4`, gate 4 too, emulated, and the planted metal gate-4 controls must go red there.
#     python -m tensorfold_contract.metal [--only NAME] [--quick] [--compiler g++] [--emulate [--gate4]]

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile

from .kernel_text import served_text
from .metal_shim import ATTRIBUTES, SHIM, compiler, mtype, template
from .record import Source
from .registry import discover
from .texts import builds

def generated(source: Source, name: str, inputs: list, launch) -> str:
    """The kernel text MLX's metal_kernel writes for this source, these inputs and this launch (less its Metal
    prelude, which the shim stands in for)."""
    body, header = served_text(source.body), served_text(source.header)
    params = []
    for arg, a in zip(source.input_names, inputs):
        space = "constant" if a.size < 8 else "device"  # MLX passes an array of fewer than 8 elements as constant
        params.append(f"  const {space} {mtype(a.dtype)}{'&' if a.ndim == 0 else '*'} {arg}")
        if a.ndim > 0:
            for suffix, kind in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                                 ("_ndim", "const constant int&")):
                if arg + suffix in body:
                    params.append(f"  {kind} {arg}{suffix}")
    params += [f"  device {mtype(d)}* {out}" for out, d in zip(source.output_names, launch.output_dtypes)]
    params += [f"  {kind} {attr}" for attr, kind in ATTRIBUTES.items() if attr in body]
    text = SHIM + header + "\n"
    declared, instance = template(launch)
    text += declared
    text += f"void {name}(\n" + ",\n".join(params) + ") {\n" + body + "\n}\n"
    if instance:
        text += f"template decltype({name}{instance}) {name}{instance};\n"
    return text


def instances(reg, quick: bool) -> list[tuple[str, str]]:
    """(label, text) for each distinct build the record's metal source and its planted metal controls need."""
    if not isinstance(reg.record.implementations.get("metal"), Source):
        return []
    return [(label, text) for label, text, _ in builds(reg.record, "metal", generated, quick)]


def check_one(text: str, cxx: str) -> tuple[bool, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(text)
    try:
        done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Werror=vla", f.name],
                              capture_output=True, text=True)
        return done.returncode == 0, done.stdout + done.stderr
    finally:
        os.unlink(f.name)


def check(only=(), quick: bool = False, cxx: str | None = None) -> list[tuple[str, bool, str]]:
    """(label, ok, compiler output) of each build of the chosen records' metal sources and controls."""
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++ or clang++)")
    jobs = [job for reg in discover() if reg.record is not None and (not only or reg.matches(list(only)))
            for job in instances(reg, quick)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda job: check_one(job[1], cxx), jobs))
    return [(label, ok, log) for (label, _), (ok, log) in zip(jobs, results)]


GATE4_ROWS = 17  # a GEMV's tiles change past 8 and past 16 rows


def missed_controls(records) -> int:
    """Each planted metal gate-4 control of `records` under the emulated gate 4: printed; how many stayed green."""
    from .metal_emu import emulated_gate4

    missed = 0
    for record in records:
        for control in (c for c in record.controls if c.kind == "metal" and c.gate == 4):
            ok, why = emulated_gate4(record, control.plant(record.implementations["metal"]),
                                     rows=min(GATE4_ROWS, record.max_rows))
            missed += ok
            print(f"{'red ' if not ok else 'MISS'} {record.name} control {control.name!r} [metal, emulated]"
                  f"{': ' + why if not ok else ': gate 4 stayed green'}")
    return missed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorfold_contract.metal", description=__doc__)
    parser.add_argument("--only", action="append", default=[], help="a kernel, family or plugin name (globs)")
    parser.add_argument("--quick", action="store_true", help="one build per source text (the widest window)")
    parser.add_argument("--compiler", help="the C++ compiler (default: $CXX, g++ or clang++)")
    parser.add_argument("--emulate", action="store_true",
                        help="then run each metal source emulated on its first served shape: against its reference, "
                             "and its rows at 1, 2, 3 and 9 rows a call")
    parser.add_argument("--gate4", action="store_true",
                        help="with --emulate: gate 4 emulated on every served shape that is not heavy, each call of "
                             f"1 to {GATE4_ROWS} rows (past both of a GEMV's tile changes), and each planted metal "
                             "gate-4 control must go red there")
    args = parser.parse_args(argv)
    if args.compiler:
        os.environ["CXX"] = args.compiler
    try:
        results = check(args.only, args.quick, args.compiler)
    except RuntimeError as exc:
        print(f"tensorfold_contract.metal: {exc}", file=sys.stderr)
        return 2
    for label, ok, log in results:
        print(f"{'ok  ' if ok else 'FAIL'} {label}")
        if not ok:
            print("\n".join(line for line in log.splitlines() if "error" in line)[:2000])
    failed = sum(not ok for _, ok, _ in results)
    print(f"{len(results) - failed} of {len(results)} metal builds checked as C++")
    if args.emulate and not failed:
        from .metal_emu import emulated, emulated_gate4, emulated_rows

        chosen = [reg.record for reg in discover() if reg.record is not None and isinstance(
            reg.record.implementations.get("metal"), Source) and (not args.only or reg.matches(args.only))]
        for record in chosen:
            ok, why = emulated(record)
            if ok:
                ok, why = emulated_gate4(record, rows=min(GATE4_ROWS, record.max_rows)) if args.gate4 else \
                    emulated_rows(record)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {record.name} [metal, emulated]{'' if ok else ': ' + why}")
        print(f"{len(chosen) - failed} of {len(chosen)} metal sources matched their references, emulated")
        if args.gate4:
            failed += missed_controls(chosen)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
