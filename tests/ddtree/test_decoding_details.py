"""What the lossless tests cannot see: mistakes that keep every committed token the target's own and only cost
acceptance or speed (the drafter's context, the context lookup, re-drafted rows' temperatures), or that only some
lengths reach (the static cache's capacity), the figures a reply is measured by (tau, tokens per second, a round's
times), and sampling held to an independent reference. Each test here failed on the mutant of decoding.py that a
mutation review (2026-12-05, 2026-12-06) found the rest of the suite letting through."""

import math
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig

import ddtree.decoding
from ddtree.decoder import load_drafter
from ddtree.decoding import DrafterRunner, OnlineCalibration, Sampling, check_budget, generate, top_p_filter
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.target_runner import DynamicTarget
from ddtree.errors import DDTreeError
from ddtree.targets import build_drafter_config
from rigged import RedraftRigged, RiggedDrafter, hf_greedy  # tests/rigged.py


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
def test_the_drafters_context_is_the_target_features_of_the_committed_tokens(tiny_target, static):
    """After rounds that accept non-first branches, the drafter's incrementally cached context must be what it would
    be fed in one go from the committed text: decoding gathers the features of the accepted rows, not of the first
    rows of the verify. (A wrong gather keeps the output lossless and only lowers acceptance, so no lossless test
    sees it.)"""
    target, tokenizer = tiny_target
    drafter = load_drafter("random", target, tokenizer, "tiny-random")
    prompt = [5, 17, 42, 8, 99, 3, 61]
    reference = hf_greedy(target, prompt, 40)

    class Tracking(DrafterRunner):  # its context grows for real; its drafts are rigged, so side branches are accepted
        rigged = RiggedDrafter(prompt + reference, target.config.vocab_size)
        last = None

        def propose(self, root, start, new_context, depth):
            self.last = (root, start, super().propose(root, start, new_context, depth).clone())
            return self.rigged.propose(root, start, new_context, depth)

    runner = Tracking(drafter, target)
    result = generate(target, prompt, "ddtree", runner, 8, 40, [], static=static)
    assert result.new_tokens == reference
    assert sum(runner.rigged.non_first_branch_accepted(s, r.accepted_depth)
               for (s, _), r in zip(runner.rigged.calls, result.rounds)) > 0  # kept rows were not the first rows
    root, start, incremental = runner.last
    with torch.no_grad():
        hidden = target(torch.tensor([(prompt + result.new_tokens)[:start]]), output_hidden_states=True).hidden_states
    fresh = DrafterRunner(drafter, target)
    whole = fresh.propose(root, start, fresh.features(hidden), incremental.shape[0])
    torch.testing.assert_close(incremental, whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 8, 11])
