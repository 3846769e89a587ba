"""Losslessness at T=0 in fp32 on the built-in target: every method reproduces greedy decoding.

Drafters: an untrained random one (nearly nothing accepted) and an oracle rigged from the
reference continuation, so that long paths, non-first branches and mid-path rejections are all
accepted or refused and the walk and the KV-cache compaction are exercised.
"""

import pytest
import torch

from ddtree.cli import load_drafter
from ddtree.decoding import DrafterRunner, OnlineCalibration, generate
from ddtree.errors import DDTreeError
from ddtree.packed_linear import pack_linears, packing_available
from ddtree.sizing import TreeSizer
from ddtree.target_runner import StaticTarget, static_target
from ddtree.targets import stop_token_ids
from rigged import RedraftRigged, RiggedDrafter, hf_greedy  # tests/rigged.py

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Give three tips for writing clear emails."}],
    [{"role": "user", "content": "What is a hash table? Answer briefly."}],
]
MAX_NEW = 40
# An untrained drafter has nearly every round rejected at the root, one committed token and one cache compaction each:
# 24 of them exercise what 40 do, at 60% of the cost (its tests were the suite's slowest).
RANDOM_NEW = 24


def _prompt_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def references(smollm2):
    model, tokenizer = smollm2
    out = []
    for messages in PROMPTS:
        prompt = _prompt_ids(tokenizer, messages)
        greedy = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stop_token_ids(model, tokenizer)
        )[0, len(prompt):].tolist()
        out.append((prompt, greedy))
    return out


@pytest.fixture(scope="module")
def random_drafter(smollm2):
    model, tokenizer = smollm2
    return DrafterRunner(load_drafter("random", model, tokenizer, "smollm2-135m"), model)


@pytest.fixture(scope="module")
def random_runs(smollm2, references, random_drafter):
    """The random drafter's generation of `new` tokens (MAX_NEW unless given) after a prompt of `references`, run once
    for each (prompt index, method, budget, static, lookup, new): tests that hold the same run to different properties
    share it (one is about 40 rejected rounds, 10 s on a 2-core AVX2 EPYC)."""
    model, tokenizer = smollm2
    runs = {}

    def run(index, method, budget, static=False, lookup=0, new=MAX_NEW):
        key = (index, method, budget, static, lookup, new)
        if key not in runs:
            runs[key] = generate(model, references[index][0], method, random_drafter, budget, new,
                                 stop_token_ids(model, tokenizer), static=static, lookup=lookup)
        return runs[key]

    return run


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
def test_ar_matches_greedy(smollm2, references, static):
    """ar's every round verifies the root alone and keeps it: RANDOM_NEW tokens after one prompt are rounds enough
    (the same one-row verify and keep each round, whatever the prompt; three prompts cost 18 s in both caches on a
    2-core AVX2 EPYC, and the pooled static target's reuse over stale slots is held by the static tests below)."""
    model, tokenizer = smollm2
    for prompt, greedy in references[:1]:
        result = generate(model, prompt, "ar", max_new_tokens=RANDOM_NEW, stop_ids=stop_token_ids(model, tokenizer),
                          static=static)
        assert result.new_tokens == greedy[:RANDOM_NEW]


# Budget 64 is held to greedy decoding by the rigged drafter below (both caches); here it would add 40 s of rejections.
# Budget 1 (18 s) is there too, in both caches, so it runs with the slow tests only.
# Budget 16 over the prompts that repeat themselves: the context lookup test below compares its lookup with these runs.
# The chain's runs are its own: RANDOM_NEW tokens after one prompt, 23 rounds each rejected at the root, hold it as
# the 80 rounds of both prompts' 40 did (30 s of them on a 2-core AVX2 EPYC).
# The chain's rounds rejected at the root in the dynamic cache (7 s) run with the slow tests only: budget 16's rounds
# here are rejected at the root in the same cache and its crop, and the rigged chain below holds the chain's walk.
@pytest.mark.parametrize("method,budget", [pytest.param("dflash", 0, marks=pytest.mark.slow),
                                           pytest.param("ddtree", 1, marks=pytest.mark.slow), ("ddtree", 16)])
def test_random_drafter_is_lossless(references, random_runs, method, budget):
    indices, new = ((0,), RANDOM_NEW) if method == "dflash" else ((0, 2), MAX_NEW)
    for index in indices:
        assert random_runs(index, method, budget, new=new).new_tokens == references[index][1][:new]


# The chain at fixed shapes (11 s) runs with the slow tests only: ddtree's variant holds the fixed-shape drafter on
# SmolLM2, and test_static_drafter.py's tiny reuse test decodes the chain at fixed shapes, re-drafting, to greedy.
@pytest.mark.parametrize("method,budget", [pytest.param("dflash", 0, marks=pytest.mark.slow), ("ddtree", 8)])
def test_drafter_at_fixed_shapes_is_lossless(smollm2, references, random_drafter, method, budget):
    """With the static cache the drafter runs at fixed shapes too (ddtree/static_drafter.py), re-drafting included."""
    model, tokenizer = smollm2
    prompt, greedy = references[0]  # one prompt: on the CPU a fixed-shape round attends over every slot (slow)
    # Every round is rejected at the root and re-drafts behind 2 tokens over the same padded slots: 12 rounds hold the
    # fixed-shape draft, re-draft and verify as RANDOM_NEW's 24 did (6 s more on a 2-core AVX2 EPYC)
    new = 12
    result = generate(model, prompt, method, random_drafter, budget, new, stop_token_ids(model, tokenizer),
                      static=True, redraft=2)
    assert random_drafter.static is not None
    assert result.new_tokens == greedy[:new]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
