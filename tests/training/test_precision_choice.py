"""The precision is chosen per machine (ddtree/precision.py), and never over a user's explicit choice.

The measurement is stubbed: one stub where bf16 is fast (an AMX Xeon), one where it is slow (an
AVX2-only CPU), plus the user overrides, in a recipe and on the command line.
A warm start trains the fp32 weights every precision keeps, whatever dtype its folder was saved in.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import ddtree.precision
import training.recipe
from ddtree.errors import DDTreeError
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.precision import BF16_MARGIN, Choice, fast_precision, resolve_dtype
from ddtree.targets import build_drafter_config
from training.arguments import RECIPES_DIR
from training.module import DistillModule
from training.recipe import check_values, config_arg, read_recipe

BF16_FAST = lambda: {torch.float32: 0.010, torch.bfloat16: 0.003}  # noqa: E731 - AMX: bf16 ~3x faster
BF16_SLOW = lambda: {torch.float32: 0.010, torch.bfloat16: 0.067}  # noqa: E731 - AVX2: bf16 6.7x slower
BF16_TIED = lambda: {torch.float32: 0.010, torch.bfloat16: 0.0095}  # noqa: E731 - within the margin


@pytest.mark.parametrize("measure, expected", [(BF16_FAST, torch.bfloat16), (BF16_SLOW, torch.float32),
                                               (BF16_TIED, torch.float32)])
def test_the_cpu_choice_follows_the_measurement(measure, expected):
    choice = fast_precision("cpu", measure=measure)
    assert choice.dtype == expected
    assert choice.lightning == {torch.bfloat16: "bf16-mixed", torch.float32: "32-true"}[expected]
    assert "x the time of fp32" in choice.reason


def test_a_gpu_gets_bf16_from_its_own_compute_capability(monkeypatch):
    """torch.cuda.is_bf16_supported() counts emulation (a T4 or V100 runs bf16 several times slower) and asks the
    current device: the choice follows the capability of the device asked about. CUDA is mocked: device 0, the
    current one, is a T4 (7.5), device 1 an H100 (9.0); 2 to 4 sit at the 8.0 boundary: an A100 (8.0) and an A10 (8.6)
    compute bf16, a V100 (7.0) does not."""
    gpus = {0: ("Tesla T4", (7, 5)), 1: ("NVIDIA H100", (9, 0)), 2: ("NVIDIA A100", (8, 0)), 3: ("NVIDIA A10", (8, 6)),
            4: ("Tesla V100", (7, 0))}
    index = lambda device: torch.device(device).index or 0  # noqa: E731 - "cuda" alone is the current device, 0
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # the T4 emulates
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpus[index(device)][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpus[index(device)][1])
    t4, h100 = fast_precision("cuda"), fast_precision("cuda:1")
    assert t4.dtype == torch.float32 and "Tesla T4 (compute capability 7.5) has no native bf16" in t4.reason
    assert h100.dtype == torch.bfloat16 and "NVIDIA H100 (compute capability 9.0) computes bf16" in h100.reason
    assert fast_precision(torch.device("cuda", 0)).dtype == torch.float32
    assert fast_precision("cuda:2").dtype == torch.bfloat16
    assert fast_precision("cuda:3").dtype == torch.bfloat16
    assert fast_precision("cuda:4").dtype == torch.float32


@pytest.mark.parametrize("device", ["mps", "xpu:0"])
def test_a_device_neither_cpu_nor_cuda_gets_fp32_and_is_not_measured(device):
    """No rule says which precision is fast on an Apple GPU or an Intel one, and the CPU's timing says nothing of it:
    such a device gets fp32, which computes everywhere, and the line says why."""
    choice = fast_precision(device, measure=lambda: pytest.fail("measured the CPU for another device"))
    assert choice.dtype == torch.float32
    assert choice.reason == f"no measurement for device {torch.device(device).type}; fp32 is always exact"


def test_the_real_measurement_returns_a_usable_choice():
    choice = fast_precision("cpu")
    assert choice.dtype in (torch.bfloat16, torch.float32)
    ratio = float(choice.reason.split("a bf16 matmul is ")[1].split("x the time of fp32")[0])  # what it measured here
    assert ratio > 0  # the reason prints it to 2 decimals: only a ratio at the margin itself may round either way
    assert (choice.dtype == torch.bfloat16) == (ratio < BF16_MARGIN) or abs(ratio - BF16_MARGIN) <= 0.005


def test_the_measurement_runs_on_one_thread_and_gives_the_threads_back(monkeypatch):
    """Split across threads, a matmul waits for its slowest: with another job on one core of a 2-core Xeon without
    AMX, bf16 read 0.77x fp32 (1.6-2x idle) and training picked it. One thread is stretched by load evenly."""
    from ddtree.precision import time_linear

    seen, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *args: seen.append(torch.get_num_threads()) or linear(*args))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seconds = time_linear(tokens=8, features=16, hidden=16, repeats=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1] * 6 and set(seconds) == {torch.float32, torch.bfloat16}


def test_the_ranks_a_run_starts_inherit_its_measured_choice(monkeypatch):
    """Lightning's DDP launcher starts ranks 1..N-1 as copies of the command with rank 0's environment: each measured
    alone, and on a machine near the margin two ranks could train in different precisions."""
    monkeypatch.delenv(ddtree.precision.INHERITED_CHOICE, raising=False)  # restored after the test
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)
    monkeypatch.setattr(ddtree.precision, "time_linear", BF16_FAST)
    launcher = fast_precision("cpu")
    assert launcher.dtype == torch.bfloat16
    inherited = dict(os.environ)  # what a rank the launcher starts now gets
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)  # a new process...
    monkeypatch.setattr(ddtree.precision, "time_linear", BF16_SLOW)  # ...whose own measurement would read otherwise
    monkeypatch.setattr(os, "environ", inherited)
    rank = fast_precision("cpu")
    assert rank.dtype == torch.bfloat16 and rank.reason.startswith(launcher.reason)
    assert rank.reason.endswith("(measured by the process that started this one)")
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)
    inherited[ddtree.precision.INHERITED_CHOICE] = "float16 made up"  # not a value this project writes: measured
    assert fast_precision("cpu").dtype == torch.float32
    # measured on another host or with other kernels (a child held to torch's default kernels): measured afresh
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)
    name, cpu, reason = launcher.name, ddtree.precision.cpu_key(), launcher.reason
    inherited[ddtree.precision.INHERITED_CHOICE] = f"{name}\tother-host {cpu}\t{reason}"
    assert fast_precision("cpu").dtype == torch.float32
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")  # not this machine's AVX2/AVX512
    inherited[ddtree.precision.INHERITED_CHOICE] = f"{name}\t{cpu}\t{reason}"
    assert fast_precision("cpu").dtype == torch.float32


def ranks_choosing(monkeypatch, *chosen: str) -> SimpleNamespace:
    """A DistillModule's view of a launch whose ranks resolved trainer.precision to `chosen` (rank 0 first)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_gather_object",
                        lambda out, mine: out.__setitem__(slice(None), [f"{name}, target in {dtype}" for name, dtype in
                                                                       (c.split(":") for c in chosen)]))
    module = SimpleNamespace(trainer=SimpleNamespace(world_size=len(chosen), precision=chosen[0].split(":")[0]),
                             frozen_target_dtype=lambda: getattr(torch, chosen[0].split(":")[1]))
    return module


