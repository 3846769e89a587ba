"""The draft tree: heap = brute-force top-B prefixes; the tree mask matches running each path alone."""

import itertools
import math

import numpy as np
import pytest
import torch

from ddtree.calibration import learning_from, load_calibration, save_calibration
from ddtree.target_runner import DynamicTarget, StaticTarget
from ddtree.decoding import OnlineCalibration, draft_tree
from ddtree.errors import DDTreeError
from ddtree.sizing import TreeSizer
from ddtree.tree import (
    DraftTree, ancestor_matrix, build_tree, chain_tree, context_lookup, tree_positions, truncated, walk,
)


def brute_force_top_prefixes(log_probs: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    depth_count, vocab = log_probs.shape
    scored = []
    for depth in range(1, depth_count + 1):
        for prefix in itertools.product(range(vocab), repeat=depth):
            scored.append((sum(log_probs[d, t].item() for d, t in enumerate(prefix)), prefix))
    scored.sort(reverse=True)
    return {prefix for _, prefix in scored[:budget]}


def node_paths(tree) -> list[tuple[int, ...]]:
    paths = []
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        paths.append((paths[parent - 1] if parent else ()) + (token,))
    return paths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 7, 20])
def test_heap_builds_the_top_budget_prefixes(seed, budget):
    generator = torch.Generator().manual_seed(seed)
    depth_count, vocab = 3, 4
    logits = torch.randn(depth_count, vocab, generator=generator) * 2
    log_probs = torch.log_softmax(logits, -1)
    tree = build_tree(logits, budget)
    paths = node_paths(tree)

    assert len(tree) == min(budget, sum(vocab**d for d in range(1, depth_count + 1)))
    assert set(paths) == brute_force_top_prefixes(log_probs, budget)
    assert len(set(paths)) == len(paths)
    for row, (parent, depth, path) in enumerate(zip(tree.parents, tree.depths, paths), start=1):
        assert parent < row  # parents before children
        assert depth == len(path)
        if len(path) > 1:  # prefix-closed: the parent's path is this path minus its last token
            assert paths[parent - 1] == path[:-1]
        else:
            assert parent == 0
        expected = sum(log_probs[d, t].item() for d, t in enumerate(path))
        assert math.isclose(tree.log_probs[row - 1], expected, abs_tol=1e-5)
    assert all(a >= b - 1e-6 for a, b in zip(tree.log_probs, tree.log_probs[1:]))  # pops non-increasing


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [2, 9, 30])
def test_heap_with_redrafted_branches_builds_the_top_prefixes_under_each_branchs_rows(seed, budget):
    """Below a re-drafted depth-1 token the paths score that branch's rows; below the others, the block's own."""
    generator = torch.Generator().manual_seed(seed)
    depth_count, vocab = 3, 4
    logits = torch.randn(depth_count, vocab, generator=generator) * 2
    branches = {token: torch.randn(depth_count - 1, vocab, generator=generator) * 2 for token in (2, 0)}
    log_probs = torch.log_softmax(logits, -1)
    branch_log_probs = {token: torch.log_softmax(rows, -1) for token, rows in branches.items()}

    def score(prefix):
        rows = branch_log_probs.get(prefix[0], log_probs[1:])
        return log_probs[0, prefix[0]].item() + sum(rows[d, t].item() for d, t in enumerate(prefix[1:]))

    every = [p for depth in range(1, depth_count + 1) for p in itertools.product(range(vocab), repeat=depth)]
    best = set(sorted(every, key=score, reverse=True)[:budget])
    tree = build_tree(logits, budget, branches)
    paths = node_paths(tree)
    assert set(paths) == best and len(paths) == budget
    for row, (parent, path) in enumerate(zip(tree.parents, paths), start=1):
        assert parent < row and math.isclose(tree.log_probs[row - 1], score(path), abs_tol=1e-5)
    assert build_tree(logits, budget, {}).tokens == build_tree(logits, budget).tokens  # no branch: the plain tree
    # A draft vocabulary: the columns outside it are -inf; built over its columns alone, the same tree.
    vocab, wide = torch.tensor([1, 4, 6, 7]), torch.full((depth_count, 9), float("-inf"))
    wide[:, [1, 4, 6, 7]] = logits
    wide_branches = {[1, 4, 6, 7][token]: torch.full((depth_count - 1, 9), float("-inf")).index_copy(
        1, vocab, rows) for token, rows in branches.items()}
    full, narrow = build_tree(wide, budget, wide_branches), build_tree(wide, budget, wide_branches, vocab)
    assert full.tokens == narrow.tokens == [[1, 4, 6, 7][t] for t in tree.tokens] and full.parents == narrow.parents
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(full.log_probs, narrow.log_probs))
    first, rows = int(logits[0].argmax()), branches[2]  # the chain continues as re-drafted behind its first token
    assert draft_tree(logits, None, branches={first: rows}).tokens == [first] + rows.argmax(-1).tolist()


