"""Train a drafter from a recipe (recipes/<name>.yaml) with LightningCLI.

    python -m training.train --recipe smollm2-135m                    # the CPU default
    python -m training.train --recipe tiny --trainer.max_steps=20     # any field can be overridden
    python -m training.train --recipe smollm2-135m --resume last      # or --resume path/to/x.ckpt
    make train RECIPE=tiny [RESUME=last]
    make train RECIPE=qwen3-8b NODES=2                                # several nodes: see training/strategies.py

Every run writes outputs/<recipe>/<run>/:
    config.yaml            the fully resolved configuration (resuming reads it back)
    checkpoints/           step-N checkpoints at the evaluation steps (the top checkpoint.save_top_k by
                           val/tau_ddtree@<eval.primary_budget>), best.ckpt -> the best, last.ckpt:
                           drafter, optimizer, scheduler, loop and data-loader state; never the target
    report.md, tau.png     measured acceptance at every evaluation (training/callbacks.py), eval/ the details
    tensorboard/, csv/     logs (one version_k per launch: a resumed run appends version_k+1)
    corpus.safetensors     with model.corpus: the training split's replies, which every export of a checkpoint
                           trained with it carries
    drafter/               the trained drafter as a HF folder, for `ddtree bench --drafter`

`--resume last` continues the newest run of the recipe that has a last.ckpt, in its own folder and
with its own config.yaml: step, optimizer, scheduler and data position all continue exactly (a --run-name beside
--resume is refused: a new run from a checkpoint is a warm start, --model.init_from its export).
`--resume <run folder>` continues from its newest readable checkpoint (last.ckpt, or the hpc_ckpt_N.ckpt of a SLURM
requeue before 2026-12-03; a newer one whose save was cut short is passed over, in one line). Under DeepSpeed every
checkpoint is a folder of per-rank shards under the same name.
A resumed run keeps its recipe (the <recipe> folder it is in; a --recipe naming another is refused), and
its config.yaml takes the launch's overrides only once the checkpoint is restored and training starts.
With data.feature_store set (offline target features, training/features.py) a missing store is
built first, in a single-process run; a multi-process launch asks for `make features` instead.
Several processes (devices > 1, torchrun, SLURM) share one run folder; rank 0 writes config.yaml
and drafter/, and a launch whose process count differs from devices x num_nodes stops at once.
While a launch runs, its rank 0 holds the folder's .train.lock: another launch into it (the same --run-name,
a --resume of a run still training) is refused in one line; a default name taken in the same second gets -2.
Bad input (unknown recipe, bad field, bad target) prints one line and exits with status 2 (ddtree/errors.py).
A SIGTERM stops every process where a step ends, saved, with status 143 and the command that resumes (outside the
training loop, in the data's or the feature store's preparation or the export of drafter/ after it, at once, as Ctrl-C
does, leaving no staging folder and no new run folder behind); SLURM's requeue signal (SIGUSR1, recipes/slurm.sbatch)
the same way, rank 0 then requeuing the job (`scontrol requeue`), status 138;
one that comes after training has ended is noted in one line, and the job finishes (status 0, drafter/ written).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from training.arguments import (DEFAULT_RECIPE, answer_early, check_recipe_name, check_resume_alone, check_train_args,
                                known_recipes, recipe_path, train_parser)

# python -m: --help, a bad --recipe or --resume before Lightning loads
answer_early(__name__, train_parser, check_train_args, overrides=True)

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.corpus import CORPUS_FILE, write_replies
from ddtree.errors import INTERRUPTED, TERMINATED, DDTreeError, Terminated, command, error_line
from ddtree.files import files_an_export_would_lose, read_yaml_mapping, unwritable_as_error, write_text_atomic
from training.callbacks import AcceptanceEvaluation, SigtermAtStepBoundary
from training.checkpoint_paths import (find_resume, is_deepspeed_checkpoint, newest_checkpoint, resume_point, run_checkpoints,
                                       saved_step, why_no_best, why_unreadable)
from training.checkpoints import (AtomicCheckpointIO, check_resumable, deepspeed_client_state, newest_finite_checkpoint,
                                  non_finite_tensors)
from training.data import DATA_RECORD, DistillDataModule, replies
from training.export import export_drafter, run_corpus
from training.feature_store import (build_feature_store, drafter_layer_ids, is_complete, resolve_store_path, store_seconds,
                                    store_teacher)
from training.module import DistillModule, NonFiniteError
from training.recipe import DistillCLI, check_checkpoint_settings, config_arg, parser_overrides, recipe_errors
from training.recipe_data import prepare_recipe_data
from training.strategies import (check_launcher, drafter_for_export, end_process_group, is_deepspeed, is_first_process,
                                 launcher_world)
from training.target import dtype_for_precision


class DropLightningTips(logging.Filter):
    """Lightning 2.6 logs an advertisement for its cloud logger at every launch: not ours to print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def run_location_args(run_dir: Path) -> list[str]:
    """Where this launch writes: always the run folder as it is now, never the one a config.yaml recorded.

    Given after --config, these win over config.yaml's own values, so a run that was moved or copied
    and then resumed (under another --output-root too) logs and checkpoints into its new folder.
    """
    # flush_secs: tensorboard's writer thread sleeps until its next flush unless an event wakes it, and a Ctrl-C that
    # lands as the main thread queues an event can leave it unwoken; Lightning's shutdown then waits for it, up to
    # the default 120 s (a SIGINT run printed its line and outlived the test's 120 s, CI 2026-12-05). 5 s bounds it.
    logger = [
        {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
         "init_args": {"save_dir": str(run_dir), "name": "tensorboard", "flush_secs": 5}},
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(run_dir), "name": "csv"}},
    ]
    return [f"--trainer.default_root_dir={run_dir}", f"--trainer.logger={json.dumps(logger)}",
            f"--checkpoint.dirpath={run_dir / 'checkpoints'}"]


