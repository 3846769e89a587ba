"""Unit tests of what report.md, tau.png and the model card say (training/report.py, training/model_card.py).

    .venv/bin/pytest -q tests/training/test_report.py

Pure functions on hand-made records: no model, no training (test_eval_callback.py and test_publish.py run those end
to end). Each test pins a figure or a sentence that a real run's records reach only at sizes the end-to-end tests
are too small for: taus above 2, limits of hours, checkpoints short of max_steps.
"""

from __future__ import annotations

import math
import shlex

from ddtree.bench import CHAIN, tree_key
from training.model_card import (PROJECT_ROOT, CardFacts, evaluated_steps, evaluation_section, max_time_seconds,
                                 merge_step, planned_length, read_data_record, read_run_config, recipe_section,
                                 usage_section)
from training.report import (duration_text, markdown_report, objective_description, plot_tau, tau_bound,
                             training_end)

PROMPTS = "data/eval_prompts.jsonl"
SETTINGS = dict(prompts=PROMPTS, num_prompts=1, max_new_tokens=4, budgets=[8], primary_budget=8, block_size=8)


def record(step: int, tau: float, trees: dict[int, float] | None = None, **extra) -> dict:
    """One evaluation as AcceptanceEvaluation.history holds it, every method at `tau`, or the trees of `trees`' budgets
    at their taus."""
    def stats(tau: float) -> dict:
        return {"tau": tau, "expected_tau": tau, "rounds": 1, "accepted_depth_counts": {}}

    trees = trees or {8: tau}
    return {"step": step, "train_loss": None, "val_loss": None, "seconds": 0.0, "checkpointed": True,
            "summary": {CHAIN: stats(tau), **{tree_key(budget): stats(at) for budget, at in trees.items()}}, **extra}


def card_facts(**fields) -> CardFacts:
    """The facts of a card of the tiny recipe's drafter at step 40, with `fields` in place of the defaults."""
    defaults = dict(name="drafter", repo=None, target="tiny-random", base_model=None, license="apache-2.0",
                    drafter_config={"block_size": 8}, num_parameters=1, dtype="float32", step=40,
                    checkpoint="last -> last.ckpt", hyper_parameters={}, run_config={}, evaluation=None)
    return CardFacts(**{**defaults, **fields})


def test_tau_png_shows_a_tau_above_2_and_the_floor_of_1():
    """Real runs measure taus of 3 to 6; a plot held at 2 drew them as a flat line along its top edge."""
    axes = plot_tau([record(2, math.nan), record(4, 3.5)], SETTINGS).axes[0]  # NaN: a step no round measured
    bottom, top = axes.get_ylim()
    assert top >= 3.5 and bottom <= 1.0


def test_max_time_is_written_and_read_in_days_hours_minutes_and_seconds():
    """report.md writes trainer.max_time as config.yaml holds it and the card reads it back: every real recipe's limit
    is an hour or more, where the end-to-end tests' is 2 seconds."""
    assert duration_text(90061) == "01:01:01:01"
    assert duration_text(3 * 3600 + 5 * 60) == "00:03:05:00"
    assert max_time_seconds("01:02:03:04") == 93784.0
    assert max_time_seconds({"hours": 1}) == 3600.0  # timedelta's fields, as a mapping in config.yaml
    assert max_time_seconds({"days": 1, "hours": 2}) == 93600.0  # whole days counted, not only the day's rest
    assert max_time_seconds("soon") is None
    assert max_time_seconds({"hour": 1}) is None  # a field timedelta lacks (a typo): not read, and no traceback


def test_max_time_keeps_the_seconds_past_a_half_minute():
    """The seconds field is what is left of the minute: a limit of 59 s written as 29 s would stop a resumed run's
    clock at half its planned time, and the card would read back a budget the run never had."""
    assert duration_text(59) == "00:00:00:59"
    assert duration_text(3 * 3600 + 45) == "00:03:00:45"
    assert max_time_seconds(duration_text(3 * 3600 + 45)) == 3 * 3600 + 45