def test_no_budget_or_no_depth_gives_the_empty_tree():
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    empty = DraftTree([], [], [], [], [{}])
    assert build_tree(logits, 0) == empty and build_tree(logits[:0], 4) == empty
    assert empty.expected_acceptance == 1.0


def test_a_two_row_block_scores_depth_two_below_a_redrafted_token_by_its_branch():
    """--redraft on a block of 2 rows: the depth-2 node under the re-drafted token is the branch's, not the block's."""
    logits, branch = torch.tensor([[3.0, 0.0, 0.0], [0.0, 5.0, 0.0]]), torch.tensor([[0.0, 0.0, 5.0]])
    tree = build_tree(logits, 2, {0: branch})
    expected = torch.log_softmax(logits[0], -1)[0] + torch.log_softmax(branch[0], -1)[2]
    assert tree.tokens == [0, 2] and tree.parents == [0, 1]
    assert math.isclose(tree.log_probs[1], expected.item(), abs_tol=1e-5)


@pytest.mark.parametrize("tokens,length,expected", [
    ([1, 2, 3, 4, 9, 2, 3], 3, [4, 9, 2]),  # the last 2 tokens recur: what followed them
    ([2, 3, 5, 2, 3, 6, 3], 2, [6, 3]),  # only the last token recurs: its most recent occurrence wins
    ([1, 2, 3, 1, 2, 3, 1, 2, 3], 5, [1, 2, 3, 1, 2]),  # the match runs into the end: it goes on with period 3
    ([3, 5, 3], 1, [5]),  # a lookup of one token (the last round's room, --lookup 1)
    ([1, 2, 3], 4, []),  # nothing recurs
    ([7], 4, []),
    ([4, 4], 5, [4, 4, 4, 4, 4]),  # period 1
    ([1, 2, 3, 4, 1, 2], 5, [3, 4, 1, 2, 3]),  # a shorter match ([1, 2]) overlapping the end: period 4
    ([1, 2, 3, 9, 9, 1, 2, 3, 7, 5, 1, 2, 3], 4, [7, 5, 1, 2]),  # room before the end: no period needed
    ([1, 2, 9, 2, 5, 1, 2], 2, [9, 2]),  # the 2-token suffix wins over a more recent match of its last token
    ([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], 2, [9, 5]),  # by default 3 tokens: over a more recent match of the last 2
])
def test_context_lookup_continues_the_latest_recurrence_of_the_longest_suffix(tokens, length, expected):
    assert context_lookup(tokens, length) == expected


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,lookup", [(8, [3, 1, 2]), (4, [0, 0, 0, 0, 0]), (2, [1, 2, 3])])
def test_a_grafted_path_stays_within_the_budget_and_keeps_the_drafter_scores(seed, budget, lookup):
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)) * 2
    log_probs = torch.log_softmax(logits, -1)
    tree = draft_tree(logits, budget, lookup)
    paths = node_paths(tree)
    kept = lookup[: budget - 1]  # the drafter keeps at least one node
    assert len(tree) <= budget
    assert all(tuple(kept[:d]) in paths for d in range(1, len(kept) + 1))  # the whole path, from the root
    drafted = build_tree(logits, budget - len(kept))  # the drafter's own tree comes first, as built
    assert len(drafted) >= 1  # even where the copy is as long as the budget
    assert (tree.tokens[: len(drafted)], tree.parents[: len(drafted)]) == (drafted.tokens, drafted.parents)
    assert all(parent < row for row, parent in enumerate(tree.parents, start=1))  # parents first: the mask holds
    assert len(set(paths)) == len(paths)
    for path, score in zip(paths, tree.log_probs):
        assert score == pytest.approx(sum(log_probs[d, t].item() for d, t in enumerate(path)), abs=1e-5)
    assert tree.grafted == tree.depths[len(drafted):]  # the depths of exactly the nodes the graft added


@pytest.mark.parametrize("budget,lookup", [(4, []), (4, [0, 0]), (2, [])])
def test_a_quoted_path_as_long_as_the_budget_leaves_the_drafter_a_node_too(budget, lookup):
    """A corpus quote that took the rest of the budget left the drafter no node: a quote wrong at depth 1 then left
    the round nothing to accept."""
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)) * 2
    quoted = [1, 2, 3, 1, 2]
    tree = draft_tree(logits, budget, lookup, quoted=quoted)
    kept = quoted[: budget - len(lookup) - 1]
    drafted = build_tree(logits, budget - len(lookup) - len(kept))
    assert len(drafted) >= 1 and len(tree) <= budget
    assert (tree.tokens[: len(drafted)], tree.parents[: len(drafted)]) == (drafted.tokens, drafted.parents)
    assert tuple(kept) in node_paths(tree)



