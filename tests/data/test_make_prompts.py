"""Tests of data/make_prompts.py: deterministic, held-out eval prompts, shipped files reproducible.

    .venv/bin/pytest -q tests/data/test_make_prompts.py
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "data"))
import make_prompts  # noqa: E402

from ddtree.errors import DDTreeError  # noqa: E402


def contents(records):
    return [r["messages"][0]["content"] for r in records]


def test_build_is_deterministic_and_eval_is_held_out():
    train, evaluation = make_prompts.build(seed=0, num_coding=300, num_chat=300, num_eval=40)
    again_train, again_eval = make_prompts.build(seed=0, num_coding=300, num_chat=300, num_eval=40)
    assert (train, evaluation) == (again_train, again_eval)
    assert contents(make_prompts.build(seed=1, num_coding=300, num_chat=300, num_eval=40)[0]) != contents(train)

    assert len(train) == 600 and len({r["id"] for r in train}) == 600
    assert len(evaluation) == 40 and sum(r["id"].startswith("eval-code/") for r in evaluation) == 20
    assert not set(contents(train)) & set(contents(evaluation))
    # Coding eval prompts come only from held-out modules.
    for record in evaluation:
        if record["id"].startswith("eval-code/"):
            qual = record["id"].split("/")[1]
            assert any(qual == m or qual.startswith(m + ".") for m in make_prompts.EVAL_MODULES), record
    train_modules = {r["id"].split("/")[1] for r in train if r["id"].startswith("code/")}
    assert not {m for m in make_prompts.EVAL_MODULES if any(t == m or t.startswith(m + ".") for t in train_modules)}


def test_first_sentence_drops_signature_lines():
    doc = "getopt(args, options[, long_options]) -> opts, args\n\nParse command line options.  More text."
    assert make_prompts.first_sentence(doc) == "Parse command line options."
    assert make_prompts.first_sentence("make an iterator\nthat groups.\n\nDetails.") == "Make an iterator that groups."
    # Builtins list one signature per calling form (str, int): none of them is the summary.
    two = "str(object='') -> str\nstr(bytes_or_buffer[, encoding[, errors]]) -> str\n\nCreate a new string object."
    assert make_prompts.first_sentence(two) == "Create a new string object."


@pytest.mark.skipif(sys.version_info[:2] != make_prompts.SHIPPED_PYTHON,
                    reason="the coding prompts come from this Python's standard library, the shipped ones from 3.11's")
def test_shipped_prompt_files_are_what_the_script_writes(tmp_path):
    assert make_prompts.main(["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]) == 0
    assert (tmp_path / "eval.jsonl").read_text() == (ROOT / "data/eval_prompts.jsonl").read_text()
    assert (tmp_path / "train.jsonl").read_text() == (ROOT / "data/prompts/train_prompts.jsonl").read_text()
    for line in (ROOT / "data/eval_prompts.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert set(record) == {"id", "messages"} and record["messages"][0]["role"] == "user"


def test_written_files_follow_the_umask(tmp_path):
    # Written through a temp file (0600 as created): the final file must be readable as the umask allows.
    previous = os.umask(0o022)
    try:
        make_prompts.write_jsonl([{"id": "a", "messages": []}], tmp_path / "sub" / "out.jsonl")
    finally:
        os.umask(previous)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["out.jsonl"]  # no temp file left behind
    assert stat.S_IMODE((tmp_path / "sub" / "out.jsonl").stat().st_mode) == 0o644
    assert (tmp_path / "sub" / "out.jsonl").read_text() == '{"id": "a", "messages": []}\n'


def other_prompts_line(flag: str, path) -> str:
    """The one line a run that would replace a file of other prompts stops with."""
    return (f"error: {flag} {path} exists and holds other prompts than these settings make; pass --overwrite to "
            "replace it, or give another path")


def test_the_shipped_files_are_not_replaced_by_other_prompts_unasked(tmp_path, capsys):
    """The defaults are the repository's files: `--num-eval 10` rewrote data/eval_prompts.jsonl with 10 prompts."""
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    small = ["--num-coding", "20", "--num-chat", "20", "--num-eval", "4"]
    assert make_prompts.main([*out, *small]) == 0
    written = (tmp_path / "eval.jsonl").read_text()
    assert make_prompts.main([*out, *small]) == 0  # the same prompts again: nothing to refuse
    capsys.readouterr()
    assert make_prompts.main([*out, *small[:-1], "6"]) == 2
    assert capsys.readouterr().err.strip() == other_prompts_line("--eval-out", tmp_path / "eval.jsonl")
    assert (tmp_path / "eval.jsonl").read_text() == written
    # Refused for its --eval-out, a job writes no training file either: a refusal changes no file.
    new_train = ["--train-out", str(tmp_path / "new.jsonl"), *out[2:]]
    assert make_prompts.main([*new_train, *small[:-1], "6"]) == 2 and not (tmp_path / "new.jsonl").exists()
    assert make_prompts.main([*out, *small[:-1], "6", "--overwrite"]) == 0
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 6


