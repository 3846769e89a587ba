"""The ablation harness trains every variant on one budget and tabulates what the evaluation measured."""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

import toy_data  # tests/training/toy_data.py
import training.ablate
import training.report
from ddtree.errors import DDTreeError
from ddtree.files import WriteFailed
from training.ablate import (ABLATE_STAMP_ENV, DEFAULT_VARIANTS, decoder_additions, decoding_target, last_validation,
                             main, markdown_table, parse_variant, plot, summarize_variant, write_results)
from training.arguments import recipe_path
from training.callbacks import AcceptanceEvaluation

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("undrawn_plots")  # ablate-*.png drawn only where a test asks (drawn_plots)


@pytest.fixture
def undrawn_tau(monkeypatch):
    """Each run's tau.png built from its rows but undrawn (as undrawn_plots does), where a test asks for drawn_plots
    for ablate-*.png alone: four tau plots of two launches were ~2 s of a 12 s test on a 2-core AVX2 EPYC, and tau.png
    is drawn where it is read (test_eval_callback)."""
    plot_tau = training.report.plot_tau

    def built_undrawn(*args, **kwargs):
        with mock.patch.object(Figure, "tight_layout", lambda self, *a, **k: None):
            figure = plot_tau(*args, **kwargs)
        figure.savefig = lambda file, **kw: file.write(b"not drawn (undrawn_tau)")
        return figure

    monkeypatch.setattr(training.report, "plot_tau", built_undrawn)


def test_two_variants_of_the_tiny_recipe_are_trained_measured_and_compared(tmp_path, capsys, drawn_plots, undrawn_tau):
    # 12 conversations: 10 train sequences, 5 batches an epoch; --steps 6 trains past one epoch (a step budget past
    # the first epoch once stopped at Lightning's val_check_interval check), at half the steps 24 and 12 took
    data = toy_data.write_conversations(tmp_path / "conversations.jsonl", 12, 30, 60)
    status = main([
        "--recipe", "tiny", "--steps", "6", "--eval-limit", "1", "--eval-max-new-tokens", "4",
        "--output-root", str(tmp_path / "out"), "--variant", "plain=", "--variant",
        "frontier=--model.objective=frontier --model.redraft_prob=0.5",
        f"--data.data_path={data}", f"--data.cache_dir={tmp_path / 'cache'}", "--data.batch_size=2",
        "--data.val_fraction=0.2", "--trainer.enable_progress_bar=false",
    ])
    assert status == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| plain") or line.startswith("| frontier")]
    assert len(table) == 2
    # each launch says its precision; the checks before them, which read the recipe once per flag and variant, do not
    before_first = out.split("[ablate]", 1)[0]
    assert "[precision]" not in before_first, before_first
    results = json.loads(next((tmp_path / "out" / "tiny").glob("ablate-*.json")).read_text())
    assert [r["variant"] for r in results] == ["plain", "frontier"]
    for r in results:
        assert r["step"] == 6 and r["val_loss"] is not None and len(r["recall"]) == 7  # block 8: depths 1..7
        assert set(r["tau"]) == {"4", "8", "16"} and all(tau >= 1 for tau in r["tau"].values())
        assert r["data"]["train_sequences"] == r["data"]["train_split_sequences"] > 0  # online features: all of it
    runs = {p.name.rsplit("-", 1)[1]: p for p in (tmp_path / "out" / "tiny").iterdir() if p.is_dir()}
    configs = {name: (run / "config.yaml").read_text() for name, run in runs.items()}
    assert "objective: frontier" in configs["frontier"] and "redraft_prob: 0.5" in configs["frontier"]
    assert "objective: decayed_ce" in configs["plain"]
    # eval.packed_weights auto is decided once, by the first variant's evaluation, and recorded in each one's
    recorded = [json.loads(next((runs[name] / "eval").glob("step-*.json")).read_text())["settings"]
                for name in ("plain", "frontier")]
    resolved = recorded[0]["packed_weights_resolved"]
    assert recorded[0]["packed_weights"] == "auto" and isinstance(resolved, bool)
    assert recorded[1]["packed_weights"] == ("on" if resolved else "off")
    assert recorded[1]["packed_weights_resolved"] is resolved and [r["packed_weights"] for r in results] == [resolved] * 2
    assert next((tmp_path / "out" / "tiny").glob("ablate-*.png")).stat().st_size > 0


@pytest.mark.slow  # two DeepSpeed runs, ~25 s; the unit test after it is the default run's share
def test_every_variant_under_a_deepspeed_strategy_trains_and_is_measured(tmp_path):
    """The variants run one after another in one process, and DeepSpeed keeps its own clone of the world group: the
    first variant closed the group behind DeepSpeed's back, so every later one failed in deepspeed.initialize ("Group
    ... is not registered") and the table measured only the first. One process, as `make ablate ... zero2` on one GPU."""
    data = toy_data.write_conversations(tmp_path / "conversations.jsonl", 24, 30, 60)
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("SLURM_") and name not in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                             "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    result = subprocess.run(
        [sys.executable, "-m", "training.ablate", "--recipe", "tiny", "--steps", "2", "--eval-limit", "1",
         "--eval-max-new-tokens", "3", "--output-root", str(tmp_path / "out"), "--variant", "a=",
         "--variant", "b=--model.lr=1e-3", "--trainer.strategy=zero2_cpu", "--trainer.precision=bf16-mixed",
         "--trainer.enable_progress_bar=false", f"--data.data_path={data}", f"--data.cache_dir={tmp_path / 'cache'}",
         "--data.batch_size=2", "--data.val_fraction=0.1", "--model.num_anchors=64", "--eval.budgets=[4]",
         "--eval.primary_budget=4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(next((tmp_path / "out" / "tiny").glob("ablate-*.json")).read_text())
    assert [r["variant"] for r in results] == ["a", "b"]
    assert all(r["step"] == 2 and r["tau"]["4"] is not None and r["tau"]["4"] >= 1 for r in results), results


def test_a_deepspeed_process_group_closed_at_the_end_of_a_run_opens_again_for_the_next(monkeypatch):
    """The cheap half of the test above: end_process_group must drop DeepSpeed's clone of the world group too, or the
    next deepspeed.init_distributed in this process hands DeepSpeed the closed one."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import groups

    from training.strategies import end_process_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(groups, "_WORLD_GROUP", None)  # and put back after, whatever the test left there
    monkeypatch.setattr(deepspeed.comm.comm, "cdb", None)  # no DeepSpeed backend yet, as in a fresh process
    try:
        for run in range(2):  # two variants' runs
            with mock.patch("deepspeed.comm.torch.build_shm_op", return_value=None):  # minutes of compiling, as zero2_cpu
                deepspeed.init_distributed(dist_backend="gloo", verbose=False)
            assert torch.distributed.get_global_rank(groups._clone_world_group(), 0) == 0, f"run {run}"
            end_process_group()
            assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_bad_variant_or_no_budget_is_one_line(capsys):
    assert main(["--recipe", "tiny", "--variant", "no equals sign at all", "--steps", "2"]) == 2
    assert main(["--recipe", "tiny"]) == 2
    assert main(["--recipe", "tiny", "--variant", 'x=--model.lr="1', "--steps", "2"]) == 2
    assert main(["--recipe", "tiny", "--minutes", "nan"]) == 2
    assert main(["--recipe", "tiny", "--steps", "0"]) == 2
    assert main(["--recipe", "tiny", "--minutes", "1e12"]) == 2  # was refused as a bad trainer section of tiny.yaml
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 6 and "--variant" in err[0] and "--steps" in err[1]
    assert "No closing quotation" in err[2] and "--minutes nan" in err[3] and "--steps 0" in err[4]
    assert "--minutes 1000000000000.0" in err[5] and "at most a year" in err[5]


def test_a_budget_or_variant_name_no_launch_could_use_is_one_line_before_any_trains(tmp_path, capsys, monkeypatch):
    """Without its own guard each of these launched: under 1 second every variant paid its set-up and trained no
    step; a name with '/' is a run name training refuses, so each was a late "stopped" row; a repeated name trained
    into the first's run folder, and both rows read the newest evaluation (mutation review m15: A02, A08, A03)."""
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 0)
    refused = [(["--minutes", "0.001", "--variant", "a="], "--minutes 0.001: give a wall time per variant of at least "
                                                           "one second"),
               (["--steps", "2", "--variant", "x/y="], "--variant 'x/y=': give name=overrides"),
               (["--steps", "2", "--variant", "../../escaped="], "--variant '../../escaped=': give name=overrides"),
               (["--steps", "2", "--variant", "a=", "--variant", "a=--model.lr=1e-3"],
                "--variant names must differ: ['a', 'a']")]
    for flags, named in refused:
        assert main(["--recipe", "tiny", "--output-root", str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {named}"), err
    assert not launched and not any(tmp_path.iterdir())


def test_a_variant_name_with_odd_characters_is_refused_naming_them_and_a_name_that_works(tmp_path, capsys):
    """`lr.high=--model.lr=1e-3` was refused with "give name=overrides, e.g. dpace=...": the user had given
    name=overrides, and the line did not say the name's '.' was what it refused."""
    assert main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path),
                 "--variant", "lr.high=--model.lr=1e-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'lr.high' has '.'" in err[0] and "letters, digits, - and _" in err[0], err
    assert err[0].endswith("e.g. lr_high=--model.lr=1e-3"), err
    assert parse_variant("lr_high=--model.lr=1e-3") == ("lr_high", ["--model.lr=1e-3"])  # the suggestion is taken
    assert not any(tmp_path.iterdir())


def test_an_eval_limit_below_1_is_refused_with_advice_that_works(tmp_path, capsys, monkeypatch):
    """`--eval-limit 0` answered eval.limit's own line, "must be at least 1, or null for every prompt", and
    `--eval-limit null` was then argparse's "invalid int value"; eval.limit=null as a recipe flag is what works."""
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: pytest.fail("trained past a bad --eval-limit"))
    assert main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", "a=",
                 "--eval-limit", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --eval-limit 0: eval.limit=0: must be at least 1"), err
    assert "--eval.limit=null" in err[0] and "or null" not in err[0], err
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 2)
    main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", "a=", "--eval.limit=null"])
    assert launched and "--eval.limit=null" in launched[0]  # the advice it gives is taken


