"""Ablations: train variants of one recipe on the same budget, measure them the same way, compare.

    python -m training.ablate --recipe smollm2-135m --steps 600 \
        --variant recipe= --variant lr=--model.lr=1e-3 --variant tree     # tree: the default variant of that name
    make ablate RECIPE=smollm2-135m ARGS="--steps 600"        # the DEFAULT_VARIANTS below

Each variant is one ordinary training run (training/train.py) of the recipe with its overrides,
under <output-root>/<recipe>/ablate-<stamp>-<variant>/ (the stamp: the start time; <time>-2 for a second ablation
started in the same second), all with the same step budget (or the same
--minutes of wall time), the same data order, the same seed and the same in-training acceptance
evaluation at the end: real tree decoding of the recipe's held-out prompts (`eval:` section,
--eval-limit and --eval-max-new-tokens apply to every variant alike). Variants run one after the
other, so each has the machine to itself and their wall times compare. Under trainer.devices > 1 the processes Lightning
starts re-run this command: they take its stamp (DDTREE_ABLATE_STAMP), so train in the same run folders, and leave the
measuring and the table to global rank 0.

Equal terms:
- --steps alone: every variant trains exactly that many steps (the recipe's trainer.max_time is lifted);
- --minutes alone: every variant trains for that long or the recipe's max_steps, whichever ends first (the schedule
  is the steps'; the learning rate warms up and anneals by the clock where it comes first, model.anneal_by_max_time,
  by the clock alone for a variant with trainer.max_steps=-1 on a recipe without max_epochs), so a faster
  variant trains more steps, as equal time means; both: whichever ends first, as in training;
- either way a variant is evaluated, validated and checkpointed only where it stops (the recipe's eval.every_n_train_steps
  and trainer.val_check_interval are moved there): an evaluation on the way would take its time from training, more of
  it from a slower variant;
- the same data, unless a feature store is time-boxed (data.store_max_minutes): such a store holds the share of the
  training split its build reached, and variants with other distillation settings read other stores (plain, -final,
  -top<k>), each cut by its own clock. The table counts each variant's training sequences (<run>/data.json) and says
  so where they differ; whole stores (make features FORCE=1 ARGS=--data.store_max_minutes=null, per store kind) or
  online features (--data.feature_store=null) put every variant on all of it;
- "launch min" is each variant's whole launch, set-up included: the first variant to need a store builds it;
- the same decoding kernels: eval.packed_weights auto (a CPU fp32 target through packed weights where a second's timing
  finds them faster) is decided by the first variant measured, and the others of its target decode with its choice
  (--eval.packed_weights=on or off); each evaluation records it, and the table says where variants differ.
Before the first variant trains, every one is checked as its own launch will check it (training.recipe's
check_before_building: its values, the machine, the files it reads): a bad one is one line naming it, and a bad flag
they all share is one line naming the flag, not a stop found after the variants before it had trained.
A variant that stops (a diverged loss, say), fails (an exception, a CUDA out-of-memory say: its traceback is printed),
or ends with no evaluation (no step trained), is a row saying so; the others still run, the table is written, and the
exit status is not 0. Ctrl-C or SIGTERM (a scheduler's) stops the whole ablation, wherever a variant's launch is (its
training, or its set-up and export, outside Lightning's fit): the interrupted variant is a row, the table of the variants
so far is written, the status is 130 or 143, and the last line is the `make ablate` that trains only the variants not
measured (the interrupted one, unless its final evaluation was written before the stop, and those after it), into a
table of their own; a stop after the last variant's launch, with every variant measured, ends on the stop's own line.

The table (printed at the end, and written with a plot to <output-root>/<recipe>/ablate-<stamp>.{md,json,png} after
each variant, so an ablation killed midway keeps the variants it finished):
validation loss (the published decayed cross-entropy at the published gamma for the block size, whatever the variant
trains on), per-depth
top-1 accuracy and top-4 recall of the target's token on the validation split, tau at every
budget and for the chain, and the drafter's expected tau beside the measured one. A note under it names the variants
whose decoder added to the drafter's own drafts (context lookup, the corpus, re-drafting: model.redraft_prob > 0 sets
the drafter's redraft), whose tau is therefore not the drafter's alone.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import logging
import math
import os
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

from .arguments import ablate_parser, answer_early, check_recipe_args, check_recipe_name, recipe_path

# python -m: --help and a bad --recipe before Lightning loads
answer_early(__name__, ablate_parser, check_recipe_args, overrides=True)

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddtree.bench import CHAIN, budget_of
from ddtree.errors import INTERRUPTED, TERMINATED, DDTreeError, SigtermRaises, Terminated, command, error_line
from ddtree.files import atomic_file, finite_json, read_yaml_mapping, unwritable_as_error, write_text_atomic

from .callbacks import AcceptanceEvaluation
from .checkpoint_paths import ABLATE_PREFIX
from .loss import RECALL_K
from .module import DistillModule
from .data import DATA_RECORD
from .recipe import check_before_building, check_values, field_overrides, read_recipe, recipe_errors
from .strategies import is_first_process
from .train import main as train_main

YEAR_SECONDS = 365 * 86400  # --minutes' bound: anything longer is a typo
# training.train's statuses for a stop the user (Ctrl-C) or a scheduler (SIGTERM, then SIGKILL) asked of the launch:
# they stop the whole ablation, not one variant
STOPPED_BY = {INTERRUPTED: "interrupted (SIGINT)", TERMINATED: "stopped by SIGTERM"}
ABLATE_STAMP_ENV = "DDTREE_ABLATE_STAMP"  # the ablation's stamp, handed to the processes Lightning starts
FAILED_REASON_CHARS = 160  # a failed variant's row: the exception's first line, cut (a CUDA one runs to 400 characters)
NO_STEP_LIMIT = 2**62  # --minutes under trainer.max_steps=-1: an interval no run reaches, so only the stop evaluates
PLAIN = "--model.distill_weight=0 --model.distill_top_k=0"  # no distillation, whatever the recipe distils with
KL = "--model.distill_weight=0.5 --model.distill_loss=kl"
DEFAULT_VARIANTS = [  # the published loss, the four acceptance-weighted objectives, the two distillation losses, mixes;
    # each names every objective and distillation setting, so a recipe's own choice (smollm2-135m: dpace + kl32)
    # changes none of them
    f"decayed_ce=--model.objective=decayed_ce {PLAIN}", f"dpace=--model.objective=dpace {PLAIN}",
    f"tree=--model.objective=tree {PLAIN}", f"frontier=--model.objective=frontier {PLAIN}",
    f"intree=--model.objective=intree {PLAIN}",
    f"kl=--model.objective=decayed_ce {KL} --model.distill_top_k=0",
    "lk=--model.objective=decayed_ce --model.distill_weight=0.5 --model.distill_loss=lk --model.distill_top_k=0",
    f"intree-kl=--model.objective=intree {KL} --model.distill_top_k=0",
    f"intree-kl32=--model.objective=intree {KL} --model.distill_top_k=32",
    f"dpace-kl32=--model.objective=dpace {KL} --model.distill_top_k=32",
]


def check_variant(recipe: Path, overrides: list[str], launch: bool = True):
    """What training checks before its first step, without loading the target: the recipe's fields and values, the
    model's hyperparameters (DistillModule builds nothing until configure_model) and the evaluation's settings; with
    `launch`, also the machine and the files the run reads, as training's own check_before_building does.
    Returns the variant's config."""
    config = read_recipe(recipe, overrides)
    with recipe_errors(recipe):
        if launch:
            check_before_building(config)
        else:
            check_values(config)
    DistillModule(**config.model.as_dict())
    AcceptanceEvaluation(**config.eval.as_dict())
    return config


