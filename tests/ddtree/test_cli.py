"""The `ddtree` CLI: a bench run end to end, and bad input as one line with a non-zero exit."""

import errno
import io
import json
import os
import random
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ddtree.bench
import ddtree.cli
import ddtree.errors
import ddtree.precision
from ddtree.calibration import (CALIBRATION_FILE, CARD_NOTE, FORMAT_VERSION, OnlineCalibration, load_calibration,
                                note_in_card, save_calibration, weights_fingerprint)
from ddtree.cli import TextStream, load_drafter, main
from ddtree.corpus import CORPUS_FILE, write_replies
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.names import REPO_MARK
from ddtree.packed_linear import is_packed, packing_available
from ddtree.precision import Choice
from ddtree.errors import DDTreeError, error_line, first_and_count
from ddtree.files import cache_dir
from ddtree.targets import build_drafter_config, load_target, resolve_target

TARGET = "tiny-random"


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_prompts(path: Path) -> Path:
    lines = [
        {"id": "chat", "messages": [{"role": "user", "content": "Name two prime numbers."}]},
        {"prompt": "def square(x):"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path / "prompts.jsonl")


@pytest.fixture
def unwarmed(monkeypatch):
    """bench's and calibrate's untimed warm-up (one generation per method before the timed ones) left out: it keeps
    one-off costs out of the timed figures, which a test that reads tokens, taus, temperatures, settings or notes does
    not read, and it teaches the timed runs nothing (test_bench holds what it decodes and that it teaches nothing).
    About a quarter of a 2-prompt bench's decoding on a 2-core AVX2 EPYC."""
    monkeypatch.setattr(ddtree.bench, "warm_up", lambda keys, decode: None)


GREEDY_BENCH = ["--methods", "ar,dflash,ddtree", "--budgets", "4", "--max-new-tokens", "12", "--dtype", "float32"]


@pytest.fixture(scope="module")
def greedy_bench(tmp_path_factory) -> dict:
    """The results of one bench of the untrained drafter over prompts_file's prompts (GREEDY_BENCH, the dynamic
    cache): the run that the static cache's and online calibration's runs are compared with, decoded once for both
    (about 1.5 s on a 2-core AVX2 EPYC)."""
    folder = tmp_path_factory.mktemp("greedy_bench")
    out, prompts = folder / "results.json", write_prompts(folder / "prompts.jsonl")
    assert main(["bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts), *GREEDY_BENCH,
                 "--static-cache", "off", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def committed(results: dict) -> list[list[int]]:
    """The tokens each method committed, prompt by prompt."""
    return [run["new_tokens"] for prompt in results["prompts"] for run in prompt["methods"].values()]


def test_bench_writes_results(capsys, tmp_path, prompts_file, unwarmed):
    out = tmp_path / "results.json"
    code, stdout, _ = run_cli(
        capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file),
        "--methods", "ar,dflash,ddtree", "--budgets", "4,16", "--max-new-tokens", "12", "--out", str(out),
        "--dtype", "float32",  # greedy decoding is exactly lossless in fp32
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results["summary"]) == {"ar", "dflash", "ddtree@4", "ddtree@16"}
    assert results["settings"]["target"] == TARGET
    assert results["settings"]["dtype"] == results["settings"]["dtype_resolved"] == "float32"
    # what the figures were measured on, to compare them with another machine's
    machine = results["machine"]
    assert machine["threads"] == torch.get_num_threads() and machine["torch"] == torch.__version__
    assert machine["cpu"] and machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "gpu" not in machine and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", machine["utc"])
    assert f"{machine['cpu']} ({machine['cpu_capability']}" in stdout and f"{machine['threads']} thread" in stdout
    ar = results["prompts"][0]["methods"]["ar"]["new_tokens"]
    for prompt in results["prompts"]:
        assert prompt["id"] in {"chat", "2"}
        for key, run in prompt["methods"].items():
            assert run["tau"] >= 1.0 and len(run["new_tokens"]) <= 12
    # greedy decoding is lossless, so every method commits the same tokens
    assert all(results["prompts"][0]["methods"][k]["new_tokens"] == ar for k in results["summary"])
    assert results["summary"]["ar"]["speedup"] == pytest.approx(1.0)
    assert "ddtree@16" in stdout
    # and bench says so, counted prompt by prompt
    for key in ("dflash", "ddtree@4", "ddtree@16"):
        assert results["summary"][key]["same_as_ar"] == results["summary"][key]["prompts"] == 2, key
    assert "prompts whose committed tokens equal ar's: dflash 2/2, ddtree@4 2/2, ddtree@16 2/2" in stdout
    assert "same_as_ar" not in results["summary"]["ar"]


def bench_off_and_on(capsys, tmp_path, prompts_file, option: str, methods: str, off: dict | None = None) -> dict:
    """Bench with `option` off and on (fp32, an untrained drafter): {choice: (results, stderr, committed tokens,
    stdout)}; `off`: the off run's results where a fixture decoded it (its stderr and stdout None)."""
    runs = {} if off is None else {"off": (off, None, committed(off), None)}
    for choice in ("off", "on")[len(runs):]:
        out = tmp_path / f"{choice}.json"
        code, stdout, err = run_cli(
            capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file), "--methods",
            methods, "--budgets", "4", "--max-new-tokens", "12", "--dtype", "float32", option, choice, "--out", str(out),
        )
        assert code == 0
        results = json.loads(out.read_text())
        runs[choice] = (results, err, committed(results), stdout)
    return runs


def test_bench_static_cache_commits_the_dynamic_caches_tokens(capsys, tmp_path, prompts_file, greedy_bench):
    """--static-cache on (padded verifies over a preallocated cache) and off decode the same tokens, every method.
    The off run is greedy_bench's (GREEDY_BENCH, --static-cache off)."""
    runs = bench_off_and_on(capsys, tmp_path, prompts_file, "--static-cache", "ar,dflash,ddtree", greedy_bench)
    for choice, (results, *_) in runs.items():
        assert results["settings"]["static_cache"] == choice
    assert runs["on"][2] == runs["off"][2] and len(runs["on"][2]) == 6


def test_bench_online_calibration_learns_a_temperature_per_method_and_commits_the_same_tokens(
        capsys, tmp_path, prompts_file, greedy_bench, unwarmed):
    """Without online calibration: greedy_bench's run (GREEDY_BENCH, --static-cache off); with it, the same settings."""
    out = tmp_path / "online.json"
    code, stdout, _ = run_cli(capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts",
                              str(prompts_file), *GREEDY_BENCH, "--static-cache", "off", "--out", str(out),
                              "--online-calibration")
    assert code == 0
    results = json.loads(out.read_text())
    tokens = {False: committed(greedy_bench), True: committed(results)}
    summaries = {False: greedy_bench["summary"], True: results["summary"]}
    assert tokens[True] == tokens[False]
    learned = {key: s["online_temperature"] for key, s in summaries[True].items() if "online_temperature" in s}
    assert set(learned) == {"dflash", "ddtree@4"} and all(t != 1.0 for t in learned.values())  # the random drafter
    assert "online calibration's draft temperature" in stdout and "online_temperature" not in summaries[False]["dflash"]


def _bad(capsys, *args):
    code, _, err = run_cli(capsys, *args)
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def test_unknown_target(capsys, prompts_file):
    line = _bad(capsys, "bench", "--target", "no-such-model", "--prompts", str(prompts_file))
    assert "unknown target 'no-such-model'" in line and "smollm2-135m" in line


@pytest.mark.parametrize("target", ["models/Qwen3 8B", "owner/name..x", "models/qwen/Qwen3-8B"])
def test_a_target_that_is_neither_a_folder_nor_a_valid_hub_id_is_one_line(capsys, prompts_file, monkeypatch, target):
    # owner/name in shape, but a name the Hub refuses: a mistyped path, not a Hub id to look up
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    line = _bad(capsys, "bench", "--target", target, "--prompts", str(prompts_file))
    assert f"unknown target {target!r}" in line


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


def test_a_bad_flag_is_one_line_naming_the_subcommands_help(capsys):
    """argparse printed its usage block (11 lines) above the error."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--prompts", "p.jsonl", "--budgets", "16,x"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: argument --budgets: expected comma-separated integers, got '16,x'; "
                                       "see ddtree bench --help\n")


def test_an_abbreviated_option_is_refused_as_unknown(capsys):
    """argparse took any unique prefix: --max-new for --max-new-tokens (a prefix that stops being unique as options are
    added would change meaning, and training.train's --output passed recipes/slurm.sbatch's guard as --output-root)."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", TARGET, "--method", "ar", "--prompt", "Hi", "--max-new", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --max-new 2; see ddtree --help\n"


@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1)])
@pytest.mark.parametrize("command", [["generate", "--method", "ar", "--prompt", "Hi"],
                                     ["bench", "--methods", "ar", "--limit", "1", "--prompts", "data/eval_prompts.jsonl"]])
def test_a_seed_torch_cannot_take_is_a_usage_error(capsys, command, seed):
    """A ValueError traceback (status 1) once the target had loaded, from manual_seed (found in a review)."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--target", TARGET, "--max-new-tokens", "2", "--seed", seed])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"error: argument --seed: {seed} is outside the seeds torch takes, -2**63 to "
                                       f"2**64-1; see ddtree {command[0]} --help\n")


def test_generates_stdout_holds_the_reply_alone(capsys):
    """`ddtree generate ... > reply.txt`: the tiny target's layer notice (a random drafter's config says it) came first
    on stdout (found in a review); it is said on stderr with the command's other notes."""
    args = ("generate", "--target", TARGET, "--raw", "--prompt", "hi", "--max-new-tokens", "4", "--no-stream",
            "--dtype", "float32", "--packed-weights", "off", "--adaptive-size", "off")
    code, out, err = run_cli(capsys, *args, "--drafter", "random")
    assert code == 0 and "[ddtree] target tiny-random has 6 layers" in err
    code, greedy, _ = run_cli(capsys, *args, "--method", "ar")  # the same tokens (decoding is lossless), no drafter
    assert code == 0 and out == greedy and "[ddtree]" not in greedy


@pytest.mark.parametrize("seed", [2**64 - 1, -2**63])
def test_a_seed_at_either_end_of_torchs_range_is_used(capsys, seed):
    code, out, err = run_cli(capsys, "generate", "--target", TARGET, "--method", "ar", "--prompt", "Hi",
                             "--max-new-tokens", "2", "--temperature", "1", "--seed", str(seed))
    assert code == 0 and "[ar] 2 tokens" in err, err


def test_bench_samples_with_the_seed_it_records(capsys, tmp_path, tiny_target):
    """bench handed its decoding a seed of its own while results.json recorded --seed: a file describing a run that did
    not happen, and no test compared two seeds (mutation review, C16). Two seeds sample two replies, a seed repeats
    its reply, and the one recorded draws the tokens recorded."""
    from ddtree.decoding import Sampling, generate
    from ddtree.targets import stop_token_ids

    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    runs = []
    for number, seed in enumerate((0, 5, 5)):
        out = tmp_path / f"{number}.json"
        assert run_cli(capsys, "bench", "--target", TARGET, "--prompts", str(tmp_path / "prompts.jsonl"), "--methods",
                       "ar", "--max-new-tokens", "8", "--temperature", "1", "--seed", str(seed), "--dtype", "float32",
                       "--packed-weights", "off", "--out", str(out))[0] == 0
        runs.append(json.loads(out.read_text()))
    tokens = [results["prompts"][0]["methods"]["ar"]["new_tokens"] for results in runs]
    assert tokens[0] != tokens[1] == tokens[2], tokens
    target, tokenizer = tiny_target
    recorded = runs[1]["settings"]["seed"]
    drawn = generate(target, tokenizer("Hi", add_special_tokens=False)["input_ids"], "ar", None, 1, 8,
                     stop_token_ids(target, tokenizer), Sampling(1.0), torch.Generator().manual_seed(recorded))
    assert recorded == 5 and drawn.new_tokens == tokens[1]


@pytest.mark.parametrize("command, default", [("generate", 256), ("bench", 256), ("calibrate", 64)])
def test_help_lists_only_the_options_a_command_takes_and_its_max_new_tokens_default(capsys, monkeypatch, command,
                                                                                    default):
    """calibrate --help offered --online-calibration, --calibration FILE and a 'random' --drafter, which it always
    refuses, and no help said --max-new-tokens' default, 64 for calibrate (found in a review)."""
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps the help to the terminal's width, at hyphens too
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"--max-new-tokens MAX_NEW_TOKENS at most this many new tokens a reply (default: {default})" in out
    for offered in ("--online-calibration", "--calibration FILE", "'random'"):
        assert (offered in out) is (command != "calibrate"), offered
    assert ("--drafter DRAFTER the drafter folder to calibrate (required)" in out) is (command == "calibrate")


@pytest.mark.parametrize("command, required", [("generate", ["--prompt", "x"]), ("bench", ["--prompts", "p.jsonl"]),
                                               ("calibrate", ["--prompts", "p.jsonl"])])
def test_each_default_is_the_one_its_help_states(capsys, monkeypatch, command, required):
    """No test pinned the defaults --help states: any could change with every test passing, and with it every sampled
    reply (--top-p), the equality of `generate --seed` with Decoder(seed=0) (--seed), or bench's comparison with the
    published figures (--budgets, --adaptive-size off) (mutation review, A01-A06), or the target every command loads
    when none is given (--target), or bench's comparison of every method (--methods; mutation review 32, A06, A12),
    or the drafter's own context lookup and re-drafting that --lookup and --redraft left out keep. Each is read from
    the help here."""
    from ddtree.arguments import build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps the help to the terminal's width
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())

    def stated(pattern: str) -> str:
        found = re.search(pattern, out)
        assert found, f"{command} --help no longer states {pattern}"
        return found.group(1)

    args = build_parser().parse_args([command, *required])
    assert args.target == stated(r"--target TARGET .*?\(default: ([\w.-]+), built in\)")
    assert args.top_p == float(stated(r"--top-p TOP_P .*?\(default: ([\d.]+), no cut\)"))
    assert args.top_k == int(stated(r"--top-k TOP_K .*?\(default: (\d+), no cut\)"))
    assert args.seed == int(stated(r"--seed SEED .*?\(default: (\d+)\)"))
    assert args.adaptive_size == stated(rf"[(;] ?{command}: (\w+)")  # "(generate: auto; calibrate: auto too; ..."
    # None: the drafter's own (drafter_defaults), 7 for the smollm2-135m recipe's: a 0 decoded it without lookup
    assert stated(r"--lookup N .*?default: (the drafter's own) \(") and args.lookup is None
    assert stated(r"--redraft K .*?default: (the drafter's own) \(") and args.redraft is None
    if command != "calibrate":  # left out, an untrained drafter decoded, and --help did not say so
        assert args.drafter == stated(r"--drafter DRAFTER .*?\(default: (\w+)\)") == "random"
    else:
        assert args.budgets == [int(stated(r"--budgets BUDGETS .*?; default: (\d+)\)"))]
    if command == "generate":
        assert args.budget == int(stated(r"--budget BUDGET tree node budget for ddtree \(published: (\d+);"))
    if command == "bench":
        budgets = stated(r"--budgets BUDGETS .*?\(default: ([\d,]+)\)")
        assert args.budgets == [int(budget) for budget in budgets.split(",")]
        named = stated(r"--methods METHODS comma-separated, from ([\w, ]+) \(default: all three;").split(", ")
        assert args.methods.split(",") == named == ["ar", "dflash", "ddtree"]


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["bench", "--prompts", "p.jsonl"],
                                     ["calibrate", "--prompts", "p.jsonl"]])
def test_the_static_cache_is_left_to_the_device_by_default(command):
    """--static-cache left out is auto, as its help says: the static cache (a CUDA graph) on CUDA only. No test read
    the default, so an `off` one would drop the CUDA graph from every GPU run with every test passing on a CPU
    (mutation review 32, A08)."""
    from ddtree.arguments import STATIC_CACHE, build_parser

    assert STATIC_CACHE[build_parser().parse_args(command).static_cache] is None  # generate(static=None): by device


@pytest.mark.parametrize("device, auto", [("cpu", False), ("cuda", True)])
def test_static_cache_off_or_on_is_kept_on_every_device_and_auto_follows_it(device, auto):
    """--static-cache auto picks the static cache on a GPU only; off must stay off on a GPU too (the dynamic cache,
    which adaptive sizing needs), and on stay on on a CPU. Resolved from a device object alone: every test runs on a
    CPU, where an `off` read as auto would pass unseen."""
    from ddtree.arguments import STATIC_CACHE
    from ddtree.decoding import static_cache

    resolved = [static_cache(static, torch.device(device)) for static in (*STATIC_CACHE, *STATIC_CACHE.values())]
    assert resolved == [auto, True, False, auto, True, False]  # "auto", "on", "off", then None, True, False


def test_no_budget_at_all_is_a_usage_error(capsys, prompts_file):
    """An empty --budgets ran nothing and wrote an empty summary (or failed with a traceback under --adaptive-size)."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--target", TARGET, "--prompts", str(prompts_file), "--budgets", " , ", "--adaptive-size", "on"])
    assert exit_.value.code == 2
    assert "argument --budgets: expected at least one integer" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "calibrate"])
def test_a_command_that_reads_prompts_refuses_to_run_without_them(capsys, command):
    """bench and calibrate have nothing to decode without --prompts: argparse says so in one line, before the target
    loads (left optional, calibrate loaded the target and then failed with a traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--target", TARGET, "--drafter", "some/folder"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"error: the following arguments are required: --prompts; see ddtree {command} "
                                       "--help\n")


