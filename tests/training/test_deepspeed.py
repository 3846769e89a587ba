"""Scale-out on CPU: the real DeepSpeed ZeRO path in two processes, multi-node launch scripts, requeue.

    .venv/bin/pytest -q tests/training/test_deepspeed.py               # default share: one 2-process ZeRO-2 run
    .venv/bin/pytest -q -m "slow or not slow" tests/training/test_deepspeed.py   # + 1-process twin, kill/resume, ZeRO-3, ...

Lightning's DeepSpeed strategy only accepts CUDA. training/strategies.py registers `zero2_cpu` and
`zero3_cpu`: the strategy the GPU recipes use with only its CUDA checks skipped, over gloo
(DS_ACCELERATOR=cpu). Runs start as they would on a cluster node: recipes/launch_torchrun.sh ->
torchrun -> training.train on the `tiny` recipe. A `Probe` callback, added on the command line,
reports from inside every process what only that process can see (the target's dtype and
whether ZeRO touched it, the optimizer's partition) and can freeze the job at a given step so the
test kills it from outside, like a lost node.

The data are 24 conversations whose replies have the same token count, and every reply token is an
anchor (num_anchors above the count): each rank then carries the same loss weight, so the mean of
two ranks' gradients is exactly the gradient of their union, and a 2-process run can be compared
with a 1-process run on the same global batch (4 sequences) with no other difference than float
summation order.

DeepSpeed's CPU backend would compile its shared-memory all-reduce op as each process starts (100-210 s
on a fresh 2-core checkout); it serves inference only, so `zero*_cpu` skip it, and the default run checks that
no process built it.

On a GPU with deepspeed installed, two more tests ("cuda and deepspeed") run the GPU recipes' own `zero2` over
NCCL in one process: trained, consolidated, killed and resumed (recipes/gpu_session.sh zero stages deepspeed there).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

import training.train
from ddtree.targets import DDTreeError, cache_dir
from training.checkpoint_paths import SAVING_MARKER, saved_step
from training.checkpoints import load_checkpoint
from training.launch import exit_status, first_failure
from training.strategies import NODE_SETTINGS, check_launch, count_devices, is_first_process

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "recipes" / "launch_torchrun.sh"
SBATCH = REPO / "recipes" / "slurm.sbatch"
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
SLURM_ENV = ("SLURM_NTASKS", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NAME", "SLURM_JOB_ID",
             "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NODELIST", "SLURM_STEP_NUM_TASKS")
STEPS = 4
# Tolerances, with what they cover (measured values are in the assertion messages):
SAME_MATH_ATOL = 0.0  # resumed vs uninterrupted, consolidated vs live: bit-for-bit
# 2 processes vs 1 on the same global batch (and ZeRO-3 vs ZeRO-2): the same sums in bf16, split and
# ordered differently. AdamW's first steps move every weight by about lr whatever the gradient's size,
# so a gradient near zero whose sign flips on rounding moves that weight the other way: a few weights
# differ by up to 2 lr, the rest by rounding. Measured (4 steps, blocks of 4, lr 3e-3, 49,440 weights): median
# 3.2e-6, 140 weights (0.28%) above 1e-4, 11 above 1e-3, max 3.0e-3 (blocks of 8: 3.6e-6, 266, 15, 3.2e-3). Weights
# move ~3e-3 per step; the median over the last 2 steps, 1.5e-3, is the block size's either way.
TWIN_MEDIAN_ATOL = 2e-5
TWIN_FRACTION_ABOVE_1E_4 = 0.02
TWIN_MAX_ATOL = 2 * 3e-3  # two lr: one flipped AdamW step


# ----------------------------------------------------------------------------- inside the training processes


class Probe(L.Callback):
    """Added with --trainer.callbacks+=...: records per rank what the test cannot see from outside.

    Writes <out_dir>/rank<r>.json at the start of training, and again after the first step with the devices that
    step ran the target on. With DDTREE_TEST_FREEZE_AT=<step> in the environment it writes <out_dir>/frozen<r> after
    that step and sleeps until killed; with DDTREE_TEST_PAUSE_AT=<step> it writes <out_dir>/paused<r> as that step
    starts and waits a few seconds (where a test's SIGTERM lands), then trains it.
    """

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)

    def on_train_start(self, trainer, pl_module):
        target = pl_module._target.model
        module_params = {id(p) for p in pl_module.parameters()}
        record = {
            "pid": os.getpid(),
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "target_dtypes": sorted({str(p.dtype) for p in target.parameters()}),
            "drafter_devices": sorted({str(p.device) for p in pl_module.drafter.parameters()}),
            "target_numel": sum(p.numel() for p in target.parameters()),
            "target_zero_params": sum(hasattr(p, "ds_id") for p in target.parameters()),
            "target_in_module": sum(id(p) in module_params for p in target.parameters()),
            "target_trainable": sum(p.requires_grad for p in target.parameters()),
            "drafter_numel": sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.drafter.parameters()),
            "drafter_local_numel": sum(p.numel() for p in pl_module.drafter.parameters()),
        }
        # The fp32 master weights this rank's optimizer steps: ZeRO-1/2 and ZeRO-3 name their partitions differently.
        optimizer = trainer.strategy.optimizers[0]
        masters = (getattr(optimizer, "single_partition_of_fp32_groups", None)
                   or getattr(optimizer, "fp32_partitioned_groups_flat", None)
                   or [p for group in optimizer.param_groups for p in group["params"]])
        target_ids = {id(p) for p in target.parameters()}
        record["optimizer_numel"] = sum(p.numel() for p in masters)
        record["optimizer_devices"] = sorted({str(p.device) for p in masters})
        record["optimizer_holds_target"] = any(id(p) in target_ids for p in masters)
        self._target_id = id(target)
        self.record = record
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.write(trainer.global_rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pause_at = int(os.environ.get("DDTREE_TEST_PAUSE_AT", "0"))
        if pause_at and trainer.global_step == pause_at - 1 and not (self.out_dir / f"paused{trainer.global_rank}").exists():
            (self.out_dir / f"paused{trainer.global_rank}").write_text(str(pause_at))
            time.sleep(5)

    def write(self, rank: int) -> None:
        (self.out_dir / f"rank{rank}.json").write_text(json.dumps(self.record))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        target = pl_module._target.model
        assert id(target) == self._target_id  # loaded once, never replaced
        if "target_devices" not in self.record:  # the module moves the target to its device when a step first uses it
            self.record["target_devices"] = sorted({str(p.device) for p in target.parameters()})
            self.write(trainer.global_rank)
        freeze_at = int(os.environ.get("DDTREE_TEST_FREEZE_AT", "0"))
        if freeze_at and trainer.global_step >= freeze_at:
            (self.out_dir / f"frozen{trainer.global_rank}").write_text(str(trainer.global_step))
            time.sleep(600)  # until the test kills the job


# ----------------------------------------------------------------------------- running the tiny recipe


def write_equal_conversations(path: Path, count: int = 24, words: int = 40) -> Path:
    """Conversations whose replies all have `words` tokens (single-token words, one prompt)."""
    vocabulary = "the a to of and in is it on for that with as at by from".split()
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(count):
            reply = " ".join(rng.choice(vocabulary) for _ in range(words))
            messages = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return path


def launch_environment(tmp: Path, processes: int, run: str, cuda: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cuda" if cuda else "cpu", GPUS_PER_NODE=str(processes),
               RUN_NAME=run, PYTHON=sys.executable)  # the launcher's default is .venv's, which a GPU machine may lack
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])  # for the Probe
    env["TORCH_EXTENSIONS_DIR"] = str(tmp / "torch_extensions")  # empty: an op built here would show
    for name in (*TORCHRUN_ENV, *SLURM_ENV, "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "DDTREE_TEST_FREEZE_AT",
                 "DDTREE_TEST_PAUSE_AT"):
        env.pop(name, None)
    return env


def launch_args(tmp: Path, strategy: str, batch_size: int, probe_dir: Path, *extra: str) -> list[str]:
    probe = json.dumps({"class_path": "test_deepspeed.Probe", "init_args": {"out_dir": str(probe_dir)}})
    return [
        "--output-root", str(tmp / "out"), f"--data.data_path={tmp / 'conversations.jsonl'}",
        f"--data.cache_dir={tmp / 'cache'}", f"--data.batch_size={batch_size}", "--data.val_fraction=0.1",
        f"--trainer.strategy={strategy}", "--trainer.precision=bf16-mixed",  # the GPU recipes' precision, on any CPU
        f"--trainer.max_steps={STEPS}", "--trainer.val_check_interval=null",
        "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--model.num_anchors=64",
        # blocks of 4, not the recipe's 8: 3 loss rows an anchor, not 7; the bf16 LM head over the 49,152-token
        # vocabulary was ~90% of a step (7.5 s a step, 3.5 s at 4, on a 2-core AVX2 EPYC), and no test reads the size
        "--model.block_size=4",
        "--eval.every_n_train_steps=2", "--eval.limit=1", "--eval.max_new_tokens=3", "--eval.budgets=[4]",
        "--eval.primary_budget=4", f"--trainer.callbacks+={probe}",
        "--checkpoint.save_top_k=-1",  # every evaluated step's checkpoint stays: the tests read step 2's, and a tie
        *extra,                        # at step 4 would displace it (the latest of equals is kept)
    ]


def launch(tmp: Path, run: str, processes: int, strategy: str, batch_size: int, *extra: str, cuda: bool = False) -> dict:
    """Train `tiny` with recipes/launch_torchrun.sh; return the run folder and what each rank's Probe saw."""
    probe_dir = tmp / f"probe-{run}-{len(list(tmp.glob(f'probe-{run}*')))}"
    result = subprocess.run(
        ["bash", str(LAUNCHER), "tiny", "1", *launch_args(tmp, strategy, batch_size, probe_dir, *extra)],
        cwd=REPO, env=launch_environment(tmp, processes, run, cuda), capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, f"{run} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    probes = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(processes)]
    return {"dir": tmp / "out" / "tiny" / run, "probes": probes, "log": result.stdout + result.stderr}


def train_losses(run_dir: Path) -> dict[int, float]:
    losses = {}
    for metrics in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            if row.get("train/loss"):
                losses[int(row["step"])] = float(row["train/loss"])
    return losses


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "drafter" / "model.safetensors")


def consolidated(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The drafter weights of a DeepSpeed checkpoint folder, gathered to fp32 as `make export` reads them."""
    return load_checkpoint(checkpoint).drafter.state_dict()


def assert_twins(a: dict, b: dict, earlier: dict, what: str) -> None:
    """Two runs that compute the same sums in another order agree weight by weight (see TWIN_* above)."""
    gap = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in b])
    moved = torch.cat([(b[k].float() - earlier[k].float()).abs().flatten() for k in b])
    stats = (f"{what}: median gap {gap.median():.2e}, {(gap > 1e-4).float().mean():.2%} above 1e-4, max {gap.max():.2e}; "
             f"median move over the last 2 steps {moved.median():.2e}")
    assert moved.median() > 50 * TWIN_MEDIAN_ATOL, stats  # training moved the weights far more than the gap
    assert gap.median() < TWIN_MEDIAN_ATOL and (gap > 1e-4).float().mean() < TWIN_FRACTION_ABOVE_1E_4, stats
    assert gap.max() <= TWIN_MAX_ATOL, stats


@pytest.fixture
def ds_cpu_accelerator(monkeypatch):
    """DeepSpeed's CPU accelerator for this test: the zero*_cpu strategies need it, and a GPU machine does not pick it
    by itself."""
    from deepspeed.accelerator import real_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setattr(real_accelerator, "ds_accelerator", CPU_Accelerator())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed")
    write_equal_conversations(tmp / "conversations.jsonl")
    return tmp


@pytest.fixture(scope="module")
def zero2_two_processes(workspace):
    """The tiny recipe, ZeRO-2, 2 processes x 2 sequences, 4 steps, checkpoints at steps 2 and 4."""
    return launch(workspace, "zero2-x2", 2, "zero2_cpu", 2)


@pytest.fixture(scope="module")
def zero3_two_processes(workspace):
    """The same under ZeRO-3 (slow tests only)."""
    return launch(workspace, "zero3-x2", 2, "zero3_cpu", 2)


# ----------------------------------------------------------------------------- ZeRO-2, two processes (default run)


def test_data_gives_every_rank_the_same_loss_weight(workspace):
    from training.conversations import read_messages_jsonl, render_with_loss_mask
    from training.data import DistillDataModule

    tokenizer = DistillDataModule(target="tiny-random").load_tokenizer()
    shapes = {tuple(map(len, (ids, [m for m in mask if m])))
              for ids, mask in (render_with_loss_mask(tokenizer, r["messages"])
                                for r in read_messages_jsonl(workspace / "conversations.jsonl"))}
    assert len(shapes) == 1  # one sequence length, one count of supervised tokens
    (length, supervised), = shapes
    assert supervised < 64  # < --model.num_anchors: every candidate is an anchor, whatever the generator


def test_zero2_two_processes_train_with_the_target_outside_zero(zero2_two_processes):
    run, probes = zero2_two_processes["dir"], zero2_two_processes["probes"]
    assert [p["rank"] for p in probes] == [0, 1] and {p["world_size"] for p in probes} == {2}
    assert {p["strategy"] for p in probes} == {"CPUDeepSpeed"}
    assert not list((run.parents[2] / "torch_extensions").rglob("*.so"))  # no process compiled DeepSpeed's op
    assert len({p["pid"] for p in probes}) == 2
    for p in probes:
        # the frozen target: whole (not a ZeRO parameter), bf16, outside the module and the optimizer
        assert p["target_dtypes"] == ["torch.bfloat16"] and p["target_zero_params"] == 0
        assert p["target_in_module"] == 0 and p["target_trainable"] == 0 and not p["optimizer_holds_target"]
        # ZeRO-2: each rank's optimizer holds its half of the drafter's fp32 master weights
        assert p["drafter_numel"] / 2 <= p["optimizer_numel"] < p["drafter_numel"] / 2 + 64, p

    losses = train_losses(run)
    assert sorted(losses) == list(range(STEPS)) and losses[STEPS - 1] < losses[0], losses

    # checkpoints are DeepSpeed folders: one optimizer shard per rank, drafter weights only
    last = run / "checkpoints" / "last.ckpt"
    shards = sorted(p.name for p in (last / "checkpoint").glob("*optim_states.pt"))
    assert shards == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    model_states = torch.load(last / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")
    assert model_states["module"] and all(key.startswith("drafter.") for key in model_states["module"])
    assert model_states["global_step"] == STEPS
    # every save finished: no folder keeps the marker that refuses a save cut short
    assert [p.name for p in (run / "checkpoints").glob("*.ckpt") if p.is_dir()] and not list(run.rglob(SAVING_MARKER))
    # one run folder for both processes; rank 0 alone wrote the config and the drafter
    assert (run / "config.yaml").is_file()
    assert zero2_two_processes["log"].count("[train] drafter written to") == 1


def test_zero_checkpoint_consolidates_to_the_live_fp32_weights(zero2_two_processes):
    run = zero2_two_processes["dir"]
    live = exported(run)  # gathered from the running engine's fp32 master copy at the end of training
    assert {t.dtype for t in live.values()} == {torch.float32}
    merged = consolidated(run / "checkpoints" / "last.ckpt")  # zero_to_fp32 on the saved shards
    assert set(merged) == set(live)
    for key in live:
        torch.testing.assert_close(merged[key], live[key], rtol=0, atol=SAME_MATH_ATOL, msg=key)
    # and the checkpoint of step 2 holds other weights (the comparison is not vacuous)
    earlier = consolidated(run / "checkpoints" / "step-2.ckpt")
    assert any(not torch.equal(earlier[k], live[k]) for k in live)


def accumulated_update(strategy: str, accumulate: int) -> list[float]:
    """The weight change of one SGD step (lr 1: the gradient applied) of a linear least-squares fit over 8 rows, given
    as `accumulate` micro-batches. The zero*_cpu strategies need DeepSpeed's CPU accelerator (ds_cpu_accelerator)."""
    import training.strategies  # noqa: F401 (registers zero2_cpu)

    torch.manual_seed(0)
    rows, targets, start = torch.randn(8, 4), torch.randn(8, 1), torch.randn(1, 4)

    class LeastSquares(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1, bias=False)
            self.linear.weight.data.copy_(start)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.linear(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    module = LeastSquares()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=accumulate,
                        precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows, targets), batch_size=8 // accumulate)
    trainer.fit(module, loader)
    return (start - module.linear.weight.detach()).flatten().tolist()


def test_deepspeed_takes_the_same_gradient_as_every_strategy_when_it_accumulates(tmp_path, ds_cpu_accelerator):
    """Lightning divides the loss by accumulate_grad_batches and DeepSpeed's backward divided it again: 4 accumulated
    batches (the 8B recipes) trained zero2/zero3 on a quarter of the gradient, clipping at 4x its value. In this
    process, under DeepSpeed's CPU accelerator (a process of its own cost ~12 s of imports on a 2-core AVX2 EPYC): the
    environment DeepSpeed's one-process group sets, and the group, are undone after."""
    with mock.patch.dict(os.environ, {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path)}):
        for name in (*TORCHRUN_ENV, *SLURM_ENV, "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            os.environ.pop(name, None)
        try:
            plain, whole, accumulated = (torch.tensor(accumulated_update(strategy, accumulate)) for strategy, accumulate
                                         in (("auto", 2), ("zero2_cpu", 1), ("zero2_cpu", 2)))
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    assert plain.abs().min() > 0.1  # the step moved every weight
    torch.testing.assert_close(whole, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(accumulated, plain, rtol=1e-5, atol=1e-6)


def test_a_single_file_checkpoint_resumed_under_deepspeed_is_one_line(workspace, tmp_path, monkeypatch, capsys,
                                                                       ds_cpu_accelerator):
    """A ddp or one-device run resumed under zero2/zero3 (the step after it ran out of memory): DeepSpeed's engine
    looked for its shard folder inside last.ckpt, a FileNotFoundError traceback. The reverse was one line already.
    The resume runs in this process, under DeepSpeed's CPU accelerator as the unit tests below set it (a process of
    its own cost 14 s of imports on a 2-core AVX2 EPYC): the refusal comes before any process group or engine."""

    out = tmp_path / "out"
    run = ["--output-root", str(out), f"--data.data_path={workspace / 'conversations.jsonl'}",
           f"--data.cache_dir={tmp_path / 'cache'}", "--data.batch_size=2", "--data.val_fraction=0.1",
           "--trainer.max_steps=1", "--trainer.val_check_interval=null", "--trainer.enable_progress_bar=false",
           "--eval.every_n_train_steps=1", "--eval.limit=1", "--eval.max_new_tokens=3", "--eval.budgets=[4]",
           "--eval.primary_budget=4"]
    assert training.train.main(["--recipe", "tiny", "--run-name", "single", *run]) == 0
    run_dir = out / "tiny" / "single"
    before = (run_dir / "config.yaml").read_text()
    for name in (*TORCHRUN_ENV, *SLURM_ENV, *NODE_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    capsys.readouterr()
    status = training.train.main(["--output-root", str(out), "--resume", str(run_dir), "--trainer.max_steps=2",
                                  "--trainer.strategy=zero2_cpu"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: --resume: ") and errors[0].endswith(
        "checkpoints/last.ckpt is a single-file checkpoint (a ddp or one-device run's) and this launch's strategy is "
        "DeepSpeed (CPUDeepSpeed), which resumes only its own folders of per-rank shards: resume it under the run's "
        "strategy (drop the trainer.strategy override), or export it (make export) and start a new run from the "
        "drafter with model.init_from"), errors
    assert "Traceback" not in err
    assert (run_dir / "config.yaml").read_text() == before  # a plain resume still works


# ----------------------------------------------------------------------------- slow: twins, kill/resume, ZeRO-3


@pytest.mark.slow  # one more run (~1 min on the shared 2-core machine)
def test_two_processes_match_one_process_on_the_same_global_batch(workspace, zero2_two_processes):
    single = launch(workspace, "zero2-x1", 1, "zero2_cpu", 4)
    earlier = consolidated(single["dir"] / "checkpoints" / "step-2.ckpt")
    assert_twins(exported(zero2_two_processes["dir"]), exported(single["dir"]), earlier, "2 vs 1 process")
    assert single["probes"][0]["optimizer_numel"] >= single["probes"][0]["drafter_numel"]  # 1 rank holds it all
    losses_two, losses_one = train_losses(zero2_two_processes["dir"]), train_losses(single["dir"])
    # the logged loss is rank 0's half of the batch under 2 processes: close to, not equal to, the whole batch's
    assert abs(losses_two[0] - losses_one[0]) < 0.05, (losses_two, losses_one)


def launch_killed(tmp: Path, run: str, processes: int, strategy: str, batch_size: int, *extra: str,
                  cuda: bool = False) -> Path:
    """Train `tiny` until every rank has finished step 3 (the Probe freezes it there), SIGKILL the job like a lost
    node, check that its last save is step 2's, and return the run folder."""
    probe_dir = tmp / f"probe-{run}"
    env = launch_environment(tmp, processes, run, cuda) | {"DDTREE_TEST_FREEZE_AT": "3"}
    job = subprocess.Popen(
        ["bash", str(LAUNCHER), "tiny", "1", *launch_args(tmp, strategy, batch_size, probe_dir, *extra)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.time() + 900
        while not all((probe_dir / f"frozen{r}").exists() for r in range(processes)):
            assert job.poll() is None, f"the job ended early with status {job.returncode}"
            assert time.time() < deadline, "the job never reached step 3"
            time.sleep(1)
    finally:  # SIGKILL: no handler runs, nothing is flushed or saved
        workers = [json.loads(p.read_text())["pid"] for p in probe_dir.glob("rank*.json")]
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    run_dir = tmp / "out" / "tiny" / run
    assert not (run_dir / "drafter").exists()  # it really died mid-run
    assert saved_step(run_dir / "checkpoints" / "last.ckpt") == 2
    return run_dir


@pytest.mark.slow  # two more runs each (and ZeRO-3's uninterrupted run)
@pytest.mark.parametrize("stage", ["zero2", "zero3"])  # ZeRO-3 names rank 0's model-state file its own way
def test_killed_two_process_run_resumes_to_the_same_weights(workspace, stage, request):
    uninterrupted = request.getfixturevalue(f"{stage}_two_processes")
    run, strategy = f"{stage}-killed", f"{stage}_cpu"
    run_dir = launch_killed(workspace, run, 2, strategy, 2)
    launch(workspace, run, 2, strategy, 2, "--resume", str(run_dir))  # the run folder: its newest checkpoint
    resumed, straight = exported(run_dir), exported(uninterrupted["dir"])
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=SAME_MATH_ATOL, msg=key)
    assert train_losses(run_dir)[STEPS - 1] == train_losses(uninterrupted["dir"])[STEPS - 1]


@pytest.mark.slow  # two more runs
def test_sigterm_between_checkpoints_saves_its_stop_and_resumes_to_the_same_weights(workspace, zero2_two_processes):
    """A SIGTERM to every rank during step 3 (step 2 the last scheduled save) stops the ZeRO-2 job where step 3 ends,
    with that step saved as the last.ckpt folder, every rank's shard: the printed resume continues from step 3 and ends
    with the uninterrupted run's weights, bit for bit. Before, the stop named last.ckpt, which held step 2."""
    run, processes = "zero2-sigterm", 2
    probe_dir = workspace / f"probe-{run}"
    env = launch_environment(workspace, processes, run) | {"DDTREE_TEST_PAUSE_AT": "3"}
    job = subprocess.Popen(
        ["bash", str(LAUNCHER), "tiny", "1", *launch_args(workspace, "zero2_cpu", 2, probe_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.time() + 900
        while not all((probe_dir / f"paused{r}").exists() for r in range(processes)):
            assert job.poll() is None, f"the job ended early with status {job.returncode}"
            assert time.time() < deadline, "the job never reached step 3"
            time.sleep(0.5)
        for record in probe_dir.glob("rank*.json"):  # the training processes, as a scheduler signals them
            os.kill(json.loads(record.read_text())["pid"], signal.SIGTERM)
        log, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    run_dir = workspace / "out" / "tiny" / run
    stop = [line for line in log.splitlines() if line.startswith("[train] stopped by SIGTERM")]
    assert len(stop) == 1 and "at step 3;" in stop[0] and "trained again" not in stop[0], log[-4000:]
    assert f"RESUME={run_dir / 'checkpoints' / 'last.ckpt'}" in stop[0] and not (run_dir / "drafter").exists()
    last = run_dir / "checkpoints" / "last.ckpt"
    assert not (last / SAVING_MARKER).exists()
    saved = torch.load(last / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")
    assert saved["global_step"] == 3
    launch(workspace, run, processes, "zero2_cpu", 2, "--resume", str(last))
    resumed, straight = exported(run_dir), exported(zero2_two_processes["dir"])
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=SAME_MATH_ATOL, msg=key)


@pytest.mark.slow  # one more launch, stopped before its first step
def test_a_deepspeed_resume_that_changes_the_drafter_is_one_line_before_deepspeed_loads(workspace, zero2_two_processes):
    # DeepSpeed loads the shards strictly before Lightning's on_load_checkpoint: another layer count was its
    # size-mismatch traceback from every rank. The run's config.yaml stays as it was.
    run_dir = zero2_two_processes["dir"]
    before = (run_dir / "config.yaml").read_text()
    probe_dir = workspace / "probe-refused"
    result = subprocess.run(
        ["bash", str(LAUNCHER), "tiny", "1",
         *launch_args(workspace, "zero2_cpu", 2, probe_dir, "--resume", str(run_dir), "--model.num_layers=2")],
        cwd=REPO, env=launch_environment(workspace, 2, "zero2-x2"), capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 2  # bad input's status, through torchrun (training/launch.py)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and all(line == errors[0] for line in errors), result.stderr[-3000:]  # the same line from each rank
    assert errors[0].startswith("error: --resume: the checkpoint's run has num_hidden_layers 1 (this launch: 2): "
                                "a resume keeps the run's drafter, data split, optimizer and loss; drop model.num_layers"), errors[0]
    assert "size mismatch" not in result.stderr and not probe_dir.exists()  # stopped before the shards and the first step
    assert (run_dir / "config.yaml").read_text() == before


@pytest.mark.slow  # one more run
def test_zero3_two_processes_shard_the_drafter_not_the_target(zero3_two_processes, zero2_two_processes):
    zero3 = zero3_two_processes
    for p in zero3["probes"]:
        assert p["target_dtypes"] == ["torch.bfloat16"] and p["target_zero_params"] == 0  # a full copy per process
        assert p["target_in_module"] == 0 and not p["optimizer_holds_target"]
        assert p["drafter_local_numel"] == 0  # every drafter weight partitioned away from the module
        assert p["drafter_numel"] / 2 <= p["optimizer_numel"] < p["drafter_numel"] / 2 + 64, p
    live = exported(zero3["dir"])
    merged = consolidated(zero3["dir"] / "checkpoints" / "last.ckpt")
    for key in live:
        torch.testing.assert_close(merged[key], live[key], rtol=0, atol=SAME_MATH_ATOL, msg=key)
    earlier = consolidated(zero2_two_processes["dir"] / "checkpoints" / "step-2.ckpt")
    assert_twins(live, exported(zero2_two_processes["dir"]), earlier, "ZeRO-3 vs ZeRO-2")


@pytest.mark.slow  # one more launch, stopped before its first step
def test_a_zero3_resume_of_nan_weights_stops_before_its_first_step(workspace, zero3_two_processes):
    """A diverged ZeRO-3 checkpoint (NaN in every rank's fp32 shard, which DeepSpeed restores the weights from) is
    refused as under ddp. The check counted the live drafter's parameters, which ZeRO-3 leaves empty placeholders,
    saw nothing, and the run resumed into a NaN loss."""
    run = "zero3-nan"
    run_dir = workspace / "out" / "tiny" / run
    shutil.copytree(zero3_two_processes["dir"], run_dir, symlinks=True)
    last = run_dir / "checkpoints" / "last.ckpt"
    for shard in (last / "checkpoint").glob("*_optim_states.pt"):
        saved = torch.load(shard, weights_only=False, map_location="cpu")
        saved["optimizer_state_dict"]["fp32_flat_groups"][0].detach()[0] = math.nan  # (saved as a leaf needing grad)
        torch.save(saved, shard)
    config = (run_dir / "config.yaml").read_text()
    result = subprocess.run(
        ["bash", str(LAUNCHER), "tiny", "1", *launch_args(workspace, "zero3_cpu", 2, workspace / f"probe-{run}",
                                                        "--resume", str(last), "--trainer.max_steps=6")],
        cwd=REPO, env=launch_environment(workspace, 2, run), capture_output=True, text=True, timeout=1200,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and errors, result.stderr[-3000:]
    assert all(line.startswith(f"error: --resume: {last} holds NaN or inf in ") for line in errors), errors
    assert (run_dir / "config.yaml").read_text() == config  # refused before the launch's settings were written


@pytest.mark.slow  # one more run
def test_zero2_with_the_optimizer_offloaded_trains_the_same_weights(workspace, zero2_two_processes):
    # zero2_offload's setting on the CPU strategy: the fp32 master weights and AdamW state live in host
    # memory and the module's own torch AdamW steps them there (DeepSpeed would otherwise demand its
    # compiled CPU Adam).
    offload = launch(workspace, "zero2-offload-x2", 2, "training.strategies.CPUDeepSpeed", 2,
                     "--trainer.strategy.stage=2", "--trainer.strategy.offload_optimizer=true")
    earlier = consolidated(zero2_two_processes["dir"] / "checkpoints" / "step-2.ckpt")
    assert_twins(exported(offload["dir"]), exported(zero2_two_processes["dir"]), earlier, "offloaded vs not")
    config = torch.load(offload["dir"] / "checkpoints" / "last.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt",
                        weights_only=False, map_location="cpu")["ds_config"]
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.slow  # one more run
def test_processes_lightning_starts_itself_share_one_run_folder(workspace):
    # devices=2 without a launcher: Lightning re-runs the command for rank 1, which must not pick a
    # timestamp of its own (it gets rank 0's folder name through the environment).
    root = workspace / "lightning-ddp"
    args = launch_args(workspace, "ddp", 2, workspace / "probe-lightning-ddp", "--trainer.devices=2")
    args[args.index("--output-root") + 1] = str(root)
    env = launch_environment(workspace, 2, "unused")
    env.pop("RUN_NAME")
    result = subprocess.run([sys.executable, "-m", "training.train", "--recipe", "tiny", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    (run,) = (root / "tiny").iterdir()
    assert (run / "drafter" / "model.safetensors").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    probes = [json.loads(p.read_text()) for p in sorted((workspace / "probe-lightning-ddp").glob("rank*.json"))]
    assert [p["rank"] for p in probes] == [0, 1] and {p["strategy"] for p in probes} == {"DDPStrategy"}
    assert (result.stdout + result.stderr).count("[train] drafter written to") == 1


# ----------------------------------------------------------------------------- ZeRO-2 on CUDA (the GPU machine)

CUDA_DEEPSPEED = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("deepspeed") is None,
    reason="ZeRO-2 on CUDA needs a GPU and deepspeed (on the GPU machine: recipes/gpu_stage_deepspeed.sh here, "
           "then recipes/gpu_session.sh zero there)",
)
ON_GPU = "--trainer.accelerator=gpu"


@pytest.fixture(scope="module")
def zero2_on_cuda(workspace):
    """The tiny recipe, ZeRO-2 on the GPU over NCCL, 1 process x 4 sequences (the CPU runs' global batch), 4 steps.

    One process: NCCL refuses two ranks on one device, so the sharding itself is the CPU runs' to show; this shows
    the strategy the GPU recipes name (`zero2`, Lightning's CUDA checks and all) training, saving and resuming.
    """
    return launch(workspace, "zero2-cuda", 1, "zero2", 4, ON_GPU, cuda=True)


@CUDA_DEEPSPEED
def test_deepspeed_zero2_trains_on_cuda_and_its_checkpoint_consolidates_to_the_live_weights(zero2_on_cuda):
    run, (probe,) = zero2_on_cuda["dir"], zero2_on_cuda["probes"]
    assert probe["strategy"] == "DrafterDeepSpeed" and probe["world_size"] == 1, probe
    assert probe["target_devices"] == probe["drafter_devices"] == probe["optimizer_devices"] == ["cuda:0"], probe
    assert probe["target_dtypes"] == ["torch.bfloat16"] and probe["target_zero_params"] == 0, probe
    assert probe["target_in_module"] == 0 and probe["target_trainable"] == 0 and not probe["optimizer_holds_target"]
    assert probe["optimizer_numel"] >= probe["drafter_numel"], probe  # one rank holds every fp32 master weight

    losses = train_losses(run)
    assert sorted(losses) == list(range(STEPS)) and losses[STEPS - 1] < losses[0], losses
    last = run / "checkpoints" / "last.ckpt"
    assert [p.name for p in (last / "checkpoint").glob("*optim_states.pt")] == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    model_states = torch.load(last / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")
    assert model_states["global_step"] == STEPS and all(key.startswith("drafter.") for key in model_states["module"])
    assert not list(run.rglob(SAVING_MARKER))  # every save finished

    live = exported(run)  # gathered from the engine's fp32 master copy on the GPU
    assert {t.dtype for t in live.values()} == {torch.float32}
    merged = consolidated(last)
    assert set(merged) == set(live)
    for key in live:
        torch.testing.assert_close(merged[key], live[key], rtol=0, atol=SAME_MATH_ATOL, msg=key)
    earlier = consolidated(run / "checkpoints" / "step-2.ckpt")
    assert any(not torch.equal(earlier[k], live[k]) for k in live)


@CUDA_DEEPSPEED
def test_deepspeed_zero2_run_killed_on_cuda_resumes_to_the_uninterrupted_weights(workspace, zero2_on_cuda):
    run = "zero2-cuda-killed"
    run_dir = launch_killed(workspace, run, 1, "zero2", 4, ON_GPU, cuda=True)
    launch(workspace, run, 1, "zero2", 4, ON_GPU, "--resume", str(run_dir), cuda=True)
    straight = zero2_on_cuda["dir"]
    # The CPU runs resume bit for bit; on a GPU kernels may sum in another order from launch to launch, so the
    # resumed weights are held to the twins' bound (the message says how far they are; 0 is bit for bit). Anchors
    # or data drawn otherwise after the resume would be far outside it.
    assert_twins(exported(run_dir), exported(straight), consolidated(straight / "checkpoints" / "step-2.ckpt"),
                 "resumed vs uninterrupted on CUDA")
    resumed_loss, straight_loss = train_losses(run_dir)[STEPS - 1], train_losses(straight)[STEPS - 1]
    assert abs(resumed_loss - straight_loss) < 1e-3, (resumed_loss, straight_loss)


# ----------------------------------------------------------------------------- launch checks (fast, in-process)


def torchrun_env(monkeypatch, world: int, per_node: int) -> None:
    for name in SLURM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def slurm_env(monkeypatch, nodes: int, per_node: int, job: str = "4242") -> None:
    """A task's environment under srun (SLURM_STEP_NUM_TASKS is srun's: a batch script's own step has none)."""
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    values = dict(SLURM_NTASKS=nodes * per_node, SLURM_NNODES=nodes, SLURM_NTASKS_PER_NODE=per_node,
                  SLURM_JOB_NAME="ddtree", SLURM_JOB_ID=job, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NODEID=0,
                  SLURM_NODELIST="node1", SLURM_STEP_NUM_TASKS=nodes * per_node)
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def test_the_export_gathers_the_master_weights_on_the_ranks_device_where_lightning_left_them_on_the_cpu(monkeypatch):
    """Lightning's teardown moves the module to the CPU before train.py exports; DeepSpeed's gather all-reduces a buffer
    on each parameter's device, which NCCL refuses on the CPU (the zero2 CUDA run on an H200, 2026-12-04, failed so).
    The CPU runs' gloo takes either, so their end-to-end export cannot show it: here the rank's device is `meta`."""
    import training.strategies as strategies

    seen = {}

    def gather(drafter):  # full_fp32_state: a collective on the device the parameters are on
        seen["devices"] = {p.device.type for p in drafter.parameters()}
        return seen

    monkeypatch.setattr(strategies, "is_deepspeed", lambda strategy: True)
    monkeypatch.setattr(strategies, "full_fp32_state", gather)
    monkeypatch.setattr(strategies, "drafter_from_weights", lambda config, hparams, state: state)
    drafter = torch.nn.Linear(2, 2)  # on the CPU, as the teardown leaves it
    module = SimpleNamespace(drafter=drafter, hparams={},
                             base_drafter=lambda: SimpleNamespace(config=SimpleNamespace(to_dict=dict)))
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("meta")))
    assert strategies.drafter_for_export(module, trainer) is seen  # the export is built from what was gathered
    assert seen["devices"] == {"meta"}


@pytest.mark.parametrize("launcher", ["torchrun", "SLURM"])
def test_a_recipe_sized_for_other_hardware_stops_at_once_with_one_line(launcher, tmp_path, monkeypatch, capsys):
    if launcher == "torchrun":
        torchrun_env(monkeypatch, world=2, per_node=2)  # 2 processes; the tiny recipe says devices: 1
        argv = ["--recipe", "tiny", "--run-name", "r"]
    else:
        slurm_env(monkeypatch, nodes=2, per_node=8)  # 16 tasks; qwen3-8b says 8 devices on 1 node
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on its GPU nodes: the launch check is next
        argv = ["--recipe", "qwen3-8b"]
    started = time.perf_counter()
    assert training.train.main([*argv, "--output-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    if launcher == "torchrun":
        assert "trainer.devices=1 x trainer.num_nodes=1 = 1 processes, but torchrun started 2" in err[0]
        assert "--trainer.devices=2 --trainer.num_nodes=1" in err[0]
    else:
        assert "trainer.devices=8 x trainer.num_nodes=1 = 8 processes, but SLURM started 16" in err[0]
        assert "--trainer.devices=8 --trainer.num_nodes=2" in err[0]
    assert not any(tmp_path.rglob("*"))  # nothing written
    assert time.perf_counter() - started < 30  # before any model, data or process group


def test_each_deepspeed_strategy_name_configures_the_stage_and_offload_it_names(ds_cpu_accelerator):
    """docs/training.md offers zero2_offload and zero3_offload where the drafter's training does not fit the GPUs: a name
    that configured no offload would run out of memory (or train a run sized for offload without it), and an offloaded
    optimizer without zero_force_ds_cpu_optimizer=False stops every such launch at fit's start with DeepSpeed's
    ZeRORuntimeException about the module's own torch AdamW. Only the zero*_cpu ones train in this suite."""
    from lightning.pytorch.strategies import StrategyRegistry

    from training.strategies import STRATEGIES, CPUDeepSpeed, DrafterDeepSpeed

    # name -> (class, stage, offloads the optimizer state, offloads the parameters), as the name says
    named = {"zero2": (DrafterDeepSpeed, 2, False, False), "zero2_offload": (DrafterDeepSpeed, 2, True, False),
             "zero3": (DrafterDeepSpeed, 3, False, False), "zero3_offload": (DrafterDeepSpeed, 3, True, True),
             "zero2_cpu": (CPUDeepSpeed, 2, False, False), "zero3_cpu": (CPUDeepSpeed, 3, False, False)}
    assert set(STRATEGIES) == set(named)  # a new name is checked here too
    for name, (cls, stage, offload_optimizer, offload_parameters) in named.items():
        strategy = StrategyRegistry.get(name)
        zero = strategy.config["zero_optimization"]
        assert type(strategy) is cls and zero["stage"] == stage, (name, type(strategy), zero)
        assert (zero.get("offload_optimizer") or {}).get("device") == ("cpu" if offload_optimizer else None), (name, zero)
        assert (zero.get("offload_param") or {}).get("device") == ("cpu" if offload_parameters else None), (name, zero)
        if offload_optimizer:
            assert strategy.config.get("zero_force_ds_cpu_optimizer") is False, (name, strategy.config)


def test_a_cpu_deepspeed_process_lightning_started_itself_joins_the_group_as_its_own_rank(monkeypatch,
                                                                                         ds_cpu_accelerator):
    """Started by Lightning (devices=2, no launcher), a process learns its rank only from the strategy's own ranks:
    CPUDeepSpeed.setup_distributed replaces DeepSpeed's, and without them both processes joined as rank 0 of 1 and
    the run hung in init_process_group. (torchrun and SLURM say the rank through the environment instead.)"""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    for rank_holder in (rank_zero_only, utils_rank_zero_only):  # set_world_ranks sets it: back to 0 for later tests
        monkeypatch.setattr(rank_holder, "rank", rank_holder.rank)
    monkeypatch.setenv("LOCAL_RANK", "1")  # what Lightning gives the process it starts for the second device
    strategy = StrategyRegistry.get("zero2_cpu")
    strategy.cluster_environment = LightningEnvironment()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    joined = {}
    monkeypatch.setattr(strategy, "_init_deepspeed_distributed",
                        lambda: joined.update(rank=strategy.global_rank, world_size=strategy.world_size))
    strategy.setup_distributed()
    assert joined == {"rank": 1, "world_size": 2}


def test_launch_check_accepts_matching_counts_and_unlaunched_runs(monkeypatch):
    torchrun_env(monkeypatch, world=16, per_node=8)
    check_launch(8, 2)
    check_launch("auto", 1)  # Lightning takes every device; nothing to compare
    with pytest.raises(DDTreeError, match="= 8 processes, but torchrun started 16"):
        check_launch(8, 1)
    with pytest.raises(DDTreeError, match=r"^trainer.devices=0,1 x trainer.num_nodes=1 = 2 processes, but torchrun"):
        check_launch("0,1", 1)  # the recipe's value as written, not the count it makes: the line says what to change
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(DDTreeError, match=r"but the launcher started 16 \(WORLD_SIZE=16\): set trainer.devices"):
        check_launch(8, 1)  # another launcher: WORLD_SIZE alone
    for name in (*TORCHRUN_ENV, *NODE_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    check_launch(8, 1)  # no launcher, one node: Lightning starts the processes itself
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    check_launch(8, 4)  # a node started by hand, with Lightning's own node settings
    # "0," is Lightning's list of one GPU, 0: counted as 2, a correct one-process launch would be refused
    assert ([count_devices(d) for d in (2, "2", [0, 1, 2], "0,1", "0,", " 1, 2 ", "auto", -1)]
            == [2, 2, 3, 2, 1, 2, None, None])


def test_torchrun_under_slurm_is_checked_on_torchrun_s_world_as_lightning_runs_it(monkeypatch):
    """`srun torchrun ...`: one SLURM task per node, torchrun's processes in each. Lightning takes torchrun's
    environment before SLURM's and runs WORLD_SIZE processes; the check compared SLURM_NTASKS (the node count) and
    refused a launch that matched (8 x 2 = 16 processes, "but SLURM started 2")."""
    slurm_env(monkeypatch, nodes=2, per_node=1, job="900")  # (each helper clears the other launcher's variables)
    for name, value in dict(TORCHELASTIC_RUN_ID="test", RANK=0, GROUP_RANK=0, LOCAL_RANK=0, LOCAL_WORLD_SIZE=8,
                            WORLD_SIZE=16).items():
        monkeypatch.setenv(name, str(value))
    check_launch(8, 2)
    with pytest.raises(DDTreeError, match=r"= 8 processes, but torchrun started 16 \(WORLD_SIZE=16\) on 2 node"):
        check_launch(8, 1)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")  # torchrun run by the batch script itself: its world, not srun's
    check_launch(8, 2)
    assert training.train.run_name(None) == "slurm-900"  # every process of the job, on every node, names it so


def lsf_env(monkeypatch, tmp_path, size: int, rank: int = 0) -> None:
    """A process's environment under LSF's jsrun, as Lightning's LSFEnvironment detects it (one task per node)."""
    for name in (*TORCHRUN_ENV, *SLURM_ENV, *NODE_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch\n" + "".join(f"node{i + 1}\n" for i in range(size)))
    for name, value in dict(LSB_JOBID=1, LSB_DJOB_RANKFILE=rankfile, JSM_NAMESPACE_SIZE=size, JSM_NAMESPACE_RANK=rank,
                            JSM_NAMESPACE_LOCAL_RANK=0).items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_launch_by_lsf_or_mpirun_stops_at_once_with_one_line_naming_torchrun_and_srun(rank, tmp_path, monkeypatch,
                                                                                        capsys):
    """check_launch took LSF's jsrun and mpirun for launchers that start nodes, but is_first_process reads none of
    their rank variables: every rank took itself for rank 0, and all but one were refused at the run folder's lock."""
    from lightning.fabric.plugins.environments import LSFEnvironment, MPIEnvironment

    lsf_env(monkeypatch, tmp_path, size=2, rank=rank)
    assert LSFEnvironment.detect() and is_first_process()  # what the refusal is for: rank 1 too
    for devices, num_nodes in ((1, 2), (2, 1)):
        with pytest.raises(DDTreeError) as refused:
            check_launch(devices, num_nodes)
        assert str(refused.value) == (
            "LSF's jsrun (JSM_NAMESPACE_SIZE=2) started this process, a launcher training does not support (its ranks "
            "would all act as rank 0): start the run with torchrun (`make train RECIPE=<recipe> NODES=<n>` on each "
            "node, recipes/launch_torchrun.sh) or SLURM's srun (`sbatch recipes/slurm.sbatch <recipe>`), as "
            "docs/training.md, Scaling out, describes")
    assert "\n## Scaling out\n" in (REPO / "docs" / "training.md").read_text()  # the section the line names
    output = tmp_path / "outputs"
    with contextlib.ExitStack() as held:
        if rank == 1:  # rank 0 holds the run folder's lock: rank 1 said it was in use by another launch
            held.enter_context(training.train.hold_run_folder(output / "tiny" / "r"))
        assert training.train.main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(output)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: LSF's jsrun (JSM_NAMESPACE_SIZE=2) started this process"), err
    assert rank == 1 or not output.exists()  # refused before the run folder was taken (or made)

    monkeypatch.setenv("JSM_NAMESPACE_SIZE", "1")
    check_launch(1, 1)  # one process: its rank is 0, as is_first_process takes it
    for name in ("LSB_JOBID", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK"):
        monkeypatch.delenv(name)
    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(lambda: True))  # mpi4py under mpirun, world size 2
    with pytest.raises(DDTreeError, match=r"^mpirun \(Lightning's MPIEnvironment\) started this process, a launcher "
                                          "training does not support .* torchrun .* SLURM's srun"):
        check_launch(1, 2)
    torchrun_env(monkeypatch, world=2, per_node=1)  # Lightning takes torchrun first, as check_launcher does
    check_launch(1, 2)


def test_slurm_tasks_that_do_not_divide_across_nodes_are_told_to_change_the_launch(monkeypatch):
    """10 tasks on 3 nodes fit no trainer.devices, yet the line advised --trainer.devices=3 --trainer.num_nodes=3, the
    settings it had just refused, and called SLURM's task count WORLD_SIZE."""
    slurm_env(monkeypatch, nodes=3, per_node=3)
    monkeypatch.setenv("SLURM_NTASKS", "10")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "10")
    with pytest.raises(DDTreeError) as refused:
        check_launch(3, 3)
    assert str(refused.value) == (
        "trainer.devices=3 x trainer.num_nodes=3 = 9 processes, but SLURM started 10 (SLURM_NTASKS=10) on 3 node(s): "
        "10 processes do not split evenly across 3 nodes, as training needs: launch 3 processes on each of 3 node(s)")
    monkeypatch.setenv("SLURM_NTASKS", "12")  # 4 a node: the settings that fit are named
    with pytest.raises(DDTreeError, match=r"started 12 \(SLURM_NTASKS=12\) on 3 node\(s\): set --trainer.devices=4 "
                                          r"--trainer.num_nodes=3, or launch 3 processes on each of 3 node\(s\)$"):
        check_launch(3, 3)
    slurm_env(monkeypatch, nodes=2, per_node=5)  # 10 tasks split 5 a node, though not 4 (the recipe's) to a node
    with pytest.raises(DDTreeError, match=r"started 10 \(SLURM_NTASKS=10\) on 2 node\(s\): set --trainer.devices=5 "
                                          r"--trainer.num_nodes=2, or launch 4 processes on each of 2 node\(s\)$"):
        check_launch(4, 2)


def test_several_nodes_without_a_launcher_stop_at_once_with_one_line(tmp_path, monkeypatch, capsys):
    """Nothing to join: Lightning waited for the other node until the process group timed out (30 minutes)."""
    for name in (*TORCHRUN_ENV, *SLURM_ENV, *NODE_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DDTreeError, match=r"trainer.num_nodes=4 but no launcher started this process .* run `make "
                                          r"train RECIPE=<recipe> NODES=4` on each node .* recipes/slurm.sbatch"):
        check_launch(8, 4)
    with pytest.raises(DDTreeError, match="trainer.num_nodes=2 but no launcher"):
        check_launch(8, 2)  # checked here first: let through, the run below waits for its other node for 30 minutes
    argv = ["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), "--trainer.num_nodes=2"]
    assert training.train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "trainer.num_nodes=2 but no launcher" in err[0], err
    assert not any(tmp_path.rglob("*"))  # refused before anything was written


def test_only_the_launchs_rank_0_is_the_first_process_whichever_launcher_numbered_it(monkeypatch):
    """Rank 0 alone makes the run folder, prints the resume line and requeues a SLURM job: a rank that took itself for
    rank 0 did each again (srun numbers its tasks in SLURM_PROCID alone; Lightning's own processes in LOCAL_RANK and
    NODE_RANK)."""
    slurm_env(monkeypatch, nodes=2, per_node=8)
    assert is_first_process()
    monkeypatch.setenv("SLURM_PROCID", "9")  # srun's tenth task, on the second node
    assert not is_first_process()
    for name in (*SLURM_ENV, *TORCHRUN_ENV, *NODE_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    assert is_first_process()  # one process, no launcher
    for name in ("LOCAL_RANK", "NODE_RANK"):  # devices: 2 (Lightning starts LOCAL_RANK=1), or a node started by hand
        monkeypatch.setenv(name, "1")
        assert not is_first_process(), name
        monkeypatch.delenv(name)


def test_a_node_started_by_hand_with_any_one_of_lightnings_node_settings_is_launched(monkeypatch):
    """Lightning reads each of them alone (node 0 needs no MASTER_ADDR: it is the master, 127.0.0.1 by default), so a
    node started with NODE_RANK=0 alone is one of several and must not be refused as a run no launcher started."""
    for name in (*TORCHRUN_ENV, *SLURM_ENV, *NODE_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("NODE_RANK", "0"), ("MASTER_ADDR", "node0"), ("GROUP_RANK", "1")):
        monkeypatch.setenv(name, value)
        check_launch(8, 2)
        monkeypatch.delenv(name)
    with pytest.raises(DDTreeError, match="no launcher started this process"):
        check_launch(8, 2)


def test_several_slurm_tasks_without_srun_stop_at_once_with_one_line(tmp_path, monkeypatch, capsys):
    """Training run by the batch script itself (slurm.sbatch's --ntasks-per-node=8 header, no srun): Lightning took
    SLURM_NTASKS for the processes started, and rank 0 waited for peers no one started until the group timed out."""
    slurm_env(monkeypatch, nodes=1, per_node=2)
    check_launch(2, 1)  # under srun
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")  # the batch step
    with pytest.raises(DDTreeError, match=r"SLURM_NTASKS=2 but no srun .* recipes/slurm.sbatch"):
        check_launch(2, 1)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    check_launch(1, 1)  # one task: the batch step is the whole launch
    monkeypatch.setenv("SLURM_NTASKS", "2")
    argv = ["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), "--trainer.devices=2",
            "--trainer.strategy=ddp"]
    assert training.train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no srun" in err[0], err
    assert not any(tmp_path.rglob("*"))  # refused before anything was written


def test_every_process_of_a_launch_gets_the_same_run_folder(monkeypatch):
    slurm_env(monkeypatch, nodes=2, per_node=8, job="777")
    assert training.train.run_name(None) == "slurm-777"  # the job id survives a requeue
    assert training.train.run_name("mine") == "mine"
    # each task of a job array is a run of its own (one folder would refuse the second task: "in use", then "already
    # holds a run"), named by the array's job id, which its requeue keeps, and the task's index
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "500")
    for task, job in (("1", "501"), ("2", "502")):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
        monkeypatch.setenv("SLURM_JOB_ID", job)  # each task's own
        assert training.train.run_name(None) == f"slurm-500-{task}"
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name)
    for name in SLURM_ENV:
        monkeypatch.delenv(name)
    torchrun_env(monkeypatch, world=2, per_node=2)
    with pytest.raises(DDTreeError, match="same --run-name on every node"):
        training.train.run_name(None)  # each process would pick its own timestamp
    monkeypatch.setenv(training.train.RUN_NAME_ENV, "20250101-000000")  # handed to Lightning's own processes
    assert training.train.run_name(None) == "20250101-000000"


def test_a_stopped_runs_resume_line_launches_as_the_run_was_launched(monkeypatch, tmp_path):
    run_dir, checkpoint = tmp_path / "out" / "qwen3-8b" / "r1", tmp_path / "out" / "qwen3-8b" / "r1" / "last.ckpt"
    torchrun_env(monkeypatch, world=16, per_node=8)  # it said `make train RECIPE=... RESUME=...`: one process
    assert training.train.resume_command(run_dir, "qwen3-8b", checkpoint) == (
        f"GPUS_PER_NODE=8 make train RECIPE=qwen3-8b NODES=2 RESUME={checkpoint} on each node (NODE_RANK and MASTER_ADDR "
        "as before)")
    slurm_env(monkeypatch, nodes=2, per_node=4)  # submitted with --ntasks-per-node=4: not slurm.sbatch's own 8
    assert training.train.resume_command(run_dir, "qwen3-8b", checkpoint) == (
        f"RUN_NAME=r1 OUTPUT_ROOT={tmp_path / 'out'} sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 "
        "recipes/slurm.sbatch qwen3-8b")
    for name in SLURM_ENV:
        monkeypatch.delenv(name)
    assert training.train.resume_command(run_dir, "qwen3-8b", checkpoint) == f"make train RECIPE=qwen3-8b RESUME={checkpoint}"


def test_the_commands_a_run_prints_keep_paths_with_spaces_whole(monkeypatch, tmp_path):
    """They printed RESUME=/out/tiny/e f/...: the shell ran `make train ... RESUME=/out/tiny/e` and a target `f/...`."""
    run_dir = tmp_path / "my out" / "tiny" / "e f"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"

    def value(command: str, variable: str) -> str:
        return next(word.split("=", 1)[1] for word in shlex.split(command) if word.startswith(f"{variable}="))

    torchrun_env(monkeypatch, world=4, per_node=2)
    assert value(training.train.resume_command(run_dir, "tiny", checkpoint), "RESUME") == str(checkpoint)
    slurm_env(monkeypatch, nodes=2, per_node=4)
    submitted = training.train.resume_command(run_dir, "tiny", checkpoint)
    assert value(submitted, "RUN_NAME") == "e f" and value(submitted, "OUTPUT_ROOT") == str(tmp_path / "my out")
    monkeypatch.setattr(training.train, "newest_finite_checkpoint", lambda run: checkpoint)
    ckpt, make_train = training.train.finite_checkpoint_line(run_dir).split("take it: ", 1)[1].split("; ")
    assert value(ckpt, "CKPT") == str(checkpoint) and value(make_train, "RESUME") == str(checkpoint)
    for name in SLURM_ENV:
        monkeypatch.delenv(name)
    assert value(training.train.resume_command(run_dir, "tiny", checkpoint), "RESUME") == str(checkpoint)


# ----------------------------------------------------------------------------- launch scripts


def test_make_train_nodes_prints_each_nodes_launch(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RUN_NAME", "GPUS_PER_NODE")}
    # under `make test` the parent make's MAKELEVEL/MAKEFLAGS would add "Entering/Leaving directory" lines
    make_env = {k: v for k, v in env.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    planned = subprocess.run(["make", "-n", "--no-print-directory", "train", "RECIPE=qwen3-8b", "NODES=2"], cwd=REPO, env=make_env,
                             capture_output=True, text=True)
    assert "recipes/launch_torchrun.sh 'qwen3-8b' '2'" in planned.stdout.splitlines()[-1]
    printed = subprocess.run(["bash", str(LAUNCHER), "qwen3-8b", "2"], cwd=REPO, env=env, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    assert "2 nodes x 8 processes = 16 processes" in printed.stdout  # qwen3-8b's trainer.devices: 8
    assert "NODE_RANK=<i> make train RECIPE=qwen3-8b NODES=2" in printed.stdout
    assert "sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 recipes/slurm.sbatch qwen3-8b" in printed.stdout

    # with the per-node settings it runs torchrun, telling the trainer the counts torchrun uses
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/usr/bin/env bash\necho \"$@\"\n")
    fake_python.chmod(0o755)
    node_env = env | {"PYTHON": str(fake_python), "GPUS_PER_NODE": "8", "MASTER_ADDR": "node0", "NODE_RANK": "1",
                      "RUN_NAME": "r1"}
    ran = subprocess.run(["bash", str(LAUNCHER), "qwen3-8b", "2", "--trainer.max_steps=3"], cwd=REPO, env=node_env,
                         capture_output=True, text=True)
    assert ran.stdout.split() == [
        "-m", "training.launch", "--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1",
        "--master-addr", "node0", "--master-port", "29500", "-m", "training.train", "--recipe", "qwen3-8b",
        "--run-name", "r1", "--trainer.num_nodes=2", "--trainer.devices=8", "--trainer.max_steps=3",
    ]
    bad = subprocess.run(["bash", str(LAUNCHER), "nope", "2"], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "nope" in bad.stderr


def make_plan(*variables: str, env: dict | None = None) -> str:
    """The command `make -n` would run for these variables (the last line it prints)."""
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "RECIPE")}
    planned = subprocess.run(["make", "-n", "--no-print-directory", *variables], cwd=REPO, env=make_env | (env or {}),
                             capture_output=True, text=True)
    assert planned.returncode == 0, planned.stderr
    return planned.stdout.strip().splitlines()[-1]


def test_make_resumes_a_run_of_any_recipe_and_keeps_paths_with_spaces_whole():
    """RECIPE's default named smollm2-135m for every resume, which training refuses for another recipe's run; and
    unquoted paths split at their spaces."""
    assert "--recipe" not in make_plan("train", "RESUME=outputs/tiny/run 1")  # the run's own recipe
    assert "--recipe 'tiny' --resume 'outputs/tiny/run 1'" in make_plan("train", "RECIPE=tiny", "RESUME=outputs/tiny/run 1")
    assert "--recipe 'tiny' --resume 'x'" in make_plan("train", "RESUME=x", env={"RECIPE": "tiny"})  # given, as a variable
    assert "--recipe 'smollm2-135m'" in make_plan("train")  # a new run: the default recipe
    assert "--ckpt 'best' --run 'outputs/tiny/my run'" in make_plan("eval", "RUN=outputs/tiny/my run")
    assert "--out '/tmp/a b'" in make_plan("features", "OUT=/tmp/a b")
    # NODES one word too: `NODES="2 --x"` gave the launcher NODES=2 and passed --x to training
    assert "launch_torchrun.sh 'smollm2-135m' '2 --x'" in make_plan("train", "NODES=2 --x")


def test_make_keeps_values_with_an_apostrophe_whole():
    """Each value was wrapped in '...', so one holding a ' ended the quote: the shell split the value or refused the
    line (`Unterminated quoted string`), and the launcher's own plan prints such paths as RESUME='...'\\''...'."""
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "RECIPE")}
    path = "/tmp/it's run"

    def words(*variables: str) -> list[str]:
        planned = subprocess.run(["make", "-n", "--no-print-directory", *variables], cwd=REPO, env=make_env,
                                 capture_output=True, text=True)
        assert planned.returncode == 0 and not planned.stderr, planned
        return shlex.split(planned.stdout.replace("\\\n", " ").strip().splitlines()[-1])  # (export's recipe: 3 lines)

    def after(option: str, line: list[str]) -> str:
        return line[line.index(option) + 1]

    assert after("--resume", words("train", f"RESUME={path}")) == path
    assert after("--resume", words("train", "NODES=2", f"RESUME={path}")) == path  # also read by the run's recipe
    assert after("--recipe", words("train", "RECIPE=it's")) == "it's"
    assert after("--run", words("eval", f"RUN={path}")) == path
    assert after("--ckpt", words("eval", f"CKPT={path}/x.ckpt")) == f"{path}/x.ckpt"
    assert after("--out", words("features", f"OUT={path}")) == path
    exported = words("export", f"RUN={path}", f"OUT={path} out", f"CKPT={path}/best.ckpt")
    assert path in exported and after("--out", exported) == f"{path} out" and after("--ckpt", exported) == f"{path}/best.ckpt"


def test_a_multi_node_resume_launches_the_runs_own_recipe(tmp_path):
    """With NODES the default recipe went to launch_torchrun.sh (its processes per node, and a --recipe training
    refuses for another recipe's run)."""
    run = tmp_path / "outputs" / "qwen3-8b" / "run 1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    launched = lambda *variables: make_plan("train", "NODES=2", *variables)  # noqa: E731
    assert f"launch_torchrun.sh 'qwen3-8b' '2' --resume '{run}'" in launched(f"RESUME={run}")
    assert "launch_torchrun.sh 'qwen3-8b' '2'" in launched(f"RESUME={run}/")
    assert "launch_torchrun.sh 'qwen3-8b' '2'" in launched(f"RESUME={run / 'checkpoints' / 'last.ckpt'}")
    # a DeepSpeed checkpoint, a folder
    assert "launch_torchrun.sh 'qwen3-8b' '2'" in launched(f"RESUME={run / 'checkpoints' / 'last.ckpt'}/")
    assert "launch_torchrun.sh 'qwen3-8b' '2'" in launched(f"RESUME={run / 'hpc_ckpt_3.ckpt'}")
    assert "launch_torchrun.sh 'tiny' '2'" in launched("RECIPE=tiny", f"RESUME={run}")  # given: as given
    # the default recipe's newest run
    assert "launch_torchrun.sh 'smollm2-135m' '2' --resume 'last'" in launched("RESUME=last")
    assert "launch_torchrun.sh 'smollm2-135m' '2'" in launched()


def test_a_multi_node_resume_from_home_or_outside_a_recipe_folder_is_the_runs_recipe_or_asks_for_it(tmp_path):
    """The recipe make read off the run's folder: a RESUME=~/... the shell left as it is was not found, so the default
    recipe launched another recipe's run; and a run moved out of outputs/<recipe>/ launched the folder above it as a
    recipe ("unknown recipe 'runs'") where training itself asks for --recipe."""
    home = {"HOME": str(tmp_path), "DDTREE_CACHE": str(cache_dir())}
    run = tmp_path / "outputs" / "qwen3-8b" / "run 1"
    moved = tmp_path / "runs" / "run 2"
    for folder in (run, moved):
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "config.yaml").write_text("model: {}\n")
    assert "launch_torchrun.sh 'qwen3-8b' '2'" in make_plan("train", "NODES=2", "RESUME=~/outputs/qwen3-8b/run 1/",
                                                            env=home)
    assert "launch_torchrun.sh 'tiny' '2'" in make_plan("train", "NODES=2", "RECIPE=tiny", f"RESUME={moved}")
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "RECIPE")}
    refused = subprocess.run(["make", "-n", "--no-print-directory", "train", "NODES=2", f"RESUME={moved}"], cwd=REPO,
                             env=make_env, capture_output=True, text=True)
    assert refused.returncode != 0 and "launch_torchrun" not in refused.stdout, refused
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and f"RESUME={moved}: the run is not in a <recipe>/ folder" in lines[0], lines
    assert "give its recipe as RECIPE=<name>" in lines[0]


def test_make_help_prints_every_line_of_each_targets_comment():
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, env=make_env, capture_output=True, text=True).stdout
    for variable in ("OVERWRITE=1", "REPLACE_REPO=1", "BASE_MODEL=", "HF_TOKEN", "NODES=n: this node's share"):
        assert variable in shown, variable


def test_the_printed_plan_keeps_the_launchs_arguments_and_gpus_per_node(tmp_path):
    """The plan dropped them: its commands trained the recipe's defaults on the recipe's GPU count."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RUN_NAME", "GPUS_PER_NODE")} | {
        "PYTHON": sys.executable}
    extra = ["--trainer.max_steps=3", "--run-name", "it's mine", "--output-root=/tmp/o"]
    plan = subprocess.run(["bash", str(LAUNCHER), "qwen3-8b", "2", *extra], cwd=REPO, env=env | {"GPUS_PER_NODE": "4"},
                          capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    make_line, sbatch_line = plan.stdout.splitlines()[2], plan.stdout.splitlines()[4]
    assert make_line.strip().startswith("MASTER_ADDR=<node 0> MASTER_PORT=29500 GPUS_PER_NODE=4 "  # ARGS name the run
                                        "NODE_RANK=<i> make train RECIPE=qwen3-8b NODES=2 ARGS=")
    # make hands ARGS to the shell: the words come back as given, quotes and all
    args = shlex.split(shlex.split(make_line.split(" ARGS=", 1)[1])[0])
    assert args == extra
    # slurm.sbatch takes the run folder from RUN_NAME and OUTPUT_ROOT, where its requeue looks for it: given as
    # --run-name, a requeued job started over under slurm-<job id> and then was refused the user's folder
    assert shlex.split(sbatch_line) == ["RUN_NAME=it's mine", "OUTPUT_ROOT=/tmp/o", "sbatch", "--nodes=2",
                                        "--ntasks-per-node=4", "--gpus-per-node=4", "recipes/slurm.sbatch", "qwen3-8b",
                                        "--trainer.max_steps=3"]
    # A resume's SLURM line names the run folder: without it slurm.sbatch started a new run from step 0
    run = tmp_path / "outputs" / "qwen3-8b" / "run 7"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    for resume in (run, run / "checkpoints" / "step-4.ckpt"):
        resumed = subprocess.run(["bash", str(LAUNCHER), "qwen3-8b", "2", "--resume", str(resume)], cwd=REPO,
                                 env=env | {"GPUS_PER_NODE": "4"}, capture_output=True, text=True)
        sbatch_line = resumed.stdout.splitlines()[4]
        assert shlex.split(sbatch_line)[:3] == ["RUN_NAME=run 7", f"OUTPUT_ROOT={tmp_path / 'outputs'}", "sbatch"], resume
    assert "may be later than" in resumed.stdout  # a checkpoint named: the folder's newest is what slurm.sbatch takes
    regenerate = subprocess.run(["bash", str(LAUNCHER), "--regenerate", "2", "--out", "x y"], cwd=REPO,
                                env=env | {"GPUS_PER_NODE": "2"}, capture_output=True, text=True)
    assert "    GPUS_PER_NODE=2 NODE_RANK=<i> recipes/launch_torchrun.sh --regenerate 2 --out 'x y'" in regenerate.stdout
    assert "recipes/slurm.sbatch --regenerate --out 'x y'" in regenerate.stdout


def printing_launcher_env(tmp_path: Path) -> dict[str, str]:
    """The launcher's environment with no inherited launch settings and a stand-in for python that reads YAML as python
    does and prints what torchrun would be given."""
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/usr/bin/env bash\n[ \"$1\" != -c ] || exec {shlex.quote(sys.executable)} \"$@\"\n"
                           "echo \"$@\"\n")
    fake_python.chmod(0o755)
    return {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RUN_NAME", "GPUS_PER_NODE", *SLURM_ENV)} | {
        "PYTHON": str(fake_python)}


def test_a_resume_through_the_launcher_keeps_the_runs_processes_per_node(tmp_path):
    """The launcher took the recipe's trainer.devices: a run trained on 2 processes per node resumed on 1, and stopped
    only once model and data were built (its train loader had been split over 2 ranks)."""
    run = tmp_path / "outputs" / "tiny" / "run 2"  # the tiny recipe says devices: 1
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  devices: '2'\n  num_nodes: 1\n")
    env = printing_launcher_env(tmp_path)

    def launched(nodes: str, *args: str, **settings: str) -> str:
        result = subprocess.run(["bash", str(LAUNCHER), "tiny", nodes, *args], cwd=REPO, env=env | settings,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result.stdout

    for resume in (str(run), f"{run}/", str(run / "checkpoints" / "last.ckpt"), str(run / "hpc_ckpt_1.ckpt")):
        assert "--nproc-per-node 2 " in launched("1", "--resume", resume), resume
        assert "--trainer.devices=2" in launched("1", f"--resume={resume}"), resume
        plan = launched("2", "--resume", resume)  # the plan's counts and its SLURM line's tasks per node
        assert "trainer.devices=2)" in plan and "--ntasks-per-node=2 --gpus-per-node=2" in plan, resume
    assert "--nproc-per-node 1 " in launched("1", "--resume", str(run), GPUS_PER_NODE="1")  # given: as given
    assert "--nproc-per-node 1 " in launched("1")  # a new run: the recipe's
    assert "--nproc-per-node 1 " in launched("1", "--resume", "last")  # only training.train finds that run
    # under the home folder, ~ unexpanded (quoted, or in make's RESUME): the recipe's count was taken
    assert "--nproc-per-node 2 " in launched("1", "--resume", "~/outputs/tiny/run 2", HOME=str(tmp_path))


def test_the_launcher_takes_the_processes_per_node_and_run_name_the_training_options_give(tmp_path):
    """ARGS="--trainer.devices=4" planned and started the recipe's 8 processes per node (training then stopped on the
    count), and a --run-name among them still stopped a node's launch with "RUN_NAME not set"."""
    env = printing_launcher_env(tmp_path)

    def launched(recipe: str, nodes: str, *args: str, **settings: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(LAUNCHER), recipe, nodes, *args], cwd=REPO, env=env | settings,
                              capture_output=True, text=True)

    for devices in (["--trainer.devices=4"], ["--trainer.devices", "4"]):
        plan = launched("qwen3-8b", "2", *devices)  # the recipe says 8
        assert plan.returncode == 0 and "trainer.devices=4)" in plan.stdout, plan
        sbatch_line = shlex.split(plan.stdout.splitlines()[4])
        assert sbatch_line[2:4] == ["--ntasks-per-node=4", "--gpus-per-node=4"] and sbatch_line[-len(devices):] == devices
        started = launched("tiny", "1", *devices)  # the recipe says 1
        assert started.returncode == 0 and "--nproc-per-node 4 " in started.stdout, started
    assert "--nproc-per-node 4 " in launched("tiny", "1", "--trainer.devices=4", GPUS_PER_NODE="4").stdout  # the same
    node = {"MASTER_ADDR": "node0", "NODE_RANK": "1"}
    for named in (["--run-name", "try 1"], ["--run=try 1"]):
        started = launched("tiny", "2", *named, **node)
        assert started.returncode == 0, started
        assert started.stdout.count("--run") == 1 and started.stdout.rstrip().endswith(" ".join(named)), started
        plan = launched("tiny", "2", *named)
        assert plan.returncode == 0 and "RUN_NAME=<name>" not in plan.stdout.splitlines()[2], plan
        assert shlex.split(plan.stdout.splitlines()[4])[0] == "RUN_NAME=try 1"
    for args, settings, said in [
        (["--trainer.devices=4"], {"GPUS_PER_NODE": "8"},
         "error: GPUS_PER_NODE=8 but the training options give --trainer.devices 4: drop one of them or give the same "
         "value"),
        (["--run-name", "b"], {"RUN_NAME": "a"},
         "error: RUN_NAME=a but the training options give --run-name b: drop one of them or give the same value"),
        (["--trainer.devices=auto"], {}, "--trainer.devices in the training options, else trainer.devices in "
                                         "recipes/tiny.yaml) must be a positive integer, got 'auto'"),
    ]:
        refused = launched("tiny", "1", *args, **settings)
        assert refused.returncode == 2 and not refused.stdout, refused
        assert len(refused.stderr.splitlines()) == 1 and said in refused.stderr, refused


def test_node_settings_that_cannot_make_a_launch_are_one_line(tmp_path):
    fake_python = tmp_path / "python"  # prints what torchrun would be given, and what the trainer would see of SLURM
    fake_python.write_text("#!/usr/bin/env bash\necho \"SLURM_NTASKS=${SLURM_NTASKS-unset} $*\"\n")
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RUN_NAME", *SLURM_ENV)} | {
        "PYTHON": str(fake_python), "GPUS_PER_NODE": "2"}
    node = {"MASTER_ADDR": "node0", "RUN_NAME": "r"}

    def launched(nodes: str, *args: str, **settings: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(LAUNCHER), "tiny", nodes, *args], cwd=REPO, env=env | settings,
                              capture_output=True, text=True)

    for nodes, settings, said in [
        ("08", {}, "NODES must be a positive integer, got '08'"),  # bash read 08 as bad octal, 010 as 8
        ("2", node | {"NODE_RANK": "2"}, "NODE_RANK must be this node's index, 0..1 for NODES=2, got '2'"),  # hung
        ("2", node | {"NODE_RANK": "01"}, "got '01'"),
        ("2", {"NODE_RANK": "1"}, "needs NODE_RANK MASTER_ADDR RUN_NAME on every node; MASTER_ADDR RUN_NAME not set"),
        ("2", node | {"NODE_RANK": "99999999999999999999"}, "got '99999999999999999999'"),  # past bash's integers
        # torchrun printed its 30-line usage for a word
        ("2", node | {"NODE_RANK": "0", "MASTER_PORT": "abc"}, "MASTER_PORT must be a port number, 1-65535, got 'abc'"),
        ("2", node | {"NODE_RANK": "0", "MASTER_PORT": "65536"}, "got '65536'"),
        ("1", {"MASTER_ADDR": "node0", "MASTER_PORT": "0"}, "got '0'"),
    ]:
        result = launched(nodes, **settings)
        assert result.returncode == 2 and said in result.stderr, result
        assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout, result
    # A resume names its run: RUN_NAME is not needed, and not passed. Inside a SLURM allocation the processes are
    # torchrun's, not SLURM's tasks.
    resumed = launched("2", "--resume", "outputs/tiny/r", MASTER_ADDR="node0", NODE_RANK="1", SLURM_NTASKS="16")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith("SLURM_NTASKS=unset -m training.launch") and "--run-name" not in resumed.stdout
    plan = launched("2", "--resume=outputs/tiny/r")  # the plan for a resume resumes, and asks for no RUN_NAME
    assert plan.returncode == 0 and "NODE_RANK=<i> make train RECIPE=tiny NODES=2 RESUME=outputs/tiny/r" in plan.stdout
    make_line = next(line for line in plan.stdout.splitlines() if "make train" in line)
    assert "RUN_NAME" not in make_line  # (slurm.sbatch's line names the run folder it resumes: RUN_NAME)


def argv_printer(path: Path, first_line: str = "") -> Path:
    """A stand-in for python that prints each argument on a line of its own (after first_line, a shell word): the
    stand-ins above print them joined by spaces, where an argument split at its spaces reads the same."""
    path.write_text(f"#!/usr/bin/env bash\n{first_line}\nprintf '%s\\n' \"$@\"\n")
    path.chmod(0o755)
    return path


def test_a_nodes_launch_hands_torchrun_its_settings_and_each_argument_whole(tmp_path):
    """A run name or path with a space reached training as two words, the node's MASTER_PORT was not the one torchrun
    met on, and `--run <name>` (training.train's other spelling of --run-name) did not name the run for the launcher."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RUN_NAME", "CUDA_VISIBLE_DEVICES", *SLURM_ENV)} | {
        "PYTHON": str(argv_printer(tmp_path / "python")), "GPUS_PER_NODE": "2"}
    node = {"MASTER_ADDR": "node0", "MASTER_PORT": "29611", "NODE_RANK": "1"}
    started = subprocess.run(["bash", str(LAUNCHER), "tiny", "2", "--run", "try 1", "--output-root", "/tmp/my out"],
                             cwd=REPO, env=env | node, capture_output=True, text=True)
    assert started.returncode == 0, started
    assert started.stdout.splitlines() == [
        "-m", "training.launch", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--master-addr", "node0",
        "--master-port", "29611", "-m", "training.train", "--recipe", "tiny", "--trainer.num_nodes=2",
        "--trainer.devices=2", "--run", "try 1", "--output-root", "/tmp/my out"]
    regenerated = subprocess.run(["bash", str(LAUNCHER), "--regenerate", "1", "--out", "my data/x.jsonl"], cwd=REPO,
                                 env=env | {"GPUS_PER_NODE": "1"}, capture_output=True, text=True)
    assert regenerated.returncode == 0, regenerated
    assert regenerated.stdout.splitlines() == [
        "data/regenerate.py", "--shard-index", "0", "--num-shards", "1", "--out", "my data/x.jsonl"]


def test_a_launch_through_torchrun_ends_with_its_processes_status_not_a_traceback():
    """The process's bad input is an empty --output-root, which training.train refuses before Lightning loads: the
    same status 2 through torchrun as a bad recipe override (test_recipes refuses those in one line), ~5 s, not ~15 s
    of the process's imports (on a 2-core AVX2 EPYC). The launcher passes --output-root through untouched."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RUN_NAME", *SLURM_ENV)} | {
        "PYTHON": sys.executable, "GPUS_PER_NODE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", str(LAUNCHER), "tiny", "1", "--output-root="],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]  # bad input's status; torchrun's own was 1
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        next(line for line in result.stderr.splitlines() if "--output-root" in line)]
    assert exit_status(-signal.SIGTERM) == 143 and exit_status(2) == 2  # a process killed by a signal, as a shell says


def test_a_master_port_in_use_is_one_line_naming_it():
    """torchrun's rendezvous failed with a 39-line DistNetworkError traceback and exit status 1."""
    import socket

    with socket.socket() as taken:  # another job's rendezvous, say
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "training.launch", "--nnodes", "1", "--nproc-per-node", "1",
                                 "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                 "-m", "training.train", "--recipe", "tiny"], cwd=REPO, capture_output=True, text=True,
                                timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: torchrun could not meet the other nodes at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port}: "), result.stderr
    assert "address already in use" in errors[0] and "give another MASTER_PORT" in errors[0]


def test_another_node_that_never_joins_is_one_line_naming_the_endpoint(monkeypatch, capsys):
    """Node 0's rendezvous timed out (DistStoreError, not the port-in-use DistNetworkError above) with a traceback."""
    import training.launch
    from torch.distributed import DistStoreError

    def never_joined(args):
        raise DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setattr(training.launch, "run", never_joined)
    assert training.launch.main(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "0", "--master-addr",
                                 "127.0.0.1", "--master-port", "29733", "-m", "training.train", "--recipe", "tiny"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("error: torchrun could not meet the other nodes at MASTER_ADDR:MASTER_PORT 127.0.0.1:29733: "
                            "Timed out after 6 seconds waiting for clients. 1/2 clients joined.; give another MASTER_PORT")


def test_a_signal_to_the_launch_ends_it_with_128_plus_its_number_in_one_line(monkeypatch, capsys):
    """torchrun ended a scheduler's SIGTERM in a SignalException traceback with exit status 1, which a job script
    could not tell from a crash."""
    import training.launch
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(args):
        raise SignalException(f"Process {os.getpid()} got signal: {signal.SIGTERM}", sigval=signal.SIGTERM)

    monkeypatch.setattr(training.launch, "run", stopped)
    assert training.launch.main(["--nnodes", "1", "--nproc-per-node", "1", "--standalone", "-m", "training.train",
                                 "--recipe", "tiny"]) == 143
    assert capsys.readouterr().err.strip().splitlines() == ["[launch] stopped by SIGTERM"]


def test_the_launch_reports_the_process_that_failed_not_those_torchrun_stopped():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    # rank 1 failed; torchrun stopped rank 0 with SIGTERM in the same second, and recorded it first
    stopped, failed = (ProcessFailure(local_rank=r, pid=100 + r, exitcode=code, error_file="<none>")
                       for r, code in ((0, -signal.SIGTERM), (1, 3)))
    stopped.timestamp = failed.timestamp
    rank, failure = first_failure(ChildFailedError("training.train", {0: stopped, 1: failed}))
    assert (rank, exit_status(failure.exitcode)) == (1, 3)
    rank, failure = first_failure(ChildFailedError("training.train", {0: stopped}))  # SIGTERM from outside: all there is
    assert (rank, exit_status(failure.exitcode)) == (0, 143)
    # two failed on their own: the first to fail is reported, with its own exit status, not the last
    later = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file="<none>")
    failed.timestamp, later.timestamp = 100, 160  # the higher rank first, so that the dict's order decides nothing
    rank, failure = first_failure(ChildFailedError("training.train", {0: later, 1: failed}))
    assert (rank, exit_status(failure.exitcode)) == (1, 3)


def test_a_failed_multi_node_launch_says_in_one_line_which_rank_failed_and_exits_with_its_status(monkeypatch, capsys):
    """The line names the failed process's global rank, not its number on its node (rank 9, process 1 of node 1, read
    as rank 1, a process of node 0), and the status is the process's as a shell gives it: a job script sees the OOM killer's SIGKILL."""
    import training.launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    # node 1 of 2 nodes of 8: its process 1 is rank 9, killed; torchrun then stopped its process 0, rank 8
    killed, stopped = (ProcessFailure(local_rank=local, pid=100 + local, exitcode=code, error_file="<none>")
                       for local, code in ((1, -signal.SIGKILL), (0, -signal.SIGTERM)))

    def failed(args):
        raise ChildFailedError("training.train", {8: stopped, 9: killed})

    monkeypatch.setattr(training.launch, "run", failed)
    assert training.launch.main(["--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1", "--master-addr",
                                 "127.0.0.1", "--master-port", "29733", "-m", "training.train", "--recipe", "tiny"]) == 137
    assert capsys.readouterr().err.strip().splitlines() == [
        "[launch] rank 9 failed first, with exit status 137; its own lines above say why"]


def test_slurm_script_passes_its_task_counts_and_resumes_a_requeued_job(tmp_path):
    header = [line.split()[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    per_node = next(int(h.split("=")[1]) for h in header if h.startswith("--ntasks-per-node="))
    assert f"--gpus-per-node={per_node}" in header  # one task per GPU
    assert any(h.startswith("--signal=SIGUSR1@") for h in header) and "--requeue" in header
    import yaml

    assert yaml.safe_load((REPO / "recipes" / "qwen3-8b.yaml").read_text())["trainer"]["devices"] == per_node

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/usr/bin/env bash\necho \"srun $*\"\n")
    (fake_bin / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {
        "PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "31",
        "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "OUTPUT_ROOT": str(tmp_path / "out"),
    }

    def submitted(*args, **extra) -> list[str]:
        result = subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, env=env | extra, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1].split()

    first = submitted("qwen3-8b")
    assert first[:3] == ["srun", "--kill-on-bad-exit=1", ".venv/bin/python"]
    assert "--trainer.num_nodes=2" in first and "--trainer.devices=8" in first
    assert first[first.index("--run-name") + 1] == "slurm-31"
    run = tmp_path / "out" / "qwen3-8b" / "slurm-31"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "hpc_ckpt_1.ckpt").write_text("")  # what Lightning saved on SIGUSR1
    requeued = submitted("qwen3-8b", SLURM_RESTART_COUNT="1")
    assert requeued[requeued.index("--resume") + 1] == str(run) and "--run-name" not in requeued
    # Requeued before its first checkpoint, even twice: the same folder, which training.train starts again in place
    # (a second requeue started a third folder, dropping the first restart's progress).
    (run / "hpc_ckpt_1.ckpt").unlink()
    for restart in ("1", "2"):
        again = submitted("qwen3-8b", SLURM_RESTART_COUNT=restart)
        assert again[again.index("--run-name") + 1] == "slurm-31" and "--resume" not in again
    (run / "checkpoints" / "step-200.ckpt").write_text("")  # checkpoint.save_last false: its step checkpoints only
    stepped = submitted("qwen3-8b", SLURM_RESTART_COUNT="3")
    assert stepped[stepped.index("--resume") + 1] == str(run) and "--run-name" not in stepped

    # The run folder is slurm.sbatch's to choose: a --run-name after the recipe made a requeue start over, refused
    for given in (["--run-name", "mine"], ["--run=mine"], ["--output-root", "o"], ["--resume", str(run)]):
        refused = subprocess.run(["bash", str(SBATCH), "qwen3-8b", "--trainer.max_steps=3", *given], cwd=tmp_path,
                                 env=env, capture_output=True, text=True)
        assert refused.returncode == 2 and not refused.stdout, refused
        assert len(refused.stderr.splitlines()) == 1 and "RUN_NAME=<name> OUTPUT_ROOT=<folder>" in refused.stderr, refused

    regenerate = subprocess.run(["bash", str(SBATCH), "--regenerate", "--out", "x"], cwd=tmp_path, env=env,
                                capture_output=True, text=True).stdout
    assert '--shard-index "$SLURM_PROCID" --num-shards "$SLURM_NTASKS"' in regenerate


def test_slurm_script_trains_in_the_run_folder_its_environment_names_and_passes_each_argument_whole(tmp_path):
    """A run is resumed under SLURM as `RUN_NAME=<name> OUTPUT_ROOT=<folder> sbatch ...` (the launcher's plan and a
    stopped run's last line print it): a job that took slurm-<job id> or outputs/ instead started that run over.
    Here srun runs its one task in place, as task 5 of 8 with local id 1 on a node whose share is GPUs 2 and 3."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text('#!/usr/bin/env bash\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (fake_bin / "srun").chmod(0o755)
    root = tmp_path / "my out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {
        "PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "31",
        "SLURM_NNODES": "2", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "CUDA_VISIBLE_DEVICES": "2,3", "RUN_NAME": "run 7", "OUTPUT_ROOT": str(root),
        "PYTHON": str(argv_printer(tmp_path / "python", 'echo "gpu=$CUDA_VISIBLE_DEVICES"'))}

    def task_lines(*args: str) -> list[str]:
        """What the task's python was given (after the script's own "[slurm] job ..." line, for training)."""
        result = subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result
        return [line for line in result.stdout.splitlines() if not line.startswith("[slurm]")]

    trained = task_lines("tiny", "--data.data_path", "my data/x.jsonl")  # no SLURM_NTASKS_PER_NODE: 8 tasks / 2 nodes
    assert trained == ["gpu=2,3", "-m", "training.train", "--recipe", "tiny", "--output-root", str(root),
                       "--run-name", "run 7", "--trainer.num_nodes=2", "--trainer.devices=4",
                       "--data.data_path", "my data/x.jsonl"]
    run = root / "tiny" / "run 7"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "checkpoints" / "last.ckpt").write_text("")
    resumed = task_lines("tiny")
    assert resumed[resumed.index("--resume") + 1] == str(run) and "--run-name" not in resumed
    # the task's GPU is the one at its local id in the node's share, not the GPU numbered by it
    assert task_lines("--regenerate", "--out", "my data/x.jsonl") == [
        "gpu=3", "data/regenerate.py", "--shard-index", "5", "--num-shards", "8", "--out", "my data/x.jsonl"]


def test_slurm_script_run_outside_a_slurm_job_says_to_submit_it_in_one_line(tmp_path):
    """`bash recipes/slurm.sbatch tiny` by hand, or under an salloc without tasks, ended in bash's "SLURM_NTASKS:
    unbound variable" (exit status 1), which said neither what was wrong nor how to submit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for args in (["tiny"], ["--regenerate", "--out", "x"]):
        result = subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == 2 and not result.stdout, result
        assert result.stderr.splitlines() == [
            "error: recipes/slurm.sbatch runs as a SLURM job (SLURM_NNODES and SLURM_NTASKS are not set here): submit "
            f"it with sbatch --nodes=<n> recipes/slurm.sbatch {args[0]} ...; without SLURM, recipes/launch_torchrun.sh "
            "starts each node"]


