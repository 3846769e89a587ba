"""A recipe's training data, written by its target on first use (data.regenerate) when it is not there yet.

    data:
      data_path: auto                   # <ddtree cache>/data/<recipe>: generated data stays out of the repository
      regenerate:                       # how: data/regenerate.py's options, by their names
        prompts: data/prompts/train_prompts.jsonl
        limit: 4000

`training.train` and `training.features` call `prepare_recipe_data` before anything reads the data:
it resolves data_path "auto" and, when the folder is missing and the recipe has a regenerate
section, runs `data/regenerate.py` in a child process (so the target it loads is freed when it ends,
before training loads its own), with model.target_adapter merged into the target as training merges it.
A folder that exists is checked against the recipe (its regeneration.json: the target and its adapter,
by path and sha256, the settings, the number of prompts) and refused when another target, the base
model without the adapter (or with another), or other settings made it: for the recipe's own data, with the
command that mends it; for a run that overrides the recipe's data settings, with a data folder of its own.
A recipe without a regenerate section reads its data_path as before.
`make data RECIPE=x` runs the same generation by hand (data/regenerate.py --recipe).
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from ddtree.errors import DDTreeError, Terminated
from ddtree.files import cache_dir, read_yaml_mapping

from .arguments import recipe_path

AUTO_DATA = "auto"  # data.data_path value: <ddtree cache>/data/<recipe>
REGENERATE_SCRIPT = Path(__file__).resolve().parents[1] / "data" / "regenerate.py"
REGENERATION_GRACE_S = 30  # how long a stopped training waits for the regeneration child to remove its staging folder
# data/regenerate.py's options a recipe may set (the target and the output folder come from the recipe itself).
REGENERATE_FIELDS = ("prompts", "limit", "max_new_tokens", "temperature", "top_p", "seed", "dtype", "device",
                     "batch_size", "chunk_size", "backend", "threads")


def default_data_path(recipe: str) -> Path:
    return cache_dir() / "data" / recipe


def check_regenerate_settings(settings: dict | None) -> None:
    """data.regenerate holds only regenerate.py's option names; anything else is a typo that would be ignored."""
    unknown = sorted(set(settings or {}) - set(REGENERATE_FIELDS))
    if unknown:
        raise DDTreeError(f"data.regenerate.{unknown[0]} is not an option of data/regenerate.py; "
                          f"use one of {', '.join(REGENERATE_FIELDS)}")


