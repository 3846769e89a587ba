"""A recipe's data written by its target on first use (training/recipe_data.py, data.regenerate).

    .venv/bin/pytest -q tests/training/test_recipe_data.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import training.recipe_data
import training.train
from ddtree.errors import DDTreeError
from ddtree.targets import cache_dir, resolve_target
from training.arguments import RECIPES_DIR, ablate_parser, train_parser
from training.data import DistillDataModule
from training.recipe import read_recipe
from training.recipe_data import (AUTO_DATA, REGENERATE_FIELDS, default_data_path, prepare_recipe_data,
                                  regenerate_arguments, run_regeneration)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data"))
import regenerate  # noqa: E402  (data/regenerate.py)


def prompt_file(path: Path, count: int) -> Path:
    lines = [json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me about {i}."}]})
             for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_settings(prompts: Path) -> dict:
    return {"prompts": str(prompts), "limit": 3, "max_new_tokens": 4, "dtype": "float32", "batch_size": 2,
            "chunk_size": 2}


def regenerate_here(monkeypatch) -> None:
    """prepare_recipe_data's data/regenerate.py command run in this process (its main), not as a child: a child
    costs about 10 s of torch's and transformers' imports on a 2-core AVX2 EPYC, and the tests that use this read
    the data and the record it wrote, not its process (the SIGTERM tests below keep the child)."""

    def here(command: list[str]) -> int:
        assert command[:2] == [sys.executable, str(training.recipe_data.REGENERATE_SCRIPT)], command
        threads = torch.get_num_threads()
        try:
            return regenerate.main(command[2:])
        finally:
            torch.set_num_threads(threads)  # regenerate.py sets its --threads

    monkeypatch.setattr(training.recipe_data, "run_regeneration", here)


@pytest.fixture(scope="module")
def auto_data(tmp_path_factory):
    """The tiny settings' data, written once for the module by the base target (no adapter) into my-recipe's auto
    folder of a cache of its own (as empty_cache makes one), by regenerate.py in this process (regenerate_here): the
    two tests that read this data write nothing into it."""
    root = tmp_path_factory.mktemp("auto-data")
    settings = tiny_settings(prompt_file(root / "prompts.jsonl", 5))
    resolve_target("tiny-random")
    cache = root / "cache"
    cache.mkdir()
    (cache / "targets").symlink_to(cache_dir() / "targets", target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDTREE_CACHE", str(cache))
        regenerate_here(patch)
        datamodule = DistillDataModule(target="tiny-random", data_path=AUTO_DATA, regenerate=settings)
        prepare_recipe_data(datamodule, "my-recipe")
    return SimpleNamespace(cache=cache, settings=settings, datamodule=datamodule)


def test_auto_data_is_generated_once_into_the_cache(tmp_path, auto_data, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(auto_data.cache))
    settings, datamodule = auto_data.settings, auto_data.datamodule
    out = auto_data.cache / "data" / "my-recipe"
    assert datamodule.data_path == str(out) == str(default_data_path("my-recipe"))
    from datasets import load_from_disk

    data = load_from_disk(str(out))
    assert data["id"] == ["p0", "p1", "p2"] and all(0 <= n <= 4 for n in data["response_tokens"])

    # Present now: a second launch reads it and generates nothing.
    stamp = (out / "regeneration.json").stat().st_mtime_ns
    again = DistillDataModule(target="tiny-random", data_path=AUTO_DATA, regenerate=settings)
    prepare_recipe_data(again, "my-recipe", world_size=4)  # would refuse to generate with 4 processes
    assert (out / "regeneration.json").stat().st_mtime_ns == stamp

    # Made by other settings than the recipe's now: refused, naming what changed, and left as it was.
    overwrite = "`make data RECIPE=my-recipe ARGS=--overwrite`"
    for changed, said in (({"max_new_tokens": 5}, f"max_new_tokens: 4 -> 5.*again with --overwrite \\({overwrite}"),
                          ({"limit": 4}, "prompts answered: 3 -> 4\\): answer the other 1 with `make data RECIPE=my-"),
                          ({"limit": 2}, f"prompts answered: 3 -> 2\\): raise the recipe's data.regenerate.limit to 3 "
                                         f"to use all 3, or cut the data to 2 with --overwrite \\({overwrite}"),
                          ({"prompts": str(prompt_file(tmp_path / "other.jsonl", 5))}, f"other.jsonl.*{overwrite}")):
        edited = DistillDataModule(target="tiny-random", data_path=AUTO_DATA, regenerate={**settings, **changed})
        with pytest.raises(DDTreeError, match=f"recipe my-recipe: .*{said}"):
            prepare_recipe_data(edited, "my-recipe")
    assert (out / "regeneration.json").stat().st_mtime_ns == stamp


def test_recipe_data_without_its_record_is_refused(tmp_path):
    """A data folder that regenerate.py did not finish cannot be told apart from another target's data."""
    (tmp_path / "data").mkdir()
    datamodule = DistillDataModule(target="tiny-random", data_path=str(tmp_path / "data"),
                                   regenerate=tiny_settings(prompt_file(tmp_path / "prompts.jsonl", 5)))
    with pytest.raises(DDTreeError, match="no regeneration.json"):
        prepare_recipe_data(datamodule, "my-recipe")


