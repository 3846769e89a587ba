"""Runs that fail say so: signals, resuming a moved run, failed starts, file modes, one-line errors.

Each signal test starts a real short `tiny` training, sends the signal where the test holds the run, and checks the
exit status, the message and that the printed command resumes the run to its end. A signal from outside reaches a
training of its own process (test_a_signal_stops_...); runs of two processes (ddp over gloo) are started as `make
train` starts them, and as srun starts a SLURM job's tasks (with a fake scontrol, for SLURM's requeue signal, SIGUSR1),
and signalled while one of them waits in an evaluation's gather; the one-process variants of those train in the test's
own process, sent the signal from another thread, as a process of their own would add only its start-up (~8 s).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import importlib
import json
import logging
import os
import math
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.trainer.connectors.logger_connector import result as lightning_result

import toy_data  # tests/training/toy_data.py
from ddtree.errors import command
from ddtree.packed_linear import cannot_pack
from ddtree.precision import fast_precision
from training.callbacks import AcceptanceEvaluation
from training.checkpoint_paths import is_checkpoint, saved_step
from training.checkpoints import (RESUME_KEYS, check_resumable, drafter_from_checkpoint, newest_finite_checkpoint,
                                  non_finite_tensors)
from training.module import DistillModule
import training.callbacks
import training.export
import training.train
from training.train import main as train_main


pytestmark = pytest.mark.usefixtures("undrawn_plots")  # tau.png drawn only where a test asks (drawn_plots)

REPO = Path(__file__).resolve().parents[2]


def tiny_args(tmp_path: Path, run: str, max_steps: int, every: int = 2) -> list[str]:
    data = tmp_path / "conversations.jsonl"
    if not data.exists():
        toy_data.write_conversations(data, 24, 30, 60)
    return [
        "--recipe", "tiny", "--output-root", str(tmp_path / "out"), "--run", run,
        f"--data.data_path={data}", f"--data.cache_dir={tmp_path / 'cache'}", "--data.batch_size=2",
        "--data.val_fraction=0.1", "--trainer.val_check_interval=null", f"--eval.every_n_train_steps={every}",
        "--eval.limit=1", f"--trainer.max_steps={max_steps}", "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1",
        *toy_data.SMALL_EVAL,  # the bench command's test, which reads two budgets, gives them after these
    ]


def inherited_precision() -> dict:
    """This process's environment, holding the CPU precision choice measured here once (fast_precision sets
    DDTREE_CPU_PRECISION), for a run started from here: it inherits the choice, as Lightning's rank 1 inherits rank
    0's, where timing its own matmuls took each such process ~1.7 s on a 2-core AVX2 EPYC (test_precision_choice
    holds the measurement)."""
    fast_precision("cpu")
    return dict(os.environ)


def train_process(args: list[str]) -> subprocess.Popen:
    # faulthandler: a run that aborts (a SIGINT run once did at exit, "terminate called after throwing ... pybind11",
    # docs/tests.md) prints every thread's Python stack into the failure message.
    env = dict(inherited_precision(), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    # A shell starts background jobs with SIGINT ignored, and a child inherits that: restore the default, so the
    # run hears the test's SIGINT however the suite was launched (`make test &` ran it to its end before).
    return subprocess.Popen([sys.executable, "-m", "training.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"training ended ({process.returncode}) before {path} appeared:\n{process.stderr.read()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


@pytest.mark.parametrize("sent, status, why", [
    # slow (~20 s, a process of its own on a 2-core AVX2 EPYC): test_sigterm_while_a_rank_waits_in_the_evaluations_...
    # sends a SIGTERM from outside to a run's processes and checks the same status, line and saved step
    pytest.param(signal.SIGTERM, 128 + signal.SIGTERM, "stopped by SIGTERM", marks=pytest.mark.slow),
    (signal.SIGINT, 128 + signal.SIGINT, "interrupted (SIGINT)"),
])
def test_a_signal_stops_the_run_with_a_non_zero_status_and_the_command_that_resumes_it(tmp_path, sent, status, why):
    args = tiny_args(tmp_path, "killed", max_steps=400)
    run_dir = tmp_path / "out" / "tiny" / "killed"
    process = train_process(args)
    wait_for(run_dir / "checkpoints" / "last.ckpt", process)
    time.sleep(1.0)  # let the checkpoint finish writing (it is renamed into place, but give the loop time to move on)
    process.send_signal(sent)
    _, err = process.communicate(timeout=120)
    assert process.returncode == status, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("[train]")]
    assert len(lines) == 1 and why in lines[0] and "no drafter written" in lines[0], err[-2000:]
    assert not (run_dir / "drafter").exists()  # nothing that looks finished

    resume = re.search(r"RESUME=(\S+)", lines[0]).group(1)
    assert Path(resume).name == "last.ckpt" and Path(resume).exists()
    stop, saved = int(re.search(r"at step (\d+);", lines[0]).group(1)), check_resumable(Path(resume))["global_step"]
    if sent != signal.SIGTERM:  # Ctrl-C saves nothing: the line says where the resume starts
        assert saved == stop or f"(it continues from step {saved}, that checkpoint's: " in lines[0], lines[0]
        return  # resuming does not depend on the signal: SIGTERM's case runs it
    assert saved == stop and "trained again" not in lines[0], lines[0]  # the stop's own step is saved
    # The printed command continues the run to its end (a shorter one here, so the test stays short).
    assert train_main(["--recipe", "tiny", "--resume", resume, "--output-root", str(tmp_path / "out"),
                       "--trainer.max_steps=6", "--trainer.enable_progress_bar=false"]) == 0
    assert (run_dir / "drafter" / "model.safetensors").is_file()


def test_a_ctrl_c_that_leaves_tensorboards_writer_asleep_delays_the_stop_by_seconds_only(tmp_path):
    """A Ctrl-C that lands as the main thread queues a tensorboard event, after the event is queued and before the
    writer thread is woken (Queue.put's notify), leaves that thread asleep until its next flush, and Lightning's
    shutdown (TensorBoardLogger.finalize) waits for it: with tensorboard's default flush_secs, 120 s, a SIGINT run
    printed its interrupted line and did not exit within the test above's 120 s (CI, 2026-12-05)."""
    specs = json.loads(next(arg for arg in training.train.run_location_args(tmp_path)
                            if arg.startswith("--trainer.logger=")).split("=", 1)[1])
    spec = next(spec for spec in specs if spec["class_path"].endswith(".TensorBoardLogger"))
    module, name = spec["class_path"].rsplit(".", 1)
    logger = getattr(importlib.import_module(module), name)(**spec["init_args"])
    logger.log_metrics({"train/loss": 1.0}, step=1)
    time.sleep(0.5)  # the writer has written the first event and sleeps until its next flush
    events = logger.experiment.file_writer.event_writer._async_writer._byte_queue
    wake = events.not_empty.notify

    def interrupted(n: int = 1) -> None:  # the signal lands on entry, as CPython checks for signals there
        events.not_empty.notify = wake
        raise KeyboardInterrupt

    events.not_empty.notify = interrupted
    with pytest.raises(KeyboardInterrupt):
        logger.log_metrics({"train/loss": 2.0}, step=2)
    finalizing = threading.Thread(target=logger.finalize, args=("failed",), daemon=True)
    finalizing.start()
    finalizing.join(timeout=30)
    assert not finalizing.is_alive(), "TensorBoardLogger.finalize still waits for its writer thread after 30 s"


def hold_until_signalled(trainer, seconds: float) -> None:
    """Waits until this process has noted the test's SIGTERM or requeue signal (SigtermAtStepBoundary's handlers), or
    `seconds` at most: the signal lands in the wait, and the run goes on at once (a fixed sleep outlasted it by
    seconds, a handler that returns resuming it)."""
    boundary = next(c for c in trainer.callbacks if isinstance(c, training.callbacks.SigtermAtStepBoundary))
    deadline = time.monotonic() + seconds
    while not (boundary.noted or boundary.requeue_noted) and time.monotonic() < deadline:
        time.sleep(0.02)


class HoldRankZeroInEvaluation(Callback):
    """Added with --trainer.callbacks+=...: at `step` rank 0 writes `marker`0 as it starts decoding its prompt, then
    waits for the test's signal (`seconds` at most), while rank 1, with no prompt to decode (eval.limit=1), writes
    `marker`1 as it enters the evaluation's gather, and waits there."""

    def __init__(self, marker: str, step: int = 2, seconds: float = 30.0):
        self.marker, self.step, self.seconds = marker, step, seconds

    def setup(self, trainer, pl_module, stage: str) -> None:
        marker = Path(f"{self.marker}{trainer.global_rank}")
        if trainer.global_rank == 0:
            decode = training.callbacks.run_benchmark  # called only by a rank with prompts to decode

            def held(*args, **kwargs):
                if trainer.global_step == self.step:
                    marker.write_text("decoding")
                    hold_until_signalled(trainer, self.seconds)  # the test's signal lands here
                return decode(*args, **kwargs)

            training.callbacks.run_benchmark = held
            return
        gather = torch.distributed.all_gather_object  # the evaluation's gather (measure_acceptance)

        def gathering(*args, **kwargs):
            if trainer.global_step == self.step:
                marker.write_text("gathering")
            return gather(*args, **kwargs)

        torch.distributed.all_gather_object = gathering


def process_environment() -> dict:
    """For training.train in a process of its own, which finds this file's callbacks (--trainer.callbacks+=...)."""
    return dict(inherited_precision(), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))