def test_a_training_file_that_holds_other_prompts_is_not_replaced_unasked(tmp_path, capsys):
    """The refusal above is for --eval-out; the training file is the larger one to lose. Nothing is written: the
    evaluation file goes to a new path, which must stay absent."""
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    small = ["--num-coding", "20", "--num-chat", "20", "--num-eval", "4"]
    assert make_prompts.main([*out, *small]) == 0
    written = (tmp_path / "train.jsonl").read_text()
    capsys.readouterr()
    other = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "new_eval.jsonl")]
    assert make_prompts.main([*other, "--num-coding", "21", *small[2:]]) == 2
    assert capsys.readouterr().err.strip() == other_prompts_line("--train-out", tmp_path / "train.jsonl")
    assert (tmp_path / "train.jsonl").read_text() == written and not (tmp_path / "new_eval.jsonl").exists()


def test_an_existing_file_that_is_not_utf8_is_refused_as_other_prompts(tmp_path, capsys):
    """A UTF-16 file (or any binary one) at the path stopped the comparison with a UnicodeDecodeError traceback."""
    (tmp_path / "train.jsonl").write_bytes("prompts\n".encode("utf-16"))
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    assert make_prompts.main([*out, "--num-coding", "20", "--num-chat", "20", "--num-eval", "4"]) == 2
    assert capsys.readouterr().err.strip() == other_prompts_line("--train-out", tmp_path / "train.jsonl")
    assert (tmp_path / "train.jsonl").read_bytes() == "prompts\n".encode("utf-16")
    assert not (tmp_path / "eval.jsonl").exists()


