"""Replayed decoding (training/replay.py) runs exactly the rounds real decoding runs on the target's own reply.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/training/test_replay.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ddtree.calibration import OnlineCalibration
from ddtree.corpus import CorpusLookup
from ddtree.decoding import DrafterRunner, generate
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import build_drafter_config, load_target
import training.replay
from training.replay import RoundNLL, learn_calibration, replay_reply, reply_span
from training.target import target_layer_features
from rigged import RedraftRigged, RiggedDrafter  # tests/rigged.py


class Recording:
    """Wraps a drafter runner and records every proposal: (start, depth, logits)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.block_size = inner.block_size

    def reset(self):
        self.inner.reset()

    def features(self, hidden_states):
        return self.inner.features(hidden_states)

    def propose(self, root_token, start, new_context, depth):
        logits = self.inner.propose(root_token, start, new_context, depth)
        self.calls.append((start, depth, logits))
        return logits


@pytest.fixture(scope="module")
def tiny():
    target, tokenizer = load_target("tiny-random", torch.float32)
    return target.eval(), tokenizer


def reply_of(target, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The target's greedy reply to `prompt`, as a training sequence (prompt + reply) and its loss mask."""
    reply = generate(target, prompt, "ar", max_new_tokens=max_new_tokens).new_tokens
    mask = torch.zeros(len(prompt) + len(reply), dtype=torch.bool)
    mask[len(prompt):] = True
    return prompt + reply, mask


@pytest.mark.parametrize("budget", [None, 1, 4, 16])
def test_replay_runs_the_rounds_of_decoding(tiny, budget):
    """Same roots, depths, accepted lengths and expected acceptance as generate() on the same reply."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    max_new = 40
    sequence, mask = reply_of(target, prompt, max_new)
    oracle = RiggedDrafter(sequence, target.config.vocab_size, block_size=6)

    decoded_runner = Recording(oracle)
    decoded = generate(target, prompt, "ddtree" if budget else "dflash", drafter=decoded_runner, budget=budget or 1,
                       max_new_tokens=max_new)
    assert prompt + decoded.new_tokens == sequence  # lossless, so the reply is the target's

    replay_runner = Recording(oracle)
    start, end = reply_span(mask)
    assert (start, end) == (len(prompt), len(sequence))
    features = torch.zeros(len(sequence), 3)  # unused by the oracle
    rounds = replay_reply(replay_runner, features, torch.tensor(sequence), start, end, budget, max_new)

    assert [(s, d) for s, d, _ in replay_runner.calls] == [(s, d) for s, d, _ in decoded_runner.calls]
    assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
    assert [r.expected for r in rounds] == pytest.approx([r.expected for r in decoded.rounds], rel=1e-6)
    accepted = {r.accepted for r in rounds}
    assert 0 in accepted and max(accepted) >= min(budget or 3, 3)  # rejections and long paths both happened


@pytest.mark.parametrize("budget", [None, 4])
def test_a_reply_that_ends_in_a_stop_token_replays_as_decoding_stops(budget):
    """Decoding commits no bonus after an accepted end-of-turn token, ends on one that comes as the bonus, and drafts as
    deep as ever near the reply's end (it cannot know where the reply ends); the replay must do the same, round by
    round, also where the supervised reply goes on past the stop."""
    torch.manual_seed(0)  # large random weights: a reply that does not repeat one token, so each cut has its own stop
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.5)
    target = LlamaForCausalLM(config).eval()
    prompt = [1, 5, 9, 13]
    reply = generate(target, prompt, "ar", max_new_tokens=40).new_tokens
    no_bonus = tried = 0
    for end in range(8, 40, 3):  # the reply cut after its token `end - 1`, taken as the stop token
        stop = reply[end - 1]
        if stop in reply[:end - 1]:
            continue  # the reply would have ended earlier
        sequence = prompt + reply[:end]
        oracle = RiggedDrafter(sequence, target.config.vocab_size, block_size=6)
        decoded_runner, replay_runner = Recording(oracle), Recording(oracle)
        decoded = generate(target, prompt, "ddtree" if budget else "dflash", decoded_runner, budget or 1, 64, [stop])
        assert decoded.new_tokens == reply[:end]
        rounds = replay_reply(replay_runner, torch.zeros(len(sequence), 3), torch.tensor(sequence), len(prompt),
                              len(sequence), budget, 64, stop_ids=[stop])
        assert [(s, d) for s, d, _ in replay_runner.calls] == [(s, d) for s, d, _ in decoded_runner.calls]
        assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
        # nor does the expected acceptance count a node below an accepted stop: online calibration learns from it
        assert [r.expected for r in rounds] == pytest.approx([r.expected for r in decoded.rounds], rel=1e-6)
        # a supervised reply may go on past a stop (<|im_end|> then <|endoftext|>): decoding ends there all the same
        whole = replay_reply(oracle, torch.zeros(len(prompt + reply), 3), torch.tensor(prompt + reply), len(prompt),
                             len(prompt + reply), budget, 64, stop_ids=[stop])
        assert [(r.accepted, r.committed) for r in whole] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
        no_bonus += decoded.rounds[-1].committed <= decoded.rounds[-1].accepted_depth
        tried += 1
    assert no_bonus > 0, "no reply ended inside an accepted path: the stop was never exercised"
    assert no_bonus < tried, "no reply ended on a bonus stop token: that stop was never exercised"
    # the prefill's token a stop: decoding runs no round
    oracle = RiggedDrafter(prompt + reply, target.config.vocab_size, block_size=6)
    assert generate(target, prompt, "ddtree" if budget else "dflash", oracle, budget or 1, 64, [reply[0]]).rounds == []
    assert replay_reply(oracle, torch.zeros(len(prompt + reply), 3), torch.tensor(prompt + reply), len(prompt),
                        len(prompt + reply), budget, 64, stop_ids=[reply[0]]) == []


@pytest.mark.parametrize("budget", [None, 4])
def test_a_round_that_accepts_a_stop_token_is_shown_no_reply_token_below_it(budget):
    """Decoding ends the reply at an accepted end-of-turn token: no depth below it is ranked or accepted, so
    model.calibrate (RoundNLL) must not fit one. The supervised reply goes on past it (<|im_end|> then <|endoftext|>),
    and the round was shown those tokens too: RoundNLL counted the depth after the stop, a label decoding never
    drafts there."""
    prompt, reply = [1, 5, 9, 13], list(range(20, 70))
    sequence = prompt + reply
    oracle = RiggedDrafter(sequence, 97, block_size=6)
    cut = 0
    for stop in reply[:30]:
        seen = []
        replay_reply(oracle, torch.zeros(len(sequence), 3), torch.tensor(sequence), len(prompt), len(sequence), budget,
                     64, lambda logits, truth, accepted: seen.append((list(truth), accepted)), stop_ids=[stop])
        for truth, accepted in seen:
            if stop in truth[:accepted]:  # the round that commits the stop: its truth ends there
                assert truth[-1] == stop, (stop, truth, accepted)
                cut += len(truth) < 5  # the stop inside the block, not at its last depth
    assert cut > 0, "no stop was accepted inside a block: the cut was never exercised"


def test_replay_feeds_the_drafter_the_context_decoding_feeds_it(tiny):
    """A real DFlash drafter: each replayed round's draft logits equal decoding's (features of the committed rows)."""
    target, tokenizer = tiny
    torch.manual_seed(0)
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4)
    drafter = DFlashDraftModel(config).eval()
    prompt = tokenizer("import os\n")["input_ids"]
    sequence, mask = reply_of(target, prompt, 24)
    decoded_runner = Recording(DrafterRunner(drafter, target))
    generate(target, prompt, "ddtree", drafter=decoded_runner, budget=8, max_new_tokens=24)
    features = target_layer_features(target, torch.tensor([sequence]), list(config.target_layer_ids))[0]
    replay_runner = Recording(DrafterRunner(drafter, target))
    replay_reply(replay_runner, features, torch.tensor(sequence), *reply_span(mask), 8, 24)
    assert len(replay_runner.calls) == len(decoded_runner.calls)
    for (s1, d1, replayed), (s2, d2, decoded) in zip(replay_runner.calls, decoded_runner.calls):
        assert (s1, d1) == (s2, d2)
        torch.testing.assert_close(replayed, decoded, rtol=1e-4, atol=1e-4)


def test_reply_span_is_the_first_supervised_run():
    assert reply_span(torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])) == (2, 5)
    assert reply_span(torch.tensor([0, 0, 1, 1, 1])) == (2, 5)
    assert reply_span(torch.tensor([1, 1, 1])) is None  # no prompt before it: decoding never starts there
    assert reply_span(torch.tensor([0, 0, 0])) is None


def test_learn_calibration_goes_on_past_a_sequence_without_a_reply(tiny):
    """A validation sequence with no reply to replay (all prompt) is skipped: the replies after it still teach the
    calibration, as if it were not there, rather than ending the learning with what the sequences before it taught."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 24)
    oracle = RiggedDrafter(sequence, target.config.vocab_size, block_size=6)
    ids, features = torch.tensor(sequence), torch.zeros(len(sequence), 3)  # features unused by the oracle
    reply = (features, ids, mask)
    no_reply = (features, ids, torch.zeros_like(mask))
    learned = learn_calibration(oracle, [reply], budget=4, max_new_tokens=24, lookup=0, redraft=0).state()
    assert learned != OnlineCalibration().settled().state()  # the reply taught it something
    again = learn_calibration(oracle, [no_reply, reply], budget=4, max_new_tokens=24, lookup=0, redraft=0).state()
    assert again == learned


def test_learn_calibration_decodes_with_the_lookup_and_redraft_it_is_given(tiny):
    """lookup and redraft reach the replay as given, each as itself: the context lookup's acceptance is learned where a
    lookup is asked for, and no block is re-drafted where none is (this drafter cannot re-draft)."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 24)
    oracle = RiggedDrafter(sequence, target.config.vocab_size, block_size=6)
    sequences = [(torch.zeros(len(sequence), 3), torch.tensor(sequence), mask)]
    learned = learn_calibration(oracle, sequences, budget=4, max_new_tokens=24, lookup=3, redraft=0).state()
    assert learned["graft_acceptance"].get("context")  # the replayed trees grafted the context lookup's nodes


def test_learn_calibration_ends_each_reply_at_a_stop_token_as_decoding_does(tiny, monkeypatch):
    """Decoding ends a reply at the target's end-of-turn token though the supervised reply goes on (<|im_end|> then
    <|endoftext|>): every replay that teaches the calibration is given the stop ids, or it learns from rounds past the
    end that decoding never runs."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 24)
    oracle = RiggedDrafter(sequence, target.config.vocab_size, block_size=6)
    replayed, replay = [], training.replay.replay_reply

    def recorded(*args, **kwargs):
        replayed.append(kwargs.get("stop_ids", ()))
        return replay(*args, **kwargs)

    monkeypatch.setattr(training.replay, "replay_reply", recorded)
    learn_calibration(oracle, [(torch.zeros(len(sequence), 3), torch.tensor(sequence), mask)], budget=4,
                      max_new_tokens=24, stop_ids=[2], lookup=0, redraft=0)
    assert replayed == [[2], [2]]  # the chain and the tree


