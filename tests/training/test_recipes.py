"""Recipes and the training CLI: every recipe parses; big recipes wire up on shrunken targets; resume is exact.

    .venv/bin/pytest -q tests/training/test_recipes.py

The big recipes name 8B targets that cannot be downloaded here. Each is checked against a SHRUNKEN
copy of its target's architecture: same family, layer count and embedding rows, tiny widths, random
weights. That is all the wiring depends on (layer ids in range, MASK id inside the embedding).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

import lightning as L
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import toy_data  # tests/training/toy_data.py
import training.arguments
import training.recipe
import training.target
import training.train
from training.arguments import RECIPES_DIR, known_recipes
from training.recipe import RecipeReader, read_recipe
from training.train import build_cli, main
from training.loss import published_gamma
from training.module import DistillModule
from ddtree.errors import CommandParser, DDTreeError
from ddtree.files import read_yaml_mapping


pytestmark = pytest.mark.usefixtures("undrawn_plots")  # tau.png drawn only where a test asks (drawn_plots)

TINY_WIDTHS = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)

# The real targets' layout (from their published config.json files), widths shrunk.
SHRUNKEN_TARGETS = {
    "Qwen/Qwen3-8B": Qwen3Config(vocab_size=151936, num_hidden_layers=36, tie_word_embeddings=False, **TINY_WIDTHS),
    "Qwen/Qwen3-4B": Qwen3Config(vocab_size=151936, num_hidden_layers=36, tie_word_embeddings=True, **TINY_WIDTHS),
    "meta-llama/Llama-3.1-8B-Instruct": LlamaConfig(
        vocab_size=128256, num_hidden_layers=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        **TINY_WIDTHS,
    ),
}
BIG_RECIPES = ["qwen3-8b", "qwen3-4b", "llama3.1-8b"]


def parse_recipe(name: str, *overrides: str):
    return read_recipe(RECIPES_DIR / f"{name}.yaml", list(overrides))


def test_every_recipe_parses_and_says_how_to_launch_it():
    names = known_recipes()
    assert {"smollm2-135m", "tiny", *BIG_RECIPES} <= set(names)
    for name in names:
        config = parse_recipe(name)
        assert config.model.target and config.data.target == config.model.target  # linked, never set twice
        header = (RECIPES_DIR / f"{name}.yaml").read_text().split("\n\n")[0]
        for field in ("Launch:", "Hardware:", "Acceptance:"):
            assert field in header, f"recipes/{name}.yaml header lacks {field}"


def test_the_figures_the_readme_and_recipe_headers_cite_have_a_section_in_the_benchmarks():
    """A header's figures pointed at README.md's table, whose rows no measurement record held, and some at nothing;
    docs/benchmarks.md is the record, so every section of it cited must exist (a heading, or a bold paragraph opening)."""
    docs = RECIPES_DIR.parent / "docs"
    plain = lambda text: re.sub(r"[`\"]", "", text).strip()  # noqa: E731
    sections = [plain(line.removeprefix("## ")) for line in (docs / "benchmarks.md").read_text().splitlines()
                if line.startswith("## ")]
    sections += [plain(bold) for bold in re.findall(r"^\*\*(.+?)\*\*", (docs / "benchmarks.md").read_text(), re.M)]
    texts = {"README.md": (RECIPES_DIR.parent / "README.md").read_text()}
    for recipe in RECIPES_DIR.glob("*.yaml"):
        header = recipe.read_text().split("\n\n")[0]
        assert "README.md's table" not in header, recipe.name
        texts[recipe.name] = " ".join(line.lstrip("#").strip() for line in header.splitlines())
    cited = 0
    for name, text in texts.items():
        text = " ".join(text.split())
        for section in re.findall(r"benchmarks\.md(?:\]\([^)]*\))?\)?, ([A-Z`\"][^,;():]*)", text):
            assert any(heading.startswith(plain(section)) for heading in sections), (name, section)
            cited += 1
    assert cited >= 10


def test_validation_across_epochs_falls_on_an_evaluated_optimizer_step():
    """Lightning counts val_check_interval in training batches, not optimizer steps: the 8B recipes' 2000, at 4
    accumulated batches, validated every 500 optimizer steps (50 batches on each of 8 GPUs, 4 times as often as meant),
    between evaluations. Counted across epochs, the interval is a whole number of optimizer steps that evaluate."""
    checked = []
    for name in known_recipes():
        config = parse_recipe(name)
        batches, accumulated = config.trainer.val_check_interval, config.trainer.accumulate_grad_batches or 1
        if config.trainer.check_val_every_n_epoch is not None or not isinstance(batches, int):
            continue  # counted within each epoch (tiny), or a fraction of one
        steps = batches / accumulated
        assert steps == int(steps) and steps % config.eval.every_n_train_steps == 0, (
            f"recipes/{name}.yaml: val_check_interval {batches} batches of {accumulated} per step validate every "
            f"{steps} optimizer steps, not a multiple of eval.every_n_train_steps {config.eval.every_n_train_steps}")
        checked.append((name, steps))
    assert {"qwen3-8b": 2000, "qwen3-4b": 2000, "llama3.1-8b": 2000}.items() <= dict(checked).items()


def test_a_read_with_the_parser_an_earlier_read_built_is_what_a_parser_of_its_own_reads(monkeypatch):
    """read_recipe builds LightningCLI's parser once a process (RecipeReader.built_parser) and parses each read with
    it: a read after another recipe's, or after overrides of the same recipe, must be what a fresh parser reads."""
    reads = [("tiny", ["--model.num_layers=3", "--eval.budgets=[4,8]", "--eval.primary_budget=4"]),
             ("smollm2-135m", []), ("tiny", [])]
    fresh = []
    for name, overrides in reads:
        monkeypatch.setattr(RecipeReader, "built_parser", None)
        fresh.append(parse_recipe(name, *overrides))
    reused = [parse_recipe(name, *overrides) for name, overrides in reads]
    assert RecipeReader.built_parser is not None and reused == fresh
    assert (reused[0].model.num_layers, reused[0].checkpoint.monitor) == (3, "val/tau_ddtree@4")  # a link applied
    assert reused[2].model.num_layers != 3 and reused[2].model.target == "tiny-random"
    assert reused[1].model.target == "smollm2-135m"


def test_a_recipe_that_does_not_say_leaves_the_rank_split_to_the_data(tmp_path):
    text = (RECIPES_DIR / "tiny.yaml").read_text()
    assert "use_distributed_sampler" in text
    silent = tmp_path / "tiny.yaml"
    silent.write_text("".join(line for line in text.splitlines(keepends=True) if "use_distributed_sampler" not in line))
    assert read_recipe(silent, []).trainer.use_distributed_sampler is False  # Lightning's default is True


