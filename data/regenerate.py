"""Regenerate responses with the target itself: prompts JSONL -> a `datasets` folder of conversations.

    python data/regenerate.py --target smollm2-135m --prompts data/prompts/train_prompts.jsonl \
        --out data/smollm2-135m --limit 2048 --max-new-tokens 256 --batch-size 64 --dtype bfloat16

    # the same job split over 2 processes (each writes its own chunks; the last one to finish merges):
    python data/regenerate.py ... --shard-index 0 --num-shards 2 &
    python data/regenerate.py ... --shard-index 1 --num-shards 2 &
    python data/regenerate.py ... --merge-only        # (re)build the dataset from finished chunks

    python data/regenerate.py --target smollm2-135m --target-adapter path/to/adapter ...   # a fine-tuned target:
                                                      # base model + PEFT adapter, merged as training merges it
    python data/regenerate.py --recipe smollm2-135m   # target and --out from the recipe (its name, or a YAML file)
    python data/regenerate.py --recipe recipes/smollm2-135m-gpu.yaml   # and its data.regenerate options; data_path
                                                                       # auto: <ddtree cache>/data/<recipe>

A drafter learns to predict the target's own continuations, so the training responses are written
by the target (greedy by default: evaluation decodes at temperature 0). A target given as a base model and a
PEFT adapter (a recipe's model.target_adapter, --target-adapter) writes them with the adapter merged, as
training loads it (training.target.load_frozen_target); the settings record the adapter's path and the sha256
of its files, so that data of the base model, or of the adapter before it was retrained, is not taken for it.

How the work is laid out, so it survives interruption:
  - the first --limit prompts are cut into chunks of --chunk-size; chunk k belongs to shard k % n;
  - each finished chunk is written to <out>.parts/chunk-<k>.jsonl (temp file, fsync, rename), and a rerun
    skips chunks that exist, so an interrupted job resumes where it stopped (a chunk that does not read
    whole, cut short all the same, is made again, with a warning naming it);
  - <out>.parts/settings.json records the settings that choose the responses (target, prompts, decoding, dtype);
    a rerun with different settings is refused instead of mixing two kinds of data (until its first chunk is
    written: a job stopped by bad input takes the corrected settings), or with --overwrite starts over, its chunks
    removed (also where settings.json is damaged: its chunks are then of unknown settings). Not the machine nor --batch-size, though in bf16 either moves most long greedy replies at their first
    near tie (data/README.md): the data shipped without them, and a resume may change batch size;
  - a dataset already merged at <out> with other settings (another target, other prompts), or answering
    more prompts than this job (a smaller --limit), is replaced only with --overwrite, and then only once
    the new one is complete; where another recipe's data.regenerate makes that folder (data/smollm2-135m,
    which recipes/tiny.yaml reads as it is), the refusal says so instead of suggesting --overwrite (training's
    --check names its own recipe with --for-recipe, unless the run overrides the recipe's data settings: that
    recipe's data is its own to mend);
  - a dataset already merged at <out> with the same settings (its regeneration.json) gives back its
    chunks, so a larger --limit on a fresh clone only generates the prompts the shipped data lacks; one
    that already answers exactly this job's prompts is left as it is (a rerun does nothing);
  - once every chunk exists, the chunks are concatenated in prompt order into a `datasets` dataset
    (save_to_disk) at <out> with columns id, messages (prompt + assistant turn), finish_reason
    ("stop" | "length"), response_tokens, response_ids (the generated ids, which training supervises
    rather than a new tokenization of the text); <out>/regeneration.json records settings, counts and the sha256
    of the prompts answered (--check compares it with the prompts file's, so a prompt edited in place is told).

Backends: transformers (a batched decoding loop, left padding, KV cache) everywhere; vLLM when it is
importable and a GPU is present (or --backend vllm). Special tokens are dropped from the response
text so a stray template token cannot break the conversation structure when it is re-rendered.
Sampling (--temperature > 0) cuts with serving's top-p rule (ddtree.decoding.top_p_filter; vLLM has its own), and
each prompt draws from a generator of its own, seeded from --seed and the prompt's id, so that neither --batch-size,
--chunk-size nor the shards choose a sampled reply (the settings record it as sampling: per-prompt; sampled data made
before, whose chunk drew its replies together, is refused as other settings rather than mixed with new chunks).
Bad input (a malformed prompt file, a prompt the target's chat template refuses: every prompt is rendered before the
weights load, settings that differ from the finished chunks, a regeneration.json or settings.json that is not a JSON
object) prints one `error:` line naming the file and exits with status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

from ddtree.arguments import DEVICE_HELP
from ddtree.calibration import weights_fingerprint
from ddtree.errors import CommandParser, DDTreeError, command
from ddtree.files import (atomic_file, iter_json_lines, path_type, read_yaml_mapping, staged_folder,
                          unwritable_as_error, write_text_atomic)
from ddtree.inputs import prompt_messages  # the prompt readers' rule, one for all (free of torch: --check uses it)
from ddtree.names import DTYPE_NAMES
from training.arguments import RECIPES_DIR, answer_early, known_recipes
from training.peft_utils import adapter_fingerprint, check_adapter_folder
from training.recipe_data import AUTO_DATA, check_regenerate_settings, default_data_path, read_record, read_summary

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=path_type, default=None,
                   help="a training recipe (its name, or a YAML file): --target and --target-adapter default to its "
                   "model.target and model.target_adapter, --out to its data.data_path, the other options to its "
                   "data.regenerate section")
    p.add_argument("--for-recipe", type=path_type, default=None, metavar="RECIPE",
                   help="the recipe (its name, or a YAML file) this job writes for, without taking its settings "
                   "as --recipe does (training's --check gives them all as flags, and names it only where they are "
                   "the recipe file's own): its own data.data_path is not refused as another recipe's, and a refusal "
                   "names the command that mends it (make data RECIPE=...)")
    p.add_argument("--target", default=None, help="built-in target name, local HF folder or Hub id (default smollm2-135m)")
    p.add_argument("--target-adapter", default=None,
                   help="PEFT adapter folder merged into --target before it writes (a recipe's model.target_adapter); "
                   "the data records its path and sha256, and the transformers backend writes")
    p.add_argument("--prompts", type=path_type, default=Path("data/prompts/train_prompts.jsonl"))
    p.add_argument("--out", type=path_type, default=None, help="output `datasets` folder (chunks go to <out>.parts)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (evaluation decodes at T=0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed: each prompt draws from its own generator, seeded from it and the prompt's id")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bfloat16")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64, help="prompts per resumable unit of work")
    p.add_argument("--shard-index", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--backend", choices=["auto", "transformers", "vllm"], default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    p.add_argument("--merge-only", action="store_true", help="only build <out> from finished chunks")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset at --out made with other settings (target, prompts, ...), and the "
                   "chunks in <out>.parts made with them")
    p.add_argument("--check", action="store_true",
                   help="only check that --out holds this job's finished dataset (its regeneration.json: these "
                   "settings, these prompts): exit 0 if so, else one line naming what differs; loads no model "
                   "(training asks it at each start of a recipe with a data.regenerate section)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.recipe is not None:  # the recipe's settings become the defaults, and the flags given are parsed again over them
        p.set_defaults(**recipe_defaults(args.recipe))
        args = p.parse_args(argv)
    return args


def recipe_defaults(recipe: Path) -> dict[str, str]:
    """A recipe's model.target (and model.target_adapter), data.data_path (auto: <ddtree cache>/data/<recipe>) and
    data.regenerate options.

    recipe: its file, or its name as training takes it (smollm2-135m for recipes/smollm2-135m.yaml).
    """
    recipe_file = recipe_file_of(recipe)
    if recipe_file is None:
        known = ", ".join(known_recipes())
        raise DDTreeError(f"recipe {recipe} does not exist; give a file, or one of the recipes' names: {known}")
    recipe = read_yaml_mapping(recipe_file)
    for section in ("model", "data"):
        if not isinstance(recipe.get(section) or {}, dict):
            raise DDTreeError(f"{recipe_file}: {section} must be a section of fields (field: value lines under it), not "
                              f"a {type(recipe[section]).__name__}")
    data = recipe.get("data") or {}
    settings = data.get("regenerate") or {}
    if not isinstance(settings, dict):
        raise DDTreeError(f"{recipe_file}: data.regenerate must map data/regenerate.py's options to values, not be a "
                          f"{type(settings).__name__}")
    check_regenerate_settings(settings)
    # Strings: argparse converts them by type. null leaves an option at its default (limit: null = every prompt).
    defaults = {field: str(value) for field, value in settings.items() if value is not None}
    # set_defaults skips argparse's type and choice checks: each value is parsed alone first, so a bad one is a line
    # naming the recipe's field rather than a traceback mid-run (or, for a choice, silently taken).
    checker = build_parser()
    checker.exit_on_error = False
    for field, value in defaults.items():
        try:
            checker.parse_args([f"--{field.replace('_', '-')}", value])
        except argparse.ArgumentError as error:
            raise DDTreeError(f"{recipe_file}: data.regenerate.{field}={value}: {error.message}") from None
    for field in ("target", "target_adapter"):
        if (recipe.get("model") or {}).get(field) is not None:
            defaults[field] = str(recipe["model"][field])
    if data.get("data_path") == AUTO_DATA:
        defaults["out"] = str(default_data_path(recipe_file.stem))
    elif data.get("data_path") is not None:
        defaults["out"] = str(data["data_path"])
    return defaults


def recipe_file_of(recipe: Path) -> Path | None:
    """--recipe's file: the file given, or recipes/<name>.yaml for a name; None where neither exists."""
    named = RECIPES_DIR / f"{recipe}.yaml"
    return recipe if recipe.is_file() else named if recipe.suffix == "" and named.is_file() else None


