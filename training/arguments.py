"""The training commands' arguments and recipe names, in a module free of torch, Lightning and transformers.

`python -m training.train` (and `features`, `evaluate`, `ablate`, `publish`, `throughput`) runs its module, whose
imports take 11-14 s on the 2-core EPYC before `main` parses anything. Each of those modules calls `answer_early`
above its heavy imports, so that `--help`, a bad value of one of its own flags, an unknown `--recipe` and a run or
checkpoint that is not there (`train --resume`, `evaluate --ckpt/--run`, `publish RUN --ckpt`:
training/checkpoint_paths.py) answer at once (a flag that `train`, `features` or `ablate` does not know is a recipe
override: the recipe's parser judges it, after the imports); its `main` then parses the same parser again (a call from
Python, a test, starts there) and checks everything else, these again among them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from ddtree.arguments import DEVICE_HELP
from ddtree.errors import CommandParser, DDTreeError, run_cli
from ddtree.files import home_expanded, path_argument, path_type, read_yaml_mapping
from ddtree.names import DTYPE_NAMES

from .checkpoint_paths import check_run_folder, find_checkpoint, find_resume, find_run_checkpoint

REPO = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO / "recipes"
DEFAULT_RECIPE = "smollm2-135m"  # the CPU default
THROUGHPUT_TARGET, THROUGHPUT_SETTINGS = "smollm2-135m", "16x5x16"  # training.throughput without --recipe


def known_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def recipes_for_target(target: str) -> list[str]:
    """The recipes whose model.target is `target`, for an error's hint."""
    return [name for name in known_recipes()
            if (read_yaml_mapping(recipe_path(name)).get("model") or {}).get("target") == target]


def check_recipe_name(name: str, flag: str = "--recipe") -> None:
    """--recipe names a file of recipes/: a run goes to outputs/<recipe>/, where a resume and `make eval` find it and
    its recipe by that name. A file given instead (data/regenerate.py takes both) is told where a recipe of one's own
    goes; the shipped recipe of the same name is offered only where no such file is there or the file holds its text,
    since following that advice for an edited copy of tiny.yaml trained the shipped recipe, on another target and data.
    flag "": the recipe is a script's first argument (recipes/launch_torchrun.sh, slurm.sbatch), said bare."""
    known = known_recipes()
    if name in known:
        return
    subject = flag or "the first argument"

    def given(recipe: str) -> str:
        return f"{flag} {recipe}" if flag else recipe

    if not name:  # `--recipe "$R"` with R unset: an unknown recipe '' that "goes at recipes/.yaml" said neither
        raise DDTreeError(f"{subject} is empty (an unset shell variable?); known recipes: {', '.join(known)}")
    if not flag and name.startswith("-"):  # `launch_torchrun.sh --recipe tiny 2` said NODES 'tiny' was no number
        raise DDTreeError(f"the first argument is a recipe's name, and {name} is an option: give the recipe first, "
                          f"then the options; known recipes: {', '.join(known)}")
    path = Path(name)
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")  # (Path.stem of llama3.1-8b is llama3)
    if path.name == name and stem == name:
        raise DDTreeError(f"unknown recipe {name!r}; known recipes: {', '.join(known)}; a recipe of your own goes at "
                          f"recipes/{name}.yaml")
    file = path if path.is_file() else path.with_name(f"{stem}.yaml")
    if stem in known and (not file.is_file() or file.read_bytes() == recipe_path(stem).read_bytes()):
        raise DDTreeError(f"{subject} takes a recipe's name: {given(stem)} (reads recipes/{stem}.yaml)")
    if stem in known:
        where = (f"recipes/{stem}.yaml is a shipped recipe, not this file: put yours at recipes/<name>.yaml under a "
                 f"name of its own and give {given('<name>')}")
    else:
        where = f"put yours at recipes/{stem}.yaml and give {given(stem)}"
    raise DDTreeError(f"{given(name)}: {subject} takes the name of a recipe in recipes/, not a file"
                      f"{', and ' if stem in known else ': '}{where} (docs/training.md, Your own target and data)")


def recipe_path(name: str) -> Path:
    return RECIPES_DIR / f"{name}.yaml"


# What each command line names that can be checked without torch. Its `main` checks these again, some after its
# other checks (evaluate's --device and --out, publish's --repo): a line holding two mistakes may name another first.

def check_recipe_args(args: argparse.Namespace) -> None:  # features, ablate
    check_recipe_name(args.recipe)


def check_train_args(args: argparse.Namespace) -> None:
    if args.recipe is not None:
        check_recipe_name(args.recipe)
    check_resume_alone(args)
    if args.resume is not None:  # an empty one too: find_resume refuses it
        find_resume(args.resume, Path(args.output_root) / (args.recipe or DEFAULT_RECIPE))


