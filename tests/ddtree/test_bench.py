"""ddtree.bench's method keys and summaries (the arithmetic `ddtree bench` and the training-time evaluation
share), and how it reads a prompts file.

    .venv/bin/pytest -q tests/ddtree/test_bench.py
"""

import pytest

from ddtree.bench import CHAIN, acceptance_summary, budget_of, iter_json_lines, load_prompts, method_keys, summarize, tree_key
from ddtree.errors import DDTreeError


def test_method_keys_are_formatted_and_parsed_one_way():
    assert [key for key, _, _ in method_keys(["ar", "dflash", "ddtree"], [16, 32])] == ["ar", CHAIN, "ddtree@16", "ddtree@32"]
    assert tree_key(32) == "ddtree@32" and budget_of(tree_key(32)) == 32
    assert budget_of(CHAIN) is None and budget_of("ar") is None


def rounds(*specs):
    """Round dicts as run_benchmark records them: (committed, expected, accepted_depth, draft_s, verify_s, other_s)."""
    names = ("committed", "expected", "accepted_depth", "draft_s", "verify_s", "other_s")
    return [dict(zip(names, spec), tree_size=4) for spec in specs]


ROWS = [  # two prompts, one method
    {"id": "a", "methods": {"ddtree@4": {"new_tokens": [1, 2, 3, 4, 5], "seconds": 0.5,
                                         "rounds": rounds((3, 2.5, 2, 0.01, 0.02, 0.001), (2, 1.5, 1, 0.01, 0.02, 0.001))}}},
    {"id": "b", "methods": {"ddtree@4": {"new_tokens": [6, 7], "seconds": 0.25,
                                         "rounds": rounds((1, 1.25, 0, 0.03, 0.04, 0.002))}}},
]


def test_summaries_are_computed_from_the_per_prompt_rows():
    acceptance = acceptance_summary(ROWS, "ddtree@4")
    assert acceptance == {"tau": 2.0, "expected_tau": pytest.approx(5.25 / 3), "rounds": 3, "new_tokens": 7,
                          "accepted_depth_counts": {0: 1, 1: 1, 2: 1}}
    full = summarize(ROWS, "ddtree@4")
    assert {name: full[name] for name in acceptance} == acceptance  # the evaluation's figures are bench's
    assert full["seconds"] == 0.75 and full["tokens_per_s"] == pytest.approx(7 / 0.75)
    assert full["draft_ms"] == pytest.approx(50 / 3) and full["verify_ms"] == pytest.approx(80 / 3)
    assert full["round_ms"] == pytest.approx(full["draft_ms"] + full["verify_ms"] + full["other_ms"])
    assert list(full)[-1] == "accepted_depth_counts"  # results.json keeps its field order


# ----------------------------------------------------------------------------- reading a prompts file


def read(path):
    return [record for _, _, record in iter_json_lines(path)]


@pytest.mark.parametrize("content, line, offset, byte", [
    ('{"prompt": "ok"}\n{"prompt": "café"}\n'.encode("latin-1"), 2, 17 + 15, "0xe9"),  # latin-1 text
    ('{"prompt": "ok"}\n'.encode("utf-16"), 1, 0, "0xff"),  # UTF-16, byte-order mark first
])
def test_a_file_that_is_not_utf8_names_the_line_and_byte(tmp_path, content, line, offset, byte):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(DDTreeError) as error:
        read(path)
    assert str(error.value) == (f"{path}:{line}: not UTF-8 (byte {byte} at byte offset {offset} of the file); "
                                "save it as UTF-8 JSONL, one JSON object per line")


def test_a_utf8_byte_order_mark_and_windows_line_ends_are_read(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes('\ufeff{"prompt": "café"}\r\n\r\n{"prompt": "b"}\r\n'.encode("utf-8"))
    assert read(path) == [{"prompt": "café"}, {"prompt": "b"}]


@pytest.mark.parametrize("bad_line, problem", [
    ('{"prompt" "b"}', "Expecting ':' delimiter at column 11"),
    ('{"prompt": "b"} x', "Extra data at column 17"),
    ('{"prompt": "\x01"}', "Invalid control character at column 13"),  # json's own message ends in "at"
    ('{"prompt": ', "the line ends before the JSON object is complete: was it cut off?"),
    ('{"prompt": "a long answer cut o', "the line ends before the JSON object is complete: was it cut off?"),
])
def test_invalid_json_says_what_and_where_on_the_line(tmp_path, bad_line, problem):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + bad_line + "\n")
    with pytest.raises(DDTreeError) as error:
        read(path)
    assert str(error.value) == f"{path}:2: not valid JSON ({problem}); each line must be one JSON object"


@pytest.mark.parametrize("limit", [0, -2])
def test_a_limit_below_one_is_refused(tmp_path, limit):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(DDTreeError, match=f"limit {limit} must be at least 1, or None for every prompt"):
        load_prompts(path, tokenizer=None, limit=limit)
