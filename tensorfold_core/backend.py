"""Facts about the MLX backend this process runs on: device, and whether its ops are row-invariant."""

from __future__ import annotations

import platform

import mlx.core as mx

from .kernels import RECORDS_KIND, backend


def device_info() -> dict:
    from .row_kernels.modules import compiling

    device = mx.default_device()
    # on a GPU whether a family compiles depends on its records; on the CPU on MLX's compiler and TENSORFOLD_COMPILE
    compiled = {"layers_compiled": compiling({}, RECORDS_KIND["cpu"])} if backend() == "cpu" else {}
    return {"backend": "cpu" if device.type == mx.cpu else "gpu", "device": str(device),
            "metal": mx.metal.is_available(), "platform": platform.platform(), "mlx": mx.__version__, **compiled}


def release_thread() -> None:
    """Free the calling thread's MLX streams and compile cache now: the last thing a thread that ran MLX does."""
    # left to the thread's exit, they go after join() returns and may meet the interpreter's teardown: SIGABRT
    mx.clear_streams()


def _rows_invariant(op, x: mx.array, max_rows: int = 16) -> bool:
    """Each row of a k-row call must be bit-equal to its own 1-row call."""
    singles = [op(x[i:i + 1]) for i in range(max_rows)]
    for k in (2, 3, 4, 8, max_rows):
        many = op(x[:k])
        if not all(mx.array_equal(many[i:i + 1], singles[i]).item() for i in range(k)):
            return False
    return True


def backend_row_invariance(dim: int = 256) -> dict:
    """Probe matmul (fp32, bf16), 4-bit quantized matmul and SDPA for row invariance on this device."""
    mx.random.seed(0)
    x = mx.random.normal((16, dim))
    w = mx.random.normal((dim, dim)) / dim ** 0.5
    qw, scales, biases = mx.quantize(w, group_size=64, bits=4)
    keys = mx.random.normal((1, 4, 32, 64))
    values = mx.random.normal((1, 4, 32, 64))

    def sdpa(rows):
        q = mx.broadcast_to(rows[:, :64].reshape(1, 1, -1, 64), (1, 4, rows.shape[0], 64))
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125)[0, 0]

    wide = mx.random.normal((640, dim)) / dim ** 0.5  # the x @ W.T layout and odd widths models really run
    narrow = mx.random.normal((dim, 640)) / 640 ** 0.5
    x_wide = mx.random.normal((16, 640))
    checks = {
        "matmul_float32": _rows_invariant(lambda r: r @ w, x),
        "linear_float32": _rows_invariant(lambda r: r @ wide.T, x) and _rows_invariant(lambda r: r @ narrow.T, x_wide),
        "matmul_bfloat16": _rows_invariant(lambda r: r @ w.astype(mx.bfloat16), x.astype(mx.bfloat16)),
        # None, not probed, on CUDA: MLX 0.32.4's quantized_matmul there builds a kernel for ~40 s at its first call
        # of 8+ rows of each shape (docs/gpu.md); the families' quantized projections run their kernel records there
        "quantized_matmul_4bit": None if backend() == "cuda" else _rows_invariant(
            lambda r: mx.quantized_matmul(r, qw, scales, biases, transpose=True, group_size=64, bits=4), x),
        "sdpa": _rows_invariant(sdpa, x),
    }
    return {"row_invariant": all(checks.values()), "ops": checks}  # one not probed (None) counts as not invariant
