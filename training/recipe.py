"""Recipes (recipes/<name>.yaml) read as training reads them: the LightningCLI parser with its links.

    config = read_recipe(recipe_path("smollm2-135m"), ["--model.num_layers=3"])
    config.model.block_size, config.data.feature_store, config.trainer.precision

Training (training/train.py) builds its run from `DistillCLI`; tools that only read a recipe
(the feature store's CLI, `make eval`, the recipe tests) use `read_recipe`, which parses and
type-checks the same way and builds nothing. A bad field or value raises a DDTreeError naming
the recipe and the field; so does a launch this machine cannot run (a GPU recipe without a GPU).
"""

from __future__ import annotations

import inspect
import math
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ddtree.errors import CommandParser, DDTreeError, error_line
from ddtree.files import not_a_file, read_yaml_mapping
from ddtree.packed_linear import check_packing_choice
from ddtree.precision import AUTO, LIGHTNING_PRECISION, fast_precision
from ddtree.targets import has_hub_id_shape

from .arguments import known_recipes, recipe_path
from .callbacks import AcceptanceEvaluation, BestCheckpoint, monitor_metric, with_step_timer
from .checkpoints import AtomicCheckpointIO
from .conversations import DATA_FILE_SUFFIXES
from .data import DistillDataModule
from .feature_store import init_from_config
from .loss import OBJECTIVE_SETTINGS
from .module import NO_SCHEDULE_END, DistillModule
from .peft_utils import check_adapter_folder
from .recipe_data import AUTO_DATA, read_summary
from .strategies import CPUDeepSpeed, DrafterDeepSpeed, check_launch, count_devices
from .target import PRECISION_CHOICES, dtype_for_precision

GPU_ACCELERATORS = ("gpu", "cuda")  # the trainer.accelerator values that need a CUDA GPU
# LightningCLI's own optimizer sections, which DistillCLI does not take: every config.yaml written before it stopped
# taking them records both as null, and those are dropped (config_arg), so that such a run still resumes.
LIGHTNING_OPTIMIZER_SECTIONS = ("optimizer", "lr_scheduler")
OPTIMIZER_FIELDS = ("the optimizer is the module's AdamW with a warm-up and a cosine schedule: set model.lr, "
                    "model.betas, model.weight_decay, model.warmup_ratio or model.min_lr_ratio instead")


# The recipe's sections, each a mapping of fields (or empty); its other top-level key is seed_everything, a value.
RECIPE_SECTIONS = ("trainer", "model", "data", "eval", "checkpoint")