# Budget 8 (11 s in both caches) runs with the slow tests only: budget 64 takes non-first branches and compacts
# both caches as it does, and budget 1 holds the narrow tree.
@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 1),
                                           pytest.param("ddtree", 8, marks=pytest.mark.slow), ("ddtree", 64)])
def test_rigged_drafter_is_lossless_and_exercises_the_walk(smollm2, references, method, budget, static):
    """The static cache (padded verifies, in-place compaction) is held to the same walk as the dynamic one."""
    model, tokenizer = smollm2
    long_paths = non_first = 0
    # Each prompt alone holds long paths and (budget >= 8) non-first branches, so one prompt holds each tree's walk to
    # greedy decoding: budget 64's first prompt takes a non-first branch in 5 of its 7 rounds and compacts both caches
    # over them (the second prompt cost 8 s more in both caches on a 2-core AVX2 EPYC); budget 1 (two tokens a round,
    # 24 rounds a prompt) and the chain (16 rows a verify, never a branch) one prompt each as well.
    for prompt, greedy in references[:1]:
        rigged = RiggedDrafter(prompt + greedy, model.config.vocab_size)
        result = generate(model, prompt, method, rigged, budget, MAX_NEW, stop_token_ids(model, tokenizer), static=static)
        assert result.new_tokens == greedy
        drafted_rounds = [r for r in result.rounds if r.tree_size > 0]
        assert len(drafted_rounds) == len(rigged.calls)
        for (start, _), round_ in zip(rigged.calls, drafted_rounds):
            long_paths += round_.accepted_depth >= 4
            non_first += rigged.non_first_branch_accepted(start, round_.accepted_depth)
    if budget >= 8 or method == "dflash":
        assert long_paths > 0, "no round accepted a long path: the walk was not exercised"
    if budget >= 8:
        # budget 1 and the single chain hold only first choices; wider trees must take the decoy's sibling
        assert non_first > 0, "no accepted path went through a non-first branch"
    else:
        assert non_first == 0


# The chain (14 s) runs with the slow tests only: ddtree holds re-drafted paths to greedy decoding here, and the
# chain behind its re-drafted first token is held by test_tree.py and test_decoding_details.py on tiny drafts.
@pytest.mark.parametrize("method,budget,redraft", [pytest.param("dflash", 0, 1, marks=pytest.mark.slow),
                                                   ("ddtree", 8, 3)])
def test_redrafted_branches_are_lossless_and_carry_the_paths_the_block_misses(smollm2, references, method, budget,
                                                                              redraft):
    """The rigged block misses every token past depth 1; re-drafted behind the true depth-1 token it drafts the
    rest. Long paths are accepted only through the re-drafted branches, in the tree also below a depth-1 token that
    was not the block's first choice, and the output stays greedy decoding's."""
    model, tokenizer = smollm2
    deepest = {}
    non_first = 0
    # 12 tokens of one prompt show the block alone stop at depth 1 (its rounds commit 1 or 2 tokens: 7 rounds, where
    # 40 tokens' 23 cost 5 s more on a 2-core AVX2 EPYC, and re-drafting takes a path of 6 in the 2nd round); two
    # prompts of MAX_NEW hold the re-drafted paths to greedy decoding
    for k, prompts, new in ((0, references[:1], 12), (redraft, references[:2], MAX_NEW)):
        deepest[k] = 0
        for prompt, greedy in prompts:
            rigged = RedraftRigged(prompt + greedy, model.config.vocab_size)
            result = generate(model, prompt, method, rigged, budget, new, stop_token_ids(model, tokenizer),
                              redraft=k)
            assert result.new_tokens == greedy[:new]
            assert all(len(firsts) == (min(k, 1) if method == "dflash" else k) for _, firsts in rigged.redrafts)
            drafted = [r for r in result.rounds if r.tree_size > 0]
            deepest[k] = max([deepest[k]] + [r.accepted_depth for r in drafted])
            non_first += k > 0 and sum(rigged.non_first_branch_accepted(start, r.accepted_depth) and r.accepted_depth > 1
                                       for (start, _), r in zip(rigged.calls, drafted))
    assert deepest[0] == 1 and deepest[redraft] >= 4, deepest  # the block alone never gets past depth 1
    assert method == "dflash" or non_first > 0, "no accepted path went deeper below a non-first depth-1 token"


def test_redraft_follows_the_drafters_default_unless_sized_for_speed(smollm2, references):
    model, tokenizer = smollm2
    prompt, greedy = references[0]
    for sizer, calls in ((None, True), (TreeSizer(fixed_ms=40.0, row_ms=1.1), False)):
        rigged = RedraftRigged(prompt + greedy, model.config.vocab_size)
        rigged.default_redraft = 3  # as a DrafterRunner over a drafter trained with model.redraft_prob
        result = generate(model, prompt, "ddtree", rigged, 16, 12, stop_token_ids(model, tokenizer), sizer=sizer)
        assert result.new_tokens == greedy[:12]
        assert bool(rigged.redrafts) == calls and all(len(firsts) == 3 for _, firsts in rigged.redrafts)


