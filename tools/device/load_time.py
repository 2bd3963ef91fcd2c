"""How long a target takes to load, each way in a fresh process: the self-test off, then on twice over one new file
of remembered passes (the first load runs the self-test's cases and writes their passes; the second reads them).

    python3 tools/device/load_time.py TARGET [--dtype bfloat16]

Run it through run_on_h200.sh exec on the GPU, where the self-test builds kernels the served path does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
start = time.perf_counter()
from tensorfold_core.loading import load_target
from tensorfold_core.options import ServeOptions
target = load_target(sys.argv[1], ServeOptions(dtype=sys.argv[2]))
failed = [op for op, label in target.model.kernels.items() if "self-test" in label]
print(json.dumps({"seconds": round(time.perf_counter() - start, 2), "failed": failed}))
"""

WAYS = (("self-test off", "0"), ("self-test on, nothing remembered", "1"), ("self-test on, passes remembered", "1"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        remembered = Path(tmp) / "self-test.json"
        for what, self_test in WAYS:
            env = dict(os.environ, TENSORFOLD_SELF_TEST=self_test, TENSORFOLD_SELF_TEST_CACHE=str(remembered))
            done = subprocess.run([sys.executable, "-c", CHILD, args.target, args.dtype], env=env,
                                  capture_output=True, text=True)
            if done.returncode:
                print(f"{what}: the load failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            out = json.loads(done.stdout.strip().splitlines()[-1])
            kept = len(json.loads(remembered.read_text())) if remembered.exists() else 0
            print(f"{what:34s} {out['seconds']:7.2f} s  passes remembered {kept}"
                  f"{'  failed: ' + ', '.join(out['failed']) if out['failed'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