@pytest.mark.parametrize("flag", ["--lookup", "--redraft"])
@pytest.mark.parametrize("command", ["generate", "bench", "calibrate"])
def test_a_negative_lookup_or_redraft_is_a_usage_error_before_anything_loads(capsys, monkeypatch, prompts_file,
                                                                            command, flag):
    """They were refused only after the target, the drafter and the corpus had loaded, behind a calibration note that
    told the user to run `ddtree calibrate` with the same refused value (found in a docs review)."""
    def no_loading(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr(ddtree.cli, "load_target", no_loading)
    where = ["--prompt", "Hi"] if command == "generate" else ["--prompts", str(prompts_file)]
    with pytest.raises(SystemExit) as exit_:
        main([command, "--target", TARGET, *where, flag, "-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"error: argument {flag}: expected a whole number >= 0 (0 = off), got -1; "
                                       f"see ddtree {command} --help\n")


@pytest.mark.parametrize("flag, expected", [("--seed", "an integer"), ("--lookup", "a whole number"),
                                            ("--redraft", "a whole number")])
def test_a_count_or_seed_that_is_not_a_number_says_what_was_expected(capsys, flag, expected):
    """Their type functions catch the int() ValueError to say what a flag takes: argparse's own line for an uncaught
    one names the function instead ("invalid _non_negative value: '2.5'"), and no test gave them a non-number
    (mutation review 32, A02, A03)."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", TARGET, "--prompt", "Hi", flag, "2.5"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"error: argument {flag}: expected {expected}, got '2.5'; "
                                       "see ddtree generate --help\n")


@pytest.mark.parametrize("args, message", [
    (["generate", "--method", "dflash", "--lookup", "4"], "--lookup shape the ddtree method's trees, and --method "
     "dflash runs no ddtree: give --method ddtree, or drop them"),
])
def test_a_lookup_that_cannot_run_is_one_line(capsys, prompts_file, args, message):
    command, *rest = args
    where = ["--prompts", str(prompts_file)] if command == "bench" else ["--prompt", "Hi"]
    assert message in _bad(capsys, command, "--target", TARGET, *where, *rest)


@pytest.mark.parametrize("args, message", [
    (["bench", "--adaptive-size", "on", "--static-cache", "on"], "saves nothing with the static cache"),
    (["generate", "--method", "dflash", "--adaptive-size", "on"], "--adaptive-size on shape the ddtree method's "
     "trees, and --method dflash runs no ddtree"),
])
def test_adaptive_size_that_cannot_run_is_one_line(capsys, prompts_file, args, message):
    command, *rest = args
    where = ["--prompts", str(prompts_file)] if command == "bench" else ["--prompt", "Hi"]
    assert message in _bad(capsys, command, "--target", TARGET, *where, *rest)


@pytest.mark.parametrize("command", ["generate", "bench", "calibrate"])
def test_a_budget_past_the_targets_context_is_one_line_before_anything_is_measured(capsys, tmp_path, prompts_file,
                                                                                    tiny_target, monkeypatch, command):
    """--adaptive-size measured verifies of budget + 1 rows first: --budget 100000000 ran for minutes at 10 GB."""
    monkeypatch.setattr("ddtree.sizing.TreeSizer.measure", lambda *a, **k: pytest.fail("measured before the check"))
    drafter = str(tiny_drafter_folder(tiny_target, tmp_path / "drafter")) if command == "calibrate" else "random"
    where = {"generate": ["--prompt", "Hi", "--budget", "4096"],
             "bench": ["--prompts", str(prompts_file), "--budgets", "16,4096"],
             "calibrate": ["--prompts", str(prompts_file), "--budgets", "4096"]}[command]
    where += ["--drafter", drafter]
    line = _bad(capsys, command, "--target", TARGET, "--adaptive-size", "on", *where)
    assert "budget 4096" in line and "context of 2048" in line
    # a budget that no method of the command uses is not refused
    code, _, _ = run_cli(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--method", "ar", "--budget", "4096",
                         "--max-new-tokens", "2")
    assert code == 0


def test_bench_without_ddtree_neither_measures_a_verify_cost_nor_checks_budgets(capsys, tmp_path, prompts_file,
                                                                               monkeypatch):
    """--adaptive-size auto measured verify costs and recorded settings.verify_cost_ms with no ddtree to size, and a
    budget that no method of the run uses (`ar`, `dflash` build no tree) was refused: budget 0 must be at least 1."""
    monkeypatch.setattr("ddtree.sizing.TreeSizer.measure", lambda *a, **k: pytest.fail("measured with no ddtree"))
    out = tmp_path / "results.json"
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file),
                           "--methods", "ar,dflash", "--budgets", "0", "--adaptive-size", "auto", "--max-new-tokens", "2",
                           "--limit", "1", "--dtype", "float32", "--out", str(out))
    assert code == 0, err
    assert "verify_cost_ms" not in json.loads(out.read_text())["settings"]
    code, _, err = run_cli(capsys, "generate", "--target", TARGET, "--method", "ar", "--budget", "0", "--prompt", "Hi",
                           "--max-new-tokens", "2", "--dtype", "float32")
    assert code == 0, err


def test_bench_adaptive_size_records_its_cost_and_sizes_within_the_budget(capsys, tmp_path, prompts_file, unwarmed):
    out = tmp_path / "adaptive.json"
    code, _, err = run_cli(
        capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file), "--methods",
        "ar,ddtree", "--budgets", "16", "--max-new-tokens", "12", "--dtype", "float32", "--adaptive-size", "on",
        "--out", str(out),
    )
    assert code == 0 and "[adaptive size] verify cost" in err
    results = json.loads(out.read_text())
    assert set(results["settings"]["verify_cost_ms"]) == {"fixed", "per_row"}
    assert 0 < results["summary"]["ddtree@16"]["tree_nodes"] <= 16
    ar = [prompt["methods"]["ar"]["new_tokens"] for prompt in results["prompts"]]
    assert [prompt["methods"]["ddtree@16"]["new_tokens"] for prompt in results["prompts"]] == ar


def test_bench_records_the_verify_cost_it_sized_with_under_its_own_names(capsys, tmp_path, prompts_file, monkeypatch):
    """Only the keys of settings.verify_cost_ms were checked: the fixed cost recorded as the per-row one (a 40 ms step
    read as 40 ms a row by whoever compares two machines' results) passed."""
    from ddtree.sizing import TreeSizer

    monkeypatch.setattr("ddtree.sizing.TreeSizer.measure", lambda *args, **kwargs: TreeSizer(fixed_ms=40.0, row_ms=1.1))
    out = tmp_path / "results.json"
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file),
                           "--methods", "ddtree", "--budgets", "4", "--adaptive-size", "on", "--max-new-tokens", "2",
                           "--limit", "1", "--dtype", "float32", "--out", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["settings"]["verify_cost_ms"] == {"fixed": 40.0, "per_row": 1.1}


def test_bench_with_several_budgets_measures_the_verify_cost_up_to_the_largest(capsys, sized_rows, tmp_path,
                                                                              prompts_file):
    """Budget 32 verifies 33 rows: a cost line timed on the smallest budget's 9 would be extrapolated past its knee,
    and the only adaptive-size bench test gave one budget (mutation review, C17). The measurement is stubbed."""
    code, _, err = run_cli(
        capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file), "--methods",
        "ddtree", "--budgets", "8,32", "--max-new-tokens", "2", "--limit", "1", "--dtype", "float32",
        "--packed-weights", "off", "--adaptive-size", "on", "--out", str(tmp_path / "results.json"),
    )
    assert code == 0, err
    assert sized_rows == [33] and "(measured up to 33 rows)" in err, err


def test_prompt_longer_than_context(capsys, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": "word " * 3000}) + "\n")
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(path), "--methods", "ar")
    assert "'long'" in line and "context is 2048" in line


@pytest.mark.parametrize("command, flags, file, message", [
    # Python reads a command-line argument's bytes that are not UTF-8 (b"caf\xe9", latin-1) as lone surrogates
    ("generate", ["--prompt", "caf\udce9"], None, "error: --prompt: not valid UTF-8 text (a lone surrogate, U+DCE9, "
     "at character 4: bytes in another encoding, or text cut mid-character); give it as UTF-8"),
    ("generate", ["--raw", "--prompt", "\udce9"], None, "error: --prompt: not valid UTF-8 text (a lone surrogate, "
     "U+DCE9, at character 1"),
    # and a JSON "\ud800" escape as one (text cut between the two halves of an emoji's UTF-16 pair)
    ("bench", ["--prompts", "{file}"], '{"prompt": "ok"}\n{"prompt": "a\\ud800b"}\n',
     'error: {file}:2: "prompt": not valid UTF-8 text (a lone surrogate, U+D800, at character 2'),
    ("bench", ["--prompts", "{file}"], '{"messages": [{"role": "user", "content": "\\ud83d"}]}\n',
     'error: {file}:1: "messages[0].content": not valid UTF-8 text (a lone surrogate, U+D83D, at character 1'),
    ("bench", ["--prompts", "{prompts}", "--methods", "ddtree", "--corpus", "{file}"],
     '{"messages": [{"role": "assistant", "content": "a\\udc80b"}]}\n',
     "error: --corpus {file}:1: an assistant turn: not valid UTF-8 text (a lone surrogate, U+DC80, at character 2"),
])
def test_text_that_is_not_valid_unicode_is_one_line_before_the_target_loads(capsys, tmp_path, prompts_file, monkeypatch,
                                                                           command, flags, file, message):
    """Found in a review: the tokenizer raised a TypeError traceback (status 1) naming neither the flag nor the line,
    for the prompts file and the corpus once the target had loaded."""
    import ddtree.cli

    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    path = tmp_path / "text.jsonl"
    if file is not None:
        path.write_text(file)
    fill = lambda text: text.format(file=path, prompts=prompts_file)  # noqa: E731
    line = _bad(capsys, command, "--target", TARGET, "--drafter", "random", *map(fill, flags))
    assert line.startswith(fill(message)), line


def test_generate_with_a_target_without_a_chat_template_is_one_line(capsys, tmp_path, tiny_target, monkeypatch):
    """A base model's folder: apply_chat_template raised a ValueError traceback (status 1); --raw decodes."""
    model, tokenizer = tiny_target
    monkeypatch.setattr(tokenizer, "chat_template", None)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    args = ("generate", "--target", str(tmp_path / "base"), "--method", "ar", "--prompt", "hi", "--max-new-tokens", "2",
            "--dtype", "float32")
    line = _bad(capsys, *args)
    assert line == ("error: --prompt: the target's tokenizer has no chat template to apply; give --raw to use the "
                    "prompt as raw text")
    code, _, err = run_cli(capsys, *args, "--raw")
    assert code == 0, err


@pytest.mark.parametrize("sliding", [dict(sliding_window=8), dict(layer_types=["full_attention", "sliding_attention"])])
def test_a_target_with_sliding_window_layers_is_refused_before_decoding(sliding):
    """Their caches keep only the window's keys, where the tree's masks and compaction assume every position."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from ddtree.decoding import generate

    sizes = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    if "layer_types" in sliding:
        target = Qwen3ForCausalLM(Qwen3Config(**sizes, use_sliding_window=True, sliding_window=8, **sliding))
    else:
        target = MistralForCausalLM(MistralConfig(**sizes, **sliding))
    with pytest.raises(DDTreeError, match="sliding-window attention"):
        generate(target, [1, 2, 3], "ar", None, 1, 4)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_a_longrope_target_is_refused_before_decoding(method):
    """Phi-3's longrope switches every row of a forward to its long frequencies once the forward's deepest position
    passes original_max_position_embeddings: a verify reaching past it committed other tokens than greedy decoding
    (here from position 11, the threshold being 24)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from ddtree.decoding import generate
    from tests.rigged import RiggedDrafter

    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=24,
                short_factor=[1.0] * 4, long_factor=[1.0 + 3 * i for i in range(4)])
    target = Phi3ForCausalLM(Phi3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                        original_max_position_embeddings=24, rope_parameters=rope, pad_token_id=0))
    drafter = RiggedDrafter(list(range(3, 40)), 32, block_size=16)
    with pytest.raises(DDTreeError, match=r"rope_parameters\['rope_type'\] 'longrope': a forward reaching past position 24"):
        generate(target.eval(), [1, 2, 3], method, drafter if method != "ar" else None, 8, 30)


def test_a_longrope_among_a_targets_per_layer_type_rope_parameters_is_refused_too():
    """transformers 5 gives a model of sliding and full layers one rope_parameters dict per layer type; a longrope in
    one of them rotates those layers' rows as a single one does."""
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig

    from ddtree.decoding import check_fixed_rope

    longrope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=24,
                    short_factor=[1.0] * 4, long_factor=[1.0 + 3 * i for i in range(4)])
    rope = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0), "full_attention": longrope}
    target = SimpleNamespace(config=Gemma3TextConfig(head_dim=8, rope_parameters=rope),
                             name_or_path_for_ddtree="per-layer")
    with pytest.raises(DDTreeError, match=r"^target 'per-layer' has rope_parameters\['rope_type'\] 'longrope': a "
                                          "forward reaching past position 24 "):
        check_fixed_rope(target)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_an_alibi_target_is_refused_before_decoding(method):
    """Found by a fuzzer (2026-12-02): ALiBi biases follow a key's cache slot, not its position, so an MPT target's
    verify rows off the first branch were scored otherwise and ddtree committed another token than greedy decoding."""
    from transformers import AutoModelForCausalLM, MptConfig

    from ddtree.decoding import generate
    from tests.rigged import RiggedDrafter

    config = MptConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=64, vocab_size=40)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    drafter = RiggedDrafter(list(range(3, 40)), 40, block_size=8)
    with pytest.raises(DDTreeError, match=r"'mpt'.*\(mpt\) uses ALiBi position biases"):
        generate(target, [1, 2, 3], method, drafter if method != "ar" else None, 8, 10)


@pytest.mark.parametrize("implementation, refused", [("flash_attention_2", True), ("flex_attention", True),
                                                     ("eager", False), ("sdpa", False)])
def test_a_target_whose_attention_kernel_ignores_the_tree_mask_is_refused_for_drafts(implementation, refused):
    """Flash attention reads an attention mask as padding: tree rows would see their siblings, and the walk would commit
    tokens the target never chose. Plain decoding passes no mask and is not refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ddtree.decoding import check_tree_attention, generate
    from tests.rigged import RiggedDrafter

    target = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)).eval()
    target.config._attn_implementation = implementation  # (set as loading would; flash-attn itself is not installed)
    drafter = RiggedDrafter(list(range(3, 20)), 32, block_size=4)
    if refused:
        with pytest.raises(DDTreeError, match=f"attends with '{implementation}'; a verify's ancestor-only mask"):
            generate(target, [1, 2, 3], "ddtree", drafter, 4, 4)
        check_tree_attention(target, "ar")  # (decoding with that kernel needs it installed: not here)
    else:
        result = generate(target, [1, 2, 3], "ddtree", drafter, 4, 4)
        assert len(result.new_tokens) == 4


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


def test_a_prompts_folder_is_named_a_folder(capsys, tmp_path):
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(tmp_path), "--methods", "ar")
    assert line == f"error: prompts file {tmp_path} is a folder; give a .jsonl file with one prompt per line"


def test_a_drafter_folder_whose_config_json_is_a_folder_is_refused(capsys, tmp_path):
    """A config.json that is a folder is no config: accepted by the check the console script runs before torch loads,
    it was refused only once torch and transformers had (about 10 s), as a file that could not be read."""
    (tmp_path / "config.json").mkdir()
    line = _bad(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--method", "ar", "--drafter", str(tmp_path))
    assert line == f"error: drafter {str(tmp_path)!r} is not a folder with a config.json"


@pytest.fixture
def pipe():
    """pipe(text): a path to a pipe that holds `text` and can be read once, as the shell's `<(...)` and a piped
    /dev/stdin are."""
    ends = []

    def make(text: str) -> str:
        read, write = os.pipe()
        ends.append(read)
        os.write(write, text.encode())  # (a few hundred bytes: within the pipe's buffer)
        os.close(write)
        return f"/dev/fd/{read}"

    yield make
    for end in ends:
        os.close(end)


def test_prompts_and_a_corpus_from_a_pipe_are_read_once_and_decoded(capsys, tmp_path, prompts_file, pipe):
    """They were refused as files that do not exist (found in a review); accepted but read twice, once to check them
    before the target loads and again to decode, a pipe had nothing left the second time."""
    reply = "Here is an example of how you can use a list in Python to hold your numbers."
    conversations = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]})
    prompts, corpus, out = pipe(prompts_file.read_text()), pipe(conversations + "\n"), tmp_path / "results.json"
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--prompts", prompts, "--corpus", corpus, "--methods",
                           "ar,ddtree", "--budgets", "4", "--max-new-tokens", "2", "--out", str(out))
    assert code == 0, err
    results = json.loads(out.read_text())
    assert [prompt["id"] for prompt in results["prompts"]] == ["chat", "2"]
    assert results["settings"]["ddtree_resolved"]["corpus"] == corpus
    assert re.search(rf"\[corpus\] [1-9]\d* runs of 3 tokens from {corpus} ", err), err
    # a calibration file is read when checked and again when used: a pipe is refused as what it is, not as missing
    line = _bad(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--calibration", pipe("{}"))
    assert line.startswith("error: --calibration /dev/fd/") and ": not a regular file; give a file" in line


def test_console_script_exit_code(capsys, tmp_path, monkeypatch):
    """`python -m ddtree.cli` exits with main's status. Run in this process as -m runs it (a fresh interpreter only
    loaded torch and transformers again, 8 s on a 2-core AVX2 EPYC); the `python -m ddtree` processes of the broken
    pipe tests hold the console script's own exit."""
    missing = tmp_path / "missing.jsonl"
    monkeypatch.setattr(sys, "argv", ["ddtree.cli", "bench", "--target", TARGET, "--prompts", str(missing)])
    with warnings.catch_warnings():  # ddtree.cli is imported here already: run again as __main__, as -m would
        warnings.filterwarnings("ignore", message="'ddtree.cli' found in sys.modules", category=RuntimeWarning)
        with pytest.raises(SystemExit) as exited:
            runpy.run_module("ddtree.cli", run_name="__main__")
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines()[-1] == f"error: prompts file {missing} does not exist"
    assert "Traceback" not in stderr