def test_the_checks_reads_of_the_recipe_log_no_seed_line_each(tmp_path, monkeypatch, caplog):
    """Each read of the recipe logged Lightning's "Seed set to 0" to stderr: the checks' printed lines were kept out
    of the way, and 10 variants still put 12 seed lines before the first launch (which says it again itself)."""
    seed_logger = "lightning.fabric.utilities.seed"
    caplog.set_level(logging.INFO, logger=seed_logger)
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 2)
    main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", "a=", "--variant", "b="])
    assert len(launched) == 2
    assert not [record for record in caplog.records if "Seed set" in record.getMessage()]
    assert logging.getLogger(seed_logger).level == logging.INFO  # as it was: a launch's own line is said


def test_a_budget_past_a_day_is_lightnings_days_field(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 2)
    main(["--recipe", "tiny", "--minutes", "1501", "--output-root", str(tmp_path), "--variant", "a="])
    assert launched and "--trainer.max_time=01:01:01:00" in launched[0]


def test_every_variant_is_read_before_any_trains(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: pytest.fail("a variant trained before all were read"))
    assert main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", "a=--model.lr=0.003",
                 "--variant", "b=--model.lrr=0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --variant b: ") and "model.lrr" in err[0], err
    assert not any(tmp_path.iterdir())
    # Values too, that only the model, the evaluation or the trainer checks refuse: b alone, as a= before it was read
    # (once is enough, above; each variant is a read of the recipe, ~0.25 s on a 2-core AVX2 EPYC); b's launch fails
    # the test should its value slip past the checks
    refused = [("--model.distill_top_k=-1", "model.distill_top_k=-1"), ("--eval.budgets=[4]", "eval.primary_budget"),
               ("--model.lr=0", "model.lr=0")]
    for bad, named in refused:
        assert main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", f"b={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --variant b: ") and named in err[0], err
    assert not any(tmp_path.iterdir())


def test_a_variant_training_could_not_launch_is_refused_before_any_trains(tmp_path, capsys, monkeypatch):
    """The check read only the values: a missing data path or prompts file, or a GPU asked of a CPU machine, in the last
    variant was found by its launch, after every variant before it had trained (hours at GPU scale)."""
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: pytest.fail("a variant trained before all were checked"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    refused = [(f"--data.data_path={tmp_path / 'typo.jsonl'}", "data.data_path="),
               (f"--eval.prompts={tmp_path / 'missing.jsonl'}", "eval.prompts="),
               (f"--model.init_from={tmp_path / 'nope'}", str(tmp_path / "nope")),
               ("--trainer.accelerator=gpu", "trainer.accelerator=gpu")]
    for i, (bad, named) in enumerate(refused):
        # a= before b in the first only: that b is checked before a trains needs showing once, and each variant is a
        # read of the recipe (~0.25 s on a 2-core AVX2 EPYC); b's launch fails the test should its flaw slip past
        before = ["--variant", "a="] if i == 0 else []
        assert main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path / "out"), *before,
                     "--variant", f"b={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --variant b: ") and named in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, expected", [("a=", ("a", [])), ("dp=--model.objective=dpace --model.lr=1e-3",
                                             ("dp", ["--model.objective=dpace", "--model.lr=1e-3"]))])
def test_variants_parse(text, expected):
    assert parse_variant(text) == expected


def test_a_variant_override_without_its_dashes_is_refused_naming_it_and_the_override_meant():
    """`lr=model.lr=1e-3` reached the recipe's parser, whose line said "unrecognized arguments on the command line" and
    pointed to `python -m training.ablate --help`, which knows no recipe field; the variant's words are the fault."""
    with pytest.raises(DDTreeError, match=r"^--variant 'lr=model.lr=1e-3': 'model.lr=1e-3' is not a recipe override: "
                                          r"give each as --section.field=value, here --model.lr=1e-3$"):
        parse_variant("lr=model.lr=1e-3")
    with pytest.raises(DDTreeError, match=r"^--variant 'ids=--model.target_layer_ids=\[1, 3\]': '3\]' is not a "
                                          r"recipe override: give each as --section.field=value \(a value with "
                                          r"spaces quoted\)$"):
        parse_variant("ids=--model.target_layer_ids=[1, 3]")
    assert parse_variant("lr=--model.lr 1e-3 --trainer.max_steps -1") == (  # a flag and its value as two words
        "lr", ["--model.lr", "1e-3", "--trainer.max_steps", "-1"])


def test_a_bare_variant_name_is_that_default_variant_or_refused(tmp_path, capsys, monkeypatch):
    """`--variant tree --variant intree` read as tree= and intree=: the recipe as it is (smollm2-135m's dpace + kl32),
    trained twice and tabulated as two other objectives."""
    assert parse_variant("tree") == ("tree", ["--model.objective=tree", "--model.distill_weight=0",
                                              "--model.distill_top_k=0"])
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 2)
    main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", "tree", "--variant", "intree"])
    assert [argv[-3] for argv in launched] == ["--model.objective=tree", "--model.objective=intree"]
    capsys.readouterr()
    launched.clear()
    assert main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", "lr"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --variant 'lr': no default variant has that name (") and \
        "lr= for the recipe as it is" in err[0], err
    assert not launched


def test_an_evaluation_records_the_packed_weights_it_decoded_with():
    """eval.packed_weights auto is measured per launch (a second's timing), so variants of one ablation decoded with
    different kernels and nothing recorded which: ablate reads the choice from each variant's evaluation."""
    drafter_config = SimpleNamespace(lookup=0, redraft=0, calibration=None, block_size=8)
    for choice, packed in (("off", False), ("auto", False)):
        evaluation = AcceptanceEvaluation(packed_weights=choice)
        assert evaluation.settings(drafter_config, 1)["packed_weights_resolved"] is None  # not resolved yet
        evaluation.resolve_packing(torch.nn.Linear(4, 4).to(torch.bfloat16), say=False)  # auto: nothing to pack in bf16
        settings = evaluation.settings(drafter_config, 1)
        assert settings["packed_weights"] == choice and settings["packed_weights_resolved"] is packed