def test_top_k_keeps_exactly_the_k_likeliest_tokens(k):
    """test_sampling's exact distribution is computed with Sampling.probabilities itself, so a wrong cut there is its
    own reference: held here to an independent one."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(k)) * 3
    for temperature in (1.0, 0.7):
        probs = Sampling(temperature, top_k=k).probabilities(logits)
        expected = torch.zeros(12)
        top = logits.topk(k)
        expected[top.indices] = torch.softmax(top.values.double() / temperature, -1).float()
        torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("top_p, expected", [
    (0.5, [0, 1, 0, 0]),  # the best token's mass is top_p exactly: it alone is enough
    (0.75, [0, 2 / 3, 0, 1 / 3]),
    (0.9375, [0, 8 / 15, 3 / 15, 4 / 15]),
])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_it_when_a_sum_equals_it_exactly(top_p, expected):
    """A cut at `> top_p` keeps one token more at each such edge. Dyadic probabilities make the sums exact; their
    order is not the ids', so the cut must follow the sort. (tests/data/test_regenerate.py holds the kept set through
    both users of this rule; here the rule itself, renormalised values and rows of a batch too.)"""
    probs = torch.tensor([0.0625, 0.5, 0.1875, 0.25], dtype=torch.float64)
    cut = top_p_filter(torch.stack([probs, probs.flip(0)]), top_p)  # (2, V): the cut is per row
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(cut, torch.stack([expected, expected.flip(0)]))


def test_top_p_one_cuts_nothing_where_the_likeliest_tokens_mass_rounds_to_one():
    """top_p 1.0 is no cut. Run through the cut at 1.0, a float32 distribution (as data regeneration passes) whose
    likeliest tokens' mass rounds to 1 lost every token after them: the target's unlikely tokens were never sampled."""
    probs = torch.tensor([0.5, 0.5, 1e-9, 1e-9], dtype=torch.float32)  # 0.5 + 0.5 is exactly 1 in float32
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_top_k_keeps_every_token_tied_with_the_kth():
    """--top-k's help and docs/decoding.md: every token tied with the k-th likeliest stays. A cut to exactly k tokens
    (topk's indices) dropped one of two tied at the k-th by its id. By hand at T1, top-k 2 of logits (1, 2, 1, 0):
    tokens 1, 0 and 2 stay, in proportion e^2 : e : e, so 1 / (e + 2), e / (e + 2), 1 / (e + 2) and 0."""
    probs = Sampling(1.0, top_k=2).probabilities(torch.tensor([1.0, 2.0, 1.0, 0.0]))
    e = math.e
    torch.testing.assert_close(probs, torch.tensor([1 / (e + 2), e / (e + 2), 1 / (e + 2), 0.0]))


def test_top_p_cuts_what_top_k_left():
    """docs/decoding.md: the temperature, then --top-k, then --top-p of what top-k kept. Probabilities (0.2, 0.4, 0.1,
    0.3), top-k 2 then top-p 0.5: top-k leaves 0.4 and 0.3, renormalised 4/7 and 3/7; 4/7 alone reaches 0.5, so only
    token 1 stays. Cut in the other order, top-p 0.5 of the whole row keeps 0.4 and 0.3 (0.4 alone is short of it)."""
    logits = torch.tensor([0.2, 0.4, 0.1, 0.3]).log()
    torch.testing.assert_close(Sampling(1.0, top_p=0.5, top_k=2).probabilities(logits), torch.tensor([0.0, 1, 0, 0]))


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0])
def test_any_temperature_above_zero_samples(temperature):
    """Only temperature 0 is greedy: at every T > 0, two tokens tied on top are drawn alike (1/2 each), and a token far
    below them never at T 0.05 (e^-160 of them). An argmax always picks the first of the two."""
    generator = torch.Generator().manual_seed(0)
    sampling = Sampling(temperature)
    logits = torch.tensor([3.0, 3.0, -5.0])
    assert {sampling.choose(logits, generator) for _ in range(40)} == {0, 1}
    choose = sampling.chooser(torch.stack([logits, logits.flip(0)]), generator)  # (2, V): rows as a walk reads them
    assert {choose(1) for _ in range(40)} == {1, 2}


class LooksLikeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, to take chooser's CUDA branch on a machine without one."""

    @property
    def is_cuda(self):
        return True


def test_the_one_kernel_argmax_of_cuda_rows_is_for_greedy_decoding_only():
    """On CUDA, chooser reads every row's argmax in one kernel, for T 0 only: taken at T > 0 too, a verify's rows were
    walked greedily while the prefill's token was sampled. (Here a CPU tensor says it is on CUDA.)"""
    logits = torch.tensor([[3.0, 3.0, -5.0], [-5.0, 3.0, 3.0]]).as_subclass(LooksLikeCuda)
    assert logits.is_cuda
    greedy = Sampling().chooser(logits, None)
    assert [greedy(0), greedy(1)] == [0, 1]
    generator = torch.Generator().manual_seed(0)
    sampled = Sampling(1.0).chooser(logits, generator)
    assert {sampled(1) for _ in range(40)} == {1, 2}


def test_a_static_generation_that_fills_its_padded_capacity_exactly_fits_its_last_verify(tiny_target):
    """prompt + max_new_tokens = 128 slots, one CAPACITY_STEP: the last round's verify (budget + 1 rows) still needs
    room past the committed tokens, which a capacity of prompt + max_new_tokens alone would not give."""
    target, tokenizer = tiny_target
    runner = DrafterRunner(load_drafter("random", target, tokenizer, "tiny-random"), target)
    prompt = [5 + i % 50 for i in range(100)]
    result = generate(target, prompt, "ddtree", runner, 8, 28, [], static=True)
    assert result.new_tokens == hf_greedy(target, prompt, 28)


def test_a_round_that_max_new_tokens_ends_drafts_no_deeper_than_it_can_commit(tiny_target):
    """A path of depth d commits d + 1 tokens (its bonus too): a deeper draft is verified and never committed, which
    costs verify rows and a deeper lookup graft in the rounds that end a reply. Below the block (16) the room alone sets
    each round's depth: a round with room for one token (the bonus) drafts nothing, one with room for two drafts one."""
    target, _ = tiny_target
    prompt = [5, 17, 42, 8, 99, 3, 61]
    reference = hf_greedy(target, prompt, 11)
    for max_new_tokens in range(2, 12):
        rigged = RiggedDrafter(prompt + reference, target.config.vocab_size)
        result = generate(target, prompt, "ddtree", rigged, 16, max_new_tokens, [])
        assert result.new_tokens == reference[:max_new_tokens]
        committed = [sum(r.committed for r in result.rounds[:i]) for i in range(len(result.rounds))]
        rooms = [max_new_tokens - 1 - before for before in committed]  # each round's room (the root is committed)
        drafted = [room - 1 for room in rooms if room > 1]
        assert [depth for _, depth in rigged.calls] == drafted, (max_new_tokens, rigged.calls, rooms)


def test_draft_temperatures_at_the_bounds_the_error_names_are_decoded_and_just_outside_refused(tiny_target):
    """The refusal says each temperature may lie within low..high: a config holding a bound itself decodes with it,
    rather than being refused by a message that names that value as allowed."""
    target, tokenizer = tiny_target
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4)
    drafter = DFlashDraftModel(config).eval()
    low, high = ddtree.decoding.DRAFT_TEMPERATURE_RANGE
    drafter.config.draft_temperatures = [low, high, 1.0]
    runner = DrafterRunner(drafter, target)
    assert runner.temperatures[:, 0].tolist() == pytest.approx([low, high, 1.0])
    for outside in ([low / 2, 1.0, 1.0], [1.0, high * 2, 1.0]):
        drafter.config.draft_temperatures = outside
        with pytest.raises(DDTreeError, match=f"within {low:g}..{high:g}"):
            DrafterRunner(drafter, target)


