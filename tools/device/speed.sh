#!/usr/bin/env bash
# H200 steps for the served kernels' speed and exactness, side by side (docs/gpu.md, "The GPU steps").
# Usage, from anywhere in the checkout:  tools/device/speed.sh STEP...   (default: bench pair exact contract affine)
#   bench     the GEMV records against MLX's matmul / quantized_matmul at 1-128 rows (outputs checked before timing)
#   pair      the inflated 1B pair (built there), plain and drafted decode per kernel table mode (ids checked first):
#             PAIR_MODES (default builtin,table; e.g. table-attention leaves attention to MLX, to attribute time);
#             PAIR_STREAMS=4,8 adds cells of that many replies at once, plain, drafted and served; PAIR_ARGS passes
#             more flags on (e.g. --mlx-lm: mlx-lm generate on the target too, its wheel carried in .whl/;
#             --rounds 3: every mode run three times, interleaved, rates the medians); DRAFTER_PRESET=0.07b drafts
#             with the drafter's own 4 layers instead of 0.1b's 8 (4 of them identity)
#   dspark    the inflated lfm2 pair (tools/zoo/inflate_lfm2.py: a 1B-class lfm2 target, its DSpark drafter), as
#             pair does (PAIR_MODES, default table; PAIR_STREAMS; PAIR_ARGS); made from the tiny-lfm2 and
#             tiny-lfm2-dspark dirs, so in stage.sh weights (which leaves DSpark dirs home) carry the latter
#   ahead     the inflated lfm2 pair (as dspark) with slots kept full (tools/device/kept_full.py --hold-ahead) at
#             AHEAD_SLOTS (default "8 1"): plain, served with holds in step and served with holds queued ahead of the
#             host's read (TENSORFOLD_HOLD_AHEAD), one engine each, every reply's ids checked first
#   token     a decode token's host build, eval and keep, sync and pipelined, the first token cold and resumed at
#             60 and 1600 ids of context, and 1/4/8 streams side by side, per TOKEN_MODES (default
#             builtin,table,table-attention; bench/bench_token_time.py)
#   launch    a launch's cost in a chain: custom kernels against MLX's own ops (bench/bench_launch.py)
#   tiles     the bf16 GEMV's tile geometries at 1-128 rows, bit-equal first (bench/bench_gemv_tiles.py);
#             TILES_ARGS passes flags on, e.g. "--warps 8,16 --rows 1,4,8 --shapes 2048x2048,2048x8192"
#   normed    the norm folded into the bf16 GEMV against MLX's rms_norm + the plain GEMV, bits first, under ncu, with
#             the ablations that find where its time goes (bench/bench_normed_gemv.py --ablations)
#   exact     run_on_h200.sh exact: the probe and drafted == plain == concurrent per mode
#   warmup    the inflated lfm2 pair (as dspark) served over HTTP at one stream, 11 waves of 256 tokens
#             (bench_concurrent's per-wave rates: the 11 code prompts once each, since a drafted server recalls a
#             repeated request's reply from its prompt cache; WARMUP_WAVES), with TENSORFOLD_WARM_UP=1
#             then =0, fresh servers each: what a server's first requests pay with the warm-up at load and without;
#             WARMUP_SIDES="1" or "0" runs one side (two calls on one warm machine, when one call's 600 s is short)
#   served    the shipped pairs each served over HTTP by fresh servers that warm up at load (bench_concurrent, 1 and 4
#             streams, 2 waves of 96 tokens, ids equal to "draft": false first), one pair a cell: SERVED_PAIRS
#             (default "tiny-llama:tiny-llama-drafter tiny-lfm2-moe:tiny-lfm2-moe-dspark tiny-lfm2-moe-4bit:",
#             MODEL:DRAFTER, none after the colon for copy drafts alone), SERVED_WORKLOADS (default code; code,random
#             adds seeded prompts: each workload's four cells are four fresh servers, ~55 s each on an H100, so the
#             three pairs take two calls); needs the weights (stage.sh weights, or carry the pairs' dirs)
#   load      the inflated 1B's load time with the self-test off, on, and on with its passes remembered
#             (tools/device/load_time.py)
#   kernels   a one-stream token's device time by kernel under Nsight Compute (tools/device/kernel_times.py --warm),
#             once per KERNEL_KNOBS entry (space-separated; "-" for none, "+" joins two settings in one entry,
#             e.g. "- TENSORFOLD_GEMV_NARROW=8 TENSORFOLD_ROPE_IN=1+TENSORFOLD_DEVICE_STEP_ARRAYS=0"); the first also
#             builds every kernel, so give CAP_KERNELS room for it
#   graphs    the shared guard's log at 8 streams (tools/device/guard_trace.py) once per GRAPH_KNOBS entry (as
#             KERNEL_KNOBS; default "- MLX_MAX_OPS_PER_BUFFER=1000 MLX_USE_CUDA_GRAPHS=1
#             MLX_USE_CUDA_GRAPHS=1+MLX_MAX_OPS_PER_BUFFER=10": graphs off, tensorfold_core's default, where the
#             knob only spaces MLX's commits, then MLX's CUDA graphs and how rounds are cut into them), on GRAPH_PAIR
#             (default the tiny-lfm2 DSpark pair: carry its drafter's dir, stage.sh weights leaves it out)
#   contract  the contract for the bf16 GEMVs (fused ones too), the window attention and rope qkv;
#   affine    the contract for the 4/8-bit GEMVs
# Each step runs under a cap in seconds (CAP_BENCH=80, CAP_PAIR=110, CAP_DSPARK=200, CAP_TOKEN=150, CAP_NORMED=90,
# CAP_EXACT=80, CAP_WARMUP=300 a side, CAP_AHEAD=280, CAP_SERVED=260 a pair, CAP_LOAD=150, CAP_KERNELS=240, CAP_GRAPHS=200,
# CAP_CONTRACT=70, CAP_AFFINE=60), so a call ends inside its limit and says which step was cut.
# Everything lands in one receipt folder, packed as $OUT/receipt.tgz, with the short texts beside it. Needs MLX
# (PYTHONPATH=/tmp/site) and, for pair, token and exact, pydantic and llguidance there (docs/gpu.md). TF_SEED fixes
# the contract's inputs.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out="${OUT:-$root/contract/receipts/out}"
receipt=$(mktemp -d /tmp/tfreceipt.XXXX)
export PYTHONUNBUFFERED=1
seed=${TF_SEED:+--seed $TF_SEED}