def test_the_first_variant_measured_decides_packed_weights_for_every_variant_of_its_target(tmp_path, monkeypatch,
                                                                                            capsys):
    """eval.packed_weights auto was timed by each launch (a second, on a machine the ablation keeps busy): the review's
    three smollm2 variants decoded on, on, off, 1.7x apart in evaluation time, and nothing said so."""
    launched = []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        if argv[argv.index("--run-name") + 1].endswith("-boom"):
            return 1  # stopped before its evaluation: decides nothing
        given = [arg.split("=")[1] for arg in argv if arg.startswith("--eval.packed_weights=")]
        fake_run(argv, {"packed_weights_resolved": given[-1] == "on" if given else True})  # auto measures: on
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    # fp32 given: the recipe's precision auto is bf16-mixed where this machine computes bf16 fast, and the bf16 variant
    # then decoded alike (the test passed on a Xeon and failed on an AVX512-BF16 EPYC)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--trainer.precision=32-true",
                 "--variant", "boom=--model.lr=1e3", "--variant", "a=", "--variant", "b=--model.objective=dpace",
                 "--variant", "off=--eval.packed_weights=off", "--variant", "bf16=--trainer.precision=bf16-mixed",
                 "--variant", "c=--model.objective=tree"]) == 1
    decided = [[arg for arg in argv if arg.startswith("--eval.packed_weights")] for argv in launched]
    assert decided == [[], [], ["--eval.packed_weights=on"], ["--eval.packed_weights=off"],  # its own choice
                       [], ["--eval.packed_weights=on"]]  # bf16: another target dtype, its own auto
    assert "[ablate] eval.packed_weights auto -> on, as a's evaluation measured it; the later variants of its target " \
           "decode alike (--eval.packed_weights=on): b, c" in capsys.readouterr().out
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [r.get("packed_weights") for r in results] == [None, True, True, False, True, True]
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    assert "different kernels (eval.packed_weights: a on, b on, off off, bf16 on, c on)" in table


def test_a_variant_with_another_adapter_dtype_or_device_decides_packed_weights_for_itself():
    """The target a variant decodes against is its target, the adapter merged into it, its dtype, accelerator and
    precision: a variant that merged an adapter decodes another model, and must not take the plain target's auto."""
    def config(**changed):
        trainer = {"accelerator": changed.pop("accelerator", "cpu"), "precision": changed.pop("precision", "32-true")}
        model = {"target": "tiny", "target_adapter": None, "target_dtype": "auto", **changed}
        return SimpleNamespace(model=SimpleNamespace(**model), trainer=SimpleNamespace(**trainer))

    base = decoding_target(config())
    assert decoding_target(config()) == base
    for changed in ({"target": "other"}, {"target_adapter": "adapters/chat"}, {"target_dtype": "bfloat16"},
                    {"accelerator": "gpu"}, {"precision": "bf16-mixed"}):
        assert decoding_target(config(**changed)) != base, changed


def test_the_table_shows_every_budget_and_a_dash_where_a_variant_did_not_measure_it():
    def result(name, taus, chain_tau):
        return {"variant": name, "step": 3, "run_minutes": 1.0, "val_loss": None, "accuracy": [0.5], "recall": [None],
                "tau": taus, "expected_tau": {b: t + 0.1 for b, t in taus.items()}, "chain_tau": chain_tau,
                "chain_expected_tau": None}

    table = markdown_table([result("a", {8: 2.0, 32: 3.0}, 1.5), result("b", {32: 2.5}, 0.0)]).splitlines()
    assert "tau@8 (expected)" in table[0] and "tau@32 (expected)" in table[0]
    assert table[2].endswith("| 2.00 (2.10) | 3.00 (3.10) | 1.50 (-) | 2.00x |")
    assert table[3].endswith("| - | 2.50 (2.60) | 0.00 (-) | - |")  # no chain rounds: no ratio
    assert plot([result("a", {8: 2.0, 32: 3.0}, 1.5), result("b", {32: 2.5}, 0.0)]) is not None
    # null in eval/step-N.json (NaN: no round ran, or weights not finite): a dash, where it was a TypeError
    unmeasured = {**result("c", {}, None), "tau": {8: None, 32: None}, "expected_tau": {8: None, 32: None}}
    assert markdown_table([unmeasured]).splitlines()[2].endswith("| - | - | - | - |")
    assert plot([unmeasured]) is not None


def test_the_tables_budget_columns_run_from_the_smallest_budget_whatever_order_a_variant_measured_them_in():
    """A variant's eval.budgets may list them in any order: the columns still read smallest to largest, as tau grows
    with the budget, so a column out of place is not read as a budget's tau."""
    row = {"variant": "a", "step": 3, "run_minutes": 1.0, "val_loss": None, "accuracy": [0.5], "recall": [None],
           "tau": {1024: 3.0, 64: 2.0}, "expected_tau": {1024: 3.1, 64: 2.1}, "chain_tau": 1.5,
           "chain_expected_tau": None}
    head = markdown_table([row]).splitlines()[0]
    assert head.index("tau@64 (expected)") < head.index("tau@1024 (expected)")


def measured_row(name: str) -> dict:
    """A table row as summarize_variant makes it: every variant of a whole store, decoded with packed weights."""
    return {"variant": name, "run": name, "step": 3, "run_minutes": 1.0, "val_loss": 3.5, "accuracy": [0.5],
            "recall": [0.6], "tau": {8: 2.0}, "expected_tau": {8: 2.1}, "chain_tau": 1.5, "chain_expected_tau": 1.6,
            "data": {"train_sequences": 2001, "train_split_sequences": 2001}, "draft_vocab_size": None,
            "packed_weights": True, "decoded_with": {}}


def test_a_variant_that_validated_nothing_has_dashes_not_blank_cells():
    """Under --trainer.limit_val_batches=0 a variant's val loss was `-` and its acc@ and recall@ cells were empty."""
    row = {**measured_row("noval"), "val_loss": None, "accuracy": [], "recall": []}
    line = markdown_table([row]).splitlines()[2]
    assert line.startswith("| noval | 3 | 1.0 | - | - | - | 2.00 (2.10) |"), line


def test_a_table_of_variants_alike_in_data_and_kernels_carries_no_note():
    """The notes under the table ask the user to build whole stores again or to decode alike: said of variants that
    read the same data with the same kernels, they sent the user to rebuild stores for nothing (mutation review 9:
    a20, a21)."""
    table = markdown_table([measured_row("a"), measured_row("b")])
    assert len(table.splitlines()) == 4, table  # the head, its rule and the two rows: no note under them


def test_the_unequal_data_note_names_the_split_a_record_gives_where_another_lacks_it():
    """The note tells the user what share of the training split each variant saw: a data.json without the split's
    size (one written before it was recorded) is no split of 0 sequences, so the note names the size another gives."""
    older = {**measured_row("a"), "data": {"train_sequences": 570}}
    table = markdown_table([older, measured_row("b")])
    assert "a 570, b 2001 of the 2001 training sequences" in table, table


def test_a_nan_in_a_variants_row_is_null_in_the_results_and_the_ablation_goes_on(tmp_path, monkeypatch):
    """A diverged variant's validation logs val/loss as "nan": written as a bare NaN, json.dumps(allow_nan=False)
    raised in the loop and the whole ablation ended with no table (mutation review 9: a32)."""
    def fake_train(argv: list[str]) -> int:
        run = fake_run(argv, {})
        (run / "csv" / "version_0").mkdir(parents=True)
        (run / "csv" / "version_0" / "metrics.csv").write_text("step,val/loss\n3,nan\n")
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "b=--model.lr=1e-3"]) == 0
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [(r["variant"], r["val_loss"]) for r in results] == [("a", None), ("b", None)]


def test_a_write_of_the_results_that_fails_leaves_the_previous_variants_files_whole(tmp_path, monkeypatch, drawn_plots):
    """The files are written again after each variant, so that a killed ablation keeps the variants before it: a kill in
    savefig, or a disk that fills as the table is written, must leave the previous plot and table, not a cut one in
    their place (mutation review 9: a30, a31)."""
    base = tmp_path / "ablate-x"
    write_results(base, [measured_row("a")])
    before = {suffix: Path(f"{base}.{suffix}").read_bytes() for suffix in ("md", "json", "png")}

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", disk_full)
        with pytest.raises(WriteFailed):  # at the table, the first file written
            write_results(base, [measured_row("a"), measured_row("b")])
    assert {suffix: Path(f"{base}.{suffix}").read_bytes() for suffix in ("md", "json", "png")} == before

    def killed_in_savefig(self, handle, **kwargs):
        handle.write(b"part")
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Figure, "savefig", killed_in_savefig)
        with pytest.raises(KeyboardInterrupt):  # the table and results are written by then: the plot is the last
            write_results(base, [measured_row("a"), measured_row("b")])
    assert Path(f"{base}.png").read_bytes() == before["png"]


