#!/usr/bin/env bash
# Stage a run on the remote H200 (the device tool's `run`): MLX's CUDA wheel in two halves, and the shipped weights
# left out of the upload while the halves travel, so that each call stays under its 64 MiB. docs/gpu.md says why.
# Usage, from anywhere in the checkout:
#   tools/device/stage.sh light   fetch the halves into .mlxa/ and .mlxb/ if missing, leave the weights out of the
#                                 upload, and print the run calls to make
#   tools/device/stage.sh full    put the weights back into the upload (after the MLX calls, or when done)
#   tools/device/stage.sh sizes   what each call would upload now, in MiB
# The weights are left out through .git/info/exclude, between two marker lines that `full` removes; git keeps
# tracking them, so nothing in the repository changes. MLX_FETCH names fetch-mlx-cuda.sh if it is not beside
# the checkout in ../shared/device/.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=.git/info/exclude
begin="# tensorfold stage.sh: weights left out of the device upload (tools/device/stage.sh full puts them back)"
end="# tensorfold stage.sh: end"
limit=$((64 * 1024 * 1024))

weights() {  # the shipped model folders, as exclude patterns anchored at the root
  git ls-files 'plugins/*/tensorfold_*/models/*' | cut -d/ -f1-4 | sort -u | sed 's|^|/|; s|$|/|'
}

unstage() {
  [ -f "$exclude" ] || return 0
  sed -i "/^$(printf '%s' "$begin" | sed 's/[][\/.*^$]/\\&/g')\$/,/^$(printf '%s' "$end" | sed 's/[][\/.*^$]/\\&/g')\$/d" "$exclude"
}

bytes_of_tree() {  # tracked and untracked-not-ignored files, less the weights while they are staged out
  local files
  files=$(git ls-files -co --exclude-standard)
  if grep -qxF "$begin" "$exclude" 2>/dev/null; then
    files=$(printf '%s\n' "$files" | grep -v -F -f <(weights | sed 's|^/||') || true)
  fi
  printf '%s\n' "$files" | tr '\n' '\0' | xargs -0 stat -c %s 2>/dev/null | awk '{n += $1} END {print n + 0}'
}

bytes_of() { if [ -e "$1" ]; then du -sb "$1" | cut -f1; else echo 0; fi; }

sizes() {
  local tree a b
  tree=$(bytes_of_tree)
  a=$(bytes_of .mlxa)
  b=$(bytes_of .mlxb)
  awk -v t="$tree" -v a="$a" -v b="$b" -v lim="$limit" 'BEGIN {
    split("call 1 (tree + .mlxa)|call 2 (tree + .mlxb)|a call with no carry", name, "|")
    n[1] = t + a; n[2] = t + b; n[3] = t
    for (i = 1; i <= 3; i++) printf "  %-24s %6.1f MiB%s\n", name[i], n[i] / 1048576, (n[i] > lim ? "   OVER the 64 MiB limit" : "")
  }'
}

case "${1:-}" in
  light)
    if [ ! -f .mlxa/part.aa ] || [ ! -f .mlxb/install.sh ]; then
      fetch=${MLX_FETCH:-$root/../shared/device/fetch-mlx-cuda.sh}
      [ -x "$fetch" ] || [ -f "$fetch" ] || { echo "no $fetch: set MLX_FETCH to fetch-mlx-cuda.sh" >&2; exit 2; }
      bash "$fetch" > /dev/null
    fi
    for d in /.mlxa/ /.mlxb/; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
    unstage
    { echo "$begin"; weights; echo "$end"; } >> "$exclude"
    commit=$(git rev-parse --short HEAD)$([ -n "$(git status --porcelain --untracked-files=no)" ] && echo +dirty)
    echo "Staged: MLX $(cat .mlxb/VERSION) in .mlxa/ and .mlxb/; the weights are left out of the upload."
    sizes
    cat <<MSG

Make these two run calls back to back (the machine goes back 30 s after a call, taking the first half with it):
  1. run(kind="nvidia-h200", carry=[".mlxa"], timeout_s=120,
         command="mkdir -p /root/mlxw && cp .mlxa/part.aa /root/mlxw/ && nvidia-smi -L")
  2. run(carry=[".mlxb"], timeout_s=600,
         command="bash .mlxb/install.sh && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TF_COMMIT=$commit && bash contract/receipts/run_on_h200.sh contract")
Later calls on the same warm machine start with: export PYTHONPATH=/tmp/site (MLX stays in /tmp/site).
A step that needs the weights: run tools/device/stage.sh full here first, then make the call (no carry).
MSG
    ;;
  full)
    unstage
    echo "The weights travel again with each call."
    sizes
    ;;
  sizes)
    sizes
    ;;
  *)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
