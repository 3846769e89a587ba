"""GPU training: the throughput benchmark (CPU and CUDA) and a GPU recipe launched where there is no GPU.

    OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/training/test_throughput.py

The CUDA case skips without a GPU. The qwen3-8b case (b) itself (an 8B random-weight target) is run
by hand on a GPU: `python -m training.throughput --recipe qwen3-8b --random-target`.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, Qwen3Config

from ddtree.errors import DDTreeError
from ddtree.targets import resolve_target

import training.target
import training.train
import training.throughput
from training.arguments import check_throughput_args, throughput_parser
from training.module import DistillModule
from training.throughput import (FIRST_TOKEN, RANDOM_TARGETS, batch_token_ids, build_module, main, phase_clock,
                                 random_target_loader, recipe_settings, recipe_step_flops, store_batch, time_call)

TINY = ["--target", "tiny-random", "--settings", "4x1x4", "--length", "80", "--repeats", "1", "--threads", "1"]


def measured_line(output: str) -> str:
    return next(line for line in output.splitlines() if "training step" in line)


def local_target(folder, config) -> str:
    """A random-weight target saved as a local folder, with tiny-random's tokenizer (the MASK id comes from it)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(resolve_target("tiny-random")) / name, folder)
    return str(folder)


def test_cpu_run_reports_both_steps_and_their_ratio(capsys, monkeypatch):
    timed = []  # the exact seconds: the line prints them to the ms, and a ~3 ms target forward rounds by up to 20%

    def recording(*args, **kwargs):
        timed.append(time_call(*args, **kwargs)[0])
        return timed[-1], None

    monkeypatch.setattr(training.throughput, "time_call", recording)
    assert main([*TINY, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    line = measured_line(out)
    assert line.lstrip().startswith("4x1x4 on tiny-random: target forward ")  # the target timed, named in its line
    threads = torch.get_num_threads()
    assert f"{threads} thread{'s' * (threads != 1)}, torch {torch.__version__}" in out.splitlines()[0]  # machine's line
    target, step = (float(x) for x in re.search(r"target forward ([\d.]+) s, training step ([\d.]+) s", line).groups())
    ratio = float(re.search(r"ratio ([\d.]+)", line).group(1))
    exact_target, exact_step, _ = timed  # target forward, training step, offline step
    assert (target, step) == (round(exact_target, 3), round(exact_step, 3))
    assert ratio == round(exact_step / exact_target, 2)
    assert "target tokens/s" in line and "offline step" in line and "peak" not in line  # no GPU memory on a CPU
    # the first step's phases, each as it ends (where a step that never finishes stalls), then the warm-ups
    phases = [re.sub(r" took [\d.]+ s$", "", x.strip()) for x in out.splitlines() if ": step 1: " in x]
    assert phases == ["4x1x4: step 1: forward", "4x1x4: step 1: backward", "4x1x4: step 1: optimizer step"]


def test_each_phase_of_the_first_step_is_timed_from_the_end_of_the_phase_before(monkeypatch, capsys):
    """The phases' seconds say where a first step that never finishes stalls: each counted from the start of the
    step, the backward and the optimizer step would carry the forward's compile time."""
    clock = iter([10.0, 12.0, 15.0, 19.0])
    monkeypatch.setattr(training.throughput, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    mark = phase_clock("case: step 1", torch.device("cpu"))
    for phase in ("forward", "backward", "optimizer step"):
        mark(phase)
    assert capsys.readouterr().out.splitlines() == [
        "case: step 1: forward took 2.0 s", "case: step 1: backward took 3.0 s", "case: step 1: optimizer step took 4.0 s"]


def test_a_phase_is_timed_once_the_gpu_has_finished_it(monkeypatch):
    """CUDA kernels run after their launch returns: read before a synchronise, the forward's seconds were its launches'
    and the backward's carried the forward's kernels, which misplaced where a first step that never finishes stalls."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(f"synchronize {device}"))
    monkeypatch.setattr(training.throughput, "time", SimpleNamespace(perf_counter=lambda: calls.append("clock") or 0.0))
    mark = phase_clock("case: step 1", torch.device("cuda:1"))
    mark("forward")
    assert calls == ["clock", "synchronize cuda:1", "clock"]


def test_the_timed_steps_without_a_label_print_no_phase_and_never_wait_for_the_gpu(monkeypatch, capsys):
    """Only the first, compiling call prints its phases: the timed calls' lines would bury the result line, and a
    synchronise in each phase of a timed step would add three waits to the time the events measure."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: pytest.fail("synchronised without a label"))
    mark = phase_clock("", torch.device("cuda"))
    for phase in ("forward", "backward", "optimizer step"):
        mark(phase)
    assert capsys.readouterr().out == ""


def test_each_timed_training_step_trains_the_drafter_and_leaves_no_gradient(monkeypatch):
    """The figure is a training step's: a step that skipped the backward or the optimizer step would time a forward
    alone and print a ratio and tokens a second no training run reaches."""
    built, changed = [], []

    def keeping(*args, **kwargs):
        built.append(build_module(*args, **kwargs))
        return built[-1]

    def once(fn, repeats, warmup, device, label="", first=None):
        before = [p.detach().clone() for p in built[0].drafter.parameters()]
        fn()
        after = list(built[0].drafter.parameters())
        changed.append(sum(not torch.equal(b, a) for b, a in zip(before, after)) / len(before))
        assert all(p.grad is None for p in after)  # zeroed, not carried into the next timed step
        return 1.0, None

    monkeypatch.setattr(training.throughput, "build_module", keeping)
    monkeypatch.setattr(training.throughput, "time_call", once)
    assert main([*TINY, "--device", "cpu"]) == 0
    assert changed[0] == 0 and changed[1] > 0.5 and changed[2] > 0.5  # target forward, training step, offline step


def test_a_random_target_is_built_in_the_dtype_training_loads_it_in_frozen(monkeypatch):
    """--random-target stands in for load_target: a float32 target where training loads bfloat16 timed a forward of
    twice the bytes (and ran an 8B target out of a GPU's memory)."""
    config = AutoConfig.from_pretrained(resolve_target("tiny-random"))
    monkeypatch.setitem(RANDOM_TARGETS, "tiny-random", config)
    model, tokenizer = random_target_loader("tiny-random", torch.device("cpu"))("tiny-random", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training and not any(p.requires_grad for p in model.parameters()) and tokenizer is None


def test_a_random_target_is_built_from_its_configuration_never_loaded(monkeypatch):
    """--random-target: the recipe's target is built from its configuration, never downloaded or read from disk (an
    8B target the machine may not hold), and the drafter is wired to it as training wires it. Qwen3-8B's layout here,
    its widths and vocabulary shrunk (main over the qwen3-8b recipe takes 20 s, its logits over 151936 ids)."""
    shrunken = Qwen3Config(vocab_size=1024, num_hidden_layers=36, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    monkeypatch.setitem(RANDOM_TARGETS, "Qwen/Qwen3-8B", shrunken)
    monkeypatch.setattr(training.target, "load_target", lambda *a, **k: pytest.fail("loaded the real target"))
    settings = dict(target="Qwen/Qwen3-8B", num_anchors=4, num_layers=1, block_size=4, mask_token_id=1000)
    module = build_module(settings, random_target=True, device=torch.device("cpu"))
    assert (module.target.config.hidden_size, module.target.config.num_hidden_layers) == (32, 36)
    assert module.drafter.config.hidden_size == 32 and module.drafter.config.num_target_layers == 36
    assert module.target.dtype == torch.bfloat16 and not module.target.training  # as training loads it, frozen


def test_the_offline_step_is_timed_on_the_batch_a_store_serves_and_the_step_on_the_tokens(monkeypatch):
    """The offline figure is the step that skips the target: timed on the token batch, it is the full step again."""
    served, timed = [], []
    shared_step = DistillModule.shared_step

    def recording_step(self, batch, *args, **kwargs):
        served.append("features" in batch)
        return shared_step(self, batch, *args, **kwargs)

    def once(fn, repeats, warmup, device, label="", first=None):
        served.clear()
        fn()
        timed.append(list(served))
        return 1.0, None

    monkeypatch.setattr(DistillModule, "shared_step", recording_step)
    monkeypatch.setattr(training.throughput, "time_call", once)
    assert main([*TINY, "--device", "cpu"]) == 0
    assert timed == [[], [False], [True]]  # target forward, training step, offline step


def test_a_target_with_a_smaller_vocabulary_gets_a_batch_of_ids_it_holds(tmp_path, capsys):
    """Llama-2, Mistral-7B and TinyLlama hold 32000 rows: ids up to 40000 stopped in an IndexError traceback."""
    config = AutoConfig.from_pretrained(resolve_target("tiny-random"))
    config.vocab_size = 32000
    target = local_target(tmp_path / "tiny32k", config)
    assert main([*TINY, "--device", "cpu", "--target", target]) == 0
    assert "target tokens/s" in measured_line(capsys.readouterr().out)


def test_a_length_past_the_targets_position_table_is_one_line(tmp_path, capsys):
    """GPT-2's positions are a learned table: past it the forward stopped in an IndexError traceback."""
    target = local_target(tmp_path / "gpt2", GPT2Config(n_positions=128, n_embd=64, n_layer=2, n_head=4))
    assert main([*TINY, "--device", "cpu", "--target", target, "--length", "200"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == [f"error: --length 200 is past the 128 positions of target {target!r} (max_position_embeddings): "
                      "give --length at most 128"]


def test_a_recipes_length_past_the_targets_position_table_names_the_recipes_max_length(monkeypatch, capsys):
    """Without --length the length is the recipe's data.max_length: the error must send the user to that setting,
    not to a --length flag the command line never held."""
    monkeypatch.setattr("training.throughput.context_limit", lambda target: 128)
    assert main(["--recipe", "tiny", "--device", "cpu", "--batch-size", "1", "--threads", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == ["error: tiny's data.max_length 256 is past the 128 positions of target 'tiny-random' "
                      "(max_position_embeddings): give --length at most 128"]


def test_a_recipes_length_too_short_to_anchor_a_block_names_the_recipes_max_length(monkeypatch, capsys):
    """A recipe of one's own may train on a data.max_length of 48: the line named a --length never given."""
    def short(name):
        return recipe_settings(name)[0], 48, 1

    monkeypatch.setattr("training.throughput.recipe_settings", short)
    monkeypatch.setattr("training.throughput.build_module", lambda *args: pytest.fail("built before the check"))
    assert main(["--recipe", "tiny", "--device", "cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == ["error: tiny's data.max_length 48 leaves no reply token with a successor to anchor a block on "
                      "after the 60-token prompt; give --length more than 61"]


def test_a_recipes_model_compile_is_timed_compiled_and_said_so(monkeypatch, capsys):
    """`--recipe` takes the drafter's settings from the recipe: its model.compile was overridden by the absent
    --compile, and the step timed was the plain one its training never runs, under a header that said nothing."""
    def compiling(name):
        settings, max_length, batch_size = recipe_settings(name)
        return {**settings, "compile": True}, max_length, batch_size

    built = []

    def stop(settings, random_target, device):
        built.append(settings["compile"])
        raise DDTreeError("stop here")

    monkeypatch.setattr("training.throughput.recipe_settings", compiling)
    monkeypatch.setattr("training.throughput.build_module", stop)
    assert main(["--recipe", "tiny", "--device", "cpu", "--length", "80"]) == 2
    assert built == [True]
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("batch "))
    assert header.endswith(", compiled drafter forward")


def test_a_recipe_that_leaves_the_drafters_shape_to_its_warm_start_is_counted_as_built(tmp_path, monkeypatch, capsys):
    """model.num_layers and model.block_size unset (None) beside model.init_from: the module takes the folder's (here 1
    layer of block 4), and the FLOP count must be of that drafter; it stopped in a TypeError traceback once every step
    had been timed."""
    folder = DistillModule(target="tiny-random", num_layers=1, block_size=4, target_layer_ids=[1, 3, 4], num_anchors=8)
    folder.configure_model()
    folder.drafter.save_pretrained(tmp_path / "drafter")

    def warm_start(name):
        settings, max_length, batch_size = recipe_settings(name)
        return ({**settings, "num_layers": None, "block_size": None, "init_from": str(tmp_path / "drafter")},
                max_length, batch_size)

    monkeypatch.setattr("training.throughput.recipe_settings", warm_start)
    monkeypatch.setattr(training.throughput, "time_call", lambda *args, **kwargs: (1.0, None))
    assert main(["--recipe", "tiny", "--device", "cpu", "--length", "80", "--batch-size", "1"]) == 0
    settings = {**recipe_settings("tiny")[0], "num_layers": 1, "block_size": 4}
    flops = recipe_step_flops(AutoConfig.from_pretrained(resolve_target("tiny-random")), settings, 80, cuda=False)
    assert f"FLOP ratio {flops.ratio:.2f}, " in measured_line(capsys.readouterr().out)


def test_the_header_line_says_the_target_has_random_weights(monkeypatch, capsys):
    """A random-weight target times as the real one does but decodes nothing: the printed figures must say which
    they are, or a pasted line reads as the downloaded model's."""
    def stop(settings, random_target, device):
        raise DDTreeError("stop here")

    monkeypatch.setattr("training.throughput.build_module", stop)
    assert main(["--recipe", "qwen3-8b", "--device", "cpu", "--length", "80", "--random-target"]) == 2
    assert main(["--recipe", "qwen3-8b", "--device", "cpu", "--length", "80"]) == 2
    random_header, real_header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch ")]
    assert random_header == real_header + ", random-weight target"


def test_the_module_is_built_on_the_device_the_step_runs_on():
    """The batch is put on --device: a module left where configure_model loaded it (the CPU) would stop the first step
    on a GPU in a device mismatch. The meta device stands in for a GPU here: every weight and buffer must move to it."""
    settings = dict(target="tiny-random", num_anchors=4, num_layers=1, block_size=4)
    module = build_module(settings, random_target=False, device=torch.device("meta"))
    assert {t.device.type for t in (*module.parameters(), *module.buffers())} == {"meta"}


def test_a_draft_vocabulary_is_timed_at_its_size_without_training_data():
    """The CPU default drafts from 8192 reply tokens, which training picks from its data (`--recipe smollm2-135m`
    stopped with that error): the tool builds a vocabulary of that size and draws its batch from it."""
    settings = dict(target="tiny-random", num_anchors=4, num_layers=1, block_size=4, gamma=4.0, draft_vocab_size=64)
    module = build_module(settings, random_target=False, device=torch.device("cpu"))
    assert module.drafter.config.draft_vocab == list(range(FIRST_TOKEN, FIRST_TOKEN + 64)) == list(batch_token_ids(settings))
    input_ids = torch.randint(FIRST_TOKEN, FIRST_TOKEN + 64, (2, 40), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    loss_mask[:, :8] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the tool steps it (its target is in bf16)
        output = module.shared_step({"input_ids": input_ids, "loss_mask": loss_mask}, 0, "train")
    assert torch.isfinite(output.loss) and output.loss > 0  # every label is in the vocabulary, so counted


@pytest.mark.parametrize("top_k", [0, 8])
def test_the_offline_step_of_a_distilling_recipe_reads_the_teacher_a_store_keeps(top_k):
    """`--recipe smollm2-135m` (distill_weight 0.5, distill_top_k 32) stopped with KeyError 'teacher_ids': the offline
    batch held the features alone. From the store's teacher the step's loss is the online step's."""
    settings = dict(target="tiny-random", num_anchors=4, num_layers=1, block_size=4, gamma=4.0, distill_weight=0.5,
                    distill_top_k=top_k)
    module = build_module(settings, random_target=False, device=torch.device("cpu"))
    input_ids = torch.randint(FIRST_TOKEN, 900, (2, 40), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    loss_mask[:, :8] = False
    batch = {"input_ids": input_ids, "loss_mask": loss_mask}
    offline = store_batch(module, batch)
    assert ("teacher_ids" in offline) == bool(top_k) and ("final_hidden" in offline) == (not top_k)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as the tool steps it
        online_loss = module.shared_step(batch, 0, "train").loss
        offline_loss = module.shared_step(offline, 0, "train").loss
    assert torch.isfinite(offline_loss) and offline_loss.item() == pytest.approx(online_loss.item(), rel=1e-3)


def test_the_offline_batch_of_a_recipe_that_does_not_distill_holds_the_features_alone():
    """A store built without distillation keeps no teacher: the offline step reads the features a store of that
    recipe serves, not a distilling store's batch."""
    settings = dict(target="tiny-random", num_anchors=4, num_layers=1, block_size=4, distill_weight=0.0)
    module = build_module(settings, random_target=False, device=torch.device("cpu"))
    input_ids = torch.randint(FIRST_TOKEN, 900, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "loss_mask": torch.ones_like(input_ids, dtype=torch.bool)}
    assert sorted(store_batch(module, batch)) == ["features", "input_ids", "loss_mask"]


def test_case_b_is_qwen3_8b_at_the_recipe_settings():
    config = RANDOM_TARGETS["Qwen/Qwen3-8B"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (36, 4096, 32, 8, 128, 12288, 151936)
    settings, max_length, batch_size = recipe_settings("qwen3-8b")
    assert settings["target"] == "Qwen/Qwen3-8B" and settings["num_anchors"] == 512 and settings["block_size"] == 16
    assert (max_length, batch_size) == (3072, 1)


@pytest.mark.parametrize("recipe, shape", [
    ("qwen3-4b", (36, 2560, 32, 8, 128, 9728, 151936, True)),  # Qwen/Qwen3-4B's config.json
    ("llama3.1-8b", (32, 4096, 32, 8, 128, 14336, 128256, False)),  # meta-llama/Llama-3.1-8B-Instruct's
])
def test_the_other_large_recipes_targets_have_their_published_configuration(recipe, shape):
    """Without them training.flops and --random-target needed the Hub for 2 of the 3 large recipes."""
    settings, _, _ = recipe_settings(recipe)
    config = RANDOM_TARGETS[settings["target"]]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == shape
    assert settings["mask_token_id"] < config.vocab_size  # the recipe's MASK is a row of the random embedding


def test_a_target_out_of_reach_names_random_target(monkeypatch, capsys):
    """The Hub error said to give a local folder, not the flag that needs no download."""
    def unreachable(settings, random_target, device):
        raise DDTreeError(f"target {settings['target']!r} is a Hub id that is not in the local cache")

    monkeypatch.setattr("training.throughput.build_module", unreachable)
    assert main(["--recipe", "qwen3-8b", "--device", "cpu", "--length", "80"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == ["error: target 'Qwen/Qwen3-8B' is a Hub id that is not in the local cache; or add --random-target "
                      "to build its published architecture with random weights, all its speed depends on"]


def test_a_target_out_of_reach_without_a_recipe_names_advice_that_runs(monkeypatch, capsys):
    """Without --recipe the line said to add --random-target, which is refused there (it needs a recipe's MASK id):
    the advice names the target's recipe, and following it gets past the check."""
    def unreachable(settings, random_target, device):
        raise DDTreeError(f"target {settings['target']!r} is a Hub id that is not in the local cache")

    monkeypatch.setattr("training.throughput.build_module", unreachable)
    assert main(["--target", "Qwen/Qwen3-8B", "--settings", "4x1x4", "--device", "cpu", "--length", "80"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == ["error: target 'Qwen/Qwen3-8B' is a Hub id that is not in the local cache; or time its recipe "
                      "with --recipe qwen3-8b --random-target to build its published architecture with random weights, "
                      "all its speed depends on"]
    check_throughput_args(throughput_parser().parse_args(["--recipe", "qwen3-8b", "--random-target"]))


@pytest.mark.parametrize("flags, given", [
    (["--target", "smollm2-135m"], "--target would be ignored: drop it"),
    (["--settings", "4x1x4"], "--settings would be ignored: drop it"),
    (["--target", "smollm2-135m", "--settings", "4x1x4"], "--target and --settings would be ignored: drop them"),
])
def test_a_recipe_with_target_or_settings_is_one_line_before_anything_is_built(flags, given, monkeypatch, capsys):
    """They were ignored without a word: the line printed the recipe's tiny-random forward, and named no target."""
    monkeypatch.setattr("training.throughput.build_module", lambda *args: pytest.fail("built before the check"))
    assert main(["--recipe", "tiny", "--device", "cpu", *flags]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"error: --recipe tiny takes the target and drafter settings from the recipe, so {given}, or "
                      "drop --recipe to time --target with --settings"]


def test_without_a_recipe_the_target_and_settings_keep_their_defaults(monkeypatch):
    built = []

    def stop(settings, random_target, device):
        built.append(settings)
        raise DDTreeError("stop here")

    monkeypatch.setattr("training.throughput.build_module", stop)
    assert main(["--device", "cpu"]) == 2
    assert [(s["target"], s["num_anchors"], s["num_layers"], s["block_size"]) for s in built] == [
        ("smollm2-135m", 16, 5, 16)]


def test_a_recipes_line_names_the_recipes_target(capsys):
    assert main(["--recipe", "tiny", "--device", "cpu", "--length", "80", "--batch-size", "1", "--repeats", "1",
                 "--warmup", "0", "--threads", "1"]) == 0
    assert measured_line(capsys.readouterr().out).lstrip().startswith("tiny on tiny-random: target forward ")


def test_a_random_target_without_a_configuration_is_one_line(capsys):
    assert main(["--random-target"]) == 2
    assert main(["--recipe", "tiny", "--random-target"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0].startswith("error: --random-target needs --recipe")
    assert errors[1].startswith("error: --random-target: no configuration for tiny's target 'tiny-random'; known: ")


@pytest.mark.parametrize("device, gpus", [("cuda", 1), ("cuda:1", 2)])  # cuda:1: events on the timed GPU's stream
def test_cuda_run_times_with_events_and_reports_peak_memory(device, gpus, capsys):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s)")
    assert main([*TINY, "--device", device]) == 0
    line = measured_line(capsys.readouterr().out)
    assert re.search(r"training step [\d.]+ s, peak [\d.]+ GiB", line)


def test_cuda_events_record_on_the_timed_gpus_stream(monkeypatch):
    """torch.cuda.Event.record() takes the current device's stream, GPU 0's unless set: with --device cuda:1 both events
    completed on an idle GPU 0 and the step's kernels went untimed. Faked here (no GPU): each event must be recorded
    while the timed device is the current one."""
    recorded = []
    fake_cuda(monkeypatch, [], recorded)
    assert time_call(lambda: None, repeats=2, warmup=0, device=torch.device("cuda:1")) == (0.005, 1)
    assert recorded == [torch.device("cuda:1")] * 4


def test_a_gpu_recipe_on_a_machine_without_a_gpu_stops_with_one_line(tmp_path, monkeypatch, capsys):
    """Before anything is loaded; the line names the recipe and the overrides that run it on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.train.main(["--recipe", "qwen3-8b", "--output-root", str(tmp_path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1
    assert "recipes/qwen3-8b.yaml: trainer.accelerator=gpu needs a CUDA GPU" in errors[0]
    # precision=auto as well: the recipe's bf16 can cost several times fp32's time on a CPU without fast bf16.
    assert errors[0].endswith("add --trainer.accelerator=cpu --trainer.precision=auto --trainer.devices=1")
    assert not any(tmp_path.iterdir())  # no run folder left behind


@pytest.mark.parametrize("flags, said", [
    (["--settings", "16x5"], "--settings '16x5': give ANCHORSxLAYERSxBLOCK"),  # was a ValueError traceback
    (["--settings", "16x5x1"], "--settings '16x5x1': give ANCHORSxLAYERSxBLOCK"),
    (["--settings", "0x5x16"], "--settings '0x5x16': give ANCHORSxLAYERSxBLOCK"),
    (["--settings", "1x\u00b2x2"], "--settings '1x\u00b2x2': give ANCHORSxLAYERSxBLOCK"),  # '²'.isdigit() is True
    (["--batch-size", "0"], "--batch-size 0: give at least 1"),  # was the default batch, silently
    (["--repeats", "0"], "--repeats 0: give at least 1"),  # was statistics' error on no data
    (["--threads", "-2"], "--threads -2: give at least 0"),
    (["--length", "61"], "--length 61 leaves no reply token with a successor to anchor a block on after the 60-token "
                         "prompt; give --length more than 61"),  # 62 holds one anchor (as training/flops.py counts it)
])
def test_bad_numbers_are_one_line_before_anything_is_built(capsys, flags, said):
    assert main([*TINY, "--device", "cpu", *flags]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {said}")


def test_no_warmup_and_zero_threads_are_accepted_and_zero_threads_keeps_torchs_own(monkeypatch, capsys):
    """--warmup 0 times the first call too and --threads 0 is torch's default (its help): only negatives are refused."""
    check_throughput_args(throughput_parser().parse_args(["--warmup", "0", "--threads", "0"]))

    def stop(settings, random_target, device):
        raise DDTreeError("stop here")

    monkeypatch.setattr(torch, "set_num_threads", lambda threads: pytest.fail(f"set to {threads} threads"))
    monkeypatch.setattr("training.throughput.build_module", stop)
    assert main(["--device", "cpu", "--warmup", "0", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: stop here"


@pytest.mark.parametrize("device, gpus, said", [
    ("foo", 0, "--device 'foo' is not a device name; give cpu, cuda or cuda:N"),  # was torch's RuntimeError traceback
    ("cuda:3", 1, "--device cuda:3: this machine has 1 CUDA GPU(s), numbered from 0"),  # was unchecked until it ran
    ("cuda", 0, "--device cuda: this machine has no CUDA GPU"),
])
def test_a_bad_device_is_one_line_before_anything_is_built(device, gpus, said, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr("training.throughput.build_module", lambda *args: pytest.fail("built before the check"))
    assert main([*TINY, "--device", device]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {said}")


def test_an_empty_settings_or_target_is_refused_not_taken_for_the_default(monkeypatch, capsys):
    """`--settings "$S"` or `--recipe "$R"` with the variable unset timed the default 16x5x16 on smollm2-135m without a
    word."""
    monkeypatch.setattr("training.throughput.build_module", lambda *args: pytest.fail("built with the default"))
    assert main(["--device", "cpu", "--settings", ""]) == 2
    assert "error: --settings '': give ANCHORSxLAYERSxBLOCK" in capsys.readouterr().err
    assert main(["--device", "cpu", "--recipe", ""]) == 2  # `--recipe "$R"`: it timed the default target too
    assert capsys.readouterr().err.startswith("error: --recipe is empty")
    built = []

    def stop(settings, random_target, device):
        built.append(settings["target"])
        raise DDTreeError("stop here")

    monkeypatch.setattr("training.throughput.build_module", stop)
    assert main(["--device", "cpu", "--target", "", "--settings", "4x1x4"]) == 2
    assert built == [""]  # the empty name is the user's, refused where the target is resolved


def test_by_default_each_figure_is_the_median_of_three_calls_after_one_warm_up_on_torchs_threads(monkeypatch):
    """A bare run's protocol (the module docstring's): one call timed alone is no median, none warmed up
    times the first call's allocations and compiles, and a fixed thread count is not torch's own on another machine."""
    timed = []

    def recording(fn, repeats, warmup, device, label="", first=None):
        timed.append((repeats, warmup))
        return 1.0, None

    monkeypatch.setattr(torch, "set_num_threads", lambda threads: pytest.fail(f"set to {threads} threads"))
    monkeypatch.setattr(training.throughput, "time_call", recording)
    assert main(["--target", "tiny-random", "--settings", "4x1x4", "--length", "80", "--device", "cpu"]) == 0
    assert timed == [(3, 1)] * 3  # target forward, training step, offline step


def test_time_call_takes_the_median_of_the_timed_calls_after_the_warm_ups(monkeypatch):
    """The warm-up calls (first allocations, kernel picks, compiles: 100 s each here) are left out of the median."""
    now, durations = [0.0], iter([100.0, 100.0, 9.0, 2.0, 1.0])

    def call():
        now[0] += next(durations)

    monkeypatch.setattr(training.throughput.time, "perf_counter", lambda: now[0])
    assert time_call(call, repeats=3, warmup=2, device=torch.device("cpu")) == (2.0, None)


def test_the_line_derives_its_rates_and_flop_ratio_from_the_times_and_the_batch(monkeypatch, capsys):
    """Tokens a second count the whole batch (2 x 80), each step its own; the FLOP ratio is the CPU path's (the context
    unpadded), and a TFLOP/s rate counts every sequence of the batch."""
    seconds = iter([0.5, 2.0, 1.0])  # target forward, training step, offline step
    monkeypatch.setattr(training.throughput, "time_call", lambda *args, **kwargs: (next(seconds), None))
    assert main([*TINY, "--device", "cpu", "--batch-size", "2"]) == 0
    line = measured_line(capsys.readouterr().out)
    settings = dict(target="tiny-random", num_anchors=4, num_layers=1, block_size=4)
    flops = recipe_step_flops(AutoConfig.from_pretrained(resolve_target("tiny-random")), settings, 80, cuda=False)
    assert "ratio 4.00, 80 target tokens/s; offline step 1.000 s, 160 tokens/s" in line
    assert line.endswith(f"FLOP ratio {flops.ratio:.2f}, target {2 * flops.full_target / 0.5 / 1e12:.3g} TFLOP/s, "
                         f"step {2 * flops.total / 2.0 / 1e12:.3g} TFLOP/s")


def test_batch_size_sets_the_batch_timed_and_the_tokens_a_second_count(monkeypatch, capsys):
    """--batch-size without a recipe must size the batch: kept at the default 2, the line printed the tokens a second of
    a batch the user did not ask for."""
    seconds = iter([0.5, 2.0, 1.0])  # target forward, training step, offline step
    monkeypatch.setattr(training.throughput, "time_call", lambda *args, **kwargs: (next(seconds), None))
    assert main([*TINY, "--device", "cpu", "--batch-size", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch 3 x 80, ")
    assert "120 target tokens/s; offline step 1.000 s, 240 tokens/s" in measured_line(out)


def test_a_length_at_the_targets_position_table_runs(tmp_path, capsys):
    """The table holds positions 0..n-1: a batch of exactly n tokens fits, and refusing it would cap a GPT-2 run one
    token short of its context."""
    target = local_target(tmp_path / "gpt2", GPT2Config(n_positions=128, n_embd=64, n_layer=2, n_head=4))
    assert main([*TINY, "--device", "cpu", "--target", target, "--length", "128"]) == 0
    assert measured_line(capsys.readouterr().out).lstrip().startswith(f"4x1x4 on {target}: target forward ")


def test_peak_memory_is_printed_in_gibibytes_as_labelled():
    """The label says GiB (2**30 bytes): divided by 1e9, a 3 GiB peak read as 3.2 GiB."""
    assert training.throughput.gigabytes(3 * 2**30) == ", peak 3.0 GiB"
    assert training.throughput.gigabytes(None) == ""  # a CPU run has no peak to print


def fake_cuda(monkeypatch, calls: list, recorded: list | None = None) -> None:
    """torch.cuda as time_call uses it, each call noted in `calls` (no GPU needed); events time 5 ms, and each is noted
    in `recorded` with the device current when it was recorded."""
    current = [None]

    @contextlib.contextmanager
    def cuda_device(device):
        previous, current[0] = current[0], torch.device(device)
        try:
            yield
        finally:
            current[0] = previous

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            if recorded is not None:
                recorded.append(current[0])

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 5.0

    for name, fake in (("device", cuda_device), ("Event", Event),
                       ("synchronize", lambda device=None: calls.append(f"synchronize {device}")),
                       ("reset_peak_memory_stats", lambda device=None: calls.append("reset peak")),
                       ("max_memory_allocated", lambda device=None: 1)):
        monkeypatch.setattr(torch.cuda, name, fake)


def test_the_peak_memory_is_the_timed_calls_not_the_warm_ups(monkeypatch):
    """The first call compiles and picks kernels, with workspaces a training step never holds again: the peak counted
    from before it overstated the step's memory."""
    calls = []
    fake_cuda(monkeypatch, calls)
    time_call(lambda: calls.append("call"), repeats=1, warmup=1, device=torch.device("cuda:1"))
    assert calls == ["call", "synchronize cuda:1", "reset peak", "call"]


def test_a_warm_up_is_timed_once_the_gpu_has_finished_it(monkeypatch, capsys):
    """Read before a synchronise, a warm-up's seconds were its launches': a first call stalled in its kernels printed a
    short warm-up and the wait landed in the next line."""
    calls = []
    fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(training.throughput, "time", SimpleNamespace(perf_counter=lambda: calls.append("clock") or 0.0))
    time_call(lambda: calls.append("call"), repeats=1, warmup=1, device=torch.device("cuda:1"), label="case: step")
    assert calls[:4] == ["clock", "call", "synchronize cuda:1", "clock"]
    assert capsys.readouterr().out == "case: step: warm-up 1/1 took 0.0 s\n"


def test_the_first_warm_up_is_the_call_that_prints_its_phases(monkeypatch):
    """The phases are printed to say where the first, compiling call stalls: given to a later warm-up, they timed a
    call already compiled and the first stalled without a word."""
    calls = []
    time_call(lambda: calls.append("step"), repeats=1, warmup=2, device=torch.device("cpu"),
              first=lambda: calls.append("step with phases"))
    assert calls == ["step with phases", "step", "step"]


def test_the_batch_marks_its_first_positions_as_prompt_as_training_data_does(monkeypatch):
    """The step's cost follows where blocks may anchor, on reply tokens only: a batch all reply anchored over the prompt
    too, a step no training batch runs."""
    served = []
    monkeypatch.setattr(training.throughput, "store_batch", lambda module, batch: served.append(batch) or batch)
    monkeypatch.setattr(training.throughput, "time_call", lambda *args, **kwargs: (1.0, None))
    assert main([*TINY, "--device", "cpu"]) == 0
    (loss_mask,) = (batch["loss_mask"] for batch in served)
    prompt = training.throughput.PROMPT_TOKENS  # 60, as the module docstring says
    assert loss_mask.shape == (2, 80) and not loss_mask[:, :prompt].any() and loss_mask[:, prompt:].all()


def test_the_step_is_timed_with_the_fused_optimizer_training_uses(monkeypatch):
    """configure_optimizers fuses AdamW outside DeepSpeed and fp16 (one kernel, not a dozen foreach launches): timed
    unfused, a GPU step read slower than the training it stands for."""
    adamw, made = torch.optim.AdamW, []
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kwargs: made.append(kwargs) or adamw(params, **kwargs))
    monkeypatch.setattr(training.throughput, "time_call", lambda *args, **kwargs: (1.0, None))
    assert main([*TINY, "--device", "cpu"]) == 0
    assert [kwargs.get("fused") for kwargs in made] == [True]


def test_the_target_forward_is_timed_without_a_kv_cache(monkeypatch):
    """Training reads the target's features in one pass and keeps no cache: a forward that filled one timed the
    cache's allocations and copies too, and the ratio read lower than a training step's."""
    seen, timed = [], []

    def hooked(*args, **kwargs):
        module = build_module(*args, **kwargs)
        module.target.get_decoder().register_forward_pre_hook(
            lambda decoder, inputs, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True)
        return module

    def once(fn, *args, **kwargs):
        seen.clear()
        fn()
        timed.append(list(seen))
        return 1.0, None

    monkeypatch.setattr(training.throughput, "build_module", hooked)
    monkeypatch.setattr(training.throughput, "time_call", once)
    assert main([*TINY, "--device", "cpu"]) == 0
    assert timed[0] == [False]  # the target forward's one call