def train_until_sigterm(args: list[str], markers: list[Path], settle_s: float, timeout_s: float) -> str:
    """Runs training.train with `args` in a session of its own, sends SIGTERM to every process at once (as `timeout`
    or a scheduler sends it) when all `markers` exist and `settle_s` has passed, and returns its stderr; a run still
    alive `timeout_s` after the signal fails the test there (a hang), not at the suite's end."""
    env = process_environment()
    process = subprocess.Popen([sys.executable, "-m", "training.train", *args], cwd=REPO, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        for marker in markers:
            wait_for(marker, process)
        time.sleep(settle_s)
        os.killpg(process.pid, signal.SIGTERM)
        _, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = process.communicate()
        raise AssertionError(f"the run hung after SIGTERM:\n{err[-3000:]}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    return err


def train_here_until_signal(args: list[str], markers: list[Path], capsys,
                            sent: int = signal.SIGTERM) -> tuple[int, str, str]:
    """A one-process run in this process: training.train with `args`, sent `sent` from another thread once all
    `markers` exist, as train_until_sigterm and slurm_tasks send it to a process of their own; its (exit status,
    stdout, stderr). A process of its own would add nothing but its start-up and exit (~8 s of imports and teardown);
    test_a_signal_stops_the_run_... signals a one-process run from outside."""
    ended = threading.Event()

    def send() -> None:
        while not all(marker.exists() for marker in markers):
            if ended.wait(0.05):
                return  # the run ended before its marker: the test's assertions on its status and lines say how
        os.kill(os.getpid(), sent)  # handled in the main thread, where the run is held until it notes the signal

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        status = train_main(args)
    finally:
        ended.set()
        sender.join()
    out, err = capsys.readouterr()
    return status, out, err


def run_until_sigterm(args: list[str], devices: int, markers: list[Path], capsys) -> str:
    """The stderr of a run that SIGTERM stopped with status 143 once all `markers` existed: a one-process run trains in
    this process (train_here_until_signal), a run of several processes in a session of its own (train_until_sigterm)."""
    if devices > 1:
        return train_until_sigterm(args, markers, settle_s=0, timeout_s=120)
    status, _, err = train_here_until_signal(args, markers, capsys)
    assert status == 128 + signal.SIGTERM, err[-3000:]
    return err


def test_sigterm_while_a_rank_waits_in_the_evaluations_gather_stops_every_rank_at_that_step(tmp_path):
    """Found in a review (2026-12-03): Lightning's own SIGTERM handler broadcasts from inside the handler, which never
    paired with the other rank's gather, and both processes hung, with no line and no status. Now the signal is noted
    and every rank stops at the step's end: 143, the stop line, and the step's checkpoint to resume from. With
    DataLoader workers (data.num_workers=2 on each rank, as the SLURM and torchrun recipes have them), which the
    group's SIGTERM reaches too: they ignore it (test_a_sigterm_to_the_process_group_with_dataloader_workers_...,
    slow, holds it in one process)."""
    marker = tmp_path / "evaluating"
    hold = json.dumps({"class_path": "test_reliability.HoldRankZeroInEvaluation", "init_args": {"marker": str(marker)}})
    args = [*tiny_args(tmp_path, "two", max_steps=4), "--trainer.devices=2", "--trainer.strategy=ddp",
            "--data.num_workers=2", f"--trainer.callbacks+={hold}"]
    markers = [Path(f"{marker}{rank}") for rank in range(2)]
    err = train_until_sigterm(args, markers, settle_s=0.2, timeout_s=90)  # 0.2 s: rank 1 waits in the gather
    lines = [line for line in err.splitlines() if line.startswith("[train]")]
    assert len(lines) == 1 and "stopped by SIGTERM at step 2; no drafter written" in lines[0], err[-3000:]
    assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]
    resume = Path(re.search(r"RESUME=(\S+)", lines[0]).group(1))
    assert resume == tmp_path / "out" / "tiny" / "two" / "checkpoints" / "last.ckpt"
    assert check_resumable(resume)["global_step"] == 2  # the step the signal stopped, evaluated and saved
    assert "trained again" not in lines[0]


class HoldAtStepStart(Callback):
    """Added with --trainer.callbacks+=...: as the step after `after` starts (off the evaluation schedule), every rank
    writes `marker`<rank> and the ranks in `ranks` (every rank if None) wait for the test's signal (`seconds` at most);
    the step then trains (a rank that does not wait waits in the step's gradient all-reduce)."""

    def __init__(self, marker: str, after: int, seconds: float = 30.0, ranks: list[int] | None = None):
        self.marker, self.after, self.seconds, self.ranks, self.held = marker, after, seconds, ranks, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.after and not self.held:
            self.held = True
            Path(f"{self.marker}{trainer.global_rank}").write_text("holding")
            if self.ranks is None or trainer.global_rank in self.ranks:
                hold_until_signalled(trainer, self.seconds)


@pytest.mark.parametrize("devices, accumulate", [
    (1, 1),
    # a stop where the optimizer step ends, not after the held micro-batch, in this process (~2 s)
    (1, 2),
    # slow (~27 s and ~36 s of two process starts on a 2-core AVX2 EPYC): (1, 2) holds the stop where the optimizer
    # step ends, and two_ranks_stopped_by_a_sigterm_to_rank_1 (two ranks accumulating 2) the ranks' agreement on the
    # step and its save (the stop's save is the same off the schedule and on it)
    pytest.param(2, 1, marks=pytest.mark.slow),
    pytest.param(2, 2, marks=pytest.mark.slow),
])
def test_sigterm_between_checkpoints_saves_the_step_it_stops_at(tmp_path, capsys, devices, accumulate):
    """Found in a review (2026-12-03): a SIGTERM stopped at step N while the newest checkpoint was the last scheduled
    save, and the stop line named it as the resume: the steps since (up to 999 of an 8B recipe's) were trained again
    without a word. Now every rank stops where an optimizer step ends (never between two micro-batches of one, whose
    accumulated gradients a checkpoint cannot hold), last.ckpt is saved there, and the line's resume continues from
    the step it names."""
    marker = tmp_path / "holding"
    hold = json.dumps({"class_path": "test_reliability.HoldAtStepStart",
                       "init_args": {"marker": str(marker), "after": 2}})
    args = [*tiny_args(tmp_path, "held", max_steps=400, every=2), f"--trainer.devices={devices}",
            f"--trainer.accumulate_grad_batches={accumulate}", f"--trainer.callbacks+={hold}"]
    args += ["--trainer.strategy=ddp"] if devices > 1 else []
    err = run_until_sigterm(args, devices, [Path(f"{marker}{rank}") for rank in range(devices)], capsys)
    lines = [line for line in err.splitlines() if line.startswith("[train]")]
    # step 2 is the last scheduled save; the held step is step 3, trained after the signal and saved as it ends (the
    # first step past a save: a stop at step 6 after a save at step 4 held the same, with three more steps to train)
    assert len(lines) == 1 and "stopped by SIGTERM at step 3; no drafter written" in lines[0], err[-3000:]
    assert "trained again" not in lines[0], lines[0]
    resume = Path(re.search(r"RESUME=(\S+)", lines[0]).group(1))
    assert resume == tmp_path / "out" / "tiny" / "held" / "checkpoints" / "last.ckpt"
    saved = torch.load(resume, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3
    assert sorted(p.name for p in resume.parent.glob("*.ckpt")) == ["best.ckpt", "last.ckpt", "step-2.ckpt"]


@pytest.fixture(scope="module")
def two_ranks_stopped_by_a_sigterm_to_rank_1(tmp_path_factory) -> SimpleNamespace:
    """A run of two ranks launched as `make train` launches it (no --run), sent a SIGTERM to rank 1 alone as step 4
    starts (every 4: a scheduled evaluation step), and what it left as it stopped: its exit status and stderr, its run
    folder and output root, last.ckpt's step, the checkpoints and whether step 4 was measured. It serves the one-rank
    SIGTERM test and the scheduled-evaluation test's two-rank case, which resumes it (so the stop's files are noted
    here, before any resume): one launch of two processes where each test started its own (~25 s of process starts
    on a 2-core AVX2 EPYC). Rank 1 alone waits for the signal: rank 0, which never notes it, waited out its whole hold
    (5 s) before."""
    tmp_path = tmp_path_factory.mktemp("sigterm-to-rank-1")
    marker = tmp_path / "holding"
    hold = json.dumps({"class_path": "test_reliability.HoldAtStepStart",
                       "init_args": {"marker": str(marker), "after": 3, "ranks": [1]}})  # the signal as step 4 trains
    # accumulating 2 micro-batches: the ranks agree where step 4's optimizer step ends, not after its first
    # micro-batch, where rank 1 notes the signal (sigterm_between_checkpoints' two-rank cases are slow)
    args = [*tiny_args(tmp_path, "unused", max_steps=12, every=4), "--trainer.devices=2", "--trainer.strategy=ddp",
            "--trainer.accumulate_grad_batches=2", "--checkpoint.save_top_k=-1", f"--trainer.callbacks+={hold}"]
    del args[args.index("--run"):args.index("--run") + 2]  # the default name, as `make train` gives none
    process = subprocess.Popen([sys.executable, "-m", "training.train", *args], cwd=REPO, env=process_environment(),
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        for rank in range(2):
            wait_for(Path(f"{marker}{rank}"), process, timeout_s=120)
        children = [int(pid) for task in Path(f"/proc/{process.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        (rank_1,) = [pid for pid in children if b"training.train" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(rank_1, signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    runs = list((tmp_path / "out" / "tiny").iterdir())
    stop = as_stopped_at_step_4(runs[0]) if len(runs) == 1 else None
    return SimpleNamespace(status=process.returncode, err=err, out=tmp_path / "out", runs=runs, stop=stop)


def as_stopped_at_step_4(run_dir: Path) -> SimpleNamespace:
    """What a run stopped at step 4 holds: last.ckpt's step (check_resumable), its checkpoints' names, and whether
    step 4 was measured (its eval/step-N.json)."""
    last = run_dir / "checkpoints" / "last.ckpt"
    return SimpleNamespace(saved=check_resumable(last)["global_step"] if last.is_file() else None,
                           checkpoints=sorted(p.name for p in last.parent.glob("*.ckpt")),
                           measured=AcceptanceEvaluation.eval_file(run_dir, 4).exists())


def test_a_sigterm_to_one_rank_alone_of_a_run_without_a_run_name_stops_every_rank_at_one_step(
        two_ranks_stopped_by_a_sigterm_to_rank_1):
    """A SIGTERM to rank 1 only (its node's scheduler, an OOM watchdog, `kill <pid>`): every rank stops at the step's
    end, 143, the step saved. The other signal tests signal the process group, where every rank notes it, so agreeing
    by the minimum passed, and the run trained on with the signal lost (K14). Without --run, as `make train` launches:
    the other runs of several processes name theirs, so not passing the default name to the ranks passed too, and
    every such run failed its rank 1 on the torchrun message and hung (T22) (mutation review m16, G2). The launch is
    two_ranks_stopped_by_a_sigterm_to_rank_1's, which the scheduled-evaluation test's two-rank case resumes."""
    launched = two_ranks_stopped_by_a_sigterm_to_rank_1
    lines = [line for line in launched.err.splitlines() if line.startswith("[train]")]
    assert launched.status == 143 and len(lines) == 1, launched.err[-3000:]
    assert "stopped by SIGTERM at step 4; no drafter written" in lines[0], lines[0]
    (run,) = launched.runs  # one default-named folder for both ranks
    assert Path(re.search(r"RESUME=(\S+)", lines[0]).group(1)) == run / "checkpoints" / "last.ckpt"
    assert launched.stop.saved == 4


@pytest.mark.parametrize("devices", [1, 2])
def test_sigterm_at_a_scheduled_evaluation_step_saves_it_at_once_and_the_resume_measures_and_ranks_it(
        tmp_path, capsys, request, devices):
    """Found in a review (2026-12-03): a SIGTERM agreed at a step of eval.every_n_train_steps still ran that step's
    evaluation before saving it, a few minutes on the 8B recipes, past a scheduler's grace before SIGKILL (SLURM's
    30 s): the step was lost. Now it is saved to last.ckpt at once, unmeasured and unranked, and the resume measures
    it before training on (on every rank, under ddp too), saves it as step-N.ckpt and ranks it, its report row with
    the train loss the stopped launch logged. Two ranks: the launch is two_ranks_stopped_by_a_sigterm_to_rank_1's (its
    SIGTERM to rank 1 alone, agreed by both ranks as the group's would be), resumed here."""
    if devices == 1:
        marker = tmp_path / "holding"
        hold = json.dumps({"class_path": "test_reliability.HoldAtStepStart",
                           "init_args": {"marker": str(marker), "after": 3}})  # the signal lands as step 4 trains
        args = [*tiny_args(tmp_path, "scheduled", max_steps=400, every=4), "--trainer.devices=1",
                "--checkpoint.save_top_k=-1", f"--trainer.callbacks+={hold}"]
        err = run_until_sigterm(args, devices, [Path(f"{marker}0")], capsys)
        out, run_dir = tmp_path / "out", tmp_path / "out" / "tiny" / "scheduled"
        stop = as_stopped_at_step_4(run_dir)
    else:  # as the launch stopped, before any resume
        launched = request.getfixturevalue("two_ranks_stopped_by_a_sigterm_to_rank_1")
        assert launched.status == 143, launched.err[-3000:]
        err, out, (run_dir,), stop = launched.err, launched.out, launched.runs, launched.stop
    lines = [line for line in err.splitlines() if line.startswith("[train]")]
    assert len(lines) == 1 and "stopped by SIGTERM at step 4; no drafter written" in lines[0], err[-3000:]
    resume = Path(re.search(r"RESUME=(\S+)", lines[0]).group(1))
    assert resume == run_dir / "checkpoints" / "last.ckpt" and stop.saved == 4
    assert stop.checkpoints == ["last.ckpt"]  # saved, not ranked
    assert not stop.measured  # nor measured

    resume_args = ["--output-root", str(out), "--resume", str(resume), "--trainer.max_steps=5"]
    if devices == 1:  # in this process, as the launch was
        assert train_main(resume_args) == 0
        said = capsys.readouterr().out
    else:  # its two ranks started side by side, as srun starts a job's two tasks: `make train` starts rank 1 only once
        # rank 0 has imported and set up, ~9 s more on a 2-core AVX2 EPYC (the launch above is started that way)
        resumed = finish(slurm_tasks(resume_args, tmp_path, 2), timeout_s=600)
        assert [status for status, _, _ in resumed] == [0, 0], resumed[0][2][-3000:] + resumed[1][2][-3000:]
        said = resumed[0][1]
    assert ("[eval] step 4: measured at the resume (the launch that trained it was stopped by SIGTERM or SLURM's "
            "requeue signal before measuring it)") in said.splitlines(), said[-3000:]
    measured = json.loads(AcceptanceEvaluation.eval_file(run_dir, 4).read_text())["summary"]["ddtree@8"]["tau"]
    assert check_resumable(resume.parent / "step-4.ckpt")["global_step"] == 4
    ranking = torch.load(resume, map_location="cpu", weights_only=False)["callbacks"]["BestCheckpoint"]
    assert ranking["best_k_models"]["step-4.ckpt"] == pytest.approx(measured) and "step-5.ckpt" in ranking["best_k_models"]
    (row,) = [line for line in (run_dir / "report.md").read_text().splitlines() if re.match(r"\| (\*\*)?4\b", line)]
    assert row.split("|")[2].strip() != "-", row  # the train loss of step 4, from the launch that trained it


class SigtermAsStepStarts(Callback):
    """Added with --trainer.callbacks+=...: this process sends itself SIGTERM as step `step` starts training (None: as
    the epoch's last batch does)."""

    def __init__(self, step: int | None = None):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1 if self.step is not None else trainer.is_last_batch:
            os.kill(os.getpid(), signal.SIGTERM)  # SigtermAtStepBoundary's handler notes it; the step trains on


@pytest.mark.parametrize("schedule", ["max_steps", "max_epochs"])
def test_sigterm_at_the_last_step_saves_it_at_once_and_the_resume_measures_it_or_says_how(tmp_path, capsys, schedule):
    """The planned last step is saved unmeasured at a SIGTERM too. A run planned in epochs (the 8B recipes') resumes
    into its last epoch's end, where the step is measured and ranked as a scheduled one; past max_steps Lightning
    starts no loop, so that resume exports the drafter and says which command measures the step."""
    if schedule == "max_steps":
        limits, stop = tiny_args(tmp_path, "last", max_steps=4), {"step": 4}
    else:  # off the every-4 grid: the epoch's 11 batches end at step 11
        limits, stop = [*tiny_args(tmp_path, "last", max_steps=-1, every=4), "--trainer.max_epochs=1"], {}
    sigterm = json.dumps({"class_path": "test_reliability.SigtermAsStepStarts", "init_args": stop})
    assert train_main([*limits, "--checkpoint.save_top_k=-1", f"--trainer.callbacks+={sigterm}"]) == 143
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train]")]
    step = int(re.search(r"stopped by SIGTERM at step (\d+); no drafter written", line).group(1))
    run_dir = tmp_path / "out" / "tiny" / "last"
    assert check_resumable(run_dir / "checkpoints" / "last.ckpt")["global_step"] == step
    assert not AcceptanceEvaluation.eval_file(run_dir, step).exists()
    assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(run_dir),
                       "--trainer.enable_progress_bar=false"]) == 0
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    said = capsys.readouterr().out
    if schedule == "max_steps":
        assert (f"[train] step {step}, the last, was saved unmeasured where a SIGTERM (or SLURM's requeue signal) "
                f"stopped the run, and no launch trains past it to measure it: `make eval RUN={run_dir} CKPT=last` "
                "measures it") in said, said
        return
    assert step % 4 != 0 and f"[eval] step {step}: measured at the resume" in said, said
    ranking = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]["BestCheckpoint"]
    assert sorted(ranking["best_k_models"]) == sorted(f"step-{n}.ckpt" for n in (4, 8, step))
    assert check_resumable(run_dir / "checkpoints" / f"step-{step}.ckpt")["global_step"] == step
    assert "the last, was saved unmeasured" not in said


class SigtermAfterStepEnds(Callback):
    """Added with --trainer.callbacks+=..., so after SigtermAtStepBoundary: this process sends itself SIGTERM as step
    `step` ends, after that step's agreement (where a signal in the next batch's data loading is noted too)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class SigtermAsTrainingEnds(Callback):
    """Added with --trainer.callbacks+=...: this process sends itself SIGTERM in on_train_end, after
    SigtermAtStepBoundary's (where the final evaluation and the last save run)."""

    def on_train_end(self, trainer, pl_module) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_noted_after_an_off_schedule_steps_end_trains_and_saves_the_next_step(tmp_path, capsys):
    """Noted after step 5's agreement (step 4 the last save), the stop waits for step 6's end and saves it: stopping at
    the next batch's start left step 5 unsaved, and the line resumed from step 4 with step 5 'trained again'; only a
    step already saved may stop there (mutation review m16, K15)."""
    sigterm = json.dumps({"class_path": "test_reliability.SigtermAfterStepEnds", "init_args": {"step": 5}})
    assert train_main([*tiny_args(tmp_path, "late", max_steps=12, every=4), f"--trainer.callbacks+={sigterm}"]) == 143
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train]")]
    assert "stopped by SIGTERM at step 6; no drafter written" in line and "trained again" not in line, line
    assert saved_step(tmp_path / "out" / "tiny" / "late" / "checkpoints" / "last.ckpt") == 6