def test_the_newest_validation_is_read_from_the_newest_csv_version_by_number(tmp_path):
    """Lightning's CSVLogger starts csv/version_<N> for each launch into a run folder: sorted as text, version_10 came
    before version_9, and a run resumed ten times read the ninth launch's validation (mutation review 9's defect)."""
    for version in range(11):
        (tmp_path / "csv" / f"version_{version}").mkdir(parents=True)
        (tmp_path / "csv" / f"version_{version}" / "metrics.csv").write_text(f"step,val/loss\n{version},{version}\n")
    assert last_validation(tmp_path)["val/loss"] == 10.0


def test_a_variants_row_reads_its_newest_evaluation_and_validation_in_depth_order(tmp_path):
    """A variant folder as training leaves it: Lightning's CSVLogger for a block-16 drafter (its columns sorted as
    strings: acc_1, acc_10, .., acc_15, acc_2, ..), two validations and two evaluations, as a variant with its own
    schedule leaves them. The tiny recipe's depths 1..7 sort alike either way, and its canned chain tau equals its
    expected tau, so a table in column order (acc@2 under acc@10), with the chain's expected tau as its tau, the first
    validation or the launch's seconds as its minutes passed every test (mutation review G2: A04, A06, A07, A08)."""
    def stats(tau, expected):
        return {"tau": tau, "expected_tau": expected, "rounds": 10, "accepted_depth_counts": {}}

    run = tmp_path / "ablate-x-v"
    logger = CSVLogger(run, name="csv")
    logger.log_metrics({"val/loss": 9.0, **{f"val/acc_{k}": 0.0 for k in range(1, 16)},
                        **{f"val/recall4_{k}": 0.0 for k in range(1, 16)}}, step=5)
    logger.log_metrics({"val/loss": 3.25, **{f"val/acc_{k}": k / 100 for k in range(1, 16)},
                        **{f"val/recall4_{k}": k / 50 for k in range(1, 16)}}, step=10)
    logger.save()
    (run / "eval").mkdir(parents=True)
    settings = {"packed_weights_resolved": False, "lookup": 0, "corpus": False, "redraft": 0}
    (run / "eval" / "step-000005.json").write_text(json.dumps({"step": 5, "settings": settings, "summary": {
        "dflash": stats(1.1, 1.1), "ddtree@16": stats(1.1, 1.1), "ddtree@32": stats(1.1, 1.1)}}))
    (run / "eval" / "step-000010.json").write_text(json.dumps({"step": 10, "settings": settings, "summary": {
        "dflash": stats(1.6, 2.0), "ddtree@32": stats(2.8, 3.3), "ddtree@16": stats(2.4, 2.9)}}))
    row = summarize_variant("v", run, seconds=600.0)
    assert row["accuracy"] == [k / 100 for k in range(1, 16)]  # depth 1..15, not the CSV's column order
    assert row["val_loss"] == 3.25 and row["step"] == 10
    acc = " ".join(f"{k / 100:.2f}" for k in range(1, 16))
    recall = " ".join(f"{k / 50:.2f}" for k in range(1, 16))
    # 10.0 launch minutes; the chain's measured 1.60 beside its expected 2.00, and tree@32 / chain = 2.80 / 1.60
    assert markdown_table([row]).splitlines()[2] == (
        f"| v | 10 | 10.0 | 3.250 | {acc} | {recall} | 2.40 (2.90) | 2.80 (3.30) | 1.60 (2.00) | 1.75x |")


def test_a_stopped_variant_is_a_row_the_others_still_compare_and_unequal_data_is_said(tmp_path, monkeypatch, capsys):
    launched = []

    def fake_train(argv: list[str]) -> int:  # what a finished run leaves that the table reads
        launched.append(argv)
        run = Path(argv[argv.index("--output-root") + 1]) / "tiny" / argv[argv.index("--run-name") + 1]
        (run / "eval").mkdir(parents=True)
        summary = {"ddtree@8": {"tau": 2.0, "expected_tau": 2.1}, "dflash": {"tau": 1.5, "expected_tau": 1.6}}
        (run / "eval" / "step-000003.json").write_text(json.dumps({"step": 3, "summary": summary,
                                                                   "settings": {"lookup": 7, "corpus": True}}))
        if run.name.endswith("-boom"):  # diverged: the comparison used to end here, with no table for the variants
            return 1  # before it. Its final evaluation is on disk: a failed run's is no result (a stop's is)
        share = 570 if run.name.endswith("-a") else 2001  # two stores, each cut by its own build's clock
        (run / "data.json").write_text(json.dumps({"train_sequences": share, "train_split_sequences": 2001}))
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "boom=--model.lr=1e3", "--variant", "c="]) == 1  # the stopped variant's status
    assert len(launched) == 3 and all("--trainer.max_time=null" in argv for argv in launched)  # the steps alone
    table = (next(tmp_path.glob("tiny/ablate-*.md"))).read_text()
    assert "| boom | stopped (exit status 1): nothing measured |" in table
    assert "| a | 3 |" in table and "| c | 3 |" in table and "tree@8 / chain" in table
    assert "a 570, c 2001 of the 2001 training sequences" in table
    assert "decoded with context lookup 7 and the corpus" in table
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [r.get("stopped") for r in results] == [None, 1, None]
    assert plot(results) is not None  # a stopped variant has no bars: nothing drawn at 0

    launched.clear()  # --minutes alone: a variant the clock cuts anneals by it
    main(["--recipe", "tiny", "--minutes", "2", "--output-root", str(tmp_path / "minutes"), "--variant", "a="])
    assert "--model.anneal_by_max_time=true" in launched[0] and "--trainer.max_time=null" not in launched[0]


def test_two_ablations_started_in_the_same_second_keep_their_own_tables_and_run_folders(tmp_path, monkeypatch):
    """Both took the stamp of that second (two started with `&`): the second's table replaced the first's, and a
    variant name they shared trained both into one run folder (the second refused as in use, or its eval/ taken)."""
    monkeypatch.setattr("time.strftime", lambda fmt: "20261203-162910")
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: fake_run(argv, {}) and 0)
    for _ in range(2):
        assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a="]) == 0
    root = tmp_path / "tiny"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["ablate-20261203-162910-2-a", "ablate-20261203-162910-a"]
    for stamp in ("20261203-162910", "20261203-162910-2"):
        assert "| a | 3 |" in (root / f"ablate-{stamp}.md").read_text()
        assert json.loads((root / f"ablate-{stamp}.json").read_text())[0]["run"] == str(root / f"ablate-{stamp}-a")
    # a stamp whose variant run folder is there (its table deleted, say) is not taken again
    (root / "ablate-20261203-162910-3-b").mkdir()
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "b="]) == 0
    assert (root / "ablate-20261203-162910-4-b" / "eval").is_dir() and (root / "ablate-20261203-162910-4.md").is_file()


def test_under_minutes_alone_a_variant_evaluates_and_validates_only_where_it_stops(tmp_path, monkeypatch):
    """The recipe's schedule (tiny: evaluate every 10 steps, validate every 15) would spend each variant's wall time on
    evaluations, more of it for a slower variant; only its stop (max_steps or the clock) is measured."""
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 2)
    main(["--recipe", "tiny", "--minutes", "2", "--output-root", str(tmp_path), "--variant", "a=",
          "--variant", "b=--trainer.max_steps=-1"])
    a, b = ([arg for arg in argv if "every_n" in arg or "val_check" in arg or "check_val" in arg] for argv in launched)
    assert a == ["--eval.every_n_train_steps=30", "--trainer.val_check_interval=30",  # tiny's max_steps
                 "--trainer.check_val_every_n_epoch=null"]
    assert b[:2] == [f"--eval.every_n_train_steps={2**62}", f"--trainer.val_check_interval={2**62}"]  # the clock only


def test_a_variant_that_accumulates_batches_validates_at_its_last_step_only(tmp_path, monkeypatch):
    """Lightning counts val_check_interval in batches: --steps 4 set it to 4, so a variant accumulating 2 batches a
    step validated at step 2 too, between evaluations, on its training time."""
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 2)
    main(["--recipe", "tiny", "--steps", "4", "--output-root", str(tmp_path), "--variant", "a=",
          "--variant", "b=--trainer.accumulate_grad_batches=2"])
    last = [[arg for arg in argv if "val_check_interval" in arg][-1] for argv in launched]  # the last given wins
    assert last == ["--trainer.val_check_interval=4", "--trainer.val_check_interval=8"]