@pytest.mark.parametrize("graft", ["lookup", "quoted"])
def test_the_sizer_counts_a_grafted_paths_rows_as_verified_whatever_it_keeps_of_the_drafters_tree(graft):
    """A graft's rows are verified whatever the sizer keeps, so they weigh in its cut. Drafter nodes of p 0.5, 0.4,
    then 0.05 (depths 2-3 uniform over 10 tokens); by hand at 0 ms + 1 ms a row (the root is a row), with the graft's
    3 rows: n=1 1.5/5 = 0.300, n=2 1.9/6 = 0.317, n=3 1.95/7 = 0.279, so 2 nodes; priced without them n=1 1.5/2 =
    0.75 beats n=2 1.9/3 = 0.63, and the drafter would keep 1."""
    first = torch.tensor([0.5, 0.4] + [0.0125] * 8).log()
    logits = torch.stack([first, torch.zeros(10), torch.zeros(10)])
    tree = draft_tree(logits, 8, sizer=TreeSizer(fixed_ms=0.0, row_ms=1.0), **{graft: [5, 6, 7]})
    assert (tree.tokens, tree.parents, tree.depths) == ([0, 1, 5, 6, 7], [0, 0, 0, 3, 4], [1, 1, 1, 2, 3])

def test_a_graft_longer_than_the_draft_is_kept_whole_and_its_deeper_nodes_add_nothing_to_the_expectation():
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)) * 2  # a 3-deep draft
    lookup = [1, 2, 3, 4, 5]  # a copy 5 deep
    tree = draft_tree(logits, 16, lookup)
    paths = node_paths(tree)
    assert tuple(lookup) in paths and max(tree.depths) == 5  # verified past the draft's depth
    deep = [score for path, score in zip(paths, tree.log_probs) if len(path) > 3]
    assert deep and all(score == -math.inf for score in deep)
    shallow = [score for path, score in zip(paths, tree.log_probs) if len(path) <= 3]
    assert tree.expected_acceptance == pytest.approx(1 + sum(math.exp(score) for score in shallow))


def test_the_expectation_before_stop_tokens_leaves_out_the_nodes_below_one():
    """Rows: 1 (token 5, depth 1), 2 (token 7, depth 1), 3 (token 9 under 5), 4 (token 3 under 9), 5 (token 4 under 7).
    With 5 a stop token, the reply ends there: nodes 3 and 4 below it can never be committed."""
    from ddtree.tree import DraftTree
    log_probs = [math.log(p) for p in (0.5, 0.3, 0.4, 0.2, 0.1)]
    tree = DraftTree([5, 7, 9, 3, 4], [0, 0, 1, 3, 2], [1, 1, 2, 3, 2], log_probs)
    assert tree.expected_acceptance == pytest.approx(2.5)
    assert tree.expected_acceptance_before({5}) == pytest.approx(1 + 0.5 + 0.3 + 0.1)  # the stop node itself counts
    assert tree.expected_acceptance_before({9}) == pytest.approx(1 + 0.5 + 0.3 + 0.4 + 0.1)
    assert tree.expected_acceptance_before({5, 9}) == pytest.approx(1.9)
    # a stop token at a leaf, the last row: nothing lies below it (a depth-1 node's parent is the root, not a row)
    assert tree.expected_acceptance_before({4}) == pytest.approx(2.5)
    assert tree.expected_acceptance_before(set()) == tree.expected_acceptance_before({2}) == tree.expected_acceptance


def test_the_expectation_before_a_stop_token_on_the_last_row_still_counts_every_depth_1_node():
    """Depth-1 nodes hang from the root (row 0), which is no draft token: reading it as tokens[-1] would put every
    node under the last row's stop token. Rows: 5 and 7 at depth 1, 4 under 7; with 4 a stop token, nothing is below
    it, so all three count: 1 + 0.5 + 0.3 + 0.1."""
    tree = DraftTree([5, 7, 4], [0, 0, 2], [1, 1, 2], [math.log(p) for p in (0.5, 0.3, 0.1)])
    assert tree.expected_acceptance_before({4}) == pytest.approx(1.9) == tree.expected_acceptance