def test_learn_calibration_keeps_the_mean_of_the_path_its_temperatures_settled_on(tiny, monkeypatch):
    """The last round's temperature is noisy (OnlineCalibration.settled says by how much): what is kept is the mean
    over the recorded path of each shape, which only a calibration that records its path can give."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 24)
    oracle = RiggedDrafter(sequence, target.config.vocab_size, block_size=6)
    settled_from, settled = [], OnlineCalibration.settled

    def recorded(self):
        settled_from.append(self.trajectory)
        return settled(self)

    monkeypatch.setattr(OnlineCalibration, "settled", recorded)
    learn_calibration(oracle, [(torch.zeros(len(sequence), 3), torch.tensor(sequence), mask)], budget=4,
                      max_new_tokens=24, lookup=0, redraft=0)
    assert len(settled_from) == 1 and set(settled_from[0] or {}) == {None, 4}  # the chain's path and the tree's


def test_round_nll_counts_depths_under_an_accepted_prefix_and_finds_the_drawing_temperature():
    """Labels drawn from softmax(z / t_k): the fitted temperature at depth k is t_k; a depth counts only
    when every depth before it was accepted."""
    generator = torch.Generator().manual_seed(0)
    vocab, depths, rounds = 40, 3, 3000
    true_temperature = torch.tensor([0.6, 1.0, 2.0])[:, None]
    fit = RoundNLL(block_size=depths + 1)
    for i in range(rounds):
        logits = 3 * torch.randn(depths, vocab, generator=generator)
        truth = torch.multinomial(torch.softmax(logits / true_temperature, dim=-1), 1, generator=generator)[:, 0]
        fit(logits, truth.tolist(), accepted=i % 3)  # depth k counts in the rounds that accepted k - 1 or more
    assert fit.counts.tolist() == [0, rounds, 2 * rounds / 3, rounds / 3]
    assert fit.best() == pytest.approx([0.6, 1.0, 2.0], rel=0.12)


def test_round_nll_skips_a_label_outside_the_draft_vocabulary():
    """A drafter trained with model.draft_vocab_size gives -inf logits outside its vocabulary: one such label made the
    depth's NLL infinite at every temperature, and model.calibrate wrote the first candidate, 0.5, for it."""
    generator = torch.Generator().manual_seed(0)
    fit, inside = RoundNLL(block_size=2), RoundNLL(block_size=2)
    for i in range(200):
        logits = 3 * torch.randn(1, 50, generator=generator)
        logits[:, 40:] = -float("inf")  # a draft vocabulary of 40
        if i % 2:
            fit(logits, [45], accepted=0)
        else:
            label = torch.multinomial(torch.softmax(logits[0] / 2, dim=-1), 1, generator=generator).tolist()
            fit(logits, label, accepted=0)
            inside(logits, label, accepted=0)
    assert torch.isfinite(fit.nll).all() and fit.counts.tolist() == [0, 100]
    assert fit.best() == inside.best() and fit.best()[0] > 1  # drawn at 2


