"""Every command's --out flag: an empty value (`--out "$UNSET"`) is a usage error, not the flag left out.

bench ran and wrote nothing, training.features built a 349 MB store at its default path, and regenerate's
Path("") is the working folder (found in a review, 2026-11-30).
"""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


def data_module(name: str):
    spec = importlib.util.spec_from_file_location(f"out_flag_{name}", DATA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(DATA))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(DATA))
    return module


def data_script(name: str):
    return data_module(name).main


def command_main(name: str):
    if name in ("regenerate", "recover_ids"):
        return data_script(name)
    return importlib.import_module(name).main


@pytest.mark.parametrize("name, argv", [
    ("ddtree.cli", ["bench", "--target", "tiny-random", "--methods", "ar", "--prompts", "data/eval_prompts.jsonl"]),
    ("training.features", ["--recipe", "tiny"]),
    ("training.evaluate", ["--recipe", "tiny", "--run", "some-run"]),
    ("training.publish", ["some-run"]),
    ("regenerate", ["--target", "tiny-random"]),
    ("recover_ids", ["some-data"]),
])
def test_an_empty_out_is_one_usage_line(capsys, name, argv):
    with pytest.raises(SystemExit) as exit_:
        command_main(name)([*argv, "--out", ""])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --out: expected a path, got an empty string" in err, err


@pytest.mark.parametrize("name", ["training.train", "training.ablate"])
def test_an_output_root_is_a_path_flag_empty_refused_and_its_tilde_expanded(capsys, monkeypatch, tmp_path, name):
    """`--output-root=~/runs` (a ~ no shell expands) split a run between ./~/runs (checkpoints, config, drafter) and
    Lightning's ~/runs (eval, report, logs); an empty one (`--output-root "$UNSET"`) trained into the working folder."""
    from training.arguments import ablate_parser, train_parser

    with pytest.raises(SystemExit) as exit_:
        command_main(name)(["--recipe", "no-such-recipe", "--output-root", ""])  # (so nothing trains if it is taken)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --output-root: expected a path, got an empty string" in err, err
    monkeypatch.setenv("HOME", str(tmp_path))
    parser = {"training.train": train_parser, "training.ablate": ablate_parser}[name]()
    assert parser.parse_known_args(["--output-root=~/runs"])[0].output_root == str(tmp_path / "runs")


@pytest.mark.parametrize("parser, flag", [
    ("training.arguments:train_parser", "--resume"),
    ("training.arguments:evaluate_parser", "--ckpt"),
    ("training.arguments:evaluate_parser", "--run"),
    ("training.arguments:evaluate_parser", "--output-root"),
    ("training.arguments:publish_parser", "--ckpt"),
    ("training.arguments:publish_parser", "--push-only"),
    ("regenerate", "--prompts"),
    ("regenerate", "--recipe"),
    ("regenerate", "--for-recipe"),
])
def test_a_path_flags_tilde_is_the_home_folder(monkeypatch, tmp_path, parser, flag):
    """`--run=~/runs/x` reaches the command with its ~ unexpanded (no shell expands it after `=`): evaluate said "no
    such run folder" of a folder that was there, regenerate --prompts=~/p.jsonl "no such file"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    if ":" in parser:
        module, name = parser.split(":")
        build = getattr(importlib.import_module(module), name)
    else:
        build = data_module(parser).build_parser
    args = build().parse_known_args([f"{flag}=~/x"])[0]
    assert str(getattr(args, flag.lstrip("-").replace("-", "_"))) == str(tmp_path / "x")


def test_make_prompts_writes_to_the_home_folder_of_a_tilde(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # a ~ taken as a folder name would write under ./~/
    assert data_script("make_prompts")(["--num-coding", "1", "--num-chat", "1", "--num-eval", "2",
                                        "--train-out=~/train.jsonl", "--eval-out=~/eval.jsonl"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["eval.jsonl", "train.jsonl"]