def test_a_launch_writes_its_checkpoints_whole_or_not_at_all(tmp_path):
    """Lightning's own writer staged each checkpoint in $TMPDIR and moved it: across filesystems a full disk or a kill
    left a truncated step-N.ckpt under its final name (training/checkpoints.py)."""
    from training.checkpoints import AtomicCheckpointIO

    cli = build_cli(RECIPES_DIR / "tiny.yaml", tmp_path / "run", ["--trainer.precision=32-true"])
    assert type(cli.trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    # a writer the recipe names in trainer.plugins is its own choice: kept, not replaced
    cli = build_cli(RECIPES_DIR / "tiny.yaml", tmp_path / "async", [
        "--trainer.precision=32-true", "--trainer.plugins=lightning.pytorch.plugins.io.AsyncCheckpointIO"])
    assert type(cli.trainer.strategy.checkpoint_io) is AsyncCheckpointIO


def test_a_block_size_override_alone_trains_with_the_published_gamma_for_that_block():
    """Every recipe pinned model.gamma at its block's published value, so `--model.block_size 10` alone kept the old
    block's decay, though an unset gamma follows the block size (docs/training.md). A given gamma is still kept."""
    for name in known_recipes():
        assert parse_recipe(name, "--model.block_size=10").model.gamma is None, f"recipes/{name}.yaml pins model.gamma"
    for overrides, gamma in [(["--model.block_size=10"], published_gamma(10)), ([], published_gamma(8)),
                             (["--model.block_size=10", "--model.gamma=3.0"], 3.0)]:
        module = DistillModule(**parse_recipe("tiny", *overrides).model.as_dict())
        module.configure_model()
        assert module.hparams.gamma == gamma, overrides
    assert published_gamma(10) == 5.0 and published_gamma(8) == 4.0


def test_an_eval_override_moves_the_checkpoint_schedule_and_ranking_with_it():
    """Checkpoints are saved at the evaluated steps and ranked by the primary budget's tau: an override of either eval
    field that did not reach the checkpoint section saved steps that were never measured, or ranked by another tau."""
    config = parse_recipe("tiny", "--eval.every_n_train_steps=7", "--eval.budgets=[4, 16]", "--eval.primary_budget=16")
    assert config.checkpoint.every_n_train_steps == 7 and config.checkpoint.monitor == "val/tau_ddtree@16"


def test_a_bad_field_is_rejected_by_the_parser():
    with pytest.raises(DDTreeError, match="no_such_field"):
        parse_recipe("tiny", "--model.no_such_field=3")


@pytest.mark.parametrize("override, said", [
    ("--trainer.max_steps=x", 'Parser key "trainer.max_steps"; Expected a <class \'int\'>. Got value: x'),
    ("--model.block_size=abc", 'Parser key "model.block_size"; Given value: abc; Does not validate against any of'),
])
def test_a_bad_value_is_one_line_naming_the_file_the_field_and_the_value(override, said):
    """jsonargparse's message runs over several lines; a field that takes null too (int | None) gives its value on one
    of its own, and the line without it named the field but not what was given there."""
    with pytest.raises(DDTreeError) as error:
        parse_recipe("tiny", override)
    assert str(error.value).startswith(f"{RECIPES_DIR / 'tiny.yaml'}: {said}") and "\n" not in str(error.value), error.value


def test_the_last_precision_override_wins_as_in_the_parser(monkeypatch, capsys):
    """A --trainer.precision given twice is the last one, as the parser takes it: auto after a 32-true resolves to what
    this machine computes fast, and an accelerator given twice is the last one that auto resolves for."""
    from ddtree.precision import Choice

    monkeypatch.setattr(training.recipe, "fast_precision", lambda device: Choice(torch.bfloat16, f"fast on {device}"))
    config = parse_recipe("tiny", "--trainer.precision=32-true", "--trainer.precision=auto")
    assert config.trainer.precision == "bf16-mixed"
    assert "trainer.precision auto -> bf16-mixed" in capsys.readouterr().out
    config = parse_recipe("tiny", "--trainer.precision=auto", "--trainer.precision=32-true")
    assert config.trainer.precision == "32-true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    training.recipe.config_arg(RECIPES_DIR / "tiny.yaml", ["--trainer.accelerator=gpu", "--trainer.accelerator=cpu"])
    assert "(fast on cpu)" in capsys.readouterr().out


def test_a_loss_setting_the_runs_objective_never_reads_is_named_in_one_line(capsys):
    """--model.objective_budget=64 on a dpace run (or model.distill_top_k without distillation) trained as if not
    given, without a word: a `make ablate` variant of it tabulated the recipe's own loss under another name."""
    def noted(*overrides):
        config = parse_recipe("tiny", "--trainer.precision=32-true", *overrides)
        capsys.readouterr()
        training.recipe.check_before_building(config)
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[loss]")]

    assert noted("--model.objective=dpace", "--model.objective_budget=64", "--model.gamma=3",
                 "--model.distill_top_k=8") == [
        "[loss] unused by this run's loss, model.objective=dpace with model.distill_weight=0.0: model.gamma=3.0 (read "
        "by objective decayed_ce and frontier only); model.objective_budget=64 (read by objective frontier and intree "
        "only); model.distill_top_k=8 (read with model.distill_weight > 0 only)"]
    assert noted("--model.objective=intree", "--model.objective_budget=64", "--model.distill_weight=0.5",
                 "--model.distill_top_k=8", "--model.distill_loss=lk") == []  # each read
    assert noted("--model.objective=tree", "--model.objective_budget=32") == []  # the default, given or not


@pytest.mark.parametrize("overrides", [["--optimizer=SGD", "--optimizer.lr=0.5"],
                                       ["--lr_scheduler=StepLR", "--lr_scheduler.step_size=1"]])
def test_lightnings_own_optimizer_options_are_refused_in_one_line(overrides, tmp_path, capsys):
    """LightningCLI's automatic --optimizer made fit fail with a traceback (an empty parameter list), and its
    --lr_scheduler was recorded in config.yaml and never used: the module's configure_optimizers is the only one."""
    assert main(["--recipe", "tiny", *overrides, "--output-root", str(tmp_path)]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"unrecognized arguments on the command line: {overrides[0]}" in errors[0], errors
    assert "model.lr" in errors[0] and "tiny.yaml" not in errors[0], errors
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("abbreviated", ["--checkpoint.dirpat={}", "--model.num_layer=2"])
def test_an_abbreviated_recipe_override_is_refused_as_unknown(abbreviated, tmp_path, capsys):
    """jsonargparse took `--checkpoint.dirpat=x` for checkpoint.dirpath, past the refusal of that field, and the run's
    checkpoints went to x (its resume found none there); a recipe's own `num_layer:` was refused, an override taken."""
    override = abbreviated.format(tmp_path / "elsewhere")
    assert main(["--recipe", "tiny", override, "--trainer.max_steps=1", "--eval.limit=1",
                 "--output-root", str(tmp_path / "out")]) == 2
    errors = error_lines(capsys)
    assert errors == [f"error: unrecognized arguments on the command line: {override}; see {CommandParser().prog} "
                      "--help"], errors
    assert not any(tmp_path.iterdir())
    with pytest.raises(DDTreeError, match=f"unrecognized arguments on the command line: {override};"):
        read_recipe(RECIPES_DIR / "tiny.yaml", [override])


@pytest.mark.parametrize("abbreviated", [["--output", "mine"], ["--run-n", "mine"], ["--resu", "last"]])
def test_an_abbreviated_option_is_refused_as_unknown(abbreviated, tmp_path, monkeypatch, capsys):
    """argparse took --output for --output-root and --run-n for --run-name: recipes/slurm.sbatch refuses the run-folder
    options by their full names, so a job wrote where the abbreviation said and its requeue, looking in
    outputs/<recipe>/slurm-<job id>, started a new run into the occupied folder."""
    assert training.arguments.train_parser().parse_known_args(abbreviated)[1] == abbreviated
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "tiny", *abbreviated]) == 2
    errors = error_lines(capsys)
    # the command line's, not the recipe's: the line named recipes/tiny.yaml, which the user had not touched
    assert errors == [f"error: unrecognized arguments on the command line: {' '.join(abbreviated)}; see "
                      f"{CommandParser().prog} --help"], errors
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("given", ["optimizer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.5\n",
                                   "optimizer: torch.optim.SGD\n", "lr_scheduler: CosineAnnealingLR\n",
                                   "lr_scheduler: {}\n"])
def test_an_optimizer_section_is_refused_and_a_null_one_from_an_older_run_is_dropped(given, tmp_path):
    """LightningCLI's shorthand (`optimizer: torch.optim.SGD`) was told to become a section, which was then refused.
    Only null is dropped: an empty section is one the user started to fill, and dropping it in silence hid that."""
    text = (RECIPES_DIR / "tiny.yaml").read_text()
    key = given.split(":")[0]
    (tmp_path / "sgd.yaml").write_text(text + given)
    with pytest.raises(DDTreeError, match=rf"sgd.yaml: {key}: section not accepted \(the optimizer is the module's"):
        read_recipe(tmp_path / "sgd.yaml", [])
    # every config.yaml written while Lightning's options were on records both as null: such a run still resumes
    older = text.replace("precision: auto", "precision: 32-true") + "optimizer: null\nlr_scheduler: null\n"
    (tmp_path / "older.yaml").write_text(older)
    assert read_recipe(tmp_path / "older.yaml", []).model.lr == read_recipe(RECIPES_DIR / "tiny.yaml", []).model.lr


