#!/usr/bin/env bash
# Stage a run on the remote H200 (the device tool's `run`): MLX's CUDA wheel in two halves, and the shipped weights
# kept out of the upload while the halves travel, so that each call stays under its 64 MiB. docs/gpu.md says why.
# Usage, from anywhere in the checkout:
#   tools/device/stage.sh light   fetch the halves into .mlxa/ and .mlxb/ if missing, take the weights and the old
#                                 receipts out of the upload, and print the run calls to make
#   tools/device/stage.sh full    put the weights back (at once after the MLX calls: see below)
#   tools/device/stage.sh weights the weights back, the receipts out instead (but the newest contract JSON, which
#                                 run_on_h200.sh orders the contract by), and the DSpark drafters' dirs (no GPU step
#                                 reads them; a call that needs one carries it): the tree with every weight and every
#                                 receipt passed the 64 MiB a call may send; `full` puts everything back
#   tools/device/stage.sh sizes   what each call would upload now, in MiB
#   tools/device/stage.sh head    .head/code.tar.gz: HEAD's code (no weights, compressed: the tree with the weights
#                                 is ~61.5 of the 64 MiB); a call that carries .head and starts with
#                                 `tar xzf .head/code.tar.gz` runs the commit, not a colleague's unsaved edits
# The device tool uploads every file git tracks, ignore rules or not, so `light` takes the weights out of git's
# index (the files stay on disk; the entries are saved in .git/) and ignores them through .git/info/exclude;
# `full` puts the saved entries back exactly. Until then `git status` shows the weights as deleted: run `full`
# right after the calls that carry MLX; until then a pre-commit hook refuses commits (they would delete the weights).
# MLX_FETCH names fetch-mlx-cuda.sh if not in ../shared/device/.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=.git/info/exclude
saved=.git/tensorfold-stage-weights.index
begin="# tensorfold stage.sh: weights kept out of the device upload (tools/device/stage.sh full puts them back)"
end="# tensorfold stage.sh: end"
limit=$((64 * 1024 * 1024))

weights() {  # the shipped model folders
  git ls-files 'plugins/*/tensorfold_*/models/*' | cut -d/ -f1-4 | sort -u
}

old_receipts() {  # every receipt but the newest contract JSON, which run_on_h200.sh orders the contract by
  local newest
  newest=$(git ls-files 'contract/receipts/h200-*/contract*.json' | sort | tail -1)
  git ls-files contract/receipts | grep -vxF "$newest" | grep -v '\.sh$'
}

git_index() {  # git "$@" on the index, waiting out another engineer's commit (its index.lock)
  local tries=0
  while [ -e .git/index.lock ] && [ $tries -lt 30 ]; do sleep 1; tries=$((tries + 1)); done
  git "$@"
}

unstage() {
  if [ -f "$saved" ]; then
    git_index update-index --index-info < "$saved" && rm -f "$saved"
  fi
  [ -f "$exclude" ] || return 0
  local first last
  first=$(printf '%s' "$begin" | sed 's/[][\/.*^$]/\\&/g')
  last=$(printf '%s' "$end" | sed 's/[][\/.*^$]/\\&/g')
  sed -i "/^$first\$/,/^$last\$/d" "$exclude"
}

hook=.git/hooks/pre-commit
guard() {  # while the weights are out of git's index, a commit would delete them from the tree: refuse it
  mkdir -p .git/hooks
  cat > "$hook" <<'HOOK'
#!/usr/bin/env bash
# tensorfold stage.sh guard
if [ -f .git/tensorfold-stage-weights.index ]; then
  echo "shipped weights or receipts are out of git's index (tools/device/stage.sh light or weights):" \
    "a commit now would delete them;" >&2
  echo "run tools/device/stage.sh full first" >&2
  exit 1
fi
HOOK
  chmod +x "$hook"
}

