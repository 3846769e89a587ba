"""The `ddtree` CLI: a bench run end to end, and bad input as one line with a non-zero exit."""

import json
import re
import subprocess
import sys

import pytest

from ddtree.cli import load_drafter, main
from ddtree.targets import load_target

TARGET = "tiny-random"


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "chat", "messages": [{"role": "user", "content": "Name two prime numbers."}]},
        {"prompt": "def square(x):"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_bench_writes_results(capsys, tmp_path, prompts_file):
    out = tmp_path / "results.json"
    code, stdout, _ = run_cli(
        capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file),
        "--methods", "ar,dflash,ddtree", "--budgets", "4,16", "--max-new-tokens", "12", "--out", str(out),
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results["summary"]) == {"ar", "dflash", "ddtree@4", "ddtree@16"}
    assert results["settings"]["target"] == TARGET
    ar = results["prompts"][0]["methods"]["ar"]["new_tokens"]
    for prompt in results["prompts"]:
        assert prompt["id"] in {"chat", "2"}
        for key, run in prompt["methods"].items():
            assert run["tau"] >= 1.0 and len(run["new_tokens"]) <= 12
    # greedy decoding is lossless, so every method commits the same tokens
    assert all(results["prompts"][0]["methods"][k]["new_tokens"] == ar for k in results["summary"])
    assert results["summary"]["ar"]["speedup"] == pytest.approx(1.0)
    assert "ddtree@16" in stdout


def _bad(capsys, *args):
    code, _, err = run_cli(capsys, *args)
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def test_unknown_target(capsys, prompts_file):
    line = _bad(capsys, "bench", "--target", "no-such-model", "--prompts", str(prompts_file))
    assert "unknown target 'no-such-model'" in line and "smollm2-135m" in line


def test_malformed_prompts_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n')
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(path), "--methods", "ar")
    assert f"{path}:2" in line
    path.write_text('{"prompt": "fine"}\n\n{"text": "no prompt field"}\n')
    assert f"{path}:3" in _bad(capsys, "bench", "--target", TARGET, "--prompts", str(path), "--methods", "ar")


def test_budget_below_one(capsys, prompts_file):
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--budgets", "8,0")
    assert "budget 0" in line


def test_prompt_longer_than_context(capsys, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": "word " * 3000}) + "\n")
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(path), "--methods", "ar")
    assert "'long'" in line and "context is 2048" in line


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("hidden_size", 576, "hidden_size 576"),
        ("target_layer_ids", [1, 40], "target_layer_ids [1, 40]"),
        ("vocab_size", 1000, "vocab_size 1000"),
    ],
)
def test_drafter_for_another_target(capsys, tmp_path, prompts_file, field, value, message):
    target, tokenizer = load_target(TARGET)
    drafter = load_drafter("random", target, tokenizer, TARGET)
    drafter.save_pretrained(tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    if field == "target_layer_ids":
        config["dflash_config"]["target_layer_ids"] = value
    else:
        config[field] = value
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    line = _bad(capsys, "bench", "--target", TARGET, "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts_file))
    assert message in line and str(tmp_path / "drafter") in line


def test_console_script_exit_code(tmp_path):
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "bench", "--target", TARGET, "--prompts", str(missing)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: prompts file {missing} does not exist"
    assert "Traceback" not in proc.stderr


def test_main_without_arguments_reads_the_command_line(capsys, monkeypatch, tmp_path):
    """The console script `ddtree` calls main() with no argument."""
    missing = tmp_path / "missing.jsonl"
    monkeypatch.setattr(sys, "argv", ["ddtree", "bench", "--target", TARGET, "--prompts", str(missing), "--methods", "ar"])
    assert main() == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: prompts file {missing} does not exist"


def test_generate_reports_its_tokens(capsys):
    code, _, err = run_cli(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--max-new-tokens", "5")
    assert code == 0
    assert re.search(r"^\[ddtree\] 5 tokens, tau \d", err, re.M), err