def test_ranks_that_resolved_auto_to_other_precisions_are_refused_before_the_first_step(monkeypatch):
    """srun and torchrun start each rank on its own: under trainer.precision auto each timed its CPU, and near the
    margin two ranks trained in bf16-mixed and 32-true without a word."""
    with pytest.raises(DDTreeError) as refused:
        DistillModule.check_ranks_precision(ranks_choosing(monkeypatch, "bf16-mixed:bfloat16", "32-true:float32"))
    assert str(refused.value) == (
        "the ranks would train in different precisions (rank 0 bf16-mixed, target in bfloat16; rank 1 32-true, target "
        "in float32): trainer.precision auto measured each rank's CPU on its own; give every rank one, "
        "--trainer.precision=32-true (or bf16-mixed)")
    DistillModule.check_ranks_precision(ranks_choosing(monkeypatch, "32-true:float32", "32-true:float32"))  # agreed
    with pytest.raises(DDTreeError, match="rank 1 32-true, target in bfloat16"):  # model.target_dtype set otherwise
        DistillModule.check_ranks_precision(ranks_choosing(monkeypatch, "32-true:float32", "32-true:bfloat16"))


def test_a_rank_inherits_fp32_where_its_launcher_measured_bf16_slow(monkeypatch):
    """fp32 is inherited as fp32, not only bf16 as bf16: on a CPU that emulates bf16, a rank taking bf16 in its place
    trained several times slower than its launcher, and in another precision."""
    monkeypatch.delenv(ddtree.precision.INHERITED_CHOICE, raising=False)  # restored after the test
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)
    monkeypatch.setattr(ddtree.precision, "time_linear", BF16_SLOW)
    assert fast_precision("cpu").dtype == torch.float32
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)  # a rank it starts...
    monkeypatch.setattr(ddtree.precision, "time_linear", BF16_FAST)  # ...whose own measurement would read otherwise
    rank = fast_precision("cpu")
    assert rank.dtype == torch.float32 and rank.reason.endswith("(measured by the process that started this one)")


