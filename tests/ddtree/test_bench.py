"""ddtree.bench's method keys and summaries (the arithmetic `ddtree bench` and the training-time evaluation
share), and how it reads a prompts file.

    .venv/bin/pytest -q tests/ddtree/test_bench.py
"""

import copy
import dataclasses
import inspect
import json
import math
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from ddtree.bench import (CHAIN, acceptance_summary, budget_of, compare_packed_verify_cost, format_summary, iter_json_lines,
                          load_prompts, measure_verify_cost, method_keys, read_prompts, resolved_options, run_benchmark,
                          summarize, tokenize_prompts, tree_key)
from ddtree import bench, sizing, target_runner
from ddtree.calibration import OnlineCalibration
from ddtree.decoding import GenerationResult, Round, Sampling, generate
from ddtree.errors import DDTreeError
from ddtree.packed_linear import is_packed, pack_linears, packing_available, unpack_linears
from ddtree.sizing import TreeSizer
from rigged import hf_greedy  # tests/rigged.py


def test_method_keys_are_formatted_and_parsed_one_way():
    assert [key for key, _, _ in method_keys(["ar", "dflash", "ddtree"], [16, 32])] == ["ar", CHAIN, "ddtree@16", "ddtree@32"]
    assert tree_key(32) == "ddtree@32" and budget_of(tree_key(32)) == 32
    assert budget_of(CHAIN) is None and budget_of("ar") is None



@pytest.mark.parametrize("budget", [0, -4])
def test_a_budget_below_one_is_refused_by_the_library_too(budget):
    """The CLI refuses it before run_benchmark is called; run_benchmark (training's evaluation calls it) decoded budget 0
    as budget 1 (`budget or 1`), under the key "ddtree@0"."""
    with pytest.raises(DDTreeError, match=f"^budget {budget} must be at least 1$"):
        method_keys(["ar", "ddtree"], [8, budget])


def test_the_prompts_fingerprint_tells_apart_ids_order_and_tokens():
    """Two results files are paired row by row through their ids: prompts renamed, reordered or re-split give another
    fingerprint, not only other token text."""
    from ddtree.bench import prompts_fingerprint

    prompts = [{"id": "a", "prompt_ids": [1, 2]}, {"id": "b", "prompt_ids": [3]}]
    variants = [[{"id": "x", "prompt_ids": [1, 2]}, prompts[1]], prompts[::-1],
                [{"id": "a", "prompt_ids": [1]}, {"id": "b", "prompt_ids": [2, 3]}],
                [prompts[0], {"id": "b", "prompt_ids": [4]}]]  # the files differ past their first prompt only
    assert len({prompts_fingerprint(p) for p in [prompts, *variants]}) == 5

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
    assert acceptance == {"tau": 2.0, "expected_tau": pytest.approx(5.25 / 3), "rounds": 3, "tree_nodes": 4.0, "new_tokens": 7,
                          "accepted_depth_counts": {0: 1, 1: 1, 2: 1}}
    full = summarize(ROWS, "ddtree@4")
    assert {name: full[name] for name in acceptance} == acceptance  # the evaluation's figures are bench's
    assert full["seconds"] == 0.75 and full["tokens_per_s"] == pytest.approx(7 / 0.75)
    assert full["draft_ms"] == pytest.approx(50 / 3) and full["verify_ms"] == pytest.approx(80 / 3)
    assert full["round_ms"] == pytest.approx(full["draft_ms"] + full["verify_ms"] + full["other_ms"])
    assert list(full)[-1] == "accepted_depth_counts"  # results.json keeps its field order



def test_tree_nodes_is_the_mean_over_every_round_of_every_prompt():
    """The table's nodes column: ROWS' rounds all verify 4 nodes, so a maximum or a mean of per-prompt means passed."""
    rows = [{"id": str(i), "methods": {"ddtree@8": {"new_tokens": [1], "seconds": 0.1,
                                                    "rounds": [dict(r, tree_size=size) for r, size in zip(
                                                        rounds(*[(1, 1.0, 0, 0.0, 0.0, 0.0)] * len(sizes)), sizes)]}}}
            for i, sizes in enumerate([(2, 8), (8,)])]
    assert acceptance_summary(rows, "ddtree@8")["tree_nodes"] == 6.0  # (2 + 8 + 8) / 3 rounds

def clocked_generate(target, prompt_ids, method, drafter, budget, *args, **kwargs):
    """generate on a clock run_benchmark cannot disturb: 0.5 s of prefill and 4 tokens for every method, ar's in 3
    rounds of 0.3 s, a tree's or chain's in 1 round of 0.4 s."""
    if method == "ar":
        rounds = [Round(committed=1, tree_size=0, verify_s=0.3) for _ in range(3)]
    else:
        rounds = [Round(committed=3, tree_size=budget, draft_s=0.1, verify_s=0.3, expected=2.0, accepted_depth=2)]
    return GenerationResult(prompt_ids=list(prompt_ids), new_tokens=[1, 2, 3, 4], rounds=rounds, prefill_s=0.5,
                            decode_s=sum(r.draft_s + r.verify_s + r.other_s for r in rounds))


@pytest.mark.parametrize("methods", [["ar", CHAIN, "ddtree"], ["ddtree", CHAIN, "ar"]])
def test_speedup_is_each_methods_tokens_per_second_over_ars_prefill_included(tiny_target, monkeypatch, methods):
    """The README's headline figure. Only ar's own 1.00x was checked (real timings allow no more): a speedup inverted
    (a tree 1.56x faster than ar read 0.64x), one over the first method listed (`--methods ddtree,ar` read ddtree 1.00x)
    or a run's seconds without the prefill whose token it counts (every tok/s up, the tree's speedup 2.25x) passed."""
    target, _ = tiny_target
    monkeypatch.setattr(bench, "generate", clocked_generate)
    summary = run_benchmark(target, CountingDrafter(target.config.vocab_size), [{"id": "a", "prompt_ids": [5, 6, 7]}],
                            methods, [4], max_new_tokens=4, stop_ids=[], progress=False)["summary"]
    assert summary["ar"]["seconds"] == pytest.approx(0.5 + 0.9)  # the prefill's time is the run's, as its token is
    assert summary["ar"]["tokens_per_s"] == pytest.approx(4 / 1.4)
    assert summary["ddtree@4"]["tokens_per_s"] == pytest.approx(4 / 0.9)
    assert summary["ddtree@4"]["speedup"] == pytest.approx((4 / 0.9) / (4 / 1.4))  # faster than ar reads above 1
    assert summary[CHAIN]["speedup"] == summary["ddtree@4"]["speedup"] and summary["ar"]["speedup"] == 1.0