def test_a_recipe_file_given_to_the_launch_scripts_is_told_the_recipes_name_as_training_tells_it(tmp_path):
    """`make train RECIPE=recipes/tiny.yaml NODES=2` was "unknown recipe 'recipes/tiny.yaml'" (a shipped recipe), and
    slurm.sbatch's "no recipes/recipes/tiny.yaml.yaml" named a file nobody gave: training.train's check says the name,
    given bare here, where the recipe is the scripts' first argument (`--recipe tiny` there is a recipe '--recipe')."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"PYTHON": sys.executable}
    slurm = {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "31", "SLURM_NNODES": "2", "SLURM_NTASKS": "16"}
    for command, extra in (([str(LAUNCHER), "recipes/tiny.yaml", "2"], {}), ([str(SBATCH), "recipes/tiny.yaml"], slurm),
                           ([str(LAUNCHER), "tiny.yml", "1"], {})):
        result = subprocess.run(["bash", *command], cwd=tmp_path, env=env | extra, capture_output=True, text=True)
        assert result.returncode == 2 and not result.stdout, result
        said = "error: the first argument takes a recipe's name: tiny (reads recipes/tiny.yaml)"
        assert result.stderr.splitlines() == [said]
    mine = tmp_path / "mine.yaml"
    mine.write_text((REPO / "recipes" / "tiny.yaml").read_text())
    result = subprocess.run(["bash", str(LAUNCHER), str(mine), "1"], cwd=tmp_path, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result
    assert "put yours at recipes/mine.yaml and give mine (" in result.stderr and "--recipe" not in result.stderr
    unknown = subprocess.run(["bash", str(LAUNCHER), "nope", "1"], cwd=tmp_path, env=env, capture_output=True,
                             text=True)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: unknown recipe 'nope'; known recipes: ")
    # the recipe given as training's option: "NODES must be a positive integer, got 'tiny'", and slurm.sbatch's
    # "unknown recipe '--recipe'", each beside the point
    for command, extra in (([str(LAUNCHER), "--recipe", "tiny", "2"], {}), ([str(SBATCH), "--recipe=tiny"], slurm)):
        result = subprocess.run(["bash", *command], cwd=tmp_path, env=env | extra, capture_output=True, text=True)
        assert result.returncode == 2 and not result.stdout, result
        assert result.stderr.splitlines() == [f"error: the first argument is a recipe's name, and {command[1]} is an "
                                              "option: give the recipe first, then the options; known recipes: "
                                              + ", ".join(sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))]


def test_a_recipe_option_beside_the_launch_scripts_recipe_is_refused_not_trained_with_the_others_settings(tmp_path):
    """`make train RECIPE=tiny NODES=1 ARGS="--recipe qwen3-8b"` trained qwen3-8b (training takes the last --recipe) on
    tiny's one process per node, which the launcher told it with --trainer.devices; under slurm.sbatch a requeued job
    looked for the run in the first recipe's folder. data/regenerate.py's own --recipe is passed on."""
    python = argv_printer(tmp_path / "python", 'case "$1" in -c) exec "$REAL_PYTHON" "$@";; esac')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {
        "PYTHON": str(python), "REAL_PYTHON": sys.executable}
    slurm = {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "31", "SLURM_NNODES": "1", "SLURM_NTASKS": "1"}
    for command, extra in (([str(LAUNCHER), "tiny", "1", "--recipe", "qwen3-8b"], {}),
                           ([str(LAUNCHER), "tiny", "2", "--recipe=qwen3-8b"], {}),
                           ([str(SBATCH), "tiny", "--trainer.max_steps=3", "--recipe", "qwen3-8b"], slurm)):
        result = subprocess.run(["bash", *command], cwd=tmp_path, env=env | extra, capture_output=True, text=True)
        assert result.returncode == 2 and not result.stdout, result
        assert len(result.stderr.splitlines()) == 1 and "give the recipe as the first argument" in result.stderr
    regenerated = subprocess.run(["bash", str(LAUNCHER), "--regenerate", "1", "--recipe", "tiny", "--out", "x"],
                                 cwd=tmp_path, env=env, capture_output=True, text=True)
    assert regenerated.returncode == 0 and regenerated.stdout.splitlines()[-4:] == ["--recipe", "tiny", "--out", "x"]


@pytest.mark.parametrize("text, said", [
    ("model:\n  target: tiny-random\n", None), ("trainer:\n", None), ("", None), ("trainer:\n  devices: 2\n", "2"),
    ("trainer: [\n", "error: recipes/mine.yaml: not valid YAML at line 2"),
])
def test_a_recipe_of_ones_own_without_a_trainer_section_launches_on_the_default_one_process(tmp_path, text, said):
    """The launcher read trainer.devices with yaml.safe_load(...)['trainer']: a recipe of one's own that leaves the
    section out or empty (training takes its defaults) ended in a Python traceback (exit status 1), and so did one that
    is not YAML, which training says in one line. The launcher is copied beside such a recipe (recipes/ is shared)."""
    (tmp_path / "recipes").mkdir()
    shutil.copy(LAUNCHER, tmp_path / "recipes" / LAUNCHER.name)
    (tmp_path / "recipes" / "mine.yaml").write_text(text)
    python = argv_printer(tmp_path / "python", 'case "$1" in -c) exec "$REAL_PYTHON" "$@";; esac')
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS_PER_NODE", "MASTER_ADDR", "NODE_RANK", *SLURM_ENV)}
    env |= {"PYTHON": str(python), "REAL_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    result = subprocess.run(["bash", str(tmp_path / "recipes" / LAUNCHER.name), "mine", "1"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    if said is not None and said.startswith("error: "):
        assert result.returncode == 2 and result.stderr.startswith(said) and "Traceback" not in result.stderr, result
        return
    assert result.returncode == 0 and "Traceback" not in result.stderr, result
    started = result.stdout.splitlines()
    assert started[started.index("--nproc-per-node") + 1] == (said or "1")
    assert f"--trainer.devices={said or 1}" in started


@pytest.mark.parametrize("resume", [["--resume", ""], ["--resume="], ["--trainer.max_steps=3", "--resume="]])
def test_an_empty_resume_through_the_launcher_is_said_as_training_says_it_not_as_a_run_name_to_drop(tmp_path, resume):
    """`recipes/launch_torchrun.sh tiny 1 --resume "$RUN"` with RUN unset launched a new run: the launcher read no
    resume and added its own --run-name, and training's error said to drop that --run-name, never given."""
    python = argv_printer(tmp_path / "python", 'case "$1" in -c) exec "$REAL_PYTHON" "$@";; esac')
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS_PER_NODE", "MASTER_ADDR", "NODE_RANK", "RUN_NAME")}
    for nodes in ("1", "2"):
        result = subprocess.run(["bash", str(LAUNCHER), "tiny", nodes, *resume], cwd=tmp_path,
                                env=env | {"PYTHON": str(python), "REAL_PYTHON": sys.executable}, capture_output=True,
                                text=True)
        assert result.returncode == 2 and not result.stdout, result
        assert result.stderr.splitlines() == [
            "error: --resume is empty (an unset shell variable?); give 'last', a run folder or a checkpoint path"]