def build_cli(config: Path, run_dir: Path, overrides: list[str], checkpoint: Path | None = None,
              saved: dict | None = None) -> DistillCLI:
    """Parse config + overrides into (model, datamodule, trainer) without running anything; `checkpoint`: the one
    a --resume continues from, `saved` that .ckpt file as main already read it (None: a DeepSpeed folder)."""
    check_checkpoint_settings(config, overrides, run_config=config == run_dir / "config.yaml")
    with recipe_errors(config), warnings.catch_warnings():
        # LightningCLI is handed its arguments here, so its warning that sys.argv holds some too is noise.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        cli = DistillCLI(
            DistillModule,
            DistillDataModule,
            save_config_callback=None,  # written by hand below, to the run folder, atomically
            seed_everything_default=0,
            # allow_abbrev: `--checkpoint.dirpat=x` was taken as checkpoint.dirpath, past check_checkpoint_settings,
            # and the run's checkpoints went to x (its resume found none); the recipe's own typos are refused
            parser_kwargs={"exit_on_error": False, "allow_abbrev": False},
            args=["--config", config_arg(config, overrides), *run_location_args(run_dir), *parser_overrides(overrides)],
            run=False,
            resuming=checkpoint is not None,
        )
    if checkpoint is not None and cli.model.hparams.init_from:
        # The checkpoint holds every drafter weight (LoRA's frozen base too): the drafter is built from its config
        # (DistillModule.configure_model), as the warm start's folder may have moved or gone since the run started.
        saved = saved if saved is not None else deepspeed_client_state(checkpoint)
        cli.model.resumed_drafter_config = saved.get("drafter_config")
    if cli.model.hparams.seed != cli.datamodule.seed:  # else Lightning stops at fit with a traceback
        raise DDTreeError(f"model.seed={cli.model.hparams.seed} and data.seed={cli.datamodule.seed} differ: Lightning "
                          "keeps one `seed` hyperparameter for both; give them the same value")
    # First, so that the other callbacks see a SIGTERM that any rank received (all ranks at once) in the same hook
    cli.trainer.callbacks.insert(0, SigtermAtStepBoundary())
    return cli


def store_overrides(overrides: list[str]) -> list[str]:
    """The launch's overrides that say which store `make features` builds: model.* and data.* (layers, distillation,
    data, max_length, ...) and trainer.precision (its dtype), each with its value, given as --x=v or as --x v."""
    kept = []
    for i, item in enumerate(overrides):
        name = item.split("=", 1)[0]
        if name.startswith(("--model.", "--data.")) or name == "--trainer.precision":
            kept.append(item)
            if "=" not in item and i + 1 < len(overrides) and not overrides[i + 1].startswith("--"):
                kept.append(overrides[i + 1])
    return kept


def make_words(words: list[str]) -> str:
    """`words` as a make variable's value on a shell command line (ARGS="..."): each quoted for the shell make's
    recipe runs them in, the whole in double quotes for the shell running make, $ doubled for make itself."""
    value = shlex.join(words).replace("$", "$$")
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'


def build_missing_feature_store(cli: DistillCLI, recipe: str, overrides: list[str]) -> None:
    """Build data.feature_store before fitting when it names a store that does not exist yet.

    Only a single-process run builds it: the processes of a larger launch would each start the
    same build, so they stop and ask for `make features` first, with the launch's overrides that shape the store.
    """
    if not cli.datamodule.feature_store:  # online features
        return
    hp = cli.model.hparams
    final_hidden, teacher_top_k = store_teacher(hp.distill_weight, hp.distill_top_k)  # distillation's soft targets
    # The store is written in the dtype the target runs in during training: the same rule as DistillModule.
    resumed = cli.model.resumed_drafter_config  # a warm start's resume: the checkpoint's layers, its folder unread
    layer_ids = (list(DFlashDrafterConfig.from_dict(resumed).target_layer_ids) if resumed is not None
                 else drafter_layer_ids(hp.target_layer_ids, hp.init_from))
    features = dict(layer_ids=layer_ids, target_adapter=hp.target_adapter,
                    dtype=dtype_for_precision(cli.config.trainer.precision, hp.target_dtype))
    store = resolve_store_path(cli.datamodule.feature_store, recipe, cli.datamodule, final_hidden, teacher_top_k,
                               **features)
    cli.datamodule.feature_store = str(store)  # "auto" resolved; config.yaml keeps "auto", so a resume resolves it again
    if is_complete(store):
        return
    if cli.trainer.world_size > 1:
        shaping = store_overrides(overrides)
        build = (f"make features RECIPE={shlex.quote(recipe)} OUT={shlex.quote(str(store))}"
                 + (f" ARGS={make_words(shaping)}" if shaping else ""))
        raise DDTreeError(f"data.feature_store {store} is not built and this launch runs {cli.trainer.world_size} "
                          f"processes: build it first with `{build}`")
    for callback in cli.trainer.callbacks:  # a target the evaluation refuses stops here, not after the store's build
        if isinstance(callback, AcceptanceEvaluation):
            callback.check_target(hp.target)
    build_feature_store(cli.datamodule, Path(store), **features, final_hidden=final_hidden,
                        teacher_top_k=teacher_top_k, max_seconds=store_seconds(cli.datamodule), take_finished=True)


