"""ddtree.bench's method keys and summaries: the arithmetic `ddtree bench` and the training-time evaluation share.

    .venv/bin/pytest -q tests/ddtree/test_bench.py
"""

import pytest

from ddtree.bench import CHAIN, acceptance_summary, budget_of, method_keys, summarize, tree_key


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
