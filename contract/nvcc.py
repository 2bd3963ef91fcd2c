"""Compile every cuda source and planted cuda control with nvcc for sm_90, as MLX would, on a machine with no GPU."""

# MLX wraps a custom kernel's body in a signature of its own; this writes that same text and hands it to nvcc, so
# an author learns of a syntax slip, a register spill or an undeclared shared array before the kernel meets a GPU.
# It needs nvcc and MLX's device headers (the mlx-cuda wheel embeds them in libmlx.so): `--include` names a folder
# holding mlx/backend/cuda/device/utils.cuh and cccl/; `--headers-from` fills such a folder from the wheel first.
#     python -m tensorfold_contract.nvcc --include DIR [--headers-from mlx_cuda_13-*.whl] [--only NAME] [--quick]

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import zipfile

from .kernel_text import served_text
from .record import Source
from .registry import discover
from .texts import builds

_CTYPES = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
           "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
           "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}

MLX_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""


def ctype(dtype) -> str:
    return _CTYPES[str(dtype).rsplit(".", 1)[-1]]


def generated(source: Source, name: str, inputs: list, launch) -> str:
    """The kernel text MLX 0.32's CUDA backend compiles for this source, these inputs and this launch."""
    body = served_text(source.body)
    params = []
    for arg, a in zip(source.input_names, inputs):
        params.append(f"    const {ctype(a.dtype)}* {arg}")
        if a.ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if arg + suffix in body:
                    params.append(f"    const __grid_constant__ {kind} {arg}{suffix}")
    params += [f"    {ctype(d)}* {out}" for out, d in zip(source.output_names, launch.output_dtypes)]
    consts = []
    for key, value in launch.template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {key} = {value};")
        else:
            consts.append(f"  using {key} = {ctype(value)};")
    return (MLX_HEADER + served_text(source.header)
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + "\n".join(consts) + "\n\n"
            + body + "\n}\n\n} // namespace mlx::core::cu\n")


REGISTERS_A_BLOCK = 65536  # what one block may hold on sm_90: a launch asking more fails ("too many resources")


def instances(reg, quick: bool) -> list[tuple[str, str, int, int]]:
    """(label, text, declared static shared bytes, threads a block) for each distinct build the record's cuda
    sources need."""
    return [(label, text, launch.static_shared, launch.threadgroup[0] * launch.threadgroup[1] * launch.threadgroup[2])
            for label, text, launch in builds(reg.record, "cuda", generated, quick)]


def compile_one(text: str, include: str, arch: str) -> tuple[bool, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as f:
        f.write(text)
    try:
        cmd = ["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", f"-I{include}", f"-I{os.path.join(include, 'cccl')}",
               "-Xptxas", "-v", "-o", os.devnull, f.name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        return done.returncode == 0, done.stdout + done.stderr
    finally:
        os.unlink(f.name)


def usage(log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    smem = re.search(r"(\d+) bytes smem", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)) if regs else None, "smem": int(smem.group(1)) if smem else 0,
            "spill": int(spill.group(1)) if spill else 0}


# The device headers MLX's JIT includes, found in libmlx.so by a line only each of them holds.
_EMBEDDED = {"utils.cuh": b"using Shape = cuda::std::array", "config.h": b"#define MAX_NDIM",
             "complex.cuh": b"LIBCUDACXX_ENABLE_SIMPLIFIED_COMPLEX_OPERATIONS"}


def extract_headers(wheel: str, dest: str) -> None:
    """Unpack the CUDA device headers MLX embeds in libmlx.so, and its cccl/, from an mlx-cuda wheel into `dest`."""
    with zipfile.ZipFile(wheel) as z:
        lib = z.read("mlx/lib/libmlx.so")
        for name in z.namelist():
            if name.startswith("mlx/include/cccl/") and not name.endswith("/"):
                path = os.path.join(dest, name[len("mlx/include/"):])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(z.read(name))
    folder = os.path.join(dest, "mlx", "backend", "cuda", "device")
    os.makedirs(folder, exist_ok=True)
    for name, marker in _EMBEDDED.items():
        at = lib.find(marker)
        if at < 0:
            raise SystemExit(f"{wheel}: no embedded {name} (an MLX this tool does not know)")
        start, end = lib.rfind(b"\0", 0, at) + 1, lib.find(b"\0", at)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(lib[start:end])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorfold_contract.nvcc", description=__doc__)
    parser.add_argument("--include", required=True, help="folder with mlx/backend/cuda/device/*.cuh and cccl/")
    parser.add_argument("--only", action="append", default=[], help="a kernel, family or plugin name (globs)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--quick", action="store_true", help="one build per source text (the widest window)")
    parser.add_argument("--headers-from", metavar="WHEEL", help="an mlx-cuda wheel to unpack the headers from")
    args = parser.parse_args(argv)
    if args.headers_from:
        extract_headers(args.headers_from, args.include)
    jobs = [job for reg in discover() if reg.record is not None and (not args.only or reg.matches(args.only))
            for job in instances(reg, args.quick)]
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for (label, _, declared, threads), (ok, log) in zip(jobs, pool.map(
                lambda j: compile_one(j[1], args.include, args.arch), jobs)):
            u = usage(log)
            notes = [f"{u['registers']} registers", f"{u['smem']} B smem"]
            if u["spill"]:
                notes.append(f"{u['spill']} B spilled")
            if ok and u["smem"] > declared:
                ok, log = False, f"uses {u['smem']} B of shared memory but its Launch declares {declared}"
            if ok and (u["registers"] or 0) * threads > REGISTERS_A_BLOCK:
                ok, log = False, (f"error: {u['registers']} registers x {threads} threads a block pass the "
                                  f"{REGISTERS_A_BLOCK} a block may hold: its launch fails (too many resources)")
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {label}: {', '.join(notes)}")
            if not ok:
                print("\n".join(line for line in log.splitlines() if "error" in line or "declares" in line)[:2000])
    print(f"{len(jobs) - failed} of {len(jobs)} builds compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