def test_no_limit_is_said_to_end_training_that_did_not_end_it():
    """A report written mid-run, and the card of a checkpoint before the end (`--ckpt best` at an early step), said
    "max_time ended training" where no limit had been reached."""
    assert training_end(5, 10, False) is None and training_end(5, None, False) is None
    assert training_end(10, 10, False) == "max_steps ended training at step 10"
    assert training_end(4, 10, True) == "max_time ended training at step 4, 6 steps short of max_steps"
    trainer = {"max_steps": 100, "max_epochs": -1, "max_time": "00:00:10:00"}
    early = planned_length(card_facts(trained_seconds=120.0), trainer)  # 2 of its 10 minutes
    assert early == "max_steps 100, max_epochs -1, max_time 00:00:10:00"
    spent = planned_length(card_facts(trained_seconds=600.0), trainer)
    assert spent == early + "; max_time ended training at step 40, 60 steps short of max_steps, this checkpoint's"
    an_hour = {**trainer, "max_time": "00:01:00:00"}  # 25 of its 60 minutes
    assert "ended training" not in planned_length(card_facts(trained_seconds=1500.0), an_hour)


def test_max_steps_0_is_a_limit_and_only_minus_1_is_none():
    """Lightning reads trainer.max_steps=-1 as no limit and 0 as a limit of no step: a launch at 0 (one that only
    evaluates) ended by max_steps, not by a max_time it never spent."""
    assert training_end(0, 0, False) == "max_steps ended training at step 0"
    assert training_end(0, -1, True) == "max_time ended training at step 0"


def test_a_step_whose_save_failed_is_resumed_from_a_saved_best_or_run_again_without_one():
    """The advice after a failed save depends on whether any checkpoint was saved before it: told the other one, a
    run with nothing saved would look for a checkpoint to resume from, and one with a best would start over."""
    unsaved = record(4, 2.0, checkpointed=False, unsaved=True)
    after_a_best = markdown_report("run", [record(2, 1.5), unsaved], SETTINGS, 0.0, 1.0)
    assert ("Checkpoint not saved at step 4: the launch stopped while saving it (a full disk, an interrupt or a crash), "
            "so it ranks for no best; a resume from the last saved checkpoint trains and measures that step again."
            ) in after_a_best
    first = markdown_report("run", [unsaved], SETTINGS, 0.0, 1.0)
    assert ("so it ranks for no best; no checkpoint was saved, so the run starts again (the same command) to train and "
            "measure it.") in first


def test_a_lookup_as_long_as_the_block_lets_a_tree_commit_one_token_past_it():
    """A tree grafts the lookup's path past the drafted block, and a round commits that path and the bonus token."""
    assert tau_bound(8, 8) == ("at most 8 (the block size) for the chain, and up to 9 for a tree, whose 8-token context "
                               "lookup may run deeper")
    assert tau_bound(8, 7) == "at most 8 (the block size)"  # 7 lookup tokens and the bonus: the block's 8


def test_the_tree_objective_is_described_with_its_top_k_survival():
    """The card's training loss row and report.md's train-loss note: the tests covered dpace, decayed_ce and intree."""
    assert objective_description({"objective": "tree", "objective_top_k": 6}) == (
        "`model.objective=tree` (smoothing 0.5, top-6 survival)")


def test_tau_png_has_no_best_star_in_its_legend_where_the_best_was_not_measured():
    """A best checkpoint whose weights were not finite has a NaN tau: its star is not drawn, so the legend must not
    name one."""
    axes = plot_tau([record(2, math.nan, non_finite_tensors=3)], SETTINGS).axes[0]
    labels = axes.get_legend_handles_labels()[1]
    assert "weights not finite (not measured)" in labels and "best checkpoint (budget 8)" not in labels


def test_an_abandoned_branch_evaluated_the_steps_it_shares_with_the_run_and_its_own(tmp_path):
    """A resume from step 2 moved the evaluations past step 2 into eval/abandoned-after-step-2/: the branch's drafter
    is the run's up to step 2 (step 2 included) and its own after; the run's step 6 is another drafter's."""
    (tmp_path / "eval" / "abandoned-after-step-2").mkdir(parents=True)
    for name in ("step-000001.json", "step-000002.json", "step-000006.json", "abandoned-after-step-2/step-000004.json"):
        (tmp_path / "eval" / name).write_text("{}")
    assert evaluated_steps(tmp_path, "abandoned-after-step-2") == [1, 2, 4]
    assert evaluated_steps(tmp_path) == [1, 2, 6]


def test_a_copy_of_an_evaluation_beside_it_is_not_taken_for_a_step(tmp_path):
    """A file the glob matches whose name is no step (a copy a file manager made, step-000002 copy.json) is left
    out: read as a step number it stopped the card and report with a ValueError."""
    (tmp_path / "eval").mkdir()
    for name in ("step-000002.json", "step-000002 copy.json", "step-best.json"):
        (tmp_path / "eval" / name).write_text("{}")
    assert evaluated_steps(tmp_path) == [2]