def test_redraft_runs_every_block_as_if_drafted_alone(smollm2, references, random_drafter):
    """One forward of several re-drafted blocks over the cached context equals each block's own uncached forward."""
    model, _ = smollm2
    prompt, _ = references[0]
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    context, root, start, depth = random_drafter.features(hidden), 11, len(prompt), random_drafter.block_size - 1
    random_drafter.reset()
    random_drafter.propose(root, start, context, depth)
    firsts = [5, 900, 31]
    rows = random_drafter.redraft(root, start, firsts, depth)
    drafter = random_drafter.drafter
    for first, got in zip(firsts, rows):
        block = torch.tensor([[root, first] + [drafter.mask_token_id] * (drafter.block_size - 2)])
        with torch.no_grad():
            alone = drafter(random_drafter.embedding(block), context, torch.arange(start + drafter.block_size)[None])
        want = drafter.compute_logits(alone[0, 2:1 + depth], random_drafter.lm_head)
        assert torch.allclose(got, want, atol=1e-4)
    with pytest.raises(RuntimeError, match="without propose"):
        random_drafter.redraft(root, start + 3, firsts, depth)
    with pytest.raises(DDTreeError, match="redraft"):
        generate(model, prompt, "ar", None, 8, 4, redraft=2)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
def test_redraft_behind_more_tokens_than_the_budget_holds_re_drafts_behind_the_budgets_worth(tiny_target, static):
    """A tree of n nodes holds at most n depth-1 tokens: `--redraft 100000` tried to lay out 100000 blocks (a 600 GB
    mask) and stopped with a traceback."""
    model, tokenizer = tiny_target
    drafter = DrafterRunner(load_drafter("random", model, tokenizer, "tiny-random"), model)
    counts, redraft = [], drafter.redraft
    drafter.redraft = lambda root, start, firsts, depth: counts.append(len(firsts)) or redraft(root, start, firsts, depth)
    prompt = [5, 17, 42, 8, 99]
    result = generate(model, prompt, "ddtree", drafter, 4, 6, static=static, redraft=100000)
    assert result.new_tokens == hf_greedy(model, prompt, 6) and counts and set(counts) == {4}


# The chain (10 s) runs with the slow tests only: ddtree is held here, and the chain's online calibration by
# test_replay.py (decoding learns what the replay learns) and test_decoding_details.py (its warmed expectation).
@pytest.mark.parametrize("method,budget", [pytest.param("dflash", 0, marks=pytest.mark.slow), ("ddtree", 8)])
def test_online_calibration_learns_a_temperature_and_stays_lossless(smollm2, references, method, budget):
    """The rigged drafter is sure of a wrong token every 7th position: online calibration warms it, and
    the warmer trees of the later prompt still commit exactly the greedy tokens. (Two prompts: the first warms,
    the second decodes warmer and warms further, as the third did; 3 s a prompt on a 2-core AVX2 EPYC.)"""
    model, tokenizer = smollm2
    online = OnlineCalibration()
    shape = OnlineCalibration.shape(method, budget)
    temperatures = []
    for prompt, greedy in references[:2]:  # the 2nd prompt is decoded warmer
        rigged = RiggedDrafter(prompt + greedy, model.config.vocab_size)
        result = generate(model, prompt, method, rigged, budget, MAX_NEW, stop_token_ids(model, tokenizer), online=online)
        assert result.new_tokens == greedy
        temperatures.append(online.temperature(shape))
    assert temperatures[0] > 1.0 and temperatures[-1] > temperatures[0]  # over-confident, so warmed
    assert list(online.log_temperatures) == [shape]


# The dynamic cache's lookup is held to greedy decoding beside online calibration below too, so budget 32 there
# (37 s) runs with the slow tests only.
@pytest.mark.parametrize("budget,static", [pytest.param(32, False, marks=pytest.mark.slow), (16, True)],
                         ids=["32-dynamic-cache", "16-static-cache"])
def test_context_lookup_is_lossless_and_accepts_what_the_drafter_misses(references, random_runs, budget, static):
    """An untrained drafter accepts almost nothing; the grafted lookup paths must be accepted where the reply repeats
    itself, and the output stays greedy decoding's. (Budget 16: the drafter's runs are test_random_drafter_is_lossless's
    and the lookup's online calibration's uncalibrated ones.)"""
    drafted = grafted = 0
    for index in (0, 2):  # the replies that repeat themselves (the second one does not)
        plain = random_runs(index, "ddtree", budget)
        result = random_runs(index, "ddtree", budget, static=static, lookup=7)
        assert result.new_tokens == references[index][1]
        assert all(r.tree_size <= budget for r in result.rounds)
        drafted += sum(r.accepted_depth for r in plain.rounds)
        grafted += sum(r.accepted_depth for r in result.rounds)
    assert grafted > drafted + 5, f"lookup accepted {grafted} nodes against the drafter's {drafted}"