def write_run_corpus(cli: DistillCLI, run_dir: Path) -> None:
    """model.corpus: the training split's replies to <run>/corpus.safetensors, which every export of a checkpoint trained
    with it ships (ddtree/corpus.py). The split is the seed's, so a resume finds the same file and keeps it."""
    corpus = run_dir / CORPUS_FILE
    if not cli.model.hparams.corpus or corpus.is_file():
        return
    cli.datamodule.setup("fit")  # the train/validation split; fit's own setup finds it done
    count = write_replies(corpus, replies(cli.datamodule.train_split), cli.datamodule.load_tokenizer())
    print(f"[train] {count} training replies written to {corpus} (model.corpus: decoders graft from them)", flush=True)


class WriteConfigOnStart(Callback):
    """A resumed run's config.yaml, with this launch's overrides, written once training starts.

    Until then the checkpoint's restore can still refuse an override (the data loader's same-data
    check, say): written earlier, the refused values would stay in config.yaml and make every later
    plain --resume fail the same way.
    """

    def __init__(self, path: Path, text: str):
        self.path, self.text = path, text
        self.started = False  # stays False where the run had already reached max_steps: Lightning trains nothing

    def on_train_start(self, trainer, pl_module) -> None:
        self.started = True
        if trainer.is_global_zero:
            write_text_atomic(self.path, self.text)


class RefuseUnfitResume(Callback):
    """A resume from a checkpoint whose drafter weights hold NaN or inf, or (DeepSpeed) whose drafter this launch
    would change, stops before its first step.

    The first is a diverged run's last.ckpt: the update before it was saved can blow the weights up with a
    finite loss and gradient. Resumed, the first step's loss would be NaN. Checked once the strategy has restored the
    weights (DeepSpeed restores them after on_fit_start), and placed before WriteConfigOnStart, so config.yaml keeps
    what it held.

    The second is checked at on_fit_start: DeepSpeed loads its shards strictly, before the module's on_load_checkpoint
    would compare the drafters, so another layer count was its size-mismatch traceback from every rank (and Lightning
    knows no ckpt_path yet at that hook; this callback does).
    """

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint

    def on_fit_start(self, trainer, pl_module) -> None:
        if is_deepspeed(trainer.strategy) and is_deepspeed_checkpoint(self.checkpoint):
            pl_module.check_resume(deepspeed_client_state(self.checkpoint))

    def on_train_start(self, trainer, pl_module) -> None:
        drafter = pl_module.drafter
        if getattr(trainer.strategy, "zero_stage_3", False):
            # ZeRO-3 leaves each live parameter an empty placeholder (its weights are the ranks' shards), whose sum
            # saw nothing: counted gathered whole, every rank sees the same count and refuses with the others. A
            # collective, so every rank calls it; simpler than summing each shard where it lives (on the CPU under
            # offload_param) and all-reducing the counts.
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None):
                non_finite = non_finite_tensors(drafter)
        else:
            non_finite = non_finite_tensors(drafter)
        if non_finite:
            raise NonFiniteError(f"--resume: {self.checkpoint} holds NaN or inf in {non_finite} of the drafter's "
                                 "parameter tensors (the run diverged before it was saved): not resumed")


def run_recipe(run_dir: Path, requested: str | None) -> str:
    """The recipe a resumed run was started from: the folder it lives in (<output-root>/<recipe>/<run>)."""
    recipe = run_dir.parent.name
    if recipe not in known_recipes():  # a run moved out of that layout: only --recipe can say
        if requested is None:
            raise DDTreeError(f"--resume: the run {run_dir} is not in a <recipe>/ folder, so its recipe is unknown; "
                              "give it with --recipe")
        return requested
    if requested is not None and requested != recipe:
        raise DDTreeError(f"--recipe {requested} but the run {run_dir} is a {recipe} run: "
                          f"drop --recipe or give --recipe {recipe}")
    return recipe


def run_layer_ids(saved: dict, config: Path, overrides: list[str]) -> list[str]:
    """The override that resumes a run on the target layers its drafter reads, where its config left them to the
    default: the default for targets under 8 layers changed on 2026-12-03 ([1, 2, 2, 2, 3] -> [0, 1, 2, 3, 4] on 6),
    and a run trained before could not be resumed. [] where the config or the command names them, or init_from does."""
    try:
        model = read_yaml_mapping(config).get("model") or {}
    except (DDTreeError, OSError):  # missing or not a recipe: reading it as the run's config names what is wrong
        return []
    given = any(flag.split("=")[0] in ("--model.target_layer_ids", "--model.init_from") for flag in overrides)
    ids = ((saved.get("drafter_config") or {}).get("dflash_config") or {}).get("target_layer_ids")
    if given or not isinstance(model, dict) or model.get("target_layer_ids") is not None or model.get("init_from") or not ids:
        return []
    return [f"--model.target_layer_ids={list(ids)}"]


