"""Adaptive tree size (ddtree/sizing.py): the rule that picks how many of a best-first tree's nodes to verify,
the truncation it relies on, and the cost measurement."""

import math

import pytest
import torch

from ddtree.sizing import TreeSizer
from ddtree.targets import load_target
from ddtree.tree import build_tree, truncated


def test_the_first_nodes_of_a_best_first_tree_are_the_best_tree_of_that_size():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 3
    full = build_tree(logits, 40)
    for nodes in range(0, 41):
        assert truncated(full, nodes) == build_tree(logits, nodes), nodes


def test_the_rule_maximises_expected_tokens_per_millisecond():
    log_probs = [math.log(p) for p in (0.6, 0.3, 0.2, 0.05, 0.01)]
    assert TreeSizer(fixed_ms=40.0, row_ms=0.0).size(log_probs) == 5  # free rows: the whole budget
    assert TreeSizer(fixed_ms=1.0, row_ms=100.0).size(log_probs) == 1  # rows dearer than anything they bring
    # by hand, 10 ms + 2 ms a row (the root is a row): n=1 1.6/14 = 0.1143, n=2 1.9/16 = 0.1188, n=3 2.1/18 = 0.1167
    assert TreeSizer(fixed_ms=10.0, row_ms=2.0).size(log_probs) == 2
    # where rows weigh more against the fixed cost the root's row decides it: 4 ms + 1 ms a row, n=1 1.6/6 = 0.2667,
    # n=2 1.9/7 = 0.2714, n=3 2.1/8 = 0.2625 (without the root's row n=1 wins, 1.6/5 = 0.32 against 1.9/6 = 0.317)
    assert TreeSizer(fixed_ms=4.0, row_ms=1.0).size(log_probs) == 2
    # 50 more rows whatever n is: n=3 2.1/118 = 0.01780, n=4 2.15/120 = 0.01792, n=5 2.16/122 = 0.01770
    assert TreeSizer(fixed_ms=10.0, row_ms=2.0).size(log_probs, extra_rows=50) == 4
    assert TreeSizer(fixed_ms=10.0, row_ms=2.0).size([]) == 0
    # a tie goes to the larger tree: free rows (measure's clamped slope) and nodes too unlikely to move the gain
    assert TreeSizer(fixed_ms=10.0, row_ms=0.0).size([math.log(0.5), math.log(1e-13), math.log(1e-14)]) == 3


def test_the_rounds_overhead_is_a_running_mean_and_favours_larger_trees():
    sizer = TreeSizer(fixed_ms=10.0, row_ms=2.0)
    for ms in (4.0, 8.0):
        sizer.observe_overhead(ms)
    assert sizer.overhead_ms == pytest.approx(6.0) and sizer.rounds == 2
    log_probs = [math.log(p) for p in (0.6, 0.3, 0.2, 0.05, 0.01)]
    # 16 ms fixed in all: n=2 1.9/22 = 0.0864, n=3 2.1/24 = 0.0875, n=4 2.15/26 = 0.0827 (without it, n=2 wins)
    assert sizer.size(log_probs) == 3
    # past 50 rounds each weighs 1/50: after 100 rounds of 0 ms, 50 of 100 ms bring it to 100 x (1 - (49/50)^50) = 63.6,
    # where a mean over every round would still say 33.3 (a cold start's first rounds would size every later tree)
    later = TreeSizer(fixed_ms=10.0, row_ms=2.0)
    for ms in [0.0] * 100 + [100.0] * 50:
        later.observe_overhead(ms)
    assert later.overhead_ms == pytest.approx(100.0 * (1 - (49 / 50) ** 50))


def test_measure_fits_a_cost_line_on_the_machine(monkeypatch):
    import ddtree.sizing as sizing

    target, _ = load_target("tiny-random")
    sizer = TreeSizer.measure(target, max_rows=17, context=32, repeats=2)  # this machine's verifies, really run
    assert sizer.fixed_ms > 0 and sizer.row_ms >= 0
    assert "ms per row" in sizer.describe()
    # The fit itself, on verifies of a known cost: fixed_ms + row_ms a row, 40 ms + 1.1 ms the 2-core CPU's line.
    timed, line = [], {"fixed_ms": 40.0, "row_ms": 1.1}

    def known_cost(runner, tree, context, repeats):
        rows = len(tree.tokens) + 1  # the root's row and one per node
        timed.append(rows)
        return (line["fixed_ms"] + line["row_ms"] * rows) / 1000

    monkeypatch.setattr(sizing, "verify_seconds", known_cost)
    fitted = TreeSizer.measure(target, max_rows=17, context=32, repeats=2)
    assert 17 in timed and len(set(timed)) > 1  # probed at several row counts, up to the largest tree
    assert abs(fitted.fixed_ms - 40.0) < 1e-6 and abs(fitted.row_ms - 1.1) < 1e-9
    # Noise on a launch-bound machine can tilt a flat line down: rows are then free, and the fixed cost is the mean
    timed.clear()
    line.update(fixed_ms=50.0, row_ms=-0.1)
    flat = TreeSizer.measure(target, max_rows=17, context=32, repeats=2)
    assert flat.row_ms == 0.0 and flat.fixed_ms == pytest.approx(50.0 - 0.1 * sum(timed) / len(timed))
    # and a steep line can meet zero before the root's row (-1 ms + 2 ms a row): no verify costs less than nothing,
    # so the fixed cost stays a hair above zero
    line.update(fixed_ms=-1.0, row_ms=2.0)
    steep = TreeSizer.measure(target, max_rows=17, context=32, repeats=2)
    assert steep.fixed_ms == 1e-3 and steep.row_ms == pytest.approx(2.0)
    # One row (the root alone, no tree to size) is one verify shape: no line through it, its time is the fixed cost
    timed.clear()
    line.update(fixed_ms=40.0, row_ms=1.1)
    single = TreeSizer.measure(target, max_rows=1, context=32, repeats=2)
    assert timed == [1] and single.fixed_ms == pytest.approx(41.1) and single.row_ms == 0.0