@pytest.mark.parametrize("seed", range(3))
def test_grafted_nodes_below_a_redrafted_token_score_its_redrafted_rows(seed):
    """Re-drafting behind a depth-1 token replaces the rows below it (build_tree scores its nodes so); a lookup or a
    corpus path through that token is scored from the same rows, so the expected acceptance is the drafter's own."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 6, generator=generator) * 2
    first = int(logits[0].argmax())
    branch = torch.randn(3, 6, generator=generator) * 2  # the re-drafted depths 2-4 behind `first`
    branch_rows = torch.cat([logits[:1], branch])
    lookup, quoted = [first, 5, 4, 3], [first, 0, 1]
    tree = draft_tree(logits, 12, lookup, branches={first: branch}, quoted=quoted)
    paths = node_paths(tree)
    for path, score in zip(paths, tree.log_probs):
        rows = torch.log_softmax(branch_rows if path[0] == first else logits, -1)
        assert score == pytest.approx(sum(rows[d, t].item() for d, t in enumerate(path)), abs=1e-5), path
    assert tuple(lookup) in paths and tuple(quoted) in paths


def test_online_calibration_scores_the_nodes_a_graft_adds_by_its_lookups_learned_acceptance():
    online = OnlineCalibration()
    online.observe_graft("context", [1, 2, 3], path=[0, 3, 3], accepted=[0, 3, 9])  # followed 2 deep
    online.observe_graft("context", [2, 3], path=[0, 3, 3], accepted=[1])  # not followed
    online.observe_graft("corpus", [1], path=[2], accepted=[2, 5])  # followed: the corpus's own table
    assert online.graft_log_prob("context", 1) == pytest.approx(math.log(2 / 3))  # (1 + 1) / (1 + 2)
    assert online.graft_log_prob("context", 2) == pytest.approx(math.log(2 / 4))
    assert online.graft_log_prob("context", 3) == pytest.approx(math.log(1 / 4))
    assert online.graft_log_prob("context", 4) == pytest.approx(math.log(1 / 2))  # nothing seen yet
    assert online.graft_log_prob("corpus", 1) == pytest.approx(math.log(2 / 3))
    assert online.graft_log_prob("corpus", 2) == pytest.approx(math.log(1 / 2))
    logits = torch.tensor([[4.0, 0, 0, 0], [0, 4.0, 0, 0], [0, 0, 4.0, 0]])  # the drafter's own path: 0, 1, 2
    tree = draft_tree(logits, 6, [0, 3, 3], online=online, quoted=[2])  # shares depth 1 with the drafter, then leaves it
    assert tree.grafted == [2, 3] and tree.quoted == [1]
    added = {(tree.depths[row], tree.tokens[row]): tree.log_probs[row] for row in range(len(tree) - 3, len(tree))}
    assert added == {(2, 3): pytest.approx(math.log(2 / 4)), (3, 3): pytest.approx(math.log(1 / 4)),
                     (1, 2): pytest.approx(math.log(2 / 3))}


def test_the_corpus_lookups_nodes_score_the_corpus_table_not_the_context_lookups():
    online = OnlineCalibration()
    online.observe_graft("context", [1], path=[3], accepted=[3])  # context at depth 1: (1 + 1) / (1 + 2)
    for _ in range(2):
        online.observe_graft("corpus", [1], path=[3], accepted=[])  # corpus at depth 1: (0 + 1) / (2 + 2)
    logits = torch.tensor([[4.0, 0, 0, 0], [0, 4.0, 0, 0]])  # the drafter's own path: 0, 1
    tree = draft_tree(logits, 4, online=online, quoted=[3])
    assert tree.quoted == [1] and tree.tokens[-1] == 3
    assert tree.log_probs[-1] == pytest.approx(math.log(1 / 4))


def test_a_verified_round_teaches_each_lookup_from_the_path_it_grafted():
    """observe_round hands each lookup its own path: the context lookup's (followed here, 2 deep) and the corpus
    lookup's (not followed). Judged by the other's path, a lookup's table learns another lookup's acceptance."""
    online = OnlineCalibration()
    # the drafter's 7; the context lookup's graft 7 -> 8 adds 8 at depth 2; the corpus lookup's 9 at depth 1
    tree = DraftTree([7, 8, 9], [0, 1, 0], [1, 2, 1], [math.log(0.6), math.log(0.3), math.log(0.2)],
                     [{7: 1, 9: 3}, {8: 2}, {}, {}], grafted=[2], quoted=[1])
    online.observe_round(8, tree, tree.expected_acceptance, grafted=[7, 8], quoted=[9], accepted=[7, 8])
    assert online.graft_accepted == {("context", 2): 1, ("corpus", 1): 0}
    assert online.graft_rounds == {("context", 2): 1, ("corpus", 1): 1}


def test_a_calibration_saved_and_loaded_scores_alike_and_learns_nothing_more_when_frozen(tmp_path):
    online = OnlineCalibration()
    online.observe(32, expected=3.0, accepted_length=1)  # over-confident: warmed
    online.observe(None, expected=1.0, accepted_length=2)  # under-confident: cooled
    online.observe_graft("context", [1, 2], path=[4, 5], accepted=[4])
    save_calibration(tmp_path / "calibration.json", online, {"prompts": "p.jsonl"})
    loaded = load_calibration(tmp_path / "calibration.json")
    assert loaded.frozen and not online.frozen
    for shape in (32, None):
        assert loaded.temperature(shape) == pytest.approx(online.temperature(shape), rel=1e-5)
    assert loaded.temperature(32) > 1.0 > loaded.temperature(None)
    assert loaded.temperature(8) == loaded.temperature(64) == loaded.temperature(32)  # the nearest budget's
    for depth in (1, 2):
        assert loaded.graft_log_prob("context", depth) == online.graft_log_prob("context", depth)
    before = loaded.state()
    loaded.observe(32, expected=9.0, accepted_length=1)
    loaded.observe_graft("context", [1], path=[4], accepted=[])
    assert loaded.state() == before  # frozen
    assert loaded.graft_log_prob("context", 5) == loaded.graft_log_prob("context", 2)  # deeper than it saw: its deepest
    assert online.graft_log_prob("context", 5) == pytest.approx(math.log(1 / 2))  # learning: the prior until it sees one
    going_on = loaded.copy()  # --online-calibration from a file: learns from where it was
    going_on.observe(32, expected=9.0, accepted_length=1)
    assert going_on.temperature(32) > loaded.temperature(32) and not going_on.frozen


def test_a_drafter_wrong_round_after_round_stops_at_the_temperature_bounds_a_file_can_hold(tmp_path):
    """Learning keeps log T within +-LOG_LIMIT: past it, a drafter far over- or under-confident would warm or cool
    without end, and `ddtree calibrate` would write a temperature its own file check (e^-2..e^2) refuses to load."""
    online = OnlineCalibration()
    for _ in range(200):  # each round moves log T by RATE x 8: 16 in all, either way
        online.observe(32, expected=9.0, accepted_length=1)
        online.observe(None, expected=1.0, accepted_length=9)
    assert online.log_temperature(32) == OnlineCalibration.LOG_LIMIT == -online.log_temperature(None)
    save_calibration(tmp_path / "calibration.json", online, {})
    assert load_calibration(tmp_path / "calibration.json").state() == online.state()


def test_the_temperature_bound_is_the_e2_that_files_and_their_refusal_name(tmp_path):
    """Learning and the file check share one bound, and it is the e^-2..e^2 the refusal names: a wider one would load
    a hand-edited temperature of 10, outside the range that line states, and learn files an older `ddtree` refuses."""
    online = OnlineCalibration()
    for _ in range(200):
        online.observe(32, expected=9.0, accepted_length=1)
    assert online.temperature(32) == pytest.approx(math.exp(2))
    path = tmp_path / "calibration.json"
    path.write_text('{"format_version": 1, "temperatures": {"8": 10.0}, "graft_acceptance": {}}')
    with pytest.raises(DDTreeError, match=r"temperature 8: 10.0 is not a number within e\^-2..e\^2"):
        load_calibration(path)


def test_a_calibration_file_written_before_decoded_with_keeps_the_sampling_and_dtype_recorded_beside_it(tmp_path):
    """Files from before decoded_with record the temperature and dtype at the top level: dropping either would decode
    a float32-learned file in bfloat16 (or a sampled one greedily) without the note that the expected tau is off."""
    path = tmp_path / "calibration.json"
    path.write_text('{"format_version": 1, "temperatures": {"8": 1.0}, "graft_acceptance": {}, "temperature": 0.7, '
                    '"dtype": "float32", "decoded_with": {"lookup": 0}}')
    calibration = load_calibration(path)
    assert calibration.decoded_with == {"temperature": 0.7, "dtype": "float32", "lookup": 0}
    assert calibration.differences({"dtype": "bfloat16"}) == ["dtype float32 here bfloat16"]


def test_a_budget_between_two_calibrated_ones_takes_the_nearest_and_on_a_tie_the_smaller():
    """The nearest budget's temperature, and on a tie the smaller budget's (the key (distance, budget)): which of two
    equidistant budgets it takes is fixed, not left to the order of the file's keys."""
    calibration = OnlineCalibration.from_state({"temperatures": {"16": 0.8, "8": 1.5}, "graft_acceptance": {}})
    assert calibration.temperature(12) == pytest.approx(1.5)
    assert calibration.temperature(11) == pytest.approx(1.5) and calibration.temperature(13) == pytest.approx(0.8)