def test_missing_data_with_several_processes_asks_for_make_data(tmp_path, empty_cache, monkeypatch):
    """Every process would regenerate into one cache folder at once: refused before any starts. A failed regeneration's
    line names `make data` too, so the refusal is told apart by the process count (mutation review, R04: with 2
    processes let through, regeneration started and failed, and the old match passed)."""
    started = []
    monkeypatch.setattr(training.recipe_data, "run_regeneration", lambda command: started.append(command) or 1)
    datamodule = DistillDataModule(target="tiny-random", data_path=AUTO_DATA,
                                   regenerate=tiny_settings(tmp_path / "prompts.jsonl"))
    with pytest.raises(DDTreeError, match=r"this launch runs 2 processes: generate it first with `make data "
                                          r"RECIPE=my-recipe`"):
        prepare_recipe_data(datamodule, "my-recipe", world_size=2)
    assert started == [] and not (tmp_path / "cache" / "data").exists()


def test_a_run_overriding_its_recipes_data_is_told_its_own_command_when_its_generation_fails(tmp_path, monkeypatch):
    """`--recipe tiny --data.data_path=D --data.regenerate=...` whose generation stopped was told that `make data
    RECIPE=tiny` resumes it: that writes the recipe file's data (tiny's, a folder it does not generate), never D. Its
    own regenerate.py command, written out, resumes from D's chunks; the same for a launch of several processes."""
    monkeypatch.setattr(training.recipe_data, "run_regeneration", lambda command: 1)
    datamodule = DistillDataModule(target="tiny-random", data_path=str(tmp_path / "data"),
                                   regenerate=tiny_settings(tmp_path / "prompts.jsonl"))
    own_command = r"`\S*python\S* \S*data/regenerate\.py --target tiny-random --out \S*data --prompts .* " \
        r"--chunk-size 2`"
    for world_size, said in ((1, "failed .*; rerun: "), (2, "this launch runs 2 processes: generate it first with ")):
        with pytest.raises(DDTreeError, match=said + own_command) as refusal:
            prepare_recipe_data(datamodule, "tiny", world_size=world_size)
        assert "make data" not in str(refusal.value)


def test_bad_regenerate_settings_are_named(tmp_path):
    with pytest.raises(DDTreeError, match=r"data\.regenerate\.max_tokens is not an option"):
        DistillDataModule(target="tiny-random", data_path=AUTO_DATA, regenerate={"max_tokens": 10})
    with pytest.raises(DDTreeError, match="data.regenerate is not set"):
        prepare_recipe_data(DistillDataModule(target="tiny-random", data_path=AUTO_DATA), "my-recipe")
    # A failed generation is one error, and nothing is left at the data path.
    # limit 0: refused before torch loads (1 s on a 2-core AVX2 EPYC); a missing prompts file, after it (14 s)
    datamodule = DistillDataModule(target="tiny-random", data_path=str(tmp_path / "data"), regenerate={"limit": 0})
    with pytest.raises(DDTreeError, match="generating the training data into"):
        prepare_recipe_data(datamodule, "my-recipe")
    assert not (tmp_path / "data").exists()


def test_a_recipe_without_regenerate_reads_its_data_path_unchanged(tmp_path):
    datamodule = DistillDataModule(target="tiny-random", data_path=str(tmp_path / "absent"))
    prepare_recipe_data(datamodule, "my-recipe")  # nothing to do: reading it fails later, as before
    assert datamodule.data_path == str(tmp_path / "absent") and not (tmp_path / "absent").exists()


def test_regenerate_fields_are_the_scripts_options():
    options = {action.dest for action in regenerate.build_parser()._actions}
    assert set(REGENERATE_FIELDS) <= options
    # The ones left out come from the recipe itself, split one job into shards, or are one launch's choice.
    assert options - set(REGENERATE_FIELDS) == {"help", "recipe", "for_recipe", "target", "target_adapter", "out",
                                                "shard_index", "num_shards", "merge_only", "overwrite", "check"}


def test_make_data_takes_the_recipes_regenerate_section(tmp_path, empty_cache):
    args = regenerate.apply_recipe(regenerate.parse_args(["--recipe", str(RECIPES_DIR / "smollm2-135m-gpu.yaml")]))
    assert args.out == tmp_path / "cache" / "data" / "smollm2-135m-gpu" and args.target == "smollm2-135m"
    assert (args.limit, args.max_new_tokens, args.dtype) == (4000, 256, "bfloat16")
    assert args.prompts == Path("data/prompts/train_prompts.jsonl")
    args = regenerate.parse_args(["--recipe", str(RECIPES_DIR / "smollm2-135m-gpu.yaml"), "--limit", "12"])
    assert args.limit == 12  # a flag given wins over the recipe