def test_the_console_script_answers_help_a_bad_flag_and_a_wrong_path_before_torch_loads():
    """`ddtree bench --help` and a bad flag waited about 8 s for torch and transformers (2-core EPYC), a mistyped
    --drafter or --prompts about 10 s; the console script (ddtree/__main__.py) parses and checks those paths first and
    loads them only to run the command."""
    probe = ("import sys\nfrom ddtree.__main__ import main\n"
             "try:\n    status = main(sys.argv[1:])\nexcept SystemExit as exit:\n    status = exit.code\n"
             "print('status', status, 'torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n")
    bad_budgets = "error: argument --budgets: expected comma-separated integers, got 'x'; see ddtree bench --help"
    for argv, status, said in ((["bench", "--help"], 0, "--budgets BUDGETS"),
                               (["bench", "--prompts", "p.jsonl", "--budgets", "x"], 2, bad_budgets),
                               ([], 2, "error: the following arguments are required: command"),
                               (["bench", "--drafter", "no-such-drafter", "--prompts", "data/eval_prompts.jsonl"], 2,
                                "error: drafter 'no-such-drafter' is not a folder with a config.json"),
                               (["generate", "--method", "dflash", "--drafter", "tests", "--prompt", "Hi"], 2,
                                "error: drafter 'tests' is not a folder with a config.json"),
                               (["bench", "--methods", "ar", "--prompts", "no-such.jsonl"], 2,
                                "error: prompts file no-such.jsonl does not exist")):
        proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).parents[2])
        assert proc.stderr.strip().splitlines()[-1] == f"status {status} no torch", proc.stderr
        assert said in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_console_script_exits_2_on_an_error_the_command_reports(capsys, tmp_path):
    """`ddtree` and `python -m ddtree` return what the command returns: an error found once torch has loaded (past the
    console script's own checks) exiting 0 would pass a script's `&& next step` and a CI step with no results."""
    from ddtree.__main__ import main as console_script

    missing = tmp_path / "none.json"
    assert console_script(["generate", "--target", TARGET, "--prompt", "Hi", "--calibration", str(missing)]) == 2
    assert f"error: --calibration {missing}: no such file" in capsys.readouterr().err


def run_with_stdout_closed(argv: list[str]) -> subprocess.CompletedProcess:
    """Run `argv` with its stdout a pipe whose reader has gone away (`... | head -c 5` once head has its bytes)."""
    # buffered as a user's stdout is: PYTHONUNBUFFERED (set by some CI and IDEs) writes each print at once, and
    # what would be left in the buffer at the end is never tested
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2], env=env)
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(argv, proc.returncode, None, stderr)


def reraised_from_a_worker(error: Exception, handled: Exception | None = None, worker: int = 0) -> Exception:
    """`error` as a DataLoader re-raises it in the main process: torch's own wrapper, as worker `worker` sends it back."""
    from torch._utils import ExceptionWrapper

    handled = handled or KeyError("shard")
    try:
        try:
            raise handled  # an error being handled when it was raised: its traceback comes first
        except type(handled):
            raise error
    except type(error):
        wrapped = ExceptionWrapper(where=f"in DataLoader worker process {worker}")
    with pytest.raises(type(error)) as reraised:
        wrapped.reraise()
    return reraised.value


def test_a_user_error_raised_in_a_data_loader_worker_is_its_own_line_not_torchs_heading():
    """torch re-raises a worker's error as "Caught DDTreeError in DataLoader worker process 0." with the worker's
    traceback after it: the line printed was that heading alone (found in a review)."""
    error = reraised_from_a_worker(DDTreeError("store s: shard-00001 is of another build; start the run again"))
    assert str(error).startswith("Caught DDTreeError in DataLoader worker process 0.\n")
    assert error_line(error) == "store s: shard-00001 is of another build; start the run again"
    assert error_line(reraised_from_a_worker(DDTreeError("first line\nsecond line"))) == "first line"
    # from any worker, not only the first: the heading's number is the worker's (mutation review 32, E15)
    assert error_line(reraised_from_a_worker(DDTreeError("store s: unreadable"), worker=11)) == "store s: unreadable"
    # a DDTreeError raised while another was handled: the raised one's line, which the traceback names last
    chained = reraised_from_a_worker(DDTreeError("store s: shard-00001 is of another build; start the run again"),
                                     handled=DDTreeError("shard-00001: unreadable (a retry reads it again)"))
    assert error_line(chained) == "store s: shard-00001 is of another build; start the run again"
    # other errors are cut to their first line as before, a heading like torch's included
    assert error_line(DDTreeError("Caught DDTreeError somewhere.\nmore")) == "Caught DDTreeError somewhere."


def test_a_user_errors_line_is_never_blank():
    """run_cli prints `error: ` and this line: an error raised without a message is named by its type, and one whose
    message starts with a line break is its first line with words, where either printed a bare "error: " (mutation
    review 32, E01, E02)."""
    assert error_line(DDTreeError()) == "DDTreeError"
    assert error_line(DDTreeError("\n  prompts file p.jsonl is empty\nline 2")) == "prompts file p.jsonl is empty"


def test_a_user_error_with_a_multi_line_message_is_printed_as_its_first_line(capsys):
    """run_cli prints error_line's line, not the message: one raised in a DataLoader worker is torch's heading and the
    worker's whole traceback. No test ran such an error through run_cli, so printing the message itself passed
    (mutation review 32, E09)."""
    from ddtree import errors

    def main(argv):
        raise reraised_from_a_worker(DDTreeError("store s: shard-00001 is of another build; start the run again"))

    assert errors.run_cli(main, []) == 2
    assert capsys.readouterr().err == "error: store s: shard-00001 is of another build; start the run again\n"


@pytest.mark.parametrize("returned, status", [(None, 0), (0, 0), (3, 3)])
def test_a_command_that_returns_nothing_exits_0_and_a_status_it_returns_is_kept(returned, status):
    """A main that ends without `return` has succeeded: a run_cli that read None as a failure failed every such
    command's `&& next step`, and one that dropped a returned status passed a failure on as success."""
    assert ddtree.errors.run_cli(lambda argv: returned, []) == status


@pytest.mark.parametrize("raised, status, said", [(KeyboardInterrupt, 130, "interrupted"),
                                                  ("Terminated", 143, "stopped by SIGTERM")])
def test_an_interrupted_or_terminated_command_exits_as_a_shell_reports_the_signal(capsys, raised, status, said):
    """130 for Ctrl-C and 143 for SIGTERM, the statuses a scheduler or a script reads to tell a stop from a failure
    (1) or bad input (2). The tests that read them ran training or ablate, which stop their own way, and a run_cli
    that returned 1 for Ctrl-C passed (mutation review 32, E05)."""
    from ddtree import errors

    def main(argv):
        raise getattr(errors, raised) if isinstance(raised, str) else raised

    assert errors.run_cli(main, []) == status
    assert capsys.readouterr().err == f"{said}\n"