@pytest.mark.parametrize("name", BIG_RECIPES)
def test_big_recipe_wires_up_on_a_shrunken_target(name, monkeypatch):
    config = parse_recipe(name)
    assert config.trainer.precision == "bf16-mixed" and config.model.lr == 6e-4 and config.model.num_anchors == 512
    assert config.data.max_length == 3072 and config.trainer.max_epochs == 6 and config.model.warmup_ratio == 0.04
    shrunken = SHRUNKEN_TARGETS[config.model.target]

    def load_shrunken(name_or_path, dtype=torch.float32, device="cpu"):
        assert name_or_path == config.model.target
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(shrunken).eval().requires_grad_(False)
        return model, None  # the recipe names its MASK id, so no tokenizer is consulted

    monkeypatch.setattr(training.target, "load_target", load_shrunken)
    settings = config.model.as_dict()
    settings.update(target_dtype="float32", num_anchors=2)  # a 2-block step is enough to exercise the wiring
    module = DistillModule(**settings)
    module.configure_model()  # raises if a layer id or the MASK id does not fit the target
    drafter_config = module.drafter.config
    assert drafter_config.num_target_layers == shrunken.num_hidden_layers
    assert drafter_config.vocab_size == shrunken.vocab_size
    assert max(drafter_config.target_layer_ids) <= shrunken.num_hidden_layers - 3
    input_ids = torch.randint(0, 1000, (1, 24))
    loss_mask = torch.zeros(1, 24, dtype=torch.bool)
    loss_mask[0, 6:] = True
    result = module.shared_step({"input_ids": input_ids, "loss_mask": loss_mask}, 0, "train")
    assert torch.isfinite(result.loss) and result.tokens.sum() > 0