@contextlib.contextmanager
def quiet_seed_lines():
    """Lightning's "Seed set to 0", which each read of the recipe logs to stderr: out of the way of the checks as their
    printed lines are (10 variants printed it 12 times before the first trained; each launch says it again)."""
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        seed_log.setLevel(level)


def check_shared(recipe: Path, shared: list[tuple[str, list[str]]]) -> None:
    """The flags every variant trains with, (as given, their overrides), checked once before the variants are: a bad
    one is named as the user gave it, not blamed on the first variant. Each one's values are checked on top of those
    before it, so the error names the first that fails; the machine and the files the runs read, once all are applied
    (a later flag may be what fixes them: --trainer.accelerator=cpu for a GPU recipe), so a bad data path or eval
    prompts file every variant shares is one line, not one stopped variant after another."""
    overrides = []
    for given, more in shared:
        if not more:
            continue
        overrides += more
        try:
            check_variant(recipe, overrides, launch=False)
        except DDTreeError as error:
            raise DDTreeError(f"{given}: {error}") from None
    check_variant(recipe, overrides)  # its error names the field and the recipe, as training's own would


def schedule_at_the_stop(max_steps: int, accumulate: int = 1) -> list[str]:
    """Overrides that leave a variant's evaluation, checkpoint and validation to where it stops: trainer.max_steps,
    or the clock (stops_here evaluates a max_time stop; Lightning validates when should_stop is set). An evaluation
    on the recipe's schedule would take its time from the variant's training, and more from a slower variant.
    A step count as val_check_interval needs check_val_every_n_epoch null, else Lightning refuses one past the
    first epoch; Lightning counts it in batches, `accumulate` (trainer.accumulate_grad_batches) to an optimizer step."""
    if max_steps <= 0:
        return [f"--eval.every_n_train_steps={NO_STEP_LIMIT}", f"--trainer.val_check_interval={NO_STEP_LIMIT}",
                "--trainer.check_val_every_n_epoch=null"]
    return [f"--eval.every_n_train_steps={max_steps}", f"--trainer.val_check_interval={max_steps * accumulate}",
            "--trainer.check_val_every_n_epoch=null"]