def test_regeneration_launch_numbers_shards_across_nodes_and_gpus(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/usr/bin/env bash\necho \"gpu=$CUDA_VISIBLE_DEVICES $*\"\n")
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {
        "PYTHON": str(fake_python), "GPUS_PER_NODE": "4", "NODE_RANK": "1"}
    ran = subprocess.run(["bash", str(LAUNCHER), "--regenerate", "3", "--out", "x"], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == [  # node 1 of 3 x 4 GPUs: shards 4..7 of 12, one per GPU
        f"gpu={i} data/regenerate.py --shard-index {4 + i} --num-shards 12 --out x" for i in range(4)]
    env.pop("NODE_RANK")
    plan = subprocess.run(["bash", str(LAUNCHER), "--regenerate", "3", "--out", "x"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert "Not started" in plan.stdout and "NODE_RANK=<i>" in plan.stdout  # a multi-node launch needs NODE_RANK


def test_regeneration_launch_takes_the_gpus_cuda_visible_devices_names(tmp_path):
    """nvidia-smi lists every GPU of the node: under CUDA_VISIBLE_DEVICES=2,3 (a scheduler's share) the launch started
    8 shards, two on each visible GPU and the rest on GPUs outside the share."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/usr/bin/env bash\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: H100\"; done\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/usr/bin/env bash\necho \"gpu=$CUDA_VISIBLE_DEVICES $*\"\n")
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS_PER_NODE", "NODE_RANK", "CUDA_VISIBLE_DEVICES")} | {
        "PYTHON": str(fake_python), "PATH": f"{fake_bin}:{os.environ['PATH']}"}

    def launched(**settings: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(LAUNCHER), "--regenerate", "1", "--out", "x"], cwd=REPO, env=env | settings,
                              capture_output=True, text=True)

    ran = launched(CUDA_VISIBLE_DEVICES="2,3")
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == [
        f"gpu={gpu} data/regenerate.py --shard-index {i} --num-shards 2 --out x" for i, gpu in enumerate((2, 3))]
    assert len(launched().stdout.splitlines()) == 8  # nothing hidden: every GPU nvidia-smi lists
    hidden = launched(CUDA_VISIBLE_DEVICES="", GPUS_PER_NODE="2")  # every GPU hidden: none un-hidden by its index
    assert sorted(hidden.stdout.splitlines()) == [
        f"gpu= data/regenerate.py --shard-index {i} --num-shards 2 --out x" for i in range(2)]
    refused = launched(CUDA_VISIBLE_DEVICES="2,3", GPUS_PER_NODE="4")
    assert refused.returncode == 2 and not refused.stdout, refused
    assert refused.stderr.splitlines() == [
        "error: GPUS_PER_NODE=4 but CUDA_VISIBLE_DEVICES=2,3 makes 2 GPU(s) visible: give GPUS_PER_NODE=2 or fewer, "
        "or make more GPUs visible"]


@pytest.mark.parametrize("stop, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stopping_a_regeneration_launch_stops_its_shards(tmp_path, stop, status):
    """Started with & by the script, the shards ignore SIGINT: a Ctrl-C killed only the launcher and every shard kept
    running, orphaned, on its GPU."""
    started = tmp_path / "started"
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/usr/bin/env bash\necho $$ >> {started}\nexec sleep 60\n")
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "CUDA_VISIBLE_DEVICES")} | {
        "PYTHON": str(fake_python), "GPUS_PER_NODE": "2"}
    # SIGINT as a terminal leaves it: a suite started from a script's & inherits it ignored, and bash cannot trap a
    # signal ignored on entry (the SIGINT case then failed, run in the background)
    launcher = subprocess.Popen(["bash", str(LAUNCHER), "--regenerate", "1", "--out", "x"], cwd=REPO, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 20
    while len(started.read_text().split() if started.exists() else []) < 2 and time.time() < deadline:
        time.sleep(0.1)
    shards = [int(pid) for pid in started.read_text().split()]
    assert len(shards) == 2
    launcher.send_signal(stop)
    try:
        assert launcher.wait(timeout=20) == status
    finally:
        running = []
        for pid in shards:
            try:
                os.kill(pid, 0)
                running.append(pid)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not running, f"shards {running} outlived the launcher"


@pytest.mark.slow  # two launches of two real regeneration processes (~30-50 s)
def test_regeneration_launch_shards_across_nodes_and_gpus(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me {i}."}]}) + "\n"
                               for i in range(6)))  # 3 chunks of 2
    out = tmp_path / "data"
    options = ["--target", "tiny-random", "--prompts", str(prompts), "--out", str(out), "--chunk-size", "2",
               "--batch-size", "2", "--max-new-tokens", "3", "--dtype", "float32", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "CUDA_VISIBLE_DEVICES")} | {
        "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "2", "PYTHON": sys.executable}
    # 2 nodes x 2 GPUs = 4 shards; chunk k belongs to shard k % 4. Node 0 (shards 0, 1) writes chunks 0 and 1.
    node0 = subprocess.run(["bash", str(LAUNCHER), "--regenerate", "2", *options], cwd=REPO, env=env | {"NODE_RANK": "0"},
                           capture_output=True, text=True, timeout=600)
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert sorted(p.name for p in Path(f"{out}.parts").glob("chunk-*.jsonl")) == ["chunk-00000.jsonl", "chunk-00001.jsonl"]
    assert not out.exists()
    # Node 1: shard 2 writes chunk 2 and, finding every chunk done, merges; shard 3 has none.
    node1 = subprocess.run(["bash", str(LAUNCHER), "--regenerate", "2", *options], cwd=REPO, env=env | {"NODE_RANK": "1"},
                           capture_output=True, text=True, timeout=600)
    assert node1.returncode == 0, node1.stderr[-3000:]
    assert "shard 3/4: 0 chunks" in node1.stdout
    summary = json.loads((out / "regeneration.json").read_text())
    assert summary["num_conversations"] == 6


# ----------------------------------------------------------------------------- SLURM requeue (one process, in-process)


class SignalAtStep(L.Callback):
    """Sends this process SIGUSR1 (what SLURM sends before the job's end) as `step` ends."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)  # noted (SigtermAtStepBoundary): the run stops where this step ends


@pytest.mark.slow  # three single-process runs
def test_sigusr1_requeue_saves_its_step_and_the_requeued_job_resumes_exactly(tmp_path, monkeypatch):
    write_equal_conversations(tmp_path / "conversations.jsonl")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (fake_bin / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    common = launch_args(tmp_path, "auto", 4, tmp_path / "probe")
    common = [arg for arg in common if not arg.startswith("--trainer.callbacks")]
    common += ["--eval.every_n_train_steps=3"]  # first regular checkpoint after the signal at step 2
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)

    assert training.train.main(["--recipe", "tiny", "--run-name", "straight", *common]) == 0

    slurm_env(monkeypatch, nodes=1, per_node=1, job="99")
    real_build_cli = training.train.build_cli

    def build_with_signal(*args):
        cli = real_build_cli(*args)
        cli.trainer.callbacks.insert(0, SignalAtStep(2))
        return cli

    monkeypatch.setattr(training.train, "build_cli", build_with_signal)
    # the SLURM job's own run folder: slurm-99; step 2 saved and the job requeued, 128 + SIGUSR1 as the status
    assert training.train.main(["--recipe", "tiny", *common]) == 128 + signal.SIGUSR1
    monkeypatch.setattr(training.train, "build_cli", real_build_cli)
    run = tmp_path / "out" / "tiny" / "slurm-99"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    assert not list(run.glob("hpc_ckpt_*.ckpt"))
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "99"]

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert training.train.main(["--recipe", "tiny", *common, "--resume", str(run)]) == 0  # as slurm.sbatch does
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == STEPS
    resumed, straight = exported(run), exported(tmp_path / "out" / "tiny" / "straight")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0, msg=key)
