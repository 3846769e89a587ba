"""How a training run spreads over processes and nodes: DeepSpeed ZeRO strategies and launch checks.

A recipe chooses its strategy in `trainer.strategy` (like any field, it can be overridden on the
command line, e.g. --trainer.strategy=zero3):

    strategy: auto            # one device (devices: 1)
    strategy: ddp             # one replica of the drafter per process, gradients all-reduced
    strategy: zero2           # DeepSpeed ZeRO-2: optimizer state and gradients sharded across processes
    strategy: zero2_offload   #   ... optimizer state and step on the CPU
    strategy: zero3           # DeepSpeed ZeRO-3: the drafter's weights sharded too
    strategy: zero3_offload   #   ... weights and optimizer state on the CPU

with `trainer.devices` processes per node on `trainer.num_nodes` nodes. Jobs of several nodes start
from recipes/launch_torchrun.sh or recipes/slurm.sbatch (`make train RECIPE=qwen3-8b NODES=2`);
`check_launch` stops a run at once when the recipe and the launcher disagree on the process count, when the
recipe asks for several nodes and no launcher started it, or when a SLURM job of several tasks runs it without srun
(each would wait for processes that never join); `check_launcher` when LSF's jsrun or mpirun started it (every rank
would take itself for rank 0).

What ZeRO shards, and what it does not: only the drafter is a submodule of DistillModule, so only
the drafter is in DeepSpeed's engine, optimizer and checkpoints. The frozen target is a plain
attribute outside the module tree (training/module.py), so ZeRO never sees it: every process
loads one full copy of it, once, in the training precision (bf16), and no checkpoint holds it.
Under ZeRO-3 that is deliberate: the target is never partitioned, so its forward needs no
all-gather per layer (a bf16 copy of an 8B target is 16 GB, which fits beside the drafter on one
80 GB GPU). A target too large for one GPU would need its own sharding (tensor-parallel feature
extraction, or stored features with only the embedding and LM head replicated); that is not
built here. For the same reason `DrafterDeepSpeed` does not build modules inside deepspeed.zero.Init as Lightning's
strategy does under ZeRO-3 (that would partition the target as it loads): it builds the drafter
whole on every process and lets deepspeed.initialize partition it (fp32, 4 GB for a 1B drafter,
briefly, once per process).

Weights: with `precision: bf16-mixed`, DeepSpeed holds the drafter's weights in bf16 and the fp32
master copy in the sharded optimizer. `drafter_for_export` gathers that fp32 copy from the live
engine at the end of training; a ZeRO checkpoint folder (step-N.ckpt/ or last.ckpt/, one file
per rank) is consolidated to the same fp32 weights when it is read (training/checkpoints.py,
`load_checkpoint`), which `make eval` and `make export` use.

DeepSpeed on CPU, for tests only: Lightning's DeepSpeed strategy refuses a non-CUDA accelerator,
yet DeepSpeed itself runs ZeRO on CPU processes over gloo (DS_ACCELERATOR=cpu). `zero2_cpu` and
`zero3_cpu` are DrafterDeepSpeed with only the CUDA-specific checks skipped, so the CPU test suite
runs the code that runs on GPUs (tests/training/test_deepspeed.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from lightning.fabric.plugins.environments import LSFEnvironment, MPIEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry
from torch import nn

from ddtree.errors import DDTreeError
from ddtree.modeling_dflash import DFlashDraftModel

from .checkpoint_paths import SAVING_MARKER
from .checkpoints import checkpoint_refusal_as_error, drafter_from_weights


class DrafterDeepSpeed(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, with the drafter built outside deepspeed.zero.Init (see above).

    With an offloaded optimizer state, DeepSpeed steps the module's own torch AdamW on the CPU
    partitions rather than requiring its compiled CPU Adam: slower per step, but nothing has to
    be compiled on the training nodes and the update is the one every other strategy computes.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if (self.config.get("zero_optimization") or {}).get("offload_optimizer"):
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """Lightning's loop has already divided the loss by accumulate_grad_batches, and DeepSpeed's engine.backward
        divides it again by its gradient_accumulation_steps (which Lightning sets to the same count) unless told not
        to. Without this, a run accumulating N batches under zero2/zero3 took 1/N of the gradient every other strategy
        takes: its clipping acted at N times gradient_clip_val and train/grad_norm read N times too small."""
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Lightning's save, between a marker written before any rank writes and removed after every rank has:
        DeepSpeed rewrites the folder's files in place under one tag, so a save cut short (a kill, a full disk) left a
        mix of two steps that resumed with a traceback or, worse, silently (checkpoint_paths.is_readable refuses it now).
        A save the disk refuses is one line, as AtomicCheckpointIO's (torch.save into a path says only "unexpected
        pos" then, a 90-line traceback from every rank); the marker stays."""
        marker = Path(filepath) / SAVING_MARKER
        if self.is_global_zero:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("a save of this checkpoint began and has not finished\n")
        self.barrier("drafter_deepspeed_save_begins")
        with checkpoint_refusal_as_error(Path(filepath)):
            super().save_checkpoint(checkpoint, filepath, storage_options)
        self.barrier("drafter_deepspeed_save_ends")
        if self.is_global_zero:
            marker.unlink()

    @contextmanager
    def model_sharded_context(self):
        # Lightning's strategy enters deepspeed.zero.Init here under ZeRO-3, which would partition
        # the frozen target that configure_model loads; deepspeed.initialize partitions the drafter.
        self._init_config_if_needed()
        yield