def parse_variant(text: str) -> tuple[str, list[str]]:
    """"name=--a=1 --b=2" -> ("name", ["--a=1", "--b=2"]); a bare name is the default variant of that name ("tree" ->
    DEFAULT_VARIANTS' tree=...). Any other bare name is refused: read as "tree=", it trained the recipe unchanged
    under that name, so `--variant tree --variant intree` tabulated the recipe's own objective twice as two others."""
    name, equals, overrides = text.partition("=")
    if not name:
        raise DDTreeError(f"--variant {text!r}: give name=overrides, e.g. dpace=--model.objective=dpace")
    if not name.replace("-", "").replace("_", "").isalnum():
        # said as such: "give name=overrides, e.g. dpace=..." alone left `lr.high=--model.lr=1e-3` to guess the fault
        odd = "".join(dict.fromkeys(c for c in name if not (c.isalnum() or c in "-_")))
        fixed = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        raise DDTreeError(f"--variant {text!r}: give name=overrides, the name of letters, digits, - and _ only (it "
                          f"names the variant's run folder; {name!r} has {odd!r}), e.g. "
                          f"{fixed}={overrides if equals else ''}")
    if not equals:
        defaults = dict(default.split("=", 1) for default in DEFAULT_VARIANTS)
        if name not in defaults:
            raise DDTreeError(f"--variant {text!r}: no default variant has that name ({', '.join(defaults)}); give "
                              f"{name}=overrides (e.g. {name}=--model.lr=1e-3), or {name}= for the recipe as it is")
        overrides = defaults[name]
    try:
        items = shlex.split(overrides)
    except ValueError as error:  # an unclosed quote
        raise DDTreeError(f"--variant {text!r}: {error} in its overrides; close the quote") from None
    for i, item in enumerate(items):
        # an override, or the value after one given as two words (--model.lr 1e-3); `model.lr=1e-3` was refused by
        # the recipe's parser as "unrecognized arguments on the command line" and sent the user to this command's --help
        if not item.startswith("--") and not (i and items[i - 1].startswith("--") and "=" not in items[i - 1]):
            fix = f", here --{item}" if "=" in item and not item.startswith("-") else " (a value with spaces quoted)"
            raise DDTreeError(f"--variant {text!r}: {item!r} is not a recipe override: give each as "
                              f"--section.field=value{fix}")
    return name, items


def check_shared_flags_reach_a_variant(common: list[str], variants: list[tuple[str, list[str]]]) -> None:
    """A recipe override every variant shares, which every variant sets again itself, changes none of them (theirs
    come after it): `make ablate ARGS="--steps 800 --model.distill_top_k=16"` trained the default variants each with
    its own distill_top_k, and the table never said the flag had been dropped."""
    for item in common:
        if not item.startswith("--"):
            continue
        field = item[2:].split("=", 1)[0]
        if all(field_overrides(overrides, field) for _, overrides in variants):
            names = ", ".join(name for name, _ in variants)
            raise DDTreeError(f"{item}: every variant sets {field} itself ({names}), after the flags they share, so "
                              f"it changes none of them: drop it, or give it in the variants' overrides "
                              f"(--variant name=... {item})")


def claim_stamp(root: Path, names: list[str]) -> str:
    """The ablation's stamp, its start time, taken by creating its table (ablate-<stamp>.md, empty until the first
    variant ends) here and only here: two ablations started in the same second (a sweep started with `&`) shared one,
    so each rewrote the other's table and same-named variants met in one run folder. The second now takes <time>-2, as
    stamped_run_folder (training/train.py) names a run; so does one whose variants' run folders exist already."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with unwritable_as_error(root):
        root.mkdir(parents=True, exist_ok=True)
        for number in itertools.count(1):
            candidate = stamp if number == 1 else f"{stamp}-{number}"
            if any((root / f"{ABLATE_PREFIX}{candidate}-{name}").exists() for name in names):
                continue
            try:
                (root / f"ablate-{candidate}.md").open("x").close()
                return candidate
            except FileExistsError:
                continue


def rerun_command(args, common: list[str], variants: list[tuple[str, list[str]]]) -> str:
    """The `make ablate` that trains `variants` (name, overrides) alone with the ablation's budget, evaluation and
    shared flags, each as it trained here: a default variant by its name, any other as name=overrides. After a stop,
    training's own line said to start "the same command", which trains the variants already measured again."""
    defaults = dict(parse_variant(text) for text in DEFAULT_VARIANTS)
    flags = [*(["--steps", str(args.steps)] if args.steps is not None else []),
             *(["--minutes", str(args.minutes)] if args.minutes is not None else []),
             *(["--eval-limit", str(args.eval_limit)] if args.eval_limit is not None else []),
             *(["--eval-max-new-tokens", str(args.eval_max_new_tokens)] if args.eval_max_new_tokens is not None else []),
             "--output-root", args.output_root, *common]
    for name, overrides in variants:
        flags += ["--variant", name if defaults.get(name) == overrides else f"{name}={shlex.join(overrides)}"]
    # make expands a $ in ARGS, and hands its value to the shell unquoted: one shell word that keeps each flag's own
    # quotes, in double quotes where nothing in it means anything there
    given = shlex.join(flags).replace("$", "$$")
    given = f'"{given}"' if not any(c in given for c in '"$`\\!') else shlex.quote(given)
    return f"make ablate RECIPE={shlex.quote(args.recipe)} ARGS={given}"