def owning_recipe(out: Path, recipe: Path | None) -> str | None:
    """The name of the recipe, other than this job's, whose data.data_path is `out` and whose data.regenerate says how
    that data is made (smollm2-135m, for the shipped data/smollm2-135m); None where there is none. Its folder is no
    place for this job's replies: `make data RECIPE=tiny` (which reads data/smollm2-135m as it is) was told to pass
    --overwrite, which would have put a random target's replies in the place of the shipped ones."""
    mine = recipe_file_of(recipe) if recipe is not None else None
    for file in sorted(RECIPES_DIR.glob("*.yaml")):
        if mine is not None and file.resolve() == mine.resolve():
            continue
        try:
            data = read_yaml_mapping(file).get("data")
        except DDTreeError:
            continue  # a broken recipe owns nothing here; training names its fault when it is used
        if not isinstance(data, dict) or not data.get("regenerate") or data.get("data_path") is None:
            continue
        path = default_data_path(file.stem) if data["data_path"] == AUTO_DATA else PROJECT_ROOT / str(data["data_path"])
        if path.resolve() == Path(out).resolve():
            return file.stem
    return None


def job_recipe(args: argparse.Namespace) -> Path | None:
    """The recipe this job writes for: --recipe (whose settings it took), else --for-recipe (training's check, which
    gives every setting itself); None for a job of flags alone."""
    return args.recipe if args.recipe is not None else args.for_recipe


def rerun_command(recipe: Path | None, flags: str = "") -> str:
    """The command that runs this --check's job with `flags`: `make data` for a recipe of recipes/ (or a name, as
    training gives it), regenerate.py --recipe for a file elsewhere; for a job of flags alone, these flags without
    --check (the caller names `flags`)."""
    recipe_file = recipe_file_of(recipe) if recipe is not None else None
    if recipe_file is not None and recipe_file.resolve().parent != RECIPES_DIR.resolve():
        return f"`python data/regenerate.py --recipe {recipe_file}{f' {flags}' if flags else ''}`"
    if recipe is not None:
        name = recipe_file.stem if recipe_file is not None else str(recipe)
        return f"`make data RECIPE={name}{f' ARGS={flags}' if flags else ''}`"
    return "this command without --check"