def read_recipe_settings(config: Path) -> dict:
    """A recipe (or a run's config.yaml) as read_yaml_mapping reads it, each section a mapping or empty: a section
    given a value (`trainer: cpu`, `trainer: [cpu]`) failed with an AttributeError's traceback, or with jsonargparse's
    line that said neither what was wrong nor what to write. An optimizer or lr_scheduler that is not null is refused
    first, whatever its shape: told to make `optimizer: torch.optim.SGD` a section, the user then had it refused."""
    settings = read_yaml_mapping(config)
    for key in LIGHTNING_OPTIMIZER_SECTIONS:
        if settings.get(key) is not None:
            raise DDTreeError(f"{config}: {key}: section not accepted ({OPTIMIZER_FIELDS}); remove it")
    for section in RECIPE_SECTIONS:
        if settings.get(section) is not None and not isinstance(settings[section], dict):
            kind = type(settings[section]).__name__
            raise DDTreeError(f"{config}: {section} must be a section of fields (field: value lines under it), not "
                              f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    return settings


class RecipeSettingError(DDTreeError):
    """A recipe setting this launch cannot run with; `recipe_errors` puts the recipe's path in front."""


def field_overrides(overrides: list[str], field: str) -> list[tuple[range, str]]:
    """Each --<field> override: the items it spans, as one (=X) or two (X after it), and its value ("" for one given
    without a value), in order: the last wins, as in the parser."""
    found = []
    for i, item in enumerate(overrides):
        if item.startswith(f"--{field}="):
            found.append((range(i, i + 1), item.split("=", 1)[1]))
        elif item == f"--{field}":
            following = overrides[i + 1] if i + 1 < len(overrides) else "--"
            found.append((range(i, i + 1), "") if following.startswith("--") else (range(i, i + 2), following))
    return found


def field_override(overrides: list[str], field: str) -> str | None:
    """The value of the --<field> override that wins; None when there is none."""
    found = field_overrides(overrides, field)
    return found[-1][1] if found else None


def parser_overrides(overrides: list[str]) -> list[str]:
    """The overrides the parser sees, without a --trainer.precision auto (Lightning has none): where auto wins,
    config_arg resolves it into the config, and no precision override is passed on at all."""
    found = field_overrides(overrides, "trainer.precision")
    auto_wins = bool(found) and found[-1][1] == AUTO
    dropped = {i for span, value in found if auto_wins or value == AUTO for i in span}
    return [item for i, item in enumerate(overrides) if i not in dropped]


def config_arg(config: Path, overrides: list[str]) -> str:
    """The --config value: the recipe's path, or its text with `trainer.precision: auto` resolved.

    "auto" (ddtree/precision.py) is this project's value, not Lightning's, so it is replaced before
    the parser sees it: by a --trainer.precision override when there is one (which wins anyway),
    else by what is fast on this machine, printed in one line. The resolved value is what
    config.yaml records, so a resumed run keeps the precision it started with. An override of
    auto asks for the same on a recipe that names a precision (give parser_overrides to the parser).
    """
    settings = read_recipe_settings(config)  # refuses an optimizer or lr_scheduler that is not null
    recorded_null = [key for key in LIGHTNING_OPTIMIZER_SECTIONS if key in settings]
    for key in recorded_null:
        del settings[key]
    # A section left with no fields (`data:` alone) is YAML's null, which jsonargparse took as the group with no
    # values at all, not its defaults: a traceback (data), a missing key (model, eval), no save_last (checkpoint)
    emptied = [section for section in RECIPE_SECTIONS if section in settings and settings[section] is None]
    for section in emptied:
        settings[section] = {}
    trainer = settings.get("trainer") or {}
    override = field_override(overrides, "trainer.precision")
    if override == AUTO:
        settings["trainer"] = trainer = {**trainer, "precision": AUTO}
        override = None
    if override is not None and not override.strip():
        keep = f" to keep the recipe's {trainer['precision']}" if trainer.get("precision") else ""
        raise RecipeSettingError(f"--trainer.precision was given no value: give one of "
                                 f"{', '.join(LIGHTNING_PRECISION.values())} (or another of Lightning's precisions), "
                                 f"or drop the override{keep}")
    if trainer.get("precision") != AUTO:
        # an empty file (or comments alone) is the empty recipe read_yaml_mapping reads; jsonargparse read the file
        # itself as no config at all ("Unexpected config")
        return yaml.safe_dump(settings, sort_keys=False) if recorded_null or emptied or not settings else str(config)
    if override is None:
        # The device the run trains on: an accelerator override's, else the recipe's (a CPU recipe given
        # --trainer.accelerator=gpu trains on the GPU, and got the host CPU's choice)
        accelerator = str(field_override(overrides, "trainer.accelerator") or trainer.get("accelerator", "auto"))
        # A GPU recipe read on a machine without one resolves for the CPU (training stops at check_accelerator).
        device = "cuda" if accelerator in (*GPU_ACCELERATORS, "auto") and torch.cuda.is_available() else "cpu"
        choice = fast_precision(device)
        print(f"[precision] trainer.precision auto -> {choice.lightning} ({choice.reason}); "
              "set trainer.precision to override", flush=True)
    trainer["precision"] = override or choice.lightning
    return yaml.safe_dump(settings, sort_keys=False)


# How argparse (under jsonargparse) says that flags were left over on the command line
UNRECOGNIZED = "unrecognized arguments: "


@contextmanager
def recipe_errors(config: Path):
    """A bad field or value in a recipe (or an override of it) as one DDTreeError line naming the file; a flag the
    command does not know as one naming the command line, which holds it (the recipe holds no flags)."""
    try:
        yield
    except ArgumentError as error:
        line = argument_error_line(error)
        if any(f"--{key}" in line for key in LIGHTNING_OPTIMIZER_SECTIONS):
            line += f" ({OPTIMIZER_FIELDS})"
        if line.startswith('Parser key "trainer.precision"'):  # (fp32, bf16-true's typos, AUTO): jsonargparse's line
            line += f"; {PRECISION_CHOICES}"  # said only that no type of the field took it, not what would
        if line.startswith(UNRECOGNIZED):  # pointing to --help as the command's own parser does (CommandParser.error)
            raise DDTreeError(f"unrecognized arguments on the command line: {line.removeprefix(UNRECOGNIZED)}; see "
                              f"{CommandParser().prog} --help") from None
        raise DDTreeError(f"{config}: {line}") from None
    except RecipeSettingError as error:
        raise DDTreeError(f"{config}: {error}") from None


def argument_error_line(error: ArgumentError) -> str:
    """jsonargparse's many-line message as one line: the key, the value given, the first thing expected."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    given = next((line for line in lines if line.startswith("Given value:")), None)
    expected = next((line.lstrip("- ") for line in lines[1:] if line.lstrip("- ").startswith(("Expected", "Does not"))), None)
    parts = [lines[0].rstrip(":") if lines else type(error).__name__] + [p for p in (given, expected) if p]
    return "; ".join(parts)[:400]


def cpu_recipe_for(target: str | None) -> str | None:
    """A recipe that trains the same target on a CPU, if there is one. One that cannot be read is passed over: a
    work-in-progress recipe beside the named one replaced that one's error with its own."""
    for name in known_recipes():
        try:
            settings = read_recipe_settings(recipe_path(name))
        except DDTreeError:
            continue
        model, trainer = settings.get("model") or {}, settings.get("trainer") or {}
        if target and model.get("target") == target and trainer.get("accelerator") == "cpu":
            return name
    return None


def check_accelerator(accelerator, devices, target: str | None = None) -> None:
    """A recipe that asks for a GPU stops before anything is built when torch sees none, or fewer than it asks for."""
    if str(accelerator) in GPU_ACCELERATORS and not torch.cuda.is_available():
        cpu_recipe = cpu_recipe_for(target)
        if cpu_recipe is not None:
            # Not --trainer.accelerator=cpu: a GPU recipe's bf16 (up to 7x fp32's time on a CPU without fast bf16)
            # and its data, regenerated by the target on first use, are sized for a GPU.
            fix = f"train the CPU recipe of {target} instead: make train RECIPE={cpu_recipe} (--recipe {cpu_recipe})"
        else:
            # precision=auto too: the recipe's bf16 can be several times fp32's time on a CPU (measured by auto).
            fix = ("add --trainer.accelerator=cpu --trainer.precision=auto"
                   + ("" if str(devices) in ("1", "auto") else " --trainer.devices=1"))
        raise RecipeSettingError(f"trainer.accelerator={accelerator} needs a CUDA GPU and this machine has none "
                                 f"(torch.cuda.is_available() is False): run it on a GPU machine, or {fix}")
    on_gpus = str(accelerator) in (*GPU_ACCELERATORS, "auto") and torch.cuda.is_available()
    requested, available = count_devices(devices), torch.cuda.device_count()
    if on_gpus and requested is not None and 0 < available < requested:
        raise RecipeSettingError(f"trainer.devices={devices} asks for {requested} GPUs and this machine has {available}: "
                                 f"add --trainer.devices={available}, or run it on a machine with {requested}")
    missing = [index for index in device_indices(devices) if index >= available]
    if on_gpus and available > 0 and missing:
        raise RecipeSettingError(f"trainer.devices={devices} names GPU {', '.join(map(str, missing))}, and this machine "
                                 f"has GPUs 0-{available - 1}: name GPUs below {available}, or give a count "
                                 f"(--trainer.devices={min(available, max(1, len(device_indices(devices))))})")


def registered_strategy(strategy) -> dict | None:
    """Lightning's registry entry (its class and init_params) for a trainer.strategy name; None for one given as an
    object or not registered. Indexed: the registry's get() builds the strategy."""
    return StrategyRegistry[strategy] if isinstance(strategy, str) and strategy in StrategyRegistry else None


def deepspeed_class(strategy) -> type | None:
    """The DeepSpeed strategy class a trainer.strategy name stands for (ours, zero2 ..., or Lightning's deepspeed_*);
    None for any other strategy, or one given as an object."""
    registered = registered_strategy(strategy)
    return registered["strategy"] if registered and issubclass(registered["strategy"], DeepSpeedStrategy) else None


def check_strategy(strategy, accelerator, gradient_clip_algorithm) -> None:
    """What Lightning's DeepSpeed strategy refuses only once fit starts, with a traceback; and the strategies Lightning
    runs but that this training cannot: FSDP (nothing here gathers it) and spawned or forked processes."""
    registered = registered_strategy(strategy)
    start_method = registered["init_params"].get("start_method") if registered else None
    if start_method in ("spawn", "fork"):
        # Lightning trains in processes it starts and joins: the drafter they trained never comes back to this one,
        # whose export after the whole run read None (a traceback, exit status 1, no drafter/)
        raise RecipeSettingError(f"trainer.strategy={strategy} trains in processes it {start_method}s, and the drafter "
                                 "they train never returns to this process, which exports it: give ddp (the same "
                                 "processes, with rank 0 training in this one)")
    if registered and issubclass(registered["strategy"], FSDPStrategy):
        # Under FSDP module.drafter holds this rank's shards: the evaluation during training and the export gather a
        # sharded drafter from DeepSpeed only (training/strategies.py), so they would have read a shard as the drafter.
        raise RecipeSettingError(f"trainer.strategy={strategy} is FSDP, which this training does not support (its "
                                 "evaluation and export gather sharded weights from DeepSpeed only): give ddp, or "
                                 "zero2/zero3 to shard across GPUs")
    deepspeed = deepspeed_class(strategy)
    if deepspeed is None:
        return
    if not issubclass(deepspeed, DrafterDeepSpeed):  # deepspeed, deepspeed_stage_2, ...: Lightning's own
        settings = registered["init_params"]
        ours = "zero3" if settings.get("stage") == 3 else "zero2"
        ours += "_offload" if settings.get("offload_optimizer") else ""
        raise RecipeSettingError(f"trainer.strategy={strategy} is Lightning's own DeepSpeed strategy, which lacks this "
                                 "training's fixes (an accumulating run's gradient divided once, not twice; the frozen "
                                 "target kept out of ZeRO-3's partitions; a marker on a save cut short): give "
                                 f"--trainer.strategy={ours} (this training's DeepSpeed: zero2, zero2_offload, zero3 or "
                                 "zero3_offload)")
    on_cuda = str(accelerator) in GPU_ACCELERATORS or (str(accelerator) == "auto" and torch.cuda.is_available())
    if not on_cuda and not issubclass(deepspeed, CPUDeepSpeed):
        where = "this machine has no CUDA GPU" if str(accelerator) == "auto" else f"trainer.accelerator={accelerator}"
        raise RecipeSettingError(f"trainer.strategy={strategy} is DeepSpeed, which Lightning runs on CUDA GPUs only, and "
                                 f"{where}: run it on a GPU machine, or give --trainer.strategy=ddp (auto for one "
                                 "device)")
    if str(gradient_clip_algorithm).lower() == "value":
        raise RecipeSettingError(f"trainer.gradient_clip_algorithm={gradient_clip_algorithm}: DeepSpeed "
                                 f"(trainer.strategy={strategy}) clips gradients by norm only; give norm (or leave it "
                                 "out), or a strategy that is not DeepSpeed (ddp) to clip by value")


def check_lora_strategy(strategy, lora_rank) -> None:
    """A LoRA drafter under ZeRO-3: its evaluation during training cannot gather it (consolidated_copy), and that
    evaluation is no option, so the run stopped at its first one, after eval.every_n_train_steps steps and no save."""
    registered = registered_strategy(strategy)
    if lora_rank and deepspeed_class(strategy) is not None and registered["init_params"].get("stage") == 3:
        raise RecipeSettingError(f"model.lora_rank={lora_rank} with trainer.strategy={strategy}: the evaluation during "
                                 "training cannot gather a LoRA drafter sharded by ZeRO-3; give --trainer.strategy=zero2 "
                                 "(or ddp), or model.lora_rank=0")


def device_indices(devices) -> list[int]:
    """The GPU numbers a trainer.devices list names ([0, 3] or "0,3"); [] where it gives a count or 'auto'."""
    if isinstance(devices, (list, tuple)):
        items = list(devices)
    elif "," in str(devices):
        items = [item for item in str(devices).split(",") if item.strip()]
    else:
        return []
    return [int(item) for item in items if str(item).strip().isdigit()]


def check_values(config: Namespace) -> None:
    """Values that type-check but that torch or Lightning refuse later, with a traceback or mid-training."""
    model, data, trainer = config.model, config.data, config.trainer
    # Lightning counts infinitely many steps here (max_epochs null means -1 under max_time): the cosine has no end
    no_epoch_limit = trainer.max_epochs == -1 or (trainer.max_epochs is None and trainer.max_time)
    endless = trainer.max_steps == -1 and no_epoch_limit
    refused = [
        ("model.lr", model.lr, model.lr > 0, "give a positive learning rate"),
        ("data.num_workers", data.num_workers, data.num_workers >= 0, "give 0 (load in the main process) or more"),
        # positions of a block past the longest sequence are never labelled, yet decoding drafts them
        ("model.block_size", model.block_size, model.block_size is None or model.block_size <= data.max_length,
         f"a block longer than data.max_length={data.max_length} has positions no sequence trains; give a block size of "
         f"at most {data.max_length}, or a longer data.max_length"),
        # a reply of one supervised token has no successor, so no anchor: a batch of such replies has no block, which
        # a single process skips but which several processes cannot (Lightning refuses a None step under DDP)
        ("data.min_supervised_tokens", data.min_supervised_tokens, data.min_supervised_tokens >= 2,
         "give at least 2 (a block anchors on a reply token with a successor; the default is 16)"),
        ("trainer.max_steps", trainer.max_steps, trainer.max_steps == -1 or trainer.max_steps >= 1,
         "give -1 (no limit) or a step count of at least 1 (0 trains nothing and exports an untrained drafter)"),
        ("trainer.max_steps", trainer.max_steps, not endless or (model.anneal_by_max_time and trainer.max_time),
         NO_SCHEDULE_END),
        ("trainer.max_epochs", trainer.max_epochs, trainer.max_epochs in (None, -1) or trainer.max_epochs >= 1,
         "give -1 or null (no limit) or an epoch count of at least 1"),
        ("trainer.accumulate_grad_batches", trainer.accumulate_grad_batches, trainer.accumulate_grad_batches >= 1,
         "give 1 (no accumulation) or more"),
        ("trainer.val_check_interval", trainer.val_check_interval, trainer.val_check_interval != 0,
         "give a step count, a fraction of an epoch, or null"),
        # Lightning reads a clip value <= 0 as no clipping, without a word: a typo would train unclipped
        ("trainer.gradient_clip_val", trainer.gradient_clip_val,
         trainer.gradient_clip_val is None or float(trainer.gradient_clip_val) > 0,
         "give a positive norm to clip at, or null (no clipping)"),
        # Lightning would wrap the data's own rank split in a second one: each rank would train on 1/world^2.
        ("trainer.use_distributed_sampler", trainer.use_distributed_sampler, not trainer.use_distributed_sampler,
         "the data splits itself across ranks (and resumes mid-epoch): give false, or leave it out"),
    ]
    for field, value, valid, fix in refused:
        if not valid:
            raise RecipeSettingError(f"{field}={value} is not a valid value: {fix}")
    try:  # else refused as the target loads, mid-setup, with a traceback
        dtype = dtype_for_precision(trainer.precision, model.target_dtype)
        # eval.packed_weights on where the evaluation's target runs in bf16 (precision auto's choice where the CPU
        # computes it fast) or on a GPU: refused at the start of training, once the feature store and the target were
        # built (minutes on the CPU recipe)
        accelerator = str(trainer.accelerator)
        on_gpu = accelerator in GPU_ACCELERATORS or (accelerator == "auto" and torch.cuda.is_available())
        float32 = ("model.target_dtype=float32" if model.target_dtype not in (None, "", AUTO)
                   else "trainer.precision=32-true")
        check_packing_choice(config.eval.packed_weights, dtype, "cuda" if on_gpu else "cpu", "eval.packed_weights",
                             float32)
    except DDTreeError as error:
        raise RecipeSettingError(str(error)) from None


def check_input_files(config: Namespace, resuming: bool = False) -> None:
    """The files a run reads, checked as the recipe is read: else a missing one was named only once the data or the
    first evaluation read it, on the CPU default after the feature store, the target and the corpus (362 s, against
    15.7 s now, the imports; a 2-core AVX2 EPYC, 2026-11-29). A resume reads no model.init_from folder: its drafter
    is built from the checkpoint (DistillModule.configure_model)."""
    data_path = str(config.data.data_path)
    generated = data_path == AUTO_DATA or config.data.regenerate  # written on first use (training/recipe_data.py)
    # ~ expanded, as the data module reads it: a recipe's `data_path: ~/mydata` (no shell expands YAML) was refused
    if not (generated or Path(data_path).expanduser().exists()):
        # mydata/convs.jsonl has the shape owner/name too, but names a file: taken for a Hub dataset, a mistyped path
        # failed at fit, 40 s later, with "could not load Hub dataset" and never said the file was not there
        if not has_hub_id_shape(data_path) or Path(data_path).suffix.lower() in DATA_FILE_SUFFIXES:
            raise RecipeSettingError(f"data.data_path={data_path}: no such file or folder (and not a Hub dataset name "
                                     "owner/name); give a .jsonl or .parquet file or a saved datasets folder")
        # data/qwen3-8b has the shape owner/name: before its replies were generated it was taken for a Hub dataset,
        # and the run failed at fit, 25 s later, asking the Hub for a dataset `data/qwen3-8b`.
        owner = Path(data_path).parts[0]
        if Path(owner).is_dir():
            raise RecipeSettingError(f"data.data_path={data_path}: no such folder ({owner}/ is a folder here, so this "
                                     "is a local path, not a Hub dataset): generate it first with data/regenerate.py "
                                     "(make data RECIPE=<recipe>; the recipe's header gives the options), or give "
                                     "the data's path")
    if config.model.init_from and not resuming:
        try:
            init_from_config(config.model.init_from)
        except DDTreeError as error:
            raise RecipeSettingError(str(error)) from None
    if config.model.target_adapter:  # else found as the target loads: after the data's generation, hours on a real one
        try:
            check_adapter_folder(config.model.target_adapter)
        except DDTreeError as error:
            raise RecipeSettingError(str(error)) from None
    prompts = config.eval.prompts
    problem = not_a_file(prompts)
    if problem:
        raise RecipeSettingError(f"eval.prompts={prompts}: {problem}; give a JSONL of held-out prompts "
                                 "(the `ddtree bench --prompts` format)")
    check_replay_data(config)


def check_replay_data(config: Namespace) -> None:
    """model.calibrate and model.replay_calibration replay the validation replies as the target's greedy decoding
    (training/replay.py): each reply token is taken for the target's choice at temperature 0. Replies the data says
    were sampled are refused, in one line: a T=0.8 copy of the shipped data trained and wrote its calibration into the
    drafter without a word, and decoding at T=0 then expected tau 1.98 where it measured 2.36 (learned on greedy
    replies: 2.27 against 2.39). Replies another target wrote are a one-line note: the `tiny` recipe replays SmolLM2's on tiny-random, a
    smoke run. What the data says: the folder's regeneration.json, or data.regenerate, which writes it (and which
    training/recipe_data.py holds an existing folder to); a data file says nothing."""
    model, data = config.model, config.data
    options = [f"model.{name}" for name in ("calibrate", "replay_calibration") if getattr(model, name, False)]
    if not options:
        return
    named = " and ".join(options) + (" replay" if len(options) > 1 else " replays")
    turned_off = " and ".join(f"{option}=false" for option in options)
    # No validation reply to replay: the evaluation replayed none and still wrote a calibration learned from nothing
    # into the drafter (temperatures all 1, and `calibrated` in its evaluation files), without a word.
    for field, value in (("trainer.limit_val_batches", config.trainer.limit_val_batches),
                         ("data.val_fraction", data.val_fraction)):
        if value is not None and float(value) == 0:
            raise RecipeSettingError(f"{named} the validation replies, and {field}={value} leaves none to replay: give "
                                     f"{field} above 0, or set {turned_off}")
    folder = Path(str(data.data_path)).expanduser()  # as the data module reads it: else ~/data was never checked
    if str(data.data_path) != AUTO_DATA and (folder / "regeneration.json").is_file():
        record, source = read_summary(folder), folder / "regeneration.json"
    elif data.regenerate:
        record = {"target": model.target, "temperature": data.regenerate.get("temperature")}
        source = "data.regenerate"
    else:
        return
    given, written_by = record.get("temperature"), record.get("target")
    try:  # as regenerate.py's --temperature reads it: a quoted "0.8" samples too (null: its default, 0)
        temperature = float(given or 0)
    except (TypeError, ValueError):
        temperature = math.nan
    if not math.isfinite(temperature):  # read as greedy, a record no one could read went on to be replayed
        raise RecipeSettingError(f"{named} the validation replies as the target's greedy decoding, and {source} gives "
                                 f"temperature {given!r}, not a number: give data whose record says temperature 0 "
                                 f"(data/regenerate.py's default), or set {turned_off}")
    if temperature > 0:
        raise RecipeSettingError(f"{named} the validation replies as the target's greedy decoding, and {source} says "
                                 f"they were sampled at temperature {temperature}: give data the target wrote at "
                                 f"temperature 0 (data/regenerate.py's default), or set {turned_off}")
    if written_by and written_by != model.target:
        print(f"[calibration] {named} the validation replies as {model.target}'s greedy decoding, and {source} says "
              f"{written_by} wrote them: what it fits is measured on another model's text", flush=True)


def note_unused_loss_settings(model: Namespace) -> None:
    """One line naming the loss settings given another value than their default that this run's loss never reads:
    `--model.objective_budget=64` on the dpace recipe trained as if not given, without a word, and a `make ablate`
    variant of it tabulated the recipe's own loss under another name."""
    defaults = inspect.signature(DistillModule.__init__).parameters
    changed = lambda name: getattr(model, name) != defaults[name].default  # noqa: E731
    unused = [f"model.{name}={getattr(model, name)} (read by objective {' and '.join(objectives)} only)"
              for name, objectives in OBJECTIVE_SETTINGS.items() if model.objective not in objectives and changed(name)]
    if not model.distill_weight > 0:
        unused += [f"model.{name}={getattr(model, name)} (read with model.distill_weight > 0 only)"
                   for name in ("distill_loss", "distill_top_k") if changed(name)]
    if unused:
        print(f"[loss] unused by this run's loss, model.objective={model.objective} with model.distill_weight="
              f"{model.distill_weight}: {'; '.join(unused)}", flush=True)


def check_before_building(config: Namespace, resuming: bool = False) -> None:
    """Everything a launch checks before it builds anything: training (DistillCLI), and make ablate for every variant
    before the first one trains, so that a variant's bad path is not found after the others trained for hours.
    A recipe sized for other hardware than was launched stops before its files are looked for (a GPU recipe on a CPU
    machine says so first, not that its data is yet to be generated). `resuming`: a --resume's launch."""
    trainer = config.trainer
    check_values(config)
    note_unused_loss_settings(config.model)
    check_accelerator(trainer.accelerator, trainer.devices, config.model.target)
    check_strategy(trainer.strategy, trainer.accelerator, trainer.gradient_clip_algorithm)
    check_lora_strategy(trainer.strategy, config.model.lora_rank)
    check_launch(trainer.devices, trainer.num_nodes)
    check_input_files(config, resuming)


# Where a run writes: training.train sets both to the run folder (run_location_args), which its resume, make eval and
# make export read, and a run's config.yaml records them.
RUN_LOCATION_FIELDS = ("trainer.default_root_dir", "checkpoint.dirpath")


def check_checkpoint_settings(config: Path, overrides: list[str] = (), run_config: bool = False) -> None:
    """Settings a launch sets itself: given in the recipe or as an override, they were dropped silently or split a run.

    The eval section sets checkpoint.every_n_train_steps and checkpoint.monitor. The run folder sets
    RUN_LOCATION_FIELDS: given elsewhere, a run's checkpoints (or its reports) went where neither its resume nor
    make eval finds them, and two runs given one dirpath overwrote each other's checkpoints. A run's own config.yaml
    (run_config) records those two, which the launch sets again.
    """
    settings = read_recipe_settings(config)
    for field, source in (("every_n_train_steps", "eval.every_n_train_steps"), ("monitor", "eval.primary_budget")):
        if field in (settings.get("checkpoint") or {}):
            raise DDTreeError(f"{config}: checkpoint.{field} follows {source}; remove it from the checkpoint section")
    fix = "give --output-root (runs go to <output-root>/<recipe>/<run>/) or --run-name"
    for field in RUN_LOCATION_FIELDS:
        section, key = field.split(".")
        if not run_config and key in (settings.get(section) or {}):
            raise DDTreeError(f"{config}: {field} is set by the run folder; remove it from the {section} section and "
                              f"{fix}")
        if any(item == f"--{field}" or item.startswith(f"--{field}=") for item in overrides):
            raise DDTreeError(f"{config}: --{field} is set by the run folder (its resume, make eval and make export "
                              f"look there); drop it and {fix}")


class DistillCLI(LightningCLI):
    def __init__(self, *args, resuming: bool = False, **kwargs):
        self.resuming = resuming  # a --resume's launch (check_before_building); read as the parent parses
        # The optimizer and its schedule are the module's (configure_optimizers: AdamW, warm-up and cosine, set by
        # model.lr, model.betas, model.weight_decay, model.warmup_ratio, model.min_lr_ratio). Lightning's own
        # --optimizer made fit fail with a traceback, and its --lr_scheduler was recorded and never used.
        super().__init__(*args, auto_configure_optimizers=False, **kwargs)

    def add_arguments_to_parser(self, parser):
        # Every run measures DDTree acceptance (eval.*) and checkpoints at exactly those steps, ranked by
        # the primary budget's tau: both checkpoint settings follow the eval section.
        parser.add_lightning_class_args(AcceptanceEvaluation, "eval")
        parser.add_lightning_class_args(BestCheckpoint, "checkpoint")
        parser.link_arguments("eval.every_n_train_steps", "checkpoint.every_n_train_steps", apply_on="parse")
        parser.link_arguments("eval.primary_budget", "checkpoint.monitor", compute_fn=monitor_metric, apply_on="parse")
        parser.set_defaults(
            {
                "checkpoint.filename": "step-{step}",
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": 1,  # the best by measured tau (plus last.ckpt)
                "checkpoint.mode": "max",
                "trainer.use_distributed_sampler": False,  # DistillDataModule splits the data across ranks itself
            }
        )
        # One target per recipe: the data's tokenizer and the model's target can never disagree.
        parser.link_arguments("model.target", "data.target", apply_on="parse")

    def before_instantiate_classes(self) -> None:
        check_before_building(self.config, self.resuming)

    def instantiate_trainer(self, **kwargs):
        # Lightning checks the rest of the trainer section (accelerator and strategy names, among others) as it
        # builds the Trainer, and raises with a traceback; a DDTreeError is already one line.
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except DDTreeError:
            raise
        # TypeError: a trainer.devices the CPU refuses (-2, abc, 1.5, a list); ImportError: an accelerator's package
        except (MisconfigurationException, ValueError, TypeError, ImportError) as error:
            raise RecipeSettingError(f"the trainer section was refused: {error_line(error)}") from None
        # Checkpoint files are written whole or not at all (training/checkpoints.py). DeepSpeed's engine writes its
        # own shard folders, and a writer a recipe names in trainer.plugins is kept.
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        trainer.callbacks[:] = with_step_timer(trainer.callbacks)  # max_time stops where an optimizer step ends
        return trainer


class RecipeReader(DistillCLI):
    """Parses and type-checks a recipe, links applied, and builds nothing (for tools that only read it)."""

    # Its parser, built by the process's first read and reused: every read makes it of the same classes and settings
    # (read_recipe's), and building it took 0.12-0.15 s of a warm read's 0.19-0.23 s on a 2-core AVX2 EPYC, where
    # `make ablate` reads the recipe once for each variant and shared flag.
    built_parser = None

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        if RecipeReader.built_parser is None:
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
            RecipeReader.built_parser = self.parser
        self.parser = RecipeReader.built_parser

    def before_instantiate_classes(self) -> None:
        pass  # no launch to check: nothing will train

    def instantiate_classes(self) -> None:
        pass


def read_recipe(config: Path, overrides: list[str]) -> Namespace:
    """A recipe's settings as training would resolve them (config.model, config.data, ...), overrides applied."""
    check_checkpoint_settings(config, overrides)
    with recipe_errors(config), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return RecipeReader(DistillModule, DistillDataModule, save_config_callback=None,
                            parser_kwargs={"exit_on_error": False, "allow_abbrev": False}, run=False,  # as build_cli's
                            args=["--config", config_arg(config, overrides), *parser_overrides(overrides)]).config