def test_a_calibration_files_chain_temperature_scales_the_chain_and_its_budgets_the_ddtree_trees():
    """The file keeps the chain's temperature under "chain" and a ddtree tree's under its budget: the decoding loop
    looks one up by OnlineCalibration.shape(method, budget), so a mix-up there cools the trees by the chain's
    temperature and makes the expected tau of every round drift from the measured one."""
    calibration = OnlineCalibration.from_state({"temperatures": {"32": 2.0, "chain": 0.5}, "graft_acceptance": {}})
    assert calibration.temperature(OnlineCalibration.shape("ddtree", 32)) == pytest.approx(2.0)
    assert calibration.temperature(OnlineCalibration.shape("chain", 32)) == pytest.approx(0.5)


def test_a_frozen_calibration_prices_a_depth_it_never_saw_by_the_same_lookups_deepest_depth():
    """The context and corpus lookups are accepted at their own rates (a corpus reply copied in is followed far less
    often than the prompt's own text), so an unseen depth takes its own lookup's deepest chance, not another's."""
    calibration = OnlineCalibration.from_state({"temperatures": {}, "graft_acceptance": {
        "context": {"1": [9, 10]}, "corpus": {"2": [0, 10]}}})
    assert calibration.graft_log_prob("context", 3) == pytest.approx(math.log(10 / 12))
    assert calibration.graft_log_prob("corpus", 3) == pytest.approx(math.log(1 / 12))