def test_gpu_recipe_stops_with_one_line_before_generating_anything(tmp_path, empty_cache, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the recipe would run")
    config = read_recipe(RECIPES_DIR / "smollm2-135m-gpu.yaml", [])
    assert config.data.data_path == AUTO_DATA and config.data.regenerate["limit"] == 4000
    assert training.train.main(["--recipe", "smollm2-135m-gpu", "--output-root", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "accelerator=gpu needs a CUDA GPU" in err
    assert not (tmp_path / "cache" / "data").exists()


def test_the_default_recipe_says_how_its_shipped_data_was_made_and_make_data_leaves_it_as_it_is(tmp_path, monkeypatch):
    """recipes/smollm2-135m.yaml had no data.regenerate: `make data` answered all 4000 prompts over the 2048 shipped
    ones (25-90 minutes on 2 cores) and training then read 4000 replies without a word. Its section is now
    data/README.md's command: each start checks the shipped data against it, and `make data` finds it done."""
    import shutil

    repo = RECIPES_DIR.parent
    monkeypatch.chdir(repo)  # the recipe's paths are the repository's
    config = read_recipe(RECIPES_DIR / "smollm2-135m.yaml", [])
    assert config.data.regenerate["limit"] == 2048
    datamodule = DistillDataModule(target=config.model.target, data_path=config.data.data_path,
                                   regenerate=config.data.regenerate)
    prepare_recipe_data(datamodule, "smollm2-135m")  # regenerate.py --check: refused with a line if it differed
    assert regenerate.main(["--recipe", "smollm2-135m", "--check"]) == 0

    shipped = tmp_path / "smollm2-135m"
    shutil.copytree(repo / "data" / "smollm2-135m", shipped)
    before = {path.name: path.read_bytes() for path in shipped.iterdir()}
    monkeypatch.setattr(regenerate, "load_frozen_target", lambda *args, **kwargs: pytest.fail("make data loaded the target"))
    summary = regenerate.run(regenerate.parse_args(["--recipe", "smollm2-135m", "--out", str(shipped)]))
    assert summary["num_prompts"] == 2048 and summary["response_ids"]["recovered"] == 1965
    assert {path.name: path.read_bytes() for path in shipped.iterdir()} == before
    assert not (tmp_path / "smollm2-135m.parts").exists()


@pytest.mark.parametrize("changed, advice", [
    # data/README.md's extension (a larger --limit) leaves the data answering more prompts than the recipe asks for
    ({"limit": 2000}, "(prompts answered: 2048 -> 2000): raise the recipe's data.regenerate.limit "
                      "(recipes/smollm2-135m.yaml) to 2048 to use all 2048, or cut the data to 2000 with --overwrite "
                      "(`make data RECIPE=smollm2-135m ARGS=--overwrite`)"),
    ({"limit": 2050}, "(prompts answered: 2048 -> 2050): answer the other 2 with `make data RECIPE=smollm2-135m` (it "
                      "keeps the 2048 answered), or lower the recipe's data.regenerate.limit "
                      "(recipes/smollm2-135m.yaml) to 2048"),
    ({"max_new_tokens": 128}, "(max_new_tokens: 256 -> 128): generate it again with --overwrite "
                              "(`make data RECIPE=smollm2-135m ARGS=--overwrite`), or give another output folder"),
])
def test_a_recipes_own_data_that_differs_gets_the_advice_that_mends_it(tmp_path, monkeypatch, changed, advice):
    """Training's check did not say which recipe it checked for, so the default recipe's own data/smollm2-135m was
    refused as "recipe smollm2-135m's data ... give this job its own output folder" once its settings moved (or the
    data was extended as data/README.md says): advice it could not follow. The recipe file's settings move here (a
    copy, edited, that training reads as recipes/smollm2-135m.yaml), not a run's overrides. Read-only on the shipped
    data."""
    import yaml

    import training.recipe_data

    monkeypatch.chdir(RECIPES_DIR.parent)
    recipe = yaml.safe_load((RECIPES_DIR / "smollm2-135m.yaml").read_text())
    recipe["data"]["regenerate"].update(changed)
    edited = tmp_path / "smollm2-135m.yaml"
    edited.write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr(training.recipe_data, "recipe_path", lambda name: edited)
    config = read_recipe(edited, [])
    datamodule = DistillDataModule(target=config.model.target, data_path=config.data.data_path,
                                   regenerate=config.data.regenerate)
    with pytest.raises(DDTreeError) as refused:
        prepare_recipe_data(datamodule, "smollm2-135m")
    assert str(refused.value) == (f"recipe smollm2-135m: data/smollm2-135m holds a dataset made with other settings "
                                  f"{advice}")


@pytest.mark.parametrize("override, named", [
    ("--data.regenerate.limit=64", "data.regenerate.limit=64 (the recipe's: 2048)"),
    ("--model.target_adapter={adapter}", "model.target_adapter={adapter} (the recipe's: null)"),
])
def test_a_run_that_overrides_its_recipes_data_settings_is_told_to_give_it_a_folder_of_its_own(
        tmp_path, monkeypatch, capsys, override, named):
    """Training's check named its recipe with --for-recipe even where the run overrode the data settings, so the
    refusal said to edit the recipe file or run `make data RECIPE=smollm2-135m ARGS=--overwrite`, which both go back
    to the recipe's own settings: make data found nothing to do (or wrote without the adapter), and training was
    refused again. Read-only on the shipped data."""
    adapter = tmp_path / "adapter"  # a folder check_adapter_folder takes; nothing loads it
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    override, named = override.format(adapter=adapter), named.format(adapter=adapter)
    monkeypatch.chdir(RECIPES_DIR.parent)
    assert training.train.main(["--recipe", "smollm2-135m", "--output-root", str(tmp_path / "out"), override]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: recipe smollm2-135m: data/smollm2-135m does not hold the data of this run, which overrides "
                   f"{named}: give the run a data folder of its own, --data.data_path=<a new folder> (training writes "
                   "the data there first), or drop the override")
    assert regenerate.main(["--recipe", "smollm2-135m", "--check"]) == 0  # the shipped data is still the recipe's


def test_a_recipes_data_path_under_tilde_is_its_own_not_an_override(tmp_path, monkeypatch):
    """A recipe's `data_path: ~/x` is the home folder's x (the data module expands it); read against the recipe file's
    unexpanded text it counted as an override, and the data check then refused the recipe's own data."""
    import training.recipe_data as recipe_data

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model:\n  target: tiny-random\ndata:\n  data_path: ~/replies\n  regenerate:\n    limit: 3\n")
    monkeypatch.setattr(recipe_data, "recipe_path", lambda name: recipe)
    monkeypatch.setenv("HOME", str(tmp_path))
    datamodule = DistillDataModule(target="tiny-random", data_path="~/replies", regenerate={"limit": 3})
    assert datamodule.data_path == str(tmp_path / "replies")
    assert recipe_data.recipe_overrides(datamodule, "mine", None) == []
    elsewhere = DistillDataModule(target="tiny-random", data_path=str(tmp_path / "other"), regenerate={"limit": 3})
    assert recipe_data.recipe_overrides(elsewhere, "mine", None) == [
        f"data.data_path={tmp_path / 'other'} (the recipe's: ~/replies)"]


def test_a_run_whose_own_data_answers_edited_prompts_is_given_the_command_that_regenerates_them(tmp_path, monkeypatch):
    """A run overriding its recipe's data (a folder of its own) whose prompts file was edited after the data was made
    was told "this command without --check regenerates the chunks that hold them": training's check, a command the
    user never typed. The command is written out in full."""
    prompts = prompt_file(tmp_path / "prompts.jsonl", 3)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"model:\n  target: tiny-random\ndata:\n  data_path: {tmp_path / 'recipes-own'}\n  regenerate:\n"
                      f"    prompts: {prompts}\n    limit: 3\n")
    monkeypatch.setattr(training.recipe_data, "recipe_path", lambda name: recipe)
    mine = tmp_path / "mine"  # what regenerate.py wrote for these settings (its record), before a prompt was edited
    mine.mkdir()
    settings = regenerate.response_settings(regenerate.parse_args(
        ["--target", "tiny-random", "--out", str(mine), "--prompts", str(prompts), "--limit", "3"]))
    (mine / "regeneration.json").write_text(json.dumps({**settings, "num_prompts": 3, "prompts_sha256": "0" * 64}))
    datamodule = DistillDataModule(target="tiny-random", data_path=str(mine),
                                   regenerate={"prompts": str(prompts), "limit": 3})
    with pytest.raises(DDTreeError) as refused:
        prepare_recipe_data(datamodule, "mine")
    command = [sys.executable, str(training.recipe_data.REGENERATE_SCRIPT), "--target", "tiny-random", "--out",
               str(mine), "--prompts", str(prompts), "--limit", "3"]
    assert str(refused.value) == (f"recipe mine: {prompts}: prompts that {mine} answers changed since it was generated "
                                  f"(the same 3, other text or ids): `{' '.join(command)}` regenerates the chunks "
                                  "that hold them")


def test_a_null_regenerate_setting_is_left_to_the_scripts_default():
    """`limit: null` is documented as every prompt: handed on as `--limit None`, regenerate.py refused it and the
    data was never made (mutation review 9: r04)."""
    assert regenerate_arguments("t", Path("o"), {"limit": None, "max_new_tokens": 4}) == [
        "--target", "t", "--out", "o", "--max-new-tokens", "4"]


def test_a_zero_regenerate_setting_is_handed_on_not_left_to_the_scripts_default():
    """Only null means the script's default: `limit: 0` must reach regenerate.py, which refuses it in one line. Read
    as unset it became every prompt, hours of generation the recipe never asked for; 0 for temperature or seed is
    likewise the recipe's own value, whatever the script's default is."""
    assert regenerate_arguments("t", Path("o"), {"limit": 0, "temperature": 0.0, "seed": 0}) == [
        "--target", "t", "--out", "o", "--limit", "0", "--temperature", "0.0", "--seed", "0"]


def test_a_run_overriding_a_setting_its_recipe_leaves_unset_or_its_target_is_not_checked_as_the_recipes_data(
        monkeypatch):
    """An override of a regenerate setting the recipe file does not set (temperature on smollm2-135m), or of
    model.target, is this run's data, not the recipe's: counted as the recipe's own, it was checked with --for-recipe,
    and the check's errors told the run to `make data RECIPE=smollm2-135m`, which makes the recipe's data and leaves
    the run refused again. Only a run on the recipe's own settings is checked for it (mutation review 9: r09, r10,
    r06)."""
    from training.recipe_data import check_recipe_data, recipe_overrides

    monkeypatch.chdir(RECIPES_DIR.parent)
    own = read_recipe(RECIPES_DIR / "smollm2-135m.yaml", []).data.regenerate
    assert "temperature" not in own
    hotter = DistillDataModule(target="smollm2-135m", data_path="data/smollm2-135m",
                               regenerate={**own, "temperature": 0.7})
    assert recipe_overrides(hotter, "smollm2-135m", None) == ["data.regenerate.temperature=0.7 (the recipe's: null)"]
    other_target = DistillDataModule(target="tiny-random", data_path="data/smollm2-135m", regenerate=own)
    assert recipe_overrides(other_target, "smollm2-135m", None) == ["model.target=tiny-random (the recipe's: "
                                                                    "smollm2-135m)"]
    checked = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: checked.append(command) or
                        subprocess.CompletedProcess(command, 0, stdout="", stderr=""))
    for datamodule in (hotter, other_target):
        check_recipe_data(datamodule, "smollm2-135m", Path("data/smollm2-135m"))
    own_data = DistillDataModule(target="smollm2-135m", data_path="data/smollm2-135m", regenerate=own)
    check_recipe_data(own_data, "smollm2-135m", Path("data/smollm2-135m"))
    assert ["--for-recipe" in command for command in checked] == [False, False, True]
    assert checked[-1][-3:] == ["--for-recipe", "smollm2-135m", "--check"]


def test_the_check_takes_greedy_data_made_with_another_chunk_size_or_seed(monkeypatch, capsys):
    """Neither changes a greedy reply: data made with `make data ARGS=--chunk-size 256` was refused at every start.
    Nor does --top-p, which draws nothing at temperature 0 (greedy settings record top_p 1.0)."""
    monkeypatch.chdir(RECIPES_DIR.parent)
    check = lambda *flags: regenerate.main(["--recipe", "smollm2-135m", "--check", *flags])  # noqa: E731
    assert check("--chunk-size", "256") == 0 and check("--seed", "5") == 0 and check("--top-p", "0.9") == 0
    capsys.readouterr()
    assert check("--max-new-tokens", "128") == 2  # a setting that does change the replies
    assert "max_new_tokens: 256 -> 128" in capsys.readouterr().err
    assert check("--seed", "5", "--temperature", "0.7") == 2  # sampled: the seed counts with the temperature


def test_the_check_takes_the_same_prompts_file_however_its_path_is_spelled(monkeypatch, capsys):
    repo = RECIPES_DIR.parent
    monkeypatch.chdir(repo / "data")  # ../ from here, and absolute, name the file the record names from the root
    check = lambda *flags: regenerate.main(["--recipe", "smollm2-135m", "--out", "smollm2-135m", "--check", *flags])  # noqa: E731
    assert check("--prompts", str(repo / "data" / "prompts" / "train_prompts.jsonl")) == 0
    assert check("--prompts", "./prompts/../prompts/train_prompts.jsonl") == 0
    capsys.readouterr()
    assert check("--prompts", "eval_prompts.jsonl") == 2  # another file is other prompts
    # (named as the project spells it, as the record will: from the root)
    assert "prompts: 'data/prompts/train_prompts.jsonl' -> 'data/eval_prompts.jsonl'" in capsys.readouterr().err


def test_every_training_command_of_the_gpu_session_passes_the_data_check(tmp_path, monkeypatch):
    """recipes/gpu_session.sh trains the GPU recipe on the shipped data/smollm2-135m (2048 prompts answered) while the
    recipe's data.regenerate section asks for 4000: once each start checked the data, its train and objectives stages
    stopped at the check, and the lease measured nothing. The script runs here with a stand-in Python that only writes
    down each command line (its /tmp/gpu-session moved under tmp_path); each training command's recipe and overrides
    then go through the check a launch makes before it loads anything."""
    from training.ablate import parse_variant

    repo = RECIPES_DIR.parent
    script = (repo / "recipes" / "gpu_session.sh").read_text()
    stages = re.search(r"case \$s in ([\w|-]+)\) ;;", script).group(1).split("|")
    assert {"train", "objectives"} <= set(stages)
    copy = tmp_path / "gpu_session.sh"
    copy.write_text(script.replace("/tmp/gpu-session", str(tmp_path / "gpu-session")))
    calls = tmp_path / "calls.jsonl"
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"with open({str(calls)!r}, 'a') as calls: calls.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    python.chmod(0o755)
    env = {name: value for name, value in os.environ.items() if name not in ("TRAIN_ARGS", "OBJ_ARGS", "LIMIT")}
    env.update(PYTHON=str(python), OUT=str(tmp_path / "logs"))
    subprocess.run(["bash", str(copy), *stages], cwd=repo, env=env, capture_output=True, timeout=120)
    commands = [json.loads(line) for line in calls.read_text().splitlines()]

    checked = []
    for argv in commands:
        if argv[:2] == ["-m", "training.train"]:
            args, overrides = train_parser().parse_known_args(argv[2:])
            runs = [(args.recipe, overrides)]
        elif argv[:2] == ["-m", "training.ablate"]:
            args, common = ablate_parser().parse_known_args(argv[2:])
            runs = [(args.recipe, [*common, *parse_variant(variant)[1]]) for variant in args.variant]
        else:
            continue
        for recipe, overrides in runs:
            config = read_recipe(RECIPES_DIR / f"{recipe}.yaml", overrides)
            datamodule = DistillDataModule(target=config.model.target, data_path=config.data.data_path,
                                           regenerate=config.data.regenerate)
            monkeypatch.chdir(repo)  # the script's paths are the repository's
            prepare_recipe_data(datamodule, recipe)  # a DDTreeError naming what differs if the data would be refused
            checked.append(recipe)
    assert checked.count("smollm2-135m-gpu") == 4  # the train stage and the objectives stage's three variants


def test_a_damaged_regeneration_json_is_named_at_the_start(tmp_path):
    """Training passed on the --check's last line of stderr: the traceback's `json.decoder.JSONDecodeError: Expecting
    value: line 2 column 1 (char 12)`, which names no file."""
    settings = tiny_settings(prompt_file(tmp_path / "prompts.jsonl", 5))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "regeneration.json").write_text('{"target": \n')
    datamodule = DistillDataModule(target="tiny-random", data_path=str(tmp_path / "data"), regenerate=settings)
    with pytest.raises(DDTreeError) as refused:
        prepare_recipe_data(datamodule, "my-recipe")
    assert str(refused.value).startswith(f"recipe my-recipe: {tmp_path / 'data' / 'regeneration.json'}: not valid JSON")
    assert "move" in str(refused.value) and "\n" not in str(refused.value)