# The dynamic cache (7 s) runs with the slow tests only: the static one verifies the same copy past the block, and
# takes its rows into the fixed-shape drafter too.
@pytest.mark.parametrize("static", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["dynamic-cache", "static-cache"])
def test_a_lookup_longer_than_the_block_is_verified_whole_and_stays_lossless(smollm2, random_drafter, static):
    """The target verifies any depth: a copy from the context may run past the drafter's block, and a round then
    commits more than a block (the static drafter takes those rows in one forward at their own shape)."""
    model, tokenizer = smollm2
    deep = random_drafter.block_size + 4
    # Text that repeats itself whole, which the target goes on repeating and the lookup copies
    prompt = tokenizer(" ".join(["one two three four five six seven eight nine ten eleven twelve"] * 3),
                       add_special_tokens=False)["input_ids"]
    # 32 tokens hold a round that commits past the block (at 24 the room left cuts the copy to 12); 40 cost 1 s more
    # on a 2-core AVX2 EPYC (8 more greedy forwards of the reference)
    new = 32
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()
    result = generate(model, prompt, "ddtree", random_drafter, 32, new, stop_token_ids(model, tokenizer),
                      static=static, lookup=deep)
    assert result.new_tokens == greedy
    assert all(r.tree_size <= 32 for r in result.rounds)
    deepest = max(r.accepted_depth for r in result.rounds)
    assert deepest >= random_drafter.block_size, f"no round accepted past the block ({deepest})"


def test_lookup_refuses_the_chain(smollm2, references, random_drafter):
    model, _ = smollm2
    prompt, _ = references[0]
    with pytest.raises(DDTreeError, match="grafts into ddtree trees"):
        generate(model, prompt, "dflash", random_drafter, 8, 4, lookup=7)


def test_lookup_follows_the_drafters_default_and_a_given_length_overrides_it(tiny_target, tmp_path):
    """A drafter folder whose config records `lookup` (a recipe's model.lookup) grafts that much by default, exactly as
    the same length given; lookup=0 turns it off; the chain never looks up."""
    model, tokenizer = tiny_target
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]  # a tiny random target soon repeats itself, which the lookup drafts

    def decode(runner, method="ddtree", **kwargs):  # 16 tokens: the graft takes 11 nodes of them, as 32 of 40
        result = generate(model, prompt, method, runner, 16, 16, (), **kwargs)
        return result.new_tokens, [(r.tree_size, r.accepted_depth) for r in result.rounds]

    drafter = load_drafter("random", model, tokenizer, "tiny-random")
    plain_runner = DrafterRunner(drafter, model)
    plain, given = decode(plain_runner), decode(plain_runner, lookup=7)
    assert plain[0] == given[0] and sum(d for _, d in given[1]) > sum(d for _, d in plain[1])  # the graft was used
    drafter.config.lookup = 7
    drafter.save_pretrained(tmp_path / "drafter")
    runner = DrafterRunner(load_drafter(str(tmp_path / "drafter"), model, tokenizer, "tiny-random"), model)
    assert runner.default_lookup == 7
    assert decode(runner) == given and decode(runner, lookup=0) == plain
    assert decode(runner, "dflash") == decode(plain_runner, "dflash")


def test_online_calibration_runs_beside_the_lookup_and_stays_lossless(smollm2, references, random_drafter,
                                                                      random_runs):
    """The random drafter is over-confident and the grafted paths are accepted where the reply repeats itself:
    calibrated online (a temperature for the drafter's nodes, a learned acceptance for the graft's), the expected
    tau comes much closer to the measured one, and the tokens stay greedy decoding's."""
    model, tokenizer = smollm2
    gaps = {}
    for online in (None, OnlineCalibration()):
        expected = measured = rounds = 0
        for index in (0, 2):  # the replies that repeat themselves, where the lookup's paths land
            prompt, greedy = references[index]
            if online is None:  # uncalibrated: the context lookup test's run (the static cache's rounds are the same)
                result = random_runs(index, "ddtree", 16, static=True, lookup=7)
            else:
                result = generate(model, prompt, "ddtree", random_drafter, 16, MAX_NEW,
                                  stop_token_ids(model, tokenizer), online=online, lookup=7)
            assert result.new_tokens == greedy
            expected += sum(r.expected for r in result.rounds)
            measured += sum(r.committed for r in result.rounds)
            rounds += len(result.rounds)
        gaps[online is not None] = abs(measured - expected) / rounds
    assert gaps[True] < gaps[False] / 2, gaps  # measured here: 1.15 against 2.47
    learned = {key: count for key, count in online.graft_accepted.items() if key[0] == "context"}
    assert learned and sum(learned.values()) > 0  # the context lookup's acceptance was learned


def test_stop_and_length_limits(smollm2, references):
    model, tokenizer = smollm2
    prompt, greedy = references[1]
    rigged = RiggedDrafter(prompt + greedy, model.config.vocab_size)
    short = generate(model, prompt, "ddtree", rigged, 16, 7, stop_token_ids(model, tokenizer))
    assert short.new_tokens == greedy[:7]
    stop_at = greedy[5]  # pretend the 6th greedy token is a stop token
    stopped = generate(model, prompt, "ddtree", RiggedDrafter(prompt + greedy, model.config.vocab_size), 16, MAX_NEW, [stop_at])
    assert stopped.stopped and stopped.new_tokens == greedy[: greedy.index(stop_at) + 1]