def test_unknown_recipe_prints_one_line_listing_the_known_ones(capsys):
    assert main(["--recipe", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope" in err and "smollm2-135m" in err and "tiny" in err
    assert main(["--recipe", "recipes/tiny.yaml"]) == 2  # data/regenerate.py takes a file: training points to the name
    assert "--recipe takes a recipe's name: --recipe tiny (reads recipes/tiny.yaml)" in capsys.readouterr().err


def test_a_recipe_file_of_ones_own_is_told_where_it_goes_never_pointed_at_the_shipped_one(tmp_path, capsys):
    """`--recipe /my/tiny.yaml`, a user's copy of tiny.yaml edited for their target and data, was told `--recipe tiny`,
    which trains the shipped recipe on another target and data; a file of any other name was an unknown recipe."""
    shipped = (RECIPES_DIR / "tiny.yaml").read_text()
    (tmp_path / "tiny.yaml").write_text(shipped.replace("target: tiny-random", "target: /my/target"))
    assert main(["--recipe", str(tmp_path / "tiny.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--recipe tiny" not in err, err
    assert ("not a file, and recipes/tiny.yaml is a shipped recipe, not this file: put yours at recipes/<name>.yaml "
            "under a name of its own and give --recipe <name>") in err, err
    (tmp_path / "byo-qwen3.yaml").write_text(shipped)
    assert main(["--recipe", str(tmp_path / "byo-qwen3.yaml")]) == 2
    assert ("not a file: put yours at recipes/byo-qwen3.yaml and give --recipe byo-qwen3 (docs/training.md, Your own "
            "target and data)") in capsys.readouterr().err
    (tmp_path / "tiny.yaml").write_text(shipped)  # the shipped recipe's own text: its name reads the same
    assert main(["--recipe", str(tmp_path / "tiny.yaml")]) == 2
    assert "--recipe takes a recipe's name: --recipe tiny (reads recipes/tiny.yaml)" in capsys.readouterr().err
    assert main(["--recipe", "byo-qwen3"]) == 2
    assert "a recipe of your own goes at recipes/byo-qwen3.yaml" in capsys.readouterr().err


def test_a_recipe_file_name_with_no_such_file_is_told_the_name_and_an_empty_one_is_named_empty(tmp_path, monkeypatch):
    """`--recipe tiny.yaml` typed where no such file is (no copy of one's own to protect) was told to put "yours"
    under a name of its own, never `--recipe tiny`; `--recipe "$R"` with R unset was an unknown recipe '' that
    "goes at recipes/.yaml"."""
    monkeypatch.chdir(tmp_path)  # no tiny.yaml nor mine.yaml here
    with pytest.raises(DDTreeError) as error:
        training.arguments.check_recipe_name("tiny.yaml")
    assert str(error.value) == "--recipe takes a recipe's name: --recipe tiny (reads recipes/tiny.yaml)"
    with pytest.raises(DDTreeError) as error:  # a name of one's own with its suffix: not recipes/mine.yaml.yaml
        training.arguments.check_recipe_name("mine.yaml")
    said = str(error.value)
    assert "put yours at recipes/mine.yaml and give --recipe mine " in said and ".yaml.yaml" not in said, said
    with pytest.raises(DDTreeError) as error:
        training.arguments.check_recipe_name("")
    assert str(error.value).startswith("--recipe is empty (an unset shell variable?); known recipes: "), error.value
    assert "recipes/.yaml" not in str(error.value)


def test_a_recipe_name_typed_with_yml_is_told_the_name_not_called_unknown(tmp_path, monkeypatch):
    """`--recipe tiny.yml` (YAML's other suffix) where no such file is means the shipped tiny as surely as tiny.yaml:
    read as a name of its own it was an unknown recipe 'tiny.yml' that "goes at recipes/tiny.yml.yaml"."""
    monkeypatch.chdir(tmp_path)  # no tiny.yml here
    with pytest.raises(DDTreeError) as error:
        training.arguments.check_recipe_name("tiny.yml")
    assert str(error.value) == "--recipe takes a recipe's name: --recipe tiny (reads recipes/tiny.yaml)"


def test_a_recipe_file_of_ones_own_named_yml_is_judged_by_its_own_text(tmp_path):
    """The file given is the one compared with the shipped recipe: judged by <stem>.yaml beside it instead, an edited
    /my/tiny.yml (no tiny.yaml there) was told `--recipe tiny`, which trains the shipped recipe on another target."""
    shipped = (RECIPES_DIR / "tiny.yaml").read_text()
    (tmp_path / "tiny.yml").write_text(shipped.replace("target: tiny-random", "target: /my/target"))
    with pytest.raises(DDTreeError) as error:
        training.arguments.check_recipe_name(str(tmp_path / "tiny.yml"))
    said = str(error.value)
    assert "--recipe tiny " not in said and "is a shipped recipe, not this file" in said, said


def test_a_dotted_recipe_name_of_ones_own_is_an_unknown_recipe_named_whole():
    """Recipe names carry dots (llama3.1-8b): `--recipe llama3.1-70b`, a name with no file yet, is an unknown recipe
    that goes at recipes/llama3.1-70b.yaml, not a file whose name ends at the last dot ("put yours at
    recipes/llama3.yaml and give --recipe llama3")."""
    with pytest.raises(DDTreeError) as error:
        training.arguments.check_recipe_name("llama3.1-70b")
    said = str(error.value)
    assert said.startswith("unknown recipe 'llama3.1-70b'; known recipes: "), said
    assert said.endswith("a recipe of your own goes at recipes/llama3.1-70b.yaml"), said


@pytest.mark.parametrize("text, named", [
    ("trainer:\n  max_steps: [\n", "not valid YAML at line 3, column 1"),
    ("model:\n  block_size: 8\n\tnum_layers: 2\n", "not valid YAML at line 3, column 1"),
    # the line where it broke, not the one its enclosing mapping began at, and what broke there
    ("model:\n  block_size: 8\n num_layers: 2\n",
     "not valid YAML at line 3, column 2 (expected <block end>, but found '<block mapping start>'); fix the file"),
    ("- model\n- trainer\n", "the top level is a list, not a mapping of sections"),
    ("model\n", "the top level is a str, not a mapping of sections"),  # a word, not `model:`
    ("[]\n", "the top level is a list, not a mapping of sections"),  # only an empty file is an empty recipe
    # a control character (a paste from a terminal): yaml's ReaderError, which has no line and column to give
    ("model:\n  block_size: 8\x07\n",
     "not valid YAML (unacceptable character #x0007: special characters are not allowed); fix the file"),
])
def test_a_recipe_that_is_not_a_yaml_mapping_is_one_line_naming_the_file_and_where(tmp_path, monkeypatch, capsys, text,
                                                                                  named):
    """A yaml ParserError's 74-line traceback before."""
    monkeypatch.setattr(training.arguments, "RECIPES_DIR", tmp_path)
    (tmp_path / "mine.yaml").write_text(text)
    assert main(["--recipe", "mine", "--output-root", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'mine.yaml'}: {named}" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, named", [
    ("trainer: cpu\n", "trainer must be a section of fields (field: value lines under it), not a str"),
    ("trainer: [cpu]\n", "trainer must be a section of fields (field: value lines under it), not a list"),
    ("seed_everything: 1\ntrainer: 32\n", "trainer must be a section of fields (field: value lines under it), not an int"),
    ("model: tiny-random\n", "model must be a section of fields (field: value lines under it), not a str"),
    ("checkpoint: outputs/tiny/r/checkpoints/last.ckpt\n", "checkpoint must be a section of fields"),
    ("trainer: 0\n", "trainer must be a section of fields (field: value lines under it), not an int"),  # falsy ones too
    ("trainer: false\n", "trainer must be a section of fields (field: value lines under it), not a bool"),
    ("trainer: []\n", "trainer must be a section of fields (field: value lines under it), not a list"),
])
@pytest.mark.parametrize("command", ["train", "features", "ablate"])
def test_a_recipe_section_given_a_value_is_one_line_naming_the_file_and_the_section(tmp_path, monkeypatch, capsys,
                                                                                    text, named, command):
    """`trainer: cpu` was an AttributeError's traceback (exit 1) in train, features and ablate, `trainer: 32` a
    TypeError's, and `model: tiny-random` jsonargparse's `Parser key "model"`, which says neither what is wrong nor
    what to write; data/regenerate.py already said it in these words."""
    import training.ablate
    import training.features

    monkeypatch.setattr(training.arguments, "RECIPES_DIR", tmp_path)
    (tmp_path / "mine.yaml").write_text(text)
    run = {"train": lambda: main(["--recipe", "mine", "--output-root", str(tmp_path / "out")]),
           "features": lambda: training.features.main(["--recipe", "mine", "--out", str(tmp_path / "store")]),
           "ablate": lambda: training.ablate.main(["--recipe", "mine", "--steps", "2",
                                                   "--output-root", str(tmp_path / "out")])}[command]
    assert run() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'mine.yaml'}: {named}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]


@pytest.mark.parametrize("section", training.recipe.RECIPE_SECTIONS)
def test_a_section_left_without_fields_takes_the_defaults_as_an_empty_mapping_does(tmp_path, section):
    """A copy of tiny.yaml with a section's fields removed (`data:` alone, YAML's null) lost the group's defaults: an
    AttributeError's traceback for data.num_workers, `Key "model.target" not found in namespace`, no save_last."""
    text = (RECIPES_DIR / "tiny.yaml").read_text().replace("precision: auto", "precision: 32-true")
    for name, value in (("emptied", ""), ("mapping", " {}")):
        (tmp_path / f"{name}.yaml").write_text(re.sub(rf"\n{section}:.*\n(  .*\n)+", f"\n{section}:{value}\n", text))
    emptied, mapping = read_recipe(tmp_path / "emptied.yaml", []), read_recipe(tmp_path / "mapping.yaml", [])
    assert vars(mapping)[section] is not None and vars(emptied)[section] == vars(mapping)[section]


@pytest.mark.parametrize("text", ["", "# model:\n#   target: tiny-random\n"])
def test_an_empty_recipe_file_reads_as_the_empty_mapping_does(tmp_path, text):
    """An emptied file, or one of comments alone, was `mine.yaml: Unexpected config` (jsonargparse read it as no config)
    while `{}` read as every default."""
    (tmp_path / "mine.yaml").write_text(text)
    (tmp_path / "mapping.yaml").write_text("{}\n")
    assert read_recipe(tmp_path / "mine.yaml", []) == read_recipe(tmp_path / "mapping.yaml", [])


def test_a_section_added_again_to_a_copy_of_a_recipe_is_refused_not_swapped_for_the_first(tmp_path):
    """The copy's second `model:` replaced the first whole: target smollm2-135m, default layers and anchors."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text((RECIPES_DIR / "tiny.yaml").read_text() + "model:\n  lr: 1.0e-3\n")
    line = len((RECIPES_DIR / "tiny.yaml").read_text().splitlines()) + 1
    with pytest.raises(DDTreeError, match=f"mine.yaml: `model:` at line {line} repeats the one at line "):
        read_recipe(recipe, [])
    recipe.write_text("model:\n  lr: 1.0e-3\n  block_size: 8\n  lr: 2.0e-3\n")  # within a section too
    with pytest.raises(DDTreeError, match=r"mine.yaml: `lr:` at line 4 repeats the one at line 2 \(YAML would keep"):
        read_yaml_mapping(recipe)
    # a merge (<<:) may repeat a key on purpose, and two list items are two mappings
    recipe.write_text("base: &base {lr: 1}\nmodel:\n  <<: *base\n  lr: 2\nlogger:\n- {name: a}\n- {name: b}\n")
    assert read_yaml_mapping(recipe)["model"] == {"lr": 2}


@pytest.mark.parametrize("module", ["train", "evaluate", "publish", "export", "features", "ablate", "throughput",
                                    "flops"])
def test_every_training_command_says_a_bad_flag_in_one_line(capsys, module):
    """argparse printed its usage block above the error (train and features pass flags they do not know on to the
    recipe's parser, which names them through recipe_errors)."""
    import importlib

    try:
        status = importlib.import_module(f"training.{module}").main(["--no-such-flag"])
    except SystemExit as exit_:  # argparse's own exit, through CommandParser.error
        status = exit_.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err  # (a missing required argument may come first)
    if module in ("train", "features", "ablate"):  # they hand it to the recipe's parser, and the line blamed the recipe
        if module == "ablate":  # (which reads the recipe once given a budget)
            assert importlib.import_module("training.ablate").main(["--steps", "2", "--no-such-flag"]) == 2
            err = capsys.readouterr().err
        assert "unrecognized arguments on the command line: --no-such-flag; see " in err and ".yaml" not in err, err


def test_train_evaluate_and_ablate_default_to_the_outputs_folder_make_clean_removes():
    """`make train`, `make eval` and `make ablate` pass no --output-root: a train default of its own would write runs
    where `make eval` and `--resume last` never look ("no run under outputs/...") and `make clean` never removes."""
    parsers = (training.arguments.train_parser, training.arguments.evaluate_parser, training.arguments.ablate_parser)
    assert [parser().parse_args([]).output_root for parser in parsers] == ["outputs"] * 3
    assert re.search(r"^\trm -rf .*\boutputs$", (RECIPES_DIR.parent / "Makefile").read_text(), re.M)


def test_features_evaluate_and_ablate_without_recipe_take_the_recipe_train_does():
    """`python -m training.features` then `python -m training.train`, neither given --recipe, must build the store of
    the recipe that then trains, and evaluate and ablate measure it: a default of its own would build another recipe's
    store, and evaluate would look for runs under another recipe's folder ("no run under outputs/<other>")."""
    parsers = (training.arguments.features_parser, training.arguments.evaluate_parser, training.arguments.ablate_parser)
    assert [parser().parse_args([]).recipe for parser in parsers] == [training.arguments.DEFAULT_RECIPE] * 3
    assert training.arguments.train_parser().parse_args([]).recipe is None  # train resolves it to DEFAULT_RECIPE


def test_the_early_resume_check_looks_in_the_given_recipes_folder(tmp_path):
    """The check `python -m training.train --recipe tiny --resume last` makes before torch loads looks for the run
    under <output-root>/tiny, where main resumes it: under the default recipe's folder it refused a run that is there."""
    run = tmp_path / "tiny" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    torch.save({"global_step": 3}, run / "checkpoints" / "last.ckpt")
    parser = training.arguments.train_parser()
    training.arguments.check_train_args(parser.parse_args(["--recipe", "tiny", "--resume", "last",
                                                            "--output-root", str(tmp_path)]))


@pytest.mark.parametrize("module, argv, status, said", [
    ("training.train", ["--help"], 0, "--output-root OUTPUT_ROOT"),
    ("training.train", ["--recipe", "nope"], 2, "error: unknown recipe 'nope'; known recipes: "),
    # a recipe override is not the command's own flag: the early parse leaves it to the recipe's parser
    ("training.train", ["--trainer.max_steps=1", "--recipe", "nope"], 2, "error: unknown recipe 'nope'; known recipes: "),
    ("training.train", ["--recipe", ""], 2, "error: --recipe is empty (an unset shell variable?); known recipes: "),
    ("training.train", ["--recipe", "tiny", "--resume", "no-such-run"], 2, "error: --resume no-such-run: no such checkpoint; "),
    ("training.train", ["--resume", "last", "--output-root", "no-such-outputs"], 2,
     "error: --resume last: no run under no-such-outputs/smollm2-135m has checkpoints/last.ckpt; start one first"),
    ("training.train", ["--resume", ""], 2, "error: --resume is empty (an unset shell variable?)"),
    ("training.train", ["--resume", "last", "--run-name", "b", "--output-root", "no-such-outputs"], 2,
     "error: --resume continues a run in its own folder, so --run-name b would be ignored: drop --run-name"),
    ("training.evaluate", ["--output-root", "no-such-outputs"], 2, "error: CKPT=best: no run under no-such-outputs/smollm2-135m "),
    ("training.evaluate", ["--run", "no-such-run"], 2, "error: RUN=no-such-run: no such run folder; "),
    ("training.publish", ["no-such-run", "--out", "no-such-export"], 2, "error: RUN=no-such-run: no such run folder; "),
    ("training.features", ["--recipe", "recipes/tiny.yaml"], 2, "error: --recipe takes a recipe's name: --recipe tiny"),
    ("training.evaluate", ["--limit", "x"], 2, "error: argument --limit: invalid int value: 'x'; see python -m training.evaluate"),
    ("training.ablate", ["--help"], 0, "--eval-max-new-tokens"),
    ("training.publish", ["--dtype", "x"], 2, "error: argument --dtype: invalid choice: 'x'"),
    ("training.throughput", ["--help"], 0, "--random-target"),
    ("training.throughput", ["--recipe", "nope"], 2, "error: unknown recipe 'nope'; known recipes: "),
    ("training.throughput", ["--recipe", ""], 2, "error: --recipe is empty (an unset shell variable?)"),
    ("training.throughput", ["--settings", "16x5"], 2, "error: --settings '16x5': give ANCHORSxLAYERSxBLOCK"),
    ("data.regenerate", ["--help"], 0, "--merge-only"),
    ("data.regenerate", ["--recipe", "tiny", "--num-shards", "0"], 2, "error: --num-shards 0 must be at least 1"),
    ("data.recover_ids", ["no-such-data", "--out", "no-such-out"], 2, "error: no-such-data: no regeneration.json; "),
])
def test_a_training_command_answers_help_and_a_bad_recipe_before_torch_loads(module, argv, status, said):
    """`python -m training.train --help`, an unknown --recipe or a missing --resume path, run or checkpoint waited
    11-18 s for torch and Lightning (2-core EPYC), data/regenerate.py and training.throughput 9-14 s; each command's
    module parses above its heavy imports and finds what it names with training/checkpoint_paths.py
    (training/arguments.py). Run as `python -m` runs it."""
    probe = ("import runpy, sys\n"
             "module = sys.argv.pop(1)  # the rest is the command line, as `python -m module ...` leaves it\n"
             "try:\n    runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
             "except SystemExit as exit:\n"
             "    print('status', exit.code, 'torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", probe, module, *argv], capture_output=True, text=True,
                          timeout=120, cwd=RECIPES_DIR.parent)
    assert proc.stderr.strip().splitlines()[-1] == f"status {status} no torch", proc.stderr
    assert said in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_max_time_under_gradient_accumulation_stops_where_a_step_ends_and_resumes_exactly(tmp_path, monkeypatch):
    """Lightning's Timer checks the clock after every micro-batch: with accumulate_grad_batches 2 it stopped after
    micro-batch 5, mid-step, and the checkpoint lacked that micro-batch's gradients, so the resumed step 3 took only
    micro-batch 6's (weights 4e-3 off the straight run's at step 4). Here the clock reads one second per micro-batch."""
    from lightning.pytorch.callbacks import Timer

    toy_data.write_conversations(tmp_path / "conversations.jsonl", 24, 30, 60, 0)
    common = [*resume_args(tmp_path, tmp_path / "out"), "--trainer.accumulate_grad_batches=2", "--trainer.max_steps=4",
              "--eval.every_n_train_steps=4", "--model.dropout=0.0"]
    clock = {"trainer": None}
    monkeypatch.setattr(Timer, "time_elapsed", lambda self, stage="train": float(
        clock["trainer"].fit_loop.epoch_loop.batch_progress.total.completed + 1) if clock["trainer"] else 0.0)

    class Clock(L.Callback):
        def on_train_start(self, trainer, pl_module):
            clock["trainer"] = trainer

    launch_with(monkeypatch, Clock())
    assert main([*common, "--run", "straight"]) == 0
    clock["trainer"] = None  # (the first run's, until this one starts training)
    assert main([*common, "--run", "stopped", "--trainer.max_time=00:00:00:05"]) == 0  # time is up after micro-batch 5
    stopped = tmp_path / "out" / "tiny" / "stopped"
    last = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3  # the step micro-batches 5 and 6 make, not 2 and a half
    assert last["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] == 6  # saved at micro-batch 6
    clock["trainer"] = None
    assert main([*common, "--resume", str(stopped), "--trainer.max_time=null"]) == 0
    first, second = drafter_weights(tmp_path / "out" / "tiny" / "straight"), drafter_weights(stopped)
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0, msg=key)


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def test_more_gpus_than_the_machine_has_is_one_line_naming_the_override(tmp_path, monkeypatch, capsys):
    """Before anything is built, not Lightning's refusal as it builds the Trainer, which names no override."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["--recipe", "qwen3-8b", "--output-root", str(tmp_path)]) == 2  # devices: 8
    errors = error_lines(capsys)
    assert len(errors) == 1 and "recipes/qwen3-8b.yaml: trainer.devices=8 asks for 8 GPUs and this machine has 1" in errors[0]
    assert "add --trainer.devices=1" in errors[0]
    assert not any(tmp_path.iterdir())


def test_accelerator_auto_on_a_gpu_machine_is_held_to_its_gpus_too(monkeypatch):
    """Lightning's auto picks the GPUs when torch sees one, so auto asking for more GPUs than the machine has is the
    same mistake as gpu asking for them: one line naming the override, not Lightning's refusal as it builds."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    too_many = "trainer.devices=8 asks for 8 GPUs and this machine has 1: add --trainer.devices=1"
    with pytest.raises(training.recipe.RecipeSettingError, match=too_many):
        training.recipe.check_accelerator("auto", 8)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(training.recipe.RecipeSettingError, match="names GPU 3, and this machine has GPUs 0-1"):
        training.recipe.check_accelerator("auto", [0, 3])


@pytest.mark.parametrize("devices, missing", [("[0,3]", 3), ("0,3", 3), ("[0,2]", 2), ("0,2", 2)])  # 2: GPUs count from 0
def test_a_devices_list_naming_a_gpu_the_machine_lacks_is_one_line(devices, missing, tmp_path, monkeypatch, capsys):
    """Two GPUs asked for on a two-GPU machine, but GPU 3 is not one of them: Lightning's own refusal names no fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["--recipe", "qwen3-8b", "--output-root", str(tmp_path), f"--trainer.devices={devices}"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"names GPU {missing}, and this machine has GPUs 0-1" in errors[0]
    assert errors[0].endswith("(--trainer.devices=2)")
    assert not any(tmp_path.iterdir())


def test_a_gpu_recipe_with_a_cpu_recipe_of_its_target_points_to_it(tmp_path, monkeypatch, capsys):
    """--trainer.accelerator=cpu would regenerate smollm2-135m-gpu's data in bf16 on the CPU: hours, where bf16 is slow."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--recipe", "smollm2-135m-gpu", "--output-root", str(tmp_path)]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "recipes/smollm2-135m-gpu.yaml: trainer.accelerator=gpu needs a CUDA GPU" in errors[0]
    assert errors[0].endswith("train the CPU recipe of smollm2-135m instead: make train RECIPE=smollm2-135m "
                              "(--recipe smollm2-135m)")
    assert "--trainer.accelerator=cpu" not in errors[0]


def test_the_cpu_recipe_pointed_to_is_named_by_its_recipe_name_not_its_target(monkeypatch):
    """A CPU recipe is found by its target, and launched by its own name: the tiny recipe trains tiny-random, and
    `--recipe tiny-random` names no recipe (smollm2-135m's recipe shares its target's name, which hides the two)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DDTreeError) as error:
        training.recipe.check_accelerator("gpu", 1, "tiny-random")
    assert str(error.value).endswith("train the CPU recipe of tiny-random instead: make train RECIPE=tiny "
                                     "(--recipe tiny)"), error.value


def test_a_gpu_recipe_with_no_cpu_recipe_of_its_target_says_what_to_add(tmp_path, monkeypatch, capsys):
    """Only a CPU recipe is offered: qwen3-8b, a GPU recipe of its target, was told to train itself instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--recipe", "qwen3-8b", "--output-root", str(tmp_path)]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "recipes/qwen3-8b.yaml: trainer.accelerator=gpu needs a CUDA GPU" in errors[0], errors
    assert errors[0].endswith("add --trainer.accelerator=cpu --trainer.precision=auto --trainer.devices=1")
    assert main(["--recipe", "qwen3-8b", "--trainer.accelerator=cuda", "--output-root", str(tmp_path)]) == 2  # gpu's alias
    errors = error_lines(capsys)
    assert len(errors) == 1 and "recipes/qwen3-8b.yaml: trainer.accelerator=cuda needs a CUDA GPU" in errors[0], errors
    assert not any(tmp_path.iterdir())


def test_the_cpu_fix_adds_trainer_devices_only_where_the_recipe_asks_for_several(monkeypatch):
    """devices auto is one CPU process already: adding --trainer.devices=1 to it is a flag the user need not type."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for devices, fix in (("auto", "--trainer.precision=auto"), (1, "--trainer.precision=auto"),
                         (8, "--trainer.precision=auto --trainer.devices=1")):
        with pytest.raises(DDTreeError) as error:
            training.recipe.check_accelerator("gpu", devices)
        assert str(error.value).endswith(f"add --trainer.accelerator=cpu {fix}"), (devices, error.value)


def test_a_malformed_recipe_beside_a_gpu_recipe_does_not_replace_its_error(tmp_path, monkeypatch, capsys):
    """Looking for a CPU recipe of the target reads every recipe: a work-in-progress one named its own fault instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for name in ("smollm2-135m-gpu", "smollm2-135m"):
        (recipes / f"{name}.yaml").write_text((RECIPES_DIR / f"{name}.yaml").read_text())
    # a work-in-progress recipe, read before smollm2-135m
    (recipes / "draft.yaml").write_text("model:\n  target: HuggingFaceTB/SmolLM2-135M-Instruct\ntrainer: cpu\n")
    monkeypatch.setattr(training.arguments, "RECIPES_DIR", recipes)
    assert main(["--recipe", "smollm2-135m-gpu", "--output-root", str(tmp_path / "out")]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "smollm2-135m-gpu.yaml: trainer.accelerator=gpu needs a CUDA GPU" in errors[0], errors
    assert errors[0].endswith("make train RECIPE=smollm2-135m (--recipe smollm2-135m)")


@pytest.mark.parametrize("devices", ["-2", "abc", "1.5", "[0,1]"])
def test_devices_the_cpu_cannot_take_are_one_line_before_anything_loads(devices, tmp_path, capsys):
    """Lightning's CPU parser raises a TypeError for them, which passed as a traceback (a GPU recipe's list of GPUs
    given --trainer.accelerator=cpu too)."""
    assert main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), f"--trainer.devices={devices}"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and errors[0].endswith("recipes/tiny.yaml: the trainer section was refused: `devices` "
                                                   "selected with `CPUAccelerator` should be an int > 0."), errors
    assert not any(tmp_path.iterdir())


def test_a_cpu_deepspeed_strategy_under_a_gpu_accelerator_says_to_set_ds_accelerator(tmp_path, monkeypatch, capsys):
    """zero2_cpu on a GPU machine, where DeepSpeed picks its CUDA accelerator: the strategy's own one line with its
    remedy, not wrapped as a refused trainer section."""
    import deepspeed.accelerator

    gpu = type("Accelerator", (), {"device_name": lambda self, *args: "cuda"})()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: gpu)
    assert main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path),
                 "--trainer.strategy=zero2_cpu"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and errors[0] == ("error: the zero*_cpu strategies need DeepSpeed's CPU accelerator: run "
                                              "with DS_ACCELERATOR=cpu"), errors
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, said", [
    (["--trainer.strategy=zero2"], "trainer.strategy=zero2 is DeepSpeed, which Lightning runs on CUDA GPUs only, and "
                                   "trainer.accelerator=cpu: run it on a GPU machine, or give --trainer.strategy=ddp"),
    (["--trainer.strategy=zero3", "--trainer.accelerator=auto"],
     "trainer.strategy=zero3 is DeepSpeed, which Lightning runs on CUDA GPUs only, and this machine has no CUDA GPU"),
    (["--trainer.strategy=zero2_cpu", "--trainer.gradient_clip_algorithm=value"],  # the CPU twin runs here; this not
     "trainer.gradient_clip_algorithm=value: DeepSpeed (trainer.strategy=zero2_cpu) clips gradients by norm only"),
])
def test_what_deepspeed_refuses_is_one_line_before_anything_loads(overrides, said, tmp_path, monkeypatch, capsys):
    """Lightning's DeepSpeed strategy refused both only once fit started: a traceback and exit status 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), *overrides]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"recipes/tiny.yaml: {said}" in errors[0], errors
    assert not any(tmp_path.iterdir())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: zero2 is fine, clipping by norm too
    training.recipe.check_strategy("zero2", "gpu", "norm")
    training.recipe.check_strategy("ddp", "cpu", "value")


@pytest.mark.parametrize("strategy, ours", [
    ("deepspeed", "zero2"), ("deepspeed_stage_1", "zero2"), ("deepspeed_stage_2", "zero2"),
    ("deepspeed_stage_2_offload", "zero2_offload"), ("deepspeed_stage_3", "zero3"),
    ("deepspeed_stage_3_offload", "zero3_offload"), ("deepspeed_stage_3_offload_nvme", "zero3_offload"),
])
def test_lightnings_own_deepspeed_is_one_line_naming_this_trainings(strategy, ours, tmp_path, monkeypatch, capsys):
    """On a GPU machine they passed and built Lightning's DeepSpeedStrategy, without DrafterDeepSpeed's fixes: an
    accumulating run stepped on 1/N of the gradient, ZeRO-3 partitioned the frozen target, a save cut short went unseen."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DDTreeError, match=f"trainer.strategy={strategy} is Lightning's own DeepSpeed strategy, .* "
                                          f"give --trainer.strategy={ours} "):
        training.recipe.check_strategy(strategy, "gpu", "norm")
    for name in ("zero2", "zero2_offload", "zero3", "zero3_offload", "zero2_cpu"):  # this training's: fine
        training.recipe.check_strategy(name, "gpu", "norm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # and before the CPU's refusal, whose fix is not it
    assert main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path),
                 f"--trainer.strategy={strategy}"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"recipes/tiny.yaml: trainer.strategy={strategy} is Lightning's own" in errors[0], errors
    assert not any(tmp_path.iterdir())