def test_round_nll_counts_the_depths_below_an_accepted_label_outside_the_draft_vocabulary():
    """A lookup's grafted node can be accepted with a token the draft vocabulary lacks: that depth has no NLL, but the
    depths under it were reached and count, as every round's do."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 45] = -float("inf")  # the depth-1 label, outside the draft vocabulary
    fit = RoundNLL(block_size=4)
    fit(logits, [45, 2, 3], accepted=2)
    assert fit.counts.tolist() == [0, 0, 1, 1] and torch.isfinite(fit.nll).all()


def test_round_nll_leaves_a_depth_no_round_reached_at_temperature_1():
    """As best() and model.calibrate promise: an argmin over no rounds gave the first candidate, 0.5, which would
    sharpen twofold the depths the drafter never got right."""
    generator = torch.Generator().manual_seed(0)
    fit = RoundNLL(block_size=5)
    for _ in range(20):
        fit(3 * torch.randn(4, 50, generator=generator), [1, 2, 3, 4], accepted=0)  # every round rejected at depth 1
    assert fit.counts.tolist() == [0, 20, 0, 0, 0]
    assert fit.best()[1:] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("budget", [None, 4])
@pytest.mark.parametrize("reply", ["greedy", "varied"])
def test_a_round_shows_the_re_drafted_rows_its_tree_ranks_the_reply_by(tiny, budget, reply):
    """Past depth 1 a tree ranks the reply's path by the block re-drafted behind its first token, where one was drafted,
    and decoding divides those rows by the drafter's temperatures as it does the block's: model.calibrate fitted them
    on the block's rows alone, which no node of that path came from. The random target's greedy reply repeats one
    token, so the varied reply tells the path's first token from its later ones."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 40)
    if reply == "varied":
        sequence = prompt + [(7 * i + 3) % target.config.vocab_size for i in range(len(sequence) - len(prompt))]
    oracle = RedraftRigged(sequence, target.config.vocab_size, block_size=6)  # its block misses past depth 1
    seen = []
    replay_reply(oracle, torch.zeros(len(sequence), 3), torch.tensor(sequence), *reply_span(mask), budget, 40,
                 on_round=lambda logits, truth, accepted: seen.append((logits, truth)), redraft=1)
    firsts = dict(oracle.redrafts)  # root -> the depth-1 token re-drafted behind (a true one ranked 2nd is not)
    kinds = []
    assert len(seen) == len(oracle.calls)
    for (start, depth), (logits, truth) in zip(oracle.calls, seen):
        redrafted = truth[0] in firsts.get(start, [])
        expected = oracle.rows(start, depth) if redrafted else oracle.rows(start, depth, miss_from=2)
        assert torch.equal(logits, expected), (start, depth, redrafted)
        kinds.append(redrafted)
    assert any(kinds) and not all(kinds)