def check_resume_alone(args: argparse.Namespace) -> None:
    """--resume continues the run in its own folder: a --run-name beside it was ignored without a word, and a branch
    meant for a new folder continued the run itself (its later checkpoints moved aside, its drafter/ replaced)."""
    if args.resume is not None and args.run is not None:
        raise DDTreeError(f"--resume continues a run in its own folder, so --run-name {args.run} would be ignored: drop "
                          f"--run-name to continue the run; to train a new run {args.run} from one of its checkpoints, "
                          "export it (python -m training.export <checkpoint> <folder>) and start that run with "
                          f"--model.init_from=<folder> --run-name {args.run}")


def check_evaluate_args(args: argparse.Namespace) -> None:
    check_recipe_name(args.recipe)
    find_checkpoint(args.ckpt, Path(args.output_root) / args.recipe, args.run)


def parse_setting(setting: str) -> tuple[int, int, int]:
    """"16x5x16" -> (anchors, layers, block size), each at least 1 (a block holds its anchor and a drafted token)."""
    parts = setting.split("x")
    if len(parts) != 3 or not all(part.isascii() and part.isdigit() for part in parts) or min(map(int, parts)) < 1 \
            or int(parts[2]) < 2:
        raise DDTreeError(f"--settings {setting!r}: give ANCHORSxLAYERSxBLOCK, positive integers with a block of at "
                          "least 2, e.g. 16x5x16 (several: comma-separated)")
    anchors, layers, block = (int(part) for part in parts)
    return anchors, layers, block


def check_throughput_args(args: argparse.Namespace) -> None:
    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--length", args.length, 1),
                               ("--threads", args.threads, 0), ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise DDTreeError(f"{flag} {value}: give at least {least}")
    if args.recipe is not None:  # an empty one too (`--recipe "$R"`, R unset): it timed the default target
        check_recipe_name(args.recipe)
        given = [flag for flag, value in (("--target", args.target), ("--settings", args.settings)) if value is not None]
        if given:  # they were ignored without a word, and the figures printed were the recipe's target's and drafter's
            raise DDTreeError(f"--recipe {args.recipe} takes the target and drafter settings from the recipe, so "
                              f"{' and '.join(given)} would be ignored: drop {'them' if len(given) > 1 else 'it'}, or "
                              "drop --recipe to time --target with --settings")
    elif args.random_target:
        raise DDTreeError("--random-target needs --recipe (the target and its drafter settings come from it)")
    else:
        for setting in (THROUGHPUT_SETTINGS if args.settings is None else args.settings).split(","):
            parse_setting(setting)


def check_publish_args(args: argparse.Namespace) -> None:
    if args.run and args.out and not args.push_only:  # main says what a line without them lacks
        check_run_folder(Path(args.run))
        find_run_checkpoint(Path(args.run), args.ckpt)


def answer_early(module: str, build: Callable[[], argparse.ArgumentParser],
                 check: Callable[[argparse.Namespace], None], overrides: bool = False) -> None:
    """Where `module` runs as the script (`__name__ == "__main__"`): parse the command line now, so that --help prints
    and a bad flag value or what `check` refuses exits with its one line (status 2) before the heavy imports below the
    call. `overrides`: the command takes any other --section.field=value as a recipe override (parse_known_args)."""
    if module != "__main__":
        return
    parser = build()
    args = parser.parse_known_args()[0] if overrides else parser.parse_args()
    def checked(_) -> None:  # what `check` returns (the arguments, say) is no exit status
        check(args)

    status = run_cli(checked)
    if status:
        sys.exit(status)


def train_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description="Train a drafter from a recipe.",
                           epilog="Any other --section.field=value overrides that recipe field (--trainer.max_steps=100, "
                                  "--model.num_layers=2, --data.batch_size=4): docs/training.md.")
    parser.add_argument("--recipe", default=None,
                        help=f"one of recipes/*.yaml (default: {DEFAULT_RECIPE}; a resumed run keeps its own)")
    # home_expanded and path_argument below: no shell expands the ~ of `--resume=~/runs/x` ("no such checkpoint")
    parser.add_argument("--resume", type=home_expanded, default=None,
                        help="'last', a run folder (its newest readable checkpoint) or a checkpoint path: continue that "
                             "run exactly")
    # --run-name too: torchrun rejects any option spelled --run (an abbreviation of its --run-path)
    parser.add_argument("--run", "--run-name", dest="run", default=None,
                        help="a new run's folder name, the same on every node (default: a timestamp, or slurm-<job id>); "
                             "not with --resume, which continues its run's own folder")
    # path_argument: `--output-root=~/runs` (no shell expands that ~) split the run between ./~/runs (checkpoints,
    # config, drafter) and Lightning's ~/runs (eval, report, logs); an empty one trained into the working folder
    parser.add_argument("--output-root", type=path_argument, default="outputs",
                        help="runs go to <output-root>/<recipe>/<run>/")
    return parser


