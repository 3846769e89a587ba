"""Measure a saved checkpoint's DDTree acceptance exactly as training measured it.

    make eval RECIPE=smollm2-135m CKPT=best     # best.ckpt of the newest run of the recipe (the default)
    make eval RECIPE=tiny CKPT=last
    make eval RUN=outputs/tiny/<run> [CKPT=last]   # that run's best.ckpt (or last.ckpt)
    python -m training.evaluate --recipe tiny --ckpt outputs/tiny/<run>/checkpoints/step-20.ckpt

Same code, same settings as the training-time evaluation (training/callbacks.py): the eval section
(prompts, budgets, max_new_tokens, limit) and the target's dtype (model.target_dtype, or the one
trainer.precision gives) come from the run's config.yaml, or from recipes/<recipe>.yaml for a
checkpoint outside a run folder (refused where the recipe's model.target is not the checkpoint's); the
target comes from the checkpoint's hyper-parameters. The drafter is the checkpoint's (LoRA adapters
merged in, as exported), and a model.corpus run's trees graft its <run>/corpus.safetensors as
training's did. When the checkpoint holds the value logged at its step, measured with the same
prompts (the file's name, and what it held: the sha256 of the prompts as read, as `ddtree bench` records it),
limit, max_new_tokens, lookup, redraft and target dtype (the sha256 and the dtype are not known in checkpoints
written before they were recorded: compared as the same), it is printed beside the new measurement; not where
the target's adapter (model.target_adapter) has other files than the checkpoint recorded (retrained in place).

Prints one row per method and writes <run>/eval/checkpoint-<name>.json (checkpoint-<name>-limit<N>.json with
--limit N, so that a partial measurement never replaces the one `make export` reports; for a checkpoint outside
a run, an eval/ folder beside it; or --out, which is never, even with --overwrite, a checkpoint, a file the
evaluation or the run reads (the config or recipe, eval.prompts), or a file a run's training writes (its
config.yaml, corpus.safetensors, data.json, report.md, tau.png, eval/step-N.json, anything in checkpoints/ or the
logs; a new file in a run folder, such as eval/bf16.json, is fine). Bad input prints one line and exits with status 2;
a results file that cannot be written (a read-only run folder, for the default too) is said so before the checkpoint
loads, and one the disk refuses at the end (full, a quota) is saved in the system's temporary folder instead, which
the error line names.
"""

from __future__ import annotations

import sys
from fnmatch import fnmatch
from pathlib import Path

from .arguments import (answer_early, check_evaluate_args, check_recipe_name, evaluate_parser, recipe_path,
                        recipes_for_target)

# python -m: --help, a bad flag, --recipe, --run or --ckpt before torch loads
answer_early(__name__, evaluate_parser, check_evaluate_args)

from ddtree.arguments import default_device
from ddtree.cli import parse_device
from ddtree.corpus import CORPUS_FILE, CorpusLookup
from ddtree.errors import DDTreeError, command
from ddtree.files import check_output_file, not_a_file, read_yaml_mapping, write_results_json
from ddtree.machine import describe_machine
from ddtree.precision import AUTO, fast_precision
from ddtree.targets import stop_token_ids

from .callbacks import AcceptanceEvaluation, changed_measurement, metrics_of
from .checkpoint_paths import ABANDONED_PREFIX, abandoned_branch, find_checkpoint, run_folder_of
from .checkpoints import Checkpoint, evaluation_state, load_checkpoint, recorded_evaluation
from .data import DATA_RECORD
from .export import run_corpus
from .peft_utils import adapter_fingerprint, adapter_folder, check_adapter_folder
from .report import tau_text
from .target import dtype_for_precision, load_frozen_target


def read_config(checkpoint: Path, recipe: str) -> tuple[dict, Path]:
    """The run's resolved config.yaml, else the recipe (for a checkpoint outside a run folder)."""
    run_dir = run_folder_of(checkpoint)
    source = run_dir / "config.yaml" if run_dir else recipe_path(recipe)
    return read_yaml_mapping(source), source