def limit_setting(recipe: Path | None) -> str:
    """Where this job's --limit comes from, as the user would edit it."""
    if recipe is None:
        return "--limit"
    recipe_file = recipe_file_of(recipe)
    if recipe_file is None:
        return "the recipe's data.regenerate.limit"
    recipe_file = recipe_file.resolve()
    shown = recipe_file.relative_to(PROJECT_ROOT) if recipe_file.is_relative_to(PROJECT_ROOT) else recipe_file
    return f"the recipe's data.regenerate.limit ({shown})"


def check_not_others_data(out: Path, recipe: Path | None, differs: str, tail: str = "") -> None:
    """Where `out` is another recipe's data (owning_recipe), the error says so, in the place of advice to pass
    --overwrite. differs: how the data there differs from this job's."""
    owner = owning_recipe(out, recipe)
    if owner is not None:
        raise DDTreeError(f"{out} holds recipe {owner}'s data (its data.data_path, made as its data.regenerate says), "
                          f"{differs}: --overwrite would replace it with this job's replies; give this job its own "
                          f"output folder (--out, or its recipe's own data.data_path){tail}")


def apply_recipe(args: argparse.Namespace) -> argparse.Namespace:
    """The target's default, and a clear error when nothing names the output folder."""
    if args.target is None:
        args.target = "smollm2-135m"
    if args.out is None:
        raise DDTreeError("no output folder: give --out, or --recipe with a data.data_path")
    return args

def checked_args(args: argparse.Namespace) -> argparse.Namespace:
    """The recipe's target default applied, and every check that needs no torch (so `python -m data.regenerate`
    answers them before torch loads)."""
    args = apply_recipe(args)
    if args.num_shards < 1:
        raise DDTreeError(f"--num-shards {args.num_shards} must be at least 1")
    if not 0 <= args.shard_index < args.num_shards:
        raise DDTreeError(f"--shard-index {args.shard_index} must be in 0..{args.num_shards - 1}")
    if args.chunk_size < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise DDTreeError("--chunk-size, --batch-size and --max-new-tokens must be positive")
    if args.limit is not None and args.limit < 1:
        raise DDTreeError(f"--limit {args.limit} must be at least 1 (leave it out for every prompt)")
    if args.threads < 1:
        raise DDTreeError(f"--threads {args.threads} must be at least 1")
    if args.target_adapter:
        check_adapter_folder(args.target_adapter, "--target-adapter")
    return args


# How a sampled reply draws its tokens, recorded with the settings of sampled data (greedy data has no draws to
# record, and the shipped data stays as it was): from a generator of its own, seeded from its prompt (prompt_seed).
# Sampled data made before this was recorded drew a chunk's replies together from one generator, seeded per chunk,
# so that its replies moved with --batch-size and --chunk-size: it reads as "per-chunk" (recorded_settings).
SAMPLING = "per-prompt"