def test_default_variants_set_every_objective_and_distillation_knob():
    """A recipe's own objective or distillation (smollm2-135m trains dpace + kl32) must not leak into a variant
    named for another: each default variant sets all four knobs itself."""
    names = set()
    for text in DEFAULT_VARIANTS:
        name, overrides = parse_variant(text)
        names.add(name)
        given = dict(override.removeprefix("--").split("=", 1) for override in overrides)
        assert {"model.objective", "model.distill_weight", "model.distill_top_k"} <= set(given), name
        assert (float(given["model.distill_weight"]) > 0) == any(part in name for part in ("kl", "lk")), name
        objective = name.split("-")[0]
        assert given["model.objective"] == ("decayed_ce" if objective in ("kl", "lk") else objective), name
    assert len(names) == len(DEFAULT_VARIANTS)


def fake_run(argv: list[str], settings: dict) -> Path:
    """What a finished run of the tiny recipe leaves that the table reads: one evaluation decoded with `settings`."""
    run = Path(argv[argv.index("--output-root") + 1]) / "tiny" / argv[argv.index("--run-name") + 1]
    (run / "eval").mkdir(parents=True)
    summary = {"ddtree@8": {"tau": 2.0, "expected_tau": 2.1}, "dflash": {"tau": 1.5, "expected_tau": 1.6}}
    (run / "eval" / "step-000003.json").write_text(json.dumps({"step": 3, "summary": summary, "settings": settings}))
    return run


def test_a_variant_decoded_with_several_additions_names_each_in_one_phrase():
    """The table's note reads "decoded with <this> and <that>": each addition whose setting is on, none that is off."""
    assert decoder_additions({"lookup": 7, "corpus": True, "redraft": 4}) == \
        "context lookup 7 and the corpus and re-drafting behind 4 depth-1 tokens"
    assert decoder_additions({"lookup": 0, "corpus": True, "redraft": 0}) == "the corpus"


def test_the_table_names_the_variants_decoded_with_re_drafting(tmp_path, monkeypatch):
    """model.redraft_prob > 0 sets the drafter's redraft, so that variant alone is evaluated re-drafting: its tau is
    another decoder's, and the table must say whose."""
    def fake_train(argv: list[str]) -> int:
        fake_run(argv, {"lookup": 0, "corpus": False, "redraft": 4 if argv[-1].startswith("--model.redraft") else 0})
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "plain=",
                 "--variant", "rd=--model.redraft_prob=0.5"]) == 0
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    assert "rd decoded with re-drafting behind 4 depth-1 tokens" in table and "plain decoded" not in table
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [r["decoded_with"] for r in results] == [{}, {"redraft": 4}]


def test_the_table_says_val_loss_does_not_compare_across_draft_vocabularies(tmp_path, monkeypatch):
    """With model.draft_vocab_size the val loss leaves out the labels outside the draft vocabulary (probability 0), so
    a variant with a small one read as the lower loss."""
    def fake_train(argv: list[str]) -> int:
        run = fake_run(argv, {})
        size = int(argv[-1].split("=")[1]) if argv[-1].startswith("--model.draft_vocab_size") else None
        (run / "config.yaml").write_text(f"model:\n  draft_vocab_size: {'null' if size is None else size}\n")
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "whole=",
                 "--variant", "dv=--model.draft_vocab_size=64"]) == 0
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    assert ("The variants draft from different vocabularies (model.draft_vocab_size: whole the whole vocabulary, dv 64): "
            "val loss is over the labels in each one's draft vocabulary only, so it does not compare across them.") in table
    assert [r["draft_vocab_size"] for r in json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())] == [None, 64]
    # the same vocabulary everywhere: nothing to say
    for path in tmp_path.glob("tiny/ablate-*"):
        path.unlink() if path.is_file() else shutil.rmtree(path)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "b=--model.lr=1e-3"]) == 0
    assert "different vocabularies" not in next(tmp_path.glob("tiny/ablate-*.md")).read_text()


def test_a_variant_that_exits_0_with_no_evaluation_is_a_row_and_the_others_are_still_tabulated(tmp_path, monkeypatch,
                                                                                               capsys, drawn_plots):
    """--trainer.limit_train_batches=0 trains no step and writes no evaluation, yet exits 0: the variants trained
    before it used to get no table, json or plot."""
    def fake_train(argv: list[str]) -> int:
        if not argv[-1].startswith("--trainer.limit_train_batches"):
            fake_run(argv, {})
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "z=--trainer.limit_train_batches=0", "--variant", "c="]) == 1
    assert "[ablate] z: " in capsys.readouterr().err
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    assert "| z | no evaluation (exit status 0): nothing measured |" in table
    assert "| a | 3 |" in table and "| c | 3 |" in table
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [r["variant"] for r in results] == ["a", "z", "c"] and results[1]["tau"] == {}
    assert next(tmp_path.glob("tiny/ablate-*.png")).stat().st_size > 0


def test_a_variant_that_raises_is_a_failed_row_and_every_variant_before_it_is_on_disk_already(tmp_path, monkeypatch,
                                                                                              capsys):
    """A CUDA out-of-memory (a RuntimeError) in one variant used to escape ablate: the variants already trained got no
    table, json or plot, which were written only at the end."""
    seen = []

    def fake_train(argv: list[str]) -> int:
        run = Path(argv[argv.index("--output-root") + 1]) / "tiny" / argv[argv.index("--run-name") + 1]
        tables = list(tmp_path.glob("tiny/ablate-*.md"))
        seen.append(tables[0].read_text() if tables else "")  # what a kill at this point would leave
        if run.name.endswith("-big"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB | " + "x" * 400)
        fake_run(argv, {})
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "big=--model.lr=1e-3", "--variant", "c="]) == 1
    assert seen[0] == "" and "| a | 3 |" in seen[1] and "| big | failed: RuntimeError: CUDA out of memory" in seen[2]
    err = capsys.readouterr().err
    assert "Traceback" in err and "[ablate] big: failed: RuntimeError: CUDA out of memory" in err
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    row = next(line for line in table.splitlines() if line.startswith("| big |"))
    assert row.count("|") == table.splitlines()[0].count("|") and len(row) < 300  # one cell, cut
    assert "| a | 3 |" in table and "| c | 3 |" in table
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [r.get("stopped") for r in results] == [None, 1, None]


@pytest.mark.parametrize("a_fails", [False, True])
@pytest.mark.parametrize("stop", [130, 143, KeyboardInterrupt])
def test_ctrl_c_or_sigterm_stops_the_whole_ablation_with_the_table_of_the_variants_so_far(tmp_path, monkeypatch, capsys,
                                                                                         stop, a_fails):
    """train turns Ctrl-C into status 130 and SIGTERM into 143: ablate took them for a diverged variant and started the
    next one, so stopping 10 variants took 10 Ctrl-Cs, and a scheduler's SIGKILL came before any table. A variant that
    failed before the stop (a CUDA out-of-memory) must not take the stop's status, 1 where a scheduler reads 130/143 as
    "requeue me", nor its line naming the variants never trained."""
    launched = []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        if len(launched) == 2:  # b
            if stop is KeyboardInterrupt:  # Ctrl-C outside Lightning's loop (data preparation, say)
                raise KeyboardInterrupt
            return stop
        if a_fails:
            raise RuntimeError("CUDA out of memory")
        fake_run(argv, {})
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    status = main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                   "--variant", "b=", "--variant", "c="])
    assert status == (130 if stop is KeyboardInterrupt else stop)
    assert len(launched) == 2  # c never started
    why = "stopped by SIGTERM" if stop == 143 else "interrupted (SIGINT)"
    err = capsys.readouterr().err
    assert f"[ablate] b: {why} (exit status {status}); the variants after it are not run" in err
    rerun = err.strip().splitlines()[-1]
    assert rerun.startswith("[ablate] not measured: b, c; to train only those")
    # a's evaluation recorded no packing (or a failed): nothing was decided, so the rerun's variants decide for
    # themselves, not decode with a forced --eval.packed_weights=off (mutation review 9: a37)
    assert "--eval.packed_weights" not in rerun
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    assert ("| a | failed: RuntimeError: CUDA out of memory (exit status 1)" if a_fails else "| a | 3 |") in table
    assert f"| b | {why} (exit status {status}): nothing measured |" in table
    assert "| c |" not in table
    assert [r["variant"] for r in json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())] == ["a", "b"]