def test_the_cost_line_times_the_targets_forward_without_building_the_mask(monkeypatch):
    """Decoding counts the tree's mask in a round's overhead (Round.other_s), which the sizer adds to the line."""
    import time
    from types import SimpleNamespace

    import ddtree.sizing as sizing

    target, _ = load_target("tiny-random")
    build_mask = sizing.ancestor_matrix
    hour, skipped = 3600.0, [0.0]  # each mask built moves the sizer's clock on an hour

    def slow_mask(tree):
        skipped[0] += hour
        return build_mask(tree)

    monkeypatch.setattr(sizing, "ancestor_matrix", slow_mask)
    monkeypatch.setattr(sizing, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + skipped[0]))
    runner = sizing.probe_runner(target, 16)
    tree = build_tree(torch.randn(3, target.config.vocab_size, generator=torch.Generator().manual_seed(0)), 8)
    assert sizing.verify_seconds(runner, tree, 16, repeats=3) < hour  # a tiny model's forward, not the mask's hour
    assert skipped[0] > 0  # (the mask was built, outside the timed forwards)


def test_a_verify_time_is_the_median_of_its_repeats_after_an_untimed_first_call(monkeypatch):
    """One noisy forward must not set a machine's cost line: the first call at a shape pays one-off costs, then the
    median of `repeats` forwards."""
    from types import SimpleNamespace

    import ddtree.sizing as sizing

    target, _ = load_target("tiny-random")
    runner = sizing.probe_runner(target, 16)
    durations, clock = iter([100.0, 5.0, 1.0, 3.0]), [0.0]  # the first call's forward, then three timed ones
    forward = runner.verify

    def verify(*args):
        clock[0] += next(durations)
        return forward(*args)

    monkeypatch.setattr(runner, "verify", verify)
    monkeypatch.setattr(sizing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert sizing.verify_seconds(runner, sizing.probe_tree(target.config.vocab_size, 4), 16, repeats=3) == 3.0


def test_the_probe_tree_spans_the_depths_a_drafted_block_does():
    """The sizer's cost line is fitted to verifies of trees shaped like decoding's: a block of 16 drafts 15 depths, and
    a tree of one depth (every node a sibling) has another mask and other positions."""
    from ddtree.sizing import probe_tree

    tree = probe_tree(2, 100)  # two tokens a depth: 100 nodes reach the deepest
    assert len(tree) == 100 and max(tree.depths) == 15


def test_measure_runs_on_a_vocabulary_smaller_than_the_special_tokens_skipped():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    sizer = TreeSizer.measure(LlamaForCausalLM(config).eval(), max_rows=9, context=20, repeats=1)
    assert sizer.fixed_ms > 0 and sizer.row_ms >= 0


def test_measure_keeps_within_a_short_context_and_refuses_one_too_short(tmp_path):
    """A learned position table of 128 rows: the 300-token probe context was an IndexError traceback."""
    import transformers

    from ddtree.errors import DDTreeError

    torch.manual_seed(0)
    target = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=128)).eval()
    sizer = TreeSizer.measure(target, max_rows=33, repeats=1)
    assert sizer.fixed_ms > 0 and sizer.row_ms >= 0
    with pytest.raises(DDTreeError, match="the target's context of 128 positions leaves no room to time verifies "
                                          "of 128 rows: lower --budget, or pass --adaptive-size off"):
        TreeSizer.measure(target, max_rows=128, repeats=1)


def test_the_cost_line_reads_the_fixed_cost_then_the_cost_of_a_row():
    """The line `ddtree bench --adaptive-size` prints of what it measured: only "ms per row" was checked, so the
    fixed cost printed as the per-row one (a 40 ms step read as 40 ms a row, trees that could never pay) passed."""
    assert TreeSizer(fixed_ms=40.0, row_ms=1.1).describe() == "verify cost 40.0 ms + 1.10 ms per row"