def test_redrafted_rows_are_divided_by_the_temperatures_of_their_own_depths(tiny_target):
    target, tokenizer = tiny_target
    torch.manual_seed(0)
    drafter = DFlashDraftModel(build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4)).eval()
    prompt = [5, 17, 42, 8, 99]
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    root, start = int(out.logits[0, -1].argmax()), len(prompt)
    rows = {}
    for temperatures in (None, [2.0, 0.5, 1.5]):  # depths 1, 2, 3
        drafter.config.draft_temperatures = temperatures
        runner = DrafterRunner(drafter, target)
        runner.propose(root, start, runner.features(out.hidden_states), 3)
        rows[temperatures is None] = runner.redraft(root, start, [5, 9], 3)  # (2 firsts, depths 2..3, V)
    drafter.config.draft_temperatures = None
    torch.testing.assert_close(rows[False], rows[True] / torch.tensor([0.5, 1.5])[:, None])



def test_a_round_drafting_two_depths_re_drafts_its_second_behind_the_first(tiny_target):
    """Re-drafting needs a depth below depth 1, so a round of depth 2 (the last round before max_new_tokens) has one.
    The rigged block misses every depth past 1: depth 2 is accepted only through the re-drafted branch."""
    model, _ = tiny_target
    prompt = [5, 17, 42, 8, 99]  # the root at position 5: depths 1 and 2 (positions 6, 7) are rigged first choices
    greedy = hf_greedy(model, prompt, 4)
    rigged = RedraftRigged(prompt + greedy, model.config.vocab_size)
    result = generate(model, prompt, "ddtree", rigged, 4, 4, redraft=1)  # after the prefill's token: depth 4 - 2
    assert result.new_tokens == greedy
    assert rigged.redrafts == [(5, [greedy[1]])]
    assert [r.accepted_depth for r in result.rounds] == [2]

@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_a_stop_token_as_the_prefills_token_ends_the_reply_there(tiny_target, method):
    target, tokenizer = tiny_target
    prompt = [5, 17, 42, 8, 99]
    first = hf_greedy(target, prompt, 1)[0]
    drafter = None if method == "ar" else DrafterRunner(load_drafter("random", target, tokenizer, "tiny-random"), target)
    result = generate(target, prompt, method, drafter, 8, 12, [first])
    assert result.new_tokens == [first] and result.stopped and result.rounds == []