def check_same_target(config: dict, source: Path, checkpoint: Checkpoint) -> None:
    """The eval settings read from `source` are the checkpoint's run's only if they are for its target: a loose
    checkpoint of a tiny-random run read the default recipe's (smollm2-135m's) prompts, budgets and max_new_tokens."""
    target, trained = (config.get("model") or {}).get("target"), checkpoint.hyper_parameters["target"]
    if target is None or target == trained:
        return
    fitting = recipes_for_target(trained)
    hint = f" (recipes for {trained!r}: {', '.join(fitting)})" if fitting else ""
    raise DDTreeError(f"{source}: model.target {target!r} is not CKPT {checkpoint.path}'s target {trained!r}, so its eval "
                      f"settings are not the run's: give the run's recipe, RECIPE=<name> (--recipe <name>){hint}")


def logged_metrics(checkpoint: Checkpoint, evaluation: AcceptanceEvaluation) -> dict | None:
    """What the training-time evaluation logged at the checkpoint's step, from its saved callback states; None where it
    measured otherwise than `evaluation` will (other prompts, or the same file holding others, limit, max_new_tokens,
    lookup, redraft or target dtype give other taus), or does not say how it measured."""
    record = recorded_evaluation(checkpoint)
    if record is None:
        return None
    saved, now = evaluation_state(checkpoint).get("measurement"), evaluation.measurement()
    if saved is None or changed_measurement(saved, now):  # (a dtype or sha256 not recorded is not known: no change)
        how = f"measured step {checkpoint.step} otherwise ({changed_measurement(saved, now)})" if saved else \
            f"did not record how it measured step {checkpoint.step}"
        print(f"[eval] training {how}: no logged tau to compare with", file=sys.stderr)
        return None
    return metrics_of(record["summary"], record["seconds"])


# What training writes into a run folder (training/train.py lists it; .train.lock is its RUN_LOCK), which its resume,
# `make eval`, `make export` and `make ablate` read: config.yaml, corpus.safetensors, data.json, checkpoints/, the logs
# and eval/step-N.json (training's record of a step, which the model card reads). In eval/ and in a branch's
# eval/abandoned-after-step-N/ only its records; make eval's own eval/checkpoint-*.json and new files are the user's.
RUN_FILES = ("config.yaml", CORPUS_FILE, DATA_RECORD, "report.md", "tau.png", ".train.lock")
RUN_FOLDERS = ("checkpoints", "drafter", "tensorboard", "csv")
# (and eval/stopped-at-step-N.json: a signal's stopped step's val loss, kept until the resume measures that step)
EVAL_RECORDS = ("step-*.json", "stopped-at-step-*.json", "accepted_depths.csv")


def is_run_file(inside: Path) -> bool:
    """Whether a path inside a run folder (relative to it) is one of the files its training writes."""
    folders, name = inside.parts[:-1], inside.name
    if not folders:
        return name in RUN_FILES or name in RUN_FOLDERS
    in_eval = folders == ("eval",) or (len(folders) == 2 and folders[0] == "eval"
                                       and folders[1].startswith(ABANDONED_PREFIX))
    return folders[0] in RUN_FOLDERS or (in_eval and any(fnmatch(name, record) for record in EVAL_RECORDS))


def check_out_is_no_input(out: Path, run_dir: Path | None, inputs: dict[str, Path]) -> None:
    """--out (--overwrite or not) is no file the run or the recipe reads, as `ddtree bench --out` is none of its inputs:
    `inputs` ({what: path}: the config the eval settings came from, the recipe, eval.prompts), and none of the files
    training writes in a run folder (the checkpoint's, or one --out lies in): is_run_file. A new file in it
    (eval/checkpoint-*.json, the default, or eval/bf16.json) is the user's."""
    place = out.resolve()
    for what, path in inputs.items():
        if place == path.resolve():
            raise DDTreeError(f"--out {out} is {what}: the results would replace it; give another --out")
    runs = [folder for folder in place.parents
            if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir()]
    for run in ([run_dir.resolve()] if run_dir else []) + runs:
        if not place.is_relative_to(run):
            continue
        inside = place.relative_to(run)
        if is_run_file(inside):
            raise DDTreeError(f"--out {out} is {inside} of the run {run}, one of the files its training writes, which "
                              "the results would replace; give a new file, such as its eval/checkpoint-<name>.json "
                              "(the default), or a path outside the run")


