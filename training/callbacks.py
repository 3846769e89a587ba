"""Acceptance during training: real DDTree decoding on held-out prompts, and checkpoints ranked by it.

    # recipes/<name>.yaml (training/train.py adds both callbacks to every run)
    eval:
      prompts: data/eval_prompts.jsonl   # held-out prompts, the `ddtree bench --prompts` format
      every_n_train_steps: 100           # checkpoints are saved at exactly these steps
      budgets: [16, 32, 64]
      primary_budget: 32                 # checkpoints are ranked by val/tau_ddtree@32
      max_new_tokens: 64
      limit: 8                           # the first 8 prompts of the file
      lookup: null                       # graft N tokens of context lookup into every tree (`--lookup N`); null = the drafter's
      redraft: null                      # re-draft behind the K best depth-1 tokens (`--redraft K`); null = the drafter's
      packed_weights: auto               # a CPU fp32 target decodes through packed weights where faster (`--packed-weights`)

Every `every_n_train_steps` optimizer steps, and at the last step, `AcceptanceEvaluation` runs
`ddtree.bench.run_benchmark` (the code behind `ddtree bench`, not a copy) with the frozen target and
the live drafter at temperature 0 (with the training replies' corpus lookup where the recipe sets
model.corpus, as its exports decode by default), and logs
    val/tau_ddtree@B           measured tokens per verification round (accepted drafts + 1 bonus)
    val/tau_dflash             the same for the single chain
    val/expected_tau_ddtree@B  what the drafter predicts for its own trees (1 + sum of path probs),
                               beside the measurement: the gap is the drafter's over-confidence
    val/eval_seconds           wall time of the evaluation
plus the accepted-depth histogram (TensorBoard), the per-prompt results (eval/step-N.json) and,
in the run folder, report.md, tau.png and eval/accepted_depths.csv (training/report.py), written once BestCheckpoint
has saved the step (so they never name a best checkpoint a failed save left unwritten). A drafter whose
weights hold NaN or inf is not decoded (it would decode losslessly at tau 1.0): its taus are NaN, one line
says so, and the step ranks last. A run that ends with no evaluation at all (stopped or failed before the
first) still gets a report.md that says why.

`BestCheckpoint` saves the run at the same steps (training/recipe.py links its every_n_train_steps and
its monitor, val/tau_ddtree@<primary>, to the `eval:` section) and keeps the top k by that metric,
last.ckpt and a checkpoints/best.ckpt symlink naming the best. Both follow `is_evaluation_step`, and
Lightning runs checkpoint callbacks after all others, so the metric a checkpoint is ranked by is always
the one AcceptanceEvaluation logged at its step. A run that stops off schedule (max_time on a slow
machine) is evaluated and checkpointed at its stop too (`stops_here`): BestCheckpoint ranks that step by
what AcceptanceEvaluation measured there. A SIGTERM's stop (SigtermAtStepBoundary; SLURM's requeue signal's too) is
saved to last.ckpt at once (step-N.ckpt with checkpoint.save_last false), unmeasured and unranked, a scheduled step's
too (its evaluation takes minutes on the 8B recipes, longer than a scheduler waits before SIGKILL), so that the resume
continues from the step the stop line names; the resume measures a scheduled step so saved and ranks it
(finish_interrupted_evaluation), all but the last step of max_steps, past which Lightning starts no training loop
(training.train says so, with the command that measures it).

Distributed (DDP, DeepSpeed): every rank decodes its share of the prompts (prompt i on rank
i % world_size), all ranks gather every result and log the same numbers (each rank's checkpoint
callback must see the metric), rank 0 writes the files. Under DeepSpeed ZeRO-3 the parameters
are sharded, so evaluation decodes with a consolidated copy gathered once per evaluation.
Training state is left as it was: train/eval mode of every module, the python/numpy/torch RNG
states, gradients (decoding runs under no_grad) and autocast (disabled while decoding, so the
numbers do not depend on the training precision plugin).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import math
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint, Timer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from ddtree.bench import CHAIN, acceptance_summary, load_prompts, prompts_fingerprint, run_benchmark, tree_key
from ddtree.corpus import CorpusLookup
from ddtree.decoding import DrafterRunner, Sampling, check_target_decodable, check_tree_attention
from ddtree.errors import DDTreeError, Terminated, error_line
from ddtree.files import WriteFailed, not_a_file, write_json_atomic
from ddtree.machine import describe_machine
from ddtree.packed_linear import PACKED_KERNELS, apply_packing, cannot_pack, pack_linears, unpack_linears
from ddtree.target_runner import context_limit
from ddtree.targets import load_tokenizer, resolve_target, stop_token_ids

from . import report
from .checkpoint_paths import ABANDONED_PREFIX, saved_step
from .checkpoints import AtomicCheckpointIO, after_a_refused_save, non_finite_tensors
from .data import replies
from .peft_utils import merged_drafter
from .strategies import consolidated_copy


def monitor_metric(primary_budget: int) -> str:
    """The metric checkpoints are ranked by: val/tau_ddtree@<primary_budget>."""
    return f"val/tau_{tree_key(primary_budget)}"


def is_evaluation_step(trainer: L.Trainer, every_n_train_steps: int) -> bool:
    """Whether this optimizer step is evaluated and checkpointed: every N steps, and the planned last step.

    The planned end (max_steps, or the last batch of the last epoch) is the same on every rank,
    unlike should_stop; a run stopped off schedule is measured and checkpointed there too (`stops_here`).
    """
    step = trainer.global_step
    if step == 0:
        return False
    if step % every_n_train_steps == 0:
        return True
    if trainer.max_steps is not None and 0 < trainer.max_steps <= step:
        return True
    max_epochs = trainer.max_epochs
    return bool(trainer.is_last_batch) and max_epochs not in (None, -1) and trainer.current_epoch + 1 >= max_epochs


def accumulating(trainer: L.Trainer) -> bool:
    """Whether the micro-batch just run leaves gradients for an optimizer step still to come (accumulate_grad_batches):
    no place to stop, evaluate or save, since a checkpoint holds no accumulated gradients."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def branch_names(run_dir: Path) -> set[str]:
    """The abandoned-after-step-* folders checkpoints/ and eval/ hold. Read as a launch starts (on_fit_start), before
    either callback moves anything aside, so that both name the branch this launch leaves alike (move_aside)."""
    return {path.name for folder in (run_dir / "checkpoints", run_dir / "eval") if folder.is_dir()
            for path in folder.glob(f"{ABANDONED_PREFIX}*")}


def move_aside(paths: list[Path], folder: Path, step: int, taken: set[str]) -> Path:
    """Move what a launch saved past `step` into a new folder/abandoned-after-step-<step>[-k]/: a resume from `step`
    trains another branch, whose files of the same steps would mix with these (a step-N.ckpt the new ranking does not
    know, kept beside the new branch's eval/step-N.json). Moved, not deleted: they may be the better branch.
    `taken`: the names either folder held as the launch started (branch_names). The first name free in both: readers
    pair a branch's checkpoints with its evaluations by that name, and a launch that moved files in one folder only
    left each folder's own count apart, so a later resume named one branch -2 in checkpoints/ and none in eval/."""
    aside, copy_number = folder / f"{ABANDONED_PREFIX}{step}", 1
    while aside.name in taken or aside.exists():  # a resume from the same step again: the first branch stays put
        copy_number += 1
        aside = folder / f"{ABANDONED_PREFIX}{step}-{copy_number}"
    aside.mkdir()
    for path in paths:
        os.replace(path, aside / path.name)
    return aside


class StepTimer(Timer):
    """The Timer that `trainer.max_time` adds, stopping only where an optimizer step ends (DistillCLI swaps it in).
    Lightning's checks the clock after every micro-batch: under gradient accumulation it stopped a run between two
    micro-batches of one step, whose checkpoint then lacked the gradients already summed, and the resumed step took
    only the remaining micro-batches. Its state keeps Lightning's Timer's key, so checkpoints of either resume."""

    @property
    def state_key(self) -> str:
        return "Timer"

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if not accumulating(trainer):
            super().on_train_batch_end(trainer, *args, **kwargs)


def with_step_timer(callbacks: list) -> list:
    """`callbacks` with Lightning's own max_time Timer replaced by a StepTimer of the same budget."""
    return [StepTimer(duration=timedelta(seconds=c._duration), interval="step", verbose=c._verbose)
            if type(c) is Timer and c._interval == "step" and c._duration is not None else c for c in callbacks]


def max_time_spent(trainer: L.Trainer) -> bool:
    """Whether this rank's clock finds the budget of the Timer that `trainer.max_time` adds spent."""
    timers = [callback for callback in trainer.callbacks if isinstance(callback, Timer) and callback._interval == "step"]
    return any(timer.time_remaining() is not None and timer.time_remaining() <= 0 for timer in timers)


