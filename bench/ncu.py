"""Nsight Compute for the kernel benches: a child of the bench run under `ncu`, each kernel's median device time."""

from __future__ import annotations

import csv
import glob
import io
import os
import shutil
import statistics
import subprocess
import sys


def kernel_medians(script: str, args: list[str], env: dict[str, str], label_of) -> dict[str, float]:
    """Median us a launch by label, past each label's first launch (a bits check), for `script ARGS` run under
    `ncu --clock-control none --cache-control none` with `env` added; `label_of(kernel name)` names a kernel's label
    (None: not counted)."""
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if ncu is None:
        raise SystemExit(f"{os.path.basename(script)}: Nsight Compute's ncu is not on this machine")
    command = [ncu, "--clock-control", "none", "--cache-control", "none", "--csv", "--metrics",
               "gpu__time_duration.sum", sys.executable, script, *args]
    out = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, **env))
    if '"ID"' not in out.stdout:
        raise SystemExit(f"ncu gave no table: {out.stderr[-2000:]}")
    times: dict[str, list[float]] = {}
    for row in csv.DictReader(io.StringIO(out.stdout[out.stdout.index('"ID"'):])):
        label = label_of(row["Kernel Name"])
        if label is not None:
            scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3}.get(row["Metric Unit"], 1e-3)
            times.setdefault(label, []).append(float(row["Metric Value"].replace(",", "")) * scale)
    return {label: statistics.median(values[1:] or values) for label, values in times.items()}