def run_target_dtype(config: Path) -> str | None:
    """The dtype the run's config.yaml ran the target in, as "bfloat16" (model.target_dtype, else trainer.precision's:
    the rule of DistillModule.configure_model and the model card's), read before this launch's overrides; None where
    that config cannot say."""
    try:
        settings = read_yaml_mapping(config)
        model, trainer = settings.get("model") or {}, settings.get("trainer") or {}
        return str(dtype_for_precision(trainer.get("precision"), model.get("target_dtype") or "auto")).removeprefix("torch.")
    except (DDTreeError, OSError, AttributeError):  # missing, not a mapping, or precision auto: the resume checks less
        return None


RUN_NAME_ENV = "DDTREE_RUN_NAME"  # the run folder name, handed to the processes Lightning starts


def run_name(requested: str | None) -> str | None:
    """The run folder's name, the same in every process of a launch; None for a new timestamped folder
    (stamped_run_folder), which a single process makes."""
    if requested is not None and (not requested or requested.strip() != requested):  # '' and ' ' (a folder ' ')
        raise DDTreeError(f"--run {requested!r}: a run's name is empty or starts or ends with a space; give a name "
                          "such as try1, or leave --run out for a timestamped folder")
    if requested is not None and (Path(requested).name != requested or requested == ".."):  # "a/b", ".", ".."
        raise DDTreeError(f"--run {requested!r}: a run's name is one folder name, made under <output-root>/<recipe>/; "
                          "give a name without '/' (--output-root puts runs elsewhere)")
    if requested:
        return requested
    if os.environ.get(RUN_NAME_ENV):  # a process Lightning started for devices > 1
        return os.environ[RUN_NAME_ENV]
    world = launcher_world()
    if SLURMEnvironment.detect():  # the job id survives a requeue (`srun torchrun ...` too: every process has it)
        job, task = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"]), os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{job}" + (f"-{task}" if task else "")
    if world and world[1] > 1:  # torchrun: each process would pick its own timestamp
        raise DDTreeError("started by torchrun without --run-name: give the same --run-name on every node "
                          "(recipes/launch_torchrun.sh does)")
    return None