def test_speedup_is_over_tokens_per_second_where_a_method_commits_other_tokens_than_ar(tiny_target, monkeypatch):
    """In bf16 a method can stop at another token than ar (a near tie flipped): its speedup is still tokens per second
    over ar's, not ar's seconds over its own, which credits it with tokens it never committed."""
    def ar_stops_early(target, prompt_ids, method, *args, **kwargs):
        result = clocked_generate(target, prompt_ids, method, *args, **kwargs)
        return dataclasses.replace(result, new_tokens=[1, 2]) if method == "ar" else result

    target, _ = tiny_target
    monkeypatch.setattr(bench, "generate", ar_stops_early)
    summary = run_benchmark(target, CountingDrafter(target.config.vocab_size), [{"id": "a", "prompt_ids": [5, 6, 7]}],
                            ["ar", "ddtree"], [4], max_new_tokens=4, stop_ids=[], progress=False)["summary"]
    assert summary["ddtree@4"]["speedup"] == pytest.approx((4 / 0.9) / (2 / 1.4))


def test_each_method_but_ar_counts_the_prompts_whose_tokens_equal_ars(tiny_target, monkeypatch):
    """The losslessness line: every drafting method, the chain too, is compared with ar prompt by prompt, and ar,
    the reference, is not compared with itself (a count on ar and none on the chain hid a lossy chain)."""
    def chain_differs_on_b(target, prompt_ids, method, *args, **kwargs):
        result = clocked_generate(target, prompt_ids, method, *args, **kwargs)
        return dataclasses.replace(result, new_tokens=[9, 9]) if method == CHAIN and prompt_ids == [8, 9] else result

    target, _ = tiny_target
    monkeypatch.setattr(bench, "generate", chain_differs_on_b)
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7]}, {"id": "b", "prompt_ids": [8, 9]}]
    summary = run_benchmark(target, CountingDrafter(target.config.vocab_size), prompts, ["ar", CHAIN, "ddtree"], [4],
                            max_new_tokens=4, stop_ids=[], progress=False)["summary"]
    assert "same_as_ar" not in summary["ar"]
    assert (summary[CHAIN]["same_as_ar"], summary[CHAIN]["prompts"]) == (1, 2)
    assert (summary["ddtree@4"]["same_as_ar"], summary["ddtree@4"]["prompts"]) == (2, 2)


# ----------------------------------------------------------------------------- warm-up and the chain's expected tau


class CountingDrafter:
    """A stub drafter that records the depth of every proposal, per generation (generate resets it once per run).

    Its logits put `confidence` on token 7 at every depth, so the argmax chain is known and so is
    the drafter's probability of each of its tokens: softmax(confidence, 0, ..., 0)[7].
    """

    block_size = 16

    def __init__(self, vocab: int, confidence: float = 3.0):
        self.vocab, self.confidence = vocab, confidence
        self.generations = []  # [[depth of each proposal]] per generate() call

    def reset(self):
        self.generations.append([])

    def features(self, hidden_states):
        return hidden_states[-1]

    def propose(self, root_token, start, new_context, depth):
        self.generations[-1].append(depth)
        logits = torch.zeros(depth, self.vocab)
        logits[:, 7] = self.confidence
        return logits


class ReplyDrafter(CountingDrafter):
    """A CountingDrafter that drafts the token at each position of `reference` (a sequence's tokens by position,
    from its start), the confident first choice: every round commits a full block or path, where the stub's token 7
    took a round per token."""

    def __init__(self, reference: list[int], vocab: int):
        super().__init__(vocab)
        self.reference = reference

    def propose(self, root_token, start, new_context, depth):
        self.generations[-1].append(depth)
        logits = torch.zeros(depth, self.vocab)
        for d in range(1, depth + 1):
            logits[d - 1, self.reference[start + d] if start + d < len(self.reference) else 0] = 16.0
        return logits


def test_every_method_is_warmed_up_at_full_depth_before_anything_is_timed(tiny_target):
    target, _ = tiny_target
    # b the longest, its positions past a's (drafted at 4-35): the drafter drafts both greedy replies, so a run takes
    # a round or four, not 17 (1.7 s against 0.6 s on a 2-core AVX2 EPYC)
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7, 8]}, {"id": "b", "prompt_ids": list(range(9, 49))}]
    a, b = (prompt["prompt_ids"] + hf_greedy(target, prompt["prompt_ids"], 17) for prompt in prompts)
    drafter = ReplyDrafter(a + b[len(a):], target.config.vocab_size)
    # 17 tokens: the prefill commits the root, so the first round drafts max_new_tokens - 2, a full block (15) at 17
    # and under it at a 4-token warm-up's (40 decoded 2.4x the rounds: about 3 s more on a 2-core AVX2 EPYC)
    run_benchmark(target, drafter, prompts, [CHAIN, "ddtree"], [4], max_new_tokens=17, stop_ids=[], progress=False)
    # two untimed runs (chain, tree) on the longest prompt, then the timed runs: 2 prompts x 2 methods
    assert len(drafter.generations) == 2 + 4
    full_depth = drafter.block_size - 1
    for warm_up in drafter.generations[:2]:
        assert full_depth in warm_up, "a warm-up that never drafts a full block leaves that shape's first call to the timed runs"