def test_a_stopped_ablation_says_the_command_that_trains_only_the_variants_not_measured(tmp_path, monkeypatch, capsys):
    """After a Ctrl-C training's own line said to start the same command again, which takes a new stamp and trains
    the variants already measured again; nothing said how to train only the missing ones."""
    launched = []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        if argv[argv.index("--run-name") + 1].endswith("-tree") and len(launched) == 2:
            return 130  # Ctrl-C in the second variant
        fake_run(argv, {"packed_weights_resolved": True})  # the first decides: the others decode alike
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    out = tmp_path / "out dir"  # one shell word only where quoted
    # fp32 given: packing, which the fake evaluation says it decided, is refused where precision auto picks bf16
    given = ["--recipe", "tiny", "--steps", "3", "--eval-limit", "1", "--output-root", str(out), "--model.lr=0.002",
             "--trainer.precision=32-true",
             "--variant", "a=", "--variant", "tree", "--variant", "q=--model.objective=dpace --model.gamma=5"]
    assert main(given) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[ablate] not measured: tree, q; to train only those (a new table beside this one): make "
                           "ablate RECIPE=tiny ARGS="), line
    make = shlex.split(line.split(": ", 2)[2])  # as the shell hands it to make, which hands ARGS to the shell again
    args = shlex.split(make[3].removeprefix("ARGS=").replace("$$", "$"))
    assert make[:3] == ["make", "ablate", "RECIPE=tiny"] and "--variant" in args and "tree" in args  # the default's name
    assert "--eval.packed_weights=on" in args  # the kernels the variants measured here decoded with
    stopped = launched[1]
    launched.clear()
    assert main(["--recipe", "tiny", *args]) == 0  # as the Makefile runs it
    assert [argv[argv.index("--run-name") + 1].rsplit("-", 1)[1] for argv in launched] == ["tree", "q"]
    without_run = lambda argv: sorted(arg for arg in argv if not arg.startswith("ablate-"))  # noqa: E731
    assert without_run(launched[0]) == without_run(stopped)  # the same launch as the stopped one's
    assert launched[1][-2:] == ["--model.objective=dpace", "--model.gamma=5"] and "--model.lr=0.002" in launched[1]
    assert len(list(out.glob("tiny/ablate-*.md"))) == 2


def test_under_steps_and_minutes_every_variant_keeps_the_steps_schedule_and_the_rerun_line_both_budgets(tmp_path,
                                                                                                       monkeypatch,
                                                                                                       capsys):
    """Both flags stop a variant at whichever ends first, as in training, on the steps' learning-rate schedule:
    annealing by the clock there would change the schedule being compared (mutation review 9: a05). The rerun line
    after a stop must keep --minutes too, or the variants not measured train under another budget than the ones
    measured (a36)."""
    launched = []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        if len(launched) == 2:
            return 130  # Ctrl-C in b
        fake_run(argv, {})
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--minutes", "2", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "b=--model.lr=1e-3"]) == 130
    first = launched[0]
    assert "--trainer.max_steps=3" in first and "--trainer.max_time=00:00:02:00" in first
    assert "--model.anneal_by_max_time=true" not in first and "--trainer.max_time=null" not in first
    line = capsys.readouterr().err.strip().splitlines()[-1]
    make = shlex.split(line.split(": ", 2)[2])
    args = shlex.split(make[3].removeprefix("ARGS=").replace("$$", "$"))
    stopped = launched[1]
    launched.clear()
    assert main(["--recipe", "tiny", *args]) == 0  # as the Makefile runs it
    without_run = lambda argv: sorted(arg for arg in argv if not arg.startswith("ablate-"))  # noqa: E731
    assert without_run(launched[0]) == without_run(stopped)  # the same budget as the variant it stands in for


@pytest.mark.parametrize("when", ["set-up", "fit", "between"])
def test_a_sigterm_outside_fit_stops_the_ablation_with_a_row_and_the_table_too(tmp_path, monkeypatch, capsys, when):
    """Lightning's SIGTERM handler exists only inside fit: one in a variant's set-up (its feature stores: minutes each)
    or while the table was written took the default action, so the ablation died with no row for the variant, no
    table printed, and no status of its own. In fit, Lightning's handler calls the one it replaced: that one must
    leave the stop to it (a stop where a step ends, saved), not raise in the middle of the step."""
    received = []

    def own_handler(signum, frame):  # stands in for the process's own (the default one would end pytest)
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, own_handler)
    launched, went_on = [], []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        if len(launched) == 2 and when == "set-up":
            os.kill(os.getpid(), signal.SIGTERM)  # delivered here, before fit
            went_on.append("set-up")
        if len(launched) == 2 and when == "fit":  # as Lightning's fit registers its handler over ablate's
            replaced = signal.getsignal(signal.SIGTERM)
            noted = []
            signal.signal(signal.SIGTERM, _HandlersCompose([lambda signum, frame: noted.append(signum), replaced]))
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                went_on.append("fit")  # the step goes on to its end, where Lightning stops the run
            finally:
                signal.signal(signal.SIGTERM, replaced)
            assert noted
            return 143  # training.train's status for the stop
        fake_run(argv, {})
        return 0

    write_results = training.ablate.write_results

    def write_and_signal(base, results):
        write_results(base, results)
        if when == "between" and len(results) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    monkeypatch.setattr(training.ablate, "write_results", write_and_signal)
    try:
        status = main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                       "--variant", "b=", "--variant", "c="])
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == 143
    assert went_on == (["fit"] if when == "fit" else [])
    assert len(launched) == (1 if when == "between" else 2)  # c never started
    assert not received and restored is own_handler  # ablate's handler while it ran, the process's own again after
    out, err = capsys.readouterr()
    assert "[ablate] b: stopped by SIGTERM (exit status 143); the variants after it are not run" in err
    assert "| a | 3 |" in out and "| b | stopped by SIGTERM (exit status 143): nothing measured |" in out  # printed
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    assert "| b | stopped by SIGTERM (exit status 143): nothing measured |" in table and "| c |" not in table