def check_not_a_checkpoint(out: Path) -> None:
    """--out may not replace a checkpoint (a .ckpt file, or a file in a DeepSpeed .ckpt folder), nor sit in a run's
    checkpoints/ folder, even with --overwrite: results there would cost a run its resume."""
    place = out.absolute()
    if any(part.suffix == ".ckpt" for part in (place, *place.parents)) or place.parent.name == "checkpoints":
        raise DDTreeError(f"--out {out} is a checkpoint or lies among a run's checkpoints; give a path outside them "
                          "(the default is <run>/eval/)")


def default_results_file(path: Path, limit: int | None) -> Path:
    """Where the results of checkpoint `path` go without --out: <run>/eval/checkpoint-<name>.json.

    Outside a run: beside the checkpoint's own folder (its run-like parent when it lies in a checkpoints/ folder).
    A branch a resume abandoned: beside its training-time evaluations, eval/abandoned-after-step-N/, since eval/
    holds the current branch's, whose checkpoint files of the same names are other drafters."""
    folder, branch, run_dir = path.resolve().parent, abandoned_branch(path), run_folder_of(path)
    eval_dir = (run_dir or (folder.parent if folder.name == "checkpoints" else folder)) / "eval"
    if branch is not None:
        eval_dir = eval_dir / branch[1]
    # A --limit measurement has its own name: the checkpoint's own one is what `make export` reports for its step
    partial = "" if limit is None else f"-limit{limit}"
    return eval_dir / f"checkpoint-{path.resolve().stem}{partial}.json"


