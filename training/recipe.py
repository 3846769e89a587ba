"""Recipes (recipes/<name>.yaml) read as training reads them: the LightningCLI parser with its links.

    config = read_recipe(recipe_path("smollm2-135m"), ["--model.num_layers=3"])
    config.model.block_size, config.data.feature_store, config.trainer.precision

Training (training/train.py) builds its run from `DistillCLI`; tools that only read a recipe
(the feature store's CLI, `make eval`, the recipe tests) use `read_recipe`, which parses and
type-checks the same way and builds nothing. A bad field or value raises a DDTreeError naming
the recipe and the field; so does a launch this machine cannot run (a GPU recipe without a GPU).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ddtree.errors import DDTreeError, error_line
from ddtree.precision import AUTO, fast_precision

from .callbacks import AcceptanceEvaluation, BestCheckpoint, monitor_metric
from .data import DistillDataModule
from .module import DistillModule
from .strategies import check_launch

REPO = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO / "recipes"
GPU_ACCELERATORS = ("gpu", "cuda")  # the trainer.accelerator values that need a CUDA GPU


class RecipeSettingError(DDTreeError):
    """A recipe setting this launch cannot run with; `recipe_errors` puts the recipe's path in front."""


def known_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def check_recipe_name(name: str) -> None:
    if name not in known_recipes():
        raise DDTreeError(f"unknown recipe {name!r}; known recipes: {', '.join(known_recipes())}")


def recipe_path(name: str) -> Path:
    return RECIPES_DIR / f"{name}.yaml"


def config_arg(config: Path, overrides: list[str]) -> str:
    """The --config value: the recipe's path, or its text with `trainer.precision: auto` resolved.

    "auto" (ddtree/precision.py) is this project's value, not Lightning's, so it is replaced before
    the parser sees it: by a --trainer.precision override when there is one (which wins anyway),
    else by what is fast on this machine, printed in one line. The resolved value is what
    config.yaml records, so a resumed run keeps the precision it started with.
    """
    settings = yaml.safe_load(Path(config).read_text()) or {}
    trainer = settings.get("trainer") or {}
    if trainer.get("precision") != AUTO:
        return str(config)
    override = next((o.split("=", 1)[1] for o in overrides if o.startswith("--trainer.precision=")), None)
    if override is None:
        accelerator = str(trainer.get("accelerator", "auto"))
        # A GPU recipe read on a machine without one resolves for the CPU (training stops at check_accelerator).
        device = "cuda" if accelerator in (*GPU_ACCELERATORS, "auto") and torch.cuda.is_available() else "cpu"
        choice = fast_precision(device)
        print(f"[precision] trainer.precision auto -> {choice.lightning} ({choice.reason}); "
              "set trainer.precision to override", flush=True)
    trainer["precision"] = override or choice.lightning
    return yaml.safe_dump(settings, sort_keys=False)


@contextmanager
def recipe_errors(config: Path):
    """A bad field or value in a recipe (or an override of it) as one DDTreeError line naming the file."""
    try:
        yield
    except ArgumentError as error:
        raise DDTreeError(f"{config}: {argument_error_line(error)}") from None
    except RecipeSettingError as error:
        raise DDTreeError(f"{config}: {error}") from None


def argument_error_line(error: ArgumentError) -> str:
    """jsonargparse's many-line message as one line: the key, the value given, the first thing expected."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    given = next((line for line in lines if line.startswith("Given value:")), None)
    expected = next((line.lstrip("- ") for line in lines[1:] if line.lstrip("- ").startswith(("Expected", "Does not"))), None)
    parts = [lines[0].rstrip(":") if lines else type(error).__name__] + [p for p in (given, expected) if p]
    return "; ".join(parts)[:400]


def check_accelerator(accelerator, devices) -> None:
    """A recipe that asks for a GPU stops before anything is built when torch sees none."""
    if str(accelerator) in GPU_ACCELERATORS and not torch.cuda.is_available():
        fix = "--trainer.accelerator=cpu" + ("" if str(devices) in ("1", "auto") else " --trainer.devices=1")
        raise RecipeSettingError(f"trainer.accelerator={accelerator} needs a CUDA GPU and this machine has none "
                                 f"(torch.cuda.is_available() is False): run it on a GPU machine, or add {fix}")


def check_values(config: Namespace) -> None:
    """Values that type-check but that torch or Lightning refuse later, with a traceback or mid-training."""
    model, data, trainer = config.model, config.data, config.trainer
    refused = [
        ("model.lr", model.lr, model.lr > 0, "give a positive learning rate"),
        ("data.num_workers", data.num_workers, data.num_workers >= 0, "give 0 (load in the main process) or more"),
        ("trainer.max_steps", trainer.max_steps, trainer.max_steps >= -1, "give -1 (no limit) or a step count"),
        ("trainer.accumulate_grad_batches", trainer.accumulate_grad_batches, trainer.accumulate_grad_batches >= 1,
         "give 1 (no accumulation) or more"),
        ("trainer.val_check_interval", trainer.val_check_interval, trainer.val_check_interval != 0,
         "give a step count, a fraction of an epoch, or null"),
        # Lightning would wrap the data's own rank split in a second one: each rank would train on 1/world^2.
        ("trainer.use_distributed_sampler", trainer.use_distributed_sampler, not trainer.use_distributed_sampler,
         "the data splits itself across ranks (and resumes mid-epoch): give false, or leave it out"),
    ]
    for field, value, valid, fix in refused:
        if not valid:
            raise RecipeSettingError(f"{field}={value} is not a valid value: {fix}")


def check_checkpoint_settings(config: Path) -> None:
    """The eval section sets checkpoint.every_n_train_steps and checkpoint.monitor; a config value would be dropped silently."""
    settings = yaml.safe_load(config.read_text()) or {}
    for field, source in (("every_n_train_steps", "eval.every_n_train_steps"), ("monitor", "eval.primary_budget")):
        if field in (settings.get("checkpoint") or {}):
            raise DDTreeError(f"{config}: checkpoint.{field} follows {source}; remove it from the checkpoint section")


class DistillCLI(LightningCLI):
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
        # Before anything is built: a recipe sized for other hardware than was launched stops here.
        check_values(self.config)
        check_accelerator(self.config.trainer.accelerator, self.config.trainer.devices)
        check_launch(self.config.trainer.devices, self.config.trainer.num_nodes)

    def instantiate_trainer(self, **kwargs):
        # Lightning checks the rest of the trainer section (accelerator and strategy names, among others) as it
        # builds the Trainer, and raises with a traceback; a DDTreeError is already one line.
        try:
            return super().instantiate_trainer(**kwargs)
        except DDTreeError:
            raise
        except (MisconfigurationException, ValueError) as error:
            raise RecipeSettingError(f"the trainer section was refused: {error_line(error)}") from None


class RecipeReader(DistillCLI):
    """Parses and type-checks a recipe, links applied, and builds nothing (for tools that only read it)."""

    def before_instantiate_classes(self) -> None:
        pass  # no launch to check: nothing will train

    def instantiate_classes(self) -> None:
        pass


def read_recipe(config: Path, overrides: list[str]) -> Namespace:
    """A recipe's settings as training would resolve them (config.model, config.data, ...), overrides applied."""
    check_checkpoint_settings(config)
    with recipe_errors(config), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return RecipeReader(DistillModule, DistillDataModule, save_config_callback=None,
                            parser_kwargs={"exit_on_error": False}, run=False,
                            args=["--config", config_arg(config, overrides), *overrides]).config