def test_a_sigterm_passes_a_commands_except_exception_on_its_way_out(capsys):
    """Commands catch Exception around work whose failure is that work's own (ablate's variant, a Hub upload): the
    Terminated a SIGTERM raises there must pass them, as KeyboardInterrupt does, or the command would record a failure
    and go on. No test raised one through such a block (mutation review 32, E07)."""
    import signal
    import time

    from ddtree import errors

    def main(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises here at the latest
        except Exception:
            return 0

    assert errors.run_cli(main, []) == 143
    assert capsys.readouterr().err == "stopped by SIGTERM\n"


def test_a_list_of_names_in_a_one_line_error_is_the_first_and_how_many_more():
    """The drafter's and the checkpoint's weight checks name a missing or unused weight this way: the count is of the
    others, so "and 2 more" means three in all (a missing layer is all of its weights, in one line)."""
    assert first_and_count(["fc.weight"]) == "fc.weight"
    assert first_and_count(["fc.weight", "norm.weight", "layers.0.mlp.up_proj.weight"]) == "fc.weight and 2 more"


@pytest.mark.parametrize("flush, lines", [(True, 100), (False, 100), (False, 1)])
def test_a_command_whose_stdout_is_closed_exits_141_without_a_traceback(flush, lines):
    """Written while it runs (a flush each time, as generate streams) or left in the buffer until the end (as bench's
    table): `... | head` ended in a BrokenPipeError traceback with status 1 (found in a review). A short output stays
    in the buffer until main returns: only run_cli's own flush writes it in time, where Python's at exit said
    "Exception ignored ... BrokenPipeError" with status 120."""
    probe = ("import sys\nfrom ddtree.errors import run_cli\n"
             f"def main(argv):\n    for _ in range({lines}):\n        print('x' * 1000, flush={flush})\n"
             "sys.exit(run_cli(main))\n")
    proc = run_with_stdout_closed([sys.executable, "-c", probe])
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback(tmp_path):
    """A child process or socket that dies is a failure, not `... | head`: it was taken for a closed stdout and ended
    with status 141 and no word (found in a review)."""
    probe = ("import subprocess, sys\nfrom ddtree.errors import run_cli\n"
             "def main(argv):\n    child = subprocess.Popen(['true'], stdin=subprocess.PIPE)\n    child.wait()\n"
             "    child.stdin.write(b'x' * 100000)\n    child.stdin.flush()\n"
             "sys.exit(run_cli(main))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "BrokenPipeError" in proc.stderr, (proc.returncode, proc.stderr)


def test_a_broken_pipe_under_a_stdout_without_a_file_descriptor_keeps_its_traceback(capsys):
    """A captured stdout (a test's, an embedding program's StringIO) cannot be a pipe whose reader left: the error is
    another pipe's, raised as it was."""
    def main(argv):
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        ddtree.errors.run_cli(main, [])
    assert capsys.readouterr().err == ""


def test_generate_piped_into_a_reader_that_stops_early_exits_141_without_a_traceback(tmp_path):
    proc = run_with_stdout_closed([sys.executable, "-m", "ddtree", "generate", "--target", TARGET, "--method", "ar",
                                   "--packed-weights", "off", "--raw", "--prompt", "The quick brown fox",
                                   "--max-new-tokens", "40"])
    assert proc.returncode == 141 and "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


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
    assert "[adaptive size] verify cost" in err  # generate sizes its trees by default on a CPU (the dynamic cache)
    code, _, err = run_cli(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--max-new-tokens", "5",
                           "--static-cache", "on")
    assert code == 0 and "[adaptive size]" not in err  # ...and not on the static cache, where rows cost the same


def test_generate_hands_every_decoding_flag_to_the_decoding(capsys, monkeypatch, tiny_target):
    """Decoding is lossless, so a flag parsed and then not handed on printed the same reply: --budget 8 decoded at 32,
    --lookup 3 at the drafter's own, a sizer measured and never used, --top-k dropped from the sampling, another seed;
    no test saw any of them (mutation review, gaps 2, 3 and 5). What the command hands to decoding is recorded here."""
    import inspect

    from ddtree.decoding import Sampling
    from ddtree.sizing import TreeSizer
    from ddtree.targets import stop_token_ids

    handed, real = [], ddtree.cli.generate

    def spy(*args, **kwargs):
        handed.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        return real(*args, **kwargs)

    monkeypatch.setattr(ddtree.cli, "generate", spy)
    code, _, err = run_cli(capsys, "generate", "--target", TARGET, "--drafter", "random", "--prompt", "Hi", "--no-stream",
                           "--dtype", "float32", "--packed-weights", "off", "--max-new-tokens", "3", "--budget", "8",
                           "--lookup", "3", "--redraft", "2", "--adaptive-size", "on", "--static-cache", "off",
                           "--corpus", "none", "--temperature", "1", "--top-p", "0.9", "--top-k", "5", "--seed", "7",
                           "--online-calibration")
    assert code == 0, err
    (given,) = handed
    assert (given["method"], given["budget"], given["max_new_tokens"]) == ("ddtree", 8, 3)
    assert list(given["stop_ids"]) == stop_token_ids(*tiny_target) != []
    assert given["sampling"] == Sampling(1.0, 0.9, 5)
    assert given["generator"].initial_seed() == 7
    assert given["static"] is False
    assert isinstance(given["online"], OnlineCalibration) and not given["online"].frozen  # learning
    assert (given["lookup"], given["redraft"], given["corpus"]) == (3, 2, False)
    assert isinstance(given["sizer"], TreeSizer)  # the one measured and said on stderr
    assert "[adaptive size] verify cost" in err and given.get("on_tokens") is None  # --no-stream


def test_generate_with_a_random_drafter_runs_on_the_built_in_targets_own_folder(capsys):
    """The converted folder (the README's "plain safetensors folder") has no spare embedding row: only the target's
    name found its MASK token, and the folder was refused with a setting ddtree has no flag for."""
    folder = str(resolve_target(TARGET))
    code, _, err = run_cli(capsys, "generate", "--target", folder, "--drafter", "random", "--prompt", "Hi",
                           "--max-new-tokens", "4", "--adaptive-size", "off", "--dtype", "float32")
    assert code == 0, err
    assert re.search(r"^\[ddtree\] 4 tokens, tau \d", err, re.M), err


def test_generate_streams_the_reply_it_prints_whole_with_no_stream(capsys, sized_rows):
    code, streamed, _ = run_cli(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--max-new-tokens", "24")
    assert code == 0
    code, whole, _ = run_cli(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--max-new-tokens", "24",
                             "--no-stream")
    assert code == 0 and streamed == whole and len(whole) > 1  # (the tiny target says newlines)


def test_a_reply_ending_at_the_end_of_turn_token_prints_without_it_streamed_or_not(capsys, monkeypatch, tiny_target):
    """The tiny target never says a special token, so --no-stream could print a chat reply's closing <|im_end|> into
    `> reply.txt` with every test passing (mutation review, C15). Its replies are made to end at one here."""
    _, tokenizer = tiny_target
    real = ddtree.cli.generate

    def ending_at_end_of_turn(*args, on_tokens=None, **kwargs):
        result = real(*args, on_tokens=on_tokens, **kwargs)
        result.new_tokens.append(tokenizer.eos_token_id)
        if on_tokens is not None:
            on_tokens([tokenizer.eos_token_id])
        return result

    monkeypatch.setattr(ddtree.cli, "generate", ending_at_end_of_turn)
    args = ("generate", "--target", TARGET, "--method", "ar", "--prompt", "Hi", "--max-new-tokens", "4")
    code, streamed, _ = run_cli(capsys, *args)
    assert code == 0
    code, whole, err = run_cli(capsys, *args, "--no-stream")
    assert code == 0 and "[ar] 5 tokens" in err, err  # the end-of-turn token was in the reply
    assert whole == streamed and tokenizer.eos_token not in whole


def test_the_streamed_reply_never_shows_half_a_character_and_adds_up_to_its_decode(tiny_target):
    _, tokenizer = tiny_target
    ids = tokenizer("héllo 😀 wörld, it's fine.", add_special_tokens=False)["input_ids"]
    out = io.StringIO()
    stream = TextStream(tokenizer, out)
    for token in ids:  # the emoji comes in two byte-level tokens: none of its first's bytes show
        stream([token])
        assert "\ufffd" not in out.getvalue()
        assert tokenizer.decode(ids).startswith(out.getvalue())
    stream.finish()
    assert out.getvalue() == "héllo 😀 wörld, it's fine.\n"

    rng = random.Random(0)  # random tokens: broken characters whose replacement stays, special tokens skipped
    ids = [rng.randrange(len(tokenizer)) for _ in range(400)]
    out, start = io.StringIO(), 0
    stream = TextStream(tokenizer, out)
    while start < len(ids):
        end = start + rng.randint(1, 5)  # a round's worth
        stream(ids[start:end])
        start = end
    stream.finish()
    assert out.getvalue() == tokenizer.decode(ids, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("sent, line", [("SIGINT", "interrupted"), ("SIGTERM", "stopped by SIGTERM")])
def test_a_reply_stopped_mid_stream_ends_its_line_before_the_stops_line(capsys, monkeypatch, sent, line,
                                                                        python_sigint):
    """Found in a review: Ctrl-C during `ddtree generate` glued the stop's one line to the reply streamed so far, on a
    terminal that shows both (`... falsely falsely^Cinterrupted`), as it once was to bench's open progress bar."""
    import signal

    streamed = TextStream.__call__

    def signalled(self, tokens):  # a few tokens into the reply
        streamed(self, tokens)
        if len(self.ids) == 3:
            os.kill(os.getpid(), getattr(signal, sent))

    monkeypatch.setattr(TextStream, "__call__", signalled)
    code, out, err = run_cli(capsys, "generate", "--target", TARGET, "--method", "ar", "--raw", "--prompt", "Hi",
                             "--max-new-tokens", "40", "--dtype", "float32")
    assert code == 128 + getattr(signal, sent) and err.endswith(f"\n{line}\n"), err[-300:]
    assert out.strip() and out.endswith("\n") and out.count("\n") == 1, repr(out)


class ByteFallback:
    """A byte-fallback tokenizer's decode (Llama 2, Mistral, Gemma): a run of <0xXX> byte pieces decodes as UTF-8, or,
    where any of it is not, as one U+FFFD per byte, so an emoji already whole turns into four of them when the run
    goes on with half of the next."""

    PIECES = ["Hi", " there", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x0A>"]

    def get_vocab(self):
        return {piece: index for index, piece in enumerate(self.PIECES)}

    def decode(self, ids, skip_special_tokens=False):
        text, run = "", b""
        for piece in [self.PIECES[i] for i in ids] + [""]:
            if piece.startswith("<0x"):
                run += bytes([int(piece[3:5], 16)])
                continue
            try:
                text += run.decode("utf-8")
            except UnicodeDecodeError:
                text += "\ufffd" * len(run)
            text, run = text + piece, b""
        return text


def test_a_byte_fallback_tokenizers_byte_run_is_written_once_it_ends():
    out = io.StringIO()
    stream = TextStream(ByteFallback(), out)
    emoji = [2, 3, 4, 5]
    for tokens in ([0], emoji, [2, 3]):  # the reply's last round cut two bytes into a second emoji
        stream(tokens)
    assert out.getvalue() == "Hi"  # the run has not ended: it may yet decode otherwise
    stream.finish()
    assert out.getvalue() == ByteFallback().decode([0, *emoji, 2, 3]) + "\n" == "Hi" + "\ufffd" * 6 + "\n"
    out = io.StringIO()
    stream = TextStream(ByteFallback(), out)
    for tokens in ([0], emoji, [1]):
        stream(tokens)
    assert out.getvalue() == "Hi😀 there"
    # a round of one byte token, whole by itself, waits too: the run it starts may end cut (mutation review 42, c01)
    out = io.StringIO()
    stream = TextStream(ByteFallback(), out)
    for tokens in ([0], [6], [2, 3]):
        stream(tokens)
    assert out.getvalue() == "Hi"
    stream.finish()
    assert out.getvalue() == "Hi" + "\ufffd" * 3 + "\n"


def test_a_tokenizer_whose_decode_rewrites_what_was_streamed_gets_its_reply_printed_again(capsys):
    class Rewriting:
        def decode(self, ids, skip_special_tokens=False):
            return ["", "a b", "a, b c"][len(ids)]

    out = io.StringIO()
    stream = TextStream(Rewriting(), out)
    stream([1])
    stream([2])  # not written: it does not continue what was
    stream.finish()
    assert out.getvalue() == "a b\na, b c\n"
    assert "the streamed reply is not its decode" in capsys.readouterr().err


def test_generate_says_when_the_targets_context_cut_the_reply_short(capsys, tiny_target):
    """A prompt near the context's end got fewer tokens than --max-new-tokens, and nothing said why."""
    _, tokenizer = tiny_target
    prompt = tokenizer.decode(tokenizer("word " * 4000, add_special_tokens=False)["input_ids"][:2040])
    length = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert 2030 < length < 2048
    code, _, err = run_cli(capsys, "generate", "--target", TARGET, "--method", "ar", "--raw", "--prompt", prompt,
                           "--max-new-tokens", "20")
    assert code == 0
    assert f"[ar] {2048 - length} tokens, tau" in err
    assert (f"[ar] stopped at the target's context of 2048 tokens (the prompt holds {length}), {20 - 2048 + length} "
            "short of --max-new-tokens 20: give a shorter prompt for a longer reply") in err
    code, _, err = run_cli(capsys, "generate", "--target", TARGET, "--method", "ar", "--prompt", "Hi",
                           "--max-new-tokens", "5")
    assert code == 0 and "stopped at the target's context" not in err


def tiny_drafter_folder(tiny_target, folder):
    target, tokenizer = tiny_target
    DFlashDraftModel(build_drafter_config(target, tokenizer, TARGET, num_layers=1)).save_pretrained(folder)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("command", ["bench", "generate"])
def test_a_config_that_does_not_match_its_weights(capsys, tmp_path, tiny_target, prompts_file, command):
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    edit_config(folder, intermediate_size=config["intermediate_size"] + 8)
    args = ["--prompts", str(prompts_file), "--methods", "dflash"] if command == "bench" else ["--prompt", "Hi"]
    line = _bad(capsys, command, "--target", TARGET, "--drafter", str(folder), "--dtype", "float32", *args)
    assert f"drafter {folder}: config.json makes weight layers.0.mlp" in line
    assert "model.safetensors holds" in line and "restore it, or export the drafter again" in line


def test_a_config_with_more_or_fewer_layers_than_its_weights(capsys, tmp_path, tiny_target, prompts_file):
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    bench = ["bench", "--target", TARGET, "--drafter", str(folder), "--prompts", str(prompts_file), "--methods", "dflash"]
    edit_config(folder, num_hidden_layers=2)  # transformers checks this one against layer_types
    line = _bad(capsys, *bench)
    assert f"drafter {folder}/config.json could not be read: `num_hidden_layers` (2) must be equal" in line
    edit_config(folder, num_hidden_layers=2, layer_types=["full_attention"] * 2)  # layer 1 would start random
    assert "config.json needs weight layers.1." in _bad(capsys, *bench)
    edit_config(folder, num_hidden_layers=0, layer_types=[])  # ... or layer 0 be silently dropped
    assert "model.safetensors holds weight layers.0." in _bad(capsys, *bench)


def test_a_drafter_folder_without_weights(capsys, tmp_path, tiny_target, prompts_file):
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    (folder / "model.safetensors").unlink()
    line = _bad(capsys, "bench", "--target", TARGET, "--drafter", str(folder), "--prompts", str(prompts_file))
    assert line == f"error: drafter {folder} has a config.json but no model.safetensors; " \
                   "copy the weights in beside it, or export the drafter again"


@pytest.mark.parametrize("file, content, problem", [
    ("config.json", '{"block_size": 4,', "config.json could not be read: "),
    ("config.json", b'{"name": "caf\xe9"}', "config.json could not be read: "),  # latin-1, not UTF-8
    ("model.safetensors.index.json", '{"weight_map": ', "model.safetensors.index.json could not be read ("),
    ("model.safetensors.index.json", '{"weight_map": [1]}', "model.safetensors.index.json could not be read ("),
    ("model.safetensors.index.json", '{"metadata": {}}', "model.safetensors.index.json could not be read ("),
])
def test_a_drafter_file_that_cannot_be_read_is_one_line(capsys, tmp_path, tiny_target, prompts_file, file, content,
                                                         problem):
    """A config.json cut off or not UTF-8, or a shard index (weights too large for one file) that is not one."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    if file != "config.json":
        (folder / "model.safetensors").unlink()  # the shards the index names are read instead
    (folder / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _bad(capsys, "bench", "--target", TARGET, "--drafter", str(folder), "--prompts", str(prompts_file),
                "--methods", "dflash", "--dtype", "float32")
    assert line.startswith(f"error: drafter {folder}/{problem}")
    if file != "config.json":
        assert line.endswith("; export the drafter again")


def test_bench_records_which_prompts_and_drafter_weights_its_paths_held(capsys, tmp_path, tiny_target, prompts_file):
    """results.json held the --prompts and --drafter paths alone: a prompts file edited in place (or another fed through
    the same pipe) and a drafter folder retrained in place gave settings that differed in --out alone."""
    from ddtree.bench import load_prompts, prompts_fingerprint
    torch.manual_seed(0)
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")

    def bench(drafter: str) -> dict:
        out = tmp_path / "results.json"
        assert run_cli(capsys, "bench", "--target", TARGET, "--drafter", drafter, "--prompts", str(prompts_file),
                       "--methods", "dflash", "--max-new-tokens", "2", "--dtype", "float32", "--packed-weights", "off",
                       "--out", str(out), "--overwrite")[0] == 0
        return json.loads(out.read_text())["settings"]

    first = bench(str(folder))
    assert first["prompts_sha256"] == prompts_fingerprint(load_prompts(prompts_file, tiny_target[1]))
    assert first["drafter_weights"] == weights_fingerprint(folder) is not None
    assert bench(str(folder)) == first  # the same inputs: the same settings
    prompts_file.write_text(json.dumps({"id": "chat", "prompt": "Name two odd numbers."}) + "\n")
    torch.manual_seed(1)
    tiny_drafter_folder(tiny_target, folder)  # the same names and shapes, other values
    second = bench(str(folder))
    assert second["prompts_sha256"] != first["prompts_sha256"] and second["drafter_weights"] != first["drafter_weights"]
    assert bench("random")["drafter_weights"] == "random, seed 0"  # built from the seed, not read from a folder


def test_bench_grafts_the_corpus_a_drafter_folder_ships_unless_told_none(
        capsys, tmp_path, tiny_target, prompts_file, unwarmed):
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    # 12 tokens: the grafted replies still lift tau by more than 1 over the untrained drafter's (24 decoded its
    # one-token rounds twice as often: about 1 s more on a 2-core AVX2 EPYC); packing, which none of it reads, off
    bench = ["bench", "--target", TARGET, "--drafter", str(folder), "--prompts", str(prompts_file), "--budgets", "8",
             "--max-new-tokens", "12", "--dtype", "float32", "--packed-weights", "off"]

    def run(*extra):
        assert run_cli(capsys, *bench, "--out", str(tmp_path / "results.json"), "--overwrite", *extra)[0] == 0
        return json.loads((tmp_path / "results.json").read_text())

    greedy = [prompt["methods"]["ar"]["new_tokens"] for prompt in run("--methods", "ar")["prompts"]]
    write_replies(folder / CORPUS_FILE, greedy, tiny_target[1])  # what the target says: the corpus lookup follows it
    shipped, none = run("--methods", "ddtree"), run("--methods", "ddtree", "--corpus", "none")
    assert shipped["settings"]["ddtree_resolved"]["corpus"] == "the drafter's corpus.safetensors"
    assert none["settings"]["ddtree_resolved"]["corpus"] is None
    for results in (shipped, none):
        assert [prompt["methods"]["ddtree@8"]["new_tokens"] for prompt in results["prompts"]] == greedy
    assert shipped["summary"]["ddtree@8"]["tau"] > none["summary"]["ddtree@8"]["tau"] + 1
    # The same file named with --corpus (from another folder, say): read as the token ids it holds. It was refused as
    # a JSONL that is not UTF-8, after the target had loaded.
    given = run("--methods", "ddtree", "--corpus", str(folder / CORPUS_FILE))
    assert given["summary"]["ddtree@8"]["tau"] == shipped["summary"]["ddtree@8"]["tau"]
    (tmp_path / "cut.safetensors").write_bytes((folder / CORPUS_FILE).read_bytes()[:-3])
    assert "is unreadable or not a corpus" in _bad(capsys, *bench, "--methods", "ddtree", "--corpus",
                                                   str(tmp_path / "cut.safetensors"))


def test_a_corpus_of_more_ids_than_a_vocabulary_is_one_line_naming_it(capsys, tmp_path, tiny_target, sized_rows):
    """Past 2^21 distinct ids a run of 3 no longer packs into one int64 key: a ValueError traceback, from --corpus and
    from a drafter folder's own file alike (found in a review). One line naming the file and the way out."""
    from safetensors.torch import save_file

    count = 2 ** 21 + 5
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    save_file({"tokens": torch.arange(count, dtype=torch.int32), "offsets": torch.tensor([0, count])},
              folder / CORPUS_FILE)
    generate = ["generate", "--target", TARGET, "--prompt", "Hi", "--max-new-tokens", "2"]
    given, shipped = ["--drafter", "random", "--corpus", str(folder / CORPUS_FILE)], ["--drafter", str(folder)]
    for flags, named in ((given, f"--corpus {folder / CORPUS_FILE}"), (shipped, f"the corpus {folder / CORPUS_FILE}")):
        line = _bad(capsys, *generate, *flags)
        assert line == (f"error: {named} holds {count} distinct token ids (0 to {count - 1}), too many to index its runs "
                        "of 3 tokens and more than a target's vocabulary: they are not token ids of a target's replies "
                        "(another writer's, or a corrupt file); give a corpus of this target's replies, or decode "
                        "without it (ddtree: --corpus none)"), line
    assert run_cli(capsys, *generate, "--drafter", str(folder), "--corpus", "none")[0] == 0  # the way out it names


def test_a_corpus_with_no_run_to_look_up_is_one_line(capsys, tmp_path, tiny_target, sized_rows):
    """Only a JSONL without an assistant turn was refused: empty turns, a corpus.safetensors written from no replies or
    from replies of 3 tokens or fewer decoded with "[corpus] 0 runs", and bench recorded the file as the corpus it ran
    with (found in a review)."""
    tokenizer = tiny_target[1]
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    empty_turns = tmp_path / "empty.jsonl"
    empty_turns.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                              {"role": "assistant", "content": ""}]}) for _ in range(2)))
    write_replies(tmp_path / "none.safetensors", [], tokenizer)
    write_replies(tmp_path / "short.safetensors", [[5, 6, 7], [8], []], tokenizer)
    generate = ["generate", "--target", TARGET, "--prompt", "Hi", "--max-new-tokens", "2"]
    for path in (empty_turns, tmp_path / "none.safetensors", tmp_path / "short.safetensors"):
        line = _bad(capsys, *generate, "--drafter", "random", "--corpus", str(path))
        assert line == (f"error: --corpus {path}: no reply in it holds more than 3 tokens, so there is nothing to look "
                        "up; give the target's replies, or decode without it (ddtree: --corpus none)"), line
    write_replies(folder / CORPUS_FILE, [[5, 6, 7]], tokenizer)
    line = _bad(capsys, *generate, "--drafter", str(folder))
    assert line.startswith(f"error: the corpus {folder / CORPUS_FILE}: no reply in it holds more than 3 tokens"), line
    assert run_cli(capsys, *generate, "--drafter", str(folder), "--corpus", "none")[0] == 0
    write_replies(folder / CORPUS_FILE, [[5, 6, 7, 8]], tokenizer)  # one run: something to look up
    code, _, err = run_cli(capsys, *generate, "--drafter", str(folder))
    assert code == 0 and "[corpus] the drafter's corpus.safetensors: 1 runs of 3 tokens" in err, err


def test_a_chain_alone_leaves_the_drafters_corpus_unread(capsys, tmp_path, tiny_target, prompts_file, unwarmed):
    """The chain grafts no corpus, yet `generate --method dflash` and `bench --methods dflash` indexed the drafter's
    corpus.safetensors, said "[corpus] the drafter's corpus.safetensors: N runs" as if they decoded with it, and refused
    a corrupt one they never read (found in a review). ddtree still reads it (test_a_corpus_with_no_run_to_look_up)."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    (folder / CORPUS_FILE).write_bytes(b"not a safetensors file")
    for command in (["generate", "--prompt", "Hi", "--method", "dflash"],
                    ["bench", "--prompts", str(prompts_file), "--methods", "ar,dflash"]):
        code, _, err = run_cli(capsys, *command, "--target", TARGET, "--drafter", str(folder), "--max-new-tokens", "2",
                               "--dtype", "float32", "--packed-weights", "off")
        assert code == 0 and "corpus" not in err, err


def test_a_corpus_another_tokenizer_wrote_is_one_line(capsys, tmp_path, tiny_target, prompts_file, sized_rows):
    """A corpus of byte ids (all below the target's vocabulary) was grafted as the target's tokens without a word, while
    docs/decoding.md said another tokenizer's are one line (found in a review): the file records its tokenizer. Each
    command refuses it before it measures the verify cost for --adaptive-size (1.6 s on a 2-core AVX2 EPYC, which
    generate, bench and calibrate spent before the corpus was checked)."""
    from types import SimpleNamespace

    tokenizer = tiny_target[1]
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    spelt = lambda ids: [f"<0x{i:02X}>" for i in ids]  # noqa: E731
    byte_level = SimpleNamespace(name_or_path="bytes", vocab_size=256, convert_ids_to_tokens=spelt)
    replies = [list("Here is an example of how you can use it.".encode())] * 3
    write_replies(tmp_path / "bytes.safetensors", replies, byte_level)
    write_replies(folder / CORPUS_FILE, replies, byte_level)
    generate = ["generate", "--target", TARGET, "--prompt", "Hi", "--max-new-tokens", "2"]
    for flags, named in ((["--drafter", "random", "--corpus", str(tmp_path / "bytes.safetensors")],
                          f"--corpus {tmp_path / 'bytes.safetensors'}"),
                         (["--drafter", str(folder)], f"the corpus {folder / CORPUS_FILE}")):
        line = _bad(capsys, *generate, *flags)
        assert line == (f"error: {named} was written with tokenizer bytes (256 tokens), whose ids the target's tokenizer "
                        f"{tokenizer.name_or_path} (49152 tokens) gives other tokens: give a corpus of this target's "
                        "replies, or decode without it (ddtree: --corpus none)"), line
    decoding = ["--target", TARGET, "--prompts", str(prompts_file), "--budgets", "4", "--adaptive-size", "on"]
    for command in (["bench", "--methods", "ddtree", "--drafter", "random"], ["calibrate", "--drafter", str(folder)]):
        line = _bad(capsys, *command, *decoding, "--corpus", str(tmp_path / "bytes.safetensors"))
        assert "was written with tokenizer bytes (256 tokens)" in line, line
    assert sized_rows == []  # no verify cost measured for a run refused
    write_replies(folder / CORPUS_FILE, replies, tokenizer)  # the target's own: grafted
    code, _, err = run_cli(capsys, *generate, "--drafter", str(folder))
    assert code == 0 and "[corpus] the drafter's corpus.safetensors: " in err, err


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["bench", "--prompts=~/p.jsonl", "--out=~/r.json"],
                                     ["calibrate", "--prompts=~/p.jsonl"], ["verify-cost"]])
def test_a_path_flag_given_with_a_tilde_is_under_the_home_folder(monkeypatch, tmp_path, command):
    """The shell leaves `~` as it is after `--flag=`: bench wrote into a folder named `~` in the working folder, and a
    drafter folder that was there was refused as missing (found in a review)."""
    from ddtree.arguments import build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    paths = {"--target": "~/t"} if command[0] == "verify-cost" else {
        "--target": "~/t", "--drafter": "~/d", "--corpus": "~/c.jsonl", "--calibration": "~/k.json"}
    args = vars(build_parser().parse_args([*command, *(f"{flag}={path}" for flag, path in paths.items())]))
    expected = {**{flag: path for flag, path in (part.split("=") for part in command if "=" in part)}, **paths}
    assert {flag: args[flag[2:]] for flag in expected} == {flag: str(tmp_path / path[2:])
                                                           for flag, path in expected.items()}


def test_bench_reads_and_writes_the_paths_a_tilde_names(capsys, tmp_path, tiny_target, prompts_file, monkeypatch):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    tiny_drafter_folder(tiny_target, home / "drafter")
    (home / "prompts.jsonl").write_text(prompts_file.read_text())
    (home / "replies.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                 {"role": "assistant", "content": "Hello there, how are you today?"}]}))
    monkeypatch.setenv("DDTREE_CACHE", str(cache_dir()))  # the converted targets stay where they are
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--drafter=~/drafter", "--prompts=~/prompts.jsonl",
                           "--corpus=~/replies.jsonl", "--out=~/results.json", "--methods", "dflash,ddtree",
                           "--budgets", "4", "--limit", "1", "--max-new-tokens", "2", "--dtype", "float32")
    assert code == 0, err
    settings = json.loads((home / "results.json").read_text())["settings"]
    assert settings["drafter"] == str(home / "drafter") and settings["corpus"] == str(home / "replies.jsonl")
    assert list(elsewhere.iterdir()) == []  # no folder named `~`


def test_truncated_drafter_weights(capsys, tmp_path, tiny_target, sized_rows):
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut off mid-way
    line = _bad(capsys, "generate", "--target", TARGET, "--drafter", str(folder), "--prompt", "Hi")
    assert f"drafter weights {weights} are unreadable, truncated or not safetensors" in line


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_limit_below_one(capsys, prompts_file, limit):
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar", "--limit", limit)
    assert line == f"error: --limit {limit} must be at least 1; omit it to use every prompt"


def test_bench_limit_decodes_that_many_prompts_from_the_top(capsys, tmp_path, prompts_file):
    """--limit was checked but could be dropped on its way to the prompts file with every test passing: bench decoded
    the whole file, and recorded the --limit it had not kept to (mutation review 42, c16)."""
    out = tmp_path / "results.json"
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar",
                           "--limit", "1", "--max-new-tokens", "2", "--dtype", "float32", "--out", str(out))
    assert code == 0, err
    results = json.loads(out.read_text())
    assert [prompt["id"] for prompt in results["prompts"]] == ["chat"] and results["settings"]["limit"] == 1


class ReaderGone(io.StringIO):
    """stdout once its reader has gone (`ddtree bench ... | head -1`) with Python's output unbuffered
    (PYTHONUNBUFFERED=1, as Docker images and batch scripts set it): every write raises at once."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_bench_and_calibrate_write_their_file_before_the_table_a_gone_reader_stops(capsys, monkeypatch, tmp_path,
                                                                                   tiny_target, prompts_file):
    """Found in a review: each printed its table first, and a write to a pipe whose reader had gone (unbuffered)
    ended the command there, after every prompt was decoded: --out, or the drafter's calibration.json, was never
    written (buffered, the same command wrote it: the table waited in the buffer)."""
    out = tmp_path / "results.json"
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    common = ["--target", TARGET, "--prompts", str(prompts_file), "--limit", "1", "--max-new-tokens", "4", "--dtype",
              "float32", "--budgets", "4"]
    monkeypatch.setattr(sys, "stdout", ReaderGone())
    with pytest.raises(BrokenPipeError):  # (run_cli's status 141 is for a real pipe, which this is not)
        main(["bench", *common, "--methods", "ar,ddtree", "--out", str(out)])
    assert json.loads(out.read_text())["summary"]["ddtree@4"]["new_tokens"] == 4
    with pytest.raises(BrokenPipeError):
        main(["calibrate", *common, "--drafter", str(folder), "--adaptive-size", "off"])
    assert json.loads((folder / CALIBRATION_FILE).read_text())["num_prompts"] == 1


