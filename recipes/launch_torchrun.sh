#!/usr/bin/env bash
# Start a recipe's training, or the data regeneration, on one node of a (multi-node) job.
#
#   recipes/launch_torchrun.sh RECIPE NODES [training.train options...]          # train under torchrun
#   recipes/launch_torchrun.sh --regenerate NODES [data/regenerate.py options...] # one regeneration shard per GPU
#   make train RECIPE=qwen3-8b NODES=2                                           # = the first form
#
# Run the same command on every node; only NODE_RANK differs between nodes:
#   NODE_RANK      this node's index, 0 .. NODES-1 (needed when NODES > 1)
#   MASTER_ADDR    address of node 0 (training, NODES > 1)
#   RUN_NAME       run folder outputs/<recipe>/<RUN_NAME>, the same on every node, on a shared file
#                  system (training, NODES > 1, unless --resume names the run or --run-name/--run is among the
#                  options; default on one node: a timestamp)
#   MASTER_PORT    default 29500
#   GPUS_PER_NODE  processes per node (default: a --trainer.devices among the options, else trainer.devices in
#                  the config.yaml of the run --resume names, else in the recipe; for --regenerate, the GPUs
#                  CUDA_VISIBLE_DEVICES names, else those nvidia-smi lists, else 1; at most the former)
#   PYTHON         default .venv/bin/python
# A RUN_NAME or GPUS_PER_NODE that says otherwise than a --run-name or --trainer.devices among the options is refused,
# and so is a --recipe among training's options (the recipe is the first argument).
# Without the settings a multi-node launch needs, the script prints what to run on each node (with
# this command's arguments and GPUS_PER_NODE, shell-quoted) and starts nothing; with only some of them,
# it names the missing ones and stops (exit status 2).
#
# Training: torchrun (training/launch.py: its exit status is the first failed process's) starts GPUS_PER_NODE processes here and the trainer is given the same counts
# (--trainer.num_nodes, --trainer.devices); training.train stops at once if the recipe's counts and
# torchrun's WORLD_SIZE disagree. Resume with --resume <run folder> (its newest readable checkpoint).
# Regeneration: process i of node n regenerates shard n*GPUS_PER_NODE+i of NODES*GPUS_PER_NODE on
# GPU i (data/regenerate.py --shard-index/--num-shards); every shard writes its own chunks under
# <out>.parts (a shared file system) and a shard that finds all chunks done merges them. A Ctrl-C or a SIGTERM of the
# script stops its shards (exit status 130, 143); a rerun with the same options goes on from the chunks written.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 2 ]; then sed -n '4,6p' "$0" | sed 's/^#  *//' >&2; exit 2; fi
if [ "$1" = "--regenerate" ]; then
    MODE=regenerate RECIPE="" JOB="data regeneration"
else
    MODE=train RECIPE=$1 JOB="recipe $1"
fi
PYTHON=${PYTHON:-.venv/bin/python}
# The recipe before the other arguments: `--recipe tiny 2` was refused as NODES 'tiny', no number
if [ "$MODE" = train ] && [ ! -f "recipes/$RECIPE.yaml" ]; then
    # training.train's own check of --recipe: a recipe's file given for its name (recipes/tiny.yaml, tiny.yaml) is
    # told the name, and a file of one's own where it goes ("unknown recipe 'recipes/tiny.yaml'" said neither)
    "$PYTHON" -c 'import sys; from ddtree.errors import run_cli
from training.arguments import check_recipe_name
sys.exit(run_cli(lambda argv: check_recipe_name(argv[0], flag=""), sys.argv[1:]))' "$RECIPE" || exit 2
    echo "error: unknown recipe '$RECIPE'; known: $(ls recipes/*.yaml | xargs -n1 basename | sed 's/.yaml$//' | xargs)" >&2
    exit 2
fi
NODES=$2
shift 2
MASTER_PORT=${MASTER_PORT:-29500}
# Plain decimal only: bash's arithmetic reads a leading 0 as octal (08 is an error, 010 is 8).
# At most 6 digits: past the shell's integers a comparison would print its own error first.
positive() { case "$2" in ''|*[!0-9]*|0*|???????*) echo "error: $1 must be a positive integer, got '$2'" >&2; exit 2 ;; esac; }
positive NODES "$NODES"
case "$MASTER_PORT" in  # torchrun answered a word with its 30-line usage
    ''|*[!0-9]*|0*|??????*) port_ok="" ;;
    *) port_ok=$([ "$MASTER_PORT" -gt 65535 ] || echo y) ;;