def test_the_warm_up_decodes_as_the_timed_runs_do_and_each_budget_sizes_with_its_own_sizer(tiny_target, monkeypatch):
    """The warm-up passed no lookup, corpus or sizer (it decoded the drafter's defaults at full-budget trees), and one
    sizer learned every budget's round overhead: budget 8's first round was sized with budget 4's rounds."""
    import ddtree.bench
    target, _ = tiny_target
    calls = []

    def spy(*args, **kwargs):
        named = inspect.signature(generate).bind(*args, **kwargs).arguments
        sizer = named.get("sizer")
        calls.append({"method": named["method"], "budget": named["budget"], "lookup": named.get("lookup"),
                      "corpus": named.get("corpus"), "sizer": sizer, "rounds_seen": None if sizer is None else sizer.rounds})
        return generate(*args, **kwargs)

    monkeypatch.setattr(ddtree.bench, "generate", spy)
    sizer = TreeSizer(fixed_ms=10.0, row_ms=1.0)
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7, 8]}, {"id": "b", "prompt_ids": [9, 10, 11]}]
    # 8 tokens: a few rounds a run, enough for a warm-up that taught the timed sizers to show (24 took 2.3 s more on a
    # 2-core AVX2 EPYC)
    run_benchmark(target, CountingDrafter(target.config.vocab_size), prompts, [CHAIN, "ddtree"], [4, 8],
                  max_new_tokens=8, stop_ids=[], progress=False, lookup=2, sizer=sizer, corpus=False)
    warm, timed = calls[:3], calls[3:]
    assert [c["method"] for c in warm] == [CHAIN, "ddtree", "ddtree"] and len(timed) == 6
    for warm_call, timed_call in zip(warm, timed):  # the same options, prompt after prompt
        assert {k: warm_call[k] for k in ("method", "budget", "lookup", "corpus")} == \
               {k: timed_call[k] for k in ("method", "budget", "lookup", "corpus")}
    trees = [c for c in timed if c["method"] == "ddtree"]
    assert all(c["lookup"] == 2 and c["corpus"] is False and c["sizer"] is not None for c in trees)
    by_budget = {budget: {id(c["sizer"]) for c in trees if c["budget"] == budget} for budget in (4, 8)}
    assert all(len(ids) == 1 for ids in by_budget.values()) and by_budget[4] != by_budget[8]
    assert id(sizer) not in by_budget[4] | by_budget[8] and sizer.rounds == 0  # the caller's own is left as it was
    first_timed = {budget: next(c for c in trees if c["budget"] == budget) for budget in (4, 8)}
    assert [first_timed[b]["rounds_seen"] for b in (4, 8)] == [0, 0]  # neither the warm-up nor budget 4 taught 8's
    assert all(c["sizer"] is not timed_c["sizer"] for c in warm if c["sizer"] for timed_c in trees)


def test_the_warm_up_builds_static_runners_every_timed_generation_fits(tiny_target, monkeypatch):
    """Warmed up on the longest prompt at the full length, no static runner is rebuilt inside the timed runs (on a
    GPU that would capture its CUDA graphs again inside a timed prefill).

    Sized to the 128-slot padding (CAPACITY_STEP) so that each wrong warm-up builds too small a cache: the short prompt
    at 64 tokens needs 128 slots and the long one 269 (trees) and 280 (the chain), past both the short prompt's 128
    and the 256 of a 32-token warm-up on the long one (300 and 160 tokens decoded 2.5x the rounds).

    The drafter drafts both prompts' greedy replies (ReplyDrafter; their positions apart: the short prompt drafts at
    4-82, the long one from 200 on), so each round commits a full block or path: the runners' sizes depend on the
    lengths alone, and a stub that missed every token took a round per token (8 s against 2.5 s on a 2-core AVX2
    EPYC)."""
    target, _ = tiny_target
    assert target_runner.CAPACITY_STEP == 128  # the prompt and reply lengths below are chosen for it
    built = []

    class CountedStaticTarget(target_runner.StaticTarget):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append((self.max_rows, self.capacity))

    monkeypatch.setattr(target_runner, "StaticTarget", CountedStaticTarget)
    monkeypatch.setattr(target_runner, "_STATIC_TARGETS", weakref.WeakKeyDictionary())  # none left by other tests
    prompts = [{"id": "short", "prompt_ids": [5, 6, 7, 8]}, {"id": "long", "prompt_ids": list(range(5, 205))}]
    short, long = (prompt["prompt_ids"] + hf_greedy(target, prompt["prompt_ids"], 64) for prompt in prompts)
    drafter = ReplyDrafter(short + long[len(short):], target.config.vocab_size)
    run_benchmark(target, drafter, prompts, [CHAIN, "ddtree"], [4], max_new_tokens=64, stop_ids=[], progress=False,
                  static=True)
    assert len(built) == 2, built  # one per verify shape (the chain's block, the tree's 5 rows), each built once
    assert all(capacity >= 200 + 64 for _, capacity in built)


def test_static_off_runs_the_dynamic_cache_and_a_bad_static_is_one_line_before_the_warm_up(tiny_target, monkeypatch):
    """Found in a review of the fixed-shape paths: static="off", the CLI's word for off, ran the static cache, and with
    a sizer was refused with "give --static-cache off"."""
    target, _ = tiny_target
    monkeypatch.setattr(target_runner, "StaticTarget", lambda *args, **kwargs: pytest.fail("built a static runner"))
    monkeypatch.setattr(target_runner, "_STATIC_TARGETS", weakref.WeakKeyDictionary())  # none left by other tests
    drafter = CountingDrafter(target.config.vocab_size)
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7, 8]}]
    run_benchmark(target, drafter, prompts, ["ddtree"], [4], max_new_tokens=8, stop_ids=[], progress=False,
                  static="off", sizer=TreeSizer(fixed_ms=5.0, row_ms=1.0))
    assert len(drafter.generations) == 2  # the warm-up and the timed run
    with pytest.raises(DDTreeError, match=r"^static 'maybe' must be None \(the static cache on CUDA only\), True or "
                                          r"False, or one of --static-cache's 'auto', 'on', 'off'$"):
        run_benchmark(target, drafter, prompts, ["ddtree"], [4], max_new_tokens=8, stop_ids=[], progress=False,
                      static="maybe")
    assert len(drafter.generations) == 2  # refused before the warm-up decoded