def test_bench_says_where_it_wrote_the_results_as_out_was_given(capsys, tmp_path, prompts_file):
    """The last line points the user at the results: the path given to --out, not a bare name that reads as a file
    in the current folder when --out named another."""
    out = tmp_path / "runs" / "results.json"
    out.parent.mkdir()
    code, printed, err = run_cli(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar",
                                 "--limit", "1", "--max-new-tokens", "2", "--dtype", "float32", "--out", str(out))
    assert code == 0, err
    assert printed.splitlines()[-1] == f"results written to {out}" and json.loads(out.read_text())["prompts"]


@pytest.mark.parametrize("flags, message", [
    (["--methods", " , "], "--methods ' , ' names no method"),
    (["--methods", "ar,ar"], "--methods repeats ar: name each once"),
    (["--methods", "ar,ddtree", "--budgets", "4,8,4"], "--budgets repeats 4: name each once"),
])
def test_bench_lists_that_name_nothing_or_repeat_are_one_line(capsys, prompts_file, flags, message):
    assert message in _bad(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), *flags)


def test_an_output_that_cannot_be_written_is_refused_before_any_decoding(capsys, tmp_path, prompts_file, monkeypatch):
    import ddtree.cli

    monkeypatch.setattr(ddtree.cli, "_setup", lambda *args, **kwargs: pytest.fail("decoded before checking --out"))
    common = ["bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar"]
    assert _bad(capsys, *common, "--out", str(prompts_file / "results.json")) == (
        f"error: cannot write {prompts_file / 'results.json'}: {prompts_file} is a file, not a folder; give a path in "
        "a writable folder")
    assert "is a folder; give a file path" in _bad(capsys, *common, "--out", str(tmp_path))


def test_an_existing_results_file_is_replaced_only_when_asked(capsys, tmp_path, prompts_file, monkeypatch):
    """`--out <drafter>/config.json` replaced the drafter's config with results, without a word."""
    import ddtree.cli

    monkeypatch.setattr(ddtree.cli, "_setup", lambda *args, **kwargs: pytest.fail("decoded before checking --out"))
    taken = tmp_path / "config.json"
    taken.write_text("{}")
    common = ["bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar", "--out", str(taken)]
    assert _bad(capsys, *common) == f"error: --out {taken} exists; pass --overwrite to replace it, or give another path"
    with pytest.raises(pytest.fail.Exception, match="decoded before checking --out"):  # asked: it goes on to decode
        ddtree.cli.main([*common, "--overwrite"])
    assert taken.read_text() == "{}"


def test_a_results_file_written_by_another_run_meanwhile_is_kept_and_this_runs_results_go_beside_it(
        capsys, tmp_path, prompts_file, monkeypatch):
    """--out was checked only at the start: a run started beside this one with the same --out, finishing first, had
    its results replaced without --overwrite (as `ddtree calibrate` refuses)."""
    import ddtree.cli

    out = tmp_path / "results.json"
    real = ddtree.cli.run_benchmark

    def another_run_finishes_first(*args, **kwargs):
        out.write_text('{"another": "run"}')
        return real(*args, **kwargs)

    monkeypatch.setattr(ddtree.cli, "run_benchmark", another_run_finishes_first)
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar", "--limit", "1",
                "--max-new-tokens", "2", "--dtype", "float32", "--out", str(out))
    kept = tmp_path / "results.1.json"
    assert line == (f"error: --out {out} was written by another run while this one decoded, so it is left as it is; "
                    f"this run's results are in {kept}")
    assert json.loads(out.read_text()) == {"another": "run"}
    assert json.loads(kept.read_text())["summary"]["ar"]["new_tokens"] == 2


@pytest.mark.parametrize("command, flags, message", [
    ("generate", ["--drafter", "{tmp}/none", "--prompt", "hi"], "error: drafter '{tmp}/none' is not a folder with a config.json"),
    ("generate", ["--drafter", "{run}", "--prompt", "hi"],
     "error: drafter '{run}' is a training run's folder: its drafter is {run}/drafter"),
    ("generate", ["--drafter", "{target}", "--prompt", "hi"],
     "error: {target} is not a DFlash drafter: its config.json (model_type 'llama') has no dflash_config or block_size"),
    ("generate", ["--drafter", "{listed}", "--prompt", "hi"],
     "error: drafter {listed}/config.json holds a JSON list, not an object of fields"),
    ("calibrate", ["--drafter", "{tmp}", "--prompts", "{prompts}"], "error: drafter '{tmp}' is not a folder with a config.json"),
    # the drafter's config.json given for its folder: the drafter is wrong, not where calibration.json would go
    ("calibrate", ["--drafter", "{run}/drafter/config.json", "--prompts", "{prompts}"],
     "error: drafter '{run}/drafter/config.json' is not a folder with a config.json"),
    ("calibrate", ["--drafter", "{run}/drafter", "--prompts", "{prompts}", "--budgets", "8,8"],  # decoded 8 twice
     "error: --budgets repeats 8: name each once"),
    ("bench", ["--prompts", "{tmp}/none.jsonl"], "error: prompts file {tmp}/none.jsonl does not exist"),
    ("bench", ["--prompts", "{prompts}", "--corpus", "{tmp}/none.jsonl"], "error: --corpus {tmp}/none.jsonl: no such file"),
    ("generate", ["--prompt", "hi", "--calibration", "{tmp}/none.json"], "error: --calibration {tmp}/none.json: no such file"),
    ("generate", ["--prompt", "hi", "--calibration", "{tmp}/c.json"],  # read only after the target loaded before
     "error: calibration file {tmp}/c.json cannot be read (format_version None, this code reads 1)"),
    ("bench", ["--prompts", "{prompts}", "--methods", "ar", "--out", "{prompts}"],  # it replaced the prompts before
     "error: --out {prompts} is the --prompts file"),
    ("bench", ["--prompts", "{prompts}", "--methods", "dflash", "--drafter", "random", "--calibration", "{tmp}/c.json",
               "--out", "{tmp}/c.json", "--overwrite"],  # with --overwrite, the results replaced the run's own input
     "error: --out {tmp}/c.json is the --calibration file: the results would replace it; give another --out"),
    ("bench", ["--prompts", "{prompts}", "--methods", "ddtree", "--drafter", "random", "--corpus", "{tmp}/c.json",
               "--out", "{tmp}/c.json", "--overwrite"],
     "error: --out {tmp}/c.json is the --corpus file: the results would replace it; give another --out"),
    ("bench", ["--prompts", "{prompts}", "--methods", "dflash", "--drafter", "{run}/drafter",
               "--out", "{run}/drafter/config.json", "--overwrite"],
     "error: --out {run}/drafter/config.json is in the --drafter folder {run}/drafter: the results would replace its "
     "config.json; give another --out"),
    # under `ar` too: the drafter's config.json is read and checked there, and --overwrite replaced it with results
    ("bench", ["--prompts", "{prompts}", "--methods", "ar", "--drafter", "{run}/drafter",
               "--out", "{run}/drafter/config.json", "--overwrite"],
     "error: --out {run}/drafter/config.json is in the --drafter folder {run}/drafter: the results would replace its "
     "config.json; give another --out"),
    ("bench", ["--prompts", "{prompts}", "--methods", "ar", "--target", "{target}", "--out", "{target}/config.json",
               "--overwrite"],
     "error: --out {target}/config.json is in the --target folder {target}: the results would replace its config.json"),
    ("bench", ["--prompts", "{prompts}", "--methods", "ar,dflash", "--lookup", "7", "--corpus", "{prompts}"],  # ignored
     "error: --lookup, --corpus shape the ddtree method's trees, and --methods ar,dflash runs no ddtree"),
    ("bench", ["--prompts", "{prompts}", "--methods", "dflash", "--adaptive-size", "on"],
     "error: --adaptive-size on shape the ddtree method's trees"),
    ("bench", ["--prompts", "{prompts}", "--methods", "ar", "--redraft", "3", "--online-calibration"],  # taken before
     "error: --redraft, --online-calibration act on the drafter's drafts, and --methods ar drafts none: add dflash or "
     "ddtree to --methods, or drop them"),
    # generate took --online-calibration with `ar` without a word, and refused --redraft and --corpus only once the
    # target had loaded (and the corpus was indexed): found in a review
    ("generate", ["--prompt", "hi", "--method", "ar", "--online-calibration"],
     "error: --online-calibration act on the drafter's drafts, and --method ar drafts none: give --method dflash or "
     "ddtree, or drop them"),
    ("generate", ["--prompt", "hi", "--method", "ar", "--redraft", "2"],
     "error: --redraft act on the drafter's drafts, and --method ar drafts none"),
    # --redraft 0 went without a word under `ar`, where --lookup 0 with dflash is refused (found in review 42)
    ("bench", ["--prompts", "{prompts}", "--methods", "ar", "--redraft", "0"],
     "error: --redraft act on the drafter's drafts, and --methods ar drafts none"),
    # a mistyped drafter path went without a word under `ar`, and showed only on the next dflash or ddtree run
    ("generate", ["--prompt", "hi", "--method", "ar", "--drafter", "/does/not/exist"],
     "error: drafter '/does/not/exist' is not a folder with a config.json"),
    ("bench", ["--prompts", "{prompts}", "--methods", "ar", "--drafter", "{tmp}/nope"],
     "error: drafter '{tmp}/nope' is not a folder with a config.json"),
    # an empty raw prompt was refused once the target had loaded, naming the API's prompt_ids
    ("generate", ["--prompt", "", "--raw", "--method", "ar"],
     "error: --prompt is empty, and with --raw no chat template adds tokens to it"),
    ("generate", ["--prompt", "hi", "--method", "ar", "--corpus", "{prompts}"],
     "error: --corpus shape the ddtree method's trees, and --method ar runs no ddtree: give --method ddtree, or drop "
     "them"),
    ("generate", ["--prompt", "hi", "--method", "dflash", "--drafter", "random", "--lookup", "3", "--adaptive-size", "on"],
     "error: --lookup, --adaptive-size on shape the ddtree method's trees, and --method dflash runs no ddtree"),
    # 0 (off) is given too, and as ignored: only a count above 0 was tested (mutation review 42, c12)
    ("generate", ["--prompt", "hi", "--method", "dflash", "--drafter", "random", "--lookup", "0"],
     "error: --lookup shape the ddtree method's trees, and --method dflash runs no ddtree"),
    # untested, so 0 could be let through: the target loaded and prefilled for no token (mutation review, C12)
    ("generate", ["--prompt", "hi", "--method", "ar", "--max-new-tokens", "0"],
     "error: --max-new-tokens 0 must be at least 1"),
])
def test_files_named_on_the_command_line_are_checked_before_the_target_loads(capsys, tmp_path, prompts_file, monkeypatch,
                                                                           command, flags, message):
    """Loading the target (and measuring packed weights and verify costs) took 11.8 s and 1.5 GB before a missing
    drafter folder was named, on the built-in target on a 2-core EPYC; checked first, 5.6 s and 0.4 GB."""
    import ddtree.cli

    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    run, target, listed = tmp_path / "run", tmp_path / "target", tmp_path / "listed"
    for folder, config in ((run / "drafter", "{}"), (target, '{"model_type": "llama"}'), (listed, "[1, 2]")):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(config)
    (tmp_path / "c.json").write_text("{}")  # a calibration or corpus the run reads
    fill = lambda text: text.format(tmp=tmp_path, prompts=prompts_file, run=run, target=target, listed=listed)  # noqa: E731
    assert _bad(capsys, command, "--target", TARGET, *map(fill, flags)).startswith(fill(message))


def test_an_out_that_names_an_input_by_another_path_is_refused(capsys, tmp_path, prompts_file, monkeypatch):
    """The prompts named relative to the working folder, or through a link, and --out by its own path: compared
    as given, they differ, and --overwrite replaced the prompts with the results (mutation review 42, c17)."""
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(prompts_file)
    for prompts in (prompts_file.name, "link.jsonl"):
        line = _bad(capsys, "bench", "--target", TARGET, "--prompts", prompts, "--methods", "ar", "--out",
                    str(prompts_file), "--overwrite")
        assert line == (f"error: --out {prompts_file} is the --prompts file: the results would replace it; give "
                        "another --out")


def test_a_corpus_or_adaptive_size_turned_off_is_taken_by_methods_without_trees():
    """`none` and `off` ask for what `ar` and dflash do anyway, as a script that passes them to every method does:
    refused as if given a corpus, they failed such a script (mutation review 42, c14)."""
    from ddtree.arguments import build_parser
    from ddtree.cli import check_flags_for_methods

    args = build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--methods", "ar,dflash", "--corpus", "none",
                                      "--adaptive-size", "off"])
    check_flags_for_methods(args, ["ar", "dflash"])  # raises DDTreeError where it refuses them


def test_an_unwritable_place_for_the_results_is_named_before_the_target_loads(capsys, tmp_path, prompts_file,
                                                                               monkeypatch, tiny_target):
    """A read-only mount (simulated: root may write anywhere else) was found only after every prompt was decoded,
    and what bench measured or calibrate learned was lost."""
    import ddtree.cli
    import ddtree.files

    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    access = ddtree.files.os.access
    monkeypatch.setattr(ddtree.files.os, "access", lambda path, mode: Path(path) != folder and access(path, mode))
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    common = ["--target", TARGET, "--prompts", str(prompts_file)]
    line = _bad(capsys, "bench", *common, "--methods", "ar", "--out", str(folder / "results.json"))
    assert line == (f"error: cannot write {folder / 'results.json'}: {folder} is not writable here; give a path in a "
                    "writable folder")
    line = _bad(capsys, "calibrate", *common, "--drafter", str(folder))
    assert line.startswith(f"error: cannot write {folder / 'calibration.json'}: {folder} is not writable here")


def test_a_results_path_too_long_to_look_up_is_one_line_before_the_target_loads(capsys, tmp_path, prompts_file,
                                                                                monkeypatch):
    """bench --out with a name over 255 bytes: the check that it is none of the run's inputs looked it up first and
    stopped in an ENAMETOOLONG traceback."""
    import ddtree.cli

    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    out = tmp_path / ("a" * 300) / "results.json"
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar", "--out",
                str(out))
    assert line == f"error: cannot write {out}: {os.strerror(errno.ENAMETOOLONG)}; give a path in a writable folder"


@pytest.mark.parametrize("flags, message", [
    (["--repeats", "0"], "--repeats 0 must be at least 1"), (["--context", "0"], "--context 0 must be at least 1"),
    (["--context", "-5"], "--context -5 must be at least 1"), (["--sizes", "4,-3"], "--sizes -3 must be at least 1"),
    (["--context", "5000", "--sizes", "8"], "--context 5000 with 8 tree nodes and its root runs past target"),
    # the largest size is the one checked, wherever it stands in the list (mutation review 42, c22)
    (["--context", "8", "--sizes", "8000,4"], "--context 8 with 8000 tree nodes and its root runs past target"),
    # timed again and printed as a second row of other figures for the same size
    (["--sizes", "8,4,8"], "--sizes repeats 8: name each once"),
])
def test_verify_cost_numbers_out_of_range_are_one_line(capsys, monkeypatch, flags, message):
    monkeypatch.setattr(ddtree.cli, "measure_verify_cost", lambda *args: pytest.fail("measured past the context"))
    assert message in _bad(capsys, "verify-cost", "--target", TARGET, "--dtype", "float32", *flags)


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ar,foo"], "unknown method 'foo': choose from ar, dflash, ddtree"),
    (["--budgets", "0"], "budget 0 must be at least 1"),
    (["--prompts", "README.md"], "README.md:1: not valid JSON"),
    (["--limit", "0"], "limit 0 must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    # found in a review: taken without a word, and the run's results went to no file
    (["--overwrite"], "--overwrite replaces an existing --out, and no --out was given: give --out FILE"),
])
def test_bench_methods_budgets_and_prompts_are_checked_before_the_target_loads(capsys, monkeypatch, flags, message):
    """An unknown method and a prompts file that is no JSONL were said only after the target had loaded (13 s on
    SmolLM2, with the packed-weights timing); budgets and the limit were already checked first."""
    import ddtree.cli

    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    given = ["--target", TARGET, "--prompts", "data/eval_prompts.jsonl", "--methods", "ar,ddtree", *flags]
    assert message in _bad(capsys, "bench", *given)


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi", "--budget", "0"],
                                     ["calibrate", "--prompts", "data/eval_prompts.jsonl", "--budgets", "4,0"]])
