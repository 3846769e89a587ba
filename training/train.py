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
    drafter/               the trained drafter as a HF folder, for `ddtree bench --drafter`

`--resume last` continues the newest run of the recipe that has a last.ckpt, in its own folder and
with its own config.yaml: step, optimizer, scheduler and data position all continue exactly.
`--resume <run folder>` continues from its newest checkpoint (last.ckpt or a SLURM requeue's
hpc_ckpt_N.ckpt). Under DeepSpeed every checkpoint is a folder of per-rank shards under the same name.
With data.feature_store set (offline target features, training/features.py) a missing store is
built first, in a single-process run; a multi-process launch asks for `make features` instead.
Several processes (devices > 1, torchrun, SLURM) share one run folder; rank 0 writes config.yaml
and drafter/, and a launch whose process count differs from devices x num_nodes stops at once.
Bad input (unknown recipe, bad field, bad target) prints one line and exits with status 2 or 1.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch.cli import LightningCLI

from ddtree.targets import DDTreeError
from training.callbacks import AcceptanceEvaluation, BestCheckpoint, monitor_metric
from training.data import DistillDataModule
from training.export import export_drafter
from training.features import build_feature_store, drafter_layer_ids, is_complete, resolve_store_path
from training.module import DistillModule, NonFiniteError
from training.strategies import check_launch, drafter_for_export, is_first_process, launcher_world

REPO = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO / "recipes"


def known_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def saved_at(checkpoint: Path) -> float:
    """When a checkpoint was last written: a file's mtime, or a DeepSpeed folder's `latest` tag file's."""
    return (checkpoint / "latest" if checkpoint.is_dir() else checkpoint).stat().st_mtime


def newest_checkpoint(run_dir: Path) -> Path:
    """The newest of a run's checkpoints/last.ckpt and the hpc_ckpt_N.ckpt Lightning saves on SLURM's requeue signal."""
    saved = [p for p in [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")]
             if (p / "latest").is_file() or p.is_file()]
    if not saved:
        raise DDTreeError(f"--resume {run_dir}: the run has no checkpoint yet (no checkpoints/last.ckpt or hpc_ckpt_*.ckpt)")
    return max(saved, key=saved_at)


def find_resume(resume: str, recipe_root: Path) -> tuple[Path, Path]:
    """(checkpoint, run folder) for --resume: 'last' = newest run of this recipe with a last.ckpt.

    Also a run folder (its newest checkpoint) or a checkpoint path: a .ckpt file, or the folder a
    DeepSpeed strategy writes under that name.
    """
    if resume == "last":
        runs = sorted(recipe_root.glob("*/checkpoints/last.ckpt"), key=saved_at)
        if not runs:
            raise DDTreeError(f"--resume last: no run with checkpoints/last.ckpt under {recipe_root}; start one first")
        checkpoint = runs[-1]
    elif (Path(resume) / "config.yaml").is_file():
        checkpoint = newest_checkpoint(Path(resume))
    else:
        checkpoint = Path(resume)
        if not (checkpoint.is_file() or (checkpoint / "latest").is_file()):
            raise DDTreeError(f"--resume {resume}: no such checkpoint; give a .ckpt path, a run folder or 'last'")
    # The run folder is the nearest one above the checkpoint with a config.yaml (checkpoints/x.ckpt, or hpc_ckpt_N.ckpt).
    run_dir = next((p for p in checkpoint.resolve().parents if (p / "config.yaml").is_file()), checkpoint.resolve().parent.parent)
    if not (run_dir / "config.yaml").is_file():
        raise DDTreeError(f"--resume {resume}: {run_dir}/config.yaml is missing, so the run cannot be resumed exactly")
    return checkpoint, run_dir


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
            }
        )
        # One target per recipe: the data's tokenizer and the model's target can never disagree.
        parser.link_arguments("model.target", "data.target", apply_on="parse")

    def before_instantiate_classes(self) -> None:
        # Before anything is built: a recipe sized for other hardware than was launched stops here.
        check_launch(self.config.trainer.devices, self.config.trainer.num_nodes)


class RecipeReader(DistillCLI):
    """Parses and type-checks a recipe, links applied, and builds nothing (for tools that only read it)."""

    def before_instantiate_classes(self) -> None:
        pass  # no launch to check: nothing will train

    def instantiate_classes(self) -> None:
        pass


def read_recipe(config: Path, overrides: list[str]) -> Namespace:
    """A recipe's settings as training would resolve them (config.model, config.data, ...), overrides applied."""
    check_checkpoint_settings(config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return RecipeReader(DistillModule, DistillDataModule, save_config_callback=None,
                            parser_kwargs={"exit_on_error": False}, run=False,
                            args=["--config", str(config), *overrides]).config


def build_cli(config: Path, run_dir: Path, overrides: list[str]) -> DistillCLI:
    """Parse config + overrides into (model, datamodule, trainer) without running anything."""
    check_checkpoint_settings(config)
    logger = [
        {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(run_dir), "name": "tensorboard"}},
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(run_dir), "name": "csv"}},
    ]
    with warnings.catch_warnings():
        # LightningCLI is handed its arguments here, so its warning that sys.argv holds some too is noise.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return DistillCLI(
            DistillModule,
            DistillDataModule,
            save_config_callback=None,  # written by hand below, to the run folder, atomically
            trainer_defaults={"default_root_dir": str(run_dir), "logger": logger},
            seed_everything_default=0,
            parser_kwargs={"exit_on_error": False},
            args=["--config", str(config), "--checkpoint.dirpath", str(run_dir / "checkpoints"), *overrides],
            run=False,
        )