@pytest.mark.parametrize("method, budget", [("dflash", 1), ("ddtree", 16)])
def test_acceptance_is_counted_down_to_the_stop_token_only(smollm2, references, method, budget):
    """The rigged drafter drafts the greedy reply past a stop token, and the target accepts those nodes too: they were
    counted as accepted (accepted_depth, so bench's accepted_depth_counts) and fed to online calibration, though the
    reply ends at the stop token. What is committed is the same either way."""
    model, _ = smollm2
    prompt, greedy = references[1]

    class Observed(OnlineCalibration):
        def observe_round(self, shape, tree, expected, grafted, quoted, accepted):
            self.paths.append(list(accepted))
            self.expected.append((expected, tree.expected_acceptance))
            super().observe_round(shape, tree, expected, grafted, quoted, accepted)

    cut_in_a_path = bonus = 0
    # Ends 6..11 hold both cases for both methods (8: the bonus; the others: in a path, in the 1st to 3rd round); each
    # end is a generation, and the 26 ends of 4..29 cost 30 s on a 2-core AVX2 EPYC.
    for end in range(6, 12):  # the reply's token `end - 1` taken as the stop token
        stop = greedy[end - 1]
        if stop in greedy[:end - 1]:
            continue  # the reply would have ended earlier
        online = Observed()
        online.paths, online.expected = [], []
        result = generate(model, prompt, method, RiggedDrafter(prompt + greedy, model.config.vocab_size), budget,
                          MAX_NEW, [stop], online=online)
        assert result.stopped and result.new_tokens == greedy[:end]  # committed as before
        last = result.rounds[-1]
        assert online.paths[-1] == greedy[end - last.committed:end][:last.accepted_depth]  # the same nodes
        if last.accepted_depth == last.committed:  # the stop token was a draft node: the round ends with it, no bonus
            assert online.paths[-1][-1] == stop
            # nor expected: the nodes below the stop token leave the drafter's estimate (it counted them too)
            expected, whole = online.expected[-1]
            assert result.rounds[-1].expected == expected < whole, online.expected[-1]
            cut_in_a_path += 1
        else:  # the stop token was the bonus
            assert last.accepted_depth == last.committed - 1
            bonus += 1
    assert cut_in_a_path, "no stop token fell inside an accepted path: the cut was never exercised"
    assert bonus, "no stop token was a round's bonus: that case was never exercised"


@pytest.mark.parametrize("runner_kind", ["dynamic", "static"])
@pytest.mark.parametrize("rows", [[0], [0, 1, 2], [0, 2, 5], [0, 1, 3], [0, 3, 7], [0, 1, 2, 3, 4, 5, 7]])
def test_cache_compaction_keeps_exactly_the_prefix_and_the_rows(tiny_target, rows, runner_kind):
    """Rows already in place (ar, the chain) are kept as they lie, the others are copied: both give the same cache.
    Row 7 is the static runner's last verify slot, onto which its padded copy pairs write (StaticTarget.keep), and the
    cache's last slot too (capacity 4 + 8): a scratch slot one past it was an IndexError only there. Seven rows leave
    one padding pair, whose scratch slot must not be the last kept row's target (row 7 to slot 4 + 6)."""
    import numpy as np

    from ddtree.target_runner import DynamicTarget, StaticTarget

    model, _ = tiny_target
    if runner_kind == "dynamic":
        runner = DynamicTarget(model, hidden_states=False)
    else:
        runner = StaticTarget(model, hidden_states=False, max_rows=8, capacity=12, cuda_graph=False)
    with torch.no_grad():  # a 4-token prefix, then 8 tree rows (a chain) verified after it
        runner.prefill(list(range(10, 14)))
        runner.verify(list(range(14, 22)), torch.arange(4, 12), np.tril(np.ones((8, 8), dtype=bool)), 4)
    # keys and values alike: stale values under the kept keys change the next verify's logits as surely
    expected = [[(buffer[..., :4, :].clone(), buffer[..., [4 + r for r in rows], :].clone())
                 for buffer in (layer.keys, layer.values)] for layer in runner.cache.layers]
    runner.keep(4, rows)
    for layer, pairs in zip(runner.cache.layers, expected):
        for buffer, (prefix, kept) in zip((layer.keys, layer.values), pairs):
            assert torch.equal(buffer[..., : 4 + len(rows), :], torch.cat([prefix, kept], dim=-2))
    if runner_kind == "dynamic":
        assert runner.cache.get_seq_length() == 4 + len(rows)



