"""Which implementations this device runs, and the launch limits recorded for each device kind (gate 5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Limits:
    """What one launch may ask of a device kind: threads per group, group dims and shared (threadgroup) memory."""

    name: str
    kind: str  # the implementation kind these limits bind: "cuda" or "metal"
    max_threads: int
    max_group: tuple[int, int, int]
    max_static_shared: int  # bytes a body may declare
    max_shared: int  # bytes in all, dynamic included (CUDA: after the opt-in MLX makes past 48000)
    max_grid: tuple[int, int, int]  # groups per dimension
    source: str = ""


_CUDA_GRID = (2**31 - 1, 65535, 65535)
# Apple's Metal feature set tables: every M-series GPU (Apple7 to Apple10 families) allows 1024 threads per
# threadgroup and 32 KiB of threadgroup memory; M5 is assumed to keep M4's limits until Apple says otherwise.
_APPLE = [Limits(f"Apple M{n}", "metal", 1024, (1024, 1024, 1024), 32768, 32768, (2**32 - 1,) * 3,
                 "Metal feature set tables" + (" (assumed as M4)" if n == 5 else "")) for n in range(1, 6)]
# CUDA programming guide, compute capability 9.0: 1024 threads per block, 48 KiB static shared memory, up to
# 227 KiB per block with the dynamic opt-in.
SM90 = Limits("NVIDIA sm_90", "cuda", 1024, (1024, 1024, 64), 49152, 232448, _CUDA_GRID,
              "CUDA C++ programming guide, compute capability 9.0")
_CUDA_BY_ARCH = {
    "sm_80": Limits("NVIDIA sm_80", "cuda", 1024, (1024, 1024, 64), 49152, 166912, _CUDA_GRID),
    "sm_86": Limits("NVIDIA sm_86", "cuda", 1024, (1024, 1024, 64), 49152, 101376, _CUDA_GRID),
    "sm_89": Limits("NVIDIA sm_89", "cuda", 1024, (1024, 1024, 64), 49152, 101376, _CUDA_GRID),
    "sm_90": SM90,
    "sm_100": Limits("NVIDIA sm_100", "cuda", 1024, (1024, 1024, 64), 49152, 232448, _CUDA_GRID),
    "sm_120": Limits("NVIDIA sm_120", "cuda", 1024, (1024, 1024, 64), 49152, 101376, _CUDA_GRID),
}
RECORDED: tuple[Limits, ...] = (*_APPLE, SM90)


@dataclass(frozen=True)
class Device:
    """The device this process runs on: its backend, name, what it can run, and its own limits if known."""

    backend: str  # "cpu", "cuda" or "metal"
    name: str
    mlx: str
    runs: tuple[str, ...]
    limits: Limits | None

    def reason_not_run(self, kind: str) -> str:
        return {"cuda": "not run (no CUDA device)", "metal": "not run (no Metal device)"}.get(kind, "not run")

    def as_json(self) -> dict:
        return {"backend": self.backend, "name": self.name, "mlx": self.mlx, "runs": list(self.runs),
                "limits": asdict(self.limits) if self.limits else None}


def _info(mx) -> dict:
    for get in (getattr(mx, "device_info", None), getattr(mx.metal, "device_info", None)):
        try:
            return dict(get()) if get else {}
        except Exception:  # an older MLX, or no GPU: the name is only for the report
            continue
    return {}


def current() -> Device:
    """Probe MLX once: Metal, CUDA or CPU, and the limits recorded for this GPU (None where unknown)."""
    import mlx.core as mx

    info = _info(mx)
    if mx.metal.is_available():
        name = str(info.get("device_name", "Apple GPU"))
        limits = next((lim for lim in _APPLE if name.startswith(lim.name)), _APPLE[0])
        return Device("metal", name, mx.__version__, ("mlx", "metal"), _current(limits))
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        arch = str(info.get("architecture", ""))
        limits = _CUDA_BY_ARCH.get(arch, SM90 if not arch else
                                   Limits(f"NVIDIA {arch}", "cuda", 1024, (1024, 1024, 64), 49152, 49152,
                                          _CUDA_GRID, "unknown architecture: the portable minimum"))
        name = f"{info.get('device_name', 'NVIDIA GPU')} ({arch or 'arch unknown'})"
        return Device("cuda", name, mx.__version__, ("mlx", "cuda"), _current(limits))
    name = str(info.get("device_name") or info.get("architecture") or "cpu")
    return Device("cpu", name, mx.__version__, ("mlx",), None)


def _current(limits: Limits) -> Limits:
    return Limits(f"this device ({limits.name})", limits.kind, limits.max_threads, limits.max_group,
                  limits.max_static_shared, limits.max_shared, limits.max_grid, limits.source)


def limits_for(kind: str, device: Device) -> list[Limits]:
    """The recorded limits a `kind` source must meet: every device kind of its API, and this device's own."""
    out = [lim for lim in RECORDED if lim.kind == kind]
    if device.limits is not None and device.limits.kind == kind:
        out.append(device.limits)
    return out


def check(launch, limits: Limits) -> list[str]:
    """Each way `launch` breaks `limits`, in words."""
    problems = []
    if launch.threads > limits.max_threads:
        problems.append(f"{launch.threads} threads per group > {limits.max_threads}")
    for axis, (size, top) in enumerate(zip(launch.threadgroup, limits.max_group)):
        if size > top:
            problems.append(f"group dim {'xyz'[axis]} {size} > {top}")
    if launch.static_shared > limits.max_static_shared:
        problems.append(f"{launch.static_shared} B static shared > {limits.max_static_shared}")
    if launch.shared > limits.max_shared:
        problems.append(f"{launch.shared} B shared > {limits.max_shared}")
    for axis, (threads, group, top) in enumerate(zip(launch.grid, launch.threadgroup, limits.max_grid)):
        if group > 0 and -(-threads // group) > top:
            problems.append(f"{-(-threads // group)} groups along {'xyz'[axis]} > {top}")
    return problems