def build_missing_feature_store(cli: DistillCLI, recipe: str) -> None:
    """Build data.feature_store before fitting when it names a store that does not exist yet.

    Only a single-process run builds it: the processes of a larger launch would each start the
    same build, so they stop and ask for `make features` first.
    """
    store = resolve_store_path(cli.datamodule.feature_store, recipe, cli.datamodule)
    if store is None:
        return
    cli.datamodule.feature_store = str(store)  # "auto" resolved; config.yaml keeps "auto", so a resume resolves it again
    if is_complete(store):
        return
    if cli.trainer.world_size > 1:
        raise DDTreeError(f"data.feature_store {store} is not built and this launch runs {cli.trainer.world_size} "
                          f"processes: build it first with `make features RECIPE={recipe} OUT={store}`")
    hp = cli.model.hparams
    build_feature_store(cli.datamodule, Path(store), layer_ids=drafter_layer_ids(hp.target_layer_ids, hp.init_from),
                        target_adapter=hp.target_adapter)


RUN_NAME_ENV = "DDTREE_RUN_NAME"  # the run folder name, handed to the processes Lightning starts


def run_name(requested: str | None) -> str:
    """The run folder's name, the same in every process of a launch."""
    if requested:
        return requested
    if os.environ.get(RUN_NAME_ENV):  # a process Lightning started for devices > 1
        return os.environ[RUN_NAME_ENV]
    world = launcher_world()
    if world and world[0] == "SLURM":  # the job id survives a requeue
        job, task = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"]), os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{job}" + (f"-{task}" if task else "")
    if world and world[1] > 1:  # torchrun: each process would pick its own timestamp
        raise DDTreeError("started by torchrun without --run-name: give the same --run-name on every node "
                          "(recipes/launch_torchrun.sh does)")
    return time.strftime("%Y%m%d-%H%M%S")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(staging, path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Train a drafter from a recipe.", add_help=True)
    parser.add_argument("--recipe", default="smollm2-135m", help="one of recipes/*.yaml")
    parser.add_argument("--resume", default=None, help="'last' or a .ckpt path: continue that run exactly")
    # --run-name too: torchrun rejects any option spelled --run (an abbreviation of its --run-path)
    parser.add_argument("--run", "--run-name", dest="run", default=None,
                        help="run folder name, the same on every node (default: a timestamp, or slurm-<job id>)")
    parser.add_argument("--output-root", default="outputs", help="runs go to <output-root>/<recipe>/<run>/")
    args, overrides = parser.parse_known_args(argv)
    if args.recipe not in known_recipes():
        print(f"error: unknown recipe {args.recipe!r}; known recipes: {', '.join(known_recipes())}", file=sys.stderr)
        return 2
    try:
        config = RECIPES_DIR / f"{args.recipe}.yaml"
        recipe_root = Path(args.output_root) / args.recipe
        checkpoint = None
        if args.resume:
            checkpoint, run_dir = find_resume(args.resume, recipe_root)
            config = run_dir / "config.yaml"
        else:
            run_dir = recipe_root / run_name(args.run)
            if is_first_process() and (run_dir / "config.yaml").exists():
                raise DDTreeError(f"run folder {run_dir} already holds a run; pick another --run or use --resume")
        cli = build_cli(config, run_dir, overrides)
        build_missing_feature_store(cli, args.recipe)
        if is_first_process():
            write_text_atomic(run_dir / "config.yaml", cli.parser.dump(cli.config, skip_none=False))
            print(f"[train] recipe {args.recipe} -> {run_dir}" + (f" (resuming {checkpoint})" if checkpoint else ""), flush=True)
        # For devices > 1 Lightning starts the other processes by re-running this command: same folder.
        os.environ[RUN_NAME_ENV] = run_dir.name
        try:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(checkpoint) if checkpoint else None)
        finally:
            os.environ.pop(RUN_NAME_ENV, None)
        if cli.trainer.interrupted:
            print(f"[train] interrupted; resume with --resume {run_dir / 'checkpoints' / 'last.ckpt'}", file=sys.stderr)
            return 130
        drafter = drafter_for_export(cli.model, cli.trainer)  # every rank: DeepSpeed gathers the fp32 weights
        if cli.trainer.is_global_zero:
            drafter_dir = export_drafter(drafter, run_dir / "drafter")
            print(f"[train] drafter written to {drafter_dir} (ddtree bench --drafter {drafter_dir})", flush=True)
        return 0
    except ArgumentError as error:
        print(f"error: {args.recipe} config: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    except DDTreeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except NonFiniteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