def test_a_round_is_shown_the_replys_tokens_not_the_padding_after_it(tiny):
    """A training row goes on past the reply (padding, the next turn): a truth running past the reply's end gave
    RoundNLL one depth more, labelled with a pad id, to fit model.calibrate's temperatures on."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 37)  # at 40 the last round drafted exactly to the end
    padded, end = sequence + [0] * 8, len(sequence)
    oracle = RiggedDrafter(padded, target.config.vocab_size, block_size=6)
    seen = []
    replay_reply(oracle, torch.zeros(len(padded), 3), torch.tensor(padded), len(prompt), end, 4, 64,
                 on_round=lambda logits, truth, accepted: seen.append(truth))
    assert any(start + 1 + depth > end for start, depth in oracle.calls)  # rounds near the end draft past it
    assert seen == [sequence[start + 1:min(start + 1 + depth, end)] for start, depth in oracle.calls]


def test_a_reply_cut_short_of_max_new_tokens_replays_no_round_from_its_last_token(tiny):
    """A reply that ends with no stop token (a training row cut at its length) gives no target choice after its last
    token: a round rooted there has nothing to be judged by, and counted as accepting nothing, it lowered tau. The rounds
    are decoding's with max_new_tokens the reply's length, which ends where the reply does."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    reply = generate(target, prompt, "ar", max_new_tokens=40).new_tokens
    landed = 0
    for length in range(8, 40):
        sequence = prompt + reply[:length]
        oracle = RiggedDrafter(sequence, target.config.vocab_size, block_size=6)
        rounds = replay_reply(oracle, torch.zeros(len(sequence), 3), torch.tensor(sequence), len(prompt), len(sequence),
                              None, 64)
        assert all(start < len(sequence) - 1 for start, _ in oracle.calls), length
        if 1 + sum(r.committed for r in rounds) == length:  # the last round's bonus was the reply's last token
            decoded = generate(target, prompt, "dflash", RiggedDrafter(sequence, target.config.vocab_size, block_size=6),
                               max_new_tokens=length)
            assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed)
                                                                   for r in decoded.rounds], length
            landed += 1
    assert landed > 0, "no replay ended with its root at the reply's last token: that end was never exercised"