step() {  # step NAME CAP COMMAND...: run it under its cap, note its exit and time in steps.txt
  local name=$1 cap=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$cap" "$@"
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - start )) s$([ $rc = 124 ] && echo " (cut at its cap of $cap s)")" \
    | tee -a "$receipt/steps.txt"
}

for what in "${@:-bench pair exact contract affine}"; do
  for name in $what; do
    case "$name" in
      bench) OUT=$receipt step bench "${CAP_BENCH:-80}" bash contract/receipts/run_on_h200.sh bench ;;
      pair)
        OUT=$receipt TF_EXEC="python3 tools/zoo/inflate.py --preset 1b --out /tmp/b1 --no-check > /dev/null \
          && python3 tools/zoo/inflate.py --preset ${DRAFTER_PRESET:-0.1b} --out /tmp/d01 --no-check > /dev/null \
          && python3 bench/bench_gpu_pair.py /tmp/b1 /tmp/d01 --modes '${PAIR_MODES:-builtin,table}' \
          ${PAIR_STREAMS:+--streams $PAIR_STREAMS} ${PAIR_ARGS:-} --json $receipt/pair.json" \
          step pair "${CAP_PAIR:-110}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/pair.txt" ;;
      dspark)
        OUT=$receipt TF_EXEC="python3 tools/zoo/inflate_lfm2.py --preset lfm2-1b --out /tmp/l1 --no-check > /dev/null \
          && python3 tools/zoo/inflate_lfm2.py --preset lfm2-dspark-0.1b --out /tmp/ld --target /tmp/l1 --no-check \
          > /dev/null && python3 bench/bench_gpu_pair.py /tmp/l1 /tmp/ld --modes '${PAIR_MODES:-table}' \
          ${PAIR_STREAMS:+--streams $PAIR_STREAMS} ${PAIR_ARGS:-} --json $receipt/dspark.json" \
          step dspark "${CAP_DSPARK:-200}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/dspark.txt" ;;
      warmup)  # fresh servers with the warm-up at load and without, one after the other on this card
        for side in ${WARMUP_SIDES:-1 0}; do
          OUT=$receipt TF_EXEC="{ [ -d /tmp/l1 ] || python3 tools/zoo/inflate_lfm2.py --preset lfm2-1b --out /tmp/l1 \
            --no-check > /dev/null; } && { [ -d /tmp/ld ] || python3 tools/zoo/inflate_lfm2.py --preset \
            lfm2-dspark-0.1b --out /tmp/ld --target /tmp/l1 --no-check > /dev/null; } && cd bench \
            && TENSORFOLD_WARM_UP=$side python3 bench_concurrent.py --model /tmp/l1 --drafter /tmp/ld --levels 1 \
            --tokens 256 --reps 1 --waves ${WARMUP_WAVES:-11} --no-alone --dtype bfloat16" \
            step warmup-$side "${CAP_WARMUP:-300}" bash contract/receipts/run_on_h200.sh exec
          mv "$receipt/exec.txt" "$receipt/warmup-$side.txt"
        done ;;
      ahead)
        OUT=$receipt TF_EXEC="{ [ -d /tmp/l1 ] || python3 tools/zoo/inflate_lfm2.py --preset lfm2-1b --out /tmp/l1 \
          --no-check > /dev/null; } && { [ -d /tmp/ld ] || python3 tools/zoo/inflate_lfm2.py --preset \
          lfm2-dspark-0.1b --out /tmp/ld --target /tmp/l1 --no-check > /dev/null; } && for slots in \
          ${AHEAD_SLOTS:-8 1}; do python3 tools/device/kept_full.py /tmp/l1 /tmp/ld --slots \$slots --requests \
          \$((slots * 4)) --tokens 128 --passes 3 --hold-ahead; done" \
          step ahead "${CAP_AHEAD:-280}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/ahead.txt" ;;
      token)
        OUT=$receipt TF_EXEC="python3 tools/zoo/inflate.py --preset 1b --out /tmp/b1 --no-check > /dev/null \
          && python3 bench/bench_token_time.py /tmp/b1 --modes '${TOKEN_MODES:-builtin,table,table-attention}' \
          --json $receipt/token.json" \
          step token "${CAP_TOKEN:-150}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/token.txt" ;;
      exact) OUT=$receipt step exact "${CAP_EXACT:-80}" bash contract/receipts/run_on_h200.sh exact ;;
      served)
        pairs="tiny-llama:tiny-llama-drafter tiny-lfm2-moe:tiny-lfm2-moe-dspark tiny-lfm2-moe-4bit:"
        for pair in ${SERVED_PAIRS:-$pairs}; do
          model=${pair%%:*} drafter=${pair#*:}
          OUT=$receipt TF_EXEC="cd bench && python3 bench_concurrent.py --model $model ${drafter:+--drafter $drafter} \
            --levels 1,4 --tokens 96 --reps 1 --waves 2 --workload ${SERVED_WORKLOADS:-code} --no-alone \
            --dtype bfloat16" \
            step "served-$model" "${CAP_SERVED:-260}" bash contract/receipts/run_on_h200.sh exec
          mv "$receipt/exec.txt" "$receipt/served-$model.txt"
        done ;;
      load)
        OUT=$receipt TF_EXEC="python3 tools/zoo/inflate.py --preset 1b --out /tmp/b1 --no-check > /dev/null \
          && python3 tools/device/load_time.py /tmp/b1" \
          step load "${CAP_LOAD:-150}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/load.txt" ;;
      kernels)
        OUT=$receipt TF_EXEC="python3 tools/zoo/inflate.py --preset 1b --out /tmp/b1 --no-check > /dev/null \
          && for knob in ${KERNEL_KNOBS:--}; do echo \"== knob \$knob\"; \
          env \$([ \"\$knob\" = - ] || echo \$knob | tr + ' ') TENSORFOLD_KERNELS=table python3 tools/device/kernel_times.py \
          /tmp/b1 --warm --steps 4 --top 8 2>&1 | grep -v '^kernels\|^probe'; done" \
          step kernels "${CAP_KERNELS:-240}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/kernels.txt" ;;
      graphs)
        OUT=$receipt TF_EXEC="for knob in ${GRAPH_KNOBS:-- MLX_MAX_OPS_PER_BUFFER=1000 \
          MLX_USE_CUDA_GRAPHS=1 MLX_USE_CUDA_GRAPHS=1+MLX_MAX_OPS_PER_BUFFER=10}; do echo \"== knob \$knob\"; \
          env \$([ \"\$knob\" = - ] || echo \$knob | tr + ' ') python3 tools/device/guard_trace.py \
          ${GRAPH_PAIR:-tiny-lfm2 tiny-lfm2-dspark} --streams 8 --passes 4 --width 600; done" \
          step graphs "${CAP_GRAPHS:-200}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/graphs.txt" ;;
      launch|tiles)
        tiles="bench/bench_gemv_tiles.py --seconds 150 ${TILES_ARGS:-}"
        script=$([ "$name" = launch ] && echo bench/bench_launch.py || echo "$tiles")
        OUT=$receipt TF_EXEC="python3 $script --json $receipt/$name.json" \
          step "$name" "${CAP_TILES:-180}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/$name.txt" ;;
      normed)
        OUT=$receipt TF_EXEC="python3 bench/bench_normed_gemv.py --ablations" \
          step normed "${CAP_NORMED:-90}" bash contract/receipts/run_on_h200.sh exec
        mv "$receipt/exec.txt" "$receipt/normed.txt" ;;
      contract|affine)
        records="--only llama*gemv*bf16* --only llama*window*attention* --only llama*rope*qkv*"
        [ "$name" = affine ] && records="--only llama*gemv*q4 --only llama*gemv*q8"
        mkdir -p "$receipt/$name"
        cap=$([ "$name" = affine ] && echo "${CAP_AFFINE:-60}" || echo "${CAP_CONTRACT:-70}")
        OUT=$receipt/$name TF_CONTRACT_ARGS="--jobs 4 --progress $seed $records" \
          step "$name" "$cap" bash contract/receipts/run_on_h200.sh contract
        cp "$receipt/$name/contract.txt" "$receipt/$name.txt" 2>/dev/null ;;
      *) echo "unknown step $name (the steps: the usage at the top of tools/device/speed.sh)" >&2
         exit 2 ;;
    esac
  done
done
mkdir -p "$out"
tar czf "$out/receipt.tgz" -C "$receipt" .
for f in steps.txt gemv.txt pair.txt normed.txt kernels.txt contract.txt affine.txt launch.txt tiles.txt; do
  [ -f "$receipt/$f" ] && cp "$receipt/$f" "$out/"
done
cat "$receipt/steps.txt"