def test_a_replaced_measurement_is_not_kept_for_this_process_or_the_ones_it_starts(monkeypatch):
    """`measure=` stands in for the timing in one call: kept, every later `auto` in the process, and the processes it
    starts (through the inherited choice), would follow the stub and not this CPU."""
    monkeypatch.delenv(ddtree.precision.INHERITED_CHOICE, raising=False)  # restored after the test
    monkeypatch.setattr(ddtree.precision, "_cpu_choice", None)
    assert fast_precision("cpu", measure=BF16_FAST).dtype == torch.bfloat16
    assert ddtree.precision._cpu_choice is None and ddtree.precision.INHERITED_CHOICE not in os.environ


def stub_choice(monkeypatch, measure):
    chosen = fast_precision("cpu", measure=measure)
    calls = []

    def stubbed(device="cpu", measure=None):
        calls.append(device)
        return chosen

    monkeypatch.setattr(training.recipe, "fast_precision", stubbed)
    monkeypatch.setattr(ddtree.precision, "fast_precision", stubbed)
    return calls


def tiny_recipe(tmp_path: Path, precision: str) -> Path:
    """recipes/tiny.yaml (which says auto) with `precision` in its trainer section, as tmp_path/<precision>.yaml."""
    text, count = re.subn(r"^  precision: \S+", f"  precision: {precision}", (RECIPES_DIR / "tiny.yaml").read_text(),
                          count=1, flags=re.MULTILINE)
    assert count == 1
    (tmp_path / f"{precision}.yaml").write_text(text)
    return tmp_path / f"{precision}.yaml"


@pytest.mark.parametrize("measure, expected", [(BF16_FAST, "bf16-mixed"), (BF16_SLOW, "32-true")])
def test_a_recipe_with_precision_auto_gets_the_measured_choice_and_says_so(tmp_path, monkeypatch, capsys, measure, expected):
    calls = stub_choice(monkeypatch, measure)
    config = read_recipe(tiny_recipe(tmp_path, "auto"), [])
    assert config.trainer.precision == expected and calls == ["cpu"]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[precision]")]
    assert len(printed) == 1 and expected in printed[0]


@pytest.mark.parametrize("accelerator, measured", [("auto", "cuda"), ("gpu", "cuda"), ("cpu", "cpu")])
def test_auto_is_measured_on_the_device_the_run_trains_on(tmp_path, monkeypatch, accelerator, measured):
    """trainer.accelerator auto on a GPU machine trains on the GPU: the host CPU's measurement would give bf16 to a
    T4 or V100, which emulates it, or fp32 to an H100 on a CPU without fast bf16."""
    calls = stub_choice(monkeypatch, BF16_SLOW)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    recipe = tiny_recipe(tmp_path, "auto")
    text, count = re.subn(r"^  accelerator: cpu$", f"  accelerator: {accelerator}", recipe.read_text(), count=1,
                          flags=re.MULTILINE)
    assert count == 1
    recipe.write_text(text)
    config_arg(recipe, [])
    assert calls == [measured]


@pytest.mark.parametrize("overrides", [["--trainer.accelerator=gpu"], ["--trainer.accelerator", "cuda"]])
def test_auto_is_measured_on_the_device_an_accelerator_override_names(tmp_path, monkeypatch, overrides):
    """The recipe's trainer.accelerator was read, not the override's: a CPU recipe launched on a GPU with
    --trainer.accelerator=gpu was given the host CPU's choice (fp32 on a CPU without fast bf16), and a GPU recipe with
    --trainer.accelerator=cpu the GPU's."""
    calls = stub_choice(monkeypatch, BF16_SLOW)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config_arg(tiny_recipe(tmp_path, "auto"), overrides)  # tiny says accelerator: cpu
    config_arg(tiny_recipe(tmp_path, "auto"), [*overrides, "--trainer.accelerator=cpu"])  # the last wins
    assert calls == ["cuda", "cpu"]


def test_an_explicit_precision_is_never_changed(tmp_path, monkeypatch):
    calls = stub_choice(monkeypatch, BF16_SLOW)
    # in the recipe: bf16-mixed, which an AVX2 machine would not have chosen
    assert read_recipe(tiny_recipe(tmp_path, "bf16-mixed"), []).trainer.precision == "bf16-mixed"
    # on the command line, over a recipe that says auto: no measurement at all
    assert read_recipe(tiny_recipe(tmp_path, "auto"), ["--trainer.precision=bf16-mixed"]).trainer.precision == "bf16-mixed"
    assert calls == []