def test_generate_and_calibrate_budgets_are_checked_before_the_target_loads(capsys, monkeypatch, tmp_path, tiny_target,
                                                                            command):
    """bench checks its budgets with its methods; generate's and calibrate's are checked in _setup, which the target's
    own check (after the load) would otherwise stand in for."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    assert "budget 0 must be at least 1" in _bad(capsys, *command, "--target", TARGET, "--drafter", str(folder))


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["bench", "--prompts", "data/eval_prompts.jsonl"],
                                     ["calibrate", "--prompts", "data/eval_prompts.jsonl"]])
def test_adaptive_size_on_with_the_static_cache_is_one_line_before_the_target_loads(capsys, monkeypatch, tmp_path,
                                                                                   tiny_target, command):
    """Found in a review: said only once the target had loaded and its packed weights were timed (generate and
    calibrate: the drafter and its corpus too), where a Decoder given the same says it before."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    line = _bad(capsys, *command, "--target", TARGET, "--drafter", str(folder), "--adaptive-size", "on",
                "--static-cache", "on")
    assert "adaptive tree size saves nothing with the static cache" in line


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["verify-cost"]])
def test_packed_weights_on_for_a_bf16_target_is_one_line_before_the_target_loads(capsys, monkeypatch, command):
    """Found in a review: `--packed-weights on --dtype bfloat16` loaded the target, then said it cannot be packed."""
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    line = _bad(capsys, *command, "--target", TARGET, "--dtype", "bfloat16", "--packed-weights", "on")
    assert line == ("error: --packed-weights on: packing is for fp32 on a CPU, and the target would run in bfloat16 "
                    "on cpu; give --dtype float32 to pack, or use --packed-weights off (or auto)")


def test_sampling_settings_name_only_the_rule_broken_by_its_flag(capsys, prompts_file):
    """The command's line names the flag given (it named the Python keyword top_p, which the command has not)."""
    line = _bad(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--top-p", "2")
    assert line == "error: bad sampling settings: --top-p 2.0 must be in (0, 1]"
    line = _bad(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--temperature", "1", "--top-k=-3")
    assert line == "error: bad sampling settings: --top-k -3 must be a whole number >= 0"


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1.0"])
def test_temperature_not_a_finite_number_at_least_zero(capsys, temperature):
    line = _bad(capsys, "generate", "--target", TARGET, "--prompt", "Hi", "--temperature", temperature)
    assert f"bad sampling settings: --temperature {temperature} must be a finite number >= 0" in line


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["verify-cost"]])
def test_unknown_dtype_is_one_line(capsys, command):
    with pytest.raises(SystemExit) as exited:  # the parser's refusal (argparse exits)
        main([command[0], "--target", TARGET, "--dtype", "fp16", *command[1:]])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--dtype" in err and "'fp16'" in err and "bfloat16" in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["bench", "--prompts", "p.jsonl"],
                                     ["calibrate", "--prompts", "p.jsonl"], ["verify-cost"]])
def test_a_misspelt_dtype_is_refused_by_the_parser_before_torch_loads(capsys, command):
    """--dtype fp32 (or bf16, AUTO) was refused by resolve_dtype, once torch had loaded: 4 s on, where every other
    bad flag value answers at once (ddtree/__main__.py parses with ddtree/arguments.py first)."""
    from ddtree.arguments import build_parser

    for given in ("fp32", "bf16", "AUTO"):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([*command, "--dtype", given])
        assert exited.value.code == 2
        assert capsys.readouterr().err == (f"error: argument --dtype: choose auto or one of float32, bfloat16, "
                                           f"float16, got {given!r}; see ddtree {command[0]} --help\n")
    for given in ("auto", "bfloat16", "torch.float32"):  # parse_dtype's spellings pass on as given
        assert build_parser().parse_args([*command, "--dtype", given]).dtype == given


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")
def test_bench_packed_weights_commit_the_plain_layers_tokens_and_say_which_ran(capsys, monkeypatch, tmp_path,
                                                                              prompts_file, unwarmed):
    """--packed-weights on packs an fp32 CPU target (and its drafter), off does not; both decode the same tokens. Only
    the target's packing was checked, so the drafter could be left on plain layers (mutation review, D08)."""
    drafters, real = [], ddtree.cli._drafter_runner

    def kept(*args):
        drafters.append(real(*args))
        return drafters[-1]

    monkeypatch.setattr(ddtree.cli, "_drafter_runner", kept)
    runs = bench_off_and_on(capsys, tmp_path, prompts_file, "--packed-weights", "ar,ddtree")
    assert [is_packed(runner.drafter) for runner in drafters] == [False, True]  # off, then on
    for choice, (results, err, _, stdout) in runs.items():
        assert results["settings"]["packed_weights_resolved"] is (choice == "on")
        assert ("[packed weights] on" in err) is (choice == "on")
        # the table's header says which layers its figures were measured with
        assert f"target {TARGET}, float32, {'packed' if choice == 'on' else 'plain'} linear layers; " in stdout
    assert runs["on"][2] == runs["off"][2] and len(runs["off"][2]) == 4


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")
def test_bench_records_what_packed_weights_auto_resolved_to(capsys, monkeypatch, tmp_path, prompts_file):
    """auto packs only where its probe measures packed layers faster, so results.json's packed_weights_resolved is
    the only record of which layers the figures came from: read back from the target, not from the flag given. auto is
    made to pack here, which the probe would not promise on this machine."""
    real = ddtree.cli.apply_packing
    monkeypatch.setattr(ddtree.cli, "apply_packing",
                        lambda choice, model, *rest: real("on" if choice == "auto" else choice, model, *rest))
    out = tmp_path / "results.json"
    assert run_cli(capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file),
                   "--methods", "ar", "--budgets", "4", "--max-new-tokens", "2", "--dtype", "float32",
                   "--packed-weights", "auto", "--out", str(out))[0] == 0
    settings = json.loads(out.read_text())["settings"]
    assert settings["packed_weights"] == "auto" and settings["packed_weights_resolved"] is True


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["verify-cost"]])
def test_packed_weights_on_in_bf16_is_one_line(capsys, command):
    line = _bad(capsys, command[0], "--target", TARGET, "--dtype", "bfloat16", "--packed-weights", "on", *command[1:])
    assert "--packed-weights on:" in line and "fp32" in line


def test_verify_cost_prints_each_measured_column_under_its_own_header(capsys, monkeypatch):
    """The table is what a user reads to size trees: each row's ratio to an AR step and its tree overhead, as
    measured, under the header that names them (the values differ here, so a column printed twice is seen)."""
    rows = [{"nodes": 0, "verify_ms": 2.0, "ar_step_ms": 2.0, "ratio": 1.0, "overhead_ms": 0.0},
            {"nodes": 8, "verify_ms": 5.0, "ar_step_ms": 2.0, "ratio": 2.5, "overhead_ms": 0.75}]
    monkeypatch.setattr(ddtree.cli, "measure_verify_cost", lambda *args: rows)
    code, out, err = run_cli(capsys, "verify-cost", "--target", TARGET, "--dtype", "float32", "--sizes", "8",
                             "--repeats", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].endswith("one AR step 2.0 ms") and lines[1].split() == ["nodes", "verify", "ms", "x", "AR",
                                                                            "step", "tree", "overhead", "ms"]
    assert [line.split() for line in lines[2:]] == [["0", "2.0", "1.00", "0.00"], ["8", "5.0", "2.50", "0.75"]]


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")
def test_verify_cost_compares_plain_and_packed_layers(capsys):
    code, out, _ = run_cli(capsys, "verify-cost", "--target", TARGET, "--dtype", "float32", "--sizes", "2,5",
                           "--repeats", "1", "--compare-plain")
    assert code == 0 and "plain / packed" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["0", "2", "5"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows)
    # It named --packed-weights, which the user had not given and --compare-plain sets itself (found in a review).
    line = _bad(capsys, "verify-cost", "--target", TARGET, "--dtype", "bfloat16", "--compare-plain")
    assert line == ("error: --compare-plain needs fp32 on a CPU, and the target runs in bfloat16 on cpu: drop "
                    "--compare-plain, or use --dtype float32")
    # --packed-weights on/off was set to off silently (both are timed): refused before the target loads
    for kind in ("on", "off"):
        line = _bad(capsys, "verify-cost", "--target", TARGET, "--packed-weights", kind, "--compare-plain")
        assert line == f"error: --compare-plain times both plain and packed linear layers: drop --packed-weights {kind}"


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")
@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
def test_verify_cost_compare_plain_over_a_bf16_target_is_one_line_before_the_target_loads(capsys, monkeypatch, dtype):
    """Said once the target had loaded (seconds, minutes for a large target), where the dtype it loads in was known
    before: --dtype bfloat16, or auto where it picks bf16 (an AMX Xeon, an AVX512-BF16 EPYC)."""
    monkeypatch.setattr(ddtree.precision, "fast_precision", lambda device: Choice(torch.bfloat16, "stub measurement"))
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    line = _bad(capsys, "verify-cost", "--target", TARGET, "--dtype", dtype, "--compare-plain")
    assert line == ("error: --compare-plain needs fp32 on a CPU, and the target runs in bfloat16 on cpu: drop "
                    "--compare-plain, or use --dtype float32")


def test_verify_cost_compare_plain_under_a_torch_without_packing_is_one_line_before_the_target_loads(capsys,
                                                                                                  monkeypatch):
    monkeypatch.setattr(ddtree.cli, "packing_available", lambda: False)
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    line = _bad(capsys, "verify-cost", "--target", TARGET, "--dtype", "float32", "--compare-plain")
    assert line == ("error: --compare-plain times packed linear layers, and this torch has no oneDNN weight packing: "
                    "drop --compare-plain")


@pytest.fixture
def auto_picks_bf16(monkeypatch):
    """`--dtype auto` resolves to bf16 whatever this machine measures."""
    monkeypatch.setattr(ddtree.precision, "fast_precision", lambda device: Choice(torch.bfloat16, "stub measurement"))


def test_bench_resolves_auto_dtype_and_records_both(capsys, tmp_path, prompts_file, auto_picks_bf16):
    out = tmp_path / "results.json"
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods", "ar",
                           "--limit", "1", "--max-new-tokens", "2", "--out", str(out))
    assert code == 0, err
    assert "--dtype auto -> bfloat16: stub measurement" in err.splitlines()
    settings = json.loads(out.read_text())["settings"]
    assert settings["dtype"] == "auto" and settings["dtype_resolved"] == "bfloat16"
    assert settings["limit"] == 1 and settings["target"] == TARGET  # the other settings keep their keys


def test_an_explicit_dtype_is_used_as_given(capsys, auto_picks_bf16):
    code, out, err = run_cli(capsys, "verify-cost", "--target", TARGET, "--dtype", "float16", "--device", "cpu",
                             "--sizes", "2", "--context", "8", "--repeats", "1")
    assert code == 0, err
    assert out.startswith(f"target {TARGET}, float16,") and "--dtype auto" not in err
    code, out, err = run_cli(capsys, "verify-cost", "--target", TARGET, "--device", "cpu",
                             "--sizes", "2", "--context", "8", "--repeats", "1")
    assert code == 0 and out.startswith(f"target {TARGET}, bfloat16,") and "--dtype auto -> bfloat16" in err


@pytest.mark.parametrize("has_gpu, given, used", [(True, [], "cuda"), (False, [], "cpu"),
                                                  (True, ["--device", "cpu"], "cpu")])
@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["verify-cost"]])
def test_a_device_left_out_is_cuda_where_this_machine_has_a_gpu(monkeypatch, has_gpu, given, used, command):
    """What --device's help states. Where the tests ran without a GPU, a default that was always cpu passed them all,
    and every command on a GPU machine would have run on its CPU (mutation review 32, A18)."""
    from ddtree.arguments import build_parser, default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
    assert default_device(build_parser().parse_args([*command, *given])).device == used


@pytest.mark.parametrize("device, message", [
    ("gpu0", "--device 'gpu0' is not a device name; give cpu, cuda or cuda:N"),
    ("cuda:99", "--device cuda:99: this machine has"),
    # torch names them, and they failed with a traceback once the target had loaded (found in a review)
    ("mps", "--device mps: this code runs on a CPU or a CUDA GPU only; give --device cpu, cuda or cuda:N"),
    ("xpu", "--device xpu: this code runs on a CPU or a CUDA GPU only"),
    ("meta", "--device meta: this code runs on a CPU or a CUDA GPU only"),
])
@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["verify-cost"]])
def test_a_device_this_machine_does_not_have(capsys, monkeypatch, device, message, command):
    import ddtree.cli

    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    assert message in _bad(capsys, command[0], "--target", TARGET, "--device", device, *command[1:])


def test_bench_counts_the_prompts_where_a_method_committed_other_tokens_than_ar(capsys, tmp_path, prompts_file,
                                                                                 monkeypatch):
    """A near-tie flipped in bf16, say: stood in for by a generate that changes ddtree's last token on one prompt."""
    import ddtree.bench

    real = ddtree.bench.generate

    def flipping(target, prompt_ids, method, *args, **kwargs):
        result = real(target, prompt_ids, method, *args, **kwargs)
        if method == "ddtree" and len(prompt_ids) < 12:  # the raw prompt "def square(x):", not the chat one
            result.new_tokens = result.new_tokens[:-1] + [result.new_tokens[-1] + 1]
        return result

    monkeypatch.setattr(ddtree.bench, "generate", flipping)
    out = tmp_path / "results.json"
    code, stdout, _ = run_cli(
        capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file),
        "--methods", "ar,dflash,ddtree", "--budgets", "4", "--max-new-tokens", "6", "--out", str(out),
        "--dtype", "float32",
    )
    assert code == 0
    summary = json.loads(out.read_text())["summary"]
    assert (summary["dflash"]["same_as_ar"], summary["ddtree@4"]["same_as_ar"]) == (2, 1)
    assert "dflash 2/2, ddtree@4 1/2" in stdout
    # and what a difference means in the dtype it decoded in: a bug in fp32, not a near tie rounded otherwise
    assert "ddtree@4 1/2 (fp32 decoding is exact, so a difference there is a bug: please report it)" in stdout


# ----------------------------------------------------------------------------- ddtree calibrate


def test_calibrate_writes_the_folders_calibration_which_bench_uses_unless_told_none(
        capsys, tmp_path, tiny_target, prompts_file, monkeypatch, sized_rows, unwarmed):
    # calibrate's verify cost is stubbed (sized_rows): what it learns is checked here, not the figures it sized with
    torch.manual_seed(0)  # the weights replaced below are drawn after seed 1: a run whose RNG stood there failed
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    # packing pinned off in every command: on a loaded machine one bench's probe could pack and another's not (the
    # target's packed sums differ at 1e-12: the expected taus compared below did), and nothing here reads it
    common = ["--target", TARGET, "--drafter", str(folder), "--prompts", str(prompts_file), "--dtype", "float32",
              "--packed-weights", "off"]
    learners = []

    class Kept(OnlineCalibration):  # calibrate's learner, kept to compare what was written with what it learned
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            learners.append(self)

    monkeypatch.setattr(ddtree.cli, "OnlineCalibration", Kept)
    code, stdout, _ = run_cli(capsys, "calibrate", *common, "--max-new-tokens", "16", "--budgets", "8")
    assert code == 0 and f"calibration written to {folder / CALIBRATION_FILE}" in stdout
    written = json.loads((folder / CALIBRATION_FILE).read_text())
    assert set(written["temperatures"]) == {"8", "chain"} and written["num_prompts"] == 2
    # the mean over the last half of its rounds, as it says, not the last step (which passed: mutation review, C18)
    (learner,) = learners
    assert written["temperatures"] == learner.settled().state()["temperatures"] != learner.state()["temperatures"]
    # an untrained drafter is sure of tokens the target never takes: warmed, as online calibration warms it
    assert written["temperatures"]["8"] > 1.0 and written["temperatures"]["chain"] > 1.0
    learned = load_calibration(folder / CALIBRATION_FILE)
    assert learned.frozen and learned.temperature(16) == learned.temperature(8)  # another budget: the nearest one's

    def bench(*extra, methods="ar,dflash,ddtree"):
        # 8 tokens, half calibrate's: the figures read are the taus the calibration shapes, not what it learned from
        out = tmp_path / "results.json"
        assert run_cli(capsys, "bench", *common, "--max-new-tokens", "8", "--methods", methods, "--budgets", "8",
                       "--out", str(out), "--overwrite", *extra)[0] == 0
        return json.loads(out.read_text())

    shipped, none = bench(), bench("--calibration", "none")
    assert shipped["settings"]["calibration_resolved"] == f"the drafter's {CALIBRATION_FILE}"
    assert none["settings"]["calibration_resolved"] is None
    for results in (shipped, none):  # it shapes the tree, never what is committed (fp32: exact)
        assert results["summary"]["ddtree@8"]["same_as_ar"] == results["summary"]["dflash"]["same_as_ar"] == 2
    # warmer, so less sure of its (wrong) guesses: the expectation falls toward the measurement
    for key in ("ddtree@8", "dflash"):
        assert shipped["summary"][key]["expected_tau"] < none["summary"][key]["expected_tau"], key
    given = bench("--calibration", str(folder / CALIBRATION_FILE), methods="ddtree")  # only ddtree@8's figures read
    # the file it was told, not the drafter's: a copy elsewhere may be another run's temperatures
    assert given["settings"]["calibration_resolved"] == str(folder / CALIBRATION_FILE)
    assert given["summary"]["ddtree@8"]["expected_tau"] == shipped["summary"]["ddtree@8"]["expected_tau"]
    assert (folder / CALIBRATION_FILE).read_text() == json.dumps(written, indent=1)  # decoding never writes it
    # Learned without a context lookup: decoding with one prices the grafted nodes by a table it never filled
    quick = [*common, "--max-new-tokens", "4", "--methods", "ddtree", "--budgets", "8"]
    assert "learned decoding with other settings" not in run_cli(capsys, "bench", *quick)[2]
    code, _, err = run_cli(capsys, "bench", *quick, "--lookup", "7")
    assert code == 0 and "[calibration] note: learned decoding with other settings (lookup 0 here 7)" in err
    # Other weights copied into the folder since (found in a review): its temperatures are another drafter's
    assert "learned on other weights" not in err and written["weights"] is not None
    torch.manual_seed(1)
    tiny_drafter_folder(tiny_target, folder)  # the same names and shapes, other values
    code, _, err = run_cli(capsys, "bench", *quick)
    assert code == 0 and (f"[calibration] note: {folder / CALIBRATION_FILE} was learned on other weights than "
                          f"{folder} holds now") in err