def test_a_lora_drafter_under_zero3_is_one_line_before_anything_loads(tmp_path, capsys):
    """The evaluation during training cannot gather a LoRA drafter sharded by ZeRO-3: the run stopped at its first
    evaluation, after eval.every_n_train_steps steps, with no checkpoint saved."""
    assert main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), "--trainer.strategy=zero3_cpu",
                 "--model.lora_rank=4", f"--model.init_from={tmp_path / 'base'}"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "model.lora_rank=4 with trainer.strategy=zero3_cpu: the evaluation" in errors[0], errors
    assert not any(tmp_path.iterdir())
    for strategy in ("zero3", "zero3_offload"):  # the GPU ones alike
        with pytest.raises(DDTreeError, match=f"model.lora_rank=8 with trainer.strategy={strategy}: "):
            training.recipe.check_lora_strategy(strategy, 8)
    for strategy, rank in (("zero2_cpu", 4), ("zero2", 4), ("ddp", 4), ("zero3", 0)):  # gathered, or no LoRA: fine
        training.recipe.check_lora_strategy(strategy, rank)


def test_a_block_longer_than_the_sequences_is_one_line_before_anything_loads(tmp_path, capsys):
    """It trained and exported: the block positions past data.max_length were never labelled, yet decoding drafts them."""
    assert main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), "--model.block_size=300"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and errors[0].endswith(
        "recipes/tiny.yaml: model.block_size=300 is not a valid value: a block longer than data.max_length=256 has "
        "positions no sequence trains; give a block size of at most 256, or a longer data.max_length"), errors
    assert not any(tmp_path.iterdir())
    training.recipe.check_values(parse_recipe("tiny", "--model.block_size=256"))  # as long as the sequences: fine