take_out() {  # keep these paths out of git's index and of the upload, their entries saved for `unstage`
  git ls-files -s -- "$@" > "$saved"
  { echo "$begin"; printf '/%s\n' "$@"; echo "$end"; } >> "$exclude"
  git_index rm -r -q --cached -- "$@"
  [ -e "$hook" ] || guard
}

unguard() { if [ -f "$hook" ] && grep -q "tensorfold stage.sh guard" "$hook"; then rm -f "$hook"; fi; }

bytes_of_tree() {  # what the device tool uploads: tracked and untracked-not-ignored files
  local files
  files=$(git ls-files -co --exclude-standard)
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
    for (i = 1; i <= 3; i++)
      printf "  %-24s %6.1f MiB%s\n", name[i], n[i] / 1048576, (n[i] > lim ? "   OVER the 64 MiB limit" : "")
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
    unstage  # after `weights` the saved entries are the receipts': put them back before taking the weights out
    commit=$(git rev-parse --short HEAD)$([ -z "$(git status --porcelain -uno)" ] || echo +dirty)
    mapfile -t dirs < <(weights)
    # the old receipts too (4 MiB): with them out a call carrying half of MLX has room for a model dir or two
    mapfile -t receipts < <(old_receipts)
    take_out "${dirs[@]}" "${receipts[@]}"
    echo "Staged: MLX $(cat .mlxb/VERSION) in .mlxa/ and .mlxb/; the weights and old receipts are out of the upload"
    echo "(and of git's index)."
    sizes
    cat <<MSG

Then, back to back (the machine goes back 30 s after a call, and the first half of MLX with it):
  1. run(kind="nvidia-h200", carry=[".mlxa"], timeout_s=120,
         command="mkdir -p /root/mlxw && cp .mlxa/part.aa /root/mlxw/ && nvidia-smi -L")
  2. run(carry=[".mlxb"], timeout_s=120, command="bash .mlxb/install.sh && echo MLX installed")
  3. here: tools/device/stage.sh weights  (the weights are back in git's index and in the upload, the receipts out)
  4. run(timeout_s=600, command="export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TF_COMMIT=$commit \\
         && bash contract/receipts/run_on_h200.sh contract")
Each later call on the same warm machine starts with export PYTHONPATH=/tmp/site (MLX stays in /tmp/site).
MSG
    ;;
  weights)
    unstage
    mapfile -t receipts < <(old_receipts)
    # no GPU step reads a shipped DSpark drafter (the exactness script builds its own): a call that does carries it
    mapfile -t drafters < <(weights | grep '^plugins/tensorfold_dspark/')
    take_out "${receipts[@]}" "${drafters[@]}"
    echo "The weights travel again (but the DSpark drafters': carry a dir a call needs); the receipts (but the newest"
    echo "contract JSON)"
    echo "are out of the upload until stage.sh full."
    echo "Commits wait for stage.sh full (a commit now would delete the receipts)."
    sizes
    ;;
  full)
    unstage
    unguard
    echo "The weights travel again with each call."
    sizes
    ;;
  sizes)
    sizes
    ;;
  head)
    mkdir -p .head
    grep -qxF "/.head/" "$exclude" 2>/dev/null || echo "/.head/" >> "$exclude"
    mapfile -t code < <(git ls-files -- plugins | grep -v '/models/')
    rm -f .head/code.tar
    git archive --format=tar.gz -9 -o .head/code.tar.gz HEAD tensorfold_core contract bench tools "${code[@]}"
    echo "HEAD $(git rev-parse --short HEAD)'s code in .head/code.tar.gz ($(bytes_of .head/code.tar.gz) bytes)."
    echo "Carry [\".head\"] and start the command with:"
    echo "  tar xzf .head/code.tar.gz && export TF_COMMIT=$(git rev-parse --short HEAD) && ..."
    ;;
  *)
    sed -n '2,15p' "$0" >&2
    exit 2
    ;;
esac