def test_a_drafter_without_redraft_asked_to_re_draft_is_refused_before_the_warm_up(tiny_target):
    """Found in a review of the fixed-shape paths: it passed the check, and the warm-up's first re-draft was an
    AttributeError (after ar's warm-up and the prefill)."""
    target, _ = tiny_target
    drafter = CountingDrafter(target.config.vocab_size)  # no redraft method
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7, 8]}]
    with pytest.raises(DDTreeError, match=r"^redraft 2 re-drafts with the drafter's redraft method, which this "
                                          r"CountingDrafter has not: give redraft 0, or a DrafterRunner$"):
        run_benchmark(target, drafter, prompts, ["ar", "ddtree"], [4], max_new_tokens=8, stop_ids=[], progress=False,
                      redraft=2)
    assert drafter.generations == []  # nothing decoded
    run_benchmark(target, drafter, prompts, ["ar"], [4], max_new_tokens=8, stop_ids=[], progress=False, redraft=2)
    assert drafter.generations == []  # ar alone never re-drafts: taken


def test_the_chain_reports_its_expected_tau_from_its_own_probabilities(tiny_target):
    target, _ = tiny_target
    vocab = target.config.vocab_size
    drafter = CountingDrafter(vocab, confidence=math.log(vocab - 1))  # token 7 has probability 1/2 at each depth
    result = generate(target, [5, 6, 7, 8], CHAIN, drafter, max_new_tokens=20)  # a full block (15) first, then more
    assert drafter.generations[0][0] == 15 and len(result.rounds) >= 2
    for depth, round_ in zip(drafter.generations[0], result.rounds):
        # fp32 softmax over V: its sum of 49151 equal terms rounds the same way each time, 1.5e-4 off on an AVX2 EPYC
        assert round_.expected == pytest.approx(1 + sum(0.5**d for d in range(1, depth + 1)), rel=1e-3)


def test_a_method_whose_prompts_ran_no_round_has_no_tau(tiny_target):
    """With max_new_tokens 1 (or a stop token first) the prefill's token is all: tau printed 0.00 and results.json
    held 0.0, as if every draft had failed. The other figures stay."""
    target, _ = tiny_target
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7, 8]}]
    results = run_benchmark(target, CountingDrafter(target.config.vocab_size), prompts, ["ar", CHAIN, "ddtree"], [4],
                            max_new_tokens=1, stop_ids=[], progress=False)
    for key, stats in results["summary"].items():
        assert stats["tau"] is None and stats["expected_tau"] is None, key
        assert stats["rounds"] == 0 and stats["new_tokens"] == 1 and "speedup" in stats
        assert results["prompts"][0]["methods"][key]["tau"] is None
        assert format_summary(results["summary"]).splitlines()[2 + list(results["summary"]).index(key)].split()[1:3] == [
            "-", "-"]
    assert generate(target, [5, 6, 7, 8], "ar", max_new_tokens=1).tau is None


def test_the_table_prints_each_figure_under_its_own_heading():
    """Tau against expected tau is how a user reads an over-confident drafter: the tests' drafters had the two equal (or
    both "-"), so tau and exp.tau swapped, or verify ms printed as draft ms, passed."""
    row = dict(tau=2.5, expected_tau=3.1, new_tokens=64, tokens_per_s=50.0, speedup=1.6, round_ms=8.5, draft_ms=2.0,
               verify_ms=6.0, other_ms=0.5, tree_nodes=32.0)
    header, _, line = format_summary({"ddtree@32": row}).splitlines()[:3]
    headings = ["method", "tau", "exp.tau", "tokens", "tok/s", "speedup", "round ms", "draft", "verify", "other", "nodes"]
    assert header.split() == " ".join(headings).split()  # the headings checked are the table's
    assert dict(zip(headings, line.split())) == {
        "method": "ddtree@32", "tau": "2.50", "exp.tau": "3.10", "tokens": "64", "tok/s": "50.0", "speedup": "1.60x",
        "round ms": "8.5", "draft": "2.0", "verify": "6.0", "other": "0.50", "nodes": "32.0"}
    for heading, value in (("tau", "2.50"), ("exp.tau", "3.10")):  # right-aligned under it, as every figure is
        end = header.index(f" {heading} ") + 1 + len(heading)
        assert line[:end].endswith(f" {value}"), heading


# A summary row's figures, for the tests of the lines printed under the table.
SUMMARY_ROW = dict(tau=1.5, expected_tau=1.6, new_tokens=60, tokens_per_s=10.0, round_ms=1.0, draft_ms=0.1,
                   verify_ms=0.8, other_ms=0.1, tree_nodes=4.0)


def test_the_line_of_prompts_equal_to_ars_says_what_a_difference_means_at_the_dtype():
    """4/6 in bf16 on an H200 read as a losslessness failure: in bf16 a near tie can flip, in fp32 it is a bug (at
    T > 0 too, where every method draws ar's tokens from a generator seeded alike)."""
    summary = {"ar": dict(SUMMARY_ROW, tau=1.0), CHAIN: dict(SUMMARY_ROW, same_as_ar=6, prompts=6),
               "ddtree@4": dict(SUMMARY_ROW, same_as_ar=4, prompts=6)}

    def equal_line(dtype):
        lines = [x for x in format_summary(summary, dtype).splitlines() if "equal ar's" in x]
        return lines[0] if lines else None

    assert "near tie" in equal_line(torch.bfloat16) and "bfloat16" in equal_line(torch.bfloat16)
    assert "is a bug" in equal_line(torch.float32)
    # every drafting method's count, in the table's order: the lossy one here is listed after a lossless chain
    assert equal_line(None) == "prompts whose committed tokens equal ar's: dflash 6/6, ddtree@4 4/6"  # equal over all
    summary["ddtree@4"]["same_as_ar"] = 6
    assert equal_line(torch.bfloat16) == "prompts whose committed tokens equal ar's: dflash 6/6, ddtree@4 6/6"


def test_the_online_temperatures_line_gives_each_methods_to_two_places():
    """The draft temperature online calibration ended at, per method: it is what a user copies into a drafter's
    default calibration, and temperatures a few hundredths apart (0.87 and 0.91) are different calibrations."""
    summary = {"ar": dict(SUMMARY_ROW, tau=1.0), CHAIN: dict(SUMMARY_ROW, online_temperature=0.8712),
               "ddtree@4": dict(SUMMARY_ROW, online_temperature=0.9149)}
    assert format_summary(summary).splitlines()[-1] == (
        "online calibration's draft temperature at the end: dflash 0.87, ddtree@4 0.91")


# ----------------------------------------------------------------------------- reading a prompts file


def read(path):
    return [record for _, _, record in iter_json_lines(path)]