def test_a_step_limit_beside_max_time_has_an_end_and_is_accepted():
    """The cosine ends at max_steps: a finite one ends the schedule whatever the clock, so only max_steps -1 with no
    other end is refused (NO_SCHEDULE_END); a finite one beside max_time, without annealing by it, is a plain run."""
    config = parse_recipe("tiny", "--trainer.max_time=00:01:00:00")
    assert config.trainer.max_steps == 30 and not config.model.anneal_by_max_time
    training.recipe.check_values(config)


def test_max_epochs_minus_1_is_no_limit_and_accepted():
    """-1 is Lightning's spelling of no epoch limit, as null is: a run bounded by max_steps alone gives it."""
    config = parse_recipe("tiny", "--trainer.max_epochs=-1")
    training.recipe.check_values(config)
    with pytest.raises(DDTreeError, match=r"trainer.max_epochs=0 is not a valid value: give -1 or null \(no limit\)"):
        training.recipe.check_values(parse_recipe("tiny", "--trainer.max_epochs=0"))


def test_deepspeed_refuses_clipping_by_value_however_it_is_capitalised():
    """Lightning lower-cases trainer.gradient_clip_algorithm, so VALUE clips by value as value does, which DeepSpeed
    cannot: it is refused alike, and norm in any case is not."""
    for algorithm in ("value", "VALUE", "Value"):
        with pytest.raises(DDTreeError, match=f"trainer.gradient_clip_algorithm={algorithm}: DeepSpeed"):
            training.recipe.check_strategy("zero2_cpu", "cpu", algorithm)
    training.recipe.check_strategy("zero2_cpu", "cpu", "NORM")