def test_a_sigterm_noted_during_a_scheduled_steps_evaluation_stops_before_the_next_step_trains(tmp_path, capsys):
    """Noted after step 4's agreement, during its evaluation and save (every 4): the saved step is where the run stops,
    before step 5 trains, as the signal's sender waits for no more. Where the save did not count (saved_step not
    moved on at on_save_checkpoint), step 5 was trained and saved too (mutation review m47, N09)."""
    sigterm = json.dumps({"class_path": "test_reliability.SigtermAfterStepEnds", "init_args": {"step": 4}})
    assert train_main([*tiny_args(tmp_path, "saved", max_steps=12, every=4), f"--trainer.callbacks+={sigterm}"]) == 143
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train]")]
    assert "stopped by SIGTERM at step 4; no drafter written" in line, line
    assert saved_step(tmp_path / "out" / "tiny" / "saved" / "checkpoints" / "last.ckpt") == 4


def test_a_sigterm_during_on_train_end_stops_with_143_and_the_line(tmp_path, capsys):
    """A signal in on_train_end (the final evaluation, the last save) arrives where no loop raises: the run ended 0
    and went on to export, past the scheduler's grace period, with no line (mutation review m16, K19, T26)."""
    sigterm = json.dumps({"class_path": "test_reliability.SigtermAsTrainingEnds"})
    assert train_main([*tiny_args(tmp_path, "end", max_steps=4), f"--trainer.callbacks+={sigterm}"]) == 143
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train]")]
    assert "stopped by SIGTERM at step 4; no drafter written" in line, line
    assert not (tmp_path / "out" / "tiny" / "end" / "drafter").exists()


def test_sigterm_with_save_last_false_saves_the_step_to_its_step_file_and_the_resume_ranks_it(tmp_path, capsys):
    """Found in a review (2026-12-03): with checkpoint.save_last false a SIGTERM's stop was saved nowhere (its save
    writes last.ckpt), a scheduled step's too, which the stop no longer measured and ranked: the resume went back to
    the last scheduled save and trained up to every_n_train_steps steps again. Now the stop goes to step-N.ckpt,
    unranked, and the resume of the run folder continues from it, measures it and ranks it."""
    sigterm = json.dumps({"class_path": "test_reliability.SigtermAsStepStarts", "init_args": {"step": 8}})
    args = [*tiny_args(tmp_path, "nolast", max_steps=12, every=4), "--checkpoint.save_last=false",
            "--checkpoint.save_top_k=-1", f"--trainer.callbacks+={sigterm}"]
    assert train_main(args) == 143
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train]")]
    checkpoints = tmp_path / "out" / "tiny" / "nolast" / "checkpoints"
    assert line == ("[train] stopped by SIGTERM at step 8; no drafter written; resume with: make train RECIPE=tiny "
                    f"RESUME={checkpoints / 'step-8.ckpt'}"), line  # no "trained again"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["best.ckpt", "step-4.ckpt", "step-8.ckpt"]
    stopped = torch.load(checkpoints / "step-8.ckpt", map_location="cpu", weights_only=False)
    assert stopped["global_step"] == 8 and sorted(stopped["callbacks"]["BestCheckpoint"]["best_k_models"]) == [
        "step-4.ckpt"]  # saved, not ranked
    assert not AcceptanceEvaluation.eval_file(checkpoints.parent, 8).exists()

    assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(checkpoints.parent),
                       "--trainer.max_steps=9", "--trainer.enable_progress_bar=false"]) == 0
    said = capsys.readouterr().out
    assert f"(resuming {checkpoints / 'step-8.ckpt'})" in said and "[eval] step 8: measured at the resume" in said, said
    measured = json.loads(AcceptanceEvaluation.eval_file(checkpoints.parent, 8).read_text())["summary"]["ddtree@8"]
    ranking = torch.load(checkpoints / "step-8.ckpt", map_location="cpu", weights_only=False)["callbacks"]
    assert ranking["BestCheckpoint"]["best_k_models"]["step-8.ckpt"] == pytest.approx(measured["tau"])
    assert not (checkpoints / "last.ckpt").exists()


def test_a_stop_at_a_validation_step_keeps_its_val_loss_for_the_resumes_report_row(tmp_path, capsys):
    """Found in a review (2026-12-03): Lightning validates a step after its train-batch hooks, so after the stop saved
    it; the resume, which does not validate it again, wrote its report.md row with no val loss ("-"), where a run not
    stopped had one (the 8B recipes validate every 2000 steps and evaluate every 1000). The stopped launch's loss is
    kept beside the evaluations until the resume measures the step."""
    sigterm = json.dumps({"class_path": "test_reliability.SigtermAsStepStarts", "init_args": {"step": 4}})
    args = [*tiny_args(tmp_path, "validated", max_steps=12, every=4), "--trainer.val_check_interval=4",
            f"--trainer.callbacks+={sigterm}"]
    assert train_main(args) == 143
    run_dir = tmp_path / "out" / "tiny" / "validated"
    assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(run_dir), "--trainer.max_steps=5",
                       "--trainer.enable_progress_bar=false"]) == 0
    assert "[eval] step 4: measured at the resume" in capsys.readouterr().out
    (row,) = [line for line in (run_dir / "report.md").read_text().splitlines() if re.match(r"\| (\*\*)?4\b", line)]
    assert row.split("|")[3].strip() != "-", row  # the val loss of step 4, from the launch that validated it
    val_loss = json.loads(AcceptanceEvaluation.eval_file(run_dir, 4).read_text())["val_loss"]
    assert row.split("|")[3].strip() == f"{val_loss:.3f}", row
    assert not list((run_dir / "eval").glob("stopped-*"))  # kept in eval/step-000004.json now


def slurm_environment(tmp_path: Path, tasks: int, **extra: str) -> dict:
    """The environment srun gives each of a job's `tasks` tasks on one node (job 99), less the task's own SLURM_PROCID
    and SLURM_LOCALID, with an `scontrol` on PATH that records its arguments in tmp_path/scontrol.log."""
    fake_bin = tmp_path / "bin"
    if not fake_bin.is_dir():
        fake_bin.mkdir()
        (fake_bin / "scontrol").write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
        (fake_bin / "scontrol").chmod(0o755)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    base = {name: value for name, value in process_environment().items() if not name.startswith("SLURM_")
            and name not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    base |= dict(PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 SLURM_JOB_ID="99", SLURM_JOB_NAME="ddtree", SLURM_NTASKS=str(tasks), SLURM_NNODES="1",
                 SLURM_NTASKS_PER_NODE=str(tasks), SLURM_STEP_NUM_TASKS=str(tasks), SLURM_NODEID="0",
                 SLURM_NODELIST="localhost", **extra)
    return base


def slurm_tasks(args: list[str], tmp_path: Path, tasks: int, **extra: str) -> list[subprocess.Popen]:
    """training.train started as srun starts a job's `tasks` tasks on one node (slurm_environment)."""
    base = slurm_environment(tmp_path, tasks, **extra)
    return [subprocess.Popen([sys.executable, "-m", "training.train", *args], cwd=REPO, text=True,
                             env=base | dict(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(tasks)]


def finish(tasks: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of every task; tasks still running after `timeout_s` fail the test (a hang)."""
    try:
        ended = [task.communicate(timeout=timeout_s) for task in tasks]
    except subprocess.TimeoutExpired:
        for task in tasks:
            task.kill()
        raise AssertionError("the job hung: " + " | ".join(task.communicate()[1][-1500:] for task in tasks)) from None
    return [(task.returncode, out, err) for task, (out, err) in zip(tasks, ended)]


@pytest.mark.parametrize("tasks", [1, 2])
def test_slurms_requeue_signal_saves_the_step_on_every_rank_requeues_once_and_the_job_resumes(tmp_path, capsys, tasks):
    """Found in a review (2026-12-03): Lightning's requeue handler saved hpc_ckpt_N.ckpt from inside the SIGUSR1
    handler, wherever each rank was: under two-process ddp rank 0's save waited in a barrier while rank 1 waited in the
    evaluation's gather, and the job hung, never requeued, until SLURM killed it. Now the signal is noted, the ranks
    agree where a step ends, each saves last.ckpt, rank 0 runs `scontrol requeue` once, every task exits with 138
    (128 + SIGUSR1) and one line, and the requeued job (slurm.sbatch: --resume <run folder>) trains to its end."""
    marker = tmp_path / "holding"
    if tasks == 2:  # the hang: rank 0 decodes step 2's prompt, rank 1 waits in the gather
        # max_steps 4: the requeued job trains on past the stop (steps 3 and 4) and measures step 4, as 6 steps did
        hold = {"class_path": "test_reliability.HoldRankZeroInEvaluation", "init_args": {"marker": str(marker)}}
        end, markers, step = 4, [Path(f"{marker}0"), Path(f"{marker}1")], 2
        args = tiny_args(tmp_path, "slurm-99", max_steps=end)
    else:  # as step 4, scheduled for evaluation, trains: saved unmeasured, measured by the requeued job (to step 6:
        # the stop is not the run's last step)
        hold = {"class_path": "test_reliability.HoldAtStepStart", "init_args": {"marker": str(marker), "after": 3}}
        end, markers, step = 6, [Path(f"{marker}0")], 4
        args = tiny_args(tmp_path, "slurm-99", max_steps=end, every=4)
    options = [f"--trainer.devices={tasks}", "--trainer.num_nodes=1", f"--trainer.callbacks+={json.dumps(hold)}"]
    if tasks == 1:  # in this process, as the job's one task (train_here_until_signal)
        job_task = slurm_environment(tmp_path, 1, SLURM_PROCID="0", SLURM_LOCALID="0")
        with mock.patch.dict(os.environ, job_task, clear=True):  # and whatever Lightning sets in it is undone
            ended = [train_here_until_signal([*args, *options], markers, capsys, sent=signal.SIGUSR1)]
    else:
        job = slurm_tasks([*args, *options, "--trainer.strategy=ddp"], tmp_path, tasks)
        for found in markers:
            wait_for(found, job[0])
        time.sleep(0.2)  # rank 1 waits in the gather
        for task in job:  # SLURM signals every task of the job
            task.send_signal(signal.SIGUSR1)
        ended = finish(job, timeout_s=120)
    assert [status for status, _, _ in ended] == [128 + signal.SIGUSR1] * tasks, ended[0][2][-3000:]
    run_dir = tmp_path / "out" / "tiny" / "slurm-99"
    last = run_dir / "checkpoints" / "last.ckpt"
    lines = [line for _, _, err in ended for line in err.splitlines() if line.startswith("[train]")]
    assert lines == [f"[train] stopped by SLURM's SIGUSR1 (its requeue signal) at step {step}; no drafter written; "
                     f"SLURM requeued job 99, which resumes from {last}"], ended[0][2][-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 99\n"  # rank 0 alone
    assert check_resumable(last)["global_step"] == step and not list(run_dir.glob("hpc_ckpt_*"))

    requeued = ["--recipe", "tiny", "--output-root", str(tmp_path / "out"), "--resume", str(run_dir), *options[:2]]
    if tasks == 1:
        with mock.patch.dict(os.environ, job_task | dict(SLURM_RESTART_COUNT="1"), clear=True):
            assert train_main(requeued) == 0
        assert "[eval] step 4: measured at the resume" in capsys.readouterr().out
    else:
        resumed = finish(slurm_tasks(requeued, tmp_path, tasks, SLURM_RESTART_COUNT="1"), timeout_s=600)
        assert [status for status, _, _ in resumed] == [0] * tasks, resumed[0][2][-3000:]
    assert check_resumable(last)["global_step"] == end and (run_dir / "drafter" / "model.safetensors").is_file()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 99\n"


def test_slurms_requeue_signal_after_training_ended_is_one_line_and_the_job_finishes(tmp_path, capsys, monkeypatch):
    """Found in a review (2026-12-03): Lightning gives SIGUSR1 back its default action as fit ends, so SLURM's requeue
    signal arriving during the export killed the process silently with 138, the status of a requeue, no drafter
    written and nothing requeued. Now it is noted, and the run finishes with its drafter and status 0. In this process,
    as a process of its own adds only its start-up (~10 s of imports on a 2-core AVX2 EPYC): SIGUSR1 has its default
    action here too, so a run that does not note it ends this process (pytest-xdist reports its worker crashed)."""
    run_dir = tmp_path / "out" / "tiny" / "late"
    export = training.train.export_drafter

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)  # as the drafter is exported, after fit
        return export(*args, **kwargs)

    monkeypatch.setattr(training.train, "export_drafter", signalled)
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # as a process of its own has it, where it ended the run
    try:
        assert train_main(tiny_args(tmp_path, "late", max_steps=2)) == 0
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    said = capsys.readouterr().out
    assert ("[train] SLURM's SIGUSR1 (its requeue signal) came after training had ended: the job was not requeued, it "
            "finished the run") in said.splitlines(), said[-3000:]


def signal_as_the_feature_store_is_built(monkeypatch, sent: int) -> None:
    """The run sends itself `sent` as its missing feature store is built, before fit, outside Lightning's handlers. In
    this process, as a process of its own adds only its start-up (~10 s of imports on a 2-core AVX2 EPYC): the signal
    is the run's own (os.kill), handled where the run is, as in a process of its own (SIGINT with python_sigint, as
    a terminal gives it; SIGTERM under the command's handler, run_cli), and train_main returns the exit status."""

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), sent)  # as the missing feature store is built, before fit

    monkeypatch.setattr(training.train, "build_missing_feature_store", signalled)


@pytest.mark.parametrize("sent, why", [(signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGINT, "interrupted (SIGINT)")])
def test_a_signal_before_fit_stops_with_one_line_and_leaves_no_run_folder(tmp_path, capsys, monkeypatch, python_sigint,
                                                                          sent, why):
    """Found in a review (2026-12-04): outside Lightning's fit a SIGTERM had its default action. A run stopped as its
    feature store was built (minutes for the CPU recipe, before fit) ended silently with 143 and left its new run
    folder with its lock, as nothing ran its clean-up. Now it stops as Ctrl-C does, and both say it in the line a stop
    in fit gives: 128 + the signal, no folder left."""
    signal_as_the_feature_store_is_built(monkeypatch, sent)
    assert train_main(tiny_args(tmp_path, "early", max_steps=2)) == 128 + sent
    err = capsys.readouterr().err
    said = [line for line in err.splitlines()  # and not run_cli's own line for a stop as well
            if line.startswith("[train]") or line in ("interrupted", "stopped by SIGTERM")]
    assert said == [f"[train] {why} at step 0; no drafter written; no checkpoint was written yet, so nothing can be "
                    "resumed; start it again (the same command)"], err[-3000:]
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # the run folder, its lock and the folders made for it


def test_a_signal_before_a_resumes_fit_names_the_step_it_resumes_from(tmp_path, capsys, monkeypatch):
    """A resume stopped as its data or feature store is prepared has restored nothing yet: its line names the
    checkpoint's step (a fresh run's says step 0), and the run folder stays as it was."""
    assert train_main(tiny_args(tmp_path, "resumed", max_steps=2)) == 0
    run_dir = tmp_path / "out" / "tiny" / "resumed"
    config = (run_dir / "config.yaml").read_text()
    capsys.readouterr()
    signal_as_the_feature_store_is_built(monkeypatch, signal.SIGTERM)
    assert train_main(["--resume", str(run_dir), "--output-root", str(tmp_path / "out"), "--trainer.max_steps=4"]) == (
        128 + signal.SIGTERM)
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("[train]") or line == "stopped by SIGTERM"]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert said == [f"[train] stopped by SIGTERM at step 2; no drafter written; resume with: make train RECIPE=tiny "
                    f"RESUME={last}"], err[-3000:]
    assert (run_dir / "config.yaml").read_text() == config and saved_step(last) == 2


def test_a_sigterm_during_the_final_export_leaves_no_staging_folder_and_the_line_says_how_to_write_drafter(tmp_path,
                                                                                                           capsys,
                                                                                                           monkeypatch):
    """Found in a review (2026-12-04): a SIGTERM as drafter/ was exported, after fit, ended the run silently with 143
    and left the export's staging folder (.drafter-xxxxxxxx, the drafter's size) for good. Now the staging folder is
    removed and the one line says that training finished and which command writes drafter/. In this process, as
    signal_as_the_feature_store_is_built's runs, for the same reason."""
    run_dir = tmp_path / "out" / "tiny" / "late"
    staged = training.export.staged_folder

    @contextlib.contextmanager
    def signalled(folder):
        with staged(folder) as staging:
            yield staging
            os.kill(os.getpid(), signal.SIGTERM)  # drafter/'s files written, not yet renamed into place

    with monkeypatch.context() as patched:
        patched.setattr(training.export, "staged_folder", signalled)
        assert train_main(tiny_args(tmp_path, "late", max_steps=2)) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("[train]") or "SIGTERM" in line]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert said == ["[train] stopped by SIGTERM during the export of drafter/, after training finished at step 2; no "
                    f"drafter written; `make train RECIPE=tiny RESUME={last}` writes it"], err[-3000:]
    assert "Traceback" not in err
    assert not (run_dir / "drafter").exists() and not list(run_dir.glob(".drafter-*"))
    # The printed command writes drafter/, training nothing more
    assert train_main(["--recipe", "tiny", "--resume", str(last), "--output-root", str(tmp_path / "out"),
                       "--trainer.enable_progress_bar=false"]) == 0
    assert (run_dir / "drafter" / "model.safetensors").is_file() and check_resumable(last)["global_step"] == 2