@pytest.mark.parametrize("content, line, offset, byte", [
    ('{"prompt": "ok"}\n{"prompt": "café"}\n'.encode("latin-1"), 2, 17 + 15, "0xe9"),  # latin-1 text
    ('{"prompt": "ok"}\n'.encode("utf-16"), 1, 0, "0xff"),  # UTF-16, byte-order mark first
    (b'\xef\xbb\xbf{"prompt": "caf\xe9"}\n', 1, 3 + 15, "0xe9"),  # a UTF-8 byte-order mark, then cp1252 text
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


def test_a_line_of_only_spaces_and_tabs_is_blank_and_later_lines_keep_their_numbers(tmp_path):
    """An editor's indentation left on an empty line is no prompt to refuse as JSON cut off."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n  \t\n{"prompt": "b"}\n')
    assert list(iter_json_lines(path)) == [(1, f"{path}:1", {"prompt": "a"}), (3, f"{path}:3", {"prompt": "b"})]


@pytest.mark.parametrize("bad_line, problem", [
    ('{"prompt" "b"}', "Expecting ':' delimiter at column 11"),
    ('{"prompt": "b"} x', "Extra data at column 17"),
    ('{"prompt": "\x01"}', "Invalid control character at column 13"),  # json's own message ends in "at"
    ('{"prompt": ', "the line ends before the JSON object is complete: was it cut off?"),
    ('{"prompt": "a long answer cut o', "the line ends before the JSON object is complete: was it cut off?"),
    ('{"prompt": "b"', "the line ends before the JSON object is complete: was it cut off?"),  # cut at the brace
])
def test_invalid_json_says_what_and_where_on_the_line(tmp_path, bad_line, problem):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + bad_line + "\n")
    with pytest.raises(DDTreeError) as error:
        read(path)
    assert str(error.value) == f"{path}:2: not valid JSON ({problem}); each line must be one JSON object"


def test_a_null_id_is_no_id_and_each_prompt_has_its_own(tmp_path):
    """A null id was the string "None", the same for every such line; rows of two results files are paired by id."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": null, "prompt": "a"}\n\n{"id": "x", "prompt": "b"}\n{"id": 7, "prompt": "c"}\n'
                    '{"prompt": "d"}\n')
    assert [prompt_id for prompt_id, _, _ in read_prompts(path)] == ["1", "x", "7", "5"]


@pytest.mark.parametrize("lines, first, second, repeated", [
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], 1, 2, "a"),
    (['{"id": "3", "prompt": "x"}', '{"prompt": "y"}', '{"prompt": "z"}'], 1, 3, "3"),  # line 3's own number
    (['{"id": null, "prompt": "x"}', '{"id": 1, "prompt": "y"}'], 1, 2, "1"),  # an int id is its text
])
def test_an_id_given_twice_is_one_line_naming_both_lines(tmp_path, lines, first, second, repeated):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DDTreeError) as error:
        read_prompts(path)
    assert str(error.value) == (f"{path}: lines {first} and {second} both have id {repeated!r} (a prompt without an id "
                                "has its line number); give each prompt its own id")


def test_a_limit_reads_that_many_prompts_from_the_top_of_the_file(tmp_path):
    """`ddtree bench --limit N` and eval.limit decode the first N prompts; one more was caught only through the
    training evaluation's rows (mutation review 10, m12)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert [prompt_id for prompt_id, _, _ in read_prompts(path, limit=2)] == ["1", "2"]
    assert [prompt_id for prompt_id, _, _ in read_prompts(path, limit=5)] == ["1", "2", "3"]


@pytest.mark.parametrize("limit", [0, -2])
def test_a_limit_below_one_is_refused(tmp_path, limit):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(DDTreeError, match=f"limit {limit} must be at least 1, or None for every prompt"):
        load_prompts(path, tokenizer=None, limit=limit)


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n{"prompt": 5}\n', ':2: "prompt" must be a string'),
    ('{"prompt": "a"}\n{"prompt": ["a"]}\n', ':2: "prompt" must be a string'),
    ("", " holds no prompts"),
    ("\n  \n", " holds no prompts"),  # blank lines alone
])
def test_a_prompts_file_whose_prompt_is_not_text_or_that_holds_none_is_one_line(tmp_path, content, message):
    """Read before the target loads: a number as "prompt" was the tokenizer's error once it had, and an empty file
    decoded nothing and summarized no prompts."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(DDTreeError) as error:
        read_prompts(path)
    assert str(error.value) == (f'{path}{message}' if message.startswith(":") else f"prompts file {path}{message}")


@pytest.mark.parametrize("content", ["5", "null", '[{"type": "text", "text": "hi"}]'])
def test_a_message_whose_content_is_not_a_string_is_one_line(tmp_path, tiny_target, content):
    """A TypeError or a jinja2 UndefinedError from the chat template before."""
    _, tokenizer = tiny_target
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n'
                    f'{{"messages": [{{"role": "user", "content": {content}}}]}}\n')
    with pytest.raises(DDTreeError, match=f"{path}:2: .*whose role and content are strings"):
        load_prompts(path, tokenizer)


def test_a_conversation_given_as_prompts_is_decoded_from_the_turn_its_reply_answers(tmp_path, tiny_target, capsys):
    """A held-out conversation file (data/regenerate.py's format) given as --prompts or eval.prompts: the template's
    generation prompt after the reply opened a second assistant turn no user sends, without a word. It now ends where
    data/regenerate.py cuts it (prompt_messages), the same prompt and fingerprint as the file of its prompts alone."""
    from ddtree.bench import prompts_fingerprint

    _, tokenizer = tiny_target
    user, reply = {"role": "user", "content": "Explain caching."}, {"role": "assistant", "content": "Sure. It keeps..."}
    conversations, prompts = tmp_path / "conversations.jsonl", tmp_path / "prompts.jsonl"
    conversations.write_text(json.dumps({"id": "a", "messages": [user, reply]}) + "\n"
                             + json.dumps({"id": "b", "messages": [user, reply, user, reply, reply]}) + "\n"
                             + json.dumps({"id": "c", "messages": [user]}) + "\n")
    prompts.write_text(json.dumps({"id": "a", "messages": [user]}) + "\n"
                       + json.dumps({"id": "b", "messages": [user, reply, user]}) + "\n"
                       + json.dumps({"id": "c", "messages": [user]}) + "\n")
    decoded = load_prompts(conversations, tokenizer)
    assert capsys.readouterr().err.strip() == (f"{conversations}: 2 prompts ended with an assistant turn: decoded from "
                                               "the turn before it")
    assert decoded == load_prompts(prompts, tokenizer)
    assert prompts_fingerprint(decoded) == prompts_fingerprint(load_prompts(prompts, tokenizer))
    assert capsys.readouterr().err == ""  # a file of prompts alone: nothing to say
    conversations.write_text(json.dumps({"id": "a", "messages": [user, reply]}) + "\n")
    load_prompts(conversations, tokenizer)
    assert capsys.readouterr().err.strip().startswith(f"{conversations}: 1 prompt ended with an assistant turn:")

    conversations.write_text(json.dumps({"messages": [user]}) + "\n" + json.dumps({"messages": [reply]}) + "\n")
    with pytest.raises(DDTreeError, match=f"^{conversations}:2: only assistant turns: "):
        read_prompts(conversations)