@command
def main(argv: list[str] | None = None) -> int:
    args = default_device(evaluate_parser().parse_args(argv))
    check_recipe_name(args.recipe)
    parse_device(args.device)
    if args.out:
        check_output_file(args.out)  # a folder, or a path that cannot be written: before any work
        check_not_a_checkpoint(Path(args.out))
    path = find_checkpoint(args.ckpt, Path(args.output_root) / args.recipe, args.run)
    config, source = read_config(path, args.recipe)
    settings = dict(config.get("eval") or {})
    if args.limit is not None:
        if args.limit < 1:  # checked here: AcceptanceEvaluation's error would blame eval.limit of the config
            raise DDTreeError(f"--limit {args.limit} must be at least 1; omit it to use eval.limit of {source}")
        settings["limit"] = args.limit
    try:
        evaluation = AcceptanceEvaluation(**settings)
    except TypeError as error:
        raise DDTreeError(f"{source}: bad eval section ({error})") from None
    if args.out:
        check_out_is_no_input(Path(args.out), run_folder_of(path), {
            "the file the eval settings are read from": source, "the recipe": recipe_path(args.recipe),
            "the eval.prompts file": Path(evaluation.prompts_path)})
        # after: an input is refused even with --overwrite, so the line must not suggest it (as `ddtree bench`)
        check_output_file(args.out, overwrite=args.overwrite)
        out = Path(args.out)
    else:  # a run on a read-only mount (someone else's, an archive's): said now, not after every prompt is decoded
        out = default_results_file(path, args.limit)
        check_output_file(out, "--out's default", instead="give --out a path in a writable folder")

    checkpoint = load_checkpoint(path)
    hp = checkpoint.hyper_parameters
    if "target" not in hp:
        raise DDTreeError(f"CKPT {path} names no target: it was not written by training.module.DistillModule")
    check_same_target(config, source, checkpoint)
    # The dtype DistillModule.configure_model picked under that trainer precision. A run's config.yaml holds the
    # precision its launch resolved; a checkpoint outside a run reads the recipe, whose `auto` is resolved as training
    # resolves it (else it would always mean fp32).
    precision = (config.get("trainer") or {}).get("precision")
    if precision == AUTO:
        choice = fast_precision(args.device)
        precision = choice.lightning
        print(f"[precision] trainer.precision auto -> {precision} ({choice.reason})", flush=True)
    dtype = dtype_for_precision(precision, hp.get("target_dtype", "auto"))
    evaluation.target_dtype = str(dtype).removeprefix("torch.")  # recorded, and compared with training's (logged_metrics)
    comparable = True  # where training measured with these settings too (logged_metrics)
    adapter = hp.get("target_adapter")
    adapter_field = f"{path}'s model.target_adapter"  # the checkpoint's record, not an option of this command
    if adapter and not adapter_folder(adapter).is_dir():  # ~: the home folder, as training took it
        # kept as its launch gave it, and no option here gives it anew: not found is no sign of a retrained adapter
        if adapter_folder(adapter).is_absolute():
            raise DDTreeError(f"{path} was trained against target adapter {adapter} (its model.target_adapter), which "
                              "is no folder now: put the adapter it trained against back there")
        raise DDTreeError(f"{path} was trained against target adapter {adapter} (its model.target_adapter, a path "
                          f"relative to the folder training was launched in), which is no folder from here "
                          f"({Path.cwd()}): evaluate from that folder, where the path leads to the adapter")
    if adapter:
        check_adapter_folder(adapter, adapter_field)
    adapter_files = adapter_fingerprint(adapter)
    if adapter and hp.get("target_adapter_sha256") not in (None, adapter_files):
        comparable = False  # training's target was another: the adapter as it was
        print(f"[eval] {path} was trained against target adapter {adapter} as its files were then, and they have "
              "changed since (retrained?): measuring against the adapter as it is now, so the result differs from "
              "training's", file=sys.stderr)
    # Before the target loads (minutes for a large one), not after; and no option here gives other prompts: a run's
    # relative path leads to them from the folder training was launched in only
    prompts_file = Path(evaluation.prompts_path)
    problem = not_a_file(prompts_file)
    if problem:
        where = ("; put back the file the run measured on" if prompts_file.is_absolute() else f" in {Path.cwd()}; a "
                 "relative path is read from the folder training was launched in: evaluate from there")
        raise DDTreeError(f"eval.prompts={prompts_file} (from {source}): {problem}{where}")
    target, tokenizer = load_frozen_target(hp["target"], dtype, adapter, device=args.device,
                                           adapter_field=adapter_field)
    drafter = checkpoint.drafter.to(args.device)
    prompts = evaluation.prompts = evaluation.load_prompts(tokenizer)  # their fingerprint is compared (logged_metrics)
    run_dir = run_folder_of(path)
    if hp.get("corpus"):  # training decoded with the training replies grafted (model.corpus), as the export does
        corpus = run_corpus(run_dir) if run_dir else None
        if corpus is None:
            comparable = False
            print(f"[eval] {path} was trained with model.corpus, but no {CORPUS_FILE} of its run is beside it: "
                  "decoding without the corpus, so the result differs from training's", file=sys.stderr)
        else:
            evaluation.corpus = CorpusLookup.from_file(corpus)
    result = evaluation.measure(target, drafter, prompts, stop_token_ids(target, tokenizer))

    step = checkpoint.step
    logged = logged_metrics(checkpoint, evaluation) if comparable else None
    print(
        f"[eval] {path} (step {step}, settings from {source}): {len(prompts)} prompts of {evaluation.prompts_path}, "
        f"up to {evaluation.max_new_tokens} new tokens, T=0, target {hp['target']} in {str(dtype).split('.')[-1]}"
    )
    print(f"{'method':<12} {'tau':>7} {'logged':>7} {'expected':>8} {'rounds':>7}  accepted depth: rounds")
    for key, stats in result["summary"].items():
        was = logged.get(f"val/tau_{key}") if logged else None
        depths = " ".join(f"{d}:{n}" for d, n in stats["accepted_depth_counts"].items())
        print(  # "-" where no round measured (every prompt ended on its first token)
            f"{key:<12} {tau_text(stats['tau']):>7} {tau_text(was):>7} {tau_text(stats.get('expected_tau')):>8} "
            f"{stats['rounds']:>7}  {depths}"
        )
    used = {**evaluation.settings(drafter.config, len(prompts)), "limit": evaluation.limit, "target": hp["target"]}
    if adapter:
        used.update(target_adapter=adapter, target_adapter_sha256=adapter_files)
    write_results_json(out, {"checkpoint": str(path), "step": step, "settings": used,
                             "machine": describe_machine(target.device), "logged": logged, **result})
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