def test_a_precision_override_in_two_items_is_an_override_too(tmp_path, monkeypatch, capsys):
    """`--trainer.precision 16-mixed` (two argv items, as train.py passes them on) is no different from `=16-mixed`."""
    calls = stub_choice(monkeypatch, BF16_SLOW)
    recipe = tiny_recipe(tmp_path, "auto")
    assert read_recipe(recipe, ["--trainer.precision", "bf16-mixed"]).trainer.precision == "bf16-mixed"
    assert yaml.safe_load(config_arg(recipe, ["--trainer.precision", "16-mixed"]))["trainer"]["precision"] == "16-mixed"
    assert calls == [] and "[precision]" not in capsys.readouterr().out  # nothing measured, no misleading "auto ->" line


@pytest.mark.parametrize("overrides", [["--trainer.precision=auto"], ["--trainer.precision", "auto", "--model.lr=0.002"]])
def test_an_override_of_auto_measures_on_any_recipe(tmp_path, monkeypatch, capsys, overrides):
    """auto is this project's value: passed on to the parser, Lightning refused it on every recipe. It replaces the
    recipe's precision alone: the rest of its trainer section (its step count, its accelerator) is kept."""
    calls = stub_choice(monkeypatch, BF16_SLOW)
    recipe = tiny_recipe(tmp_path, "bf16-mixed")
    config = read_recipe(recipe, overrides)
    assert config.trainer.precision == "32-true" and calls == ["cpu"]
    assert "[precision] trainer.precision auto -> 32-true" in capsys.readouterr().out
    as_written = read_recipe(recipe, [])
    assert config.model.lr == (0.002 if "--model.lr=0.002" in overrides else as_written.model.lr)
    kept = (as_written.trainer.max_steps, as_written.trainer.accelerator)
    assert (config.trainer.max_steps, config.trainer.accelerator) == kept


def test_the_last_precision_override_wins_with_auto_among_them(tmp_path, monkeypatch):
    calls = stub_choice(monkeypatch, BF16_SLOW)
    tiny = tiny_recipe(tmp_path, "bf16-mixed")
    assert read_recipe(tiny, ["--trainer.precision=16-mixed", "--trainer.precision", "auto"]).trainer.precision == "32-true"
    assert read_recipe(tiny, ["--trainer.precision=auto", "--trainer.precision", "16-mixed"]).trainer.precision == "16-mixed"
    assert calls == ["cpu"]  # measured only where auto won


@pytest.mark.parametrize("overrides", [["--trainer.precision="], ["--trainer.precision", "--model.lr=0.001"],
                                       ["--model.lr=0.001", "--trainer.precision"]])
def test_a_precision_override_without_a_value_is_one_line(tmp_path, monkeypatch, overrides):
    """A bare --trainer.precision is one line naming it, whether another flag follows it or nothing (given last)."""
    stub_choice(monkeypatch, BF16_SLOW)
    for recipe, kept in ((tiny_recipe(tmp_path, "auto"), "auto"), (tiny_recipe(tmp_path, "bf16-mixed"), "bf16-mixed")):
        with pytest.raises(DDTreeError) as error:
            read_recipe(recipe, overrides)
        line = str(error.value)
        assert "\n" not in line and line.startswith(f"{recipe}: --trainer.precision was given no value: give one of")
        assert "32-true" in line and line.endswith(f"drop the override to keep the recipe's {kept}")


@pytest.mark.parametrize("precision, overrides", [("auto", ["--trainer.precision=fp32"]), ("AUTO", []),
                                                  ("bf16_mixed", [])])
def test_a_precision_lightning_does_not_know_is_told_which_it_does(tmp_path, monkeypatch, precision, overrides):
    """jsonargparse's line said only that no type of trainer.precision took fp32 (on the command line or in the
    recipe), not what to write instead."""
    stub_choice(monkeypatch, BF16_SLOW)
    with pytest.raises(DDTreeError) as error:
        read_recipe(tiny_recipe(tmp_path, precision), overrides)
    line = str(error.value)
    assert "\n" not in line and 'Parser key "trainer.precision"' in line
    assert line.endswith("; give one of 16, 16-mixed, 16-true, 32, 32-true, bf16, bf16-mixed, bf16-true, or auto (the "
                         "fastest on this machine)")