def test_a_frozen_calibration_prices_a_depth_it_skipped_by_the_deepest_one_above_it_not_one_below():
    """Acceptance only falls with depth, so a depth a file never saw takes the deepest seen depth shallower than it:
    with depths 1 and 3 seen, depth 2 scores depth 1's (9 + 1) / (10 + 2), not depth 3's (1 + 1) / (10 + 2)."""
    calibration = OnlineCalibration.from_state({"temperatures": {}, "graft_acceptance": {
        "context": {"1": [9, 10], "3": [1, 10]}}})
    assert calibration.graft_log_prob("context", 2) == pytest.approx(math.log(10 / 12))
    assert calibration.graft_log_prob("context", 4) == pytest.approx(math.log(2 / 12))


def test_a_calibration_describes_each_budgets_temperature_and_the_chains_as_stderr_prints_them():
    assert OnlineCalibration().describe() == "none"
    calibration = OnlineCalibration.from_state({"temperatures": {"32": 1.14, "chain": 0.5}, "graft_acceptance": {}})
    assert calibration.describe() == "ddtree@32 1.14, chain 0.50"


def test_online_calibration_from_a_shipped_file_learns_on_from_its_temperature_and_leaves_the_file_frozen():
    """--online-calibration starts from the drafter's file where it has one: a copy that learns (a frozen copy would
    silently learn nothing), while the file's own calibration stays as loaded."""
    shipped = OnlineCalibration.from_state({"temperatures": {"8": 1.5}, "graft_acceptance": {"context": {"1": [3, 4]}}})
    online = learning_from(shipped)
    assert not online.frozen and online.temperature(8) == pytest.approx(1.5)
    online.observe(8, expected=3.0, accepted_length=1)  # log T moves by RATE x 2
    online.observe_graft("context", [1], path=[5], accepted=[5])
    assert online.log_temperature(8) == pytest.approx(math.log(1.5) + 0.02)
    assert online.graft_log_prob("context", 1) == pytest.approx(math.log(5 / 7))  # (3 + 1 + 1) / (4 + 1 + 2)
    assert shipped.temperature(8) == pytest.approx(1.5) and shipped.graft_rounds == {("context", 1): 4}
    fresh = learning_from(None)
    assert not fresh.frozen and fresh.log_temperatures == {} and fresh.graft_rounds == {}


@pytest.mark.parametrize("learned, now, noted", [
    ({"temperature": 0, "top_p": 1.0, "top_k": 0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
     ["temperature 0 here 0.7", "top_p 1.0 here 0.9", "top_k 0 here 20"]),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 20}, {"temperature": 0, "top_p": 1.0, "top_k": 0},
     ["temperature 0.7 here 0", "top_p 0.9 here 1.0", "top_k 20 here 0"]),
    ({"temperature": 0, "top_p": 1.0, "top_k": 0}, {"temperature": 0, "top_p": 0.9, "top_k": 20}, []),
], ids=["learned-greedy", "decoded-greedy", "both-greedy"])
def test_a_calibration_notes_top_p_and_top_k_unless_both_sides_decode_greedily(learned, now, noted):
    """Greedy decoding ignores top_p and top_k, so they are left out only where both sides decode greedily: with one
    side sampling they shape the acceptance the file priced, and running calibrate again with them clears the note."""
    calibration = OnlineCalibration.from_state({"temperatures": {"8": 1.0}, "graft_acceptance": {},
                                                "decoded_with": learned})
    assert calibration.differences(now) == noted