def stamped_run_folder(recipe_root: Path) -> Path:
    """A new run folder named by the launch's time, made here and only here: two launches in the same second (a
    sweep started with `&`) took one folder; the second now gets <time>-2."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with unwritable_as_error(recipe_root):
        recipe_root.mkdir(parents=True, exist_ok=True)
        for number in itertools.count(1):
            folder = recipe_root / (stamp if number == 1 else f"{stamp}-{number}")
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                continue


RUN_LOCK = ".train.lock"  # in the run folder: held by rank 0 while a launch runs there (hold_run_folder)


@contextlib.contextmanager
def hold_run_folder(run_dir: Path):
    """Hold the run folder's lock until the block ends, or refuse the launch in one line when another holds it.

    Two launches under one run name (the same --run-name twice, a resume of a run still training) trained into one
    folder, each overwriting the other's checkpoints, config.yaml and drafter/. Rank 0 alone takes it: the other ranks
    of its launch share the folder, and a refused launch's other ranks end with its rank 0 (torchrun and slurm.sbatch's
    srun stop the rest). flock: the OS releases it when the process dies, so a killed run resumes at once. The file
    stays: one removed while another launch has it open would let two launches hold a lock each."""
    with unwritable_as_error(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run_dir / RUN_LOCK, "a")
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DDTreeError(f"run folder {run_dir} is in use by another launch that is still running (it holds "
                              f"{RUN_LOCK}): stop it or wait for it to end; a new run can take another --run") from None
        except OSError as error:  # a filesystem without locks (Lustre mounted without flock, say): train unguarded
            print(f"[train] cannot lock {run_dir / RUN_LOCK} ({error.strerror}): a second launch into {run_dir} would "
                  "not be refused", file=sys.stderr, flush=True)
        yield


def resume_command(run_dir: Path, recipe: str, checkpoint: Path) -> str:
    """The command that continues a stopped run, launched as this one was: a torchrun job again on its nodes, a SLURM
    job again under its run name (recipes/slurm.sbatch resumes a run folder that holds a checkpoint). Each value is
    quoted for the shell: a run folder with a space in it printed a line that resumed another path."""
    launched = launcher_world()
    recipe, checkpoint = shlex.quote(recipe), shlex.quote(str(checkpoint))
    if launched and launched[0] == "SLURM":
        # The task counts too: slurm.sbatch's own (8 per node) would start another number of processes than the run's
        nodes, per_node = launched[2], launched[1] // launched[2]
        return (f"RUN_NAME={shlex.quote(run_dir.name)} OUTPUT_ROOT={shlex.quote(str(run_dir.parent.parent))} "
                f"sbatch --nodes={nodes} --ntasks-per-node={per_node} --gpus-per-node={per_node} recipes/slurm.sbatch {recipe}")
    if launched and launched[0] == "torchrun":
        nodes, processes = launched[2], launched[1]
        every = " on each node (NODE_RANK and MASTER_ADDR as before)" if nodes > 1 else ""
        return f"GPUS_PER_NODE={processes // nodes} make train RECIPE={recipe} NODES={nodes} RESUME={checkpoint}{every}"
    return f"make train RECIPE={recipe} RESUME={checkpoint}"


def stopped(run_dir: Path, recipe: str, why: str, status: int, step: int, requeued: str | None = None,
            exporting: bool = False) -> int:
    """Say that the run did not finish, and how to resume it if a checkpoint exists; return the exit status.

    A killed or failed run must never look finished: non-zero status, one line saying what
    happened, and the exact command that continues it, with the step it continues from where that checkpoint is
    older than the stop (a SIGTERM saves its stop, with checkpoint.save_last false too; Ctrl-C or a crash does not).
    Where SLURM has `requeued` the job (its id), that job resumes the run folder itself: the line names the checkpoint
    it takes. `exporting`: stopped after training finished, as drafter/ was written; the resume writes it.
    """
    if is_first_process():
        try:
            checkpoint = newest_checkpoint(run_dir)
            resuming = resume_command(run_dir, recipe, checkpoint)
            resume = (f"SLURM requeued job {requeued}, which resumes from {checkpoint}" if requeued
                      else f"`{resuming}` writes it" if exporting else f"resume with: {resuming}")
            resumes_at = saved_step(checkpoint)
            if 0 <= resumes_at < step:
                again = f"step {step} is" if resumes_at + 1 == step else f"steps {resumes_at + 1}-{step} are"
                resume += f" (it continues from step {resumes_at}, that checkpoint's: {again} trained again)"
        except DDTreeError:
            resume = (f"SLURM requeued job {requeued}, which starts it again" if requeued else
                      "no checkpoint was written yet, so nothing can be resumed; start it again (the same command)")
        where = (f"during the export of drafter/, after training finished at step {step}" if exporting
                 else f"at step {step}")
        print(f"[train] {why} {where}; no drafter written; {resume}", file=sys.stderr, flush=True)
    return status


def stopped_by_signal(cli: DistillCLI, run_dir: Path, recipe: str) -> int:
    """The stop SigtermAtStepBoundary agreed on, every rank having saved its step: a SIGTERM's (143), or SLURM's
    requeue signal's, where rank 0 now requeues the job (128 + the signal, SIGUSR1's 138, as a stop by a signal is)."""
    step = cli.trainer.global_step
    requeue = next((c.requeue for c in cli.trainer.callbacks if isinstance(c, SigtermAtStepBoundary)), 0)
    if not requeue:
        return stopped(run_dir, recipe, "stopped by SIGTERM", 128 + signal.SIGTERM, step)
    status, name = 128 + requeue, signal.Signals(requeue).name
    if not is_first_process():
        return status
    job = slurm_job_id()
    # SLURM ends the job (SIGTERM, then SIGKILL) as it requeues it: this process has only its line left to say
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
            failure = None if result.returncode == 0 else (f"exit status {result.returncode}" + (
                f": {error_line(result.stderr)}" if result.stderr.strip() else ""))
        except (OSError, subprocess.TimeoutExpired) as error:  # no scontrol on this node's PATH, or no answer
            failure = error_line(error)
        if failure is not None:
            return stopped(run_dir, recipe, f"stopped by SLURM's {name}, but `scontrol requeue {job}` failed ({failure})",
                           status, step)
        return stopped(run_dir, recipe, f"stopped by SLURM's {name} (its requeue signal)", status, step, requeued=job)
    finally:
        signal.signal(signal.SIGTERM, previous)


def slurm_job_id() -> str:
    """This SLURM job's id as scontrol names it: <array job>_<task> for a job array's task."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def new_folders(run_dir: Path) -> list[Path]:
    """The run folder and the folders above it that do not exist yet (this launch makes them), innermost first."""
    missing = []
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def has_checkpoint(run_dir: Path) -> bool:
    """Whatever a resume could read (run_checkpoints: a SLURM requeue's hpc_ckpt_N.ckpt beside checkpoints/ too), or a
    save left part of (a DeepSpeed shard folder without its `latest`)."""
    return bool(run_checkpoints(run_dir)) or any(path.is_file() and not AtomicCheckpointIO.is_staging(path)
                                                 for path in (run_dir / "checkpoints").rglob("*"))


def remove_unstarted_run(run_dir: Path, step: int, created: list[Path]) -> None:
    """A fresh run that failed before its first step leaves no folder behind (it would hold only config.yaml), nor
    the <output-root>/<recipe>/ folders made for it, unless another run has written there since.

    A folder that was there before the launch (created empty) may hold the user's own files: only what this
    launch wrote first goes, config.yaml (which would refuse a rerun under the same name) and the corpus."""
    if step > 0 or not is_first_process() or not run_dir.is_dir():
        return
    if has_checkpoint(run_dir):
        return
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)
        for folder in created[1:]:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
    else:
        for name in ("config.yaml", CORPUS_FILE):
            (run_dir / name).unlink(missing_ok=True)