def test_eval_packed_weights_on_over_a_bf16_target_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """--eval.packed_weights=on where precision auto picks bf16 (or bf16-mixed is given) was refused by the evaluation
    callback at the start of training, after the feature store was built and the target loaded; fp32 packs."""
    stub_choice(monkeypatch, BF16_FAST)
    config = read_recipe(tiny_recipe(tmp_path, "auto"), ["--eval.packed_weights=on"])
    with pytest.raises(DDTreeError) as error:
        check_values(config)
    assert str(error.value) == ("eval.packed_weights on: packing is for fp32 on a CPU, and the target would run in "
                                "bfloat16 on cpu; give trainer.precision=32-true to pack, or use eval.packed_weights "
                                "off (or auto)")
    with pytest.raises(DDTreeError, match="; give model.target_dtype=float32 to pack, or use eval.packed_weights off"):
        check_values(read_recipe(tiny_recipe(tmp_path, "32-true"), ["--eval.packed_weights=on",
                                                                    "--model.target_dtype=bfloat16"]))
    check_values(read_recipe(tiny_recipe(tmp_path, "bf16-mixed"), ["--eval.packed_weights=on",
                                                                    "--model.target_dtype=float32"]))
    check_values(read_recipe(tiny_recipe(tmp_path, "32-true"), ["--eval.packed_weights=on"]))
    check_values(read_recipe(tiny_recipe(tmp_path, "bf16-mixed"), []))  # auto: decides at the start, says nothing here


def test_the_default_recipe_chooses_its_precision():
    text = (RECIPES_DIR / "smollm2-135m.yaml").read_text()
    assert "\n  precision: auto" in text


def test_the_decoding_cli_dtype_auto_follows_the_same_rule(monkeypatch):
    stub_choice(monkeypatch, BF16_SLOW)
    dtype, reason = resolve_dtype("auto", "cpu")
    assert dtype == torch.float32 and "auto -> float32" in reason
    stub_choice(monkeypatch, BF16_FAST)
    assert resolve_dtype("auto", "cpu")[0] == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == (torch.float32, None)  # explicit: no choice, no line


def test_the_dtype_auto_line_and_refusal_name_where_the_dtype_was_given(monkeypatch):
    """ddtree.Decoder(dtype=...) in Python says `dtype`, not the CLI's --dtype: its user has no flag to look for. A bad
    name is refused offering auto among the choices, as the CLI's --help does."""
    stub_choice(monkeypatch, BF16_SLOW)
    assert resolve_dtype("auto", "cpu", "dtype")[1].startswith("dtype auto -> float32: ")
    with pytest.raises(DDTreeError, match=r"^dtype='fp17': choose auto or one of float32, "):
        resolve_dtype("fp17", "cpu", "dtype")


def test_the_decoding_cli_dtype_auto_is_chosen_for_the_device_it_decodes_on(monkeypatch):
    """`--dtype auto --device cuda` follows the GPU's capability: the host CPU's measurement would give bf16 to a T4
    on an AMX host, which emulates it, or fp32 to an H100 on a CPU without fast bf16."""
    calls = stub_choice(monkeypatch, BF16_SLOW)
    resolve_dtype("auto", "cuda:1")
    resolve_dtype("auto", torch.device("cpu"))
    assert calls == ["cuda:1", torch.device("cpu")]


def test_a_choice_names_its_dtype():
    assert Choice(torch.bfloat16, "x").name == "bfloat16" and Choice(torch.float32, "x").lightning == "32-true"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_lightning_name_of_a_dtype_trains_fp32_weights_against_a_target_in_that_dtype(dtype):
    """The name a choice, and the feature store's "finish it in" line, give --trainer.precision: the target runs in
    the dtype named, and the drafter keeps fp32 weights (a half dtype's -true trains half weights)."""
    from training.target import dtype_for_precision

    name = Choice(dtype, "x").lightning
    assert dtype_for_precision(name) == dtype and name.endswith("-true" if dtype == torch.float32 else "-mixed")


def test_a_warm_start_from_a_bf16_folder_trains_fp32_weights(tmp_path, tiny_target):
    """A bf16 export (make export --dtype bfloat16, the published DFlash drafters) loaded in the dtype it was saved in
    would train bf16 weights under trainer.precision=32, and under bf16-mixed, whose master weights are fp32."""
    target, tokenizer = tiny_target
    folder = tmp_path / "bf16"
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4)
    DFlashDraftModel(config).to(torch.bfloat16).save_pretrained(folder)
    module = DistillModule(target="tiny-random", init_from=str(folder), target_dtype="float32")
    module.configure_model()
    assert {p.dtype for p in module.drafter.parameters()} == {torch.float32}