class CPUDeepSpeed(DrafterDeepSpeed):
    """DrafterDeepSpeed on CPU processes over gloo, for tests. Needs DS_ACCELERATOR=cpu.

    The only differences: the checks that the accelerator is CUDA and that device indices match
    local ranks are skipped, DeepSpeed is given the local rank directly (CPU devices have no index,
    which is where the stock strategy reads it), and under ZeRO-3 every parameter is partitioned,
    however small (DeepSpeed otherwise keeps parameters under 100K elements whole, i.e. all of a
    tiny test drafter's).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(*args, **kwargs)
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise DDTreeError("the zero*_cpu strategies need DeepSpeed's CPU accelerator: run with DS_ACCELERATOR=cpu")
        if self.zero_stage_3:
            self.config["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's "only supported on CUDA GPUs"

    def setup_distributed(self) -> None:
        reset_seed()  # DeepSpeedStrategy.setup_distributed without its device-index check
        self.set_world_ranks()
        # DeepSpeed's CPU backend compiles its shared-memory all-reduce op as it starts, which serves its inference
        # all-reduce only: training's collectives go through gloo. That build took 100-210 s of a 2-core machine on
        # every fresh checkout (its cache is keyed by the venv's paths), so it is skipped.
        with mock.patch("deepspeed.comm.torch.build_shm_op", return_value=None):
            self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),  # the stock strategy passes root_device.index
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer


# name -> (class, ZeRO stage, offload the optimizer state, offload the parameters)
STRATEGIES = {
    "zero2": (DrafterDeepSpeed, 2, False, False),
    "zero2_offload": (DrafterDeepSpeed, 2, True, False),
    "zero3": (DrafterDeepSpeed, 3, False, False),
    "zero3_offload": (DrafterDeepSpeed, 3, True, True),
    "zero2_cpu": (CPUDeepSpeed, 2, False, False),
    "zero3_cpu": (CPUDeepSpeed, 3, False, False),
}
for _name, (_cls, _stage, _offload_optimizer, _offload_parameters) in STRATEGIES.items():
    StrategyRegistry.register(
        _name, _cls, description=f"DeepSpeed ZeRO-{_stage} for drafter training (training/strategies.py)",
        override=True, stage=_stage, offload_optimizer=_offload_optimizer, offload_parameters=_offload_parameters,
    )


def is_deepspeed(strategy) -> bool:
    return isinstance(strategy, DeepSpeedStrategy)


# ----------------------------------------------------------------------------- launching


def launcher_world() -> tuple[str, int, int | None] | None:
    """(launcher, processes, nodes or None if unknown) when a launcher started this process, else None.

    torchrun and SLURM are detected as Lightning detects them, torchrun first (`srun torchrun ...` starts one
    SLURM task per node and torchrun's processes in each: Lightning runs WORLD_SIZE processes, not SLURM_NTASKS),
    so this check and the Trainer agree; any other launcher that sets WORLD_SIZE (a script of one's own, the
    processes Lightning itself starts for devices > 1) is checked on WORLD_SIZE alone.
    """
    if TorchElasticEnvironment.detect():
        world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        return "torchrun", world, max(1, world // per_node)
    if SLURMEnvironment.detect():
        return "SLURM", int(os.environ["SLURM_NTASKS"]), int(os.environ.get("SLURM_NNODES", 1))
    if os.environ.get("WORLD_SIZE", "").isdigit():
        return "the launcher", int(os.environ["WORLD_SIZE"]), None
    return None


def count_devices(devices) -> int | None:
    """trainer.devices as a process count per node; None for 'auto'/-1 (Lightning takes every device)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text.lstrip("-").isdigit() and int(text) >= 0:
        return int(text)
    return None


# What Lightning's own launch across nodes reads (LightningEnvironment): a node started by hand sets them.
NODE_SETTINGS = ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK")


def started_on_nodes() -> bool:
    """Whether this process was started as one node of several: by a launcher (launcher_world) or by hand with
    Lightning's node settings. LSF's jsrun and mpirun are refused before this is asked (check_launcher)."""
    return launcher_world() is not None or any(os.environ.get(name) for name in NODE_SETTINGS)


def check_launcher() -> None:
    """Stop with one line if LSF's jsrun or mpirun started this process as one of several, as Lightning detects them
    (after torchrun and SLURM, which it prefers). is_first_process reads none of their rank variables, so every rank
    took itself for rank 0: each took the run folder's lock, and all but one were refused there. train.py calls it
    before that lock too, which every rank takes before check_launch runs. One process alone is rank 0: it passes."""
    if TorchElasticEnvironment.detect() or SLURMEnvironment.detect():
        return
    if LSFEnvironment.detect() and os.environ["JSM_NAMESPACE_SIZE"].strip() != "1":
        launcher = f"LSF's jsrun (JSM_NAMESPACE_SIZE={os.environ['JSM_NAMESPACE_SIZE']})"
    elif MPIEnvironment.detect():
        launcher = "mpirun (Lightning's MPIEnvironment)"
    else:
        return
    raise DDTreeError(
        f"{launcher} started this process, a launcher training does not support (its ranks would all act as rank 0): "
        "start the run with torchrun (`make train RECIPE=<recipe> NODES=<n>` on each node, recipes/launch_torchrun.sh) "
        "or SLURM's srun (`sbatch recipes/slurm.sbatch <recipe>`), as docs/training.md, Scaling out, describes"
    )


def check_launch(devices, num_nodes) -> None:
    """Stop with one line if the recipe's devices x num_nodes is not the number of processes launched, if it asks
    for several nodes and nothing started this process as one of them, or if a launcher it does not support did
    (check_launcher)."""
    check_launcher()
    num_nodes = int(num_nodes or 1)
    if num_nodes > 1 and not started_on_nodes():  # else it waits for the other nodes until the process group times out
        raise DDTreeError(
            f"trainer.num_nodes={num_nodes} but no launcher started this process as one of {num_nodes} nodes (no "
            f"torchrun, SLURM, {', '.join(NODE_SETTINGS)} in the environment): run `make train RECIPE=<recipe> "
            f"NODES={num_nodes}` on each node (recipes/launch_torchrun.sh) or `sbatch --nodes={num_nodes} "
            "recipes/slurm.sbatch <recipe>`, or give --trainer.num_nodes=1 for one machine"
        )
    world = launcher_world()  # torchrun's processes under SLURM are torchrun's: its world, not SLURM's tasks
    tasks = int(os.environ.get("SLURM_NTASKS") or 1)
    if world and world[0] == "SLURM" and tasks > 1 and "SLURM_STEP_NUM_TASKS" not in os.environ:
        # srun sets SLURM_STEP_NUM_TASKS as it starts a step's tasks; a batch script (or a salloc shell) running python
        # itself has SLURM_NTASKS alone, which Lightning takes for the processes started: it waited for the others
        raise DDTreeError(
            f"SLURM_NTASKS={tasks} but no srun started this process (no SLURM_STEP_NUM_TASKS: this is the job's batch "
            f"script or shell), so it would wait for {tasks - 1} other task(s) that never start: start it with `srun "
            "python -m training.train ...` (one task per GPU), or submit `sbatch recipes/slurm.sbatch <recipe>`"
        )
    per_node = count_devices(devices)
    if world is None or per_node is None:
        return
    launcher, processes, nodes = world
    if per_node * num_nodes != processes:
        where = f" on {nodes} node(s)" if nodes else ""
        count = "SLURM_NTASKS" if launcher == "SLURM" else "WORLD_SIZE"
        launch = f"launch {per_node} processes on each of {num_nodes} node(s)"
        if not nodes:
            fix = f"set trainer.devices, or {launch}"
        elif processes % nodes:  # no trainer.devices fits: Lightning runs as many processes on every node
            fix = f"{processes} processes do not split evenly across {nodes} nodes, as training needs: {launch}"
        else:
            fix = f"set --trainer.devices={processes // nodes} --trainer.num_nodes={nodes}, or {launch}"
        raise DDTreeError(
            f"trainer.devices={devices} x trainer.num_nodes={num_nodes} = {per_node * num_nodes} processes, but "
            f"{launcher} started {processes} ({count}={processes}){where}: {fix}"
        )


def is_first_process() -> bool:
    """Global rank 0 of the launch, read from the launcher's environment (before any process group exists).

    Covers torchrun (RANK), SLURM (SLURM_PROCID) and the processes Lightning starts itself for
    devices > 1 (LOCAL_RANK, NODE_RANK).
    """
    names = ["RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"] + (["SLURM_PROCID"] if SLURMEnvironment.detect() else [])
    return all(os.environ.get(name, "0") == "0" for name in names)


def end_process_group() -> None:
    """Close this process's process group, once its run has finished well.

    Lightning leaves the group that DeepSpeed opens to the interpreter's own exit, where torch tears its threads
    down in no fixed order: on the CPU (gloo) a ZeRO-2 rank whose run had finished once aborted there with
    "terminate called without an active exception" (exit 134 for a finished run, while rank 0 was still exporting),
    and on GPUs torch warns on every rank that NCCL's group was never destroyed. Every rank calls it at the same point,
    after the last collective: closing an NCCL group waits for the other ranks to close it too. Only after a run that
    finished: a rank that failed may leave others inside a collective, where closing would wait on them for good.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if "deepspeed" in sys.modules:
            import deepspeed.comm

            # DeepSpeed keeps its own clone of the world group, which only its destroy_process_group lets go of:
            # closed behind its back, the next run in this process (make ablate's next variant) gets the closed
            # clone from deepspeed.initialize ("Group ... is not registered").
            if deepspeed.comm.is_initialized():
                deepspeed.comm.destroy_process_group()
                return
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- the trained weights


def full_fp32_state(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of drafter.state_dict() as a whole fp32 CPU tensor, from a DeepSpeed engine's drafter.

    Trainable parameters come from the optimizer's fp32 master copy, frozen ones (LoRA base
    weights) from the module. A collective: every rank must call it, in the same order.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    parameters = dict(drafter.named_parameters())
    buffers = dict(drafter.named_buffers())
    state = {}
    for name in drafter.state_dict():
        if name in parameters:
            param = parameters[name]
            full = safe_get_full_fp32_param(param) if param.requires_grad else None
            if full is None:  # frozen: DeepSpeed keeps it in the training dtype only
                with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                    full = param.detach().float().clone()
            state[name] = full.detach().float().cpu()
        else:
            state[name] = buffers[name].detach().cpu()
    return state


def consolidated_copy(drafter: nn.Module) -> DFlashDraftModel:
    """A plain copy of a ZeRO-3-sharded drafter on this rank (every rank must call this together).

    Decoding runs a different number of drafter forwards on each rank, and ZeRO-3 gathers the shards
    at every forward in lockstep, so the sharded module itself cannot decode. The zero3_cpu tests run it at every
    evaluation (test_deepspeed.py's ZeRO-3 run evaluates at steps 2 and 4).
    """
    import deepspeed

    if hasattr(drafter, "peft_config") or any("lora_" in name for name, _ in drafter.named_parameters()):
        raise DDTreeError(
            "evaluation under DeepSpeed ZeRO-3 does not support a LoRA drafter; use ZeRO-2 or DDP, "
            "or evaluate saved checkpoints with `make eval`"
        )
    params = dict(drafter.named_parameters())
    device = next(iter(params.values())).device
    copy = DFlashDraftModel(drafter.config)
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        full = {name: p.detach().clone() for name, p in params.items()}  # (whole tensors inside the context)
    missing = set(dict(copy.named_parameters())) - set(full)
    if missing:
        raise RuntimeError(f"consolidating the ZeRO-3 drafter: parameters {sorted(missing)[:3]} were not gathered")
    copy.load_state_dict(full, strict=False)
    return copy.to(device=device, dtype=full[next(iter(full))].dtype).eval()


def drafter_for_export(module, trainer) -> nn.Module:
    """The trained drafter with full fp32 weights, as training/export.py writes it.

    Under DDP or one device that is the module's own drafter. Under DeepSpeed the module holds bf16
    (ZeRO-2) or partitioned (ZeRO-3) weights, so the fp32 master weights are gathered into a fresh
    copy; every rank must call this, and only rank 0 needs to write the result.
    """
    if not is_deepspeed(trainer.strategy):
        return module.drafter
    # Lightning's teardown has moved the module to the CPU by now, and DeepSpeed gathers each fp32 master weight by
    # all-reducing a buffer on its parameter's device: gloo (the CPU runs') takes a CPU buffer, NCCL refuses it ("No
    # backend type associated with device type cpu", the zero2 run on an H200, 2026-12-04). Back to the rank's device.
    module.drafter.to(trainer.strategy.root_device)
    config = module.base_drafter().config.to_dict()
    return drafter_from_weights(config, dict(module.hparams), full_fp32_state(module.drafter))