def test_a_static_round_keeping_all_rows_but_one_keeps_its_last_row_and_stays_lossless(tiny_target):
    """Budget 4 over a 3-deep block: the rigged drafter is sure at depths 1 and 2 and puts a decoy before the true
    token at depth 3 (position 15, p % 5 == 0), so the tree is the chain, the decoy, then the true token in the last
    verify row, and the round keeps rows [0, 1, 2, 4] of 5: one padding pair, whose scratch slot is the one past the
    kept rows (StaticTarget.keep). On the kept row's slot, its copy was overwritten by the decoy's keys."""
    target, _ = tiny_target
    prompt = [5, 17, 42, 8, 99, 3, 61, 7, 250, 12, 31, 4]  # the root at position 12: depths 1..3 at 13..15
    greedy = hf_greedy(target, prompt, 12)
    rigged = RiggedDrafter(prompt + greedy, target.config.vocab_size, block_size=4)
    result = generate(target, prompt, "ddtree", rigged, 4, 12, [], static="on")
    assert result.new_tokens == greedy
    assert result.rounds[0].accepted_depth == 3 and result.rounds[0].tree_size == 4
    # what the static cache holds before the last round's verify: every committed token but the last round's
    last = result.rounds[-1]
    kept = len(prompt) + len(greedy) - last.committed - 1
    runner = static_target(target, True, 4 + 1, needed=len(prompt) + 12 + 4 + 1)  # generate's, from the pool
    with torch.no_grad():
        plain = target(torch.tensor([(prompt + greedy)[:kept]]), use_cache=True).past_key_values
    for layer, reference in zip(runner.cache.layers, plain.layers, strict=True):
        torch.testing.assert_close(layer.keys[..., :kept, :], reference.keys)
        torch.testing.assert_close(layer.values[..., :kept, :], reference.values)


def test_a_static_verify_whose_padding_runs_past_the_cache_is_refused(tiny_target):
    """Every static verify writes max_rows rows, its padding too: 3 rows at slot 6 of a 12-slot cache fit as rows but
    not as a verify of 8, which is refused before its forward writes past the buffers."""
    import numpy as np

    model, _ = tiny_target
    runner = StaticTarget(model, hidden_states=False, max_rows=8, capacity=12, cuda_graph=False)
    with torch.no_grad():
        runner.prefill(list(range(10, 14)))
        with pytest.raises(ValueError, match="^3 rows at slot 6 do not fit 8 rows / 12 slots$"):
            runner.verify([14, 15, 16], torch.arange(6, 9), np.tril(np.ones((3, 3), dtype=bool)), 6)


def test_a_static_verify_of_more_rows_than_its_shape_is_refused_by_name(tiny_target):
    """A StaticTarget verifies at most max_rows rows: 9 rows at slot 4 of an 8-row, 12-slot runner fit the slots
    (4 + 8 = 12) but not the shape, refused in one line that names both, not numpy's broadcast error."""
    import numpy as np

    model, _ = tiny_target
    runner = StaticTarget(model, hidden_states=False, max_rows=8, capacity=12, cuda_graph=False)
    with torch.no_grad():
        runner.prefill(list(range(10, 14)))
        with pytest.raises(ValueError, match="^9 rows at slot 4 do not fit 8 rows / 12 slots$"):
            runner.verify(list(range(14, 23)), torch.arange(4, 13), np.tril(np.ones((9, 9), dtype=bool)), 4)


def test_a_static_verify_gives_the_hidden_states_of_its_real_rows_only(tiny_target):
    """As DynamicTarget.verify: every layer's hidden states of the 4 rows verified, as the growing cache gives them, not
    of the 6 rows the static runner's padded forward ran."""
    import numpy as np

    from ddtree.target_runner import DynamicTarget

    model, _ = tiny_target
    hidden = {}
    for runner in (StaticTarget(model, hidden_states=True, max_rows=6, capacity=32, cuda_graph=False),
                   DynamicTarget(model, hidden_states=True)):
        with torch.no_grad():
            runner.prefill([5, 17, 42, 8])
            _, hidden[type(runner).__name__] = runner.verify([99, 3, 61, 250], torch.arange(4, 8),
                                                             np.tril(np.ones((4, 4), dtype=bool)), 4)
    for static, dynamic in zip(hidden["StaticTarget"], hidden["DynamicTarget"], strict=True):
        assert static.shape[:2] == (1, 4)
        torch.testing.assert_close(static, dynamic)


def test_a_static_target_on_a_cpu_captures_no_graph_and_warns_nothing(tiny_target):
    """cuda_graph None means a CUDA graph on a GPU only: on a CPU a StaticTarget runs its forwards uncaptured from the
    start, rather than trying a capture at its first prefill and warning that it failed, in every static generation."""
    import warnings

    model, _ = tiny_target
    runner = StaticTarget(model, hidden_states=False, max_rows=4, capacity=32)
    assert runner.cuda_graph is False
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        runner.prefill([5, 17, 42, 8])
    assert runner.graph is None


def test_a_static_prefill_whose_prompt_and_verify_overrun_the_cache_names_both(tiny_target):
    """A prompt refused for the cache names its own length and the verify's rows apart: the user shortens the one
    or sizes the budget down by the other."""
    model, _ = tiny_target
    runner = StaticTarget(model, hidden_states=False, max_rows=8, capacity=12, cuda_graph=False)
    with torch.no_grad(), pytest.raises(
        ValueError, match="^a 5-token prompt and 8 verify rows exceed the cache's 12 slots$"
    ):
        runner.prefill(list(range(10, 15)))