def test_a_raw_prompt_is_tokenized_as_is_without_the_tokenizers_special_tokens():
    """{"prompt": ...} is the text the target continues from: a tokenizer that adds a BOS (Llama's) added it to every
    raw prompt. The tiny target's tokenizer adds none, so a stand-in that does."""
    from ddtree.bench import tokenize_prompts

    def tokenizer(text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [ord(character) for character in text]}

    records = [("a", "p.jsonl:1", {"prompt": "hi"})]
    assert tokenize_prompts(records, tokenizer) == [{"id": "a", "prompt_ids": [104, 105]}]


def test_a_raw_prompt_the_tokenizer_turns_into_no_token_is_one_line_naming_the_line():
    """Text a tokenizer drops whole (a stand-in's here) leaves the target nothing to continue from."""
    records = [("a", "p.jsonl:1", {"prompt": "hi"}), ("b", "p.jsonl:2", {"prompt": "\u200b"})]
    with pytest.raises(DDTreeError, match="^p.jsonl:2: the prompt is empty$"):
        tokenize_prompts(records, lambda text, add_special_tokens: {"input_ids": [1] if text == "hi" else []})


def test_a_chat_prompt_ends_with_the_templates_generation_prompt(tmp_path, tiny_target):
    """The target answers from the assistant header the template opens: without it, it went on with the user's turn.
    The conversation test above compares two files loaded alike, so a prompt without that header passed it."""
    _, tokenizer = tiny_target
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Explain caching."}]}) + "\n")
    [prompt] = load_prompts(path, tokenizer)
    assert tokenizer.decode(prompt["prompt_ids"]).endswith("Explain caching.<|im_end|>\n<|im_start|>assistant\n")


STRICT_TEMPLATE = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate "
                   "user/assistant/user/assistant/...') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("template, problem", [
    (None, "the target's tokenizer has no chat template to apply"),
    (STRICT_TEMPLATE, r"the target's chat template refused the messages \(Conversation roles must alternate "),
])
def test_a_chat_template_that_cannot_apply_is_one_line_naming_the_line(tmp_path, tiny_target, monkeypatch, template,
                                                                       problem):
    """A base model's tokenizer has no template (a ValueError before), and Llama-2's, Mistral's or Gemma's refuses roles
    that do not alternate (a jinja2 TemplateError): both tracebacks before."""
    _, tokenizer = tiny_target
    monkeypatch.setattr(tokenizer, "chat_template", template)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"messages": [{"role": "assistant", "content": "Hi"}, '
                    '{"role": "user", "content": "x"}]}\n')
    with pytest.raises(DDTreeError, match=f"^{path}:2: {problem}.*give {{\"prompt\": ...}} records, used as raw text$"):
        load_prompts(path, tokenizer)


def test_a_rounds_verify_time_is_the_targets_forward_and_the_trees_mask_is_overhead(tiny_target, monkeypatch):
    """results.json's split: building the tree's mask and positions counts in `other`, as Round says, not in
    `verify` (the target's forward), which the tree sizer fits its cost line to."""
    import ddtree.decoding as decoding
    from ddtree.cli import load_drafter

    model, tokenizer = tiny_target
    drafter = decoding.DrafterRunner(load_drafter("random", model, tokenizer, "tiny-random"), model)
    build_mask = decoding.ancestor_matrix

    def slow_mask(tree):
        time.sleep(0.2)
        return build_mask(tree)

    monkeypatch.setattr(decoding, "ancestor_matrix", slow_mask)
    for method, budget in (("dflash", 0), ("ddtree", 8)):
        result = generate(model, [1, 2, 3, 4], method, drafter, budget, 3)
        assert result.rounds and all(r.other_s >= 0.2 for r in result.rounds), [r.other_s for r in result.rounds]


def test_a_runner_built_for_another_target_is_refused_before_the_warm_up_decodes(tiny_target, monkeypatch):
    """generate refused it too, but only after the warm-up had decoded every method at full length."""
    import copy

    target, tokenizer = tiny_target
    other = copy.deepcopy(target)  # the same shapes, another model
    drafter = decoding_runner(target, tokenizer)
    monkeypatch.setattr(bench, "generate", lambda *args, **kwargs: pytest.fail("decoded before the check"))
    with pytest.raises(DDTreeError, match=r"^this DrafterRunner was built for another target"):
        run_benchmark(other, drafter, [{"id": "a", "prompt_ids": [5, 6, 7]}], ["ar", "ddtree"], [4], 4, [], progress=False)


def decoding_runner(target, tokenizer):
    from ddtree.cli import load_drafter
    from ddtree.decoding import DrafterRunner

    return DrafterRunner(load_drafter("random", target, tokenizer, "tiny-random"), target)


def test_the_warm_up_teaches_the_callers_online_calibration_nothing(tiny_target):
    """`ddtree calibrate` writes what run_benchmark's rounds taught into the drafter's calibration.json: a warm-up
    decoding with the caller's calibration, not a copy, taught it the longest prompt twice. Only the sizers' isolation
    was tested."""
    target, tokenizer = tiny_target
    drafter = decoding_runner(target, tokenizer)
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7, 8]}, {"id": "b", "prompt_ids": [9, 10, 11, 12, 13, 14]}]
    learned = {}
    for warm in (False, True):
        calibration = OnlineCalibration(record=True)
        # 8 tokens: a few rounds a run to learn from (a warm-up that taught them fails at 8 as at 16, half the cost)
        run_benchmark(target, drafter, prompts, [CHAIN, "ddtree"], [4], max_new_tokens=8, stop_ids=[], progress=False,
                      online=calibration, warm=warm)
        learned[warm] = (calibration.log_temperatures, calibration.trajectory)
    assert learned[True] == learned[False]