def test_an_evaluation_that_recorded_no_temperature_is_carded_as_greedy():
    """AcceptanceEvaluation has always decoded greedily; evaluations written before it recorded the temperature have
    no field for it, and their card must not call them sampled."""
    stats = {"tau": 1.5, "expected_tau": 1.4, "rounds": 2, "new_tokens": 3}
    evaluation = {"step": 40, "settings": {"prompts": PROMPTS, "num_prompts": 1, "max_new_tokens": 4},
                  "summary": {CHAIN: stats, tree_key(8): stats}}
    section = "\n".join(evaluation_section(card_facts(evaluation=evaluation)))
    assert f"on the first 1 prompts of `{PROMPTS}` (not compared with the training data), up to 4 new tokens each, " \
           "temperature 0." in section


def test_report_ranks_checkpoints_by_the_primary_budget_not_the_first_listed():
    """eval.budgets lists the primary budget anywhere: ranked by another budget, report.md marked a step best that
    BestCheckpoint (which ranks by eval.primary_budget) did not link as checkpoints/best.ckpt."""
    settings = {**SETTINGS, "budgets": [4, 8], "primary_budget": 8}
    evaluations = [record(2, 1.5, trees={4: 2.0, 8: 3.0}), record(4, 1.5, trees={4: 2.5, 8: 2.8})]
    report = markdown_report("run", evaluations, settings, 0.0, 1.0)
    assert "**Best checkpoint by tau@8: step 2** (tau 3.000;" in report and "| **2** (best) |" in report


ADAPTER = {"target_adapter": "adapters/sql", "target_adapter_sha256": "a" * 64}  # a run's hyper-parameters


def usage(**fields) -> str:
    """The card's usage section for `fields` (card_facts') of a drafter whose config names its target layers."""
    config = {"block_size": 8, "dflash_config": {"target_layer_ids": [1]}}
    return "\n".join(usage_section(card_facts(**{"drafter_config": config, **fields})))


def test_the_merge_step_loads_the_target_in_the_dtype_training_merged_its_adapter_in():
    """The card's merge step writes the target every command of the card loads: merged in float32 after a bf16 run, it
    is not the bfloat16 target training merged the adapter into, and that every figure of the card was measured with."""
    bf16 = "\n".join(merge_step(card_facts(hyper_parameters=ADAPTER, run_config={"trainer": {"precision": "bf16-true"}})))
    assert 'load_target("tiny-random", dtype=torch.bfloat16)' in bf16
    fp16 = "\n".join(merge_step(card_facts(hyper_parameters={**ADAPTER, "target_dtype": "float16"},
                                           run_config={"trainer": {"precision": "bf16-mixed"}})))
    assert 'load_target("tiny-random", dtype=torch.float16)' in fp16  # model.target_dtype over the precision


def test_a_damaged_data_record_leaves_the_card_silent_on_it_rather_than_failing_the_export(tmp_path):
    """data.json cut short, not UTF-8, or not an object: the export went on to a traceback (or to data_notes reading
    a list), where the card should only say nothing of the share of the split the run drew from."""
    for damaged in (b'{"sequences": ', b"\xff\xfe", b"[1, 2]"):
        (tmp_path / "data.json").write_bytes(damaged)
        assert read_data_record(tmp_path) is None, damaged
    (tmp_path / "data.json").write_text('{"sequences": 3}')
    assert read_data_record(tmp_path) == {"sequences": 3}


def test_the_usage_of_a_hub_export_loads_the_repo_and_a_local_exports_its_folder():
    """A card pushed to you/d told transformers users `AutoModel.from_pretrained("path/to/this/folder")`, which no
    reader of the Hub page has; the ddtree commands decode the folder the card's download line writes."""
    hub = usage(repo="you/d")
    assert 'AutoModel.from_pretrained("you/d", trust_remote_code=True)' in hub and "path/to/this/folder" not in hub
    assert "hf download you/d --local-dir drafter\nddtree generate --target tiny-random --drafter drafter " in hub
    local = usage()
    assert 'AutoModel.from_pretrained("path/to/this/folder", trust_remote_code=True)' in local
    assert "hf download" not in local and "--drafter path/to/this/folder " in local


def test_the_usage_commands_keep_a_target_folder_with_a_space_one_argument():
    """A run whose model.target is a local folder with a space in its name (no Hub id) got a card whose ddtree commands
    split it in two (`--target /data/my models/llama`), where its vLLM and SGLang commands quote it."""
    target = "/data/my models/llama's"
    text = usage(target=target)
    lines = [line for line in text.splitlines() if line.startswith("ddtree ")]
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        assert words[words.index("--target") + 1] == target, line
        assert words[words.index("--drafter") + 1] == "path/to/this/folder", line
    assert shlex.split(lines[0])[-2:] == ["--prompt", "Hello"]