def test_a_check_that_fails_without_its_line_says_what_it_was_checking(tmp_path, monkeypatch):
    """A crash of regenerate.py --check (a traceback, not its `error:` line) names the data it was checking."""
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="Traceback ...\nKeyError: 'x'\n")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: failed)
    (tmp_path / "data").mkdir()
    datamodule = DistillDataModule(target="tiny-random", data_path=str(tmp_path / "data"),
                                   regenerate=tiny_settings(tmp_path / "prompts.jsonl"))
    with pytest.raises(DDTreeError, match=re.escape(f"recipe my-recipe: checking {tmp_path / 'data'} with "
                                                    "data/regenerate.py --check failed: KeyError: 'x'")):
        prepare_recipe_data(datamodule, "my-recipe")


def test_a_recipe_with_a_target_adapter_has_its_data_written_by_the_adapted_target(
        tmp_path, empty_cache, auto_data, monkeypatch):
    """model.target_adapter: the recipe's data is generated with the adapter merged, and data generated without it
    (the base model's replies) is refused for it, and the other way round. Before, regenerate.py was given the
    target alone and the data check accepted the base model's replies for a run that set an adapter. The base
    model's data, on the same settings, is auto_data's; regenerate.py runs in this process (regenerate_here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "data"))
    from test_regenerate import lora_adapter  # noqa: E402  (tests/data/test_regenerate.py)

    adapter = lora_adapter(tmp_path / "adapter", 0)
    regenerate_here(monkeypatch)
    settings = auto_data.settings
    datamodule = DistillDataModule(target="tiny-random", data_path=AUTO_DATA, regenerate=settings)
    prepare_recipe_data(datamodule, "my-recipe", target_adapter=adapter)
    made_with = json.loads((Path(datamodule.data_path) / "regeneration.json").read_text())
    assert made_with["target_adapter"] == adapter and len(made_with["target_adapter_sha256"]) == 64
    prepare_recipe_data(DistillDataModule(target="tiny-random", data_path=AUTO_DATA, regenerate=settings), "my-recipe",
                        target_adapter=adapter)  # its own data: taken
    with pytest.raises(DDTreeError, match=rf"recipe my-recipe: .*\(target_adapter: '{re.escape(adapter)}' -> None\)"):
        prepare_recipe_data(DistillDataModule(target="tiny-random", data_path=AUTO_DATA, regenerate=settings),
                            "my-recipe")
    base = DistillDataModule(target="tiny-random", data_path=auto_data.datamodule.data_path, regenerate=settings)
    prepare_recipe_data(base, "my-recipe")  # the base model's data, written without the adapter: taken without it
    with pytest.raises(DDTreeError, match=rf"recipe my-recipe: .*\(target_adapter: None -> '{re.escape(adapter)}'\)"):
        prepare_recipe_data(base, "my-recipe", target_adapter=adapter)


@pytest.mark.parametrize("command", ["train", "features"])
def test_training_and_the_feature_store_hand_the_adapter_to_the_data(tmp_path, monkeypatch, command):
    """training.train and training.features pass model.target_adapter on to prepare_recipe_data."""
    import training.features

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    handed = []

    def stop(datamodule, recipe, *args, target_adapter=None):
        handed.append(target_adapter)
        raise DDTreeError("stopped here")

    module = training.train if command == "train" else training.features
    monkeypatch.setattr(module, "prepare_recipe_data", stop)
    argv = ["--recipe", "tiny", f"--model.target_adapter={tmp_path / 'adapter'}"]
    argv += ["--output-root", str(tmp_path / "out")] if command == "train" else ["--out", str(tmp_path / "store")]
    assert module.main(argv) == 2
    assert handed == [str(tmp_path / "adapter")]


@pytest.mark.slow  # the shortest cap a stage runs under is 20 s
def test_a_gpu_session_stage_stopped_at_its_cap_leaves_each_threads_stack_in_its_log(tmp_path):
    """qwen3-8b's first training step outlasted its stage's cap twice on the H200 with no word of where it was stuck:
    a stage stopped at its cap now gets SIGABRT, and Python's fault handler prints every thread's stack into the log."""
    repo = RECIPES_DIR.parent
    python = tmp_path / "python"  # a stand-in: the tests stage (pytest) hangs in a function of its own; the rest exit 0
    python.write_text(f"#!{sys.executable}\nimport sys, time\n"
                      "def stuck_in_the_first_step():\n    time.sleep(120)\n"
                      "if sys.argv[1:3] == ['-m', 'pytest']:\n    stuck_in_the_first_step()\n")
    python.chmod(0o755)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONFAULTHANDLER"}
    env.update(PYTHON=str(python), OUT=str(tmp_path / "logs"), LIMIT="27")
    done = subprocess.run(["bash", str(repo / "recipes" / "gpu_session.sh"), "tests"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "failed or skipped: tests" in done.stdout
    log = (tmp_path / "logs" / "tests.log").read_text()
    assert re.search(r"== tests: stopped at its cap of 2\ds \(exit 124\); each Python thread's stack then is above", log)
    assert "in stuck_in_the_first_step" in log  # the stack, innermost call named


@pytest.mark.parametrize("to_group", [False, True], ids=["to-training", "to-the-group"])
def test_a_sigterm_while_training_regenerates_its_data_lets_the_child_remove_its_staging_folder(
        tmp_path, capfd, monkeypatch, to_group):
    """Found in a review (2026-12-04): a SIGTERM that stopped training as its data/regenerate.py child merged the data
    had subprocess.run SIGKILL the child at once, so the child's staging folder (the whole merged dataset) stayed for
    good and its own stop line was lost. Now the child is passed the SIGTERM (sent to training alone, as `kill` does)
    and waited for; sent to the group (a scheduler's), the child's own and training's forwarded one stop it once.
    The group's variant starts its child from a parent that runs only training's data step (prepare_recipe_data under
    run_cli, as training.train.main runs it) with a datamodule's three fields: what it adds is the child's second
    SIGTERM, and training's own handling of its one SIGTERM is the variant to-training's (training.train's imports
    cost 14 s on a 2-core AVX2 EPYC, these 0.3 s). The variant to-training runs training.train.main in this process,
    sent the SIGTERM from another thread (to this process alone, as `kill` sends it to training's): a process of its
    own added only those 14 s; the child is a process of its own in both."""
    data, marker = tmp_path / "data", tmp_path / "staged"
    child = tmp_path / "held_regenerate.py"  # data/regenerate.py, held once its merged dataset is in the staging folder
    child.write_text(
        "import contextlib, pathlib, runpy, sys, time\nimport ddtree.files\nstaged = ddtree.files.staged_folder\n"
        "@contextlib.contextmanager\ndef held(folder):\n    with staged(folder) as staging:\n        yield staging\n"
        f"        if pathlib.Path(folder) == pathlib.Path({str(data)!r}):\n"
        f"            pathlib.Path({str(marker)!r}).write_text(str(staging))\n            time.sleep(60)\n"
        f"ddtree.files.staged_folder = held\nsys.argv[0] = {str(regenerate.__file__)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    settings = json.dumps(tiny_settings(prompt_file(tmp_path / "prompts.jsonl", 5)))
    args = ["--recipe", "tiny", "--output-root", str(tmp_path / "out"), f"--data.data_path={data}",
            f"--data.regenerate={settings}", f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false"]
    if to_group:
        script = ("import json, sys, types, training.recipe_data\nfrom ddtree.errors import run_cli\n"
                  f"training.recipe_data.REGENERATE_SCRIPT = {str(child)!r}\n"
                  f"data = types.SimpleNamespace(target='tiny-random', data_path={str(data)!r}, "
                  f"regenerate=json.loads({settings!r}))\n"
                  "sys.exit(run_cli(lambda argv: training.recipe_data.prepare_recipe_data(data, 'tiny')))\n")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        process = subprocess.Popen([sys.executable, "-c", script, *args], cwd=RECIPES_DIR.parent, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            ended = process.poll() is not None
            assert marker.exists(), "the child did not stage its data" + ended * process.stderr.read()
            os.killpg(process.pid, signal.SIGTERM)
            _, err = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
        status = process.returncode
    else:  # training.train.main here, sent the SIGTERM from another thread once the child holds its staged data
        monkeypatch.setattr(training.recipe_data, "REGENERATE_SCRIPT", child)
        ended = threading.Event()

        def send() -> None:
            while not marker.exists():
                if ended.wait(0.05):
                    return  # training ended first: the assertions below say how
            os.kill(os.getpid(), signal.SIGTERM)  # to this process alone, as `kill` sends it

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            status = training.train.main(args)
        finally:
            ended.set()
            sender.join()
        err = capfd.readouterr().err  # training's and its child's (which writes to this process's stderr)
        assert marker.exists(), "the child did not stage its data:\n" + err[-3000:]
    assert status == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err.splitlines(), err[-3000:]  # the child's own line (run_cli's)
    assert not data.exists() and not list(tmp_path.glob(".data-*")), sorted(p.name for p in tmp_path.iterdir())


def test_a_regeneration_child_that_ignores_the_sigterm_is_killed_after_the_grace_period(tmp_path, monkeypatch):
    """A stopped training passes its SIGTERM to the child and waits REGENERATION_GRACE_S for its clean-up: a child
    that ignores it (stuck in a C call) must then be killed, or Popen's exit waits for it for good and the scheduler's
    SIGKILL comes with no stop line (mutation review 9: r17)."""
    from ddtree.errors import Terminated
    from training.recipe_data import run_regeneration

    monkeypatch.setattr(training.recipe_data, "REGENERATION_GRACE_S", 1)
    ready = tmp_path / "ignoring"
    stubborn = [sys.executable, "-c", "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"pathlib.Path({str(ready)!r}).touch(); time.sleep(10)"]
    wait, stopped = subprocess.Popen.wait, []

    def terminated_while_waiting(child, timeout=None):  # training's SIGTERM, once the child ignores it
        if timeout is None and not stopped:
            stopped.append(child)
            while not ready.exists():
                time.sleep(0.01)
            raise Terminated
        return wait(child, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", terminated_while_waiting)
    started = time.monotonic()
    with pytest.raises(Terminated):
        run_regeneration(stubborn)
    assert time.monotonic() - started < 8  # the grace, not the child's 10 s
    assert stopped[0].returncode == -signal.SIGKILL


def test_a_regeneration_interrupted_otherwise_than_by_sigterm_kills_its_child(monkeypatch):
    """Ctrl-C (or any other exception) while training waits for its regeneration child ends the child at once, as
    subprocess.run does: Popen's exit alone leaves it running after training has stopped."""
    wait, children = subprocess.Popen.wait, []

    def interrupted_while_waiting(child, timeout=None):
        if not children:
            children.append(child)
            raise KeyboardInterrupt
        return wait(child, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted_while_waiting)
    with pytest.raises(KeyboardInterrupt):
        run_regeneration([sys.executable, "-c", "import time; time.sleep(10)"])
    assert wait(children[0], timeout=5) == -signal.SIGKILL