def read_record(path: Path, remedy: str) -> dict | None:
    """The JSON object in `path` (a regeneration.json or a settings.json), None where there is no such file. One that
    is not a JSON object (cut short by a copy, edited by hand) is a DDTreeError naming it and saying `remedy`."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise DDTreeError(f"{path}: not valid JSON ({error}); {remedy}") from None
    if not isinstance(record, dict):
        raise DDTreeError(f"{path}: holds a JSON {type(record).__name__}, not the object of settings "
                          f"data/regenerate.py writes; {remedy}")
    return record


def read_summary(out: Path) -> dict | None:
    """<out>/regeneration.json, what the dataset at `out` was made with and its counts; None where there is none."""
    remedy = f"restore it (git checkout, for the shipped data) or move {out} away and generate the data again"
    return read_record(Path(out) / "regeneration.json", remedy)


def regenerate_arguments(target: str, out: Path, settings: dict, target_adapter: str | None = None) -> list[str]:
    """{"max_new_tokens": 256, ...} -> regenerate.py's command line for this target (and the PEFT adapter merged
    into it) and output folder."""
    check_regenerate_settings(settings)
    arguments = ["--target", str(target), *(["--target-adapter", str(target_adapter)] if target_adapter else []),
                 "--out", str(out)]
    for field, value in settings.items():
        if value is not None:  # null: the option's default (limit: null = every prompt)
            arguments += [f"--{field.replace('_', '-')}", str(value)]
    return arguments


def prepare_recipe_data(datamodule, recipe: str, world_size: int = 1, target_adapter: str | None = None) -> None:
    """Resolve data_path "auto" on the datamodule; generate the data first if the recipe says how and it is missing.

    target_adapter: the run's model.target_adapter, merged into the target that writes the data (the datamodule
    knows the target alone): without it the replies were the base model's, and the drafter learned those.

    Only a single-process launch generates: the processes of a larger one would each start the same
    job, so they stop and ask for `make data` first.
    """
    if datamodule.data_path == AUTO_DATA:
        if not datamodule.regenerate:
            raise DDTreeError(f"recipe {recipe}: data.data_path is auto but data.regenerate is not set, so nothing "
                              "says how to make the data; give a data_path, or a regenerate section")
        datamodule.data_path = str(default_data_path(recipe))  # config.yaml keeps "auto": a resume resolves it again
    path = Path(datamodule.data_path)
    if not datamodule.regenerate:
        return
    if path.exists():
        check_recipe_data(datamodule, recipe, path, target_adapter)
        return
    command = [sys.executable, str(REGENERATE_SCRIPT),
               *regenerate_arguments(datamodule.target, path, datamodule.regenerate, target_adapter)]
    # `make data` writes the recipe file's data: for a run that overrides its data settings it generated other data (or
    # found the recipe's done) and this run's stayed missing, so that run is told its own command, written out
    by_hand = f"`{shlex.join(command)}`" if recipe_overrides(datamodule, recipe, target_adapter) else \
        f"`make data RECIPE={recipe}`"
    if world_size > 1:
        raise DDTreeError(f"data {path} does not exist yet and this launch runs {world_size} processes: "
                          f"generate it first with {by_hand}")
    print(f"[data] {path} is missing: the target writes it first ({' '.join(command[1:])})", flush=True)
    if run_regeneration(command) != 0:
        raise DDTreeError(f"generating the training data into {path} failed (its error is above); rerun: "
                          f"{by_hand} resumes from the chunks already written")


def run_regeneration(command: list[str]) -> int:
    """data/regenerate.py's exit status. A SIGTERM that stops training (Terminated) is passed on to it, and its own
    clean-up (the merge's staging folder removed, its stop line) is waited for, REGENERATION_GRACE_S at most: under
    subprocess.run the child was SIGKILLed at once and its staging folder, the whole merged dataset, stayed for good
    (found in a review, 2026-12-04). Anything else (Ctrl-C) ends it as subprocess.run does."""
    with subprocess.Popen(command) as child:
        try:
            return child.wait()
        except Terminated:
            child.send_signal(signal.SIGTERM)  # one sent to the group is its second, which it ignores (SigtermRaises)
            try:
                child.wait(timeout=REGENERATION_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
        except BaseException:
            child.kill()
            raise


def recipe_overrides(datamodule, recipe: str, target_adapter: str | None) -> list[str]:
    """The data settings this run took from its command line rather than from recipes/<recipe>.yaml (model.target,
    model.target_adapter, data.data_path, data.regenerate), each as `name=value (the recipe's: value)`; none for a
    recipe with no file there. Values compare as regenerate.py is given them (regenerate_arguments: as text)."""
    recipe_file = recipe_path(recipe)
    if not recipe_file.is_file():
        return []
    own = read_yaml_mapping(recipe_file)
    model, data = own.get("model") or {}, own.get("data") or {}
    own_path = default_data_path(recipe) if data.get("data_path") == AUTO_DATA else data.get("data_path")
    shown = lambda value: "null" if value is None else str(value)  # noqa: E731
    pairs = [("model.target", datamodule.target, model.get("target")),
             ("model.target_adapter", target_adapter, model.get("target_adapter"))]
    settings, own_settings = datamodule.regenerate or {}, data.get("regenerate") or {}
    pairs += [(f"data.regenerate.{field}", settings.get(field), own_settings.get(field))
              for field in REGENERATE_FIELDS if field in settings or field in own_settings]
    overrides = [f"{name}={shown(value)} (the recipe's: {shown(recipe_value)})" for name, value, recipe_value in pairs
                 if shown(value) != shown(recipe_value)]
    # (the datamodule's path has `~` expanded; the recipe file's may not)
    if own_path is None or Path(datamodule.data_path).resolve() != Path(own_path).expanduser().resolve():
        overrides.append(f"data.data_path={datamodule.data_path} (the recipe's: {shown(own_path)})")
    return overrides


def check_recipe_data(datamodule, recipe: str, path: Path, target_adapter: str | None = None) -> None:
    """The data at `path` is what the recipe's target (with its adapter) and data.regenerate settings would write
    (regenerate.py --check, which answers before torch loads: a fraction of a second); else a DDTreeError naming what
    differs and what mends it."""
    overrides = recipe_overrides(datamodule, recipe, target_adapter)
    # --for-recipe: the recipe's own data, made as its file says, is its data to mend (make data RECIPE=...), not
    # another recipe's. Not where this run overrides one of those settings: the recipe file and `make data` would
    # make the recipe's data again, never this run's.
    command = [sys.executable, str(REGENERATE_SCRIPT),
               *regenerate_arguments(datamodule.target, path, datamodule.regenerate, target_adapter),
               *([] if overrides else ["--for-recipe", recipe]), "--check"]
    checked = subprocess.run(command, capture_output=True, text=True)
    if checked.returncode != 0:
        said = (checked.stderr.strip().splitlines() or [f"exit status {checked.returncode}"])[-1]
        if not said.startswith("error: "):  # not its one line (a traceback's last): say what failed, on which data
            said = f"checking {path} with data/regenerate.py --check failed: {said}"
        elif overrides and said.startswith(f"error: {path} holds "):  # other data: advice for regenerate.py's flags
            said = (f"{path} does not hold the data of this run, which overrides {'; '.join(overrides)}: give the run "
                    "a data folder of its own, --data.data_path=<a new folder> (training writes the data there "
                    f"first), or drop {'the override' if len(overrides) == 1 else 'those overrides'}")
        elif overrides:  # (checked without --for-recipe) its advice named "this command without --check", which the
            # user never typed: training's own check is the command that says it, so its job is written out in full
            said = said.replace("this command without --check", f"`{shlex.join(command[:-1])}`")
        raise DDTreeError(f"recipe {recipe}: {said.removeprefix('error: ')}")