def test_the_usage_of_an_adapted_built_in_target_never_sends_the_reader_to_the_target_without_its_adapter():
    """The card of a built-in target measured through its GGUF weights says `--target smollm2-135m` decodes as
    measured; with an adapter it must not: that target lacks the adapter, and the merge step's folder, which the
    commands name, is already made from those very GGUF weights."""
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    plain = usage(target="smollm2-135m", base_model=hub_id)
    assert "`--target smollm2-135m` (`ddtree`'s built-in" in plain  # the note this is about
    adapted = usage(target="smollm2-135m", base_model=hub_id, hyper_parameters=ADAPTER)
    assert "--target merged-target --drafter" in adapted and "`--target smollm2-135m`" not in adapted


def test_a_run_folder_without_config_yaml_still_has_a_card_that_says_so(tmp_path):
    """A run folder with no config.yaml (a checkpoint copied into a bare folder) reads as {}: the card then says the
    data settings are not known, where reading the missing file failed the export."""
    assert read_run_config(tmp_path) == {}
    (tmp_path / "config.yaml").write_text("trainer:\n  precision: bf16-true\n")
    assert read_run_config(tmp_path) == {"trainer": {"precision": "bf16-true"}}


def test_the_merge_step_names_an_adapter_inside_the_project_by_its_path_in_the_repository():
    """The card's merge step, like its adapter row, names the adapter relative to the project, not by the layout of
    the machine that trained."""
    inside = str(PROJECT_ROOT / "adapters" / "sql")
    step = "\n".join(merge_step(card_facts(hyper_parameters={"target_adapter": inside, "target_adapter_sha256": None})))
    assert 'PeftModel.from_pretrained(base, "adapters/sql")' in step and str(PROJECT_ROOT) not in step


def test_tau_png_plots_tau_against_the_training_step():
    """Axes labelled the other way round read a run's steps as its taus."""
    axes = plot_tau([record(2, 2.0), record(4, 3.0)], SETTINGS).axes[0]
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("training step", "tau (tokens per verification)")


def test_tau_png_places_each_evaluation_at_its_training_step():
    """Evaluations run every eval.every steps and a resume may skip some: points placed by their order in the history
    (0, 1, 2) would show a run's tau reached at the wrong step, and the star off every curve."""
    axes = plot_tau([record(2, 1.5), record(4, 3.0), record(10, 2.0)], SETTINGS).axes[0]
    handles, labels = axes.get_legend_handles_labels()
    for label in ("DDTree, budget 8", "DFlash chain"):
        assert list(handles[labels.index(label)].get_xdata()) == [2, 4, 10], label


def test_tau_png_stars_the_best_checkpoint_at_its_own_step_and_tau():
    """The star is the checkpoint `checkpoints/best.ckpt` links to: one drawn at the latest evaluation instead marked a
    worse, later step best on the plot while report.md named the earlier one."""
    axes = plot_tau([record(2, 1.5), record(4, 3.0), record(6, 2.0)], SETTINGS).axes[0]
    handles, labels = axes.get_legend_handles_labels()
    star = handles[labels.index("best checkpoint (budget 8)")]
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([4], [3.0])


def test_the_cards_recipe_rows_state_the_runs_own_settings():
    """The recipe table is what a reader copies to train the next drafter: each row must carry the run's own value
    (its gamma, not another hyper-parameter; its node count, not its devices per node; its LoRA rank), since a wrong
    figure there reproduces another run without a word."""
    facts = card_facts(
        drafter_config={"num_hidden_layers": 1, "hidden_size": 8, "block_size": 4,
                        "dflash_config": {"target_layer_ids": [1], "mask_token_id": 0}},
        hyper_parameters={"gamma": 7.0, "lr": 0.003, "lora_rank": 16, "lora_alpha": 32},
        run_config={"trainer": {"devices": 8, "accelerator": "gpu", "num_nodes": 2, "strategy": "ddp"},
                    "data": {"batch_size": 4}})
    rows = "\n".join(recipe_section(facts))
    assert "| loss decay gamma | 7.0 |" in rows
    assert "| hardware | 8 x gpu, 2 node(s), strategy ddp |" in rows
    assert "| LoRA | rank 16 (merged into these weights) |" in rows