def stops_here(trainer: L.Trainer) -> bool:
    """Whether the run stops after this optimizer step off schedule, as seen from on_train_batch_end: a callback
    before the caller set should_stop, or the Timer that `trainer.max_time` adds (which Lightning runs after the
    other callbacks) finds the time spent. On a slow machine max_time cuts the schedule, and the stopped step is
    then the most trained one: it is measured and competes for best.ckpt like a scheduled step, saved where a
    resume continues exactly (a save in on_train_end would resume at the next epoch). Not at a SIGTERM: the sender
    gives seconds, not an evaluation's minute. Rank 0's decision on every rank, as the Timer broadcasts its own (each
    rank's clock started at its own moment).
    """
    if not getattr(trainer.fit_loop, "_can_stop_early", True) or accumulating(trainer):  # the same on every rank
        return False  # (min_steps not met yet; StepTimer stops at the step's end, measured there)
    spent = max_time_spent(trainer)
    # SIGTERM reaches each rank at its own moment (training.train's SigtermAtStepBoundary sets the flag on every rank at
    # once; a Trainer without it does not): every rank joins the broadcast, and rank 0's flag decides (a rank that
    # returned before it would leave the others' broadcast to pair with the next collective).
    sigterm, stop = trainer.strategy.broadcast((bool(trainer.received_sigterm), bool(trainer.should_stop or spent)))
    return bool(stop) and not sigterm