@command
def main(argv: list[str] | None = None) -> int:
    parser = train_parser()
    args, overrides = parser.parse_known_args(argv)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(DropLightningTips())
    # Lightning 2.6's own pytree helper builds torch's deprecated LeafSpec at every launch: not ours to print.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # DistillModule logs its validation metrics already summed over the ranks (on_validation_epoch_end); Lightning's
    # advice under a process group to sync them again (16 lines a run) read as if they were each rank's own.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('val/"
                                              r"(loss|tau_chain_estimate|acc_\d+|recall\d+_\d+)', \.\.\., sync_dist=True\)`")
    if args.recipe is not None:
        check_recipe_name(args.recipe)
    check_resume_alone(args)
    check_launcher()  # before the run folder's lock, which every rank of such a launch takes (check_launch: too late)
    held = contextlib.ExitStack()  # the run folder's lock (hold_run_folder), released as main returns
    cli = created = None  # created: set once a fresh run's folder is this launch's, for remove_unstarted_run
    run_dir = checkpoint = None
    trained = False  # fit ended and left the export to do
    try:
        saved = None
        if args.resume is not None:  # an empty one too: find_resume refuses it
            checkpoint, run_dir = find_resume(args.resume, Path(args.output_root) / (args.recipe or DEFAULT_RECIPE))
            args.recipe = run_recipe(run_dir, args.recipe)
            config = run_dir / "config.yaml"
            if is_first_process():
                held.enter_context(hold_run_folder(run_dir))
            if not is_deepspeed_checkpoint(checkpoint):  # (after the lock: a run still training rewrites config.yaml)
                saved = check_resumable(checkpoint)  # read once: build_cli takes a warm start's drafter config from it
                overrides += run_layer_ids(saved, config, overrides)
        else:
            args.recipe = args.recipe or DEFAULT_RECIPE
            config = recipe_path(args.recipe)
            recipe_root = Path(args.output_root) / args.recipe
            made_above = new_folders(recipe_root)  # before this launch makes any
            name = run_name(args.run)
            run_dir = recipe_root / name if name else stamped_run_folder(recipe_root)
            fresh = new_folders(run_dir) if name else [run_dir, *made_above]  # none: only what this launch wrote goes
            if is_first_process():
                held.enter_context(hold_run_folder(run_dir))
            # On every process: one that skipped the check would wait in the rendezvous rank 0 left and die in a
            # network error's traceback. No checkpoint of this launch can exist yet (saving needs every process).
            if (run_dir / "config.yaml").exists():
                if has_checkpoint(run_dir):
                    raise DDTreeError(f"run folder {run_dir} already holds a run; pick another --run or use --resume")
                if is_first_process():  # stopped before its first checkpoint, whose line said to start it again
                    print(f"[train] {run_dir} holds a run stopped before its first checkpoint: starting it again",
                          flush=True)
            created = fresh
        cli = build_cli(config, run_dir, overrides, checkpoint, saved)
        if checkpoint:
            for callback in cli.trainer.callbacks:
                if isinstance(callback, AcceptanceEvaluation):
                    callback.run_dtype = run_target_dtype(config)
        if checkpoint and is_deepspeed_checkpoint(checkpoint) and not is_deepspeed(cli.trainer.strategy):
            # Lightning would torch.load the folder: an IsADirectoryError traceback
            raise DDTreeError(f"--resume: {checkpoint} is a DeepSpeed checkpoint (a folder of per-rank shards) and this "
                              f"launch's strategy is {type(cli.trainer.strategy).__name__}: resume it under the run's "
                              "DeepSpeed strategy (drop the trainer.strategy override), or export it (make export) and "
                              "start a new run from the drafter with model.init_from")
        if checkpoint and not is_deepspeed_checkpoint(checkpoint) and is_deepspeed(cli.trainer.strategy):
            # DeepSpeed's engine would look for its shard folder there: a FileNotFoundError traceback from every rank
            raise DDTreeError(f"--resume: {checkpoint} is a single-file checkpoint (a ddp or one-device run's) and this "
                              f"launch's strategy is DeepSpeed ({type(cli.trainer.strategy).__name__}), which resumes "
                              "only its own folders of per-rank shards: resume it under the run's strategy (drop the "
                              "trainer.strategy override), or export it (make export) and start a new run from the "
                              "drafter with model.init_from")
        prepare_recipe_data(cli.datamodule, args.recipe, cli.trainer.world_size,
                            target_adapter=cli.model.hparams.target_adapter)
        build_missing_feature_store(cli, args.recipe, overrides)
        config_text = cli.parser.dump(cli.config, skip_none=False)
        if checkpoint:  # on every process, as the checks above: the export of drafter/ at the end would refuse them
            lost = files_an_export_would_lose(run_dir / "drafter") if (run_dir / "drafter").is_dir() else []
            if lost:  # after the whole training, leaving the last leg's drafter (found in a review)
                raise DDTreeError(f"--resume: {run_dir / 'drafter'} holds {', '.join(lost[:3])}"
                                  f"{f' and {len(lost) - 3} more' if len(lost) > 3 else ''}, which no export writes and "
                                  "the run's export at the end would delete: move them out of it, then resume")
            # in this order: a refused resume leaves config.yaml as it was
            config_writer = WriteConfigOnStart(run_dir / "config.yaml", config_text)
            cli.trainer.callbacks += [RefuseUnfitResume(checkpoint), config_writer]
        elif is_first_process():
            write_text_atomic(run_dir / "config.yaml", config_text)
        if is_first_process():
            taken, passed_over = resume_point(run_dir) if checkpoint else (None, None)
            if passed_over and taken.resolve() == checkpoint.resolve():  # a run folder's resume, or that one named
                print(f"[train] {passed_over} is unreadable ({why_unreadable(passed_over)}): resuming from {checkpoint}, "
                      "the run's newest readable checkpoint", flush=True)
            print(f"[train] recipe {args.recipe} -> {run_dir}" + (f" (resuming {checkpoint})" if checkpoint else ""), flush=True)
        # For devices > 1 Lightning starts the other processes by re-running this command: same folder.
        os.environ[RUN_NAME_ENV] = run_dir.name
        try:
            if is_first_process():  # inside the try: a fresh run whose data fails here leaves no folder
                write_run_corpus(cli, run_dir)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(checkpoint) if checkpoint else None)
        except SIGTERMException:  # a SystemExit with no code: without this, a killed run would exit 0
            return stopped_by_signal(cli, run_dir, args.recipe)
        except SystemExit:  # Lightning turns Ctrl-C into sys.exit(1) after its graceful shutdown
            if cli.trainer.interrupted:
                return stopped(run_dir, args.recipe, "interrupted (SIGINT)", 128 + signal.SIGINT, cli.trainer.global_step)
            raise
        except ValueError as error:  # Lightning's check of an interval longer than the epoch: a 5-line traceback
            if "`val_check_interval`" not in str(error):
                raise
            raise DDTreeError(f"trainer.val_check_interval={cli.trainer.val_check_interval} is more than the "
                              f"{cli.trainer.fit_loop.max_batches} training batches of an epoch of this data: give a "
                              "smaller one, or --trainer.check_val_every_n_epoch=null to count it across epochs") from None
        finally:
            os.environ.pop(RUN_NAME_ENV, None)
        # Lightning gives SIGUSR1 back its default action as fit ends: SLURM's requeue signal (recipes/slurm.sbatch),
        # sent as the export ran, killed the job without a line, a requeue or a drafter, with 138, a requeue's status.
        # The training is saved and what is left takes seconds: noted, and the job finishes (say_late_requeue_signal).
        late_requeue: list[int] = []
        previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: late_requeue.append(signum))
        held.callback(signal.signal, signal.SIGUSR1, previous_usr1)  # as main returns
        if cli.trainer.received_sigterm:  # arrived where no loop raises (the final evaluation, say)
            return stopped_by_signal(cli, run_dir, args.recipe)
        if cli.trainer.interrupted:  # stopped by a callback or an exception Lightning swallowed
            return stopped(run_dir, args.recipe, "interrupted", 1, cli.trainer.global_step)
        trained = True
        if checkpoint and not config_writer.started and (run_dir / "drafter").is_dir():
            if is_first_process():  # else a finished run's resume rewrote drafter/ and exited 0 without a word
                step, max_steps = cli.trainer.global_step, cli.trainer.max_steps
                if max_steps != -1 and step >= max_steps:
                    why, fix = f"had already reached step {step} of max_steps {max_steps}", "--trainer.max_steps"
                else:  # the Timer restored its spent budget, or the epochs ran out
                    why = f"stopped at step {step} of max_steps {max_steps} by its time or epoch limit"
                    fix = "--trainer.max_time (or --trainer.max_epochs)"
                print(f"[train] {run_dir} {why}: nothing trained, its drafter/ kept; raise {fix} to train further",
                      flush=True)
            end_process_group()
            say_late_requeue_signal(late_requeue)
            return 0
        drafter = drafter_for_export(cli.model, cli.trainer)  # every rank: DeepSpeed gathers the fp32 weights
        non_finite = non_finite_tensors(drafter)
        if non_finite:  # the last update blew the weights up: no next step's loss to show it, and no export of noise
            raise NonFiniteError(f"training ended at step {cli.trainer.global_step} with {non_finite} of the drafter's "
                                 "parameter tensors holding NaN or inf: no drafter exported")
        end_process_group()  # here, where every rank is: under NCCL closing waits for the others, and an export can fail
        if cli.trainer.is_global_zero:
            write_text_atomic(run_dir / DATA_RECORD, json.dumps(cli.datamodule.record(), indent=1) + "\n")
            # the run's own drafter/: a resume's replaces the one written before (a file no export writes is refused);
            # the run's corpus only where this launch trained with it (a resume may drop model.corpus, and its file stays)
            corpus = run_corpus(run_dir) if cli.model.hparams.corpus else None
            drafter_dir = export_drafter(drafter, run_dir / "drafter", corpus, overwrite=True)
            export = "make export takes the best checkpoint by default"
            if not (run_dir / "checkpoints" / "best.ckpt").exists():  # none kept, none saved or none measured
                export += (f", and this run has none: {why_no_best(run_dir)}; `make export RUN="
                           f"{shlex.quote(str(run_dir))} OUT=exports/<name> CKPT=last` exports these weights")
            print(f"[train] drafter written to {drafter_dir}: the last step's weights; `{bench_command(cli, drafter_dir)}`"
                  + (" with --target the target merged with model.target_adapter (ddtree loads no adapter; the "
                     "export's card shows the merge)" if cli.model.hparams.target_adapter else "")
                  + f" measures them as the training-time evaluation did ({export})", flush=True)
            unmeasured = unmeasured_last_step(cli)
            if unmeasured is not None:
                print(f"[train] step {unmeasured}, the last, was saved unmeasured where a SIGTERM (or SLURM's requeue "
                      "signal) stopped the run, and no launch trains past it to measure it: "
                      f"`make eval RUN={shlex.quote(str(run_dir))} CKPT=last` measures it (best.ckpt and report.md rank the steps measured before)", flush=True)
        say_late_requeue_signal(late_requeue)
        return 0
    except BaseException as error:
        if created is not None:  # a fresh run's failure, from a bad override to a NaN at its first step; still locked
            remove_unstarted_run(run_dir, cli.trainer.global_step if cli else 0, created)
        if isinstance(error, (KeyboardInterrupt, Terminated)) and run_dir is not None:
            # Ctrl-C or a SIGTERM outside Lightning's loop (the data, the feature store, the export after fit; a SIGTERM
            # in fit's set-up, before Lightning's handler, too): the line a stop in the loop gives, caught above, and
            # what was half-written is gone (`finally` blocks on the way here)
            why, status = (("interrupted (SIGINT)", INTERRUPTED) if isinstance(error, KeyboardInterrupt)
                           else ("stopped by SIGTERM", TERMINATED))
            step = cli.trainer.global_step if cli is not None else 0
            if not step and checkpoint is not None:  # a resume stopped before fit restored its step
                step = max(saved_step(checkpoint), 0)
            return stopped(run_dir, args.recipe, why, status, step, exporting=trained)
        unexpected = isinstance(error, Exception) and not isinstance(error, (DDTreeError, NonFiniteError))
        if unexpected and cli is not None and cli.trainer.global_step > 0:
            # an evaluation or a step that crashed (out of memory, say) after steps were checkpointed: its traceback
            # alone said neither that the run can go on nor how
            stopped(run_dir, args.recipe, f"failed ({type(error).__name__})", 1, cli.trainer.global_step)
        if not isinstance(error, NonFiniteError):
            raise
        print(f"error: {error}; {finite_checkpoint_line(run_dir)}", file=sys.stderr)  # not bad input: the run failed
        return 1
    finally:
        held.close()