def test_fsdp_is_one_line_before_anything_loads(tmp_path, monkeypatch, capsys):
    """Nothing here gathers FSDP's shards: the evaluation during training and the export gather DeepSpeed's only, so on
    GPUs (where Lightning takes FSDP) they would have read each rank's shard of the drafter."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for strategy in ("fsdp", "fsdp_cpu_offload"):
        with pytest.raises(DDTreeError, match=f"trainer.strategy={strategy} is FSDP, .* give ddp, or zero2"):
            training.recipe.check_strategy(strategy, "gpu", "norm")
    assert main(["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), "--trainer.strategy=fsdp"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "recipes/tiny.yaml: trainer.strategy=fsdp is FSDP" in errors[0], errors
    assert not any(tmp_path.iterdir())


def test_spawned_or_forked_processes_are_one_line_before_anything_loads(tmp_path, capsys):
    """They passed every check and trained the whole run in the processes Lightning started, then this process, whose
    drafter configure_model never built, exported None: a traceback, exit status 1 and no drafter/."""
    for strategy in ("ddp_fork", "ddp_notebook", "ddp_spawn_find_unused_parameters_true"):
        with pytest.raises(DDTreeError, match=f"trainer.strategy={strategy} trains in processes it (spawn|fork)s, .* "
                                              "give ddp"):
            training.recipe.check_strategy(strategy, "cpu", "norm")
    training.recipe.check_strategy("ddp_find_unused_parameters_true", "cpu", "norm")  # started as commands: fine
    argv = ["--recipe", "tiny", "--run-name", "r", "--output-root", str(tmp_path), "--trainer.strategy=ddp_spawn",
            "--trainer.devices=2"]
    assert main(argv) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and errors[0].endswith(
        "recipes/tiny.yaml: trainer.strategy=ddp_spawn trains in processes it spawns, and the drafter they train never "
        "returns to this process, which exports it: give ddp (the same processes, with rank 0 training in this one)"), errors
    assert not any(tmp_path.iterdir())


def test_a_data_path_under_a_local_folder_is_a_missing_folder_not_a_hub_dataset(tmp_path, monkeypatch, capsys):
    """data/qwen3-8b before its replies are generated has the shape owner/name: it passed the check as a Hub dataset
    and failed at fit, 25 s later, with the Hub's message (or asked the Hub for a dataset `data/qwen3-8b`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    out = tmp_path / "out"
    prompts = RECIPES_DIR.parent / "data" / "eval_prompts.jsonl"  # the recipe's, named from the repository
    assert main(["--recipe", "tiny", "--data.data_path=data/qwen3-8b", f"--eval.prompts={prompts}",
                 "--output-root", str(out)]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "data.data_path=data/qwen3-8b: no such folder (data/ is a folder here" in errors[0]
    assert "generate it first with data/regenerate.py (make data RECIPE=<recipe>" in errors[0], errors
    assert not out.exists()
    # owner/name whose owner/ is no folder here: a Hub dataset, left for the data to load from the Hub, not refused
    config = parse_recipe("tiny", "--data.data_path=someone/chats", f"--eval.prompts={prompts}",
                          "--trainer.precision=32-true")
    training.recipe.check_before_building(config)


def test_a_missing_data_file_of_the_shape_owner_name_is_a_missing_file_not_a_hub_dataset(tmp_path, monkeypatch):
    """mydata/convs.jsonl (mistyped, or not copied yet) passed the check as a Hub dataset and failed at fit, 40 s later,
    with "could not load Hub dataset 'mydata/convs.jsonl'", never saying the file was not there."""
    monkeypatch.chdir(tmp_path)  # no mydata/ here
    prompts = RECIPES_DIR.parent / "data" / "eval_prompts.jsonl"
    for data_path in ("mydata/convs.jsonl", "mydata/convs.JSON", "mydata/convs.parquet"):
        config = parse_recipe("tiny", f"--data.data_path={data_path}", f"--eval.prompts={prompts}",
                              "--trainer.precision=32-true")
        with pytest.raises(DDTreeError, match=f"data.data_path={data_path}: no such file or folder"):
            training.recipe.check_before_building(config)


def test_eval_prompts_that_are_not_there_are_one_line_before_anything_loads(tmp_path, capsys):
    """Else found at the first evaluation, after the feature store, the target, the corpus and the first training steps."""
    prompts = tmp_path / "prompts.jsonl"
    assert main(["--recipe", "tiny", f"--eval.prompts={prompts}", "--output-root", str(tmp_path / "out")]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and errors[0].endswith(
        f"recipes/tiny.yaml: eval.prompts={prompts}: no such file; give a JSONL of held-out prompts (the `ddtree bench "
        "--prompts` format)"), errors
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("adapter, said", [
    ("adaptr", "no adapter_config.json there"),
    ("config_only", "adapter_config.json is there but not the adapter's weights"),
    ("prompt", "a PROMPT_TUNING adapter, which cannot be merged into the target's weights"),
])
def test_a_target_adapter_that_is_not_there_is_named_before_the_data_is_generated(tmp_path, monkeypatch, capsys,
                                                                                  adapter, said):
    """A misspelt model.target_adapter was found only as the target loaded, after data/regenerate.py had written the
    recipe's data with it (hours, on a real target); a prompt-tuning one then failed to merge with a traceback."""
    from peft import PromptTuningConfig, get_peft_model

    from ddtree.targets import load_target

    monkeypatch.setattr(training.train, "prepare_recipe_data", lambda *args, **kwargs: pytest.fail("went on to the data"))
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "adapter_config.json").write_text("{}")
    if adapter == "prompt":
        prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        get_peft_model(load_target("tiny-random")[0], prompt_tuning).save_pretrained(tmp_path / "prompt")
    regenerate = '{"prompts": "data/prompts/train_prompts.jsonl", "limit": 3}'
    argv = ["--recipe", "tiny", f"--model.target_adapter={tmp_path / adapter}", f"--data.data_path={tmp_path / 'regen'}",
            f"--data.regenerate={regenerate}", "--output-root", str(tmp_path / "out")]
    assert main(argv) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"model.target_adapter={tmp_path / adapter}: {said}" in errors[0], errors
    assert not (tmp_path / "regen").exists() and not (tmp_path / "out").exists()


def test_a_resume_does_not_look_for_the_warm_start_folder_it_no_longer_reads(tmp_path):
    """A resumed drafter is built from its checkpoint, which holds every weight: a run warm-started from a folder since
    moved or removed is still resumed, and a new run from it is refused before anything loads."""
    config = parse_recipe("tiny", f"--model.init_from={tmp_path / 'gone'}", "--trainer.precision=32-true")
    training.recipe.check_before_building(config, resuming=True)
    with pytest.raises(DDTreeError, match=f"model.init_from: drafter '{tmp_path / 'gone'}' is not a folder"):
        training.recipe.check_before_building(config)


@pytest.mark.parametrize("field", ["checkpoint.dirpath", "trainer.default_root_dir"])
def test_where_a_run_writes_is_the_run_folders_alone(field, tmp_path, monkeypatch, capsys):
    """Overriding either split a run: --checkpoint.dirpath put its checkpoints where neither its resume nor make eval
    looks (and two runs given one overwrote each other's), --trainer.default_root_dir its reports and eval/."""
    elsewhere = tmp_path / "elsewhere"
    for given in ([f"--{field}={elsewhere}"], [f"--{field}", str(elsewhere)]):  # in one item or two
        assert main(["--recipe", "tiny", *given, "--output-root", str(tmp_path / "out")]) == 2
        errors = error_lines(capsys)
        assert len(errors) == 1 and f"tiny.yaml: --{field} is set by the run folder" in errors[0], (given, errors)
        assert "--output-root" in errors[0] and not elsewhere.exists() and not (tmp_path / "out").exists()
    section, key = field.split(".")
    recipe = tmp_path / "mine.yaml"
    text = (RECIPES_DIR / "tiny.yaml").read_text()
    recipe.write_text(text.replace(f"\n{section}:\n", f"\n{section}:\n  {key}: x\n", 1))
    with pytest.raises(DDTreeError, match=f"mine.yaml: {field} is set by the run folder; remove it from the {section} "):
        read_recipe(recipe, [])


@pytest.mark.parametrize("key, source", [("every_n_train_steps", "eval.every_n_train_steps"),
                                         ("monitor", "eval.primary_budget")])
def test_a_checkpoint_setting_the_eval_section_sets_is_refused_in_the_recipe(key, source, tmp_path):
    """The eval section's link replaced it: `monitor: train/loss` ranked checkpoints by tau without a word."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text((RECIPES_DIR / "tiny.yaml").read_text().replace("\ncheckpoint:\n", f"\ncheckpoint:\n  {key}: 5\n", 1))
    with pytest.raises(DDTreeError, match=f"mine.yaml: checkpoint.{key} follows {source}; remove it from the checkpoint "):
        read_recipe(recipe, [])


def test_a_target_dtype_that_is_not_a_dtype_is_one_line_before_anything_loads(tmp_path, capsys):
    with pytest.raises(DDTreeError, match="model.target_dtype='fp16': choose one of float32, bfloat16, float16, or auto"):
        training.target.dtype_for_precision("32-true", "fp16")
    assert training.target.dtype_for_precision("32-true", "torch.bfloat16") == torch.bfloat16
    assert main(["--recipe", "tiny", "--model.target_dtype=fp16", "--output-root", str(tmp_path)]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "recipes/tiny.yaml: model.target_dtype='fp16': choose one of" in errors[0]
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- end to end: tiny recipe


def write_conversations(path, count=24, seed=0):
    return toy_data.write_conversations(path, count, 30, 60, seed)


def launch_with(monkeypatch, callback: L.Callback) -> None:
    """training.train's launches build their trainer with `callback` first among its callbacks."""
    def build(*args):
        cli = build_cli(*args)
        cli.trainer.callbacks.insert(0, callback)
        return cli

    monkeypatch.setattr(training.train, "build_cli", build)


def drafter_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "drafter" / "model.safetensors")