def last_validation(run_dir: Path) -> dict[str, float]:
    """The newest row of the run's CSV logs that has val/loss. Each launch into the run folder logs to its own
    csv/version_<N>, ordered by N: as text, version_10 came before version_9."""
    rows = []
    versions = (run_dir / "csv").glob("version_*/metrics.csv")
    for metrics in sorted(versions, key=lambda path: int(path.parent.name.removeprefix("version_"))):
        with metrics.open() as f:
            rows += [row for row in csv.DictReader(f) if row.get("val/loss")]
    if not rows:
        return {}
    return {key: float(value) for key, value in rows[-1].items() if key.startswith("val/") and value}


def last_evaluation(run_dir: Path) -> dict:
    """The newest acceptance evaluation of the run (eval/step-N.json)."""
    files = sorted((run_dir / "eval").glob("step-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise DDTreeError(f"{run_dir}: no acceptance evaluation was written; did the run reach a step?")
    return json.loads(files[-1].read_text())


def evaluated_where_it_ended(run_dir: Path, max_steps: int, every_n_train_steps: int) -> bool:
    """Whether the run's newest evaluation is where its training ended: at trainer.max_steps, off the
    eval.every_n_train_steps schedule, where only a max_time stop evaluates (stops_here; a SIGTERM's stop is saved
    unmeasured), or on it where max_time was spent as it ended (its file says max_time_stop). A SIGTERM during that
    final evaluation still makes training return 143, with nothing left to train."""
    try:
        evaluation = last_evaluation(run_dir)
        step = evaluation["step"]
    except (DDTreeError, OSError, ValueError, KeyError):  # none written, or one cut short: not measured
        return False
    return step == max_steps or step % every_n_train_steps != 0 or evaluation.get("max_time_stop") is True


def read_data_record(run_dir: Path) -> dict:
    """<run>/data.json (training/train.py): how many training sequences the run drew from; {} if it has none."""
    try:
        return json.loads((run_dir / DATA_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def stopped_variant(name: str, run_dir: Path, seconds: float, status: int, why: str = "stopped") -> dict:
    """The table's row for a variant whose training stopped with `status`, or ended with no evaluation: nothing
    measured."""
    return {"variant": name, "run": str(run_dir), "stopped": status, "why": why, "step": None, "run_minutes": seconds / 60,
            "val_loss": None, "accuracy": [], "recall": [], "tau": {}, "expected_tau": {}, "chain_tau": None,
            "chain_expected_tau": None, "decoded_with": {}}


def draft_vocab_size(run_dir: Path) -> int | None:
    """The run's model.draft_vocab_size from its config.yaml (None: the whole vocabulary, or no config.yaml)."""
    config = run_dir / "config.yaml"
    return (read_yaml_mapping(config).get("model") or {}).get("draft_vocab_size") if config.is_file() else None


def decoding_target(config) -> tuple:
    """What eval.packed_weights auto decides by for a variant: its target as training loads it, on its device. Variants
    alike in these decode alike (the first one's evaluation decides for the others); another precision or target decides
    for itself (`on` would be an error where nothing can be packed: bf16, a GPU)."""
    model, trainer = config.model, config.trainer
    return model.target, model.target_adapter, model.target_dtype, str(trainer.accelerator), str(trainer.precision)


def summarize_variant(name: str, run_dir: Path, seconds: float) -> dict:
    evaluation, validation = last_evaluation(run_dir), last_validation(run_dir)
    summary = evaluation["summary"]
    trees = {budget_of(key): stats for key, stats in summary.items() if budget_of(key) is not None}
    depth = sorted(int(key.rsplit("_", 1)[1]) for key in validation if key.startswith("val/acc_"))
    return {
        "variant": name, "run": str(run_dir), "step": evaluation["step"], "run_minutes": seconds / 60,
        "val_loss": validation.get("val/loss"),
        "accuracy": [validation[f"val/acc_{k}"] for k in depth],
        "recall": [validation.get(f"val/recall{RECALL_K}_{k}") for k in depth],
        "tau": {budget: stats["tau"] for budget, stats in sorted(trees.items())},
        "expected_tau": {budget: stats["expected_tau"] for budget, stats in sorted(trees.items())},
        "chain_tau": summary[CHAIN]["tau"],
        "chain_expected_tau": summary[CHAIN].get("expected_tau"),  # absent in evaluations made before decoding recorded it
        "data": read_data_record(run_dir),
        "draft_vocab_size": draft_vocab_size(run_dir),  # its val loss is over the labels in that vocabulary only
        # whether the target decoded through packed weights (eval.packed_weights, maybe auto): its evaluation's time
        "packed_weights": evaluation["settings"].get("packed_weights_resolved"),
        # what the decoder added to the drafter's own drafts: lookup and corpus nodes in the trees, re-drafts behind
        # the best depth-1 tokens (model.redraft_prob > 0 sets the drafter's redraft) in the trees and the chain
        "decoded_with": {key: evaluation["settings"][key] for key in ("lookup", "corpus", "redraft")
                         if evaluation["settings"].get(key)},
    }


def all_budgets(results: list[dict]) -> list[int]:
    """Every budget some variant measured (a variant may override eval.budgets; its missing cells print '-')."""
    return sorted({budget for r in results for budget in r["tau"]})


def markdown_table(results: list[dict]) -> str:
    budgets = all_budgets(results)
    top = budgets[-1] if budgets else None  # one budget for every row's ratio
    head = ["variant", "steps", "launch min", "val loss", "acc@1..", f"recall{RECALL_K}@1..",
            *[f"tau@{b} (expected)" for b in budgets], "chain tau (expected)",
            f"tree@{top} / chain" if top is not None else "tree / chain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # a variant that validated nothing (trainer.limit_val_batches=0) has no depths: a dash, as its val loss, not a blank
    fmt = lambda values: " ".join("-" if v is None else f"{v:.2f}" for v in values) or "-"  # noqa: E731
    for r in results:
        if r.get("stopped") is not None:
            cells = [r["variant"], f"{r.get('why', 'stopped')} (exit status {r['stopped']}): nothing measured",
                     f"{r['run_minutes']:.1f}",
                     *["-"] * (len(head) - 3)]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        # A tau is null in eval/step-N.json where no round ran (or the weights were not finite): a dash, as in report.md
        measured = lambda tau, expected: "-" if tau is None else f"{tau:.2f} ({fmt([expected])})"  # noqa: E731
        top_tau, chain_tau = r["tau"].get(top), r["chain_tau"]
        cells = [r["variant"], str(r["step"]), f"{r['run_minutes']:.1f}",
                 "-" if r["val_loss"] is None else f"{r['val_loss']:.3f}", fmt(r["accuracy"]), fmt(r["recall"]),
                 *[measured(r["tau"][b], r["expected_tau"][b]) if b in r["tau"] else "-" for b in budgets],
                 measured(chain_tau, r.get("chain_expected_tau")),
                 f"{top_tau / chain_tau:.2f}x" if chain_tau and top_tau is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    shares = {r["variant"]: r["data"]["train_sequences"] for r in results if r.get("data", {}).get("train_sequences")}
    if len(set(shares.values())) > 1:
        split = max(r["data"].get("train_split_sequences", 0) for r in results if r.get("data"))
        lines += ["", "The variants trained on different shares of the data (time-boxed feature stores, "
                  f"data.store_max_minutes): {', '.join(f'{name} {count}' for name, count in shares.items())} of the "
                  f"{split} training sequences. Build whole stores first (make features FORCE=1 "
                  "ARGS=--data.store_max_minutes=null, for each store kind) to compare on the same data."]
    vocabularies = {r["variant"]: r.get("draft_vocab_size") for r in results if r.get("stopped") is None}
    if len(set(vocabularies.values())) > 1:
        sizes = ", ".join(f"{name} {'the whole vocabulary' if size is None else size}" for name, size in vocabularies.items())
        lines += ["", f"The variants draft from different vocabularies (model.draft_vocab_size: {sizes}): val loss is "
                  "over the labels in each one's draft vocabulary only, so it does not compare across them. acc@ and "
                  f"recall{RECALL_K}@ count every label, one outside the vocabulary as a miss, so they do."]
    kernels = {r["variant"]: r["packed_weights"] for r in results if r.get("packed_weights") is not None}
    if len(set(kernels.values())) > 1:
        which = ", ".join(f"{name} {'on' if packed else 'off'}" for name, packed in kernels.items())
        lines += ["", f"The variants' targets decoded with different kernels (eval.packed_weights: {which}): their "
                  "launch min does not compare (packed weights evaluate faster on a CPU), and their tau may differ at "
                  "fp32's rounding. Give --eval.packed_weights=on or off to decode them alike."]
    carried = {r["variant"]: decoder_additions(r["decoded_with"]) for r in results if r.get("decoded_with")}
    if carried:  # report.md says the same of a run's own table
        decoders = "; ".join(f"{name} decoded with {how}" for name, how in carried.items())
        lines += ["", f"Not every tau is the drafter's alone: {decoders} (eval.lookup, model.corpus, "
                  "eval.redraft or model.redraft_prob): those variants' tau and tree/chain are the decoder's. Lookup and "
                  "corpus nodes go into the trees only; re-drafting runs in the chain too."]
    cut = [f"{r['variant']} ({r['stopped_after_evaluation']})" for r in results if r.get("stopped_after_evaluation")]
    if cut:
        lines += ["", f"Stopped after their final evaluation, so measured, but with no drafter/ exported: {', '.join(cut)}. "
                  "Each run's `make train RESUME=<run>/checkpoints/last.ckpt` writes it."]
    return "\n".join(lines)


def decoder_additions(decoded_with: dict) -> str:
    """{"lookup": 7, "corpus": True, "redraft": 4} -> "context lookup 7 and the corpus and re-drafting behind 4 depth-1
    tokens"."""
    parts = []
    if decoded_with.get("lookup"):
        parts.append(f"context lookup {decoded_with['lookup']}")
    if decoded_with.get("corpus"):
        parts.append("the corpus")
    if decoded_with.get("redraft"):
        parts.append(f"re-drafting behind {decoded_with['redraft']} depth-1 tokens")
    return " and ".join(parts)


def plot(results: list[dict]) -> Figure:
    # Wide enough for the 10 default variants; their names slanted, and the legends outside the axes, so that none
    # covers a name, a bar or a curve.
    figure = Figure(figsize=(14, 5), layout="constrained")
    FigureCanvasAgg(figure)
    bars, depth = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    budgets = all_budgets(results)
    width = 0.8 / (len(budgets) + 1)
    drawn: set[str] = set()  # each legend entry once
    labels = ["chain"] + [f"tree@{b}" for b in budgets]
    for i, r in enumerate(results):
        values = [r["chain_tau"]] + [r["tau"].get(b) for b in budgets]
        for j, value in enumerate(values):
            if value is None:  # not measured (a stopped variant, a budget it did not decode): no bar, as the table's dash
                continue
            bars.bar(i + j * width, value, width, color=f"C{j}", label=labels[j] if labels[j] not in drawn else None)
            drawn.add(labels[j])
        # one legend entry per variant, its colour; the two metrics told apart by the line style entries below
        depth.plot(range(1, len(r["recall"]) + 1), r["recall"], "o-", color=f"C{i}", label=r["variant"])
        depth.plot(range(1, len(r["accuracy"]) + 1), r["accuracy"], "x--", color=f"C{i}")
    depth.plot([], [], "o-", color="black", label=f"recall{RECALL_K} (any variant)")
    depth.plot([], [], "x--", color="black", label="top-1 (any variant)")
    bars.set_xticks([i + width * len(budgets) / 2 for i in range(len(results))], [r["variant"] for r in results],
                    rotation=30, ha="right")
    bars.set_ylabel("measured tau (tokens per round)")
    if drawn:  # every variant stopped: no bars to name
        bars.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.01), ncol=len(labels), frameon=False)
    depth.set_xlabel("block position (depth)")
    depth.set_ylabel("validation accuracy / recall")
    depth.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return figure


def write_results(base: Path, results: list[dict]) -> None:
    """The table, the results and the plot of the variants so far, as <base>.{md,json,png}."""
    write_text_atomic(Path(f"{base}.md"), markdown_table(results) + "\n")
    write_text_atomic(Path(f"{base}.json"), json.dumps(finite_json(results), indent=1, allow_nan=False))
    with atomic_file(Path(f"{base}.png"), "wb") as handle:
        plot(results).savefig(handle, format="png", dpi=110)


@command
def main(argv: list[str] | None = None) -> int:
    parser = ablate_parser()
    args, common = parser.parse_known_args(argv)
    check_recipe_name(args.recipe)
    if args.steps is None and args.minutes is None:
        raise DDTreeError("give --steps N (the same schedule for every variant) and/or --minutes M (the same wall time)")
    if args.steps is not None and args.steps < 1:
        raise DDTreeError(f"--steps {args.steps}: give at least 1 optimizer step")
    if args.minutes is not None and not (math.isfinite(args.minutes) and 1 <= args.minutes * 60 <= YEAR_SECONDS):
        raise DDTreeError(f"--minutes {args.minutes}: give a wall time per variant of at least one second (1/60 of a "
                          f"minute) and at most a year ({YEAR_SECONDS // 60} minutes)")
    if args.eval_limit is not None and args.eval_limit < 1:  # eval.limit's own line said "or null for every prompt",
        # which --eval-limit (an int) refuses
        raise DDTreeError(f"--eval-limit {args.eval_limit}: eval.limit={args.eval_limit}: must be at least 1; leave "
                          "--eval-limit out for the recipe's eval.limit, or give --eval.limit=null for every prompt")
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    if len({name for name, _ in variants}) != len(variants):
        raise DDTreeError(f"--variant names must differ: {[name for name, _ in variants]}")
    check_shared_flags_reach_a_variant(common, variants)
    budget = []
    if args.steps is not None and args.minutes is None:
        budget.append("--trainer.max_time=null")  # the steps alone, not the recipe's time safety net
    if args.minutes is not None and args.steps is None:  # the learning rate anneals by the clock where it cuts first
        budget.append("--model.anneal_by_max_time=true")
    if args.steps is not None:  # every evaluation, checkpoint and validation at the end only: the budget goes to training
        budget += [f"--trainer.max_steps={args.steps}", *schedule_at_the_stop(args.steps)]
    if args.minutes is not None:
        days, seconds = divmod(round(args.minutes * 60), 86400)  # Lightning's DD:HH:MM:SS
        budget.append(f"--trainer.max_time={days:02d}:{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}")
    given = " ".join(f"--{flag} {value}" for flag, value in (("steps", args.steps), ("minutes", args.minutes))
                     if value is not None)
    shared = [(given, budget)]  # (the flags as given, their overrides): what every variant trains with
    if args.eval_limit is not None:
        shared.append((f"--eval-limit {args.eval_limit}", [f"--eval.limit={args.eval_limit}"]))
    if args.eval_max_new_tokens is not None:
        shared.append((f"--eval-max-new-tokens {args.eval_max_new_tokens}",
                       [f"--eval.max_new_tokens={args.eval_max_new_tokens}"]))
    budget = [override for _, overrides in shared for override in overrides]
    # The checks read the recipe once per flag and variant: what each read prints ("[precision] ... auto -> 32-true")
    # is said again by the variant's own launch, so it is kept out of the way (2 variants printed it 6 times).
    with contextlib.redirect_stdout(io.StringIO()), quiet_seed_lines():
        check_shared(recipe_path(args.recipe), [*shared, (" ".join(common), common)])
        schedules = {}  # each variant's evaluation and validation steps under --minutes alone: at its stop only
        packing = {}  # each variant's eval.packed_weights and the target it decides by
        ends = {}  # each variant's trainer.max_steps and eval.every_n_train_steps: whether a stop came after its end
        for name, overrides in variants:  # every variant checked as training will before any trains: a bad one in the
            try:                           # last would otherwise stop the comparison after the others had trained
                config = check_variant(recipe_path(args.recipe), [*budget, *common, *overrides])
            except DDTreeError as error:
                raise DDTreeError(f"--variant {name}: {error}") from None
            # --steps set the schedule for all; a variant accumulating batches validates at its last step only if
            # its interval counts them (Lightning's val_check_interval is in batches)
            schedules[name] = schedule_at_the_stop(config.trainer.max_steps, config.trainer.accumulate_grad_batches or 1)
            packing[name] = config.eval.packed_weights, decoding_target(config)
            ends[name] = config.trainer.max_steps, config.eval.every_n_train_steps

    # For devices > 1 Lightning starts the other processes by re-running this command: they take the first one's stamp,
    # so each variant is one run folder, and leave the measuring and writing to it
    root = Path(args.output_root) / args.recipe
    first = is_first_process()
    stamp = os.environ.get(ABLATE_STAMP_ENV) or (claim_stamp(root, [name for name, _ in variants]) if first
                                                 else time.strftime("%Y%m%d-%H%M%S"))
    results, failed = [], 0
    # eval.packed_weights auto, decided once: each launch timed its own packing for a second on a machine the ablation
    # keeps busy, so variants decoded with different kernels (evaluations 1.7x apart). The first variant of a target
    # to be measured decides it, and the others of that target decode with its choice (rank 0 alone reads it: the
    # other processes of a launch decode as rank 0 chose, AcceptanceEvaluation.on_train_start).
    decided: dict[tuple, bool] = {}
    os.environ[ABLATE_STAMP_ENV] = stamp
    # A SIGTERM in a variant's set-up or export (outside Lightning's fit, which stops where a step ends, saved) is
    # training's stop (status 143), the variant's "stopped by SIGTERM" row; between launches (the table being written)
    # it is noted, and the next variant stops before it starts. (The default action ended the ablation at once, with
    # no row and no table.)
    sigterm = SigtermRaises(raising=False)  # raising in a variant's launch only
    previous_sigterm = signal.signal(signal.SIGTERM, sigterm)
    # Ctrl-C between launches likewise: its KeyboardInterrupt escaped (in write_results, say), and the ablation ended on a
    # bare `interrupted`, with no table printed, no plot and no rerun line (found in a review)
    interrupted = []

    def ctrl_c_between_launches(signum, frame):
        if sigterm.raising:  # in a variant's launch: Ctrl-C's own KeyboardInterrupt, which training stops on
            raise KeyboardInterrupt
        interrupted.append(signum)

    previous_sigint = signal.getsignal(signal.SIGINT)
    if previous_sigint is signal.default_int_handler:  # an ignored one (a background job's) stays ignored
        signal.signal(signal.SIGINT, ctrl_c_between_launches)
    try:
        for name, overrides in variants:
            run = f"{ABLATE_PREFIX}{stamp}-{name}"
            if first:
                print(f"[ablate] {name}: {' '.join(overrides) or '(the recipe as it is)'} -> {root / run}", flush=True)
            started = time.perf_counter()
            why = None
            choice, target = packing[name]
            packed = ([f"--eval.packed_weights={'on' if decided[target] else 'off'}"]
                      if choice == "auto" and target in decided else [])
            sigterm.raising = True
            try:
                if sigterm.received:  # while the table of the variant before was written
                    raise Terminated
                if interrupted:
                    raise KeyboardInterrupt
                status = train_main(["--recipe", args.recipe, "--run-name", run, "--output-root", args.output_root,
                                     *budget, *schedules[name], *common, *overrides, *packed])
            except KeyboardInterrupt:  # Ctrl-C outside training's loop (its data preparation, say): the same stop
                status = INTERRUPTED
            except Terminated:  # outside a launch's own handling (between launches, say): the same stop
                status = TERMINATED
            except Exception as error:  # a CUDA out-of-memory, say: this variant's failure, not the comparison's
                traceback.print_exc()  # not bad input: keep what a bug report needs
                reason = f"failed: {type(error).__name__}: {error_line(error)}"[:FAILED_REASON_CHARS]
                status, why = 1, reason.replace("|", "/")  # one table cell
            finally:
                sigterm.raising = False
            if not first:  # rank 0 alone wrote the evaluation and writes the table; a non-zero exit here would have
                # Lightning kill rank 0 before its table, so only a stop ends this process, with the stop's status
                if status in STOPPED_BY:
                    return status
                continue
            why = why or STOPPED_BY.get(status, "stopped")
            seconds = time.perf_counter() - started
            # A stop during the variant's final evaluation (minutes on a CPU) came after its training and its
            # measurement were written: counted, not trained again by the rerun line; only its drafter/ is missing
            measured = status == 0 or (status in STOPPED_BY and evaluated_where_it_ended(root / run, *ends[name]))
            if status != 0:  # a diverged or failed variant is a result too; the others still compare (unless stopped)
                then = "the variants after it are not run" if status in STOPPED_BY else "going on with the others"
                after = (" after its final evaluation: measured, but no drafter/ written (its training's resume line "
                         "writes it)" if measured else "")
                print(f"[ablate] {name}: {why} (exit status {status}){after}; {then}", file=sys.stderr)
                failed = status if status in STOPPED_BY else failed or status  # a stop's own status, as Ctrl-C's is 130
            if not measured:
                results.append(stopped_variant(name, root / run, seconds, status, why))
            else:
                try:
                    results.append(summarize_variant(name, root / run, seconds))
                    if status != 0:
                        results[-1]["stopped_after_evaluation"] = why
                except DDTreeError as error:  # exited 0 with nothing measured (no steps to train, say): a hole
                    print(f"[ablate] {name}: {error}; going on with the other variants", file=sys.stderr)
                    results.append(stopped_variant(name, root / run, seconds, status, "no evaluation"))
                    failed = failed or 1
                resolved = results[-1].get("packed_weights")
                if choice == "auto" and target not in decided and resolved is not None:
                    decided[target] = resolved
                    alike = [later for later, _ in variants[len(results):] if packing[later] == (choice, target)]
                    if alike:
                        print(f"[ablate] eval.packed_weights auto -> {'on' if resolved else 'off'}, as {name}'s "
                              f"evaluation measured it; the later variants of its target decode alike "
                              f"(--eval.packed_weights={'on' if resolved else 'off'}): {', '.join(alike)}", flush=True)
            write_results(root / f"ablate-{stamp}", results)  # after each variant: a killed ablation keeps them
            if status in STOPPED_BY:  # one Ctrl-C (or a scheduler's SIGTERM, before its SIGKILL) stops the ablation
                break
    finally:
        os.environ.pop(ABLATE_STAMP_ENV, None)  # a later ablation in this process takes its own
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_sigterm is None else previous_sigterm)
        if previous_sigint is signal.default_int_handler:  # (Lightning's fit leaves SIG_IGN after a Ctrl-C)
            signal.signal(signal.SIGINT, previous_sigint)

    if first:
        print(markdown_table(results))
        print(f"[ablate] table, results and plot: {root / f'ablate-{stamp}'}.{{md,json,png}}")
        # the stopped variant (unless measured before the stop) and those after it; a new ablation, with its own table
        missing = variants[len(results) - (results[-1].get("stopped") is not None):] if failed in STOPPED_BY else []
        if missing:
            # decoding with the kernels these variants had here, where one choice covers them all
            kept = {decided.get(packing[name][1]) for name, _ in missing if packing[name][0] == "auto"}
            alike = [f"--eval.packed_weights={'on' if kept.pop() else 'off'}"] if kept in ({True}, {False}) else []
            print(f"[ablate] not measured: {', '.join(name for name, _ in missing)}; to train only those (a new "
                  f"table beside this one): {rerun_command(args, [*common, *alike], missing)}", file=sys.stderr,
                  flush=True)
    # A stop noted between launches is for the next variant to stop on; after the last one (its table being written)
    # there is none, and the ablation exited 0 with no stop line, as if not stopped: every variant is measured, so it
    # ends with the usual stop line and status alone (run_cli), after the table
    if failed not in STOPPED_BY and interrupted:
        raise KeyboardInterrupt
    if failed not in STOPPED_BY and sigterm.received:
        raise Terminated
    return failed  # 130 or 143 for a stopped ablation, else the first stopped variant's status (1 for one that failed
    # or had no evaluation): a comparison with a hole is not a clean exit


if __name__ == "__main__":
    sys.exit(main())