def say_late_requeue_signal(noted: list[int]) -> None:
    """One line where SLURM's requeue signal came after training had ended: the job finished instead."""
    if noted and is_first_process():
        print(f"[train] SLURM's {signal.Signals(noted[0]).name} (its requeue signal) came after training had ended: "
              "the job was not requeued, it finished the run", flush=True)


def unmeasured_last_step(cli: DistillCLI) -> int | None:
    """The step a resume that trained nothing ended at, where a SIGTERM saved it unmeasured (AcceptanceEvaluation
    measures such a step as a resume starts training, which Lightning does not past the planned last step); else None."""
    step = cli.trainer.global_step
    for callback in cli.trainer.callbacks:
        if isinstance(callback, AcceptanceEvaluation) and callback.unmeasured_stop is not None:
            if callback.unmeasured_stop[0] == step and callback.last_step != step:
                return step
    return None


def finite_checkpoint_line(run_dir: Path) -> str:
    """Where a diverged run can be taken up: its newest checkpoint with finite weights (each checked by loading it)."""
    if not is_first_process():
        return "rank 0 names the newest checkpoint with finite weights"
    good = newest_finite_checkpoint(run_dir)
    if good is None:
        return f"no checkpoint of {run_dir} has finite weights: start again (a lower model.lr?)"
    return (f"the newest checkpoint with finite weights is {good} (make eval/export take it: "
            f"CKPT={shlex.quote(str(good))}; make train RESUME={shlex.quote(str(good))} continues from it)")