def test_a_process_forked_by_a_command_ends_at_a_sigterm_as_before_and_runs_none_of_its_clean_up():
    """A command's SIGTERM handler (ddtree.errors.SigtermRaises) raises where the command is. A process forked from it
    (a process a library forks) inherits the handler: raised there, the exception would unwind the parent's
    stack in the child, through the parent's `finally` blocks (a staging folder's removal, a run folder's). It ends at
    the signal instead, as it did under the default action."""

    @command
    def forks(argv) -> int:
        child = os.fork()
        if child == 0:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            finally:
                os._exit(7)  # the parent's clean-up ran in the child (or the signal did nothing)
        return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])

    assert forks([]) == -signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the command's handler was its own only while it ran


def requeue_stop(run_dir: Path) -> Path:
    """SLURM's requeue signal (SIGUSR1, what the ranks agreed on) at step 3 of the run in run_dir, which every rank
    saved: the stop's status is 128 + the signal. Its last.ckpt is returned."""
    last = run_dir / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"global_step": 3}, last)
    boundary = training.callbacks.SigtermAtStepBoundary()
    boundary.requeue = signal.SIGUSR1
    cli = SimpleNamespace(trainer=SimpleNamespace(global_step=3, callbacks=[boundary]))
    assert training.train.stopped_by_signal(cli, run_dir, "tiny") == 128 + signal.SIGUSR1
    return last


def test_a_requeue_scontrol_refuses_is_one_line_with_the_command_that_resumes(tmp_path, monkeypatch, capsys):
    """Every rank saved the step; rank 0's `scontrol requeue` failed (a job not requeueable, say): the line says so,
    with the command that resumes, and the status is still 128 + the signal."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text("#!/usr/bin/env bash\necho 'scontrol: error: Requested operation is presently "
                                       "disabled for job 7' >&2\nexit 1\n")
    (fake_bin / "scontrol").chmod(0o755)
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    last = requeue_stop(tmp_path / "out" / "tiny" / "r")
    assert capsys.readouterr().err.splitlines() == [
        "[train] stopped by SLURM's SIGUSR1, but `scontrol requeue 7` failed (exit status 1: scontrol: error: Requested "
        f"operation is presently disabled for job 7) at step 3; no drafter written; resume with: make train RECIPE=tiny "
        f"RESUME={last}"]
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # ignored only while rank 0 requeued


def test_a_requeue_on_a_node_without_scontrol_is_one_line_with_the_command_that_resumes(tmp_path, monkeypatch, capsys):
    """scontrol not on the PATH of rank 0's node: the requeue's failure is said, not a FileNotFoundError traceback."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", str(empty_bin))
    last = requeue_stop(tmp_path / "out" / "tiny" / "r")
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("[train] stopped by SLURM's SIGUSR1, but `scontrol requeue 7` failed (") and "scontrol" in \
        line.split("failed (", 1)[1] and line.endswith(f"resume with: make train RECIPE=tiny RESUME={last}"), line


def in_slurm_job(tmp_path: Path, monkeypatch, **slurm: str) -> None:
    """This process as rank 0 of a SLURM job with the `slurm` variables alone, with an `scontrol` on PATH that records
    its arguments in tmp_path/scontrol.log."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (fake_bin / "scontrol").chmod(0o755)
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")


def test_a_job_array_tasks_requeue_names_the_task_as_scontrol_and_squeue_do(tmp_path, monkeypatch, capsys):
    """A task of a job array requeues as <array job>_<task> (slurm_job_id), the id squeue shows and run_name's
    slurm-<array job>-<task> folder follows; its own SLURM_JOB_ID names neither."""
    in_slurm_job(tmp_path, monkeypatch, SLURM_JOB_ID="503", SLURM_ARRAY_JOB_ID="500", SLURM_ARRAY_TASK_ID="3")
    last = requeue_stop(tmp_path / "out" / "tiny" / "slurm-500-3")
    assert (tmp_path / "scontrol.log").read_text() == "requeue 500_3\n"
    assert capsys.readouterr().err.splitlines() == [
        f"[train] stopped by SLURM's SIGUSR1 (its requeue signal) at step 3; no drafter written; SLURM requeued job "
        f"500_3, which resumes from {last}"]


def test_a_requeue_before_any_checkpoint_says_the_requeued_job_starts_the_run_again(tmp_path, monkeypatch, capsys):
    """SLURM's requeue signal before the first step was saved (SigtermAtStepBoundary saves nothing at step 0): the job
    is requeued all the same, and the line says that it starts the run again, not to start it again by hand, which
    would run a second job into the same run folder."""
    in_slurm_job(tmp_path, monkeypatch, SLURM_JOB_ID="7")
    run_dir = tmp_path / "out" / "tiny" / "slurm-7"
    run_dir.mkdir(parents=True)
    boundary = training.callbacks.SigtermAtStepBoundary()
    boundary.requeue = signal.SIGUSR1
    cli = SimpleNamespace(trainer=SimpleNamespace(global_step=0, callbacks=[boundary]))
    assert training.train.stopped_by_signal(cli, run_dir, "tiny") == 128 + signal.SIGUSR1
    assert (tmp_path / "scontrol.log").read_text() == "requeue 7\n"
    assert capsys.readouterr().err.splitlines() == [
        "[train] stopped by SLURM's SIGUSR1 (its requeue signal) at step 0; no drafter written; SLURM requeued job 7, "
        "which starts it again"]


def test_the_ranks_of_an_evaluation_say_their_lines_once_and_pack_as_rank_0_chose(tiny_target, tmp_path, capsys):
    """Found in a review (2026-12-03): each rank timed the packed weights and printed its own choice, which could differ
    (a loaded machine), and each said it measured the resumed step. Rank 0 says both; every rank packs as it chose."""
    target, _ = tiny_target
    said = {}
    for rank in (1, 0):
        evaluation = AcceptanceEvaluation(packed_weights="auto", every_n_train_steps=2)
        evaluation._evaluate = lambda *args, **kwargs: None  # a resume at step 2, whose evaluation was cut short
        rank_zero = SimpleNamespace(broadcast=lambda value: "rank 0's choice")
        trainer = SimpleNamespace(global_rank=rank, is_global_zero=rank == 0, world_size=2, global_step=2,
                                  ckpt_path=None, default_root_dir=str(tmp_path), strategy=rank_zero,
                                  checkpoint_callbacks=[])
        evaluation.on_train_start(trainer, SimpleNamespace(target=target))
        assert evaluation.pack_target == "rank 0's choice", rank
        said[rank] = capsys.readouterr().out
    assert said[1] == ""
    assert "[eval] step 2: measured at the resume" in said[0]
    assert ("[eval] [packed weights]" in said[0]) == (cannot_pack(target) is None)  # auto says what it measured


def crash_training_at(monkeypatch, step: int | None) -> None:
    """DistillModule.training_step raises a simulated CUDA out-of-memory at `step` (at every step where None)."""
    checked = DistillModule.training_step

    def crashing(self, batch, batch_idx):
        if step is None or self.global_step == step:
            raise RuntimeError("CUDA out of memory (simulated)")
        return checked(self, batch, batch_idx)

    monkeypatch.setattr(DistillModule, "training_step", crashing)


def test_a_crash_after_a_checkpoint_says_how_to_resume_beside_its_traceback(tmp_path, monkeypatch, capsys):
    """Found in a review (2026-12-02): an evaluation that crashed after an earlier checkpoint left a traceback alone."""
    crash_training_at(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="simulated"):
        train_main(tiny_args(tmp_path, "crashed", max_steps=6))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train]")]
    assert len(lines) == 1 and "failed (RuntimeError) at step 3; no drafter written" in lines[0], lines
    resume = re.search(r"RESUME=(\S+)", lines[0]).group(1)
    assert Path(resume) == tmp_path / "out" / "tiny" / "crashed" / "checkpoints" / "last.ckpt" and Path(resume).exists()
    # no save at a crash: the line says where its resume starts (it named last.ckpt as if it were step 3's)
    assert lines[0].endswith(f"RESUME={resume} (it continues from step 2, that checkpoint's: step 3 is trained again)")


def test_a_crash_after_the_first_step_before_any_checkpoint_says_so_beside_its_traceback(tmp_path, monkeypatch,
                                                                                          capsys):
    """A step trained is a run that started (its folder and logs stay): the line says that it failed and that there
    is nothing to resume, not a traceback alone."""
    crash_training_at(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="simulated"):
        train_main(tiny_args(tmp_path, "crashed", max_steps=4, every=4))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train]")]
    assert lines == ["[train] failed (RuntimeError) at step 1; no drafter written; no checkpoint was written yet, so "
                     "nothing can be resumed; start it again (the same command)"], lines
    assert (tmp_path / "out" / "tiny" / "crashed" / "config.yaml").is_file()


def blow_up_update(monkeypatch, step: int) -> None:
    """The optimizer update that makes step `step` leaves NaN weights, with a finite loss and gradient, as a too-large
    learning rate can: only the next step's loss would show it."""
    checked = DistillModule.on_before_optimizer_step

    def poisoned(self, optimizer):
        checked(self, optimizer)  # the loss and gradient checks pass
        if self.global_step == step - 1:
            for parameter in self.drafter.parameters():
                parameter.grad = torch.full_like(parameter, math.nan)

    monkeypatch.setattr(DistillModule, "on_before_optimizer_step", poisoned)