@pytest.mark.parametrize("budget", [None, 4])
def test_a_calibrated_temperature_divides_the_re_drafted_rows_as_decoding_divides_them(tiny, budget):
    """At a temperature away from 1 the re-drafted blocks, divided or not, give another expected acceptance: the
    quantity model.replay_calibration learns its temperature from. (Learning from T = 1, it hardly moves in a reply.)
    The chain's and the tree's temperatures differ, so a tree drafted at the chain's would read another acceptance."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 40)
    calibrated = {"temperatures": {"4": 3.0, "chain": 0.5}, "graft_acceptance": {}}  # frozen: both runs see these
    decoded = generate(target, prompt, "ddtree" if budget else "dflash",
                       RedraftRigged(sequence, target.config.vocab_size, block_size=6), budget or 1, 40, lookup=0,
                       redraft=1, online=OnlineCalibration.from_state(calibrated))
    assert prompt + decoded.new_tokens == sequence
    rounds = replay_reply(RedraftRigged(sequence, target.config.vocab_size, block_size=6),
                          torch.zeros(len(sequence), 3), torch.tensor(sequence), *reply_span(mask), budget, 40,
                          redraft=1, online=OnlineCalibration.from_state(calibrated))
    assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
    assert [r.expected for r in rounds] == pytest.approx([r.expected for r in decoded.rounds], rel=1e-6)


def test_replay_re_drafts_the_blocks_decoding_re_drafts(tiny):
    """A tree holds at most `budget` depth-1 nodes, so decoding re-drafts min(redraft, budget) blocks: the replay
    re-drafted `redraft` of them, for the same rounds at more drafter calls (model.calibrate's time)."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 40)
    decoding, replaying = (RedraftRigged(sequence, target.config.vocab_size, block_size=6) for _ in range(2))
    decoded = generate(target, prompt, "ddtree", decoding, 2, 40, lookup=0, redraft=3)
    rounds = replay_reply(replaying, torch.zeros(len(sequence), 3), torch.tensor(sequence), *reply_span(mask), 2, 40,
                          redraft=3)
    assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
    assert replaying.redrafts == decoding.redrafts and all(len(firsts) == 2 for _, firsts in replaying.redrafts)


@pytest.mark.parametrize("budget, lookup", [(None, None), (8, "context"), (8, "corpus")])
def test_replay_grafts_redrafts_and_learns_as_decoding_does(tiny, budget, lookup):
    """With a context lookup or a corpus, re-drafting and online calibration (model.replay_calibration), the replayed
    rounds are decoding's, and the calibration learned from them is the one decoding learns. (The two lookups one at a
    time: with both, the corpus's path was always the context's, already in the tree.)"""
    target, tokenizer = tiny
    torch.manual_seed(0)
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4)
    drafter = DFlashDraftModel(config).eval()
    prompt = tokenizer("import os\n")["input_ids"]
    sequence, mask = reply_of(target, prompt, 40)  # a random target's reply repeats itself: the lookup is accepted
    corpus = CorpusLookup([sequence[len(prompt) + 10:]])  # its tail, as if another reply had held it
    settings = dict(lookup=5 if lookup == "context" else 0, redraft=2, corpus=corpus if lookup == "corpus" else None)
    decoded_online, replayed_online = OnlineCalibration(), OnlineCalibration()
    decoded = generate(target, prompt, "ddtree" if budget else "dflash", DrafterRunner(drafter, target), budget or 1,
                       40, online=decoded_online, **settings)
    assert prompt + decoded.new_tokens == sequence
    features = target_layer_features(target, torch.tensor([sequence]), list(config.target_layer_ids))[0]
    rounds = replay_reply(DrafterRunner(drafter, target), features, torch.tensor(sequence), *reply_span(mask), budget,
                          40, online=replayed_online, **settings)
    assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
    assert [r.expected for r in rounds] == pytest.approx([r.expected for r in decoded.rounds], rel=1e-4)
    learned, decoded_state = replayed_online.state(), decoded_online.state()
    assert learned["graft_acceptance"] == decoded_state["graft_acceptance"]
    assert learned["temperatures"] == pytest.approx(decoded_state["temperatures"], rel=1e-4)
    if lookup:  # the lookup grafted nodes, and the target took some of them
        counts = learned["graft_acceptance"][lookup].values()
        assert sum(rounds for _, rounds in counts) > 0 and sum(hits for hits, _ in counts) > 0, learned