def resume_args(tmp_path, out):
    """The tiny recipe for 6 steps, evaluated at steps 3 and 6 (one prompt, toy_data.SMALL_EVAL: the evaluation is not
    under test), with dropout, whose masks a resumed run must draw as the uninterrupted one does."""
    return [
        "--recipe", "tiny", "--output-root", str(out),
        f"--data.data_path={tmp_path / 'conversations.jsonl'}", f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.batch_size=2", "--data.val_fraction=0.1", "--trainer.val_check_interval=null",
        "--eval.every_n_train_steps=3", "--eval.limit=1", *toy_data.SMALL_EVAL,
        "--trainer.max_steps=6", "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1", "--model.dropout=0.1",
    ]


def test_the_last_line_names_the_checkpoint_make_export_takes(tmp_path, capsys):
    """It said `make export` takes the best checkpoint by default also for a run that kept none (checkpoint.save_top_k
    0 keeps last.ckpt only): doing as it said stopped on the missing best.ckpt (found in a review)."""
    write_conversations(tmp_path / "conversations.jsonl")
    said = {}
    for run, top_k in (("kept", 1), ("none", 0)):
        assert main([*resume_args(tmp_path, tmp_path / "out"), "--trainer.max_steps=2", "--eval.every_n_train_steps=2",
                     f"--checkpoint.save_top_k={top_k}", "--run", run]) == 0
        said[run] = capsys.readouterr().out.splitlines()[-1]
    assert said["kept"].endswith("(make export takes the best checkpoint by default)"), said
    assert (tmp_path / "out" / "tiny" / "kept" / "checkpoints" / "best.ckpt").exists()
    none = tmp_path / "out" / "tiny" / "none"
    assert not (none / "checkpoints" / "best.ckpt").exists()
    assert "takes the best checkpoint by default)" not in said["none"]
    assert said["none"].endswith(f"`make export RUN={none} OUT=exports/<name> CKPT=last` exports these weights)"), said
    assert "checkpoint.save_top_k 0 keeps last.ckpt only" in said["none"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """One straight run of 6 steps, the reference of both resume tests: (its data folder, its run folder)."""
    tmp_path = tmp_path_factory.mktemp("straight")
    write_conversations(tmp_path / "conversations.jsonl")
    assert main([*resume_args(tmp_path, tmp_path / "out"), "--run", "straight"]) == 0
    return tmp_path, tmp_path / "out" / "tiny" / "straight"


def test_a_straight_run_writes_its_checkpoint_logs_and_drafter(straight_run):
    _, straight = straight_run
    for produced in ("config.yaml", "checkpoints/last.ckpt", "drafter/config.json", "csv/version_0/metrics.csv"):
        assert (straight / produced).exists(), produced
    assert list((straight / "tensorboard" / "version_0").glob("events.out.tfevents.*"))
    checkpoint = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)
    assert all(key.startswith("drafter.") for key in checkpoint["state_dict"])  # never the target
    assert checkpoint["global_step"] == 6 and checkpoint["optimizer_states"] and checkpoint["lr_schedulers"]


@pytest.mark.parametrize("stop", [3, 4])  # on the evaluation grid, and off it (as max_time stops, on_train_end saves)
def test_tiny_recipe_runs_and_resumes_exactly(straight_run, tmp_path, monkeypatch, stop):
    data_folder, straight = straight_run
    common = resume_args(data_folder, tmp_path / "out")  # the straight run's data, a folder of its own

    # the same run stopped after step `stop` (mid-epoch: 11 batches per epoch), then resumed to 6. It is
    # stopped by a callback, not by max_steps, which would change the length of the cosine schedule.
    class StopAfterStep(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step >= stop

    launch_with(monkeypatch, StopAfterStep())
    assert main([*common, "--run", "split"]) == 0
    monkeypatch.setattr(training.train, "build_cli", build_cli)
    split = tmp_path / "out" / "tiny" / "split"
    assert torch.load(split / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == stop
    assert main([*common, "--resume", "last"]) == 0  # the newest run of the recipe: `split`
    resumed = torch.load(split / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == 6
    assert (split / "csv" / "version_1").exists()  # the resumed launch logs beside the first one
    first, second = drafter_weights(straight), drafter_weights(split)
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("lr", ["0", "-1e-4"])
def test_a_learning_rate_that_is_not_positive_is_refused_before_anything_loads(lr):
    """AdamW takes lr=0 without a word, and the schedule scales it: the run would train for hours and export the
    drafter it started with."""
    with pytest.raises(DDTreeError, match=rf"^model.lr={float(lr)} is not a valid value: give a positive learning "
                                          "rate$"):
        training.recipe.check_values(parse_recipe("tiny", f"--model.lr={lr}"))
    training.recipe.check_values(parse_recipe("tiny", "--model.lr=1e-6"))  # however small, positive trains