def test_the_context_lookup_copies_from_the_prompt_from_the_first_round(smollm2):
    """A reply that goes on quoting its prompt is drafted by the lookup from round 1: the prompt is context too.
    (Looked up in the reply alone, the same reply was lossless with tau 1.92 instead of 5.75.)"""
    from ddtree.targets import stop_token_ids

    model, tokenizer = smollm2
    runner = DrafterRunner(load_drafter("random", model, tokenizer, "smollm2-135m"), model)
    prompt = tokenizer(" ".join(["one two three four five six seven eight nine ten eleven twelve"] * 3),
                       add_special_tokens=False)["input_ids"]
    result = generate(model, prompt, "ddtree", runner, 32, 24, stop_token_ids(model, tokenizer), lookup=7)
    assert result.rounds[0].accepted_depth >= 4, [r.accepted_depth for r in result.rounds]


def test_a_rounds_expected_tau_leaves_out_the_nodes_below_a_stop_token(tiny_target):
    """A drafter sure of the stop token x at every depth drafts the chain x x x x (budget 4, each p ~ 1): the reply
    ends at the first x, so the round expects 1 + p(x) ~ 2, not the 5 that counting the nodes below it gives."""
    target, _ = tiny_target
    prompt = [5, 17, 42, 8, 99]
    vocab = target.config.vocab_size
    stop = (hf_greedy(target, prompt, 1)[0] + 1) % vocab  # not the prefill's token: a round runs

    class SureOfStop(RiggedDrafter):
        def propose(self, root_token, start, new_context, depth):
            logits = torch.zeros(depth, vocab)
            logits[:, stop] = 30.0  # p(x) = 1 - (V - 1) e^-30 at every depth
            return logits

    result = generate(target, prompt, "ddtree", SureOfStop([], vocab), 4, 8, [stop])
    assert result.rounds[0].tree_size == 4
    assert result.rounds[0].expected == pytest.approx(2.0, abs=1e-6)


def test_a_stop_token_accepted_mid_path_ends_the_rounds_accepted_depth_and_what_calibration_observes(tiny_target):
    """The target's greedy reply here turns from 199 to 20163 at its 5th token, taken as the stop token: round 2's
    rigged path runs through it to depth 4 and the target accepts the node below it too, but the reply ends at the stop
    token, so the round accepted 3 nodes (no bonus), and online calibration is told a length of 1 + 3, not 1 + 4.
    (tiny-random repeats one token from the start for most prompts: this one changes early, at a clean position.)"""
    target, _ = tiny_target
    prompt = [22450, 31596, 26371, 18207, 47881, 11658, 28187, 29101, 199]
    greedy = hf_greedy(target, prompt, 12)
    stop = greedy[4]
    assert stop not in greedy[:4] and greedy[5] == stop  # a node below the stop token that the target accepts too

    class Observed(OnlineCalibration):
        def observe(self, shape, expected, accepted_length):
            self.lengths.append(accepted_length)
            super().observe(shape, expected, accepted_length)

    online = Observed()
    online.lengths = []
    rigged = RiggedDrafter(prompt + greedy, target.config.vocab_size)
    result = generate(target, prompt, "ddtree", rigged, 8, 12, [stop], online=online)
    assert result.stopped and result.new_tokens == greedy[:5]
    # round 1 is rejected at depth 1 (position 10: the true token is the 2nd choice behind a decoy's subtree);
    # round 2, rooted at position 10, accepts positions 11, 12 and 13, the stop token
    assert [(r.accepted_depth, r.committed) for r in result.rounds] == [(0, 1), (3, 3)]
    assert online.lengths == [1, 4]


def test_tau_counts_the_tokens_the_rounds_commit_not_the_prefills(tiny_target):
    """tau, which `ddtree generate` and Decoder report, is tokens per verify: the prefill's token is no round's. Counted
    in, ar's tau read above 1 and every drafter's read better than it was."""
    target, _ = tiny_target
    prompt = [5, 17, 42, 8, 99, 3, 61]
    reference = hf_greedy(target, prompt, 12)
    assert generate(target, prompt, "ar", max_new_tokens=12).tau == 1.0  # one token a round
    rigged = generate(target, prompt, "ddtree", RiggedDrafter(prompt + reference, target.config.vocab_size), 16, 12, [])
    assert rigged.new_tokens == reference
    assert rigged.tau == (12 - 1) / len(rigged.rounds) > 1, [r.committed for r in rigged.rounds]