def test_each_budgets_online_temperature_is_its_own(tiny_target):
    """results.json's online_temperature of ddtree@16 was budget 4's (the nearest learned to budget 1) and no test saw
    it: each had one budget, whose temperature is the nearest to any."""
    target, tokenizer = tiny_target
    calibration = OnlineCalibration()
    summary = run_benchmark(target, decoding_runner(target, tokenizer), [{"id": "a", "prompt_ids": [5, 6, 7, 8]}],
                            [CHAIN, "ddtree"], [4, 16], max_new_tokens=16, stop_ids=[], progress=False,
                            online=calibration, warm=False)["summary"]  # the warm-up teaches it nothing (tested above)
    assert calibration.log_temperatures[4] != calibration.log_temperatures[16]  # else this test tells nothing
    for budget in (4, 16):
        assert summary[tree_key(budget)]["online_temperature"] == calibration.temperature(budget)
    assert summary[CHAIN]["online_temperature"] == calibration.temperature(None)


def test_at_a_temperature_every_method_samples_ars_tokens_from_a_generator_seeded_alike(tiny_target):
    """At T > 0 the losslessness line compares each method with ar prompt by prompt: fp32 decoding draws the same
    tokens only from generators seeded alike, so a method seeded otherwise read as lossy (or compared another sample's
    speed). The seed is the caller's: another seed samples other tokens."""
    target, tokenizer = tiny_target
    drafter = decoding_runner(target, tokenizer)
    prompts = [{"id": "a", "prompt_ids": [5, 6, 7, 8]}, {"id": "b", "prompt_ids": [9, 10, 11]}]

    def sampled(seed, methods=("ar", CHAIN, "ddtree")):
        return run_benchmark(target, drafter, prompts, list(methods), [4], max_new_tokens=12, stop_ids=[],
                             sampling=Sampling(temperature=1.0), seed=seed, progress=False, warm=False)

    results = sampled(0)
    for key in (CHAIN, "ddtree@4"):
        assert (results["summary"][key]["same_as_ar"], results["summary"][key]["prompts"]) == (2, 2), key
    ar_tokens = [row["methods"]["ar"]["new_tokens"] for row in results["prompts"]]
    # else it tells nothing; only ar's tokens are read at the other seed, so only ar decodes there
    assert ar_tokens != [row["methods"]["ar"]["new_tokens"] for row in sampled(1, ["ar"])["prompts"]]


# ------------------------------------------------------------------------------ prompts a library caller builds


@pytest.mark.parametrize("prompts, problem", [
    ([], r'^no prompts to benchmark: give a list of \{"id": ..., "prompt_ids": \[...\]\}'),
    ([{"id": "a", "prompt_ids": [5, 6]}, {"prompt_ids": [5, 6]}],
     r'^prompts\[1\] must be a dict with "id" and "prompt_ids" \(as load_prompts gives\), got keys \[\'prompt_ids\'\]'),
    ([[5, 6]], r'^prompts\[0\] must be a dict with "id" and "prompt_ids" .*, got a list'),
    ([{"id": "a", "prompt_ids": "hi"}], r"^prompt 'a''s prompt_ids is text \('hi'\), not token ids"),
], ids=["none", "no id", "not a dict", "text"])
def test_prompts_that_cannot_be_benchmarked_are_one_line_before_anything_decodes(tiny_target, monkeypatch, prompts,
                                                                                 problem):
    """No prompt was a ValueError from max(); a prompt without "id" a KeyError after the warm-up had decoded."""
    target, _ = tiny_target
    monkeypatch.setattr(bench, "generate", lambda *args, **kwargs: pytest.fail("decoded before the check"))
    with pytest.raises(DDTreeError, match=problem):
        run_benchmark(target, None, prompts, ["ar"], [4], 4, [], progress=False)


@pytest.mark.parametrize("methods", [[CHAIN], ["ar", "ddtree"]])
def test_a_drafting_method_without_a_drafter_is_one_line_before_anything_decodes(tiny_target, monkeypatch, methods):
    """ar beside a drafting method is the usual comparison, so the check looks for any drafting method, not only lists
    of nothing else: with ar listed first, ar decoded before the drafting method found it had no drafter."""
    target, _ = tiny_target
    monkeypatch.setattr(bench, "generate", lambda *args, **kwargs: pytest.fail("decoded before the check"))
    with pytest.raises(DDTreeError, match="^methods dflash and ddtree need a drafter$"):
        run_benchmark(target, None, [{"id": "a", "prompt_ids": [5, 6]}], methods, [4], 4, [], progress=False)