@pytest.mark.parametrize("budget", [None, 4])
def test_a_reply_longer_than_max_new_tokens_replays_the_rounds_decoding_runs_up_to_it(tiny, budget):
    """Decoding stops at max_new_tokens, mid-reply: no round once that many tokens are committed, and a round that may
    commit only one more token commits its bonus alone. The replay must stop there too, or it proposes a block with no
    depth left (mutant: `committed <= max_new_tokens`)."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 40)
    exact = 0
    for max_new in range(6, 30, 2):
        decoded = generate(target, prompt, "ddtree" if budget else "dflash",
                           RiggedDrafter(sequence, target.config.vocab_size, block_size=6), budget or 1, max_new)
        assert prompt + decoded.new_tokens == sequence[:len(prompt) + max_new]
        rounds = replay_reply(RiggedDrafter(sequence, target.config.vocab_size, block_size=6),
                              torch.zeros(len(sequence), 3), torch.tensor(sequence), *reply_span(mask), budget, max_new)
        assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed)
                                                               for r in decoded.rounds], max_new
        assert 1 + sum(r.committed for r in rounds) == max_new  # the reply goes on: max_new_tokens ends it
        exact += rounds[-1].committed > 1  # the last round reached max_new_tokens itself, not by a bonus-only round
    assert exact > 0, "no replay reached max_new_tokens with a drafted round: the bound was never exercised"


@pytest.mark.parametrize("budget", [None, 2])
def test_replay_re_drafts_as_many_blocks_as_decoding_for_the_chain_and_the_tree(tiny, budget):
    """The chain holds one depth-1 node, so decoding re-drafts one block behind it however many `redraft` asks for
    (mutant: the chain re-drafting `redraft` blocks, the same rounds at three times the re-drafting)."""
    target, tokenizer = tiny
    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    sequence, mask = reply_of(target, prompt, 40)
    decoding, replaying = (RedraftRigged(sequence, target.config.vocab_size, block_size=6) for _ in range(2))
    decoded = generate(target, prompt, "ddtree" if budget else "dflash", decoding, budget or 1, 40, lookup=0, redraft=3)
    rounds = replay_reply(replaying, torch.zeros(len(sequence), 3), torch.tensor(sequence), *reply_span(mask), budget,
                          40, redraft=3)
    assert [(r.accepted, r.committed) for r in rounds] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
    assert replaying.redrafts == decoding.redrafts
    assert all(len(firsts) == (budget or 1) for _, firsts in replaying.redrafts)


@pytest.mark.parametrize("budget", [None, 4])
def test_a_round_that_accepts_a_stop_token_counts_no_node_below_it_as_accepted(budget):
    """Decoding ends the reply at an accepted end-of-turn token: that round's accepted nodes end with it and it commits
    no bonus, so the replay commits the reply up to the stop and no further. The drafter here drafts past the stop as
    well as before it, so the walk accepts nodes below it (mutant: ReplayRound.accepted = the walk's whole path)."""
    prompt, reply = [1, 5, 9, 13], list(range(20, 70))
    sequence = prompt + reply
    below = 0
    for stop in reply[1:30]:  # reply[0], the prefill's token, runs no round
        oracle = RiggedDrafter(sequence, 97, block_size=6)
        walked = []
        rounds = replay_reply(oracle, torch.zeros(len(sequence), 3), torch.tensor(sequence), len(prompt), len(sequence),
                              budget, 64, lambda logits, truth, accepted: walked.append(accepted), stop_ids=[stop])
        assert 1 + sum(r.committed for r in rounds) == reply.index(stop) + 1, stop  # the reply ends at the stop
        last = rounds[-1]
        assert last.accepted in (last.committed - 1, last.committed) and walked[-1] == last.accepted, (stop, last)
        if last.accepted == last.committed:  # the stop accepted, not the round's bonus: a round with depths below it
            below += last.accepted < 5 and (len(prompt) + reply.index(stop) + 1) % 7 != 3
    assert below > 0, "no stop was accepted above a drafted, matching node: nothing below it to leave out"