def bench_command(cli: DistillCLI, drafter_dir: Path) -> str:
    """`ddtree bench` on the exported drafter with the run's eval settings (prompts, limit, new tokens, budgets, lookup
    and re-drafting) and its target in the dtype training ran it in, so it gives the tau the run logged. A bare
    `ddtree bench --drafter` was printed here, which stops at once for want of --prompts (found in a review)."""
    hp = cli.model.hparams
    evaluation = next((c for c in cli.trainer.callbacks if isinstance(c, AcceptanceEvaluation)), AcceptanceEvaluation())
    dtype = str(dtype_for_precision(cli.trainer.precision, hp.target_dtype)).removeprefix("torch.")
    script = Path(sys.executable).parent / "ddtree"  # the console script of this environment, named as run from here
    if script.is_file() and script.absolute().is_relative_to(Path.cwd()):
        script = script.absolute().relative_to(Path.cwd())
    words = [str(script) if script.is_file() else "ddtree", "bench", "--target", str(hp.target),
             "--drafter", str(drafter_dir), "--dtype", dtype, "--prompts", str(evaluation.prompts_path),
             *(["--limit", str(evaluation.limit)] if evaluation.limit is not None else []),
             "--max-new-tokens", str(evaluation.max_new_tokens), "--methods", "dflash,ddtree",
             "--budgets", ",".join(map(str, evaluation.budgets))]
    for flag, value in (("--lookup", evaluation.lookup), ("--redraft", evaluation.redraft)):  # None: the drafter's own
        if value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


if __name__ == "__main__":
    sys.exit(main())