esac
if [ "$MODE" = train ] && [ -z "$port_ok" ]; then
    echo "error: MASTER_PORT must be a port number, 1-65535, got '$MASTER_PORT'" >&2
    exit 2
fi
# A word of a printed command, quoted for the shell where it needs it ('\'' is a quote inside quotes).
shell_word() { case "$1" in ''|*[!A-Za-z0-9_./=:,+@%-]*) printf "'%s'" "${1//\'/\'\\\'\'}" ;; *) printf '%s' "$1" ;; esac; }
GIVEN_GPUS=${GPUS_PER_NODE:-}  # the user's, printed in the plan's commands
# The run folder a --resume value names: the folder itself, or a checkpoint in it (checkpoints/x.ckpt, hpc_ckpt_N.ckpt).
# A leading ~ is the home folder, as training reads --resume (quoted, the shell leaves it: the recipe's count was
# taken).
run_of() {
    local run=${1%/}
    case "$run" in "~" | "~/"*) run=$HOME${run#\~} ;; esac
    case "$run" in *.ckpt) run=$(dirname "$run"); [ "$(basename "$run")" != checkpoints ] || run=$(dirname "$run") ;; esac
    printf '%s' "$run"
}

# For the plan's commands: PASSED, the arguments but --resume (a resumed run keeps its folder); SBATCH_PASSED, but the
# run folder's options too, which slurm.sbatch takes from RUN_NAME and OUTPUT_ROOT (where its requeue looks).
# DEVICES_GIVEN, a --trainer.devices among them: the processes per node, as RUN_GIVEN is the run's name.
RESUMING="" RUN_GIVEN="" ROOT_GIVEN="" DEVICES_GIVEN="" previous="" PASSED=() SBATCH_PASSED=()
# An empty --resume ("$RUN" unset) read as no resume: the launch's own --run-name went with it, and training's error
# said to drop that --run-name, which the user never gave
empty_resume() {
    echo "error: --resume is empty (an unset shell variable?); give 'last', a run folder or a checkpoint path" >&2
    exit 2
}
for arg in "$@"; do
    option=$previous previous=$arg
    case "$option" in
        --resume) RESUMING=$arg previous=""; [ -n "$arg" ] || empty_resume; continue ;;
        --run|--run-name) RUN_GIVEN=$arg previous="" ;;
        --output-root) ROOT_GIVEN=$arg previous="" ;;
        --trainer.devices) DEVICES_GIVEN=$arg previous="" SBATCH_PASSED+=("$(shell_word "$arg")") ;;
        *) case "$arg" in
               --resume=*) RESUMING=${arg#--resume=}; [ -n "$RESUMING" ] || empty_resume; continue ;;
               --resume) continue ;;
               --run=*|--run-name=*) RUN_GIVEN=${arg#*=} ;;
               --output-root=*) ROOT_GIVEN=${arg#*=} ;;
               --trainer.devices=*) DEVICES_GIVEN=${arg#*=} SBATCH_PASSED+=("$(shell_word "$arg")") ;;
               --run|--run-name|--output-root) ;;
               --recipe|--recipe=*)  # training took it over the launcher's, with the other recipe's processes per node
                   if [ "$MODE" = train ]; then
                       echo "error: --recipe among the training options would train that recipe with recipe $RECIPE's" \
                           "processes per node: give the recipe as the first argument, recipes/launch_torchrun.sh" \
                           "RECIPE NODES [options] (make train RECIPE=<name> NODES=<n>)" >&2
                       exit 2
                   fi
                   SBATCH_PASSED+=("$(shell_word "$arg")") ;;
               *) SBATCH_PASSED+=("$(shell_word "$arg")") ;;
           esac ;;
    esac
    PASSED+=("$(shell_word "$arg")")
done
[ "$previous" != --resume ] || RESUMING=last  # a bare --resume at the end: training.train's own error says what it needs