def test_weights_blown_up_by_the_last_update_exit_non_zero_and_export_nothing(tmp_path, monkeypatch, capsys):
    """No next step's loss shows it: before, the run exited 0 and exported a drafter of NaNs. last.ckpt holds them
    too, so the line names the newest checkpoint that loads with finite weights (each is checked)."""
    blow_up_update(monkeypatch, step=4)
    assert train_main(tiny_args(tmp_path, "blown", max_steps=4)) == 1
    run_dir = tmp_path / "out" / "tiny" / "blown"
    (line,) = error_lines(capsys)
    assert line.startswith("error: training ended at step 4 with ") and "holding NaN or inf: no drafter exported" in line
    good = run_dir / "checkpoints" / "step-2.ckpt"
    named = (f"the newest checkpoint with finite weights is {good} (make eval/export take it: CKPT={good}; "
             f"make train RESUME={good} continues from it)")
    assert line.endswith(named)
    assert not (run_dir / "drafter").exists()
    last = run_dir / "checkpoints" / "last.ckpt"
    assert newest_finite_checkpoint(run_dir) == good and is_checkpoint(last)

    # Resuming the NaN weights of last.ckpt stops before a step, with the same pointer, and config.yaml unchanged
    # (before, the resumed run's first loss was NaN, after config.yaml took this launch's overrides).
    config = (run_dir / "config.yaml").read_text()
    resume_last = ["--recipe", "tiny", "--resume", "last", "--output-root", str(tmp_path / "out"), "--trainer.max_steps=8"]
    assert train_main(resume_last) == 1
    (line,) = error_lines(capsys)
    assert line.startswith(f"error: --resume: {last} holds NaN or inf in ") and "not resumed; " in line
    assert line.endswith(named)
    assert (run_dir / "config.yaml").read_text() == config
    assert torch.load(last, weights_only=False)["global_step"] == 4 and not (run_dir / "drafter").exists()
    # from the finite checkpoint the run goes on (the poisoned update was step 4's; it is redone unpoisoned)
    monkeypatch.undo()
    assert train_main(["--resume", str(good), "--output-root", str(tmp_path / "out")]) == 0
    assert torch.load(last, weights_only=False)["global_step"] == 4
    assert non_finite_tensors(drafter_from_checkpoint(last)) == 0


def test_a_nan_loss_after_a_checkpoint_of_nan_weights_does_not_call_that_checkpoint_good(tmp_path, monkeypatch, capsys):
    """The update of step 2 blows the weights up; step 2 is evaluated and saved (ranked last, but the only one), and
    step 3's loss is NaN. The checkpoint written before the stop is not a good one: the line says none is."""
    blow_up_update(monkeypatch, step=2)
    assert train_main(tiny_args(tmp_path, "nan", max_steps=6)) == 1
    run_dir = tmp_path / "out" / "tiny" / "nan"
    (line,) = error_lines(capsys)
    assert line.startswith("error: training stopped at step 2: the loss is nan; ")
    assert line.endswith(f"no checkpoint of {run_dir} has finite weights: start again (a lower model.lr?)")
    assert is_checkpoint(run_dir / "checkpoints" / "last.ckpt")


def test_a_fresh_run_that_fails_after_its_first_step_keeps_its_folder_and_logs(tmp_path, monkeypatch, capsys):
    """Only a run that failed before any step leaves no folder (remove_unstarted_run): one that trained a step and
    failed before its first checkpoint (here its first update left NaN weights, and the next loss was NaN; an
    evaluation out of memory as well) keeps its folder: its logs say what went wrong."""
    blow_up_update(monkeypatch, step=1)
    assert train_main(tiny_args(tmp_path, "one-step", max_steps=4, every=4)) == 1
    (line,) = error_lines(capsys)
    assert line.startswith("error: training stopped at step 1: the loss is nan; "), line
    run_dir = tmp_path / "out" / "tiny" / "one-step"
    assert (run_dir / "config.yaml").is_file() and not (run_dir / "checkpoints").exists()
    assert (run_dir / "csv" / "version_0").is_dir() and list((run_dir / "tensorboard" / "version_0").glob("events.*"))