def test_the_processes_lightning_starts_for_several_devices_train_the_same_runs_and_write_nothing(tmp_path, monkeypatch,
                                                                                                   capsys):
    """With trainer.devices > 1 Lightning re-runs this command in each other process: each took its own stamp, so
    trained in a run folder of its own, and wrote a second table of the newest stamp, every row 'no evaluation'."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", ABLATE_STAMP_ENV):
        monkeypatch.delenv(name, raising=False)
    handed = []

    def fake_train(argv: list[str]) -> int:  # what Lightning's processes would inherit
        handed.append((argv[argv.index("--run-name") + 1], os.environ.get(ABLATE_STAMP_ENV)))
        fake_run(argv, {})
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path / "first"), "--variant", "a="]) == 0
    (run, stamp), = handed
    assert run == f"ablate-{stamp}-a" and ABLATE_STAMP_ENV not in os.environ  # not handed to a later ablation
    capsys.readouterr()

    monkeypatch.setenv(ABLATE_STAMP_ENV, "20250101-000000")  # a process Lightning started: local rank 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    trained = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: trained.append(argv[argv.index("--run-name") + 1]))
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path / "other"), "--variant", "a=",
                 "--variant", "b="]) == 0  # no evaluation of its own: rank 0 wrote it
    assert trained == ["ablate-20250101-000000-a", "ablate-20250101-000000-b"]  # rank 0's run folders
    assert not (tmp_path / "other").exists()  # no table, json or plot
    assert "[ablate]" not in capsys.readouterr().out
    # A stop ends it too, with the stop's status: rank 0 starts no later variant, and this one started alone would
    # wait in its first collective for ranks that never come
    trained.clear()
    monkeypatch.setenv(ABLATE_STAMP_ENV, "20250101-000000")  # main took it out of the environment as it ended
    monkeypatch.setattr(training.ablate, "train_main",
                        lambda argv: trained.append(argv[argv.index("--run-name") + 1]) or 143)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path / "other"), "--variant", "a=",
                 "--variant", "b="]) == 143
    assert trained == ["ablate-20250101-000000-a"] and not (tmp_path / "other").exists()


def test_a_shared_flag_that_every_variant_sets_again_is_refused_before_any_trains(tmp_path, capsys, monkeypatch):
    """Each variant's overrides come after the flags they share: `--model.distill_top_k=16` beside the default
    variants, which each name their distill_top_k, trained every one without it and the table never said so."""
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: pytest.fail("a variant trained"))
    assert main(["--recipe", "tiny", "--steps", "2", "--output-root", str(tmp_path), "--variant", "a=--model.lr=1e-3",
                 "--variant", "b=--model.lr 2e-3", "--model.lr=5e-4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --model.lr=5e-4: every variant sets model.lr itself (a, b), after the flags they share, so "
                   "it changes none of them: drop it, or give it in the variants' overrides (--variant name=... "
                   "--model.lr=5e-4)"], err
    assert not any(tmp_path.iterdir())


def test_a_bad_flag_every_variant_shares_is_named_as_given_not_blamed_on_a_variant(tmp_path, capsys, monkeypatch):
    """--eval-limit 0 was reported as `--variant decayed_ce: eval.limit=0: ...`, naming a variant the user may never
    have typed (the first default one)."""
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: pytest.fail("a variant trained"))
    refused = [(["--eval-limit", "0"], "--eval-limit 0: eval.limit=0: must be at least 1"),
               (["--eval-max-new-tokens", "2"], "--eval-max-new-tokens 2: eval.max_new_tokens=2: must be at least 3"),
               (["--eval-limit", "3", "--model.lr=0"], "--model.lr=0: "),
               (["--model.lrr=3"], "--model.lrr=3: ")]
    for flags, named in refused:
        assert main(["--recipe", "tiny", "--steps", "5", "--output-root", str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {named}"), err
    # A file every variant reads: one line before any trains, not the same error from each of the 10 default variants.
    assert main(["--recipe", "tiny", "--steps", "5", "--output-root", str(tmp_path), "--eval.prompts=missing.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval.prompts=missing.jsonl: no such file" in err[0] and "--variant" not in err[0], err
    assert not any(tmp_path.iterdir())


def test_a_flag_every_variant_shares_may_fix_what_an_earlier_one_could_not_launch(tmp_path, monkeypatch):
    """The machine and the files are checked once every shared flag is applied: --steps alone on top of a GPU recipe is
    no launch on a CPU machine, and blaming it would refuse the --trainer.accelerator=cpu given after it."""
    gpu_recipe = tmp_path / "tiny-gpu.yaml"
    gpu_recipe.write_text(recipe_path("tiny").read_text().replace("accelerator: cpu", "accelerator: gpu"))
    assert "accelerator: gpu" in gpu_recipe.read_text()
    monkeypatch.setattr(training.ablate, "recipe_path", lambda name: gpu_recipe)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    launched = []
    monkeypatch.setattr(training.ablate, "train_main", lambda argv: launched.append(argv) or 2)
    main(["--recipe", "tiny", "--steps", "2", "--eval-limit", "1", "--output-root", str(tmp_path / "out"),
          "--variant", "a=", "--trainer.accelerator=cpu"])
    assert len(launched) == 1


def test_the_plot_of_the_ten_default_variants_keeps_names_bars_and_curves_clear():
    """The 10 default variants' names ran into each other under the bars, the bars' legend covered the last variant's
    tree bar, and the 20-entry legend of the depth panel covered its curves."""
    results = [{"variant": parse_variant(text)[0], "chain_tau": 1.6, "tau": {32: 2.2}, "recall": [0.6, 0.5, 0.4],
                "accuracy": [0.4, 0.3, 0.2]} for text in DEFAULT_VARIANTS]
    figure = plot(results)
    figure.canvas.draw()
    bars, depth = figure.axes
    inside = figure.bbox
    for label in bars.get_xticklabels():
        assert label.get_rotation() > 0  # slanted, so the long names do not run into each other
        box = label.get_window_extent()
        assert inside.x0 <= box.x0 and box.y0 >= inside.y0, label.get_text()  # and none cut off by the figure's edge
    for axes in (bars, depth):
        legend = axes.get_legend()
        assert legend is not None and not any(legend.get_window_extent().overlaps(ax.get_window_extent())
                                              for ax in (bars, depth)), axes.get_ylabel()
    assert len(depth.get_legend().get_texts()) == len(results) + 2  # a colour per variant, a line style per metric


def test_the_plot_draws_every_measured_bar_of_every_variant_over_that_variants_name():
    """Each variant's chain and tree bars stand in its own group, over its name, one bar per budget it measured: a bar
    drawn at another variant's place, or a budget left out, compares the wrong variants."""
    curves = {"recall": [0.6, 0.5], "accuracy": [0.4, 0.3]}
    results = [{"variant": "a", "chain_tau": 1.5, "tau": {16: 2.0, 64: 2.5}, **curves},
               {"variant": "b", "chain_tau": 1.6, "tau": {16: 2.1}, **curves}]  # b stopped before decoding at 64
    bars, _ = plot(results).axes
    assert [bar.get_height() for bar in bars.patches] == [1.5, 2.0, 2.5, 1.6, 2.1]
    names = [label.get_text() for label in bars.get_xticklabels()]
    nearest = [names[min(range(len(names)), key=lambda i: abs(bars.get_xticks()[i] - bar.get_center()[0]))]
               for bar in bars.patches]
    assert names == ["a", "b"] and nearest == ["a", "a", "a", "b", "b"]


def test_every_bar_has_the_colour_of_its_legend_entry_chain_or_tree_budget():
    """The bars' legend names a colour per decoder (chain, tree@b), the same in every variant's group: a bar coloured
    by its variant instead would be read as another budget's tau."""
    curves = {"recall": [0.6], "accuracy": [0.4]}
    results = [{"variant": "a", "chain_tau": 1.5, "tau": {16: 2.0, 64: 2.5}, **curves},
               {"variant": "b", "chain_tau": 1.6, "tau": {16: 2.1, 64: 2.6}, **curves}]
    bars, _ = plot(results).axes
    legend = {text.get_text(): to_hex(handle.get_facecolor())
              for text, handle in zip(bars.get_legend().get_texts(), bars.get_legend().legend_handles)}
    assert list(legend) == ["chain", "tree@16", "tree@64"] and len(set(legend.values())) == 3
    colours = [to_hex(bar.get_facecolor()) for bar in bars.patches]
    assert colours == [legend["chain"], legend["tree@16"], legend["tree@64"]] * 2


def test_the_depth_panel_draws_each_variants_recall_and_accuracy_in_its_colour_and_their_line_styles():
    """The legend names recall as the solid line with dots and top-1 as the dashed line with crosses, one colour per
    variant: a curve drawn from the other metric's values, or in another variant's colour, reads as the wrong one."""
    results = [{"variant": "a", "chain_tau": 1.5, "tau": {16: 2.0}, "recall": [0.6, 0.5], "accuracy": [0.4, 0.3]},
               {"variant": "b", "chain_tau": 1.6, "tau": {16: 2.1}, "recall": [0.7, 0.6], "accuracy": [0.5, 0.2]}]
    _, depth = plot(results).axes
    curves = [(line.get_color(), line.get_marker(), line.get_linestyle(), list(line.get_ydata()))
              for line in depth.lines if len(line.get_ydata())]  # the legend's empty style-only entries left out
    assert curves == [("C0", "o", "-", [0.6, 0.5]), ("C0", "x", "--", [0.4, 0.3]),
                      ("C1", "o", "-", [0.7, 0.6]), ("C1", "x", "--", [0.5, 0.2])]


def test_the_depth_panel_draws_each_curve_from_depth_1():
    """Acceptance and recall are per draft depth, the first drafted token at depth 1, as the table's acc@1.. reads:
    a curve from depth 0 shifts every figure to the depth before it."""
    results = [{"variant": "a", "chain_tau": 1.5, "tau": {16: 2.0}, "recall": [0.6, 0.5, 0.4],
                "accuracy": [0.4, 0.3, 0.2]}]
    _, depth = plot(results).axes
    assert [list(line.get_xdata()) for line in depth.lines if len(line.get_ydata())] == [[1, 2, 3], [1, 2, 3]]


def test_a_variants_bars_stand_side_by_side_chain_then_each_budget():
    """Each of a variant's bars has its own place in its group, the chain first then the budgets smallest to largest:
    bars drawn over one another hide every tau but the last one drawn."""
    results = [{"variant": "a", "chain_tau": 1.5, "tau": {16: 2.0, 64: 2.5}, "recall": [0.6], "accuracy": [0.4]}]
    bars, _ = plot(results).axes
    patches = bars.patches
    centres = [bar.get_center()[0] for bar in patches]
    assert centres == sorted(centres) and len(set(centres)) == 3
    assert all(right.get_x() >= left.get_x() + left.get_width() - 1e-9 for left, right in zip(patches, patches[1:]))


def stop_while_writing_table(monkeypatch, variants: int, signum) -> list:
    """Fakes the launches (each a run of 3 steps) and sends `signum` to this process as the table of the
    `variants`-th variant is written; returns the launches' argv, in order."""
    launched = []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        fake_run(argv, {})
        return 0

    write_results = training.ablate.write_results

    def write_and_stop(base, results):
        if len(results) == variants:
            os.kill(os.getpid(), signum)
        write_results(base, results)

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    monkeypatch.setattr(training.ablate, "write_results", write_and_stop)
    return launched