class SigtermAtStepBoundary(L.Callback):
    """A SIGTERM stops the run where an optimizer step ends, every process of a launch at the same step, and that step
    is saved (BestCheckpoint writes last.ckpt there), so that the resume the stop line prints continues from it
    (training/train.py adds this callback first).

    Lightning 2.6's SIGTERM handler broadcasts from inside the handler, wherever the process is. During an
    evaluation, with another rank waiting in its gather (measure_acceptance), the two never paired: both processes
    hung until killed, with no stop line and no resume command; paired with another collective they crashed. Its flag
    also stopped a run after any micro-batch, where no checkpoint can be written (accumulate_grad_batches), and after
    whatever step the signal found, which nothing saved: the resume trained the steps since the last scheduled save
    again (up to 999 of the 8B recipes'). Here the handler only notes the signal (and passes it on to the processes
    Lightning started, as Lightning's does). Where a step ends, every rank joins one all-reduce of its note, and a note
    on any rank sets trainer.received_sigterm on every rank at once: BestCheckpoint, the last callback, saves that step
    (unmeasured, a scheduled one too: AcceptanceEvaluation starts no evaluation then), and Lightning's own checks stop
    every rank after it. A signal noted after that (during the step's evaluation or
    save) stops the run before the next step trains where the step is saved (a scheduled one), else at the next step's
    end. The end of training and of fit agree too (a signal during the last evaluation).

    SLURM's requeue signal (SIGUSR1, which recipes/slurm.sbatch asks SLURM to send every task 120 s before the job
    ends) is a stop of the same kind, agreed in the same all-reduce: every rank saves the step, and training.train then
    requeues the job from rank 0 (`scontrol requeue`), whose next start resumes the run folder. Lightning's own
    requeue handler saved hpc_ckpt_N.ckpt from inside the handler, wherever each rank was: its save's barrier paired
    with another rank's evaluation gather, and a two-process DDP job hung there, neither saved nor requeued (found in a
    review, 2026-12-03). It is registered under SLURM with auto-requeue only (Lightning's default there), as before.
    """

    def __init__(self):
        self.active = False  # in fit
        self.noted = False  # this process received a SIGTERM that the ranks have not agreed on yet
        self.requeue_noted = 0  # the requeue signal this process received (0: none) that the ranks have not agreed on
        self.requeue = 0  # the requeue signal the ranks agreed on (0: none): training.train requeues the job as it stops
        self.step_ended = True  # the last micro-batch ended an optimizer step (no gradients accumulated)
        self.saved_step = 0  # the step the newest checkpoint holds (0: nothing trained, nothing to lose)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.noted, self.requeue_noted, self.requeue, self.step_ended = False, 0, 0, True
        self.active = stage == "fit"
        if self.active:  # the trainer registers whichever handlers these name after setup, as fit starts
            trainer._signal_connector._sigterm_notifier_fn = functools.partial(self.note, trainer)
            trainer._signal_connector._slurm_sigusr_handler_fn = self.note_requeue

    def note(self, trainer, signum, frame) -> None:
        """The handler: no collective here, where the process may be inside one."""
        if not self.noted and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        self.noted = True

    def note_requeue(self, signum, frame) -> None:
        """The requeue signal's handler: only noted, as a SIGTERM is (SLURM sends it to every task itself)."""
        self.requeue_noted = int(signum)

    def agree(self, trainer) -> bool:
        """Whether any rank has received a SIGTERM or the requeue signal; every rank must call it at the same point."""
        if self.active and not trainer.received_sigterm:
            noted = [int(self.noted), self.requeue_noted]
            if trainer.world_size > 1:
                # The one collective this callback adds to a step, an all-reduce of two ints: microseconds beside a
                # step's gradient all-reduce (and beside the broadcast Lightning 2.6's loop makes at every step)
                flags = torch.tensor(noted, device=trainer.strategy.root_device)
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
                noted = flags.tolist()
            self.requeue = noted[1]
            if any(noted):
                trainer._signal_connector.received_sigterm = True
        return trainer.received_sigterm

    def on_train_start(self, trainer, pl_module) -> None:
        self.saved_step = trainer.global_step  # a resume's checkpoint holds it; a new run has nothing to lose

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved_step = trainer.global_step  # every rank builds the checkpoint, whichever writes it

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Only where the step before is saved: a stop here would leave the steps since the last save unsaved (and a
        # save here, with this batch already drawn from the loader, would skip it on the resume).
        if self.active and self.step_ended and trainer.global_step == self.saved_step and self.agree(trainer):
            raise SIGTERMException  # as Lightning's loop raises it: training.train exits 143 with the resume command
            # (or, at the requeue signal, requeues the job)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Before the other callbacks: a run stopped here is not evaluated off schedule (stops_here), and BestCheckpoint
        # saves it. Not between two micro-batches of a step: a checkpoint holds no accumulated gradients.
        self.step_ended = not accumulating(trainer)
        if self.step_ended:
            self.agree(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.agree(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.agree(trainer)  # a signal during the last evaluation or save: training.train reads received_sigterm


# ----------------------------------------------------------------------------- measuring


def measure_acceptance(
    target: PreTrainedModel,
    drafter: DrafterRunner,
    prompts: list[dict],
    budgets: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    rank: int = 0,
    world_size: int = 1,
    lookup: int | None = None,
    redraft: int | None = None,
) -> dict:
    """Decode this rank's share of `prompts` with the chain and DDTree at every budget; gather all ranks.

    lookup > 0 grafts that many tokens of context lookup into every DDTree tree (the chain stays the drafter's).
    redraft > 0 re-drafts behind that many depth-1 tokens in every tree, behind the first in the chain. None, for
    either: the drafter's default, its config's `lookup` or `redraft` (generate).

    Returns {"summary": {CHAIN | tree_key(B): acceptance_summary}, "prompts": [per-prompt bench rows,
    in file order]}, identical on every rank.
    """
    # Longest first and no warm-up: the warm-up is for timings, which this does not report (it was a fifth of an
    # evaluation on the 2-core EPYC); decoding the longest prompt first still sizes the static runners (CUDA graphs)
    # once for the rest. Each generation is seeded and reset, so the order changes no result.
    share = sorted(range(rank, len(prompts), world_size), key=lambda i: -len(prompts[i]["prompt_ids"]))
    rows = []
    if share:  # a rank with no prompt (fewer prompts than ranks) still joins the gather
        results = run_benchmark(
            target, drafter, [prompts[i] for i in share], [CHAIN, "ddtree"], budgets, max_new_tokens, stop_ids,
            Sampling(temperature=0.0), seed=0, progress=False, lookup=lookup, redraft=redraft, warm=False,
        )
        rows = [dict(row, index=i) for i, row in zip(share, results["prompts"])]
    if world_size > 1:
        gathered: list[list[dict] | None] = [None] * world_size
        torch.distributed.all_gather_object(gathered, rows)
        rows = [row for part in gathered for row in part]
    rows.sort(key=lambda row: row["index"])  # file order, whatever the number of ranks
    keys = [CHAIN] + [tree_key(budget) for budget in budgets]
    return {"summary": {key: measured_summary(rows, key) for key in keys}, "prompts": rows}


def measured_summary(rows: list[dict], key: str) -> dict:
    """acceptance_summary, with NaN for a tau no round measured (every prompt ended on its first token): as for a drafter
    that was not decoded, a number that ranks below every measured tau (report.ranking_score), not None."""
    stats = acceptance_summary(rows, key)
    return {**stats, **{name: math.nan for name in ("tau", "expected_tau") if stats[name] is None}}


def logged_value(trainer: L.Trainer, name: str) -> float | None:
    """A metric the module logged (callback_metrics), as a Python float; None where it was not."""
    return float(trainer.callback_metrics[name]) if name in trainer.callback_metrics else None


def metrics_of(summary: dict, seconds: float) -> dict[str, float]:
    """The scalars logged for one evaluation."""
    metrics = {}
    for key, stats in summary.items():
        metrics[f"val/tau_{key}"] = stats["tau"]
        if stats.get("expected_tau") is not None:  # absent only in records made before decoding recorded the chain's
            metrics[f"val/expected_tau_{key}"] = stats["expected_tau"]
    metrics["val/eval_seconds"] = seconds
    return metrics


def unmeasured(budgets: list[int], non_finite: int) -> dict:
    """measure_acceptance's result for a drafter with non-finite weights, which is not decoded: its proposals are
    noise, and tree decoding, lossless whatever is proposed, would still commit the target's own token each round,
    a tau of 1.0 that measures nothing. Every tau is NaN instead, so the step ranks last (BestCheckpoint) and reads
    as unmeasured (report.md)."""
    nothing = {"tau": math.nan, "expected_tau": math.nan, "rounds": 0, "tree_nodes": 0.0, "new_tokens": 0,
               "accepted_depth_counts": {}}
    keys = [CHAIN] + [tree_key(budget) for budget in budgets]
    return {"summary": {key: dict(nothing) for key in keys}, "prompts": [], "non_finite_tensors": non_finite}


def in_dtype(drafter: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The drafter as `ddtree` decodes its export: LoRA merged in the training precision, then in the target's dtype
    (ddtree/drafters.py loads it so), so the tau that ranks checkpoints is the shipped drafter's. A copy where training
    keeps other weights (fp32 under bf16-mixed) or LoRA layers; the drafter itself where neither holds.

    Merged first: the unmerged layers round W x and the adapters' s B A x each in bf16, whose logits missed the
    export's by up to 0.045 on a tiny target (top-1 agreeing on 97% of positions)."""
    merged = merged_drafter(drafter)
    if merged is drafter and all(p.dtype == dtype for p in drafter.parameters() if p.is_floating_point()):
        return drafter
    converted = merged if merged is not drafter else copy.deepcopy(drafter)
    # parameters only: from_pretrained(dtype=) keeps the rotary inv_freq buffers in float32, so must this copy
    for module in converted.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    return converted


class TrainingStateGuard:
    """Puts back what decoding could disturb: module train/eval flags and the python/numpy/torch RNGs."""

    def __init__(self, *modules: nn.Module):
        self.modules = modules

    def __enter__(self):
        self.flags = [(m, m.training) for module in self.modules for m in module.modules()]
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return self

    def __exit__(self, *exc):
        for m, training in self.flags:
            m.training = training  # per module: .train() would also flip modules deliberately left in eval
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False


# ----------------------------------------------------------------------------- the callback


def changed_measurement(saved: dict, now: dict) -> str:
    """The settings in which two AcceptanceEvaluation.measurement() differ, as `eval.max_new_tokens 8 -> 16` or `the
    target's dtype float32 -> bfloat16`; "" where they measure alike. A dtype or prompts fingerprint not recorded (a
    checkpoint written before it was) is not known, and differs from none. The fingerprint is named only where the
    file and the limit are the same: other ones read other prompts anyway."""
    changes = []
    for key, value in now.items():
        was = saved.get(key)
        if key == "dtype":
            if None not in (was, value) and was != value:
                changes.append(f"the target's dtype {was} -> {value}")
        elif key == "prompts_sha256":
            same_file = all(saved.get(name) == now.get(name) for name in ("prompts", "limit"))
            if None not in (was, value) and was != value and same_file:
                changes.append(f"the contents of eval.prompts {now['prompts']}: prompts_sha256 {was[:12]}... -> "
                               f"{value[:12]}...")
        elif was != value:
            changes.append(f"eval.{key} {was!r} -> {value!r}")
    return ", ".join(changes)


class AcceptanceEvaluation(L.Callback):
    """Measures the live drafter's real acceptance every `every_n_train_steps` steps and at the end (see the top)."""

    def __init__(
        self,
        prompts: str = "data/eval_prompts.jsonl",  # held-out prompts in the `ddtree bench --prompts` format
        every_n_train_steps: int = 200,  # evaluate (and checkpoint) every N optimizer steps, and at the end
        budgets: list[int] = [16, 32, 64],  # DDTree node budgets; the single chain always runs too
        primary_budget: int = 32,  # checkpoints are ranked by val/tau_ddtree@<this>; must be in budgets
        max_new_tokens: int = 64,  # per prompt
        limit: int | None = 8,  # the first N prompts of the file (None = all)
        lookup: int | None = None,  # graft N tokens of context lookup into every DDTree tree (`ddtree bench --lookup`);
        # 0 = off; None = the drafter's
        redraft: int | None = None,  # re-draft behind K depth-1 tokens (`ddtree bench --redraft`); None = the drafter's
        packed_weights: str = "auto",  # the target's linear layers through oneDNN while it decodes (`--packed-weights`)
    ):
        if every_n_train_steps < 1:
            raise DDTreeError(f"eval.every_n_train_steps={every_n_train_steps}: must be at least 1")
        if not budgets or min(budgets) < 1:
            raise DDTreeError(f"eval.budgets={budgets}: give one or more node budgets, each at least 1")
        if primary_budget not in budgets:
            raise DDTreeError(f"eval.primary_budget={primary_budget} is not one of eval.budgets={budgets}; add it")
        if max_new_tokens < 3:  # 2 leaves one round room for the target's own token alone: tau 1.0 for any drafter
            raise DDTreeError(f"eval.max_new_tokens={max_new_tokens}: must be at least 3 (the first comes from prefill, "
                              "and a round needs room for a drafted token besides the target's)")
        if limit is not None and limit < 1:
            raise DDTreeError(f"eval.limit={limit}: must be at least 1, or null for every prompt")
        if lookup is not None and lookup < 0:
            raise DDTreeError(f"eval.lookup={lookup}: must be at least 0 (0 = the drafter's trees alone)")
        if redraft is not None and redraft < 0:
            raise DDTreeError(f"eval.redraft={redraft}: must be at least 0 (0 = one draft per round)")
        if packed_weights not in PACKED_KERNELS:
            raise DDTreeError(f"eval.packed_weights={packed_weights!r}: choose one of {', '.join(PACKED_KERNELS)}")
        self.prompts_path = prompts
        self.every_n_train_steps = every_n_train_steps
        self.budgets = sorted(set(budgets))
        self.primary_budget = primary_budget
        self.max_new_tokens = max_new_tokens
        self.limit = limit
        self.lookup = lookup
        self.redraft = redraft
        self.packed_weights = packed_weights
        self.pack_target: bool | None = None  # packed_weights resolved for this launch's target (packed_target)
        # The dtype the target decodes in, as "bfloat16": trainer.precision's or model.target_dtype (setup); None before
        self.target_dtype: str | None = None
        # On a resume, the dtype the run's config.yaml ran the target in (train.py): it stands in for the one that
        # checkpoints written before 2026-12-03 do not record, so their resume in another precision is refused too
        self.run_dtype: str | None = None
        self.history: list[dict] = []  # one record per evaluation; kept in checkpoints for the report
        self.prompts: list[dict] | None = None  # read in setup (needs the target's tokenizer)
        self.tokenizer = None
        self.corpus: CorpusLookup | None = None  # model.corpus: the training replies, grafted as the export will be
        self.stop_ids: list[int] | None = None  # needs the target's generation config: set at the first evaluation
        self.last_step = -1
        self.validated: tuple[int, float] | None = None  # (step, loss) of this launch's latest validation
        self.measured: tuple[int, dict] | None = None  # (step, metrics) of this launch's latest evaluation
        # The step just measured whose checkpoint BestCheckpoint has not saved yet: report.md and tau.png wait for it
        # (checkpoint_saved), so that they never name a best that a failed or killed save left unwritten
        self.unsaved_step: int | None = None
        # (step, train loss) of a scheduled step a SIGTERM (or the requeue signal) stopped and saved unmeasured: the
        # resume measures it
        self.unmeasured_stop: tuple[int, float | None] | None = None
        self.launch_started = time.perf_counter()
        self.launch_eval_seconds = 0.0
        self.branches_taken: set[str] = set()  # branch_names as this launch started (on_fit_start)

    @property
    def monitor(self) -> str:
        return monitor_metric(self.primary_budget)

    # -------------------------------------------------------------- one evaluation, usable without a Trainer

    def load_prompts(self, tokenizer) -> list[dict]:
        problem = not_a_file(self.prompts_path)
        if problem:
            raise DDTreeError(f"eval.prompts={self.prompts_path}: {problem}; give a JSONL of held-out prompts")
        try:
            return load_prompts(Path(self.prompts_path), tokenizer, self.limit)
        except DDTreeError as error:  # it names the file and line, not the setting that gave it, nor what to give
            raise DDTreeError(f"eval.prompts: {error}; fix the file (held-out prompts in the `ddtree bench --prompts` "
                              "format)") from None

    def drafter_runner(self, drafter: nn.Module, target: PreTrainedModel) -> DrafterRunner:
        """The runner decoding uses; tests override it with rigged drafters."""
        return DrafterRunner(drafter, target, corpus=self.corpus)

    def measure(
        self, target: PreTrainedModel, drafter: nn.Module, prompts: list[dict], stop_ids: list[int],
        rank: int = 0, world_size: int = 1,
    ) -> dict:
        """Decode `prompts` with `drafter` and return measure_acceptance's result; training state is untouched."""
        with (TrainingStateGuard(drafter, target), torch.no_grad(), torch.autocast(target.device.type, enabled=False),
              self.packed_target(target)):
            runner = self.drafter_runner(in_dtype(drafter, target.dtype), target)
            return measure_acceptance(
                target, runner, prompts, self.budgets, self.max_new_tokens, stop_ids, rank, world_size, self.lookup,
                self.redraft,
            )

    def resolve_packing(self, target: PreTrainedModel, say: bool = True) -> bool:
        """eval.packed_weights for this target, once: auto measures (ddtree/packed_linear.py) and says what it chose
        (where `say`: rank 0); where nothing can be packed (a GPU, bf16) it stays off without a word; `on` there is a
        DDTreeError."""
        if self.pack_target is None:
            if self.packed_weights == "auto" and cannot_pack(target):
                self.pack_target = False
            else:
                self.pack_target, reason = apply_packing(self.packed_weights, target, "eval.packed_weights")
                unpack_linears(target)  # packed_target packs it for each evaluation
                if reason and say:
                    print(f"[eval] {reason}", flush=True)
        return self.pack_target

    @contextlib.contextmanager
    def packed_target(self, target: PreTrainedModel):
        """The target's linear layers packed while it decodes, where resolve_packing chose it: on the 2-core AVX2 EPYC
        the CPU recipe's evaluation (fp32) took 1.3x less time, the same taus. Unpacked after each, since training's
        own target forwards (online features) run other shapes and the packed copy is 4 bytes a weight more."""
        packed = self.resolve_packing(target) and pack_linears(target) > 0
        try:
            yield
        finally:
            if packed:
                unpack_linears(target)

    def check_target(self, target: str) -> None:
        """The target must be one decoding takes (check_target_decodable: full attention, fixed RoPE, no ALiBi), and
        the largest budget and every prompt must fit its context, read from its config: the weights load later, in
        configure_model. Decoding refuses them too, but only at the first evaluation, N steps in, with no checkpoint."""
        unloaded = SimpleNamespace(config=AutoConfig.from_pretrained(resolve_target(target)), name_or_path_for_ddtree=target)
        check_target_decodable(unloaded, "ddtree")
        limit = context_limit(unloaded)
        if self.budgets[-1] >= limit:
            raise DDTreeError(f"eval.budgets={self.budgets}: a tree of {self.budgets[-1]} nodes cannot be verified within "
                              f"the target's context of {limit} tokens; give budgets below {limit}")
        for prompt in self.prompts or ():  # read in setup: training.train checks the target before, without them
            if len(prompt["prompt_ids"]) >= limit:
                raise DDTreeError(f"eval.prompts={self.prompts_path}: prompt {prompt['id']!r} has "
                                  f"{len(prompt['prompt_ids'])} tokens, the target's context {limit}; shorten or drop it")

    # -------------------------------------------------------------- Lightning hooks

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.prompts is not None:
            return
        # Read the prompts now, so a bad file stops the run before training, not after the first N steps.
        tokenizer = load_tokenizer(pl_module.hparams.target)  # the target's own, shared: read, never changed
        self.prompts = self.load_prompts(tokenizer)
        self.check_target(pl_module.hparams.target)
        self.tokenizer = tokenizer
        if pl_module.hparams.get("corpus"):  # the replies the export ships (training/train.py), decoded with here too
            datamodule = trainer.datamodule
            if getattr(datamodule, "train_split", None) is None:
                raise DDTreeError("model.corpus ships the training replies: fit with a DistillDataModule "
                                  "(training.train does), or leave it unset")
            self.corpus = CorpusLookup(replies(datamodule.train_split))
        # as DistillModule.configure_model loads the target, in which decoding runs it (measure)
        self.target_dtype = str(pl_module.frozen_target_dtype()).removeprefix("torch.")

    def on_fit_start(self, trainer, pl_module) -> None:
        self.branches_taken = branch_names(Path(trainer.default_root_dir))  # before BestCheckpoint moves any

    def on_train_start(self, trainer, pl_module) -> None:
        self.launch_started = time.perf_counter()
        self.launch_eval_seconds = 0.0
        self.resolve_packing(pl_module.target, say=trainer.is_global_zero)  # now: `on` where it cannot pack stops here
        if trainer.world_size > 1:  # each rank timed its own packing: all decode as rank 0 chose, and as it said
            self.pack_target = trainer.strategy.broadcast(self.pack_target)
        check_tree_attention(pl_module.target, "ddtree")  # the kernel it loaded with (setup read only the config)
        # A checkpoint is written before its step's validation runs, so a resumed history lacks that loss; the
        # evaluation's file recorded it (on_validation_end).
        for row in self.history:
            if row.get("val_loss") is None:
                row["val_loss"] = self.recorded_val_loss(Path(trainer.default_root_dir), row["step"])
        self.move_abandoned_evaluations(trainer)
        self.finish_interrupted_evaluation(trainer, pl_module)

    def move_abandoned_evaluations(self, trainer) -> None:
        """On a resume from an earlier step than the run reached, its evaluations past that step are another
        branch's: moved aside (move_aside), so that eval/ holds this branch's alone, `make eval`'s of a checkpoint
        past that step too; report.md, tau.png and accepted_depths.csv are written again from the history the
        checkpoint restored (they named the other branch's best until the next evaluation, and a launch stopped
        before it left them so)."""
        folder, step = Path(trainer.default_root_dir) / "eval", trainer.global_step
        if trainer.ckpt_path is None or not trainer.is_global_zero or not folder.is_dir():
            return
        later = sorted(path for path in folder.glob("step-*.json") if path.stem[len("step-"):].isdigit()
                       and int(path.stem[len("step-"):]) > step)
        later += sorted(path for path in folder.glob("checkpoint-*.json") if recorded_step(path) > step)
        if later:
            aside = move_aside(later, folder, step, self.branches_taken)
            print(f"[eval] moved {len(later)} evaluation file(s) past step {step} to {aside}: the launch resumed from "
                  f"step {step} trains another branch", flush=True)
            if self.history:
                self._write_report(trainer)
            else:
                report.write_no_evaluation(Path(trainer.default_root_dir), f"the run resumed from step {step}, before "
                                           "its first evaluation; the evaluations of the branch it left are in "
                                           f"{aside.relative_to(trainer.default_root_dir)}")

    def finish_interrupted_evaluation(self, trainer, pl_module) -> None:
        """A launch resumed at a scheduled step whose evaluation or save its checkpoint does not record: a SIGTERM
        saves its step at once, unmeasured (on_train_batch_end), and SLURM's SIGUSR1 saved hpc_ckpt_N.ckpt wherever the
        process was, an evaluation's minute included. Left so, that step was never measured (the best of the run, it
        may be) or measured and never saved (report.md named a best that best.ckpt did not point at). Measured now,
        before the next step; BestCheckpoint then saves and ranks it. (The last step of max_steps is not: Lightning
        starts no training loop past it, and training.train says how to measure it.)"""
        step = trainer.global_step
        # A SIGTERM's unmeasured stop, off the grid too: the last step of max_epochs, whose resume runs the loop's end
        stopped_here = self.unmeasured_stop is not None and self.unmeasured_stop[0] == step
        if step == 0 or (step % self.every_n_train_steps != 0 and not stopped_here):
            return
        if step != self.last_step:
            saver = any(isinstance(c, BestCheckpoint) for c in trainer.checkpoint_callbacks)  # which saves it then
            self._evaluate(trainer, pl_module, logged=False, checkpointed=saver)
            self.unmeasured_stop = None
            if trainer.is_global_zero:
                # its val loss is in eval/step-N.json now
                self.stop_val_loss_file(Path(trainer.default_root_dir), step).unlink(missing_ok=True)
                why = ("was stopped by SIGTERM or SLURM's requeue signal before measuring it" if stopped_here
                       else "stopped during its evaluation")
                print(f"[eval] step {step}: measured at the resume (the launch that trained it {why})", flush=True)
        elif self.history and self.history[-1]["step"] == step:  # measured; its save is BestCheckpoint's to check
            self.measured = (step, metrics_of(self.history[-1]["summary"], self.history[-1]["seconds"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Under gradient accumulation this runs once per micro-batch: evaluate a step once.
        if trainer.global_step == self.last_step:
            return
        if is_evaluation_step(trainer, self.every_n_train_steps):
            if trainer.received_sigterm:  # SigtermAtStepBoundary's stop, agreed by every rank: BestCheckpoint saves the
                # step at once, where an evaluation (minutes on the 8B recipes) would outlast the scheduler's grace
                # before SIGKILL and lose it; the resume measures it (finish_interrupted_evaluation)
                self.unmeasured_stop = (trainer.global_step, logged_value(trainer, "train/loss"))
                if trainer.is_global_zero:  # another branch's, where a resume went back before it
                    self.stop_val_loss_file(Path(trainer.default_root_dir), trainer.global_step).unlink(missing_ok=True)
            else:
                self._evaluate(trainer, pl_module, logged=True)
        elif stops_here(trainer):  # max_time: measured and ranked as a scheduled step is
            self._evaluate(trainer, pl_module, logged=True, stop=True)

    def on_train_end(self, trainer, pl_module) -> None:
        # A run stopped where on_train_batch_end could not see it coming (a stop set later in the step, by
        # validation say) still gets its final weights measured; Lightning allows no logging to the module here,
        # so this one is in the files and loggers only, with no checkpoint. Not after a SIGTERM (stops_here).
        if trainer.global_step > 0 and trainer.global_step != self.last_step and not trainer.received_sigterm:
            self._evaluate(trainer, pl_module, logged=False)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # Fit ended without an exception (after on_train_end, or where it had nothing to train).
        if stage == "fit":
            self._report_no_evaluation(trainer, "was stopped by SIGTERM" if trainer.received_sigterm else "ended")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.unsaved_step is not None:  # the step's save failed (a full disk) or was interrupted (Ctrl-C)
            self._report_unsaved(trainer)
        # Not at step 0: a launch that trained nothing leaves nothing (training/train.py removes a run it started).
        if trainer.global_step == 0:
            return
        # (Terminated: ddtree.errors' SIGTERM outside Lightning's own handler, while a resume restores its checkpoint)
        if isinstance(exception, (SIGTERMException, Terminated)) or trainer.received_sigterm:
            self._report_no_evaluation(trainer, "was stopped by SIGTERM")
        elif isinstance(exception, KeyboardInterrupt):
            self._report_no_evaluation(trainer, "was interrupted (SIGINT)")
        else:
            said = str(exception).strip().splitlines()
            self._report_no_evaluation(trainer, "failed", type(exception).__name__ + (f": {said[0]}" if said else ""))

    @property
    def prompts_sha256(self) -> str | None:
        """The fingerprint of the prompts as read (`ddtree bench` records the same one): a file edited or regenerated
        under its name reads other prompts. None before they are read (setup)."""
        return None if self.prompts is None else prompts_fingerprint(self.prompts)

    def measurement(self) -> dict:
        """The settings that say what a tau of this evaluation measures (the budgets and the ranking aside): the same
        drafter decodes to other taus in bfloat16 than in float32, so the target's dtype is one, and the prompts are
        compared by what the file held as well as by its name."""
        return {"prompts": str(self.prompts_path), "prompts_sha256": self.prompts_sha256, "limit": self.limit,
                "max_new_tokens": self.max_new_tokens, "lookup": self.lookup, "redraft": self.redraft,
                "dtype": self.target_dtype}

    def state_dict(self) -> dict:
        return {"history": self.history, "last_step": self.last_step, "measurement": self.measurement(),
                "unmeasured_stop": self.unmeasured_stop}

    def load_state_dict(self, state_dict: dict) -> None:
        # New taus are ranked against the history's (best.ckpt, the report): measured otherwise, they compare nothing
        saved, now = state_dict.get("measurement"), self.measurement()  # (checkpoints before it was kept: not checked)
        if saved is not None and saved.get("dtype") is None and self.run_dtype is not None:
            saved = {**saved, "dtype": self.run_dtype}
        changed = changed_measurement(saved, now) if saved is not None else ""
        if changed:
            fix = "resume with the run's values, or measure its checkpoints so with make eval"
            if "the target's dtype" in changed:  # a resume on another machine, or with --trainer.precision=auto
                fix = (f"resume with the run's trainer.precision and model.target_dtype (its config.yaml's, which ran "
                       f"the target in {saved['dtype']}), or warm-start a new run in {now['dtype']} from its drafter "
                       "(python -m training.export <checkpoint> <folder>, then --model.init_from=<folder>)")
            elif "the contents of eval.prompts" in changed:  # regenerated or edited under the same name
                fix = (f"put back the prompts {now['prompts']} held when the run measured them (the sha256 its "
                       "eval/step-N.json files record as settings.prompts_sha256), or warm-start a new run on these "
                       "from its drafter (python -m training.export <checkpoint> <folder>, then "
                       "--model.init_from=<folder>)")
            raise DDTreeError(f"this run measured its checkpoints' tau otherwise than the resume would ({changed}): {fix}")
        self.history = list(state_dict.get("history", []))
        self.last_step = state_dict.get("last_step", -1)
        stop = state_dict.get("unmeasured_stop")
        self.unmeasured_stop = tuple(stop) if stop is not None else None

    def on_validation_end(self, trainer, pl_module) -> None:
        # Lightning validates after the train-batch hooks of the same step, so the evaluation recorded
        # there saw the previous validation's loss: this step's row takes the fresh one.
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        # A stop that on_train_batch_end did not see coming validates before on_train_end evaluates it: kept for that row.
        self.validated = (trainer.global_step, float(trainer.callback_metrics["val/loss"]))
        if self.unmeasured_stop is not None and self.unmeasured_stop[0] == trainer.global_step:
            # A stop's step, saved before this validation (Lightning validates after the train-batch hooks): the
            # checkpoint cannot hold the loss, so the resume that measures the step reads it here (_evaluate).
            if trainer.is_global_zero:
                write_json_atomic(self.stop_val_loss_file(Path(trainer.default_root_dir), trainer.global_step),
                                  {"step": trainer.global_step, "val_loss": self.validated[1]})
        elif self.history and self.history[-1]["step"] == trainer.global_step:
            val_loss = self.validated[1]
            self.history[-1]["val_loss"] = val_loss
            if trainer.is_global_zero:
                path = self.eval_file(Path(trainer.default_root_dir), trainer.global_step)
                if path.exists():  # beside the tau measured at this step, where a resume finds it
                    write_json_atomic(path, {**json.loads(path.read_text()), "val_loss": val_loss})
                self._write_report(trainer)

    @staticmethod
    def eval_file(run_dir: Path, step: int) -> Path:
        return run_dir / "eval" / f"step-{step:06d}.json"

    @staticmethod
    def stop_val_loss_file(run_dir: Path, step: int) -> Path:
        """The validation loss of a stop's unmeasured step, until the resume measures it (not a step-N.json: the
        model card and `make ablate` read those as evaluations)."""
        return run_dir / "eval" / f"stopped-at-step-{step:06d}.json"

    @classmethod
    def recorded_val_loss(cls, run_dir: Path, step: int) -> float | None:
        """The validation loss on_validation_end recorded in the step's evaluation file; None if none."""
        return cls.read_val_loss(cls.eval_file(run_dir, step))

    @staticmethod
    def read_val_loss(path: Path) -> float | None:
        try:
            return json.loads(path.read_text()).get("val_loss")
        except (OSError, ValueError):  # no file (another node's, an older run), or unreadable: the row stays blank
            return None

    # -------------------------------------------------------------- the evaluation inside training

    def eval_drafter(self, trainer, pl_module) -> nn.Module:
        """The live drafter (LoRA layers included), or a consolidated copy under ZeRO-3."""
        drafter = pl_module.base_drafter()
        if getattr(trainer.strategy, "zero_stage_3", False):
            return consolidated_copy(drafter)
        return drafter

    def calibrate(self, trainer, pl_module) -> list[float] | None:
        """With model.calibrate, fit the drafter's draft temperatures on the validation batches first; with
        model.replay_calibration, then learn decoding's calibration on them (the evaluation decodes with it)."""
        hparams = pl_module.hparams
        if not (hparams.get("calibrate") or hparams.get("replay_calibration")) or trainer.datamodule is None:
            return None
        limit = trainer.limit_val_batches
        batches = trainer.datamodule.val_dataloader(whole=True)  # the same replays on every rank
        count = limit if isinstance(limit, int) else math.ceil(limit * len(batches))
        temperatures = None
        with TrainingStateGuard(pl_module.drafter):
            pl_module.drafter.eval()
            if hparams.get("calibrate"):
                temperatures = pl_module.calibrate_draft_temperatures(
                    itertools.islice(batches, count), self.primary_budget, self.max_new_tokens, self.stop_ids,
                    self.lookup, self.redraft, self.corpus)
            if hparams.get("replay_calibration"):
                started = time.perf_counter()
                learned = pl_module.fit_replayed_calibration(
                    itertools.islice(batches, count), self.primary_budget, self.max_new_tokens, self.stop_ids,
                    self.lookup, self.redraft, self.corpus)
                if trainer.is_global_zero:
                    print(f"[calibration] replayed on {min(count, len(batches))} validation batches in "
                          f"{time.perf_counter() - started:.1f}"
                          f" s: draft temperature {learned.describe()}", flush=True)
        return temperatures

    def _evaluate(self, trainer, pl_module, logged: bool, stop: bool = False, checkpointed: bool | None = None) -> None:
        """logged: into callback_metrics (on_train_batch_end only); stop: off the every-N grid, at a stop;
        checkpointed: whether BestCheckpoint ranks this step (None: as `logged` and `stop` imply)."""
        step = trainer.global_step
        started = time.perf_counter()
        target = pl_module.target
        if self.stop_ids is None:
            self.stop_ids = stop_token_ids(target, self.tokenizer)
        drafter = self.eval_drafter(trainer, pl_module)  # a ZeRO-3 copy shares the config calibrate writes into
        # NaN or inf weights would decode at tau 1.0 and be ranked by it: not decoded, they rank last (NaN).
        non_finite = int(trainer.strategy.broadcast(non_finite_tensors(drafter)))  # every rank decodes, or none
        temperatures = None
        if non_finite:  # nor calibrated: temperatures fitted to NaN probabilities would be kept into later steps
            result = unmeasured(self.budgets, non_finite)
        else:
            temperatures = self.calibrate(trainer, pl_module)
            result = self.measure(target, drafter, self.prompts, self.stop_ids, trainer.global_rank, trainer.world_size)
        seconds = time.perf_counter() - started  # includes waiting for the slowest rank in the gather
        self.last_step = step
        self.launch_eval_seconds += seconds
        metrics = metrics_of(result["summary"], seconds)
        self.measured = (step, metrics)

        if logged:  # into callback_metrics on every rank, where BestCheckpoint ranks by it, and the progress bar
            for name, value in metrics.items():
                pl_module.log(name, value, logger=False, prog_bar=name == self.monitor, batch_size=1)
        # Whether this step competes for best.ckpt: every one on the grid; a stop's where BestCheckpoint saves it.
        best = [c for c in trainer.checkpoint_callbacks if isinstance(c, BestCheckpoint)]
        if checkpointed is None:
            checkpointed = logged and (not stop or bool(best))
        checkpointed = (checkpointed and not any(c.save_top_k == 0 for c in best)  # 0: last only
                        and not trainer.fast_dev_run)  # BestCheckpoint saves nothing then
        self.unsaved_step = step if checkpointed and best else None

        train_loss = logged_value(trainer, "train/loss")
        # Filled by on_validation_end where validation runs at this step after the evaluation (scheduled ones); the
        # metric held now may be an earlier step's, so only a validation of this very step counts.
        val_loss = self.validated[1] if self.validated and self.validated[0] == step else None
        if self.unmeasured_stop is not None and self.unmeasured_stop[0] == step:
            # a resume measuring a SIGTERM's stop: the stopped launch logged its train loss, and validated it after
            # saving it where the step is a validation step (no resume validates it again)
            train_loss = self.unmeasured_stop[1]
            run_dir = Path(trainer.default_root_dir)
            val_loss = self.read_val_loss(self.stop_val_loss_file(run_dir, step))
            if val_loss is None:  # a resume that measured it before was stopped before saving it: its file has it
                val_loss = self.recorded_val_loss(run_dir, step)
        self.history.append(
            {
                "step": step,
                "train_loss": train_loss,
                "val_loss": val_loss,
                "seconds": seconds,
                "checkpointed": checkpointed,
                "summary": result["summary"],
                **({"non_finite_tensors": non_finite} if non_finite else {}),
                **({"draft_temperatures": temperatures} if temperatures else {}),
            }
        )
        if trainer.is_global_zero:
            self._write(trainer, metrics, result)

    def settings(self, drafter_config, num_prompts: int) -> dict:
        """What an evaluation decoded with, as report.md and `make eval`'s JSON record it."""
        return {
            "prompts": self.prompts_path, "num_prompts": num_prompts,
            "prompts_sha256": self.prompts_sha256,  # what the file held, as `ddtree bench` records it
            "max_new_tokens": self.max_new_tokens,
            "budgets": self.budgets, "primary_budget": self.primary_budget,
            "lookup": self.lookup if self.lookup is not None else drafter_config.lookup,
            "redraft": self.redraft if self.redraft is not None else drafter_config.redraft,
            "corpus": self.corpus is not None,
            "calibrated": drafter_config.calibration is not None,  # model.replay_calibration: lookups' nodes counted
            "block_size": int(drafter_config.block_size),
            # auto is measured per launch (resolve_packing): what it ran as, as `ddtree bench` records it; None before
            # a decoding resolves it
            "packed_weights": self.packed_weights, "packed_weights_resolved": self.pack_target,
            "dtype": self.target_dtype,  # the target's, and the drafter's with it (in_dtype); the model card states it
        }

    def _report_no_evaluation(self, trainer, ended: str, error: str = "") -> None:
        """report.md for a run that ends with no evaluation in its history, saying why (rank 0)."""
        if self.history or not trainer.is_global_zero:
            return
        step = trainer.global_step
        first = self.every_n_train_steps
        if trainer.max_steps is not None and 0 < trainer.max_steps < first:
            first = trainer.max_steps  # the planned last step comes first
        when = f", before its first evaluation at step {first}" if step < first else ""
        reason = f"the run {ended} at step {step}{when} (eval.every_n_train_steps={self.every_n_train_steps})"
        if error:
            reason += f", with {error}"
        report.write_no_evaluation(Path(trainer.default_root_dir), reason)

    def checkpoint_saved(self, trainer, step: int) -> None:
        """BestCheckpoint.save has written `step`'s files whole and linked best.ckpt: the report held back since the
        step's evaluation is written now.

        Written at the evaluation, before the save (seconds to minutes on the big recipes), report.md and tau.png named
        the new best while best.ckpt still linked the last one, and kept naming it where the save then failed (a full
        disk), was interrupted (Ctrl-C) or killed: a best checkpoint that did not exist. Written after it, they name
        saved steps only, whatever stops the save; on_exception adds the measured row, marked unsaved
        (_report_unsaved). BestCheckpoint calls this, as only it knows when its files are whole."""
        if self.unsaved_step != step:
            return
        self.unsaved_step = None
        if trainer.is_global_zero:
            self._write_report(trainer)

    def checkpoints_gone(self, trainer, kept: set[int], saved_up_to: int) -> None:
        """BestCheckpoint found ranked files gone as this launch resumed: the steps saved up to `saved_up_to` whose file
        is not among those `kept` rank for no best in report.md, which names best.ckpt's step again (a step measured
        since, not saved yet, still competes)."""
        for record in self.history:
            if record["checkpointed"] and record["step"] <= saved_up_to and record["step"] not in kept:
                record["checkpointed"] = False
        if trainer.is_global_zero and self.history:
            self._write_report(trainer)

    def _report_unsaved(self, trainer) -> None:
        """report.md and tau.png of a launch that stopped while saving the step it had just measured: its row says the
        checkpoint was not saved, and it competes for no best (best.ckpt links an earlier step, or none)."""
        step, self.unsaved_step = self.unsaved_step, None
        record = next((record for record in self.history if record["step"] == step), None)
        if record is None or not trainer.is_global_zero:
            return
        record.update(checkpointed=False, unsaved=True)  # this history is in no checkpoint: the save failed
        try:
            self._write_report(trainer)
        except (OSError, DDTreeError) as error:  # the full disk that failed the save: the files stay as they were,
            # written before this step's evaluation, naming saved steps only
            print(f"[eval] after the failed save of step {step}, report.md and tau.png could not both be rewritten "
                  f"({error_line(error)}): what was not shows the steps saved before", flush=True)

    def _write_report(self, trainer) -> None:
        """Rewrite report.md and tau.png from the history."""
        launch_seconds = time.perf_counter() - self.launch_started
        module = trainer.lightning_module
        datamodule = trainer.datamodule  # what data.json will record: a time-boxed store's share of the split
        drawn = datamodule.record() if getattr(datamodule, "train_set", None) is not None else None
        timers = [callback for callback in trainer.callbacks if isinstance(callback, Timer) and callback._duration]
        max_steps = trainer.max_steps
        # the limits the run was planned by: max_steps unset (-1) is none, where max_epochs plans it (the 8B recipes)
        limits = ([f"max_steps {max_steps}"] if max_steps is not None and max_steps >= 0
                  else [f"max_epochs {trainer.max_epochs}"] if trainer.max_epochs not in (None, -1) else [])
        limits += [f"max_time {report.duration_text(timer._duration)}" for timer in timers[:1]]
        settings = {**self.settings(module.drafter_config, len(self.prompts)),
                    "train_loss_note": report.training_loss_note(dict(module.hparams), module.block_size),
                    "target_note": report.target_note(dict(module.hparams)),
                    "data_notes": report.data_notes(drawn),
                    "planned_length": ", ".join(limits),
                    "ended": report.training_end(trainer.global_step, max_steps,
                                                 any(timer.time_remaining() <= 0 for timer in timers))}
        report.write_all(Path(trainer.default_root_dir), self.history, settings, self.launch_eval_seconds, launch_seconds)

    def _write(self, trainer, metrics: dict, result: dict) -> None:
        step = trainer.global_step
        # Straight to the loggers: metrics logged through the module reach them only on
        # log_every_n_steps boundaries, which evaluation steps need not be.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if hasattr(logger.experiment, "add_histogram"):  # TensorBoard
                for key, stats in result["summary"].items():
                    counts = stats["accepted_depth_counts"]
                    if counts:
                        depths = np.repeat(np.array(list(counts), dtype=np.int64), list(counts.values()))
                        edges = np.arange(-0.5, max(counts) + 1.5)  # one bin per depth
                        logger.experiment.add_histogram(f"val/accepted_depth/{key}", depths, step, bins=edges)
            logger.save()

        run_dir = Path(trainer.default_root_dir)
        settings = self.settings(trainer.lightning_module.drafter_config, len(self.prompts))
        val_loss = self.history[-1]["val_loss"]  # known here only where on_train_end evaluates a stop (on_validation_end)
        machine = describe_machine(trainer.lightning_module.device)  # this rank's: its tok/s are measured there
        # max_time spent as the evaluation ends: training stops after this step, on the evaluation grid as off it. Only
        # a stop off the grid told a reader so (make ablate, where a SIGTERM during this evaluation makes training
        # return 143), and a stop on it read as unmeasured, to be trained again. Rank 0's clock, as the Timer's, which
        # reads it a moment later (min_steps not met holds the run, as in stops_here).
        max_time_stop = getattr(trainer.fit_loop, "_can_stop_early", True) and max_time_spent(trainer)
        record = {"step": step, "settings": settings, "machine": machine, **result,
                  **({"val_loss": val_loss} if val_loss is not None else {}),
                  **({"max_time_stop": True} if max_time_stop else {})}
        try:
            write_json_atomic(self.eval_file(run_dir, step), record)
        except WriteFailed as failure:  # (a full disk) its line says how the run goes on, as a checkpoint's does
            raise DDTreeError(f"cannot write the evaluation {failure.path} ({failure.why}); "
                              f"{after_a_refused_save(failure.path)}") from None
        if self.unsaved_step != step:  # else once BestCheckpoint has saved the step (checkpoint_saved)
            self._write_report(trainer)
        launch_seconds = time.perf_counter() - self.launch_started
        if result.get("non_finite_tensors"):
            print(f"[eval] step {step}: the drafter's weights are not finite ({result['non_finite_tensors']} parameter "
                  "tensors hold NaN or inf): not decoded, no tau; this step ranks below every measured one", flush=True)
            return

        primary = result["summary"][tree_key(self.primary_budget)]
        print(
            f"[eval] step {step}: tau@{self.primary_budget} {report.tau_text(primary['tau'], 2)} "
            f"(drafter expected {report.tau_text(primary['expected_tau'], 2)}), "
            f"chain {report.tau_text(result['summary'][CHAIN]['tau'], 2)}, "
            f"{metrics['val/eval_seconds']:.1f} s ({100 * self.launch_eval_seconds / max(launch_seconds, 1e-9):.1f}% "
            "of this launch so far)",
            flush=True,
        )


def recorded_step(path: Path) -> int:
    """The step an evaluation file records; -1 for one that cannot be read (left where it is)."""
    try:
        step = json.loads(path.read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return -1
    return step if isinstance(step, int) else -1


# ----------------------------------------------------------------------------- checkpoint selection


class BestCheckpoint(Checkpoint):
    """Saves the run at the evaluation steps; keeps the top k by the measured tau, last.ckpt and best.ckpt.

    At every step `is_evaluation_step` picks (the same schedule as AcceptanceEvaluation: recipe.py
    links every_n_train_steps), the checkpoint <filename>.ckpt competes by `monitor`, the value
    AcceptanceEvaluation logged at that step, and so does the step a run stops at off schedule (max_time:
    `stops_here`), where AcceptanceEvaluation measured it; the latest wins ties (a few prompts' tau often ties, and says
    nothing then, while the later checkpoint has trained longer: the CPU recipe's run tied at 1400, 4200 and 5600
    steps, and 1400 would have been exported). last.ckpt is saved at the same
    steps (at the end of a launch that saved nothing, and where a SIGTERM stops the run: save_stop, which writes
    step-N.ckpt instead with save_last false), so a resume continues exactly from it.
    checkpoints/best.ckpt is a relative symlink to the best file, replaced atomically on rank 0 before the
    file it displaces is deleted, so it never points at a missing file; a launch re-links it as it starts,
    and deletes a displaced file the last launch stopped before deleting.
    """

    LAST_NAME = "last.ckpt"
    BEST_NAME = "best.ckpt"
    DISPLACED_NAME = ".displaced.json"  # save() is deleting the file it names (finish_removal)

    def __init__(
        self,
        dirpath: str | None = None,  # default: <trainer.default_root_dir>/checkpoints
        filename: str = "step-{step}",  # {step} and {epoch} are filled in: step-200.ckpt
        monitor: str = monitor_metric(32),  # set from eval.primary_budget by training/recipe.py
        mode: str = "max",  # the monitor is a tau: higher is better (the only mode; kept for saved configs)
        every_n_train_steps: int = 200,  # set from eval.every_n_train_steps by training/recipe.py
        save_top_k: int = 1,  # how many evaluated checkpoints to keep (-1: all, 0: only last.ckpt)
        save_last: bool = True,  # also write last.ckpt at every save, for --resume
    ):
        if mode != "max":  # report.md and the model card mark the highest tau as the best
            raise DDTreeError(f"checkpoint.mode={mode!r}: checkpoints are ranked by measured tau, where higher is "
                              "better; remove checkpoint.mode (max)")
        if save_top_k < -1:
            raise DDTreeError(f"checkpoint.save_top_k={save_top_k}: give -1 (keep all), 0 or more")
        if every_n_train_steps < 1:
            raise DDTreeError(f"checkpoint.every_n_train_steps={every_n_train_steps}: must be at least 1")
        try:
            self.file_name(filename, step=0, epoch=0)
        except (KeyError, IndexError, ValueError):
            raise DDTreeError(f"checkpoint.filename={filename!r}: only {{step}} and {{epoch}} can be filled in") from None
        if self.file_name(filename, step=0, epoch=0) == self.file_name(filename, step=1, epoch=0):
            # every evaluation would overwrite one file, and best.ckpt would hold whatever step came last
            raise DDTreeError(f"checkpoint.filename={filename!r} names every step's checkpoint alike: put {{step}} in it "
                              "(the default is step-{step})")
        if "/" in filename or os.sep in filename:  # best.ckpt was linked in the sub-folder, where nothing looks for it
            raise DDTreeError(f"checkpoint.filename={filename!r} names a sub-folder: give a file name (the default is "
                              "step-{step}); every checkpoint is saved in checkpoints/")
        self.dirpath = str(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.every_n_train_steps = every_n_train_steps
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.best_k_models: dict[str, float] = {}  # file name -> monitor value, in the order they were saved
        self.best_model_path = ""  # the best kept file (Lightning's launchers and loggers read this name)
        self.last_saved_step = -1
        self.saved_this_launch = False
        self.branches_taken: set[str] = set()  # branch_names as this launch started (on_fit_start)

    @staticmethod
    def file_name(filename: str, step: int, epoch: int) -> str:
        """"step-{step}" -> "step-200.ckpt". (Runs saved before this change hold ModelCheckpoint's
        "step-step=200.ckpt"; they resume and export as they are.)"""
        return filename.format(step=step, epoch=epoch) + ".ckpt"

    def update_best(self) -> None:
        """Point best_model_path at the best kept file, the latest of equals."""
        if not self.best_k_models or self.dirpath is None:
            self.best_model_path = ""
            return
        latest_first = reversed(self.best_k_models)  # saved in step order
        self.best_model_path = os.path.join(self.dirpath, max(latest_first, key=self.best_k_models.get))

    # -------------------------------------------------------------- Lightning hooks

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        self.update_best()

    def on_fit_start(self, trainer, pl_module) -> None:
        self.branches_taken = branch_names(Path(trainer.default_root_dir))  # before AcceptanceEvaluation moves any

    def on_train_start(self, trainer, pl_module) -> None:
        self.forget_gone(trainer)
        # A resumed ranking is loaded by now: best.ckpt names its best file even if the last launch stopped
        # between saving a new best and linking it.
        if trainer.is_global_zero and self.best_model_path and os.path.exists(self.best_model_path):
            self.link_best()
        self.finish_removal(trainer)
        # What a save killed half-way left: here, or in the run folder (SLURM's hpc_ckpt_N.ckpt is saved there).
        folders = {Path(folder) for folder in (self.dirpath, trainer.default_root_dir) if folder and os.path.isdir(folder)}
        for folder in sorted(folders) if trainer.is_global_zero else ():
            for stale in AtomicCheckpointIO.remove_stale_staging(folder):
                print(f"[checkpoint] removed {stale}: a save the last launch did not finish", flush=True)
        self.move_abandoned(trainer)
        # A scheduled step the last launch measured but did not save (AcceptanceEvaluation.finish_interrupted_evaluation
        # measured it again, or found it measured): saved now, where a resume continues exactly.
        step = trainer.global_step
        if step > 0 and step != self.last_saved_step and not trainer.fast_dev_run:
            score = self.measured_score(trainer, step)
            if score is not None:
                self.save(trainer, step, report.ranking_score(score))

    def forget_gone(self, trainer) -> None:
        """Drop from a resumed ranking the files that are gone (deleted by hand to free disk, say). Ranked still, a gone
        best kept out every later step that scored below it, so the best step left was never saved, and best.ckpt and
        report.md went on naming the gone file. The evaluations of steps with no file left rank for no best in
        report.md either (checkpoints_gone)."""
        gone = [name for name in self.best_k_models if not os.path.exists(os.path.join(self.dirpath, name))]
        gone = trainer.strategy.broadcast(gone)  # rank 0's look: the same ranking on every rank
        if not gone:
            return
        for name in gone:
            self.best_k_models.pop(name, None)
        self.update_best()
        # the steps the files left were saved at, as each records it (rank 0's read, as the look above)
        kept = trainer.strategy.broadcast({saved_step(Path(self.dirpath) / name) for name in self.best_k_models})
        for callback in trainer.callbacks:
            if isinstance(callback, AcceptanceEvaluation):
                callback.checkpoints_gone(trainer, kept, self.last_saved_step)
        if trainer.is_global_zero:
            now = (f"best.ckpt links {Path(self.best_model_path).name}" if self.best_model_path
                   else "no kept checkpoint is left to link best.ckpt to")
            print(f"[checkpoint] {', '.join(gone)}, ranked by this run, {'is' if len(gone) == 1 else 'are'} gone "
                  f"(deleted or moved): no longer ranked; {now}, and later steps compete without it", flush=True)

    def finish_removal(self, trainer) -> None:
        """Delete the file a new best displaced where the last launch stopped before deleting it: the marker
        save() writes once the new files are whole names it. Not a file of the ranking, nor the one this launch
        resumed from; the marker goes either way."""
        marker = Path(self.dirpath, self.DISPLACED_NAME)
        if not trainer.is_global_zero or not marker.exists():
            return
        try:
            displaced = json.loads(marker.read_text())["displaced"]
        except (OSError, ValueError, KeyError, TypeError):
            displaced = None  # unreadable: nothing is deleted on its word
        if isinstance(displaced, str) and displaced not in self.best_k_models and "/" not in displaced:
            if self.remove(trainer, os.path.join(self.dirpath, displaced)):
                print(f"[checkpoint] removed {displaced}: a new best displaced it before the last launch stopped",
                      flush=True)
        marker.unlink(missing_ok=True)

    def move_abandoned(self, trainer) -> None:
        """On a resume from an earlier step than the run reached, the checkpoints saved past it (last.ckpt included)
        are another branch's, outside the restored ranking: moved aside (move_aside). Left, they made more than
        save_top_k files, a step-N.ckpt unlike the report's step N, and a resume of the folder took the old branch."""
        step = trainer.global_step
        if trainer.ckpt_path is None or not trainer.is_global_zero or not os.path.isdir(self.dirpath):
            return
        later = sorted(path for path in Path(self.dirpath).glob("*.ckpt") if not path.is_symlink()
                       and path.name not in self.best_k_models and saved_step(path) > step)
        if later:
            aside = move_aside(later, Path(self.dirpath), step, self.branches_taken)
            print(f"[checkpoint] moved {', '.join(path.name for path in later)} to {aside}: saved past step {step}, "
                  f"where this launch resumed a different branch (delete the folder if you do not need them)", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.fast_dev_run or step == self.last_saved_step:
            return
        # The value AcceptanceEvaluation measured (a Python float), at a scheduled step as at a stop off schedule
        # (stops_here): the logged copy is float32, so equal taus from the two would round apart and break the
        # latest-wins rule that report.md follows.
        score = self.measured_score(trainer, step)
        if score is None and trainer.received_sigterm:  # SigtermAtStepBoundary's stop, scheduled or not: unmeasured
            if not accumulating(trainer):
                self.save_stop(trainer, step)
            return
        if not is_evaluation_step(trainer, self.every_n_train_steps):
            if score is not None:
                self.save(trainer, step, report.ranking_score(score))
            return
        if score is None:
            if self.monitor not in trainer.callback_metrics:
                raise DDTreeError(
                    f"checkpoint.monitor={self.monitor} was not logged at step {step}: it is logged by "
                    "AcceptanceEvaluation (the eval: section) at the same steps; keep eval.every_n_train_steps and "
                    "checkpoint's equal"
                )
            score = float(trainer.callback_metrics[self.monitor])
        self.save(trainer, step, report.ranking_score(score))

    def save_stop(self, trainer, step: int) -> None:
        """last.ckpt at the step a SIGTERM stops (SigtermAtStepBoundary: every rank agrees where a step ends), not
        ranked (nothing measured it): the stop line's resume then continues from the step it names, where the last
        scheduled save was up to every_n_train_steps - 1 steps earlier. A save is seconds, where an evaluation would
        be the minutes a scheduler does not give; one cut short by SIGKILL leaves the last whole one (AtomicCheckpointIO,
        DeepSpeed's `saving` marker). last_saved_step stays the last ranked save's: a scheduled step so saved is then
        ranked by the resume, once it has measured it (on_train_start).

        With save_last false the stop goes to its step's file (step-N.ckpt) instead, unranked too: a last.ckpt that no
        later save rewrites would be the run folder's resume point (resume_point takes last.ckpt first) after the run
        had moved on. The resume of a scheduled step so saved ranks it as above, writing the file again if it enters
        the top save_top_k; one that does not enter, or a stop off schedule (never measured), stays beside the ranked
        files. Before, nothing was saved then, and the resume trained the steps since the last scheduled save again."""
        self.saved_this_launch = True
        name = (self.LAST_NAME if self.save_last
                else self.file_name(self.filename, step=step, epoch=trainer.current_epoch))
        trainer.save_checkpoint(os.path.join(self.dirpath, name), weights_only=False)

    def on_train_end(self, trainer, pl_module) -> None:
        # A launch that reached no evaluation step (stopped early) still leaves last.ckpt to resume from.
        if self.save_last and not self.saved_this_launch and not trainer.fast_dev_run:
            self.last_saved_step = trainer.global_step
            trainer.save_checkpoint(os.path.join(self.dirpath, self.LAST_NAME), weights_only=False)

    def measured_score(self, trainer, step: int) -> float | None:
        """`monitor` as AcceptanceEvaluation measured it at `step` (checkpoint callbacks run after the others); None
        where it did not."""
        for callback in trainer.callbacks:
            if isinstance(callback, AcceptanceEvaluation) and callback.measured and callback.measured[0] == step:
                return callback.measured[1].get(self.monitor)
        return None

    def state_dict(self) -> dict:
        return {"best_k_models": dict(self.best_k_models), "last_saved_step": self.last_saved_step,
                "monitor": self.monitor}

    def load_state_dict(self, state_dict: dict) -> None:
        ranked_by = state_dict.get("monitor", self.monitor)  # (checkpoints written before it was kept: not checked)
        if ranked_by != self.monitor:  # the kept scores are another tau's: ranking new ones against them means nothing
            raise DDTreeError(f"this run ranked its checkpoints by {ranked_by}, the resume by {self.monitor}: resume with "
                              "the run's eval.primary_budget, or start a new run to rank by another budget")
        self.best_k_models = dict(state_dict.get("best_k_models", {}))
        self.last_saved_step = state_dict.get("last_saved_step", -1)
        self.update_best()

    # -------------------------------------------------------------- saving

    def save(self, trainer, step: int, score: float) -> None:
        """Save this step's checkpoint if it enters the top k (dropping the one it displaces), then last.ckpt."""
        name = self.file_name(self.filename, step=step, epoch=trainer.current_epoch)
        self.best_k_models.pop(name, None)  # a step saved again (a resume from an earlier checkpoint) competes anew
        # A resume with a lower save_top_k: the ranking is cut to it first (each save displaces at most one file), the
        # lowest going, never the best; their files go with the displaced one's, once the new files are whole.
        surplus = []
        while self.save_top_k != -1 and len(self.best_k_models) > max(self.save_top_k, 1):
            surplus.append(min(self.best_k_models, key=self.best_k_models.get))
            self.best_k_models.pop(surplus[-1])
        displaced = None
        if self.save_top_k == 0:  # only last.ckpt
            enters = False
        elif self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            enters = True
        else:
            displaced = min(self.best_k_models, key=self.best_k_models.get)  # the earliest of equals goes
            enters = score >= self.best_k_models[displaced]  # a tie: the later checkpoint replaces it
        enters = trainer.strategy.broadcast(enters)  # the same decision on every rank, whatever the float noise

        # The state is updated before saving: each file holds the ranking it is part of, for an exact resume.
        self.last_saved_step = step
        self.saved_this_launch = True
        if enters:
            self.best_k_models.pop(displaced, None)
            self.best_k_models[name] = score
        self.update_best()
        # Every rank saves (the strategy may shard), the whole state a resume needs; weights_only left unset, Lightning
        # logged that it defaulted to False at every save.
        if enters:
            trainer.save_checkpoint(os.path.join(self.dirpath, name), weights_only=False)
        if self.save_last:
            trainer.save_checkpoint(os.path.join(self.dirpath, self.LAST_NAME), weights_only=False)
        # best.ckpt moves before the file it may point at goes: a stop in between leaves an extra file, never a
        # link to nothing (`make export CKPT=best` reads it). The marker, written once the new files are whole,
        # names that file for the next launch to delete (on_train_start).
        marker = Path(self.dirpath, self.DISPLACED_NAME)
        if enters and displaced is not None and trainer.is_global_zero:
            write_json_atomic(marker, {"displaced": displaced, "by": name})
        if trainer.is_global_zero and self.best_model_path:
            self.link_best()
        # The new files are whole and best.ckpt links the best: now, not at the evaluation, report.md may name it
        for callback in trainer.callbacks:
            if isinstance(callback, AcceptanceEvaluation):
                callback.checkpoint_saved(trainer, step)
        if enters and displaced is not None:
            self.remove(trainer, os.path.join(self.dirpath, displaced))
            if trainer.is_global_zero:
                marker.unlink(missing_ok=True)
        for lower in surplus:
            if self.remove(trainer, os.path.join(self.dirpath, lower)) and trainer.is_global_zero:
                print(f"[checkpoint] removed {lower}: checkpoint.save_top_k={self.save_top_k} keeps fewer", flush=True)

    @staticmethod
    def remove(trainer, path: str) -> bool:
        """Delete a displaced checkpoint (rank 0), unless this launch resumed from it; whether there was one to delete."""
        if trainer.ckpt_path is not None and Path(trainer.ckpt_path).resolve() == Path(path).resolve():
            return False
        if not os.path.lexists(path):
            return False
        if os.path.islink(path):  # the strategy's remove follows the link and skips one that dangles
            if trainer.is_global_zero:
                os.unlink(path)
            return True
        trainer.strategy.remove_checkpoint(path)
        return True

    def link_best(self) -> None:
        best = Path(self.best_model_path)
        link = best.parent / self.BEST_NAME
        if link.is_symlink() and os.readlink(link) == best.name:
            return
        staging = best.parent / f".{self.BEST_NAME}.tmp"
        staging.unlink(missing_ok=True)
        staging.symlink_to(best.name)  # relative: the run folder can be moved
        os.replace(staging, link)