def test_a_settled_calibration_keeps_the_mean_temperature_of_the_last_half_of_its_rounds():
    online = OnlineCalibration(record=True)
    for expected, accepted in [(5.0, 1), (5.0, 1), (2.0, 2), (1.0, 3)]:  # warmed twice, held, cooled
        online.observe(32, expected, accepted)
    steps = [0.04, 0.08, 0.08, 0.06]  # log T after each round
    settled = online.settled()
    assert settled.frozen and online.log_temperature(32) == pytest.approx(steps[-1])
    assert settled.log_temperature(32) == pytest.approx((steps[2] + steps[3]) / 2)
    assert OnlineCalibration().settled().log_temperatures == {}  # nothing recorded, nothing averaged


def test_a_settled_calibration_averages_the_clamped_temperatures_so_its_file_loads(tmp_path):
    """`ddtree calibrate` saves the settled mean: it must average the log temperatures as held (within +-LOG_LIMIT),
    not the unclamped steps, or a drafter pinned at the ceiling would settle above e^2 and its file be refused."""
    online = OnlineCalibration(record=True)
    for _ in range(300):  # log T would reach RATE x 8 x 300 = 24 unclamped
        online.observe(32, expected=9.0, accepted_length=1)
    settled = online.settled()
    assert settled.log_temperature(32) == pytest.approx(OnlineCalibration.LOG_LIMIT)
    save_calibration(tmp_path / "calibration.json", settled, {})
    assert load_calibration(tmp_path / "calibration.json").temperature(32) == pytest.approx(math.exp(2), rel=1e-5)


def test_a_drafter_already_calibrated_keeps_its_temperature_round_after_round():
    """Expected tau counts the bonus token (1 + the path probabilities), so the measured side must count it too: a
    round read one token short would warm every drafter by RATE a round, up to the e^2 ceiling, and `ddtree
    calibrate` would write that."""
    online = OnlineCalibration()
    certain = DraftTree([7], [0], [1], [0.0], [{7: 1}, {}])  # p 1, accepted: expected 2, measured 2
    online.observe_round(8, certain, certain.expected_acceptance, [], [], [7])
    assert online.log_temperature(8) == 0.0  # not moved (first, while a bias has room below the e^2 ceiling)
    even = DraftTree([7], [0], [1], [math.log(0.5)], [{7: 1}, {}])  # one node of p 1/2: expected tau 1.5
    for round_ in range(200):  # accepted every other round: measured tau 2, 1, 2, 1, ..., mean 1.5
        online.observe_round(8, even, even.expected_acceptance, [], [], [7] if round_ % 2 == 0 else [])
    assert online.temperature(8) == pytest.approx(1.0, abs=0.05)


def test_ancestor_matrix_and_walk():
    # depth-1 tokens 5 (p .6) and 6 (p .4); depth 2 token 7 then 8
    logits = torch.log(torch.tensor([[0.0, 0, 0, 0, 0, 0.6, 0.4, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0.7, 0.3]]) + 1e-9)
    tree = build_tree(logits, 4)  # 5, 5->7, 6, 5->8 or 6->7
    visible = ancestor_matrix(tree)
    for row in range(1, len(tree) + 1):
        chain, node = {0, row}, row
        while node:
            node = tree.parents[node - 1]
            chain.add(node)
        assert {j for j in range(len(tree) + 1) if visible[row, j]} == chain
    # a walk that takes the non-first branch at depth 1 (token 6) then stops
    target_choice = {0: 6}
    accepted, bonus = walk(tree, lambda row: target_choice.get(row, 99))
    assert [tree.tokens[r - 1] for r in accepted] == [6] and bonus == 99


def test_a_chain_is_verified_causally_and_walked_to_its_first_miss():
    """DFlash's chain as a tree: each token sees every one before it (a causal mask), at start + its depth; a chain
    whose nodes all hung from the root let the target verify each token without the ones before it."""
    tree = chain_tree([5, 6, 7])
    assert (tree.parents, tree.depths) == ([0, 1, 2], [1, 2, 3])
    assert (ancestor_matrix(tree) == np.tril(np.ones((4, 4), dtype=bool))).all()
    assert tree_positions(tree, 10).tolist() == [10, 11, 12, 13]
    target_choice = {0: 5, 1: 6, 2: 9}  # the target agrees on 5 and 6, then picks 9
    assert walk(tree, lambda row: target_choice[row]) == ([1, 2], 9)