def redrafting_drafter(tmp_path, tiny_target, prompts_file) -> tuple[Path, list[str], list[str]]:
    """A tiny drafter folder that re-drafts by default (redraft 4, as model.redraft_prob's drafters ship), the flags
    every command decodes it with, and a calibrate command over it. Weight packing off: no test of it reads packing,
    whose probe at start (about 0.1 s a command on a 2-core AVX2 EPYC) the auto default would time in every command."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    edit_config(folder, dflash_config={**config["dflash_config"], "redraft": 4})
    common = ["--target", TARGET, "--drafter", str(folder), "--dtype", "float32", "--device", "cpu",
              "--packed-weights", "off"]
    # 4 tokens a prompt: its callers read what a calibration file records it was decoded with, not what it learned
    calibrate = ["calibrate", *common, "--prompts", str(prompts_file), "--budgets", "8", "--max-new-tokens", "4",
                 "--overwrite"]
    return folder, common, calibrate


def test_bench_records_what_the_chain_decoded_with_beside_what_ddtree_did(capsys, tmp_path, tiny_target, prompts_file,
                                                                         monkeypatch, sized_rows, unwarmed):
    """Only ddtree_resolved was written: under --adaptive-size the chain re-drafted as its drafter says (two drafter
    forwards a round) while sized trees did not, and the file's one redraft, 0, said otherwise (found in a review).
    Each record is what generate itself resolved. Whether trees are sized is what matters, not the figures: the
    verify cost is stubbed (sized_rows)."""
    import ddtree.decoding

    folder, common, _ = redrafting_drafter(tmp_path, tiny_target, prompts_file)
    resolve, ran = ddtree.decoding.drafter_defaults, {}

    def recorded(method, *args):
        ran[method] = resolve(method, *args)
        return ran[method]

    monkeypatch.setattr(ddtree.decoding, "drafter_defaults", recorded)  # generate's own call
    for extra, chain_redraft in (([], 4), (["--redraft", "0"], 0)):
        ran.clear()
        out = tmp_path / "results.json"
        assert run_cli(capsys, "bench", *common, "--prompts", str(prompts_file), "--methods", "dflash,ddtree",
                       "--budgets", "8", "--adaptive-size", "on", "--max-new-tokens", "4", "--out", str(out),
                       "--overwrite", *extra)[0] == 0
        settings = json.loads(out.read_text())["settings"]
        assert settings["dflash_resolved"] == {"lookup": 0, "redraft": chain_redraft, "corpus": None}
        assert settings["ddtree_resolved"]["redraft"] == 0  # sized trees leave it off
        assert {method: list(options[:2]) for method, options in ran.items()} == {
            method: [settings[f"{method}_resolved"]["lookup"], settings[f"{method}_resolved"]["redraft"]]
            for method in ("dflash", "ddtree")}
    out = tmp_path / "chain.json"
    assert run_cli(capsys, "bench", *common, "--prompts", str(prompts_file), "--methods", "ar,dflash",
                   "--max-new-tokens", "2", "--out", str(out))[0] == 0
    settings = json.loads(out.read_text())["settings"]
    assert "ddtree_resolved" not in settings and settings["dflash_resolved"]["redraft"] == 4


def test_bench_hands_the_context_lookup_to_the_trees_alone(capsys, tmp_path, prompts_file):
    """--lookup grafts prompt runs into ddtree's trees; the chain beside them decodes without it (generate refuses a
    lookup for dflash), so `--methods dflash,ddtree --lookup 7` runs both and records the chain's lookup as 0."""
    out = tmp_path / "results.json"
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--prompts", str(prompts_file), "--methods",
                           "dflash,ddtree", "--budgets", "4", "--lookup", "7", "--max-new-tokens", "2",
                           "--out", str(out))
    assert code == 0, err
    settings = json.loads(out.read_text())["settings"]
    assert (settings["dflash_resolved"]["lookup"], settings["ddtree_resolved"]["lookup"]) == (0, 7)


def test_calibrate_learns_with_the_settings_a_default_generate_decodes_with(capsys, tmp_path, tiny_target,
                                                                            prompts_file, sized_rows, unwarmed):
    """calibrate defaulted to --adaptive-size off and generate to auto, which on a CPU sizes the trees and so leaves
    re-drafting off: a drafter trained to re-draft was calibrated on re-drafted trees, and every default generate after
    it printed the mismatch note (found in a review). Explicit flags still choose.
    Calibrate and generate measure the verify cost of sized trees (about 1.5 s a run on a 2-core AVX2 EPYC): stubbed
    (sized_rows), as only whether trees are sized matters here, not the figures."""
    folder, common, calibrate = redrafting_drafter(tmp_path, tiny_target, prompts_file)
    generate = ["generate", *common, "--prompt", "Hi", "--budget", "8", "--max-new-tokens", "4"]
    learned = lambda: json.loads((folder / CALIBRATION_FILE).read_text())["decoded_with"]  # noqa: E731
    assert run_cli(capsys, *calibrate)[0] == 0
    assert learned() == {"lookup": 0, "redraft": 0, "corpus": False, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                         "target": TARGET, "dtype": "float32"}
    code, _, err = run_cli(capsys, *generate)
    assert code == 0 and "learned decoding with other settings" not in err
    # calibrated as bench decodes by default (unsized, re-drafting): generate says so, unless it re-drafts too
    assert run_cli(capsys, *calibrate, "--adaptive-size", "off")[0] == 0 and learned()["redraft"] == 4
    code, _, err = run_cli(capsys, *generate)
    assert code == 0 and "[calibration] note: learned decoding with other settings (redraft 4 here 0)" in err
    code, _, err = run_cli(capsys, *generate, "--redraft", "4")
    assert code == 0 and "learned decoding with other settings" not in err


def test_calibrate_learns_by_default_the_budget_a_default_generate_decodes_at():
    """A calibration holds a draft temperature per budget learned, and a budget it lacks takes the nearest one's: a
    default calibrate learned at another budget than generate's default would shape every default generate's trees with
    a temperature learned on other trees, and nothing pinned the two together (mutation review 32, A13)."""
    from ddtree.arguments import build_parser

    calibrated = build_parser().parse_args(["calibrate", "--prompts", "p.jsonl"]).budgets
    assert calibrated == [build_parser().parse_args(["generate", "--prompt", "Hi"]).budget]


def test_calibrate_says_in_an_exports_card_that_its_figures_were_measured_without_it(
        capsys, tmp_path, tiny_target, prompts_file, sized_rows, unwarmed):
    """The card kept saying its figures were what `ddtree` decodes this drafter to; after `ddtree calibrate` it decodes
    calibrated by default, at another tau (found in a review: 2.938 against the card's 2.984). The card says so, once
    however often it is calibrated; a README.md that is not an export's card is left as it is.
    Calibrate and generate measure the verify cost of sized trees (about 1.5 s a run on a 2-core AVX2 EPYC): stubbed
    (sized_rows), as the card is what is checked here."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    card = ["# drafter", "", "## Measured acceptance", "", "| decoding | tau |", "|---|---:|", "| chain | 1.500 |", "",
            "Decoded as `ddtree` decodes this drafter unless told otherwise (its config and files).", "",
            "## Training recipe", "", "| setting | value |", "", f"{REPO_MARK}none -->", ""]
    (folder / "README.md").write_text("\n".join(card))
    # one prompt of 4 tokens: the card is what is read, not what was learned
    calibrate = ["calibrate", "--target", TARGET, "--drafter", str(folder), "--prompts", str(prompts_file),
                 "--limit", "1", "--dtype", "float32", "--budgets", "8", "--max-new-tokens", "4", "--packed-weights",
                 "off"]
    code, stdout, _ = run_cli(capsys, *calibrate)
    assert code == 0 and f"the folder's card ({folder / 'README.md'}) now says its figures were measured" in stdout
    lines = (folder / "README.md").read_text().splitlines()
    noted = [i for i, line in enumerate(lines) if line.startswith(CARD_NOTE)]
    assert len(noted) == 1 and "`--calibration none`" in lines[noted[0]]
    assert lines[noted[0] - 2].startswith("Decoded as") and lines[noted[0] + 2] == "## Training recipe"  # its section's end
    assert [line for line in lines if not line.startswith(CARD_NOTE)] == card[:10] + [""] + card[10:-1]
    assert run_cli(capsys, *calibrate, "--overwrite")[0] == 0
    assert (folder / "README.md").read_text().splitlines() == lines  # replaced, not added again

    own = "# my notes\n\n## Measured acceptance\n"  # not an export's card: the user's
    (folder / "README.md").write_text(own)
    code, stdout, _ = run_cli(capsys, *calibrate, "--overwrite")
    assert code == 0 and "card" not in stdout and (folder / "README.md").read_text() == own


def test_an_exports_card_without_its_section_of_figures_gets_the_calibration_note_before_its_mark(tmp_path):
    """A card whose "## Measured acceptance" was edited away still says it was calibrated after: the note goes last,
    before the export's mark."""
    card = ["# drafter", "", "## Training recipe", "", "| setting | value |", "", f"{REPO_MARK}none -->"]
    (tmp_path / "README.md").write_text("\n".join(card) + "\n")
    assert note_in_card(tmp_path, "2026-01-02") is True
    lines = (tmp_path / "README.md").read_text().splitlines()
    assert lines[:6] == card[:6] and lines[6].startswith(CARD_NOTE) and "2026-01-02" in lines[6]
    assert lines[7:] == ["", card[6]]


def test_the_calibration_note_names_the_flags_that_clear_it(
        capsys, tmp_path, tiny_target, prompts_file, sized_rows, unwarmed):
    """The note said `run ddtree calibrate --overwrite with these settings`: after a default calibrate (generate's
    sized trees, no re-drafting) a default bench re-drafts, and the bare command it seemed to ask for learned redraft 0
    again, so the note came back (found in a review). It names the flags; run as it says, the note is gone.
    Calibrate and generate measure the verify cost of sized trees (about 1.5 s a run on a 2-core AVX2 EPYC): stubbed
    (sized_rows), as only whether trees are sized matters here, not the figures."""
    folder, common, calibrate = redrafting_drafter(tmp_path, tiny_target, prompts_file)
    bench = ["bench", *common, "--prompts", str(prompts_file), "--limit", "1", "--methods", "ddtree", "--budgets", "8",
             "--max-new-tokens", "4"]
    generate = ["generate", *common, "--prompt", "Hi", "--budget", "8", "--max-new-tokens", "4"]

    def note(*command) -> list[str] | None:
        code, _, err = run_cli(capsys, *command)
        assert code == 0, err
        said = re.search(r"\[calibration\] note: learned decoding with other settings .*?run `ddtree calibrate "
                         r"--overwrite([^`]*)`", err)
        return said and said.group(1).split()

    assert run_cli(capsys, *calibrate)[0] == 0  # as generate decodes
    flags = note(*bench)
    assert flags == ["--lookup", "0", "--redraft", "4", "--adaptive-size", "off", "--corpus", "none"]
    assert run_cli(capsys, *calibrate, *flags)[0] == 0
    assert json.loads((folder / CALIBRATION_FILE).read_text())["decoded_with"]["redraft"] == 4
    assert note(*bench) is None
    # and the other way: learned for bench, a default generate (sized on a CPU) says how to learn for it
    flags = note(*generate)
    assert flags == ["--lookup", "0", "--redraft", "0", "--adaptive-size", "on", "--corpus", "none"]
    assert run_cli(capsys, *calibrate, *flags)[0] == 0
    assert note(*generate) is None


