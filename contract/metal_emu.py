"""Run a metal source on the host: its text compiled as C++ over an emulated SIMT threadgroup, for the contract's
references to judge on a machine with no Apple GPU (what it reads, writes and sums, not Metal's last bits)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile

import numpy as np

from .kernel_text import served_text
from .metal_shim import ATTRIBUTES, compiler, mtype, template
from .metal_emu_runtime import LAUNCH, PRELUDE
from .record import Source

_CACHE = os.path.join(tempfile.gettempdir(), "tensorfold-metal-emu")

# each attribute's value for thread i of the group, from the launch's sizes (x varies fastest)
_VALUES = {
    "thread_index_in_simdgroup": "(uint)(i % 32)", "simdgroup_index_in_threadgroup": "(uint)(i / 32)",
    "thread_index_in_threadgroup": "(uint)i", "threads_per_simdgroup": "32u", "thread_execution_width": "32u",
    "simdgroups_per_threadgroup": "(uint)((tf_count + 31) / 32)",
    "thread_position_in_threadgroup": "uint3{(uint)lx, (uint)ly, (uint)lz}",
    "threadgroup_position_in_grid": "uint3{(uint)tf_group[0], (uint)tf_group[1], (uint)tf_group[2]}",
    "thread_position_in_grid": "uint3{(uint)(tf_group[0] * tf_size[0] + lx), (uint)(tf_group[1] * tf_size[1] + ly), "
                               "(uint)(tf_group[2] * tf_size[2] + lz)}",
    "threads_per_threadgroup": "uint3{(uint)tf_actual[0], (uint)tf_actual[1], (uint)tf_actual[2]}",
    "threads_per_grid": "uint3{(uint)tf_grid[0], (uint)tf_grid[1], (uint)tf_grid[2]}",
    "threadgroups_per_grid": "uint3{(uint)((tf_grid[0] + tf_size[0] - 1) / tf_size[0]), "
                             "(uint)((tf_grid[1] + tf_size[1] - 1) / tf_size[1]), "
                             "(uint)((tf_grid[2] + tf_size[2] - 1) / tf_size[2])}",
}


def program(source: Source, inputs: list, launch) -> str:
    """The C++ that runs `source` for these inputs and this launch: the kernel as MLX would template it, then the
    entry each emulated thread calls it through."""
    body = served_text(source.body)
    for name in source.input_names:
        if any(name + suffix in body for suffix in ("_shape", "_strides", "_ndim")):
            raise NotImplementedError(f"{source.name}: {name}'s shape or strides are not emulated")
    attrs = [a for a in ATTRIBUTES if a in body]
    missing = [a for a in attrs if a not in _VALUES]
    if missing:
        raise NotImplementedError(f"{source.name}: the attribute {missing[0]} is not emulated")
    params = [f"const {mtype(a.dtype)}{'&' if a.ndim == 0 else '*'} {n}" for n, a in zip(source.input_names, inputs)]
    params += [f"{mtype(d)}* {n}" for n, d in zip(source.output_names, launch.output_dtypes)]
    params += [f"{ATTRIBUTES[a]} {a}" for a in attrs]
    declared, instance = template(launch)
    text = PRELUDE + served_text(source.header) + "\n" + declared
    text += "void tf_kernel(" + ", ".join(params) + ") {\n" + body + "\n}\n"
    args = [f"{'*' if a.ndim == 0 else ''}(const {mtype(a.dtype)}*)tf_buffers[{k}]" for k, a in enumerate(inputs)]
    args += [f"({mtype(d)}*)tf_buffers[{len(inputs) + k}]" for k, d in enumerate(launch.output_dtypes)]
    args += attrs
    call = "tf_kernel" + instance
    text += ("static void tf_entry() {\n  const int i = tf_cur;\n  const int lx = i % tf_actual[0], "
             "ly = (i / tf_actual[0]) % tf_actual[1], lz = i / (tf_actual[0] * tf_actual[1]);\n"
             "  (void)lx; (void)ly; (void)lz;\n"
             + "".join(f"  const {ATTRIBUTES[a]} {a} = {_VALUES[a]};\n" for a in attrs)
             + f"  {call}({', '.join(args)});\n}}\n")
    return text + LAUNCH


def _library(text: str):
    """The program built into a shared library (cached by its text), loaded."""
    os.makedirs(_CACHE, exist_ok=True)
    path = os.path.join(_CACHE, hashlib.sha1(text.encode()).hexdigest()[:16] + ".so")
    if not os.path.exists(path):
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (set CXX, or install g++ or clang++)")
        with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
            f.write(text)
        try:
            done = subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                                   "-Wno-attributes", "-o", path + ".tmp", f.name], capture_output=True, text=True)
        finally:
            os.unlink(f.name)
        if done.returncode:
            raise RuntimeError("the metal source does not build as C++:\n" + "\n".join(
                line for line in done.stderr.splitlines() if "error" in line)[:2000])
        os.replace(path + ".tmp", path)
    return ctypes.CDLL(path)


def _host(a) -> np.ndarray:
    """An mx.array's bytes on the host, bf16 as its uint16 bits, contiguous."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def run_source(source: Source, case) -> dict:
    """One launch of a metal source on the case, emulated; its outputs as mx.arrays (poison where never written)."""
    import mlx.core as mx

    from .gates import _poison

    source = source.at(case)
    launch = source.launch(case)
    inputs = source.inputs(case)
    poison = _poison(launch.output_dtypes)
    outs = []
    for shape, dtype in zip(launch.output_shapes, launch.output_dtypes):
        full = mx.full(shape, poison, dtype=mx.float32).astype(dtype)  # as MLX's init_value fills it
        filled = np.array(full.view(mx.uint16) if dtype == mx.bfloat16 else full)
        outs.append(np.ascontiguousarray(filled))
    if 0 not in launch.grid:
        hosts = [_host(a) for a in inputs]
        lib = _library(program(source, inputs, launch))
        buffers = (ctypes.c_void_p * (len(hosts) + len(outs)))(*[h.ctypes.data for h in (*hosts, *outs)])
        error = ctypes.create_string_buffer(400)
        grid = (ctypes.c_int * 3)(*launch.grid)
        size = (ctypes.c_int * 3)(*launch.threadgroup)
        if lib.tf_launch(buffers, grid, size, error, 400):
            raise RuntimeError(error.value.decode())
    arrays = [mx.array(o).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(o)
              for o, d in zip(outs, launch.output_dtypes)]
    return source.outputs(arrays, case)