@pytest.mark.parametrize("runner_kind", ["dynamic", "static"])
def test_a_prefill_gives_the_plain_forwards_logits_and_hidden_states_even_after_a_longer_prompt(tiny_target,
                                                                                               runner_kind):
    """A prefill is the target's plain causal forward over the prompt: no prompt row sees a later one, and a static
    runner reused by a shorter prompt sees none of the longer one's keys left in its slots."""
    from ddtree.target_runner import DynamicTarget, StaticTarget

    model, _ = tiny_target
    static = StaticTarget(model, hidden_states=True, max_rows=4, capacity=32, cuda_graph=False)
    with torch.no_grad():
        for prompt in ([5, 17, 42, 8, 99, 3, 61, 7, 250, 12], [31, 4, 1000, 9]):
            runner = static if runner_kind == "static" else DynamicTarget(model, hidden_states=True)
            logits, hidden = runner.prefill(prompt)
            plain = model(torch.tensor([prompt]), output_hidden_states=True)
            torch.testing.assert_close(logits, plain.logits[0, -1])
            for got, want in zip(hidden, plain.hidden_states, strict=True):
                torch.testing.assert_close(got, want)


@pytest.mark.parametrize("runner_kind", ["dynamic", "static"])
def test_a_tree_verify_gives_each_node_the_plain_forwards_logits_over_its_path(tiny_target, runner_kind):
    """Each node of a verified tree scores as the plain forward over the prompt and its own path does: at its depth's
    position, seeing its ancestors and no sibling (two nodes share depth 1; the static runner pads to 6 rows)."""
    import numpy as np

    from ddtree.target_runner import DynamicTarget, StaticTarget

    model, _ = tiny_target
    if runner_kind == "dynamic":
        runner = DynamicTarget(model, hidden_states=False)
    else:
        runner = StaticTarget(model, hidden_states=False, max_rows=6, capacity=32, cuda_graph=False)
    prompt, tokens = [5, 17, 42, 8], [99, 3, 61, 250]
    paths = [[0], [0, 1], [0, 2], [0, 1, 3]]  # each row's path from the root: two children, a grandchild of the first
    visible = np.zeros((4, 4), dtype=bool)
    for row, path in enumerate(paths):
        visible[row, path] = True
    with torch.no_grad():
        runner.prefill(prompt)
        logits, _ = runner.verify(tokens, torch.tensor([len(prompt) + len(path) - 1 for path in paths]), visible,
                                  len(prompt))
        for row, path in enumerate(paths):
            plain = model(torch.tensor([prompt + [tokens[node] for node in path]])).logits[0, -1]
            torch.testing.assert_close(logits[row], plain)


@pytest.fixture(scope="module")
def packed_target(smollm2):
    import copy

    model, tokenizer = smollm2
    packed = copy.deepcopy(model)
    assert pack_linears(packed) == 30 * 7 + 1  # every projection of the 30 layers, and the LM head
    return packed, tokenizer


@pytest.fixture(scope="module")
def packed_references(packed_target, references):
    """(prompt, the packed model's greedy decoding) for the first prompt of `references`: the packed matmuls are the
    same kernels over every prompt, and three prompts cost 45 s here and in the tests below on a 2-core AVX2 EPYC."""
    model, tokenizer = packed_target
    return [(prompt, model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                    eos_token_id=stop_token_ids(model, tokenizer))[0, len(prompt):].tolist())
            for prompt, _ in references[:1]]


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")
def test_packed_weights_keep_the_plain_models_greedy_tokens(packed_references, references):
    """--packed-weights (ddtree/packed_linear.py) moves logits by fp32 rounding only: on this prompt the packed
    model's greedy decoding is the plain model's token for token."""
    assert [greedy for _, greedy in packed_references] == [greedy for _, greedy in references[:1]]


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")
# No `ar` here: its loop over packed layers runs the packed model's own forwards, as packed_references' generate does
# (and the loop itself is held to greedy decoding by test_ar_matches_greedy).
@pytest.mark.parametrize("method,budget,static", [("dflash", 0, False), ("ddtree", 8, False), ("ddtree", 64, False),
                                                  ("ddtree", 8, True)])
def test_packed_weights_are_lossless(packed_target, packed_references, method, budget, static):
    """The decoding loops over oneDNN's packed matmuls commit exactly the packed model's greedy tokens."""
    model, tokenizer = packed_target
    for prompt, greedy in packed_references:
        rigged = RiggedDrafter(prompt + greedy, model.config.vocab_size)
        result = generate(model, prompt, method, rigged, budget, MAX_NEW, stop_token_ids(model, tokenizer),
                          static=static)
        assert result.new_tokens == greedy


@pytest.fixture(scope="module")
def cuda_target(smollm2):
    import copy

    model, tokenizer = smollm2
    return copy.deepcopy(model).to("cuda"), tokenizer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache-cuda-graph"])
@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 32)])
def test_decoding_on_cuda_matches_greedy_in_fp32(cuda_target, method, budget, static):
    """The same loops on a GPU, against the target's own greedy decoding there; static=True is the CUDA-graph path."""
    model, tokenizer = cuda_target
    stop_ids = stop_token_ids(model, tokenizer)
    for messages in PROMPTS:
        prompt = _prompt_ids(tokenizer, messages)
        greedy = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=stop_ids)[0, len(prompt):].tolist()
        rigged = RiggedDrafter(prompt + greedy, model.config.vocab_size)
        result = generate(model, prompt, method, rigged, budget, MAX_NEW, stop_ids, static=static)
        assert result.new_tokens == greedy
    if static:  # a failed capture warns and runs uncaptured, which would pass the comparison without any graph
        from ddtree.target_runner import _STATIC_TARGETS

        runners = list(_STATIC_TARGETS[model].values())
        assert runners and all(runner.graph is not None for runner in runners)
        if method == "ddtree":  # the rigged drafter's non-first branches move kept rows: keep is replayed too
            assert any(runner.keep_graph is not None for runner in runners)