def test_a_calibration_learned_at_another_sampling_or_dtype_is_noted_with_the_flags_that_clear_it(
        capsys, tmp_path, tiny_target, prompts_file, unwarmed):
    """calibrate --temperature 1 wrote a file that greedy decoding then used without a word: its temperatures and
    graft tables priced a sampled acceptance (expected tau 4.12 where 7.23 was measured; found in a review). The file
    records the sampling, target and dtype, and decoding with others is noted as other lookups are. Sampled calibration
    is kept (it prices a server that samples); the replayed calibration of a drafter's config is greedy decoding's."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    # packing off: its probe (about 0.1 s a command on a 2-core AVX2 EPYC) is nothing the file or the note records
    common = ["--target", TARGET, "--drafter", str(folder), "--dtype", "float32", "--adaptive-size", "off",
              "--packed-weights", "off"]
    # one prompt of 4 tokens a calibration: what is checked is what the file records, not what was learned
    calibrate = ["calibrate", *common, "--prompts", str(prompts_file), "--limit", "1", "--budgets", "8",
                 "--max-new-tokens", "4", "--lookup", "0", "--overwrite"]
    generate = ["generate", *common, "--prompt", "Hi", "--budget", "8", "--max-new-tokens", "4", "--lookup", "0"]

    def note(*command) -> tuple[str, list[str]] | None:
        code, _, err = run_cli(capsys, *command)
        assert code == 0, err
        said = re.search(r"\[calibration\] note: learned decoding with other settings \((.*?)\): .*?run `ddtree "
                         r"calibrate --overwrite([^`]*)`", err)
        return said and (said.group(1), said.group(2).split())

    assert run_cli(capsys, *calibrate, "--temperature", "1")[0] == 0
    written = json.loads((folder / CALIBRATION_FILE).read_text())
    assert written["decoded_with"]["temperature"] == 1.0 and written["decoded_with"]["dtype"] == "float32"
    said, flags = note(*generate)
    assert said == "temperature 1.0 here 0.0" and "--temperature" not in flags  # greedy: calibrate's default
    assert note(*generate, "--temperature", "1") is None
    said, flags = note(*generate, "--temperature", "1", "--top-p", "0.9", "--top-k", "20")
    assert said == "top_p 1.0 here 0.9; top_k 0 here 20" and flags[-6:] == ["--temperature", "1", "--top-p", "0.9",
                                                                           "--top-k", "20"]
    assert run_cli(capsys, *calibrate, *flags)[0] == 0
    assert note(*generate, "--temperature", "1", "--top-p", "0.9", "--top-k", "20") is None
    # greedy on both sides: top-p and top-k cut nothing, whatever they say
    assert run_cli(capsys, *calibrate)[0] == 0
    assert note(*generate, "--top-p", "0.5") is None
    said, flags = note(*[flag if flag != "float32" else "bfloat16" for flag in generate])
    assert said == "dtype float32 here bfloat16" and flags[-2:] == ["--dtype", "bfloat16"]
    # a file written before decoded_with held them: the temperature and dtype recorded beside it
    old = json.loads((folder / CALIBRATION_FILE).read_text())
    old["decoded_with"] = {"lookup": 0, "redraft": 0, "corpus": False}
    (folder / CALIBRATION_FILE).write_text(json.dumps({**old, "temperature": 0.7}))
    assert note(*generate)[0] == "temperature 0.7 here 0.0"
    # the config's replayed calibration was learned as greedy decoding
    (folder / CALIBRATION_FILE).unlink()
    config = json.loads((folder / "config.json").read_text())
    edit_config(folder, dflash_config={**config["dflash_config"], "calibration": {
        "temperatures": {"8": 1.2}, "graft_acceptance": {}, "decoded_with": {"lookup": 0, "redraft": 0, "corpus": False}}})
    assert note(*generate) is None
    assert note(*generate, "--temperature", "0.7")[0] == "temperature 0.0 here 0.7"


@pytest.mark.parametrize("corpus, given, parsed", [
    (object(), "my replies.jsonl", "my replies.jsonl"),  # a file given here: named, quoted for the shell
    (object(), None, None),  # the drafter folder's own: calibrate's default too
    (None, None, "none"),  # decoded without one
])
def test_the_flags_a_calibration_note_prints_give_calibrate_every_setting_when_pasted_back(corpus, given, parsed):
    """The note's `ddtree calibrate --overwrite FLAGS` is pasted into a shell, so each flag must parse back to the
    value decoded with: --top-p 0.95 printed to one decimal, or a corpus path with a space unquoted, would learn on
    other trees, and the note would come back (mutation review 42)."""
    import argparse
    import shlex

    from ddtree.arguments import build_parser
    from ddtree.cli import calibrate_flags

    args = argparse.Namespace(corpus=given, temperature=0.75, top_p=0.95, top_k=40)
    flags = shlex.split(calibrate_flags(args, 3, 2, corpus, None, "bfloat16"))
    pasted = build_parser().parse_args(["calibrate", "--drafter", "d", "--prompts", "p.jsonl", *flags])
    assert (pasted.lookup, pasted.redraft, pasted.adaptive_size, pasted.corpus) == (3, 2, "off", parsed)
    assert (pasted.temperature, pasted.top_p, pasted.top_k, pasted.dtype) == (0.75, 0.95, 40, "bfloat16")


def test_the_sampling_a_calibration_note_asks_calibrate_for_is_the_one_decoded_with_to_every_digit():
    """The flags were printed with :g, 6 significant digits: `--temperature 0.1234567` asked for `calibrate
    --temperature 0.123457`, which learned at another temperature, and the note came back after it had run (found
    in a review); a top-p of 0.9999999 was printed as `--top-p 1`, no cut at all."""
    import argparse
    import shlex

    from ddtree.arguments import build_parser
    from ddtree.cli import calibrate_flags

    args = argparse.Namespace(corpus=None, temperature=0.1234567, top_p=0.9999999, top_k=0)
    flags = shlex.split(calibrate_flags(args, 0, 0, None, None))
    pasted = build_parser().parse_args(["calibrate", "--drafter", "d", "--prompts", "p.jsonl", *flags])
    assert (pasted.temperature, pasted.top_p) == (0.1234567, 0.9999999)


@pytest.mark.parametrize("overwrite", [False, True])
def test_calibrate_leaves_a_file_another_run_wrote_while_it_decoded_unless_told_to_overwrite(
        capsys, tmp_path, tiny_target, prompts_file, monkeypatch, overwrite, sized_rows, unwarmed):
    """Two calibrate runs started together on one folder both passed the check at the start, and the second to finish
    replaced the first's file (found in a review): without --overwrite, nothing is replaced. With it, the file is
    replaced, as docs/decoding.md says and bench --out does; it was refused, asking for the --overwrite already given,
    and what the run learned was lost (found in a later review)."""
    import ddtree.cli
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    theirs = '{"format_version": 1, "temperatures": {"8": 1.5}, "graft_acceptance": {}}'
    decode = ddtree.cli.run_benchmark

    def the_other_run_finishes_first(*args, **kwargs):
        (folder / CALIBRATION_FILE).write_text(theirs)
        return decode(*args, **kwargs)

    monkeypatch.setattr(ddtree.cli, "run_benchmark", the_other_run_finishes_first)
    code, _, err = run_cli(capsys, "calibrate", "--target", TARGET, "--drafter", str(folder), "--prompts",
                           str(prompts_file), "--dtype", "float32", "--max-new-tokens", "8", "--budgets", "8",
                           *(["--overwrite"] if overwrite else []))
    if not overwrite:
        assert code == 2 and (f"error: ddtree calibrate: {folder / CALIBRATION_FILE} was written by another run while "
                              "this one decoded, so it is left as it is (learned here: draft temperature ") in err
        assert (folder / CALIBRATION_FILE).read_text() == theirs
        return
    assert code == 0, err
    written = json.loads((folder / CALIBRATION_FILE).read_text())
    assert written["prompts"] == str(prompts_file) and written["temperatures"]["8"] != 1.5  # this run's, learned here


@pytest.mark.parametrize("content", [
    '{"format_version": 1, "temperatures": {"8": 1.1}, "graft_acceptance": {"context": {"1": [Infinity, 5]}}}',
    '{"format_version": 1, "temperatures": {"8": true}, "graft_acceptance": {}}',
    '{"format_version": 1, "temperatures": {"8": 1e-300}, "graft_acceptance": {}}',
    '{"format_version": 1, "temperatures": {"-8": 1.1}, "graft_acceptance": {}}',
    '{"format_version": 1, "temperatures": {"0": 1.1}, "graft_acceptance": {}}',  # no budget is 0
    '{"format_version": 1, "temperatures": {}, "graft_acceptance": {"context": {"1": "12"}}}',
    "[" * 100000 + "]" * 100000,
    # a TypeError traceback when generate compared the settings (found in a review)
    '{"format_version": 1, "temperatures": {"8": 1.0}, "graft_acceptance": {}, "decoded_with": 7}',
    '{"format_version": 1, "temperatures": {"8": 1.0}, "graft_acceptance": {}, "decoded_with": ["lookup"]}',
])
def test_a_broken_calibration_file_is_one_line(capsys, tmp_path, tiny_target, prompts_file, content):
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    (folder / CALIBRATION_FILE).write_text(content)
    line = _bad(capsys, "generate", "--target", TARGET, "--drafter", str(folder), "--prompt", "Hi", "--max-new-tokens", "2")
    assert f"calibration file {folder / CALIBRATION_FILE} cannot be read" in line


def test_generate_online_calibration_starts_from_the_folders_calibration(capsys, tmp_path, tiny_target, monkeypatch,
                                                                         sized_rows):
    import ddtree.cli
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    shipped = OnlineCalibration()
    shipped.log_temperatures[32] = 0.5
    save_calibration(folder / CALIBRATION_FILE, shipped, {})
    given = []
    real = ddtree.cli.generate
    def spy(*args, **kwargs):  # what generate is handed, before it learns anything
        given.append(None if args[10] is None else args[10].copy(frozen=args[10].frozen))
        return real(*args, **kwargs)

    monkeypatch.setattr(ddtree.cli, "generate", spy)
    generate = ["generate", "--target", TARGET, "--drafter", str(folder), "--prompt", "Hi", "--max-new-tokens", "3"]
    assert run_cli(capsys, *generate, "--online-calibration")[0] == 0
    assert run_cli(capsys, *generate)[0] == 0
    learning, default = given
    assert not learning.frozen and learning.log_temperature(32) == pytest.approx(0.5)  # learning, from the file's
    assert default is None  # generate itself then takes the drafter's (frozen) file
    assert json.loads((folder / CALIBRATION_FILE).read_text())["temperatures"]["32"] == pytest.approx(1.648721)


def test_calibrate_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, tiny_target, prompts_file, sized_rows,
                                                            unwarmed):
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    common = ["--target", TARGET, "--prompts", str(prompts_file), "--dtype", "float32", "--max-new-tokens", "4"]
    assert "give --drafter FOLDER, not random" in _bad(capsys, "calibrate", *common)
    assert "drop --calibration and --online-calibration" in _bad(capsys, "calibrate", *common, "--drafter", str(folder),
                                                                  "--online-calibration")
    (folder / CALIBRATION_FILE).write_text("{}")
    assert "exists and decoding uses it by default; pass --overwrite" in _bad(capsys, "calibrate", *common,
                                                                             "--drafter", str(folder))
    assert (folder / CALIBRATION_FILE).read_text() == "{}"
    # ...and decoding with a broken one says which file and what to do
    line = _bad(capsys, "bench", *common, "--drafter", str(folder), "--methods", "dflash")
    assert f"calibration file {folder / CALIBRATION_FILE} cannot be read" in line and "--calibration none" in line
    assert run_cli(capsys, "bench", *common, "--drafter", str(folder), "--methods", "dflash", "--calibration",
                   "none")[0] == 0
    assert "no such file" in _bad(capsys, "bench", *common, "--drafter", str(folder), "--methods", "dflash",
                                  "--calibration", str(tmp_path / "missing.json"))
    calibration = ["--target", TARGET, "--drafter", str(folder), "--calibration", str(folder / CALIBRATION_FILE)]
    for command in (["bench", "--prompts", str(prompts_file), "--methods", "ar"], ["generate", "--method", "ar",
                                                                                   "--prompt", "Hi"]):
        assert "method 'ar' drafts none" in _bad(capsys, *command, *calibration)
    assert run_cli(capsys, "calibrate", *common, "--drafter", str(folder), "--overwrite", "--budgets", "4")[0] == 0
    assert json.loads((folder / CALIBRATION_FILE).read_text())["format_version"] == 1
    # a good file to start from, which calibrate would ignore without a word (mutation review 42, c19)
    line = _bad(capsys, "calibrate", *common, "--drafter", str(folder), "--overwrite", "--calibration",
                str(folder / CALIBRATION_FILE))
    assert "always learns from a fresh start: drop --calibration and --online-calibration" in line
    # One new token a prompt is the target's own: no round is verified, nothing learned. It wrote an empty file
    # (with --overwrite, over a good one), which still displaced the drafter's own calibration.
    learned = (folder / CALIBRATION_FILE).read_text()
    line = _bad(capsys, "calibrate", *common[:-1], "1", "--drafter", str(folder), "--overwrite", "--budgets", "4")
    assert "no round was verified (--max-new-tokens 1" in line and (folder / CALIBRATION_FILE).read_text() == learned


def test_a_calibration_temperature_too_large_for_a_float_is_one_line(tmp_path):
    """An OverflowError from math.isfinite before."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"format_version": FORMAT_VERSION, "temperatures": {"32": 10 ** 400}, "graft_acceptance": {}}))
    with pytest.raises(DDTreeError, match=f"calibration file {path} cannot be read"):
        load_calibration(path)


@pytest.mark.parametrize("content, message", [
    ('{"format_version": 1, "graft_acceptance": {}}', "missing field temperatures"),  # a bare KeyError's name before
    ('{"format_version": 1, "temperatures": {"8": 1.1}}', "missing field graft_acceptance"),
    ('{"format_version": 1, "temperatures": [1.1], "graft_acceptance": {}}', "temperatures [1.1] is not an object"),
    ('[1, 2]', "it holds [1, 2], not a JSON object"),
    # a misspelt lookup was taken, and its table never read: the lookup's nodes scored the prior
    ('{"format_version": 1, "temperatures": {}, "graft_acceptance": {"contxt": {"1": [1, 2]}}}',
     "graft_acceptance 'contxt' is not a lookup: context or corpus"),
    # a lookup's table that is not one (an AttributeError's "'list' object has no attribute 'items'" else)
    ('{"format_version": 1, "temperatures": {}, "graft_acceptance": {"context": [1, 2]}}',
     "graft_acceptance context [1, 2] is not an object of depths"),
    # more accepted than rounds: a grafted node priced above certainty, (5 + 1) / (2 + 2), in every tree it joins
    ('{"format_version": 1, "temperatures": {}, "graft_acceptance": {"context": {"1": [5, 2]}}}',
     "graft_acceptance context 1: [5, 2] is not [accepted, rounds]"),
    # another format's fields may mean other things: refused, not used as if they were this one's
    ('{"format_version": 2, "temperatures": {"8": 1.5}, "graft_acceptance": {}}',
     "format_version 2, this code reads 1"),
    # outside the e^-2..e^2 that learning keeps to: a hand-edited file, refused as its other fields are
    ('{"format_version": 1, "temperatures": {"8": 50.0}, "graft_acceptance": {}}',
     "temperature 8: 50.0 is not a number within e^-2..e^2"),
    ('{"format_version": 1, "temperatures": {"chain": 0.1}, "graft_acceptance": {}}',
     "temperature chain: 0.1 is not a number within e^-2..e^2"),
])
def test_a_calibration_files_bad_field_is_named(tmp_path, content, message):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    with pytest.raises(DDTreeError) as error:
        load_calibration(path)
    assert str(error.value) == (f"calibration file {path} cannot be read ({message}); rerun `ddtree calibrate` with "
                                "--overwrite, or decode with --calibration none")


def test_the_weights_fingerprint_tells_apart_weights_that_differ_past_the_header(tmp_path):
    """A calibration file learned on other weights is noted by this fingerprint: weights of one size and header
    (retrained, or another seed) differ past the header's chunk. It reads 16 chunks of 64 KiB spread over each file:
    the whole of a 1 MiB one, and the end of a larger one."""
    def fingerprint(name: str, data: bytes) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(data)
        return weights_fingerprint(tmp_path / name)

    for size, changed in [(1 << 20, 700_000), (3 << 20, (3 << 20) - 1)]:
        data = bytearray(random.Random(size).randbytes(size))
        before = fingerprint(f"{size}-before", bytes(data))
        data[changed] ^= 0xFF
        assert fingerprint(f"{size}-after", bytes(data)) != before, (size, changed)


def test_the_weights_fingerprint_of_the_same_weights_stays_what_calibration_files_recorded(tmp_path):
    """calibration.json keeps the fingerprint it was learned on: the same bytes must hash as they did (16 chunks of
    64 KiB), or every file written before reads as learned on other weights."""
    (tmp_path / "model.safetensors").write_bytes(bytes(i * 7 % 251 for i in range(300_000)))
    assert weights_fingerprint(tmp_path) == "569ea53849ad7919"


def test_the_weights_fingerprint_reads_a_drafter_saved_as_pytorch_bin(tmp_path):
    """A drafter saved without safetensors holds pytorch_model.bin: read as no weights (None), retrained .bin weights
    would keep the old calibration file with no note that it was learned on other weights."""
    (tmp_path / "pytorch_model.bin").write_bytes(random.Random(0).randbytes(1000))
    before = weights_fingerprint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(random.Random(1).randbytes(1000))
    assert before is not None and weights_fingerprint(tmp_path) != before


def test_the_weights_fingerprint_leaves_out_the_folders_corpus(tmp_path):
    """The corpus an export ships beside the weights (corpus.safetensors) is no weight: one added or replaced after
    `ddtree calibrate` must not make the calibration read as learned on other weights (a false note on every decode)."""
    (tmp_path / "model.safetensors").write_bytes(random.Random(0).randbytes(1000))
    before = weights_fingerprint(tmp_path)
    (tmp_path / CORPUS_FILE).write_bytes(random.Random(1).randbytes(1000))
    assert weights_fingerprint(tmp_path) == before is not None


@pytest.mark.parametrize("calibration, message", [
    ({"temperatures": {"8": 1.0}}, "missing field graft_acceptance"),
    ([], "it holds [], not a JSON object"),  # [] and {} were taken as no calibration, without a word
    ({}, "missing field temperatures"),
    # read as given, it failed later with a traceback where decoding compared the settings it was learned with
    ({"temperatures": {"8": 1.0}, "graft_acceptance": {}, "decoded_with": ["lookup"]},
     "decoded_with ['lookup'] is not an object of the lookup, redraft and corpus it was learned with"),
])
def test_a_broken_calibration_in_the_drafters_config_names_the_folder_and_field(capsys, tmp_path, tiny_target,
                                                                                 calibration, message, sized_rows):
    """It said only "the drafter's config.json has a calibration that cannot be read ('graft_acceptance')"."""
    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    edit_config(folder, dflash_config={**config["dflash_config"], "calibration": calibration})
    generate = ["generate", "--target", TARGET, "--drafter", str(folder), "--prompt", "Hi", "--max-new-tokens", "2"]
    assert _bad(capsys, *generate) == (f"error: drafter {folder}: dflash_config.calibration in its config.json cannot be "
                                       f"read ({message}): remove the field, or decode with --calibration none")
    assert run_cli(capsys, *generate, "--calibration", "none")[0] == 0


def test_calibration_none_leaves_out_the_files_and_the_configs_calibration_and_says_what_stays(capsys, tmp_path,
                                                                                               tiny_target):
    """`--calibration none` ("none = off") still applied a model.calibrate drafter's per-position draft_temperatures,
    and nothing said so (found in a review): they are the drafter's own, as its weights are, and stay; the help says."""
    import ddtree.cli
    from ddtree.arguments import build_parser

    folder = tiny_drafter_folder(tiny_target, tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    edit_config(folder, dflash_config={**config["dflash_config"], "draft_temperatures": [0.5] * (config["block_size"] - 1),
                                       "calibration": {"temperatures": {"8": 1.5}, "graft_acceptance": {}}})
    args = build_parser().parse_args(["generate", "--target", TARGET, "--drafter", str(folder), "--prompt", "Hi",
                                      "--calibration", "none"])
    runner = ddtree.cli._drafter_runner(args, *tiny_target)
    assert runner.default_calibration is None and runner.temperatures[:, 0].tolist() == [0.5] * (config["block_size"] - 1)
    flag = next(action for action in build_parser()._subparsers._group_actions[0].choices["generate"]._actions
                if "--calibration" in action.option_strings)
    assert "none = neither it nor the calibration the drafter's config holds" in flag.help
    assert "draft_temperatures stay" in flag.help


def test_the_docs_that_run_ddtree_say_make_setup_gives_it_and_the_set_up_stays_two_commands():
    """The README's Decoding section and docs/decoding.md ran `.venv/bin/ddtree`, which a fresh clone lacks, and no
    doc named `make setup`, the target that makes only it (found in a docs review). The README's set-up block stays
    the two commands it has (a CI rule): the note goes where `.venv/bin/ddtree` is first run."""
    root = Path(__file__).parents[2]
    readme = (root / "README.md").read_text()
    setup = readme.split("## Set-up on a fresh machine\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in setup.strip().splitlines()] == [["make", "train"], ["make", "test"]]
    decoding = readme.split("\n## Decoding\n", 1)[1]
    for doc, text in [("README.md", decoding), ("docs/decoding.md", (root / "docs/decoding.md").read_text())]:
        before_first_run = text.split(".venv/bin/ddtree ", 1)[0]
        assert "`make setup`" in before_first_run, doc
    assert re.search(r"^setup: ", (root / "Makefile").read_text(), re.M)


def test_bench_refuses_an_empty_raw_prompt_before_the_target_loads(capsys, tmp_path, monkeypatch):
    """{"prompt": ""} was refused only after the tokenizer and the target loaded (seconds and 1.5 GB for one line),
    where `generate --raw --prompt ""` is refused before (found in a review of the edges)."""
    from ddtree.bench import read_prompts

    path = tmp_path / "empty.jsonl"
    path.write_text('{"prompt": "Hello"}\n{"prompt": ""}\n')
    with pytest.raises(DDTreeError) as raised:
        read_prompts(path)
    message = (f'{path}:2: "prompt" is empty: give the text the target continues from (a raw prompt gets no chat '
               "template)")
    assert str(raised.value) == message
    monkeypatch.setattr(ddtree.cli, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    assert _bad(capsys, "bench", "--target", TARGET, "--prompts", str(path), "--methods", "ar") == f"error: {message}"


@pytest.mark.parametrize("sent, line", [("SIGTERM", "stopped by SIGTERM"), ("SIGINT", "interrupted")])
def test_a_bench_stopped_mid_run_says_so_on_a_line_of_its_own_after_its_progress_bar(capsys, prompts_file, monkeypatch,
                                                                                      sent, line, python_sigint):
    """Found in a review (2026-12-04): the stop's one line was glued to the end of the open progress bar
    (`... dflash tau=7.88]stopped by SIGTERM`), and the bar was drawn again after it, as the last line of the log."""
    import signal

    import ddtree.bench

    format_tau = ddtree.bench.format_tau

    def signalled(*args, **kwargs):  # as the first timed run ends, its tau shown on the bar
        monkeypatch.setattr(ddtree.bench, "format_tau", format_tau)
        os.kill(os.getpid(), getattr(signal, sent))
        return format_tau(*args, **kwargs)

    monkeypatch.setattr(ddtree.bench, "format_tau", signalled)
    code, _, err = run_cli(capsys, "bench", "--target", TARGET, "--drafter", "random", "--prompts", str(prompts_file),
                           "--methods", "ar", "--max-new-tokens", "4", "--dtype", "float32")
    assert code == 128 + getattr(signal, sent)
    assert "bench:" in err and err.endswith(f"\n{line}\n"), repr(err[-300:])