def _first_shape(record):
    """The record's first served shape that is not heavy: small enough to emulate."""
    return next((s for s in record.shapes if not s.heavy and s.rows > 0), record.shapes[0])


def emulated(record, kind_source: Source | None = None, rows: int = 3) -> tuple[bool, str]:
    """The record's metal source (or `kind_source`, a planted one) run emulated on its first served shape that is
    not heavy, against the record's float64 reference: (ok, why)."""
    from .gates import compare, make_case

    source = kind_source or record.implementations["metal"]
    shape = _first_shape(record)
    try:
        case = make_case(record, shape, min(rows, shape.rows), np.random.default_rng(0))
        ok, why, _ = compare(record, case, run_source(source, case), record.reference(case))
    except (RuntimeError, NotImplementedError) as exc:
        ok, why = False, f"{shape.label}: {exc}"
    return ok, why


def emulated_rows(record, source: Source | None = None, singles: int = 3, wide: int = 9) -> tuple[bool, str]:
    """Gate 4 in small, emulated: rows 0..singles-1 of 2-, 3- and `wide`-row calls bit-equal to their 1-row calls
    (a GEMV's tiles change past 8 rows), on the record's first served shape that is not heavy."""
    from .gates import _bits, _differs, make_case

    source = source or record.implementations["metal"]
    shape = _first_shape(record)
    rows = min(wide, shape.rows, record.max_rows)
    try:
        case = make_case(record, shape, rows, np.random.default_rng(1))
        alone = [_bits(run_source(source, case.take_rows(i, i + 1))) for i in range(min(singles, rows))]
        for k in sorted({min(2, rows), min(3, rows), rows}):
            many = _bits(run_source(source, case.take_rows(0, k)))
            for i in range(min(k, len(alone))):
                name = _differs(alone[i], many, 0, i)
                if name:
                    return False, f"{shape.label}: {name} row {i} of a {k}-row call differs from its 1-row call"
    except (RuntimeError, NotImplementedError) as exc:
        return False, f"{shape.label}: {exc}"
    return True, ""


def emulated_gate4(record, source: Source | None = None, seed: int = 0, shapes=None,
                   rows: int | None = None) -> tuple[bool, str]:
    """Gate 4 as the contract runs it, emulated: on each served shape that is not heavy (or those `shapes` picks from
    them), every row of each call of 1 to `rows` rows (default: the record's most) bit-equal to its own 1-row call,
    and a repeat of the widest call equal to it: (ok, why)."""
    from .gates import Inputs, _bits_of_shape

    source = source or record.implementations["metal"]
    light = [s for s in record.shapes if not s.heavy and s.rows > 0]
    inputs = Inputs(record, seed)
    for shape in (shapes(light) if shapes else light):
        why = _bits_of_shape(record, "metal", source, shape, inputs, {}, None, [], runner=run_source, rows=rows)
        if why:
            return False, why
    return True, ""