def features_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description="Build a recipe's offline feature store.",
                           epilog="Any other --section.field=value overrides that recipe field, as in training.train "
                                  "(--data.max_length=256, --data.store_max_minutes=7).")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE,
                        help="one of recipes/*.yaml; its model.* and data.* define the store")
    parser.add_argument("--out", type=path_argument, default=None, help="store folder (default: the recipe's data.feature_store; "
                        "when that is auto or unset, <ddtree cache>/features/<recipe>-<tokenization key>, with "
                        "-final appended where the recipe distils, model.distill_weight > 0, or -top<k> with "
                        "model.distill_top_k k)")
    parser.add_argument("--force", action="store_true",
                        help="build the store even where a complete one is there, of this build or another (the old "
                             "one is replaced once the new one is complete; an unfinished build of the same settings "
                             "is resumed, one in another dtype started over)")
    # Checked by parse_dtype, not argparse choices: a bad name is then one `error:` line like every other bad input.
    parser.add_argument("--dtype", default="auto", help=f"the target's and the store's dtype: {', '.join(DTYPE_NAMES)}, "
                        "or auto: the dtype the recipe trains the target in (its trainer.precision, measured if auto)")
    return parser


def evaluate_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description="Measure a saved checkpoint's DDTree acceptance exactly as training measured it.")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="one of recipes/*.yaml")
    parser.add_argument("--ckpt", type=home_expanded, default="best",
                        help="'best', 'last' (of --run, else of the recipe's newest run) or a .ckpt path")
    parser.add_argument("--run", default=None, type=path_type,
                        help="the run folder whose --ckpt to measure (make eval RUN=)")
    parser.add_argument("--output-root", type=path_argument, default="outputs",
                        help="where the recipe's runs are: <output-root>/<recipe>/")
    parser.add_argument("--limit", type=int, default=None, help="override eval.limit (the result then differs from training's)")
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--out", type=path_argument, default=None,
                        help="results JSON (default: <run>/eval/checkpoint-<name>[-limit<N>].json); never a "
                        "checkpoint, the config, recipe or eval.prompts, nor a run's file but its eval/checkpoint-*.json")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def ablate_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description="Train variants of a recipe on one budget and compare them.")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--variant", action="append", default=None,
                        help="name=overrides (repeatable; name= is the recipe as it is), or the name of a default "
                        "variant; default: the five training objectives, the two distillation losses and three mixes "
                        "(10 variants)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (the schedule's length)")
    parser.add_argument("--minutes", type=float, default=None, help="wall-time budget per variant (trainer.max_time)")
    parser.add_argument("--eval-limit", type=int, default=None, help="held-out prompts in the final evaluation")
    parser.add_argument("--eval-max-new-tokens", type=int, default=None)
    parser.add_argument("--output-root", type=path_argument, default="outputs")  # as training.train's
    return parser


def publish_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m training.publish", description="Export a trained drafter as a Hugging Face "
                           "Hub folder, ready for the serving engines, and push it.")
    parser.add_argument("run", nargs="?", type=path_argument, help="the run folder, outputs/<recipe>/<run>")
    parser.add_argument("--out", type=path_argument, help="the folder to write (an earlier export in it only with "
                        "--overwrite; refused if it holds anything else)")
    parser.add_argument("--ckpt", type=home_expanded, default="best", help="best (default), last, or a checkpoint path")
    parser.add_argument("--speculators", action="store_true", help="add vLLM's speculators fields to config.json")
    parser.add_argument("--base-model", help="the target's Hub id, if the run named it otherwise (a folder)")
    parser.add_argument("--license", default="apache-2.0", help="card license; match the target's (e.g. llama3.1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32", help="dtype of the exported weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    parser.add_argument("--allow-engine-mismatch", action="store_true",
                        help="export a drafter that vLLM or SGLang would reject (the card says which rule)")
    parser.add_argument("--repo", help="Hub repo id, user/name")
    parser.add_argument("--push", action="store_true", help="upload to --repo after exporting (token: HF_TOKEN)")
    parser.add_argument("--private", action="store_true",
                        help="create the Hub repo private (an existing public repo is refused, not changed)")
    parser.add_argument("--replace-repo", action="store_true",
                        help="push into an existing repo that holds files no export writes (they are deleted from it)")
    parser.add_argument("--push-only", type=path_argument, metavar="FOLDER",
                        help="upload a finished export without exporting again")
    return parser


def throughput_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description="Measure training throughput: a full training step vs the frozen target's "
                           "forward alone, same batch.")
    parser.add_argument("--target", default=None, help=f"default: {THROUGHPUT_TARGET} (without --recipe)")
    parser.add_argument("--recipe", default=None, help="take the settings, length and batch size from recipes/<name>.yaml")
    parser.add_argument("--random-target", action="store_true", help="build the target with random weights (RANDOM_TARGETS)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's, else 2")
    parser.add_argument("--length", type=int, default=None, help="default: the recipe's max_length, else 320")
    parser.add_argument("--settings", default=None,
                        help=f"comma-separated ANCHORSxLAYERSxBLOCK (without --recipe; default: {THROUGHPUT_SETTINGS})")
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="the drafter's training forward through torch.compile "
                        "(model.compile)")
    return parser