def test_the_summary_line_counts_the_coding_and_chat_prompts_written(tmp_path, capsys):
    """The line the user reads to confirm the mix. The other runs ask for as many of each kind, where swapped counts
    read the same."""
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    assert make_prompts.main([*out, "--num-coding", "30", "--num-chat", "10", "--num-eval", "4"]) == 0
    ids = [json.loads(line)["id"] for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert sum(name.startswith("code/") for name in ids) == 30 and len(ids) == 40
    assert f"wrote 40 training prompts (30 coding, 10 chat) to {tmp_path / 'train.jsonl'}\n" in capsys.readouterr().out


def test_a_refusal_under_another_python_says_which_python_wrote_the_files(tmp_path, monkeypatch, capsys):
    """Another Python's standard library writes other coding prompts: the shipped files were refused with no reason."""
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    small = ["--num-coding", "20", "--num-chat", "20", "--num-eval", "4"]
    assert make_prompts.main([*out, *small]) == 0
    monkeypatch.setattr(make_prompts, "SHIPPED_PYTHON", (2, 7))
    assert make_prompts.main([*out, *small[:-1], "6"]) == 2  # not a shipped file: no word of Python
    assert "make; pass --overwrite" in capsys.readouterr().err
    monkeypatch.setattr(make_prompts, "SHIPPED_FILES", {(tmp_path / "eval.jsonl").resolve()})  # as if it were data/eval_prompts.jsonl
    assert make_prompts.main([*out, *small[:-1], "6"]) == 2
    this = ".".join(map(str, sys.version_info[:2]))
    assert (f"holds other prompts than these settings make (the shipped files were written with Python 2.7, whose "
            f"standard library gives other coding prompts than this Python {this}'s: run it with 2.7 to write them "
            "again); pass --overwrite") in capsys.readouterr().err


def test_the_files_named_as_shipped_are_the_ones_the_repository_ships():
    """The test above stands in its own path for them; a wrong one here left a refusal of the real files under
    another Python without the reason."""
    assert make_prompts.SHIPPED_FILES == {(ROOT / "data/eval_prompts.jsonl").resolve(),
                                          (ROOT / "data/prompts/train_prompts.jsonl").resolve()}
    assert all(path.is_file() for path in make_prompts.SHIPPED_FILES)


def test_counts_below_one_prompt_and_one_file_for_both_are_refused(tmp_path, capsys):
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    for extra, said in [(["--num-chat", "-5"], "error: --num-chat -5: give a count of at least 0"),
                        (["--num-coding", "-1"], "error: --num-coding -1: give a count of at least 0"),
                        (["--num-eval", "0"], "error: --num-eval 0: give a count of at least 1"),
                        (["--num-coding", "0", "--num-chat", "0"], "error: --num-coding 0 --num-chat 0: no training "
                                                                   "prompts to write; give at least one"),
                        (["--eval-out", str(tmp_path / "train.jsonl")], "error: --train-out and --eval-out are both"),
                        # one file spelled two ways: the evaluation prompts replaced the training prompts
                        (["--eval-out", str(tmp_path / "sub" / ".." / "train.jsonl")],
                         "error: --train-out and --eval-out are both"),
                        # more than the held-out modules and topics make: 218 were written without a word
                        (["--num-eval", "300"], "error: --num-eval 300: the held-out modules and topics make only "),
                        # more than the standard library gives: 5018 were written, said only in the summary line
                        (["--num-coding", "100000"], "error: --num-coding 100000: the 70 training modules of this "
                                                     "Python's standard library make only ")]:
        assert make_prompts.main([*out, *extra]) == 2
        assert capsys.readouterr().err.strip().startswith(said)
    assert not list(tmp_path.iterdir())


def test_an_eval_path_under_a_file_is_refused_before_the_training_file_is_written(tmp_path, capsys):
    """Found only at its write, after the training file's: the run failed having written half its output."""
    (tmp_path / "notes").write_text("a file\n")
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "notes" / "eval.jsonl")]
    assert make_prompts.main([*out, "--num-coding", "20", "--num-chat", "20", "--num-eval", "4"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: cannot write {tmp_path / 'notes' / 'eval.jsonl'}: "
                                               f"{tmp_path / 'notes'} is a file, not a folder; give a path in a "
                                               "writable folder")
    assert [path.name for path in tmp_path.iterdir()] == ["notes"]


def test_an_evaluation_set_one_prompt_short_is_refused(tmp_path, capsys):
    """The shortfall at its boundary: one chat prompt more than the held-out topics make, every coding prompt paired."""
    import re

    from ddtree.errors import DDTreeError

    with pytest.raises(DDTreeError) as everything:  # what the held-out sources make, as the refusal counts it
        make_prompts.build(seed=0, num_coding=10, num_chat=10, num_eval=100_000)
    coding, chat = map(int, re.search(r"make only (\d+) coding and (\d+) chat", str(everything.value)).groups())
    assert coding > chat  # so that the coding half of one more pair is there, and only its chat prompt is missing
    num_eval = 2 * (chat + 1)
    out = ["--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    assert make_prompts.main([*out, "--num-coding", "10", "--num-chat", "10", "--num-eval", str(num_eval)]) == 2
    assert f"({num_eval - 1} in all); ask for fewer" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("num_eval", [1, 5])
def test_an_odd_evaluation_count_is_written_exactly_with_the_extra_prompt_chat(num_eval):
    """Every other test asks for an even count, where rounding either half up or down reads the same: an odd one
    wrote one prompt too many (a coding half rounded up) or was refused as one short (a chat half rounded down)."""
    evaluation = make_prompts.build(seed=0, num_coding=20, num_chat=20, num_eval=num_eval)[1]
    kinds = [record["id"].split("/")[0] for record in evaluation]
    assert kinds == ["eval-code", "eval-chat"] * (num_eval // 2) + ["eval-chat"]


def test_an_eval_word_problem_that_training_holds_word_for_word_is_drawn_again(tmp_path):
    """Both sets fill the same word-problem templates: seeds 25 and 33 stopped with an AssertionError traceback,
    and under `python -O` (the assert skipped) wrote an evaluation prompt that training also holds."""
    for seed in (25, 33):
        train, evaluation = make_prompts.build(seed=seed, num_coding=2400, num_chat=1600, num_eval=40)
        assert len(evaluation) == 40 and not set(contents(train)) & set(contents(evaluation))
    out = ["--seed", "25", "--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    done = subprocess.run([sys.executable, "-O", str(ROOT / "data/make_prompts.py"), *out], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    train, evaluation = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                         for name in ("train.jsonl", "eval.jsonl"))
    assert len(evaluation) == 40 and not set(contents(train)) & set(contents(evaluation))


def test_a_word_problem_whose_every_filling_training_holds_is_refused_by_its_cause():
    """With every filling taken (a --num-chat in the tens of thousands) the redraws must stop with what to change:
    without it the taken prompt went on to the last check, which says to try another --seed, to no avail."""
    import random

    from ddtree.errors import DDTreeError

    template = make_prompts.WORD_PROBLEMS[0]  # fills {a} from 12..480 and {b} from 2..11
    taken = frozenset(template.format(a=a, b=b) for a in range(12, 481) for b in range(2, 12))
    with pytest.raises(DDTreeError) as refused:
        make_prompts.word_problem_candidates(1, random.Random(0), "eval", avoid=taken)
    assert str(refused.value).startswith("--num-chat: the training prompts hold nearly every filling of word problem 0")
    assert str(refused.value).endswith("ask for fewer chat prompts")


def test_an_eval_prompt_left_in_training_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """The last check before writing: a word-problem draw that ignores the training texts must not be written."""
    draw = make_prompts.word_problem_candidates
    monkeypatch.setattr(make_prompts, "word_problem_candidates", lambda count, rng, tag, avoid=frozenset(): draw(count, rng, tag))
    out = ["--seed", "25", "--train-out", str(tmp_path / "train.jsonl"), "--eval-out", str(tmp_path / "eval.jsonl")]
    assert make_prompts.main(out) == 2
    assert capsys.readouterr().err.strip() == ("error: --seed 25: the evaluation prompts ['eval-chat/math-eval/1/1'] are "
                                               "also training prompts; try another --seed")
    assert not list(tmp_path.iterdir())


def test_what_the_shipped_evaluation_shares_with_training_is_what_the_readme_says():
    """data/README.md said the evaluation used *other* topic lists and texts, and the docstring that the two files
    "cannot overlap": the word problems of both fill the same templates, so 2 of the 40 evaluation prompts are
    training prompts with other numbers. Nothing else shares a text once numbers are set aside, and the training
    file repeats one text; the README gives these counts, which this test holds it to."""
    import re

    read = lambda path: [json.loads(line) for line in path.read_text().splitlines()]  # noqa: E731
    train, evaluation = read(ROOT / "data/prompts/train_prompts.jsonl"), read(ROOT / "data/eval_prompts.jsonl")
    numbers_aside = lambda text: re.sub(r"\d+", "#", text)  # noqa: E731
    trained = {numbers_aside(text) for text in contents(train)}
    twins = [record["id"] for record in evaluation if numbers_aside(record["messages"][0]["content"]) in trained]
    assert twins == ["eval-chat/math-eval/3/3", "eval-chat/math-eval/0/0"]
    assert not set(contents(train)) & set(contents(evaluation))
    assert len(set(contents(train))) == 3999
    readme = (ROOT / "data/README.md").read_text()
    assert "differ from training prompts only in their numbers" in readme and "3999 distinct texts" in readme
    assert "cannot overlap" not in make_prompts.__doc__


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize("flag", ["--train-out", "--eval-out"])
def test_an_output_path_that_is_a_folder_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, flag, overwrite):
    """It was refused as holding "other prompts than these settings make" and, with --overwrite, an IsADirectoryError
    traceback at the rename."""
    monkeypatch.setattr(make_prompts, "build", lambda *args: pytest.fail("built the prompts first"))
    (tmp_path / "adir").mkdir()
    paths = {"--train-out": str(tmp_path / "train.jsonl"), "--eval-out": str(tmp_path / "eval.jsonl"),
             flag: str(tmp_path / "adir")}
    assert make_prompts.main([*(part for item in paths.items() for part in item), *overwrite]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {flag} {tmp_path / 'adir'} is a folder; give the path of the JSONL file to write "
                   f"({tmp_path / 'adir' / 'prompts.jsonl'}, say)")
    assert [path.name for path in tmp_path.iterdir()] == ["adir"] and not any((tmp_path / "adir").iterdir())


def test_a_module_in_both_lists_is_named_alone(monkeypatch):
    """A maintainer who adds a module to EVAL_MODULES that TRAIN_MODULES holds is told that module, the one to move,
    not every module of both lists."""
    shared = make_prompts.TRAIN_MODULES[0]
    monkeypatch.setattr(make_prompts, "EVAL_MODULES", [*make_prompts.EVAL_MODULES, shared])
    with pytest.raises(DDTreeError) as error:
        make_prompts.build(0, 8, 8, 8)
    assert str(error.value) == (f"make_prompts.py: [{shared!r}] are in both TRAIN_MODULES and EVAL_MODULES; keep each "
                                "module in one list")