def test_a_tree_cut_to_fewer_nodes_is_the_tree_built_with_that_budget_and_its_last_node_can_be_accepted():
    """The adaptive sizer (a CPU's default) builds once at the largest budget and cuts. A cut that left the last node
    out of its parent's children only lowered acceptance (it was verified, never accepted); one that dropped its own
    children map was an IndexError when the walk reached it."""
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 2
    whole = build_tree(logits, 12)
    for nodes in range(1, 12):
        cut, built = truncated(whole, nodes), build_tree(logits, nodes)
        assert (cut.tokens, cut.parents, cut.depths, cut.log_probs, cut.children) == (
            built.tokens, built.parents, built.depths, built.log_probs, built.children), nodes
        assert cut.expected_acceptance == built.expected_acceptance, nodes  # what the sizer weighs the cut by
        path, row = [], nodes  # the rows from depth 1 down to the last node
        while row:
            path.insert(0, row)
            row = cut.parents[row - 1]
        target_choice = dict(zip([0] + path, [cut.tokens[r - 1] for r in path]))  # the target picks that path
        accepted, _ = walk(cut, lambda row: target_choice.get(row, -1))
        assert accepted == path, nodes


@pytest.mark.parametrize("runner_kind", ["dynamic", "static"])
def test_tree_forward_matches_each_path_alone(smollm2, runner_kind):
    """Both target runners (ddtree/target_runner.py): the static one pads the tree to a fixed row count."""
    model, tokenizer = smollm2
    prompt = tokenizer("def fibonacci(n):\n    ", add_special_tokens=False)["input_ids"]
    generator = torch.Generator().manual_seed(0)
    tree = build_tree(torch.randn(4, model.config.vocab_size, generator=generator) * 3, 12)
    root = 1000
    if runner_kind == "dynamic":
        runner = DynamicTarget(model, hidden_states=False)
    else:
        runner = StaticTarget(model, hidden_states=False, max_rows=20, capacity=len(prompt) + 40, cuda_graph=False)
    with torch.no_grad():
        runner.prefill(prompt)
        start = len(prompt)
        tree_logits, _ = runner.verify([root] + tree.tokens, tree_positions(tree, start), ancestor_matrix(tree), start)
        assert tree_logits.shape[0] == len(tree) + 1
        for row, path in enumerate([()] + node_paths(tree)):
            alone = model(torch.tensor([prompt + [root, *path]])).logits[0, -1]
            torch.testing.assert_close(tree_logits[row], alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize("budget", [6, 20])  # (6: no tie of scores at the edge of the best set)
def test_tokens_the_drafter_rules_out_are_never_nodes(budget):
    """A drafter may give most tokens probability 0 (-inf logits): the tree holds only tokens it can draft, every
    score finite, the best `budget` of the 2 + 4 + 8 possible prefixes (all 14 when the budget is larger)."""
    logits = torch.full((3, 6), float("-inf"))
    logits[:, 2], logits[:, 4] = 1.0, 0.2
    tree = build_tree(logits, budget)
    assert all(math.isfinite(score) for score in tree.log_probs)
    assert set(tree.tokens) == {2, 4}
    finite = torch.log_softmax(logits[:, [2, 4]], -1)  # the same drafter over its two tokens alone
    expected = {tuple((2, 4)[t] for t in prefix) for prefix in brute_force_top_prefixes(finite, min(budget, 14))}
    assert set(node_paths(tree)) == expected and len(tree.tokens) == min(budget, 14)


@pytest.mark.parametrize("broken", ["nan", "inf", "all -inf"])
def test_a_depth_one_row_that_is_not_finite_gives_an_empty_tree(broken):
    """NaN or +inf logits at depth 1 (a drafter that diverged, a 0 temperature) give no node whose score is NaN: the
    sizer and the expected acceptance read the scores (a NaN score made TreeSizer.size raise IndexError)."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    logits[0] = {"nan": float("nan"), "inf": float("-inf"), "all -inf": float("-inf")}[broken]
    if broken == "inf":
        logits[0, 2] = float("inf")
    assert build_tree(logits, 8).tokens == []
    logits[1] = float("nan")  # a finite depth 1 above a broken depth 2: the depth-1 nodes alone
    tree = build_tree(torch.cat([torch.randn(1, 6), logits[1:]]), 8)
    assert tree.depths == [1] * 6 and all(math.isfinite(score) for score in tree.log_probs)


def test_a_round_whose_expected_acceptance_is_not_a_number_leaves_the_online_temperature_alone():
    online = OnlineCalibration()
    online.observe(32, expected=3.0, accepted_length=1)
    warmed = online.temperature(32)
    online.observe(32, expected=float("nan"), accepted_length=2)  # max(-2, nan) is -2: it pinned T at its floor
    assert online.temperature(32) == warmed