def test_a_prompt_given_as_a_batch_of_one_counts_its_tokens_not_its_rows(tiny_target, monkeypatch):
    """A (1, T) tensor, which generate takes, was measured with len(): 1 token recorded, the warm-up's longest prompt
    picked wrong, and a prompt past the context not caught up front."""
    target, _ = tiny_target
    long, short = list(range(5, 12)), [5, 6, 7]
    decoded = []

    def recording(target, prompt_ids, *args, **kwargs):
        decoded.append(list(prompt_ids))
        return generate(target, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(bench, "generate", recording)
    prompts = [{"id": "short", "prompt_ids": short}, {"id": "long", "prompt_ids": torch.tensor([long])}]
    results = run_benchmark(target, None, prompts, ["ar"], [4], 4, [], progress=False)
    assert [row["prompt_tokens"] for row in results["prompts"]] == [3, 7]
    assert decoded == [long, short, long]  # the warm-up on the longest prompt, then each prompt
    assert results["prompts"][1]["methods"]["ar"]["new_tokens"] == generate(target, long, "ar", max_new_tokens=4).new_tokens
    limit = target.config.max_position_embeddings
    with pytest.raises(DDTreeError, match=f"^prompt 'long' has {limit} tokens; the target's context is {limit}"):
        run_benchmark(target, None, [{"id": "long", "prompt_ids": torch.full((1, limit), 5)}], ["ar"], [4], 4, [],
                      progress=False)
    assert len(decoded) == 3  # refused before the warm-up


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packing")
def test_comparing_packed_verify_cost_on_an_already_packed_target_is_one_line(tiny_target):
    """Found in a review of the fixed-shape paths: it deep-copies the target to pack the copy, and a packed target's
    oneDNN copies cannot be deep-copied (NotImplementedError deep in torch)."""
    target = copy.deepcopy(tiny_target[0]).requires_grad_(False)
    pack_linears(target)
    with pytest.raises(DDTreeError, match=r"^compare_packed_verify_cost: the target's linear layers are already packed "
                                          r"\(pack_linears\); give it the plain model, unpack_linears\(target\) first"):
        compare_packed_verify_cost(target, [2], context=8, repeats=1)
    assert is_packed(target)  # left as given
    unpack_linears(target)
    assert [row["nodes"] for row in compare_packed_verify_cost(target, [2], context=8, repeats=1)] == [0, 2]


def test_the_verify_cost_ratio_is_the_trees_verify_over_one_ar_step(tiny_target, monkeypatch):
    """`ddtree verify-cost`'s ratio column: a 5-row verify at 2x a one-token step reads 2.0, not 0.5 (a tree
    that costs two steps read as half of one)."""
    asked = []  # the repeats each median was asked for: the step's too, or one noisy run is the baseline

    def verify_seconds(runner, tree, context, repeats):
        asked.append(repeats)
        return 0.010 * (1 + len(tree) / 4)

    monkeypatch.setattr(sizing, "verify_seconds", verify_seconds)
    rows = measure_verify_cost(tiny_target[0], [4], context=8, repeats=3)
    assert [(row["nodes"], row["ar_step_ms"], row["verify_ms"]) for row in rows] == [(4, 10.0, 20.0)]
    assert rows[0]["ratio"] == pytest.approx(2.0)
    assert asked == [3, 3]


def test_the_trees_overhead_is_the_median_of_its_repeats(tiny_target, monkeypatch):
    """`ddtree verify-cost`'s overhead column, as its verify columns: the median, not the luckiest of the repeats."""
    import ddtree.tree

    monkeypatch.setattr(sizing, "verify_seconds", lambda runner, tree, context, repeats: 0.010)
    clock, builds, build = [0.0], iter([0.0, 0.0, 0.010, 0.030, 0.020]), ddtree.tree.build_tree

    def timed_build(*args):  # the AR step's and the verified tree's, untimed, then the three timed builds
        clock[0] += next(builds)
        return build(*args)

    monkeypatch.setattr(ddtree.tree, "build_tree", timed_build)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    [row] = measure_verify_cost(tiny_target[0], [4], context=8, repeats=3)
    assert row["overhead_ms"] == pytest.approx(20.0)


def test_the_trees_overhead_counts_the_cache_compaction_after_the_walk(tiny_target, monkeypatch):
    """Every round compacts the cache to the accepted path (runner.keep), so `ddtree verify-cost`'s overhead column
    holds that time too: the build alone understates what each round costs beside its verify."""
    monkeypatch.setattr(sizing, "verify_seconds", lambda runner, tree, context, repeats: 0.010)
    clock, probe_runner = [0.0], sizing.probe_runner

    def slow_compaction_runner(*args):
        runner = probe_runner(*args)
        keep = runner.keep

        def timed_keep(*keep_args):
            clock[0] += 0.005
            return keep(*keep_args)

        runner.keep = timed_keep
        return runner

    monkeypatch.setattr(sizing, "probe_runner", slow_compaction_runner)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    [row] = measure_verify_cost(tiny_target[0], [4], context=8, repeats=3)
    assert row["overhead_ms"] == pytest.approx(5.0)


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packing")
def test_the_packed_comparison_times_each_model_alike_and_reads_plain_over_packed(tiny_target, monkeypatch):
    """`ddtree verify-cost --compare-plain`: only the rows' sizes were checked, so plain and packed timed on one model,
    a probe tree of another size, one repeat or the ratio upside down (a 3x faster packed model read 0.33) passed."""
    timed = []

    def verify_seconds(runner, tree, context, repeats):
        packed = is_packed(runner.target)
        timed.append((packed, len(tree), repeats))
        return 0.010 if packed else 0.030

    monkeypatch.setattr(sizing, "verify_seconds", verify_seconds)
    rows = compare_packed_verify_cost(tiny_target[0], [5], context=8, repeats=3)
    assert [(row["nodes"], row["plain_ms"], row["packed_ms"]) for row in rows] == [(0, 30.0, 10.0), (5, 30.0, 10.0)]
    assert [row["ratio"] for row in rows] == [pytest.approx(3.0)] * 2
    # alternately, one run at a time, three of each at each size: the AR step (no node) and the 5-node probe tree
    assert timed == [(packed, nodes, 1) for nodes in (0, 5) for _ in range(3) for packed in (False, True)]


REDRAFTING = SimpleNamespace(default_lookup=0, default_redraft=2, default_corpus=None)  # a drafter's defaults


def test_the_chain_decodes_with_the_redraft_it_was_given():
    """--redraft (or the drafter's own) acts on dflash's chain as on ddtree's trees: bench handing the chain 0 ran its
    dflash row without the re-drafts that `generate --method dflash` makes, and recorded it as run with them."""
    assert resolved_options("dflash", REDRAFTING, None, 3, False, None)[1] == 3
    assert resolved_options("dflash", REDRAFTING, None, None, False, None)[1] == 2  # the drafter's own
    assert resolved_options("ar", REDRAFTING, None, 3, False, None)[1] == 0  # ar drafts nothing to re-draft


def test_sizing_leaves_re_drafts_off_for_ddtrees_trees_only():
    """--adaptive-size sizes ddtree's trees, which then leave re-drafting off (it cost more than it gained on a CPU);
    the chain, which is not sized, keeps the drafter's re-drafts."""
    assert resolved_options("dflash", REDRAFTING, None, None, True, None)[1] == 2
    assert resolved_options("ddtree", REDRAFTING, None, None, True, None)[1] == 0