def attention_kernels(target, tokenizer, device: str, static: bool) -> set[str]:
    """The attention operators a short bf16 ddtree generation (re-drafting on) runs, by the profiler's names."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    target = copy.deepcopy(target).to(device, torch.bfloat16)
    drafter = DrafterRunner(load_drafter("random", target, tokenizer, "smollm2-135m"), target)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as profiler:
        generate(target, _prompt_ids(tokenizer, PROMPTS[0]), "ddtree", drafter, 8, 6, static=static, redraft=2)
    return {event.key for event in profiler.key_averages() if "attention" in event.key}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache-cuda-graph"])
def test_bf16_decoding_on_cuda_never_runs_cudnn_attention(smollm2, static):
    """cuDNN's attention sets itself up per shape, and decoding meets new key lengths every round
    (ddtree/modeling_dflash.py, sdpa_backends): the target's and the drafter's attention run other kernels."""
    kernels = attention_kernels(*smollm2, "cuda", static)
    assert kernels  # the profiler saw the attention calls
    assert not [name for name in kernels if "cudnn" in name], kernels


def test_adaptive_tree_size_is_lossless_and_cuts_the_unlikely_nodes(smollm2, references, random_drafter):
    """A verify cost like the 2-core CPU's (40 ms + 1.1 ms a row): the rigged drafter's trees keep their likely
    branches and lose some of the improbable tail, rounds differ in size, and the tokens stay greedy decoding's."""
    model, tokenizer = smollm2
    sizer = TreeSizer(fixed_ms=40.0, row_ms=1.1)
    # One reply: its 7 sized rounds take 6 sizes from 17 to 29 nodes (the other two replies' 13 rounds sized alike cost
    # 4 s more on a 2-core AVX2 EPYC), and it repeats itself, which the lookup below needs
    prompt, greedy = references[0]
    rigged = RiggedDrafter(prompt + greedy, model.config.vocab_size)
    result = generate(model, prompt, "ddtree", rigged, 32, MAX_NEW, stop_token_ids(model, tokenizer), sizer=sizer)
    assert result.new_tokens == greedy
    sizes = [r.tree_size for r in result.rounds if r.tree_size]
    # 28 tokens hold the rounds (at tokens 19 and 23) whose grafted copy is taken, the random drafter taking none of
    # its own: 40 were 33 rounds, 8 s on a 2-core AVX2 EPYC
    with_lookup = generate(model, prompt, "ddtree", random_drafter, 32, 28, stop_token_ids(model, tokenizer),
                           sizer=sizer, lookup=7)
    assert with_lookup.new_tokens == greedy[:28]
    assert sum(r.accepted_depth for r in with_lookup.rounds) > 0  # the sized trees kept the graft
    assert min(sizes) < 32 and len(set(sizes)) > 2, sizes  # (the slow rigged drafter's overhead favours large trees)
    assert sizer.rounds > 0 and sizer.overhead_ms > 0  # the rounds' drafting and bookkeeping were counted
    with pytest.raises(DDTreeError, match="static cache"):
        generate(model, references[0][0], "ddtree", random_drafter, 8, 4, static=True, sizer=sizer)
    with pytest.raises(DDTreeError, match="method 'dflash'"):
        generate(model, references[0][0], "dflash", random_drafter, 8, 4, sizer=sizer)


# Slow only (6 s): test_static_drafter.py's tiny reuse test holds the same reuse over stale slots to greedy decoding,
# and its pool tests the capacity and the replacement.
@pytest.mark.slow
def test_static_runners_outlive_their_generation(smollm2, references, random_drafter):
    """A generation reuses the static target and drafter the one before it used (their graphs captured once), over
    slots that one left stale, and stays lossless; a generation that needs more slots gets larger ones."""
    from ddtree.target_runner import padded_capacity, static_target

    model, tokenizer = smollm2
    stop = stop_token_ids(model, tokenizer)
    longer, shorter = sorted(references[:2], key=lambda reference: -len(reference[0]))  # stale slots past the 2nd
    budget = 8
    new = 8  # every round of the second generation runs over the first one's stale slots: 8 tokens show it as 24 do
    results, runners = [], []
    for prompt, _ in (longer, shorter):
        results.append(generate(model, prompt, "ddtree", random_drafter, budget, new, stop, static=True, redraft=2))
        runners.append((static_target(model, True, budget + 1, needed=1), random_drafter.static))
    assert [result.new_tokens for result in results] == [longer[1][:new], shorter[1][:new]]
    assert runners[0][0] is runners[1][0] and runners[0][1] is runners[1][1]
    target_runner = runners[1][0]
    assert target_runner.capacity == padded_capacity(len(longer[0]) + new + budget + 1)
    bigger = static_target(model, True, budget + 1, needed=target_runner.capacity + 1)
    assert bigger is not target_runner and bigger.capacity > target_runner.capacity
    assert static_target(model, True, budget + 1, needed=1) is bigger  # it replaced the smaller one