def test_a_ctrl_c_between_variants_stops_the_ablation_as_a_sigterm_there_does(tmp_path, monkeypatch, capsys,
                                                                            python_sigint, drawn_plots):
    """A Ctrl-C while the table of a variant was written escaped main: run_cli printed a bare `interrupted`, with no
    table printed and no rerun line, where a SIGTERM at the same point gave both (found in a review)."""
    launched = stop_while_writing_table(monkeypatch, 1, signal.SIGINT)  # Ctrl-C as the table of a is written
    status = main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                   "--variant", "b=--model.lr=1e-3"])
    assert status == 130 and len(launched) == 1  # b never started
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the process's own again
    out, err = capsys.readouterr()
    assert "| a | 3 |" in out and "| b | interrupted (SIGINT) (exit status 130): nothing measured |" in out  # printed
    assert err.strip().splitlines()[-1].startswith("[ablate] not measured: b; to train only those")
    assert next(tmp_path.glob("tiny/ablate-*.png")).stat().st_size > 0


@pytest.mark.parametrize("stop, status, line", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "stopped by SIGTERM")])
def test_a_stop_while_the_last_variants_table_is_written_ends_the_ablation_stopped(tmp_path, monkeypatch, capsys,
                                                                                  python_sigint, stop, status, line):
    """A Ctrl-C (or SIGTERM) between launches is only noted, for the next variant to stop on: after the last variant
    there is none, so the ablation ended with status 0 and no stop line, as if it had not been stopped. Every variant
    was measured: the table keeps them all, the stop is the usual one line and status, and there is no rerun line."""
    launched = stop_while_writing_table(monkeypatch, 2, getattr(signal, stop))  # as the last table is written
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "b=--model.lr=1e-3"]) == status
    assert len(launched) == 2
    out, err = capsys.readouterr()
    assert "| a | 3 |" in out and "| b | 3 |" in out  # both measured, and printed
    assert err.strip().splitlines()[-1] == line and "not measured" not in err
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [r["variant"] for r in results] == ["a", "b"] and not any(r.get("stopped") for r in results)


def test_a_ctrl_c_during_a_variants_launch_stops_that_variant_where_it_is(tmp_path, monkeypatch, capsys, python_sigint):
    """In a launch, ablate's SIGINT handler raises Ctrl-C's KeyboardInterrupt, which training stops on: only noted, as
    between launches, the variant would train on to its end and the stop come one variant late."""
    launched, went_on = [], []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        if len(launched) == 2:  # Ctrl-C in b's launch
            os.kill(os.getpid(), signal.SIGINT)
            went_on.append(argv)
        fake_run(argv, {})
        return 0

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    assert main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                 "--variant", "b=--model.lr=1e-3", "--variant", "c="]) == 130
    assert len(launched) == 2 and not went_on  # b stopped where the Ctrl-C came; c never started
    out, err = capsys.readouterr()
    assert "| a | 3 |" in out and "| b | interrupted (SIGINT) (exit status 130): nothing measured |" in out
    assert err.strip().splitlines()[-1].startswith("[ablate] not measured: b, c; to train only those")


def test_an_ablation_started_with_sigint_ignored_as_a_background_job_is_not_stopped_by_it(tmp_path, monkeypatch):
    """A background job (`make ablate &`) starts with SIGINT ignored, so that a Ctrl-C at its terminal is not for it:
    the ablation keeps it ignored while it runs, trains every variant through one, and leaves it ignored."""
    launched = stop_while_writing_table(monkeypatch, 1, signal.SIGINT)  # a Ctrl-C as the table of a is written
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        status = main(["--recipe", "tiny", "--steps", "3", "--output-root", str(tmp_path), "--variant", "a=",
                       "--variant", "b=--model.lr=1e-3"])
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == 0 and len(launched) == 2 and after is signal.SIG_IGN
    results = json.loads(next(tmp_path.glob("tiny/ablate-*.json")).read_text())
    assert [r["variant"] for r in results] == ["a", "b"] and not any(r.get("stopped") for r in results)


@pytest.mark.parametrize("steps, every, measured", [(3, None, True), (6, None, True), (6, 3, False)])
def test_a_sigterm_during_a_variants_final_evaluation_keeps_its_measurement(tmp_path, monkeypatch, capsys, steps,
                                                                            every, measured):
    """A SIGTERM noted during the last evaluation makes training return 143 once max_steps is reached, with the
    evaluation written: ablate called the variant "nothing measured" and its rerun line trained it again (found in a
    review). So is one at step 3 of 6, off the schedule of 6 (an epoch limit's stop evaluates there). An evaluation on
    a variant's own schedule, before a stop, is still not its end."""
    launched = []

    def fake_train(argv: list[str]) -> int:
        launched.append(argv)
        fake_run(argv, {})  # its evaluation at step 3
        return 143

    monkeypatch.setattr(training.ablate, "train_main", fake_train)
    schedule = [] if every is None else [f"--eval.every_n_train_steps={every}"]
    status = main(["--recipe", "tiny", "--steps", str(steps), "--output-root", str(tmp_path),
                   "--variant", f"a={' '.join(schedule)}", "--variant", "b=--model.lr=1e-3"])
    assert status == 143 and len(launched) == 1  # b never started
    out, err = capsys.readouterr()
    rerun = err.strip().splitlines()[-1]
    table = next(tmp_path.glob("tiny/ablate-*.md")).read_text()
    if measured:
        assert "| a | 3 |" in out and "| a | 3 |" in table and "2.00 (2.10)" in table  # its tau, measured
        assert "no drafter/ exported: a (stopped by SIGTERM)" in table
        assert rerun.startswith("[ablate] not measured: b; to train only those") and "--variant a=" not in rerun
    else:
        assert "| a | stopped by SIGTERM (exit status 143): nothing measured |" in table
        assert rerun.startswith("[ablate] not measured: a, b; to train only those")


def test_a_max_time_stop_on_the_evaluation_grid_counts_as_measured_after_a_sigterm_in_its_evaluation(tmp_path,
                                                                                               monkeypatch, capsys):
    """The tiny recipe under --minutes, evaluated every 2 steps, on a clock of one second per step: max_time (4 s)
    stops it at step 4, on the grid, and a SIGTERM during that step's evaluation makes training return 143. Only a stop
    off the grid read as measured: this one was "nothing measured", and the rerun line trained it again."""
    data = toy_data.write_conversations(tmp_path / "conversations.jsonl", 24, 30, 60)
    clock = {}
    timer_start = Timer.on_train_start

    def start_the_clock(self, trainer, pl_module):
        clock["trainer"] = trainer
        timer_start(self, trainer, pl_module)

    monkeypatch.setattr(Timer, "on_train_start", start_the_clock)
    monkeypatch.setattr(Timer, "time_elapsed", lambda self, stage="train": float(clock["trainer"].global_step)
                        if "trainer" in clock else 0.0)
    evaluate = AcceptanceEvaluation._evaluate

    def evaluate_then_sigterm(self, trainer, pl_module, *args, **kwargs):
        evaluate(self, trainer, pl_module, *args, **kwargs)
        if trainer.global_step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # noted; the Timer stops the run after this step, which is saved

    monkeypatch.setattr(AcceptanceEvaluation, "_evaluate", evaluate_then_sigterm)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # not pytest's end, should one slip through
    try:
        status = main(["--recipe", "tiny", "--minutes", str(4 / 60), "--output-root", str(tmp_path / "out"),
                       "--eval-limit", "1", "--eval-max-new-tokens", "4", "--variant", "a=--eval.every_n_train_steps=2",
                       "--variant", "b=", f"--data.data_path={data}", f"--data.cache_dir={tmp_path / 'cache'}",
                       "--data.batch_size=2", "--data.val_fraction=0.1", "--trainer.enable_progress_bar=false",
                       "--trainer.max_steps=100"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == 143
    run = next(path for path in (tmp_path / "out" / "tiny").iterdir() if path.is_dir())
    evaluations = {step: json.loads(AcceptanceEvaluation.eval_file(run, step).read_text()) for step in (2, 4)}
    assert evaluations[4].get("max_time_stop") is True and "max_time_stop" not in evaluations[2]  # 2: time was left
    out, err = capsys.readouterr()
    (row,) = [line for line in out.splitlines() if line.startswith("| a |")]
    assert row.startswith("| a | 4 |"), row  # its tau, measured at its stop
    rerun = err.strip().splitlines()[-1]
    assert rerun.startswith("[ablate] not measured: b; to train only those") and "--variant a=" not in rerun