def test_a_checkpoint_save_that_runs_out_of_disk_keeps_the_last_whole_one_and_says_so(tmp_path, monkeypatch, capsys):
    """Lightning staged a checkpoint in $TMPDIR and moved it: across filesystems a copy, which a full disk left as a
    truncated step-N.ckpt under its final name. The save of step 4 runs out of space half-way: no step-4.ckpt, no
    staging file, last.ckpt still step 2's and whole, one line; the resume goes on from it, and a staging file a
    killed save left is removed as the run starts."""
    real_save = torch.save

    def disk_fills(obj, handle, *args, **kwargs):
        if isinstance(obj, dict) and "drafter_config" in obj and obj["global_step"] == 4:  # step-4.ckpt, saved first
            handle.write(b"PK half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills)
    assert train_main(tiny_args(tmp_path, "full", max_steps=4)) == 2
    checkpoints = tmp_path / "out" / "tiny" / "full" / "checkpoints"
    (line,) = error_lines(capsys)
    assert line == (f"error: cannot write the checkpoint {checkpoints / 'step-4.ckpt'}: No space left on device; the "
                    "previous checkpoints are whole: make room and resume the run (--resume <run folder>)")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.ckpt", "last.ckpt", "step-2.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 2
    monkeypatch.undo()

    # what saves killed half-way leave: in checkpoints/, and in the run folder (SLURM's hpc_ckpt_N.ckpt is saved there)
    killed = [checkpoints / ".saving-checkpoint-k1lled", checkpoints.parent / ".saving-checkpoint-hpc"]
    for path in killed:
        path.write_bytes(b"PK a save killed half-way")
    assert train_main(["--resume", str(checkpoints.parent), "--output-root", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    for path in killed:
        assert f"removed {path}: a save the last launch did not finish" in out and not path.exists()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.ckpt", "last.ckpt", "step-4.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 4


def test_a_resume_from_a_checkpoint_the_user_names_says_nothing_of_the_newest_readable_one(tmp_path, monkeypatch,
                                                                                            capsys):
    """The line that an unreadable newer checkpoint was passed over is a run folder's resume's, or one naming the
    checkpoint it takes: said of an older checkpoint given by hand, it called that one the run's newest readable,
    while step-4.ckpt was there whole."""
    assert train_main([*tiny_args(tmp_path, "r", max_steps=4), "--checkpoint.save_top_k=-1"]) == 0
    checkpoints = tmp_path / "out" / "tiny" / "r" / "checkpoints"
    (checkpoints / "last.ckpt").write_bytes((checkpoints / "last.ckpt").read_bytes()[:1000])  # a save cut short

    def stop(cli, run_dir):  # right after the lines a resume starts with
        raise training.train.DDTreeError("stopped after the start's lines")

    monkeypatch.setattr(training.train, "write_run_corpus", stop)
    capsys.readouterr()
    for named, passed_over in ((checkpoints / "step-2.ckpt", False), (checkpoints.parent, True)):
        assert train_main(["--resume", str(named), "--output-root", str(tmp_path / "out")]) == 2
        said = capsys.readouterr().out
        assert ("[train] " + str(checkpoints / "last.ckpt") + " is unreadable" in said) == passed_over, said
        taken = named if not passed_over else checkpoints / "step-4.ckpt"
        assert f"[train] recipe tiny -> {checkpoints.parent} (resuming {taken})" in said, said


def test_a_moved_run_resumes_into_its_new_folder(tmp_path, caplog, recwarn):
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    assert train_main(tiny_args(tmp_path, "first", max_steps=2)) == 0
    logged = [record.getMessage() for record in caplog.records]
    assert any("GPU available" in line for line in logged)  # Lightning's own lines are there,
    assert not any("Tip:" in line for line in logged)  # but not its advertisement,
    assert not any("LeafSpec" in str(warning.message) for warning in recwarn)  # nor its deprecated pytree call
    original = tmp_path / "out" / "tiny" / "first"
    # config.yaml records where the run checkpointed, which the copy's resume must not follow back to the original
    assert yaml.safe_load((original / "config.yaml").read_text())["checkpoint"]["dirpath"] == str(original / "checkpoints")
    moved_root = tmp_path / "elsewhere"
    shutil.copytree(original, moved_root / "tiny" / "first", symlinks=True)
    before = files_as_they_are(original)

    assert train_main(["--recipe", "tiny", "--resume", str(moved_root / "tiny" / "first"), "--output-root",
                       str(moved_root), "--trainer.max_steps=4", "--trainer.enable_progress_bar=false"]) == 0
    moved = moved_root / "tiny" / "first"
    assert (moved / "csv" / "version_1").is_dir() and (moved / "tensorboard" / "version_1").is_dir()
    # Nothing beside either run folder: the evaluations (eval/) follow trainer.default_root_dir, not the loggers
    assert [path.name for path in (tmp_path / "out" / "tiny").iterdir()] == ["first"]
    assert [path.name for path in (moved_root / "tiny").iterdir()] == ["first"]
    assert files_as_they_are(original) == before  # the original is untouched: no file added, removed or rewritten
    assert yaml.safe_load((moved / "config.yaml").read_text())["checkpoint"]["dirpath"] == str(moved / "checkpoints")
    assert saved_step(moved / "checkpoints" / "last.ckpt") == 4


def files_as_they_are(folder: Path) -> dict:
    """Each path under `folder`: its modification time and its bytes (a link: where it points; a folder: nothing)."""
    return {path.relative_to(folder): (path.lstat().st_mtime_ns, os.readlink(path) if path.is_symlink()
                                       else path.read_bytes() if path.is_file() else None)
            for path in folder.rglob("*")}


def test_a_run_stopped_before_its_first_checkpoint_starts_again_under_its_name(tmp_path, capsys, monkeypatch):
    """Its stop line says to start it again; the same command refused, the folder "already holds a run", and
    --resume found no checkpoint: a dead end under the README's own --run name."""
    run_dir = tmp_path / "out" / "tiny" / "try1"
    (run_dir / "tensorboard" / "version_0").mkdir(parents=True)  # what a run Ctrl-C'd at step 0 leaves
    (run_dir / "config.yaml").write_text("a run that never saved\n")
    (run_dir / "checkpoints").mkdir()  # ...or one killed during its first save: not a checkpoint, removed at the start
    (run_dir / "checkpoints" / ".saving-checkpoint-k1lled").write_bytes(b"PK half a checkpoint")
    assert train_main(tiny_args(tmp_path, "try1", max_steps=2, every=2)) == 0
    assert "holds a run stopped before its first checkpoint: starting it again" in capsys.readouterr().out
    assert not (run_dir / "checkpoints" / ".saving-checkpoint-k1lled").exists()
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    assert train_main(tiny_args(tmp_path, "try1", max_steps=2)) == 2  # one with checkpoints is kept
    assert "already holds a run; pick another --run or use --resume" in capsys.readouterr().err
    with monkeypatch.context() as env:  # on another node's processes too: they waited for rank 0, then a traceback
        env.setenv("RANK", "3")
        assert train_main(tiny_args(tmp_path, "try1", max_steps=2)) == 2
        assert "already holds a run; pick another --run or use --resume" in capsys.readouterr().err
    requeued = tmp_path / "out" / "tiny" / "requeued"  # SLURM's requeue checkpoint sits beside checkpoints/
    requeued.mkdir()
    (requeued / "config.yaml").write_text("a requeued run\n")
    (requeued / "hpc_ckpt_1.ckpt").write_bytes(b"weights")
    assert train_main(tiny_args(tmp_path, "requeued", max_steps=2)) == 2
    assert "already holds a run" in capsys.readouterr().err and (requeued / "hpc_ckpt_1.ckpt").read_bytes() == b"weights"


def stop_at_the_build(monkeypatch) -> list[Path]:
    """Launches that stop with one line where they would build the model: the run folders that got that far."""
    reached = []

    def build_cli(config, run_dir, overrides, checkpoint=None, saved=None):
        reached.append(run_dir)
        raise training.train.DDTreeError("stopped at the build")

    monkeypatch.setattr(training.train, "build_cli", build_cli)
    return reached


def test_a_second_launch_into_a_run_folder_still_training_is_refused(tmp_path, capsys, monkeypatch):
    """The same --run-name twice: the second launch said "starting it again" and trained in the first one's folder,
    overwriting its checkpoints, config.yaml and drafter/; a --resume of a run still training did the same."""
    reached = stop_at_the_build(monkeypatch)
    run_dir = tmp_path / "out" / "tiny" / "live"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("the first launch's\n")  # no checkpoint yet
    in_use = (f"error: run folder {run_dir} is in use by another launch that is still running (it holds .train.lock): "
              "stop it or wait for it to end; a new run can take another --run")
    # the first launch's rank 0 holds it while it trains, through the launch's own lock: a lock taken by hand here
    # would refuse a second launch even if the launches' locks let each other in (a shared one, say)
    with training.train.hold_run_folder(run_dir):
        assert train_main(tiny_args(tmp_path, "live", max_steps=2)) == 2
        assert error_lines(capsys) == [in_use] and not reached
        assert (run_dir / "config.yaml").read_text() == "the first launch's\n"
        with monkeypatch.context() as env:  # the first launch's other ranks share its folder: not refused
            env.setenv("RANK", "1")
            assert train_main(tiny_args(tmp_path, "live", max_steps=2)) == 2
            assert error_lines(capsys) == ["error: stopped at the build"] and reached == [run_dir]
        (run_dir / "checkpoints").mkdir()
        torch.save({key: {} for key in RESUME_KEYS}, run_dir / "checkpoints" / "last.ckpt")
        resume = ["--output-root", str(tmp_path / "out"), "--resume", str(run_dir)]
        assert train_main(resume) == 2
        assert error_lines(capsys) == [in_use] and reached == [run_dir]
    assert train_main(resume) == 2  # the first launch ended (or was killed): its lock went with it
    assert error_lines(capsys) == ["error: stopped at the build"] and reached == [run_dir, run_dir]


def test_a_resume_given_a_run_name_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """Found in a review (2026-12-05): --resume continues the run in its own folder, and a --run-name beside it was
    ignored without a word. Branching into a new folder with `--resume <run>/checkpoints/step-N.ckpt --run-name b`
    continued the run itself instead: its later checkpoints moved aside, its drafter/ replaced at the end."""
    reached = stop_at_the_build(monkeypatch)
    run_dir = tmp_path / "out" / "tiny" / "first"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("the run's\n")
    torch.save({key: {} for key in RESUME_KEYS}, run_dir / "checkpoints" / "last.ckpt")
    before = sorted(tmp_path.rglob("*"))
    for given in (["--run-name", "branch"], ["--run=branch"]):
        assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(run_dir), *given]) == 2
        assert error_lines(capsys) == [
            "error: --resume continues a run in its own folder, so --run-name branch would be ignored: drop --run-name "
            "to continue the run; to train a new run branch from one of its checkpoints, export it (python -m "
            "training.export <checkpoint> <folder>) and start that run with --model.init_from=<folder> --run-name branch"]
    assert not reached and sorted(tmp_path.rglob("*")) == before  # no folder `branch`, not even the run's lock file


def test_default_run_names_taken_in_the_same_second_are_two_folders(tmp_path, capsys, monkeypatch):
    """A sweep started with `&`: two launches in one second got one timestamp, and trained into one folder."""
    reached = stop_at_the_build(monkeypatch)
    monkeypatch.setattr(training.train.time, "strftime", lambda form: "20250101-000000")
    first = tmp_path / "out" / "tiny" / "20250101-000000"
    first.mkdir(parents=True)
    (first / "config.yaml").write_text("the first launch's\n")
    args = tiny_args(tmp_path, "unused", max_steps=2)
    del args[args.index("--run"):args.index("--run") + 2]  # the default name
    assert train_main(args) == 2
    assert reached == [first.parent / "20250101-000000-2"]
    assert not reached[0].exists() and (first / "config.yaml").read_text() == "the first launch's\n"


def with_data(args: list[str], data: Path | str) -> list[str]:
    return [f"--data.data_path={data}" if a.startswith("--data.data_path") else a for a in args]


def unreadable_data(tmp_path: Path) -> Path:
    """A data file that exists, so it passes the launch's early check, and fails as it is read (inside the fit)."""
    path = tmp_path / "broken.jsonl"
    path.write_text("this is not json\n")
    return path


@pytest.mark.parametrize("extra", [[], ["--model.corpus=true"]])  # model.corpus reads the data before fit
def test_a_start_that_fails_on_its_data_leaves_no_run_folder(tmp_path, capsys, extra):
    args = with_data(tiny_args(tmp_path, "bad", max_steps=2), unreadable_data(tmp_path)) + extra
    assert train_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.jsonl" in err[0], err
    assert not (tmp_path / "out").exists()  # nor the <output-root>/<recipe>/ folders made for it


def test_a_failed_start_under_a_default_name_leaves_no_run_folder(tmp_path, capsys, monkeypatch):
    """The stamped folder is this launch's own (stamped_run_folder makes it, so it exists before the launch checks
    what it made): a start that failed left it behind, empty but for its lock, beside the runs of the recipe."""
    stop_at_the_build(monkeypatch)
    recipe_root = tmp_path / "out" / "tiny"
    launch = ["--recipe", "tiny", "--output-root", str(tmp_path / "out")]
    assert train_main(launch) == 2
    assert error_lines(capsys) == ["error: stopped at the build"] and not (tmp_path / "out").exists()
    (recipe_root / "older").mkdir(parents=True)
    assert train_main(launch) == 2
    assert error_lines(capsys) == ["error: stopped at the build"]
    assert [path.name for path in recipe_root.iterdir()] == ["older"]


def test_a_failed_start_in_a_folder_that_was_there_keeps_the_folders_own_files(tmp_path, capsys, monkeypatch):
    """--run names a folder the user made (notes in it): the failure removes what the launch wrote, nothing else. A
    corpus.safetensors it left would be kept by the next launch there as its own, from whatever data it reads."""
    run_dir = tmp_path / "out" / "tiny" / "mine"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("keep me")
    args = with_data(tiny_args(tmp_path, "mine", max_steps=2), unreadable_data(tmp_path)) + ["--model.corpus=true"]
    assert train_main(args) == 2
    assert (run_dir / "notes.txt").read_text() == "keep me" and not (run_dir / "config.yaml").exists()

    crash_training_at(monkeypatch, None)  # after the corpus is written, before the first step
    with pytest.raises(RuntimeError, match="simulated"):
        train_main([*tiny_args(tmp_path, "mine", max_steps=2), "--model.corpus=true"])
    assert "training replies written to" in capsys.readouterr().out
    assert (run_dir / "notes.txt").read_text() == "keep me" and not (run_dir / "corpus.safetensors").exists()
    assert not (run_dir / "config.yaml").exists()


@pytest.mark.parametrize("field, given, problem", [
    ("data.data_path", "no/such.jsonl", "no such file"), ("eval.prompts", "no/such.jsonl", "no such file"),
    ("eval.prompts", "a-folder", "a folder, not a file"),  # passed the check, to fail at the first eval; then "no such file"
])
def test_a_missing_input_file_is_named_as_the_recipe_is_read(tmp_path, capsys, monkeypatch, field, given, problem):
    monkeypatch.setattr(training.train, "prepare_recipe_data", lambda *args: pytest.fail("went on to the data"))
    (tmp_path / "a-folder").mkdir()
    args = tiny_args(tmp_path, "missing", max_steps=2) + [f"--{field}={tmp_path / given}"]
    assert train_main(args) == 2
    (line,) = error_lines(capsys)
    assert f"{field}={tmp_path / given}: {problem}" in line, line
    assert not (tmp_path / "out").exists()


def test_a_warm_start_from_no_drafter_folder_is_named_as_the_recipe_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(training.train, "prepare_recipe_data", lambda *args: pytest.fail("went on to the data"))
    (tmp_path / "empty").mkdir()
    assert train_main(tiny_args(tmp_path, "warm", max_steps=2) + [f"--model.init_from={tmp_path / 'empty'}"]) == 2
    (line,) = error_lines(capsys)
    assert f"model.init_from: drafter '{tmp_path / 'empty'}' is not a folder with a config.json" in line, line


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_a_resume_keeps_the_runs_target_adapter_by_its_files(tmp_path, capsys):
    """A resume with model.target_adapter=null trained on against the base model, and config.yaml then said null; one
    with the adapter retrained in place went on as silently (checkpoints kept the path alone). A copy of the same
    files at another path (a node's own disk) is the same adapter."""
    from peft import LoraConfig, get_peft_model

    from ddtree.targets import load_target

    def save_adapter(path, seed):
        torch.manual_seed(seed)
        config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
        get_peft_model(load_target("tiny-random")[0], config).save_pretrained(path)

    save_adapter(tmp_path / "adapter", 0)
    assert train_main(tiny_args(tmp_path, "adapted", max_steps=2) + [f"--model.target_adapter={tmp_path / 'adapter'}"]) == 0
    run_dir = tmp_path / "out" / "tiny" / "adapted"
    before = (run_dir / "config.yaml").read_text()
    resume = ["--output-root", str(tmp_path / "out"), "--resume", str(run_dir), "--trainer.enable_progress_bar=false"]
    # ddtree bench loads no adapter: its printed command, run against the bare target, would measure another tau
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("[train] drafter written to") and "` with --target the target merged with " \
        "model.target_adapter (ddtree loads no adapter; the export's card shows the merge)" in last, last
    assert train_main([*resume, "--trainer.max_steps=4", "--model.target_adapter=null"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"error: --resume: the checkpoint's run has target_adapter "
                                                   f"{tmp_path / 'adapter'} (this launch: None): "), lines
    assert "drop model.target_adapter from the command" in lines[0] and (run_dir / "config.yaml").read_text() == before
    shutil.copytree(tmp_path / "adapter", tmp_path / "copy")
    assert train_main([*resume, "--trainer.max_steps=4", f"--model.target_adapter={tmp_path / 'copy'}"]) == 0
    save_adapter(tmp_path / "copy", 1)  # retrained where the run now reads it
    capsys.readouterr()
    assert train_main([*resume, "--trainer.max_steps=6"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0] == (
        f"error: --resume: the checkpoint's run trained against target adapter {tmp_path / 'copy'} as its files were "
        "then, and they have changed since (retrained?): a resume keeps the run's target; put back the adapter it "
        "trained against, or start a new run"), lines


def test_a_warm_started_lora_run_resumes_to_the_uninterrupted_weights_without_its_init_from_folder(tmp_path,
                                                                                                   tiny_target,
                                                                                                   monkeypatch):
    """Its checkpoint holds every drafter weight, LoRA's frozen base too, yet a resume read model.init_from again: with
    the folder moved or deleted it stopped, and its advice ("or null") was then refused for LoRA."""
    from ddtree.modeling_dflash import DFlashDraftModel
    from ddtree.targets import build_drafter_config

    target, tokenizer = tiny_target
    folder = tmp_path / "base"
    torch.manual_seed(0)
    DFlashDraftModel(build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=8,
                                          target_layer_ids=[1, 3, 4])).save_pretrained(folder)
    lora = [f"--model.init_from={folder}", "--model.lora_rank=4"]
    assert train_main(tiny_args(tmp_path, "straight", max_steps=4) + lora) == 0

    class StopAtStep2(Callback):  # not max_steps=2, which would give the cosine schedule another length
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step >= 2

    build_cli = training.train.build_cli

    def stopping_at_step_2(*args):
        cli = build_cli(*args)
        cli.trainer.callbacks.insert(0, StopAtStep2())
        return cli

    with monkeypatch.context() as patched:
        patched.setattr(training.train, "build_cli", stopping_at_step_2)
        assert train_main(tiny_args(tmp_path, "resumed", max_steps=4) + lora) == 0
    shutil.rmtree(folder)
    runs = tmp_path / "out" / "tiny"
    assert torch.load(runs / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(runs / "resumed"),
                       "--trainer.enable_progress_bar=false"]) == 0
    resumed, straight = (torch.load(runs / run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
                         for run in ("resumed", "straight"))
    assert torch.load(runs / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    assert resumed.keys() == straight.keys() and any("base_layer" in key for key in resumed)
    for key, weight in straight.items():  # the frozen base as the adapters
        assert torch.equal(resumed[key], weight), key


def test_a_resume_refused_at_restore_leaves_config_yaml_as_it_was(tmp_path, capsys):
    assert train_main(tiny_args(tmp_path, "kept", max_steps=2)) == 0
    run_dir = tmp_path / "out" / "tiny" / "kept"
    before = (run_dir / "config.yaml").read_text()
    resume = ["--recipe", "tiny", "--output-root", str(tmp_path / "out"), "--resume", str(run_dir),
              "--trainer.max_steps=4", "--trainer.enable_progress_bar=false"]
    capsys.readouterr()
    # Another split of the data: only the restore of the checkpoint's loader position refuses it.
    assert train_main([*resume, "--data.val_fraction=0.3"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "resume with the same data and devices" in lines[0], lines
    assert (run_dir / "config.yaml").read_text() == before
    # Another drafter: a shape was a load_state_dict traceback, a block size trained on silently under the run's name.
    for overrides, named in [
        (["--model.num_layers=2"], "num_hidden_layers 1 (this launch: 2): a resume keeps the run's drafter, data split, "
                                   "optimizer and loss; drop model.num_layers from the command"),
        # an unset gamma follows the block size: the block size alone is named
        (["--model.block_size=4"], "block_size 8 (this launch: 4): a resume keeps the run's drafter, data split, "
                                   "optimizer and loss; drop model.block_size from the command"),
        (["--model.block_size=4", "--model.gamma=3.0"], "block_size 8 (this launch: 4); gamma 4.0 (this launch: 3.0): a "
                                                        "resume keeps the run's drafter, data split, optimizer and loss; "
                                                        "drop model.block_size, model.gamma from the command"),
        # Lightning restores the optimizer: the new rate went unused, while config.yaml and the model card recorded it
        (["--model.lr=1e-5"], "lr 0.003 (this launch: 1e-05): a resume keeps the run's drafter, data split, optimizer "
                              "and loss; drop model.lr from the command"),
    ]:
        assert train_main([*resume, *overrides]) == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and lines[0].startswith("error: --resume: the checkpoint's run has "), lines
        assert named in lines[0], lines
        assert (run_dir / "config.yaml").read_text() == before
    # LoRA adapts a warm start, which this run is not: refused as the module is built, before the checkpoint is read
    assert train_main([*resume, "--model.lora_rank=2"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: model.lora_rank=2 adapts a trained drafter"), lines
    assert (run_dir / "config.yaml").read_text() == before
    # A file no export writes in drafter/ (a bench's results.json, say): the export at the end refused it after the
    # whole training and left the last leg's drafter; now refused before any step
    weights = (run_dir / "drafter" / "model.safetensors").read_bytes()
    (run_dir / "drafter" / "results.json").write_text("{}")
    assert train_main(resume) == 2
    lines = error_lines(capsys)
    assert lines == [f"error: --resume: {run_dir / 'drafter'} holds results.json, which no export writes and the run's "
                     "export at the end would delete: move them out of it, then resume"], lines
    assert (run_dir / "config.yaml").read_text() == before and not list((run_dir / "checkpoints").glob("step-4*"))
    assert (run_dir / "drafter" / "model.safetensors").read_bytes() == weights
    (run_dir / "drafter" / "results.json").unlink()
    # Other conversations of the same count: the loader's count matched, and the run trained on them silently.
    other = toy_data.write_conversations(tmp_path / "other.jsonl", 24, 30, 60, seed=5)
    assert train_main([*resume, f"--data.data_path={other}"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"error: --resume: data.data_path={other} holds other conversations "
                                                   "than the run trained on (tokenized, they hash to "), lines
    assert (run_dir / "config.yaml").read_text() == before
    assert train_main(resume) == 0  # so the plain resume still works
    assert "max_steps: 2" in before and "max_steps: 4" in (run_dir / "config.yaml").read_text()
    # A DeepSpeed checkpoint (a folder of shards) under another strategy: Lightning's IsADirectoryError traceback.
    last = run_dir / "checkpoints" / "last.ckpt"
    last.unlink()
    (last / "checkpoint").mkdir(parents=True)
    (last / "latest").write_text("checkpoint")
    capsys.readouterr()
    assert train_main([*resume, "--trainer.max_steps=6"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0] == (
        f"error: --resume: {last} is a DeepSpeed checkpoint (a folder of per-rank shards) and this launch's strategy is "
        "SingleDeviceStrategy: resume it under the run's DeepSpeed strategy (drop the trainer.strategy override), or "
        "export it (make export) and start a new run from the drafter with model.init_from"), lines
    # A file that torch reads but Lightning cannot resume from (a KeyError traceback before), and one it cannot read.
    weights, text = run_dir / "checkpoints" / "weights.ckpt", run_dir / "checkpoints" / "notes.ckpt"
    torch.save({"w": torch.zeros(2)}, weights)
    text.write_text("not a checkpoint")
    for path, said in [(weights, f"error: --resume {weights} is not a training checkpoint of this project (it has no "
                                 "pytorch-lightning_version, global_step, loops, state_dict, drafter_config): give a "
                                 "run's last.ckpt, step-N.ckpt or hpc_ckpt_N.ckpt"),
                       (text, f"error: --resume {text} is not a checkpoint (not a file torch.save wrote); give its "
                              f"run folder {run_dir.resolve()} (its newest checkpoint)")]:
        assert train_main([*resume, "--resume", str(path)]) == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and lines[0].startswith(said), lines
    assert (run_dir / "config.yaml").read_text() == before.replace("max_steps: 2", "max_steps: 4")


def test_a_resumed_run_keeps_its_own_recipe(tmp_path, capsys, monkeypatch):
    assert train_main(tiny_args(tmp_path, "mine", max_steps=2)) == 0
    run_dir = tmp_path / "out" / "tiny" / "mine"
    # The recipe resolves data.data_path and data.feature_store `auto`: another recipe's would train on other data.
    prepared, prepare = [], training.train.prepare_recipe_data

    def recording(datamodule, recipe, *args, **kwargs):
        prepared.append(recipe)
        return prepare(datamodule, recipe, *args, **kwargs)

    monkeypatch.setattr(training.train, "prepare_recipe_data", recording)
    capsys.readouterr()
    assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(run_dir), "--trainer.max_steps=4",
                       "--trainer.enable_progress_bar=false"]) == 0
    assert prepared == ["tiny"]
    assert train_main(["--recipe", "smollm2-135m", "--output-root", str(tmp_path / "out"), "--resume", str(run_dir)]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "--recipe smollm2-135m" in lines[0] and "is a tiny run" in lines[0], lines
    assert prepared == ["tiny"]  # refused before anything was built


def test_a_run_moved_out_of_its_recipes_folder_resumes_under_the_recipe_given(tmp_path):
    """run_recipe: the <recipe>/ folder a run is in names its recipe; a run moved out of that layout takes --recipe's,
    which then prepares its data and goes into the resume line a stop prints (RECIPE=<the folder it was moved to>
    would not resume it), and without one it is refused in one line."""
    moved = tmp_path / "archive" / "first"
    assert training.train.run_recipe(moved, "tiny") == "tiny"
    with pytest.raises(training.train.DDTreeError, match=r"is not in a <recipe>/ folder, so its recipe is unknown; "
                                                         r"give it with --recipe$"):
        training.train.run_recipe(moved, None)
    assert training.train.run_recipe(tmp_path / "tiny" / "first", None) == "tiny"


def test_resuming_a_finished_run_says_so_and_keeps_its_drafter(tmp_path, capsys):
    """Lightning trains nothing past max_steps; the launch rewrote drafter/ and exited 0 without a word."""
    prompts = tmp_path / "prompts.jsonl"  # one prompt: eval.limit null evaluates every prompt of the file
    prompts.write_text((REPO / "data" / "eval_prompts.jsonl").read_text().splitlines()[0] + "\n")
    assert train_main([*tiny_args(tmp_path, "done", max_steps=2), f"--eval.prompts={prompts}", "--eval.limit=null"]) == 0
    run_dir = tmp_path / "out" / "tiny" / "done"
    # config.yaml keeps a null over a non-null default: dropped, every resume would evaluate eval.limit's default 8
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["eval"]["limit"] is None
    drafter = run_dir / "drafter" / "model.safetensors"
    written = drafter.stat().st_mtime_ns
    capsys.readouterr()
    resume = ["--output-root", str(tmp_path / "out"), "--resume", str(run_dir), "--trainer.enable_progress_bar=false"]
    assert train_main(resume) == 0
    assert f"[train] {run_dir} had already reached step 2 of max_steps 2: nothing trained" in capsys.readouterr().out
    assert drafter.stat().st_mtime_ns == written
    assert train_main([*resume, "--trainer.max_steps=3"]) == 0  # raised, it trains on and writes the drafter again
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3
    assert drafter.stat().st_mtime_ns != written
    # A spent time budget: the Timer's elapsed time is restored, so raising max_steps (as the line said) trained nothing
    timed = [*resume, "--trainer.max_steps=10000", "--trainer.max_time=00:00:00:01"]
    assert train_main(timed) == 0  # trains for its second, and its checkpoint holds the Timer's spent budget
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    capsys.readouterr()
    assert train_main(timed) == 0
    assert (f"[train] {run_dir} stopped at step {step} of max_steps 10000 by its time or epoch limit: nothing trained, "
            "its drafter/ kept; raise --trainer.max_time (or --trainer.max_epochs)") in capsys.readouterr().out
    # With no step limit (max_steps -1, the schedule ending with max_epochs) every step is at or past it: only the time
    # budget can have stopped the run, and the line must not send the user to raise a step limit there is none of
    unlimited = [*timed[:-2], "--trainer.max_steps=-1", "--trainer.max_epochs=1000", "--trainer.max_time=00:00:00:01"]
    assert train_main(unlimited) == 0
    assert (f"[train] {run_dir} stopped at step {step} of max_steps -1 by its time or epoch limit: nothing trained, "
            "its drafter/ kept; raise --trainer.max_time (or --trainer.max_epochs)") in capsys.readouterr().out


def test_the_bench_command_printed_at_the_end_reproduces_the_logged_tau(tmp_path, capsys):
    """It printed `ddtree bench --drafter <run>/drafter`, which stops at once for want of --prompts (found in a review):
    it now carries the run's eval settings, and run as printed it measures what the last evaluation logged."""
    from ddtree.cli import main as ddtree_main

    # fp32 given: the tiny recipe's precision auto is bf16-mixed where this machine computes bf16 fast (an AVX512-BF16
    # EPYC), and the command then names bfloat16, as it should
    args = [*tiny_args(tmp_path, "hint", max_steps=2), "--eval.budgets=[4,8]", "--eval.primary_budget=8",
            "--eval.lookup=2", "--eval.packed_weights=off", "--trainer.precision=32-true"]
    assert train_main(args) == 0
    run_dir = tmp_path / "out" / "tiny" / "hint"
    said = re.search(r"\[train\] drafter written to (\S+): the last step's weights; `([^`]+)` measures them as the "
                     "training-time evaluation did", capsys.readouterr().out)
    assert said and said.group(1) == str(run_dir / "drafter")
    words = shlex.split(said.group(2))
    assert Path(words[0]).name == "ddtree" and words[1] == "bench"
    for flag, value in (("--drafter", str(run_dir / "drafter")), ("--target", "tiny-random"), ("--dtype", "float32"),
                        ("--prompts", "data/eval_prompts.jsonl"), ("--limit", "1"), ("--max-new-tokens", "4"),
                        ("--budgets", "4,8"), ("--lookup", "2")):
        assert words[words.index(flag) + 1] == value, flag
    assert "--redraft" not in words  # eval.redraft left to the drafter, as bench leaves it
    out = tmp_path / "bench.json"
    assert ddtree_main([*words[1:], "--packed-weights", "off", "--out", str(out)]) == 0
    logged = json.loads((run_dir / "eval" / "step-000002.json").read_text())["summary"]
    measured = json.loads(out.read_text())["summary"]
    assert set(measured) == set(logged) == {"dflash", "ddtree@4", "ddtree@8"}
    for key in logged:
        assert measured[key]["tau"] == logged[key]["tau"], key


def test_the_bench_command_carries_the_target_dtype_and_a_lookup_or_redraft_of_0(tmp_path):
    """The settings the run above leaves at their defaults: model.target_dtype over the precision's dtype (training ran
    the target in it), eval.lookup 0 and eval.redraft 2 (0 is not the drafter's default: bench left without --lookup
    grafts the lookup a corpus drafter's config names), eval.limit null (every prompt, as bench without --limit)."""
    evaluation = AcceptanceEvaluation(prompts="p.jsonl", budgets=[8], primary_budget=8, limit=None, lookup=0, redraft=2)
    cli = SimpleNamespace(model=SimpleNamespace(hparams=SimpleNamespace(target="tiny-random", target_dtype="bfloat16")),
                          trainer=SimpleNamespace(precision="32-true", callbacks=[evaluation]))
    words = shlex.split(training.train.bench_command(cli, tmp_path / "drafter"))
    for flag, value in (("--dtype", "bfloat16"), ("--lookup", "0"), ("--redraft", "2"), ("--budgets", "8")):
        assert words[words.index(flag) + 1] == value, (flag, words)
    assert "--limit" not in words, words


def test_a_run_folder_on_a_filesystem_without_locks_trains_unguarded_and_says_so(tmp_path, monkeypatch, capsys):
    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(training.train.fcntl, "flock", no_locks)
    with training.train.hold_run_folder(tmp_path / "run"):
        pass
    assert capsys.readouterr().err == (f"[train] cannot lock {tmp_path / 'run' / '.train.lock'} (No locks available): "
                                       f"a second launch into {tmp_path / 'run'} would not be refused\n")


def test_a_failed_start_keeps_a_folder_holding_a_checkpoint_and_folders_above_that_hold_another_run(tmp_path):
    """remove_unstarted_run: a folder that holds a checkpoint keeps its config.yaml (a resume reads it); of the folders
    a launch made, one another run has written into since stays, and so do those above it."""
    run_dir = tmp_path / "out" / "tiny" / "mine"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_text("a checkpoint")
    (run_dir / "config.yaml").write_text("model: {}\n")
    training.train.remove_unstarted_run(run_dir, 0, [])
    assert (run_dir / "config.yaml").is_file()

    fresh = tmp_path / "out" / "tiny" / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("model: {}\n")
    training.train.remove_unstarted_run(fresh, 0, [fresh, fresh.parent, fresh.parent.parent])
    assert not fresh.exists() and (run_dir / "config.yaml").is_file()


def test_the_bench_command_of_a_run_started_outside_the_checkout_names_the_console_script_whole(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = SimpleNamespace(model=SimpleNamespace(hparams=SimpleNamespace(target="tiny-random", target_dtype="float32")),
                          trainer=SimpleNamespace(precision="32-true", callbacks=[]))
    script = Path(sys.executable).parent / "ddtree"
    words = shlex.split(training.train.bench_command(cli, tmp_path / "drafter"))
    assert words[0] == (str(script.absolute()) if script.is_file() else "ddtree")


def test_the_make_args_of_a_printed_command_reach_the_recipe_as_given(tmp_path):
    """make_words quotes the overrides that the multi-process refusal prints as `make features ... ARGS="..."`: pasted
    into a shell, make must hand its recipe the same words. Without `$` doubled for make, a data path under
    `/data/$USER/...` reached the build as `/data/SER/...` (make expands `$U`)."""
    words = ["--data.data_path=/tmp/a $USER b", "it's", 'say "hi"', "back\\slash", "`date`", "$(x) ${y}", "100%"]
    makefile = tmp_path / "Makefile"
    makefile.write_text("show:\n\t@printf '<%s>\\n' $(ARGS)\n")
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    shown = subprocess.run(["bash", "-c", f"make -s -f {shlex.quote(str(makefile))} show "
                                          f"ARGS={training.train.make_words(words)}"],
                           env=make_env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [f"<{word}>" for word in words]


def test_a_finished_distributed_run_closes_its_process_group(tmp_path, recwarn):
    """Left to the interpreter's exit, a finished ZeRO-2 rank once aborted there (exit 134, "terminate called without
    an active exception", in a full `make test`), and NCCL warns on every rank. One process under `ddp` opens a group
    here too: both ends of a run that finished (trained, and a resume with nothing left to train) close it.

    Validated under a process group, the run gets none of Lightning's 16 warnings to log the validation metrics with
    sync_dist=True: DistillModule logs them already summed over the ranks (found in a review, 2026-12-03)."""
    args = [*tiny_args(tmp_path, "ddp", max_steps=2), "--trainer.strategy=ddp", "--trainer.devices=1",
            "--trainer.val_check_interval=2"]
    lightning_result.warning_cache.clear()  # Lightning warns once a process: an earlier test's run may have
    try:
        with mock.patch.dict(os.environ):  # Lightning sets LOCAL_RANK, MASTER_PORT, ...: not for this worker's next tests
            assert train_main(args) == 0
            with open(tmp_path / "out" / "tiny" / "ddp" / "csv" / "version_0" / "metrics.csv") as f:
                assert any(row.get("val/loss") for row in csv.DictReader(f))  # validated
            assert not [str(w.message) for w in recwarn if "sync_dist" in str(w.message)]
            assert not torch.distributed.is_initialized()
            resume = ["--output-root", str(tmp_path / "out"), "--resume", str(tmp_path / "out" / "tiny" / "ddp"),
                      "--trainer.enable_progress_bar=false"]
            assert train_main(resume) == 0
            assert not torch.distributed.is_initialized()
    finally:  # a failure above must not leave a group behind for this worker's other tests
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("override, named", [
    ("--trainer.max_steps=-5", "trainer.max_steps=-5"),
    ("--trainer.max_steps=0", "trainer.max_steps=0"),  # it exported an untrained drafter, exit 0
    ("--trainer.max_epochs=0", "trainer.max_epochs=0"),
    ("--model.lr=-1", "model.lr=-1.0"),
    ("--model.lr=0", "model.lr=0.0"),  # trains nothing and exports the initial drafter
    ("--data.num_workers=-1", "data.num_workers=-1"),
    ("--trainer.val_check_interval=0", "trainer.val_check_interval=0"),
    ("--trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0"),
    ("--trainer.use_distributed_sampler=true", "trainer.use_distributed_sampler=True"),
    ("--trainer.accelerator=bogus", "accelerator='bogus'"),  # refused by Lightning as it builds the Trainer
    ("--trainer.strategy=bogus", "strategy='bogus'"),
    # found in a review (2026-11-30): a traceback mid-step (fp64 drafter, fp32 target), a traceback from Lightning's
    # accelerator import, and a negative clip Lightning reads as no clipping
    ("--trainer.precision=64", "trainer.precision=64"),
    ("--trainer.accelerator=tpu", "torch_xla"),
    ("--trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1"),
    ("--trainer.gradient_clip_val=0", "trainer.gradient_clip_val=0"),  # no clipping too, to Lightning
    # found in a review (2026-12-02): a batch with no anchor crashed a run of several processes with a traceback
    ("--data.min_supervised_tokens=1", "data.min_supervised_tokens=1"),
    ("--trainer.precision=bogus", 'key "trainer.precision"; Given value: bogus;'),  # no Union subtype takes it
])
def test_a_value_torch_or_lightning_refuses_is_one_line_naming_it(tmp_path, capsys, override, named):
    assert train_main([*tiny_args(tmp_path, "bad", max_steps=2), override]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "tiny.yaml" in lines[0] and named in lines[0], lines
    assert not (tmp_path / "out" / "tiny" / "bad").exists()


@pytest.mark.parametrize("limits", [["--trainer.max_time=00:00:01:00"], ["--trainer.max_epochs=-1"],
                                    ["--trainer.max_epochs=-1", "--model.anneal_by_max_time=true"]])  # no clock to anneal by
def test_no_step_limit_where_only_the_clock_could_end_the_schedule_is_one_line_naming_it(tmp_path, capsys, limits):
    """Found in a review (2026-12-02): trainer.max_steps=-1 with no epoch limit (tiny has none) left the cosine no
    end, an OverflowError traceback as the optimizer was built; ablate --minutes lost every variant's table to it."""
    assert train_main([*tiny_args(tmp_path, "bad", max_steps=-1), *limits]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "trainer.max_steps=-1" in lines[0] and "model.anneal_by_max_time=true" in lines[0], lines
    assert "tiny.yaml" in lines[0], lines  # the recipe check's line, not the optimizer's
    assert not (tmp_path / "out" / "tiny" / "bad").exists() and not (tmp_path / "cache").exists()  # nothing built


def clock_by_training_steps(monkeypatch, seconds: float, start: float = 0.0) -> list[int]:
    """max_time's Timer (and StepTimer) reads a clock that moves `seconds` at each training_step call, whatever the
    machine's load; the calls' global steps are returned as they come."""
    calls = []
    original_training_step = DistillModule.training_step

    def training_step(module, *args):
        calls.append(module.global_step)
        return original_training_step(module, *args)

    monkeypatch.setattr(DistillModule, "training_step", training_step)
    clock = SimpleNamespace(monotonic=lambda: start + seconds * len(calls))
    monkeypatch.setattr("lightning.pytorch.callbacks.timer.time", clock)
    return calls


def test_no_step_limit_under_max_time_with_anneal_by_max_time_warms_up_and_anneals_by_the_clock(tmp_path,
                                                                                                monkeypatch):
    """max_time's Timer reads a clock on which each training step takes 0.25 s: the 3 s run takes 12 steps however
    loaded the machine (on the wall clock, at load 9 on 2 cores, 5 steps ran and the rate never neared its peak)."""
    clock_by_training_steps(monkeypatch, 0.25)
    args = [*tiny_args(tmp_path, "clock", max_steps=-1, every=2**62), "--trainer.max_time=00:00:00:03",
            "--model.anneal_by_max_time=true"]
    assert train_main(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "tiny" / "clock" / "csv" / "version_0" / "metrics.csv")))
    lrs = [float(row["train/lr"]) for row in rows if row.get("train/lr")]
    assert len(lrs) == 12  # no step limit: the clock alone ended the run
    # tiny's warm-up is 10% of max_time (0.3 s): the first step trains at the clock's start, at a rate of 0 (the
    # steps' warm-up never ends), and ends 5/6 into it, the second step's rate; the third's is just past it, near the
    # peak; then the rate anneals by the stop (train/lr: the rate each step trained at)
    assert lrs[0] == 0 and lrs[1] == pytest.approx(5 / 6 * 3e-3, rel=1e-3), lrs
    assert max(lrs) > 0.9 * 3e-3 and lrs[-1] < 0.25 * 3e-3, lrs


def test_max_time_under_accumulation_stops_where_a_step_ends_and_measures_only_that_step(tmp_path, monkeypatch):
    """Each micro-batch takes 0.6 s on max_time's clock: the 3 s are spent after the 5th, the middle of step 3 of
    accumulate_grad_batches=2. Lightning's Timer stopped there, the half-step's gradients lost and no checkpoint ranked
    (the closing line blamed a failed save); a stop checked mid-step also measured step 2 again. The run trains step 3
    whole, saves it, and measures it alone (mutation review m16, K06, K07, K10)."""
    micro_batches = clock_by_training_steps(monkeypatch, 0.6, start=0.6)
    args = [*tiny_args(tmp_path, "accumulated", max_steps=1000, every=2**62), "--trainer.max_time=00:00:00:03",
            "--trainer.accumulate_grad_batches=2"]
    assert train_main(args) == 0
    run = tmp_path / "out" / "tiny" / "accumulated"
    assert len(micro_batches) == 6 and saved_step(run / "checkpoints" / "last.ckpt") == 3
    assert sorted(p.name for p in (run / "eval").glob("step-*.json")) == ["step-000003.json"]
    assert os.readlink(run / "checkpoints" / "best.ckpt") == "step-3.ckpt"


def test_a_validation_interval_longer_than_the_epoch_is_one_line(tmp_path, capsys):
    """Lightning's ValueError was a traceback (the 8B recipes' 2000 steps on a smaller dataset, say)."""
    assert train_main([*tiny_args(tmp_path, "long", max_steps=2), "--trainer.val_check_interval=500"]) == 2
    (line,) = error_lines(capsys)
    assert "trainer.val_check_interval=500 is more than the " in line and "check_val_every_n_epoch=null" in line
    assert not (tmp_path / "out" / "tiny" / "long").exists()


def test_an_output_root_that_is_a_file_is_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    args = tiny_args(tmp_path, "r", max_steps=2)
    args[args.index("--output-root") + 1] = str(afile)
    assert train_main(args) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and f"{afile} is a file, not a folder" in lines[0], lines
    assert afile.read_text() == "mine"


NOT_ONE_FOLDER = ("a run's name is one folder name, made under <output-root>/<recipe>/; give a name without '/' "
                  "(--output-root puts runs elsewhere)")
BLANK = "a run's name is empty or starts or ends with a space; give a name such as try1, or leave --run out for a " \
        "timestamped folder"


@pytest.mark.parametrize("name, said", [("../../escaped", NOT_ONE_FOLDER), ("a/b", NOT_ONE_FOLDER),
                                        ("..", NOT_ONE_FOLDER), ("", BLANK), (" ", BLANK), ("try1 ", BLANK)])
def test_a_run_name_that_is_not_one_folder_name_or_is_blank_is_one_line(tmp_path, capsys, name, said):
    """`--run ../../escaped` wrote the run two folders above <output-root>/<recipe>/, beside the user's own files;
    `--run ' '` trained into a folder named with a single space, and `--run ''` was told to give a name without '/'."""
    assert train_main(tiny_args(tmp_path, name, max_steps=2)) == 2
    (line,) = error_lines(capsys)
    assert line == f"error: --run {name!r}: {said}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conversations.jsonl"]


def test_run_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        assert train_main(tiny_args(tmp_path, "modes", max_steps=2)) == 0
    finally:
        os.umask(old)
    run_dir = tmp_path / "out" / "tiny" / "modes"
    paths = [run_dir / name for name in ("config.yaml", "report.md", "tau.png", "eval", "drafter",
                                         "drafter/config.json", "drafter/model.safetensors", "checkpoints/last.ckpt")]
    paths += list((run_dir / "eval").iterdir())
    paths += list((tmp_path / "cache").rglob("*"))  # the tokenized cache
    for path in paths:
        expected = 0o755 if path.is_dir() else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == expected, f"{path}: {oct(stat.S_IMODE(path.stat().st_mode))}"


def test_a_hub_target_fails_at_once_when_the_hub_is_off(monkeypatch):
    from ddtree.errors import DDTreeError
    from ddtree.targets import resolve_target

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    started = time.monotonic()
    with pytest.raises(DDTreeError, match="HF_HUB_OFFLINE"):
        resolve_target("someone/not-cached")
    assert time.monotonic() - started < 5


def test_a_hub_target_fails_at_once_when_the_hub_cannot_be_reached(monkeypatch):
    from ddtree.errors import DDTreeError
    from ddtree.targets import resolve_target

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    with pytest.raises(DDTreeError, match="cannot be reached"):
        resolve_target("someone/not-cached")


def test_a_nan_temperature_is_refused():
    from ddtree.decoding import Sampling
    from ddtree.errors import DDTreeError

    with pytest.raises(DDTreeError, match="temperature nan"):
        Sampling(temperature=float("nan"))
    with pytest.raises(DDTreeError, match="temperature inf"):
        Sampling(temperature=float("inf"))


def test_export_of_a_folder_that_is_not_a_run_says_so(tmp_path, capsys):
    from training.publish import main as publish_main

    (tmp_path / "notes").mkdir()
    assert publish_main([str(tmp_path / "notes"), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a training run" in err[0] and "best.ckpt" not in err[0], err
    assert not (tmp_path / "export").exists()


def test_make_export_without_arguments_says_what_it_needs():
    result = subprocess.run(["make", "-s", "export", "STAMP="], cwd=REPO, capture_output=True, text=True)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "make export needs RUN=" in lines[0] and "OUT=" in lines[0], result.stderr


def test_a_warm_start_from_a_truncated_drafter_is_one_line(tmp_path, tiny_target):
    from ddtree.errors import DDTreeError
    from ddtree.modeling_dflash import DFlashDraftModel
    from ddtree.targets import build_drafter_config
    from training.module import DistillModule

    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    DFlashDraftModel(build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, target_layer_ids=[1, 3])).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    module = DistillModule(target="tiny-random", init_from=str(folder), target_dtype="float32")
    with pytest.raises(DDTreeError) as error:
        module.configure_model()
    assert len(str(error.value).splitlines()) == 1 and "truncated" in str(error.value)


def test_a_second_sigterm_during_the_first_ones_clean_up_does_not_cut_it_short(tmp_path):
    """Found in a review (2026-12-04): SLURM signals every process of a step and a launcher forwards the signal as well
    (recipes/launch_torchrun.sh, training's data-regeneration child's parent), so a command gets two SIGTERMs a moment
    apart. The second raised Terminated again inside the first one's `finally`, and the staging folder it was removing
    stayed. Now a command raises once; its clean-up runs to the end."""
    from ddtree.files import staged_folder

    removing = shutil.rmtree

    def signalled_again(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the forwarded SIGTERM, as the first one's clean-up starts
        removing(path, *args, **kwargs)

    @command
    def stages(argv) -> int:
        with staged_folder(tmp_path / "written") as staging:
            (staging / "half.bin").write_bytes(b"0" * 1024)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        return 0

    with mock.patch("shutil.rmtree", signalled_again):
        assert stages([]) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging (.written-xxxxxxxx)


# slow (~16 s, a process of its own on a 2-core AVX2 EPYC): test_sigterm_while_a_rank_waits_in_the_evaluations_...
# sends its SIGTERM to the group of a two-rank run with two DataLoader workers on each rank, and checks the same
@pytest.mark.slow
def test_a_sigterm_to_the_process_group_with_dataloader_workers_stops_at_the_step_and_saves_it(tmp_path):
    """Found in a review (2026-12-04): with data.num_workers > 0 (the SLURM and torchrun recipes'), a SIGTERM sent to
    the whole process group (`timeout`, SLURM, scancel) ended the DataLoader workers too, and the run crashed with
    "DataLoader worker (pid N) is killed by signal", status 1 and the step not saved. Now the workers ignore it and
    the main process stops where the step ends, saved, as with no workers."""
    marker = tmp_path / "holding"
    hold = json.dumps({"class_path": "test_reliability.HoldAtStepStart",
                       "init_args": {"marker": str(marker), "after": 3}})
    args = [*tiny_args(tmp_path, "workers", max_steps=400, every=100), "--data.num_workers=2",
            f"--trainer.callbacks+={hold}"]
    err = train_until_sigterm(args, [Path(f"{marker}0")], settle_s=0.2, timeout_s=120)
    lines = [line for line in err.splitlines() if line.startswith("[train]")]
    assert len(lines) == 1 and "stopped by SIGTERM at step 4; no drafter written" in lines[0], err[-3000:]
    assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]
    resume = Path(re.search(r"RESUME=(\S+)", lines[0]).group(1))
    assert resume == tmp_path / "out" / "tiny" / "workers" / "checkpoints" / "last.ckpt"
    assert check_resumable(resume)["global_step"] == 4


def test_a_resume_that_drops_model_corpus_writes_its_drafter_without_the_runs_corpus(tmp_path):
    """The first launch's model.corpus left corpus.safetensors in the run folder; a resume with model.corpus false
    trained and measured its steps without it, but the drafter/ it wrote at the end shipped it, which ddtree then
    grafted by default: decoding otherwise than the run measured (make export already left it out)."""
    run_dir = tmp_path / "out" / "tiny" / "corpus"
    assert train_main([*tiny_args(tmp_path, "corpus", max_steps=2), "--model.corpus=true"]) == 0
    assert (run_dir / "corpus.safetensors").is_file() and (run_dir / "drafter" / "corpus.safetensors").is_file()
    assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(run_dir), "--trainer.max_steps=3",
                       "--model.corpus=false", "--trainer.enable_progress_bar=false"]) == 0
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    assert not (run_dir / "drafter" / "corpus.safetensors").exists()