if [ "$MODE" = train ]; then
    # The training options come after the launcher's own --trainer.devices and --run-name, so theirs are the ones
    # training takes: the plan and torchrun's process count follow them, and an environment variable that says
    # otherwise is refused (torchrun started one count and training expected the other).
    contradicts() {  # NAME OPTION VALUE
        if [ -n "$3" ] && [ -n "${!1:-}" ] && [ "${!1}" != "$3" ]; then
            echo "error: $1=${!1} but the training options give $2 $3: drop one of them or give the same value" >&2
            exit 2
        fi
    }
    contradicts GPUS_PER_NODE --trainer.devices "$DEVICES_GIVEN"
    contradicts RUN_NAME --run-name "$RUN_GIVEN"
    RUN_NAME=${RUN_NAME:-$RUN_GIVEN}
    # A resumed run keeps the processes per node it was trained with (its data were split over that many ranks, and
    # training refuses another count only once model and data are built): its config.yaml's, else the recipe's.
    DEVICES_FROM=recipes/$RECIPE.yaml
    if [ -n "$RESUMING" ] && [ -f "$(run_of "$RESUMING")/config.yaml" ]; then DEVICES_FROM=$(run_of "$RESUMING")/config.yaml; fi
    GPUS_PER_NODE=${GPUS_PER_NODE:-$DEVICES_GIVEN}
    # A recipe with no trainer: section (or an empty one) takes the default, 1; a file that is not YAML is training's
    # one line (read_yaml_mapping), not a traceback
    GPUS_PER_NODE=${GPUS_PER_NODE:-$("$PYTHON" -c 'import sys; from ddtree.errors import run_cli
from ddtree.files import read_yaml_mapping
def devices(argv):
    trainer = read_yaml_mapping(argv[0]).get("trainer") or {}
    print(trainer.get("devices", 1) if isinstance(trainer, dict) else 1)  # another value: training.train says it
sys.exit(run_cli(devices, sys.argv[1:]))' "$DEVICES_FROM")}
else
    # A scheduler's share of the node is CUDA_VISIBLE_DEVICES: nvidia-smi lists every GPU of the node regardless.
    IFS=, read -ra VISIBLE <<< "${CUDA_VISIBLE_DEVICES:-}"
    if [ ${#VISIBLE[@]} -gt 0 ]; then
        GPUS_PER_NODE=${GPUS_PER_NODE:-${#VISIBLE[@]}}
    else
        GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
    fi
    [ "${GPUS_PER_NODE:-0}" != 0 ] || GPUS_PER_NODE=1
fi
positive "processes per node (GPUS_PER_NODE${DEVICES_FROM:+, else ${DEVICES_GIVEN:+--trainer.devices in the training options, else }trainer.devices in $DEVICES_FROM})" "$GPUS_PER_NODE"
if [ "$MODE" = regenerate ] && [ ${#VISIBLE[@]} -gt 0 ] && [ "$GPUS_PER_NODE" -gt ${#VISIBLE[@]} ]; then
    # one shard per GPU: the extra shards would share a visible GPU or take one outside this job's share
    echo "error: GPUS_PER_NODE=$GPUS_PER_NODE but CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES makes ${#VISIBLE[@]} GPU(s) visible: give GPUS_PER_NODE=${#VISIBLE[@]} or fewer, or make more GPUs visible" >&2
    exit 2
fi
WORLD=$((NODES * GPUS_PER_NODE))

if [ "$NODES" -gt 1 ]; then
    needed=(NODE_RANK)
    if [ "$MODE" = train ]; then
        needed+=(MASTER_ADDR)
        [ -n "$RESUMING$RUN_GIVEN" ] || needed+=(RUN_NAME)  # or the run is named by its options
    fi
    missing=() given=()
    for name in "${needed[@]}"; do if [ -n "${!name:-}" ]; then given+=("$name"); else missing+=("$name"); fi; done
    if [ ${#missing[@]} -gt 0 ] && [ ${#given[@]} -gt 0 ]; then  # half set: a mistake, not a request for the plan
        echo "error: a launch on $NODES nodes needs ${needed[*]} on every node; ${missing[*]} not set (run without all of them to see the plan)" >&2
        exit 2
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        echo "$JOB on $NODES nodes x $GPUS_PER_NODE processes = $WORLD processes."
        gpus=${GIVEN_GPUS:+"GPUS_PER_NODE=$(shell_word "$GIVEN_GPUS") "}
        passed=${PASSED[*]}  # each word quoted already
        sbatch="sbatch --nodes=$NODES --ntasks-per-node=$GPUS_PER_NODE --gpus-per-node=$GPUS_PER_NODE recipes/slurm.sbatch"
        if [ "$MODE" = train ]; then
            echo "Not started: run on each node i = 0..$((NODES - 1)) (trainer.num_nodes=$NODES, trainer.devices=$GPUS_PER_NODE):"
            make_args="make train RECIPE=$RECIPE NODES=$NODES${RESUMING:+ RESUME=$(shell_word "$RESUMING")}${passed:+ ARGS=$(shell_word "$passed")}"
            if [ -n "$RESUMING$RUN_GIVEN" ]; then
                echo "    MASTER_ADDR=<node 0> MASTER_PORT=$MASTER_PORT ${gpus}NODE_RANK=<i> $make_args"
            else
                echo "    MASTER_ADDR=<node 0> MASTER_PORT=$MASTER_PORT ${gpus}RUN_NAME=<name> NODE_RANK=<i> $make_args"
            fi
            echo "or, under SLURM (one task per GPU, requeued on preemption):"
            # slurm.sbatch's run folder is OUTPUT_ROOT/<recipe>/RUN_NAME; a resume continues the one --resume names
            slurm_run="${RUN_GIVEN:+RUN_NAME=$(shell_word "$RUN_GIVEN") }${ROOT_GIVEN:+OUTPUT_ROOT=$(shell_word "$ROOT_GIVEN") }"
            sbatch_passed=${SBATCH_PASSED[*]}
            if [ -n "$RESUMING" ]; then
                run=$(run_of "$RESUMING")
                if [ -f "$run/config.yaml" ]; then
                    slurm_run="RUN_NAME=$(shell_word "$(basename "$run")") OUTPUT_ROOT=$(shell_word "$(dirname "$(dirname "$run")")") "
                else  # --resume last: the newest run's folder, which only training.train looks up
                    slurm_run="RUN_NAME=<the run folder's name> OUTPUT_ROOT=<the folder above its recipe's> "
                fi
            fi
            echo "    $slurm_run$sbatch $RECIPE${sbatch_passed:+ $sbatch_passed}"
            case "$RESUMING" in *.ckpt) echo "    (it resumes that run's newest readable checkpoint, which may be later than $RESUMING)" ;; esac
        else
            echo "Not started: run on each node i = 0..$((NODES - 1)):"
            echo "    ${gpus}NODE_RANK=<i> recipes/launch_torchrun.sh --regenerate $NODES ${passed:-<data/regenerate.py options>}"
            echo "or, under SLURM: $sbatch --regenerate ${passed:-<options>}"
        fi
        exit 0
    fi
fi
NODE_RANK=${NODE_RANK:-0}
case "$NODE_RANK" in ''|*[!0-9]*|0?*|???????*) bad=y ;; *) bad=$([ "$NODE_RANK" -lt "$NODES" ] || echo y) ;; esac
if [ -n "$bad" ]; then  # torchrun would wait for a node rank no launch can fill
    echo "error: NODE_RANK must be this node's index, 0..$((NODES - 1)) for NODES=$NODES, got '$NODE_RANK'" >&2
    exit 2
fi

if [ "$MODE" = regenerate ]; then
    pids=()
    # A script's & starts the shards with SIGINT ignored: a Ctrl-C (or a kill) of the launcher stops them here, or they
    # kept running, orphaned, on their GPUs.
    stop_shards() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait; exit "$1"; }
    trap 'stop_shards 130' INT
    trap 'stop_shards 143' TERM
    for ((i = 0; i < GPUS_PER_NODE; i++)); do
        # GPU i of this node: the i-th visible one; none where CUDA_VISIBLE_DEVICES is set empty (the CPU); else GPU i
        CUDA_VISIBLE_DEVICES=${VISIBLE[i]-${CUDA_VISIBLE_DEVICES-$i}} "$PYTHON" data/regenerate.py \
            --shard-index $((NODE_RANK * GPUS_PER_NODE + i)) --num-shards "$WORLD" "$@" &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    exit $status
fi

RUN_ARGS=(--run-name "${RUN_NAME:-$(date +%Y%m%d-%H%M%S)}")
[ -z "$RESUMING$RUN_GIVEN" ] || RUN_ARGS=()  # a resumed run keeps its folder; a --run-name among the options names it
# Inside a SLURM allocation (salloc, or this script in an sbatch job) torchrun starts the processes: without
# SLURM_NTASKS nothing in them takes them for SLURM's tasks (Lightning and the launch check read torchrun's variables
# first; recipes/slurm.sbatch is the SLURM launch).
unset SLURM_NTASKS
if [ "$NODES" -eq 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    RENDEZVOUS=(--standalone)  # one node: torchrun picks a free local port
else
    RENDEZVOUS=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
exec "$PYTHON" -m training.launch --nnodes "$NODES" --nproc-per-node "$GPUS_PER_NODE" "${RENDEZVOUS[@]}" \
    -m training.train --recipe "$RECIPE" "${RUN_ARGS[@]}" \
    --trainer.num_nodes="$NODES" --trainer.devices="$GPUS_PER_NODE" "$@"
