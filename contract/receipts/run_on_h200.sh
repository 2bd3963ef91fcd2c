#!/usr/bin/env bash
# The kernel contract and the GEMV benchmark on a CUDA machine that has MLX (PYTHONPATH=/tmp/site, see
# shared/device/README.md) but not tensorfold: the plugins' entry points are written into a throwaway site, so
# nothing is pip-installed and nothing outside numpy, pluggy and MLX is imported (no server, no pydantic).
# Usage, from the repository root:  bash contract/receipts/run_on_h200.sh [contract|bench|exact|all]   (default: all)
# `exact` (not in `all`): tools/device/gpu_exact.py, the probe and drafted == "draft": false == shared == resumed per
# family and kernel table mode (exit 1 on a records-mode mismatch); it loads models through tensorfold_core and so
# needs pydantic and llguidance (carried as wheels, docs/gpu.md). TF_EXACT_ARGS passes flags on, e.g.
# TF_EXACT_ARGS="--families llama,lfm2 --tokens 16". Writes $OUT/gpu_exact.json and $OUT/gpu_exact.txt.
# TF_CONTRACT_ARGS passes flags on, e.g. TF_CONTRACT_ARGS="--seed 7 --only *gemv*" (globs with no spaces);
# TF_CONTRACT_ORDER names an earlier --json report whose slowest records start first (default: the newest committed
# contract/receipts/h200-*/contract*.json; empty for record order).
# TF_COMMIT names the commit in env.txt (the device's copy has no .git: tools/device/stage.sh prints it).
# On a GPU each record runs in a child process of its own (--isolate is the default there): a crash in MLX fails
# the step it hit ("crashed (signal 11, SIGSEGV) in host() at gates.py:N") and the run and its JSON go on.
# Writes $OUT/contract.json, $OUT/contract.txt, $OUT/gemv.json, $OUT/gemv.txt and $OUT/env.txt.
set -uo pipefail
what="${1:-all}"
root=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:-$root/contract/receipts/out}"
site=$(mktemp -d /tmp/tfsite.XXXX)
mkdir -p "$out"

python3 - "$root" "$site" <<'PY'
# one dist-info per plugin distribution, read from its pyproject.toml: the runner finds plugins only this way
import os, sys, tomllib
root, site = sys.argv[1], sys.argv[2]
os.symlink(os.path.join(root, "tensorfold_core"), os.path.join(site, "tensorfold_core"))
os.symlink(os.path.join(root, "contract"), os.path.join(site, "tensorfold_contract"))
plugins = os.path.join(root, "plugins")
for name in sorted(os.listdir(plugins)):
    toml = os.path.join(plugins, name, "pyproject.toml")
    if not os.path.exists(toml):
        continue
    project = tomllib.load(open(toml, "rb"))["project"]
    points = project.get("entry-points", {}).get("tensorfold", {})
    listed = tomllib.load(open(toml, "rb")).get("tool", {}).get("setuptools", {}).get("packages", [])
    for package in sorted({p.split(".")[0] for p in listed}):
        os.symlink(os.path.join(plugins, name, package), os.path.join(site, package))
    info = os.path.join(site, f"{project['name'].replace('-', '_')}-{project['version']}.dist-info")
    os.mkdir(info)
    open(os.path.join(info, "METADATA"), "w").write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    open(os.path.join(info, "entry_points.txt"), "w").write("[tensorfold]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    print(f"plugin {project['name']} {project['version']}: {', '.join(f'{k} = {v}' for k, v in points.items())}")
PY
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; python3 --version
  python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available())'
  echo "commit ${TF_COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)}"; } > "$out/env.txt" 2>&1
cat "$out/env.txt"

rc=0
if [ "$what" = contract ] || [ "$what" = all ]; then
  start=$(date +%s)
  order=${TF_CONTRACT_ORDER-$(ls "$root"/contract/receipts/h200-*/contract*.json 2>/dev/null | sort | tail -1)}
  set -f  # TF_CONTRACT_ARGS may hold --only globs: they are for the contract, not for the shell
  python3 -m tensorfold_contract --json ${order:+--order-from $order} ${TF_CONTRACT_ARGS:-} > "$out/contract.json" \
    2> "$out/contract.err"
  rc=$?
  set +f
  took=$(( $(date +%s) - start ))
  python3 - "$out/contract.json" <<'PY' | tee "$out/contract.txt"
# the report's lines, rebuilt from the JSON (one run, two views)
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    sys.exit(f"no JSON report ({exc}); see contract.err")
for k in r["kernels"]:
    for p in k["problems"]:
        print(f"{k['name']}: {p}")
    for kind, impl in k["implementations"].items():
        gates = " ".join(f"{g}:{v['status']}" for g, v in impl["gates"].items())
        print(f"{k['name']:<24} {kind:<5} {impl['status']:<26} {gates}  ({impl['seconds']} s)")
        for g, v in impl["gates"].items():
            if v["status"] in ("fail", "known"):
                print(f"{'':<24}   gate {g}: {v['detail']}")
    for c in k["controls"]:
        print(f"{'':<24}   control [{c['implementation']}] {c['name']} -> gate {c['gate']}: {c['status']}"
              + (f" ({c['detail']})" if c["status"] == "missed" else ""))
from tensorfold_contract.report import summary_line
print(f"{summary_line(r['summary'])}  (seed {r['seed']}{', each record isolated' if r.get('isolated') else ''})")
PY
  echo "contract: exit $rc in $took s (python3 -m tensorfold_contract --json ${order:+--order-from ${order#$root/} }${TF_CONTRACT_ARGS:-})" | tee -a "$out/contract.txt"
  tail -5 "$out/contract.err"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m tensorfold_llama.kernels.bench --json "$out/gemv.json" 2>&1 | tee "$out/gemv.txt"
fi
if [ "$what" = exec ]; then  # any command with tensorfold and its plugins importable: TF_EXEC="..."
  bash -c "$TF_EXEC" 2>&1 | tee "$out/exec.txt"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = exact ]; then
  python3 tools/device/gpu_exact.py --out "$out" ${TF_EXACT_ARGS:-} 2>&1 | tee "$out/gpu_exact.txt"
  rc=${PIPESTATUS[0]}
fi
rm -rf "$site"
exit $rc