def test_tokens_per_second_counts_the_prefills_time_with_its_token(tiny_target, monkeypatch):
    """The reply's first token is the prefill's, so its rate is over the prefill's time too, as bench's speedup is:
    over the decoding's alone a slow prefill (a long prompt) read as fast as none in `ddtree generate`'s tok/s."""
    target, _ = tiny_target

    class SlowPrefill(DynamicTarget):
        def prefill(self, prompt_ids):
            time.sleep(0.3)
            return super().prefill(prompt_ids)

    monkeypatch.setattr(ddtree.decoding, "DynamicTarget", SlowPrefill)
    result = generate(target, [5, 17, 42, 8], "ar", max_new_tokens=6, static=False)
    assert result.prefill_s >= 0.3 and len(result.new_tokens) == 6
    assert result.tokens_per_second <= 6 / 0.3, (result.prefill_s, result.decode_s)


def test_tokens_per_second_of_a_reply_under_a_second_is_its_rate_not_zero():
    """A short reply on a fast GPU takes well under a second: its tok/s is the tokens over that time, not 0 (which
    read as a decoder that produced nothing)."""
    result = ddtree.decoding.GenerationResult(prompt_ids=[1], new_tokens=[2, 3, 4, 5], prefill_s=0.1, decode_s=0.4)
    assert result.tokens_per_second == pytest.approx(4 / 0.5)


def test_a_rounds_other_time_leaves_out_its_verify(tiny_target, monkeypatch):
    """Round's split, which bench prints as its draft, verify and other columns: the target's forward is verify_s
    alone. Counted in other_s too, a round's three parts added up to more than the decoding took."""
    target, _ = tiny_target

    class SlowVerify(DynamicTarget):
        def verify(self, *args):
            time.sleep(0.2)
            return super().verify(*args)

    monkeypatch.setattr(ddtree.decoding, "DynamicTarget", SlowVerify)
    result = generate(target, [5, 17, 42, 8], "ar", max_new_tokens=4, static=False)
    assert len(result.rounds) == 3
    assert all(r.verify_s >= 0.2 > r.other_s for r in result.rounds), [(r.verify_s, r.other_s) for r in result.rounds]
    assert sum(r.draft_s + r.verify_s + r.other_s for r in result.rounds) <= result.decode_s + 1e-6


def test_online_temperature_divides_the_redrafted_rows_as_it_divides_the_block(tiny_target):
    """A calibration's temperature is the drafter's, at every depth: left off the re-drafted rows, a chain behind its
    re-drafted first token was scored (and sized, and calibrated) with depth 1 cooled and the rest not, so a redraft
    drafter decoding with its folder's calibration.json said another expected tau than its own."""
    target, _ = tiny_target
    generator = torch.Generator().manual_seed(0)
    block, branch = (torch.randn(rows, target.config.vocab_size, generator=generator) * 10 for rows in (3, 2))

    class Fixed:  # the block's rows (depths 1-3), and the same re-drafted rows (depths 2-3) behind any first token
        block_size = 4

        def reset(self):
            pass

        def features(self, hidden):
            return hidden[-1]  # (1, T, H): read by nothing here

        def propose(self, root, start, new_context, depth):
            return block[:depth]

        def redraft(self, root, start, firsts, depth):
            return branch[: depth - 1].expand(len(firsts), -1, -1)

    online = OnlineCalibration(frozen=True)
    online.log_temperatures[None] = math.log(2.0)  # the chain's
    result = generate(target, [5, 17, 42, 8], "dflash", Fixed(), max_new_tokens=8, stop_ids=[], online=online,
                      redraft=1)
    path = torch.log_softmax(torch.cat([block[:1], branch]) / 2.0, dim=-1).max(dim=-1).values.cumsum(0)
    assert result.rounds[0].expected == pytest.approx(1 + path.exp().sum().item(), rel=1e-5)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_a_falcon_target_with_alibi_is_refused_before_decoding(method):
    """Falcon says ALiBi in its config (alibi=True), not in its model_type as MPT and Bloom do: unread, a Falcon-RW
    style target got past the refusal into a ValueError inside transformers' Falcon, its cache unreadable."""
    from transformers import FalconConfig, FalconForCausalLM

    target = FalconForCausalLM(FalconConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            alibi=True)).eval()
    drafter = RiggedDrafter(list(range(3, 40)), 40, block_size=8)
    with pytest.raises(DDTreeError, match=r"^target 'falcon' \(falcon\) uses ALiBi position biases"):
        generate(target, [1, 2, 3], method, drafter if method != "ar" else None, 8, 10)