def response_settings(args: argparse.Namespace) -> dict:
    """The settings that choose a chunk's replies; --limit does not (it only says how many chunks). The adapter by
    its path and its files' sha256, a local target folder by its path and its weight files' fingerprint
    (target_weights): retrained at the same path, either writes other replies. Left out: the machine and
    --batch-size, which in bf16 move a greedy reply at a near tie (data/README.md); recorded, --batch-size would
    refuse the shipped data (whose regeneration.json lacks it) and stop it being extended. Sampled, the settings
    say how the tokens are drawn (SAMPLING)."""
    sampled = {"sampling": SAMPLING} if args.temperature > 0 else {}
    return {
        "target": args.target,
        "target_weights": target_weights(args.target),
        "target_adapter": args.target_adapter,
        "target_adapter_sha256": adapter_fingerprint(args.target_adapter),
        # as the project spells it (same_file_spelling), which is how a recorded path is read back: a relative path
        # given in another folder was recorded as given and read as the project's, so the same file by its absolute
        # path was refused as other prompts
        "prompts": same_file_spelling(args.prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p if args.temperature > 0 else 1.0,
        "seed": args.seed,
        "dtype": args.dtype,
        "chunk_size": args.chunk_size,
        **sampled,
    }


def target_weights(target: str) -> str | None:
    """A local target folder's weights_fingerprint, the one a feature store records as target_weights
    (training.feature_store.target_fingerprint, which imports torch: --check answers without it): a target fine-tuned
    and saved over at the same path passed --check with the old model's replies. None for a built-in target, whose
    folder the project converts, and a Hub id, whose files are not here."""
    folder = Path(target).expanduser()
    return weights_fingerprint(folder) if folder.is_dir() else None


def recorded_settings(old: dict) -> dict:
    """Settings as a record holds them, read as this script's: sampled data that records no `sampling` was made
    before it was recorded, by a chunk's replies drawn together (SAMPLING)."""
    sampled = old.get("temperature") not in (None, 0)
    return {**old, "sampling": "per-chunk"} if sampled and "sampling" not in old else old


def changed_settings(old: dict, settings: dict) -> list[str]:
    """What differs between recorded settings and this job's, one "name: old -> new" each. One prompts file is one
    setting however its path is spelled (same_file_spelling), one adapter wherever its files were copied (the same
    sha256); the sha256 is named only where the path is the same (the adapter retrained in place), and so are a target
    folder's weights, as a line of their own. Settings recorded without target_weights (before it was) pass it."""
    old = recorded_settings(old)
    copied_adapter = settings.get("target_adapter_sha256") is not None and \
        old.get("target_adapter_sha256") == settings["target_adapter_sha256"]
    moved_adapter = old.get("target_adapter") != settings.get("target_adapter")
    moved_target = old.get("target") != settings.get("target")
    changed = []
    for k, v in settings.items():
        if old.get(k) == v or (k == "prompts" and same_prompts_file(old.get(k), v)):
            continue
        if (k == "target_adapter" and copied_adapter) or (k == "target_adapter_sha256" and moved_adapter):
            continue
        if k == "target_weights":
            if old.get(k) is not None and not moved_target:
                changed.append(f"target {settings['target']}: its weight files changed since the data was generated")
            continue
        changed.append(f"{k}: {old.get(k)!r} -> {v!r}")
    return changed


def same_prompts_file(recorded, given: str) -> bool:
    """A recorded relative path is the project's; one recorded as given in another folder (before response_settings
    recorded the project's spelling) is that folder's too, so such a job still resumes from there."""
    readings = (same_file_spelling(recorded, recorded=True), same_file_spelling(recorded)) \
        if isinstance(recorded, str) else ()
    return same_file_spelling(given) in readings


def same_file_spelling(path, recorded: bool = False) -> str:
    """A prompts path as the project names it (from its root, ./ and .. folded), so that one file is one setting
    however it was spelled: an absolute --prompts to data/prompts/train_prompts.jsonl was refused as other prompts.
    A recorded relative path is the project's (jobs run from its root, as make does); a given one is from here."""
    absolute = (PROJECT_ROOT / path if recorded else Path(path)).resolve()
    return absolute.relative_to(PROJECT_ROOT).as_posix() if absolute.is_relative_to(PROJECT_ROOT) else str(absolute)


def changed_replies(old: dict, settings: dict) -> list[str]:
    """changed_settings for a finished dataset: what its replies depend on. How the prompts were chunked is not (a
    sampled prompt draws from its own generator), nor a greedy job's seed: `make data ARGS=--chunk-size 256` made the
    same replies, then every training start refused them."""
    greedy = settings["temperature"] == 0 and old.get("temperature") == 0
    ignored = {"chunk_size", *(["seed"] if greedy else [])}
    return changed_settings(old, {k: v for k, v in settings.items() if k not in ignored})


def check_dataset(args: argparse.Namespace) -> None:
    """--check: --out holds the dataset this job would write, or a DDTreeError names what differs.

    Training reads a recipe's generated data as it finds it; without this, a recipe whose target or
    data.regenerate settings changed since would train on the old target's replies."""
    summary = Path(args.out) / "regeneration.json"
    if not Path(args.out).exists():
        raise DDTreeError(f"{args.out} does not exist yet: generate it (this command without --check)")
    if not summary.is_file():
        raise DDTreeError(f"{args.out} holds no dataset this script finished (no regeneration.json): move it away so "
                          "that it is generated again, or give another output folder")
    made_with = read_summary(args.out)
    changed = changed_replies(made_with, response_settings(args))
    if not args.prompts.is_file():
        raise DDTreeError(f"--prompts {args.prompts} does not exist; give the prompts file the data was made from")
    # A prompt a line, read as the generator reads them (read_messages_jsonl needs torch's imports; iter_json_lines,
    # under it, does not): a file that is not UTF-8, opened as text, stopped --check (each training start) with a
    # UnicodeDecodeError traceback, where the reader's one line names its line and byte
    available = sum(1 for _ in iter_json_lines(args.prompts))
    count = available if args.limit is None else min(available, args.limit)
    answered = made_with.get("num_prompts")
    if answered != count:
        changed.append(f"prompts answered: {answered!r} -> {count}")
    recipe = job_recipe(args)
    if not changed:
        # The same count can be other prompts (a line edited in place), which the generator answers again and training
        # would take with the old replies. Data recorded without the digest is checked by its count alone, as before.
        recorded = made_with.get("prompts_sha256")
        if recorded is not None and recorded != prompts_sha256(read_prompts_torch_free(args.prompts, count)):
            raise DDTreeError(f"{args.prompts}: prompts that {args.out} answers changed since it was generated (the "
                              f"same {count}, other text or ids): {rerun_command(recipe)} regenerates the chunks "
                              "that hold them")
        return
    check_not_others_data(args.out, recipe, f"made with other settings ({'; '.join(changed)})")
    differs = f"{args.out} holds a dataset made with other settings ({'; '.join(changed)})"
    only_count = len(changed) == 1 and isinstance(answered, int) and answered > 0
    if only_count and count < answered <= available:  # extended with a larger --limit (data/README.md says how)
        raise DDTreeError(f"{differs}: raise {limit_setting(recipe)} to {answered} to use all {answered}, or cut the "
                          f"data to {count} with --overwrite ({rerun_command(recipe, '--overwrite')})")
    if only_count and answered < count:  # the same replies, fewer of them: the rest can be added to them
        raise DDTreeError(f"{differs}: answer the other {count - answered} with {rerun_command(recipe)} (it keeps the "
                          f"{answered} answered), or lower {limit_setting(recipe)} to {answered}")
    raise DDTreeError(f"{differs}: generate it again with --overwrite ({rerun_command(recipe, '--overwrite')}), or "
                      "give another output folder")


def prompts_sha256(records: list[dict]) -> str:
    """The sha256 of the prompts a dataset answers, in order: each one's id and messages (prompt_messages's). What
    regeneration.json records (conversation_counts) and --check compares, so that a prompt edited in place is told."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps([record["id"], record["messages"]], sort_keys=True).encode() + b"\n")
    return digest.hexdigest()


def read_prompts_torch_free(path: Path, count: int) -> list[dict]:
    """The first `count` prompts of `path` as the generator answers them (training.conversations.read_messages_jsonl,
    whose imports load torch, then prompt_messages): the id given, else <file stem>-<line>, and each message's role
    and content. For --check, which answers before torch loads; a record the generator would refuse reads as given,
    and its digest then matches no recorded one."""
    records = []
    for line_number, _, record in iter_json_lines(path):
        if len(records) == count:
            break
        try:
            given = record.get("id")
            messages = prompt_messages([{"role": m["role"], "content": m["content"]} for m in record["messages"]])
        except (AttributeError, KeyError, TypeError):
            given, messages = None, record
        records.append({"id": str(given) if given is not None else f"{path.stem}-{line_number}", "messages": messages})
    return records


def answer_early_check(args: argparse.Namespace) -> None:
    """The torch-free checks; --check is answered whole here (exit 0 when the dataset is this job's)."""
    args = checked_args(args)
    if args.check:
        check_dataset(args)
        sys.exit(0)


# As a script: --help, a bad flag, recipe or value answered before torch and transformers load (11 s, 2-core EPYC).
answer_early(__name__, build_parser, lambda _: answer_early_check(parse_args()))  # (parse_args: with the recipe's defaults)


import torch
from tqdm import tqdm
from transformers import DynamicCache

from ddtree.bench import chat_prompt_ids, check_chat_template
from ddtree.cli import parse_device
from ddtree.decoding import SAMPLING_FLAGS, Sampling, top_p_filter
from ddtree.targets import DTYPES, config_stop_token_ids, load_tokenizer, resolve_target, stop_token_ids
from training.conversations import CHAT_TARGET, read_messages_jsonl
from training.target import load_frozen_target


def cut_at_stop(token_ids: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Response tokens before the first stop token, and why generation ended."""
    for i, token in enumerate(token_ids):
        if token in stop_ids:
            return token_ids[:i], "stop"
    return token_ids, "length"


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The seed of one prompt's sampling generator: --seed and the prompt's id (unique in its file), so that its reply
    is the same whatever batch, chunk or shard the prompt falls in, and whatever --limit. 63 bits: a signed 64-bit
    seed (vLLM's) takes it too."""
    digest = hashlib.sha256(f"{seed}\0{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def pick_next(logits: torch.Tensor, temperature: float, top_p: float,
              generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """Greedy at temperature 0, else a sample from the temperature-scaled, top-p-truncated softmax.

    The top-p cut is serving's (ddtree.decoding.top_p_filter), so sampled training answers come
    from the distribution the drafter will be served under. generators: one a row of logits (B, V), its prompt's
    (prompt_seed); needed to sample. Each row draws from its own, so that its token does not depend on the rows beside
    it: one draw for the whole batch gave every reply of a chunk another token with another --batch-size.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    if generators is None or len(generators) != len(logits):
        raise ValueError(f"sampling needs a generator a row: {len(logits)} rows, "
                         f"{0 if generators is None else len(generators)} generators")
    probs = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p)  # (B, V)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])  # (B,)


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], pad_id: int, stop_ids: list[int], max_new_tokens: int,
                   temperature: float, top_p: float,
                   generators: list[torch.Generator] | None = None) -> list[list[int]]:
    """New tokens of each prompt (ending with its stop token, or max_new_tokens long); sampled, each prompt draws
    from its own of `generators` (pick_next).

    A plain decoding loop over the model's forward with a KV cache, rather than `generate`, so
    that rows that have stopped leave the batch: with `generate` every row pays for the longest
    answer of its batch, which on CPU made a third of the work padding.
    """
    width = max(len(p) for p in prompts)
    # Left padding: every prompt ends at the same column, so new tokens append in lockstep.
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # real tokens count from 0 despite padding
    next_position = attention_mask.sum(-1)  # (B,)
    stops = torch.tensor(stop_ids, device=model.device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows = torch.arange(len(prompts), device=model.device)  # original index of each live row
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        live_generators = None if generators is None else [generators[row] for row in rows.tolist()]
        tokens = pick_next(out.logits[:, -1], temperature, top_p, live_generators)  # (b,)
        for row, token in zip(rows.tolist(), tokens.tolist()):
            outputs[row].append(token)
        if step == max_new_tokens - 1:
            break
        alive = ~torch.isin(tokens, stops)
        if not alive.all():
            if not alive.any():
                break
            keep = alive.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, tokens, attention_mask, next_position = rows[keep], tokens[keep], attention_mask[keep], next_position[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=-1)  # (b, T+1)
        out = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_position[:, None],
                    past_key_values=cache, use_cache=True)
        next_position = next_position + 1
    return outputs


def generate_transformers(model, prompts: list[list[int]], pad_id: int, stop_ids: list[int], batch_size: int,
                          max_new_tokens: int, temperature: float, top_p: float,
                          generators: list[torch.Generator] | None = None, progress=None) -> list[list[int]]:
    """Batched generation over all prompts; results in the input order. generators: one a prompt, to sample with."""
    # Sort by length so a batch wastes little on padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    outputs: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        indices = order[start:start + batch_size]
        batch_generators = None if generators is None else [generators[i] for i in indices]
        batch_out = generate_batch(model, [prompts[i] for i in indices], pad_id, stop_ids, max_new_tokens, temperature,
                                   top_p, batch_generators)
        for index, tokens in zip(indices, batch_out):
            outputs[index] = tokens
        if progress is not None:
            progress.update(len(indices))
    return outputs


class VLLMGenerator:
    """vLLM backend (for GPU machines; this code path is reviewed, not run on the CPU-only dev box)."""

    def __init__(self, target: str, dtype: str, seed: int):
        from vllm import LLM  # imported here: vLLM is optional

        self.llm = LLM(model=resolve_target(target), dtype=dtype, seed=seed)

    def generate(self, prompts: list[list[int]], stop_ids: list[int], max_new_tokens: int, temperature: float,
                 top_p: float, seeds: list[int], progress=None) -> list[list[int]]:
        """seeds: one a prompt (prompt_seed), as the transformers backend seeds each prompt's generator."""
        from vllm import SamplingParams

        params = [SamplingParams(
            temperature=temperature, top_p=top_p if temperature > 0 else 1.0, max_tokens=max_new_tokens,
            stop_token_ids=stop_ids, seed=seed,
        ) for seed in seeds]
        results = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if progress is not None:
            progress.update(len(prompts))
        # vLLM keeps the prompts' order; token_ids may end with the stop token, cut_at_stop handles both.
        return [list(r.outputs[0].token_ids) for r in results]


# What to do with a prompt whose messages the target's chat template refuses (chat_prompt_ids's "fix them, or ..."):
# the target is a chat model, its template takes other roles (CHAT_TARGET's advice is for a tokenizer with no template).
TEMPLATE_REFUSED = ("leave those prompts out (a template without a system role refuses a system turn: put its text "
                    "into the first user turn)")


def check_prompts_render(target: str, records: list[dict]) -> None:
    """Every prompt of the job rendered with the target's tokenizer alone, before its weights load: a prompt its chat
    template refuses stopped the job only when its chunk came up, after the target had loaded and the chunks before
    it were generated (hours, on a CPU). One line: the first refusal (file:line), and how many of the prompts."""
    tokenizer = load_tokenizer(target)  # a folder without a tokenizer transformers reads: one line, as load_target's
    check_chat_template(tokenizer, records[0]["where"], CHAT_TARGET)
    refusals = []
    for record in records:
        try:
            chat_prompt_ids(tokenizer, record["messages"], record["where"], TEMPLATE_REFUSED)
        except DDTreeError as refusal:
            refusals.append(refusal)
    if refusals:
        raise DDTreeError(f"{refusals[0]}; the template refuses {len(refusals)} of the job's {len(records)} prompts, "
                          "the first named here; nothing was generated")


def tokenizer_and_stops(target: str):
    """The target's tokenizer and end-of-turn ids without loading its weights (for the vLLM path)."""
    from transformers import AutoTokenizer

    source = resolve_target(target)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return tokenizer, config_stop_token_ids(source, tokenizer)


def vllm_usable() -> bool:
    try:
        importlib.import_module("vllm")  # optional: only whether it imports matters here
    except ImportError:
        return False
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- files

def chunk_path(parts: Path, index: int) -> Path:
    return parts / f"chunk-{index:05d}.jsonl"


def check_replaces_only_its_own(out: Path, settings: dict, num_prompts: int, overwrite: bool,
                                recipe: Path | None = None) -> None:
    """A finished dataset at `out` made with other settings (another target, other prompts, ...), or answering more
    prompts than this job's `num_prompts`, is replaced only when asked: the merge would put this job's replies in its
    place. A smaller --limit over the 2048 shipped answers left 64, and without a .parts folder the rest were lost.
    Where it is another recipe's data than this job's `recipe`, the error says so rather than offer --overwrite."""
    made_with = read_summary(out) or {}
    changed = changed_replies(made_with, settings) if made_with else []
    if changed and not overwrite:
        check_not_others_data(out, recipe, f"made with other settings ({'; '.join(changed)})", "; nothing was written")
        raise DDTreeError(f"--out {out} holds a dataset made with other settings ({'; '.join(changed)}): give another "
                          "--out, or pass --overwrite to replace it once the new one is complete; nothing was written")
    answered = made_with.get("num_prompts")
    if isinstance(answered, int) and answered > num_prompts and not overwrite:
        check_not_others_data(out, recipe, f"answering {answered} prompts where this job writes {num_prompts} "
                              "(--limit)", "; nothing was written")
        raise DDTreeError(f"--out {out} holds a dataset answering {answered} prompts and this job writes {num_prompts} "
                          f"(--limit): the other {answered - num_prompts} answers would be lost; give another --out, or "
                          f"pass --overwrite to replace it with the {num_prompts}; nothing was written")


def check_settings(parts: Path, settings: dict, overwrite: bool = False) -> None:
    """Record the settings on first use; refuse to continue a job made with different ones, or with `overwrite`
    remove its chunks (the user asked to replace what the other settings made) and start over.

    Until a chunk is written there is nothing to mix with: a job that stopped on bad input before its first chunk
    takes the corrected settings."""
    path = parts / "settings.json"
    chunks = sorted(parts.glob("chunk-*.jsonl"))
    if path.exists() and chunks:
        try:
            changed = changed_settings(read_record(path, "pass --overwrite to make its chunks again (not with "
                                                          f"--merge-only), delete {parts}, or choose another --out"),
                                       settings)
        except DDTreeError:
            if not overwrite:
                raise
            # Settings that cannot be read cannot vouch for the chunks: the user asked to replace them, so they go.
            changed = [f"{path.name} could not be read"]
        if not changed:
            return
        if not overwrite:
            raise DDTreeError(f"{parts} holds chunks made with other settings ({'; '.join(changed)}); pass "
                              "--overwrite to make them again (not with --merge-only), or choose another --out")
        for chunk in chunks:  # only the chunks: the folder may hold what the user put there
            chunk.unlink(missing_ok=True)  # (a shard started alongside may have removed it first)
        print(f"[regenerate] --overwrite: removed {len(chunks)} chunk{'s' if len(chunks) > 1 else ''} of {parts} "
              f"made with other settings ({'; '.join(changed)})", flush=True)
    write_text_atomic(path, json.dumps(settings, indent=2) + "\n")


def check_settings_unchanged(parts: Path, settings: dict) -> None:
    """Before a chunk is written or the chunks merged: settings.json still holds this job's settings. Another job
    started in the same work folder before any chunk existed (shards launched together) may have replaced them,
    and its chunks and this job's would then mix two kinds of data."""
    try:
        recorded = json.loads((parts / "settings.json").read_text())
    except (OSError, ValueError):
        recorded = None
    changed = changed_settings(recorded, settings) if isinstance(recorded, dict) else ["settings.json is gone"]
    if changed:
        raise DDTreeError(f"{parts}: another job started there with other settings while this one ran "
                          f"({'; '.join(changed)}); this job wrote no chunk since: run every shard with the same "
                          f"settings, or delete {parts} and start again")


def read_chunk(parts: Path, index: int, records: list[dict]) -> list[dict] | None:
    """The finished rows of chunk `index` for these prompt records, or None if it must be (re)made.

    A chunk counts as finished only if its rows answer exactly these prompts (same ids, same
    messages), so an edited prompt file redoes just the chunks whose prompts changed. A chunk
    can hold more rows than asked for: it was finished under a larger --limit, and its prefix
    is exactly what this limit needs.
    """
    path = chunk_path(parts, index)
    if not path.exists():
        return None
    try:
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except ValueError:  # cut short (a crash before the disk held it all) or edited: its prompts are answered again
        return damaged_chunk(path, "a line of it is not valid JSON (cut short?)")
    if not all(isinstance(row, dict) and "id" in row and isinstance(row.get("messages"), list) for row in rows):
        return damaged_chunk(path, "a row of it has no id or no messages list")
    rows = rows[: len(records)]
    if len(rows) < len(records):
        return None
    for row, record in zip(rows, records):
        if row["id"] != record["id"] or row["messages"][:-1] != record["messages"]:
            return None
    return rows


DAMAGED_CHUNKS: set[Path] = set()  # those damaged_chunk has warned of


def damaged_chunk(path: Path, problem: str) -> None:
    """A chunk that cannot be read counts as unfinished (its prompts are answered again), said once per file: it
    stopped every resume and merge with a traceback until it was found and deleted by hand."""
    if path not in DAMAGED_CHUNKS:
        DAMAGED_CHUNKS.add(path)
        print(f"warning: {path}: {problem}; its prompts count as unanswered and are generated again",
              file=sys.stderr, flush=True)
    return None


def write_chunk(parts: Path, index: int, rows: list[dict]) -> None:
    """Chunk `index` written whole or not at all: atomic_file puts it on the disk (fsync) before the rename, so that
    a machine that stops (a crash, a preemption) leaves the chunk whole or absent, never cut short."""
    with atomic_file(chunk_path(parts, index)) as handle:
        handle.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def reuse_merged(out: Path, parts: Path, chunks_of_records: list[list[dict]], settings: dict) -> int:
    """Write back into `parts` the chunks that the merged dataset at `out` already answers; return how many.

    `parts` is a work folder and is not shipped, so without this a larger --limit on a fresh clone would
    generate the shipped answers again. Only a dataset whose replies these settings would write (changed_replies:
    another --chunk-size, or a greedy job's --seed, asked for every answer again) is reused, and only chunks whose
    rows answer exactly their prompts, in order, sliced as this job chunks them.
    """
    made_with = read_summary(out)
    if made_with is None or changed_replies(made_with, settings):
        return 0
    from datasets import load_from_disk  # heavy import, only needed here

    rows = load_from_disk(str(out)).to_list()
    reused, start = 0, 0
    for k, records in enumerate(chunks_of_records):
        chunk_rows, start = rows[start:start + len(records)], start + len(records)
        answered = len(chunk_rows) == len(records) and all(
            row["id"] == record["id"] and row["messages"][:-1] == record["messages"]
            for row, record in zip(chunk_rows, records))
        if not answered:
            break  # the dataset is a prefix of the prompts: nothing after the first mismatch is reused
        if read_chunk(parts, k, records) is None:
            write_chunk(parts, k, chunk_rows)
            reused += 1
    return reused


def conversation_counts(rows: list[dict]) -> dict:
    """The counts regeneration.json records of a dataset's rows (--check reads num_prompts as the prompts answered),
    and the digest of the prompts they answer (--check compares it to the prompts file's)."""
    return {
        "num_prompts": len(rows),
        "num_conversations": len(rows),
        "num_stopped": sum(r["finish_reason"] == "stop" for r in rows),
        "num_hit_max_new_tokens": sum(r["finish_reason"] == "length" for r in rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "response_tokens": sum(r["response_tokens"] for r in rows),
        "prompts_sha256": prompts_sha256([{"id": r["id"], "messages": r["messages"][:-1]} for r in rows]),
    }


def finished_here(out: Path, records: list[dict], settings: dict) -> dict | None:
    """The summary of the dataset at `out` when it already answers exactly these prompts, in order, with these
    settings; else None. Merging it again from its own chunks would rewrite it (the shipped data/smollm2-135m lost
    its int32 response_ids and recover_ids.py's record in regeneration.json) and change nothing it answers."""
    made_with = read_summary(out)
    if made_with is None:
        return None
    if changed_replies(made_with, settings) or made_with.get("num_prompts") != len(records):
        return None
    from datasets import load_from_disk  # heavy import, only needed here

    rows = load_from_disk(str(out)).to_list()
    answered = len(rows) == len(records) and all(
        row["id"] == record["id"] and row["messages"][:-1] == record["messages"] for row, record in zip(rows, records))
    return made_with if answered else None


def merge(parts: Path, out: Path, chunks_of_records: list[list[dict]], settings: dict) -> dict:
    """Concatenate every chunk in order into a `datasets` folder at `out`; return the summary."""
    from datasets import Dataset  # heavy import, only needed here

    check_settings_unchanged(parts, settings)
    sizes = [len(c) for c in chunks_of_records]
    chunks = [read_chunk(parts, k, records) for k, records in enumerate(chunks_of_records)]
    missing = [k for k, rows in enumerate(chunks) if rows is None]
    if missing:
        raise DDTreeError(
            f"{parts}: {len(missing)} of {len(sizes)} chunks are not finished (first: {missing[0]}); "
            "run the remaining shards first, or merge fewer prompts with a smaller --limit"
        )
    rows = [row for chunk in chunks for row in chunk]
    # Dataset.from_list takes its columns from the first row alone: a first chunk reused from data made before
    # response_ids were kept dropped the ids just generated for the others (training then tokenized their text).
    if any("response_ids" in row for row in rows):
        rows = [{**row, "response_ids": row.get("response_ids")} for row in rows]
    summary = {**settings, **conversation_counts(rows)}
    with staged_folder(out) as staging:
        Dataset.from_list(rows).save_to_disk(str(staging))
        (staging / "regeneration.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# ----------------------------------------------------------------------------- main

def report(summary: dict, out: Path) -> dict:
    print(f"[regenerate] wrote {summary['num_conversations']} conversations to {out} "
          f"({summary['response_tokens']} response tokens, {summary['num_hit_max_new_tokens']} hit max_new_tokens)")
    return summary


def run(args: argparse.Namespace) -> dict | None:
    args = checked_args(args)
    if args.check:  # (as a script, answered before torch loads: answer_early_check)
        check_dataset(args)
        return None
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    # serving's checks of --temperature and --top-p, before any work, naming the flags
    Sampling(args.temperature, args.top_p, names=SAMPLING_FLAGS)
    parse_device(args.device)  # a GPU this machine lacks is one line here, not an assertion once the target loads
    if args.backend == "vllm" and args.target_adapter:
        raise DDTreeError(f"--backend vllm loads --target {args.target} from its files and merges no --target-adapter: "
                          "give --backend transformers (auto picks it for an adapter), or merge the adapter into a "
                          "folder of its own (docs/training.md, A target with a PEFT adapter) and give that as "
                          "--target")
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise DDTreeError("--backend vllm: vLLM is not installed in this environment; install it, or give --backend "
                          "transformers (auto picks vLLM only where it imports and a GPU is present)")
    parts = Path(f"{args.out}.parts")
    if parts.exists() and not parts.is_dir():
        raise DDTreeError(f"{parts} (the work folder of --out {args.out}) is a file; move it away or give another --out")
    out = Path(args.out)
    if out.exists() and not (out / "regeneration.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise DDTreeError(f"--out {out} exists and is not a dataset this script wrote (no regeneration.json): give "
                          "another --out, or move it away; nothing was written")
    torch.set_num_threads(args.threads)

    records = read_messages_jsonl(args.prompts)
    if args.limit is not None:
        records = records[: args.limit]
    for record in records:
        record["messages"] = prompt_messages(record["messages"])
        if not record["messages"]:
            raise DDTreeError(f"{args.prompts}: record {record['id']!r} has only assistant turns; it needs a prompt")
    chunks = [records[start:start + args.chunk_size] for start in range(0, len(records), args.chunk_size)]
    settings = response_settings(args)
    check_replaces_only_its_own(out, settings, len(records), args.overwrite, job_recipe(args))
    finished = finished_here(out, records, settings)
    if finished is not None:  # `make data` on the default recipe, whose data ships finished
        print(f"[regenerate] {out} already answers these {len(records)} prompts with these settings; nothing to do")
        return finished
    with unwritable_as_error(parts):
        parts.mkdir(parents=True, exist_ok=True)
    # a merge makes no chunk again: removing those of other settings there would only lose them
    check_settings(parts, settings, args.overwrite and not args.merge_only)
    reused = reuse_merged(args.out, parts, chunks, settings)
    if reused:
        print(f"[regenerate] {reused} chunks taken from the dataset already at {args.out}", flush=True)
    if args.merge_only:
        return report(merge(parts, args.out, chunks, settings), args.out)

    mine = [k for k in range(len(chunks)) if k % args.num_shards == args.shard_index]
    todo = [k for k in mine if read_chunk(parts, k, chunks[k]) is None]
    print(f"[regenerate] {len(records)} prompts, {len(chunks)} chunks; shard {args.shard_index}/{args.num_shards}: "
          f"{len(mine)} chunks, {len(mine) - len(todo)} already done", flush=True)

    if todo:
        check_prompts_render(args.target, records)
        use_vllm = args.backend == "vllm" or (args.backend == "auto" and not args.target_adapter and vllm_usable())
        if use_vllm:  # vLLM holds the weights; here only the tokenizer and the stop ids are needed
            vllm_generator, model = VLLMGenerator(args.target, args.dtype, args.seed), None
            tokenizer, stops = tokenizer_and_stops(args.target)
        else:
            vllm_generator = None
            model, tokenizer = load_frozen_target(args.target, DTYPES[args.dtype], args.target_adapter, args.device,
                                                  adapter_field="--target-adapter")
            stops = sorted(set(stop_token_ids(model, tokenizer)))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
        total = sum(len(chunks[k]) for k in todo)
        started = time.time()
        with tqdm(total=total, desc=f"shard {args.shard_index}", unit="prompt", file=sys.stdout) as progress:
            for k in todo:
                chunk = chunks[k]
                prompts = [chat_prompt_ids(tokenizer, r["messages"], r["where"], CHAT_TARGET) for r in chunk]
                seeds = [prompt_seed(args.seed, record["id"]) for record in chunk]  # whatever the batch, chunk, shard
                if vllm_generator is not None:
                    new_tokens = vllm_generator.generate(prompts, stops, args.max_new_tokens, args.temperature,
                                                         args.top_p, seeds, progress)
                else:
                    generators = None if args.temperature <= 0 else [
                        torch.Generator(model.device).manual_seed(seed) for seed in seeds]
                    new_tokens = generate_transformers(model, prompts, pad_id, stops, args.batch_size,
                                                       args.max_new_tokens, args.temperature, args.top_p,
                                                       generators=generators, progress=progress)
                rows = []
                for record, prompt, tokens in zip(chunk, prompts, new_tokens):
                    response, finish = cut_at_stop(tokens, set(stops))
                    text = tokenizer.decode(response, skip_special_tokens=True)
                    rows.append({
                        "id": record["id"],
                        "messages": record["messages"] + [{"role": "assistant", "content": text}],
                        "finish_reason": finish,
                        "prompt_tokens": len(prompt),
                        "response_tokens": len(response),
                        "response_ids": response,  # what training supervises (training/conversations.py)
                    })
                check_settings_unchanged(parts, settings)
                write_chunk(parts, k, rows)
        print(f"[regenerate] shard {args.shard_index}: {total} prompts in {time.time() - started:.0f} s", flush=True)

    if all(read_chunk(parts, k, chunk) is not None for k, chunk in enumerate(chunks)):
        return report(merge(parts, args.out, chunks, settings), args.out)
    print("[regenerate] other shards still running; the last one merges (or run with --merge-only)")
    return None


@command
def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