def test_every_id_of_a_stop_list_nested_in_stop_ids_ends_the_reply(tiny_target):
    """A generation_config's eos_token_id can be a list itself ([eos, end_of_turn]), passed inside stop_ids' own list:
    read as its first id alone, a reply ran on past its end-of-turn token."""
    target, _ = tiny_target
    prompt = [5, 17, 42, 8, 99]
    reference = hf_greedy(target, prompt, 12)
    stop = reference[3]
    other = next(token for token in range(target.config.vocab_size) if token not in reference)
    result = generate(target, prompt, "ar", max_new_tokens=12, stop_ids=[[other, stop]])
    assert result.new_tokens == reference[: reference.index(stop) + 1] and result.stopped


@pytest.mark.parametrize("setting", ["lookup", "redraft"])
def test_a_negative_lookup_or_redraft_is_one_line_before_the_prefill(tiny_target, monkeypatch, setting):
    """redraft -1 passed as a count and was a RuntimeError in the first round's topk, after the prefill."""
    target, tokenizer = tiny_target
    runner = DrafterRunner(load_drafter("random", target, tokenizer, "tiny-random"), target)
    monkeypatch.setattr(DynamicTarget, "prefill", lambda *args: pytest.fail("prefilled before the check"))
    with pytest.raises(DDTreeError, match=f"^{setting} -1 must be >= 0"):
        generate(target, [5, 17, 42, 8], "ddtree", runner, 8, 6, [], **{setting: -1})


def test_a_runner_reused_for_another_prompt_drafts_as_a_new_one(tiny_target):
    """Each generation resets the runner to an empty context: a drafter cache kept from the last prompt stayed lossless
    (every token is the target's) but drafted the next prompt beside the last one's keys, for lower acceptance."""
    target, tokenizer = tiny_target
    drafter = load_drafter("random", target, tokenizer, "tiny-random")

    class Recording(DrafterRunner):
        def propose(self, root, start, new_context, depth):
            self.drafts.append(super().propose(root, start, new_context, depth))
            return self.drafts[-1]

    reused, fresh = Recording(drafter, target), Recording(drafter, target)
    reused.drafts = []
    generate(target, [9, 33, 7, 61, 20, 4], "ddtree", reused, 8, 10, [])
    prompt = [5, 17, 42, 8]
    reused.drafts, fresh.drafts = [], []
    generate(target, prompt, "ddtree", reused, 8, 10, [])
    generate(target, prompt, "ddtree", fresh, 8, 10, [])
    assert len(reused.drafts) == len(fresh.drafts) > 1
    for again, new in zip(reused.drafts, fresh.drafts):
        torch.testing.assert_close(again, new, atol=1e-4, rtol=0)


def test_the_drafters_features_are_its_target_layers_outputs_in_its_order(tiny_target):
    """The drafter was trained on the outputs of its target_layer_ids, concatenated in that order (layer l is
    hidden_states[l + 1], training/target.py): read in another order, decoding stayed lossless at a lower acceptance."""
    target, tokenizer = tiny_target
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4, target_layer_ids=[0, 3])
    runner = DrafterRunner(DFlashDraftModel(config).eval(), target)
    with torch.no_grad():
        hidden = target(torch.tensor([[5, 17, 42, 8]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(runner.features(hidden), torch.cat([hidden[1], hidden[4]], dim=-1), atol=0, rtol=0)


def test_the_context_limit_is_the_targets_positions_exactly_and_none_where_it_names_none():
    """A prompt one short of max_position_embeddings fits and decodes the one token its context leaves room for, and a
    tree one node short of it can be verified; a config naming no max_position_embeddings limits nothing. (An
    off-by-one in context_limit refused a prompt that fits; a finite default refused what a model naming none can do.)"""
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=16,
    )).eval()
    prompt = list(range(1, 16))  # positions 0..14 of the 16
    assert len(generate(target, prompt, "ar", None, max_new_tokens=8, stop_ids=[]).new_tokens) == 1
    with pytest.raises(DDTreeError, match="prompt of 16 tokens does not fit the target's context of 16 tokens"):
        generate(target, prompt + [1], "ar", None, max_new_tokens=8, stop_ids=[])
    check_budget(15, target)
    with pytest.raises(DDTreeError, match="budget 16: "):
        check_budget(16, target)
    check_budget(1 << 20, SimpleNamespace(config=PretrainedConfig()))
