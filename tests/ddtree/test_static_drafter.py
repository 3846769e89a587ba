"""The drafter's forwards at fixed shapes (ddtree/static_drafter.py) give the growing cache's logits, and the static
runners (the drafter's and the target's) handed from one generation to the next stay lossless.

    .venv/bin/pytest -q tests/ddtree/test_static_drafter.py
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

from ddtree.cli import load_drafter
from ddtree.decoding import DrafterRunner
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.static_drafter import StaticDrafter, redraft_layout
from ddtree.targets import build_drafter_config

# The context rows each call adds: the prompt (longer than a block: one uncaptured forward), then rounds
# that keep 1..block rows, as the decoding loop's root and accepted rows do; and the depth drafted.
ROUNDS = [(21, 7), (3, 7), (1, 7), (8, 7), (2, 3), (5, 7)]
CAPACITY = sum(rows for rows, _ in ROUNDS)


@pytest.fixture(scope="module")
def drafter(smollm2):
    model, tokenizer = smollm2
    drafter = load_drafter("random", model, tokenizer, "smollm2-135m")
    with torch.no_grad():  # random weights are small; scaled up, one context row moves the logits far
        for parameter in drafter.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.05)
    return drafter


def runs(runner: DrafterRunner, rounds: list[tuple[int, int]] = ROUNDS,
         zero_row: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each round's propose logits, and its redraft logits behind the 3 likeliest first tokens.
    rounds: each call's (new context rows, depth), as ROUNDS.
    zero_row: that row of the prompt's context is zeros (a lost context row, to size the tolerance against)."""
    generator = torch.Generator().manual_seed(0)
    device, width = runner.lm_head.weight.device, runner.drafter.fc.in_features
    start, out = 0, []
    for round_, (rows, depth) in enumerate(rounds):
        context = torch.randn(1, rows, width, generator=generator)
        if round_ == 0 and zero_row is not None:
            context[:, zero_row] = 0
        start += rows
        logits = runner.propose(100 + round_, start, context.to(device), depth)
        firsts = logits[0].topk(3).indices.tolist()
        out.append((logits.clone(), runner.redraft(100 + round_, start, firsts, depth).clone()))
    return out


def largest_difference(a, b) -> float:
    return max(max((x - y).abs().max().item() for x, y in zip(pair_a, pair_b)) for pair_a, pair_b in zip(a, b))


@pytest.mark.parametrize("temperatures", [None, [0.5 + 0.1 * depth for depth in range(15)]],
                         ids=["uncalibrated", "calibrated"])
def test_fixed_shapes_give_the_growing_caches_logits(smollm2, drafter, monkeypatch, temperatures):
    """calibrated: each depth's logits divided by its own draft temperature, on both paths (propose's first row is
    depth 1, redraft's depth 2)."""
    model, _ = smollm2
    monkeypatch.setattr(drafter.config, "draft_temperatures", temperatures)  # read by DrafterRunner
    growing, fixed = DrafterRunner(drafter, model), DrafterRunner(drafter, model)
    fixed.fix_shapes(CAPACITY)
    assert not fixed.static.cuda_graph  # on the CPU the fixed-shape forwards run uncaptured
    expected, got = runs(growing), runs(fixed)
    for (want_block, want_redraft), (block, redraft) in zip(expected, got):
        assert block.shape == want_block.shape and redraft.shape == want_redraft.shape
    assert largest_difference(got, expected) < 1e-4
    growing.reset()
    assert largest_difference(runs(growing, zero_row=5), expected) > 100 * 1e-4  # what one lost row does


def test_a_fixed_shape_drafter_holds_its_capacity_and_refuses_a_position_past_it(tiny_target):
    """Its buffers hold `capacity` context slots and one padded block: a round ending on the last slot fits, the next
    position is refused in a line naming it, rather than written over the padded block's slots or past the buffers."""
    target, tokenizer = tiny_target
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4,
                                  target_layer_ids=[0, target.config.num_hidden_layers - 1])
    runner = DrafterRunner(DFlashDraftModel(config).eval(), target)
    static, width = StaticDrafter(runner, capacity=8), runner.drafter.fc.in_features
    static.propose(11, 5, torch.randn(1, 5, width), 3)  # the prompt, uncaptured
    assert static.propose(12, 8, torch.randn(1, 3, width), 3).shape[0] == 3  # the last slot, through the padded block
    with pytest.raises(ValueError, match=r"^position 9 is past the drafter's 8 context slots$"):
        static.propose(13, 9, torch.randn(1, 1, width), 3)


def test_a_fixed_shape_drafter_reused_by_a_shorter_generation_sees_none_of_the_last_ones_context(smollm2, drafter):
    """The next generation takes the buffers as they are (fix_shapes): the slots past its context still hold the last
    one's keys, and a mask that kept them (propose's, or a re-draft's) let its queries see them. Decoding stays
    lossless with a wrong draft, so only the acceptance would have told."""
    model, _ = smollm2
    fixed = DrafterRunner(drafter, model)
    fixed.fix_shapes(CAPACITY)
    runs(fixed)
    reused = fixed.static
    fixed.reset()
    fixed.fix_shapes(CAPACITY)
    assert fixed.static is reused
    shorter = [(5, 7), (2, 7), (1, 3)]
    assert largest_difference(runs(fixed, shorter), runs(DrafterRunner(drafter, model), shorter)) < 1e-4


def test_a_runner_cast_to_another_dtype_gets_fixed_shapes_in_it(tiny_target):
    """fix_shapes hands the last generation's buffers to the next that fits: after the drafter was cast they were of
    the old dtype, and the first fixed-shape forward failed (float != BFloat16)."""
    from ddtree.decoding import generate
    from ddtree.modeling_dflash import DFlashDraftModel
    from ddtree.targets import build_drafter_config

    target, tokenizer = tiny_target
    target = copy.deepcopy(target)
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4,
                                  target_layer_ids=[0, target.config.num_hidden_layers - 1])
    runner = DrafterRunner(DFlashDraftModel(config).eval(), target)
    prompt = [5, 6, 7, 8]
    generate(target, prompt, "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    target.to(torch.bfloat16), runner.drafter.to(torch.bfloat16)
    result = generate(target, prompt, "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    fresh = generate(target, prompt, "ddtree", DrafterRunner(runner.drafter, target), budget=4, max_new_tokens=6,
                     static=True)  # the same bf16 forwards on new buffers
    assert runner.static.dtype == torch.bfloat16 and len(result.new_tokens) == 6
    assert result.new_tokens == fresh.new_tokens and result.tau == fresh.tau
    # There and back with no generation between: the same dtype, but the weights live elsewhere, and a captured CUDA
    # graph reads them by address. Both the drafter's and the target's fixed-shape runners are made again.
    from ddtree.target_runner import static_target

    before, target_runner = runner.static, static_target(target, True, 5, 64)
    assert static_target(target, True, 5, 64) is target_runner  # reused while nothing moved
    for model in (target, runner.drafter):
        model.to(torch.float32).to(torch.bfloat16)
    generate(target, prompt, "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    assert runner.static is not before and static_target(target, True, 5, 64) is not target_runner


def test_a_redraft_block_sits_where_proposes_block_does_and_sees_only_itself(tiny_target):
    """Both paths share redraft_layout, so comparing them cannot see a wrong one: held here to what training's block
    mask and propose's positions say. Block i is [root, first i, MASK...] at positions start..start+B-1 (the root at
    start), seeing the context and its own block only: its logits are those of that block drafted alone."""
    target, tokenizer = tiny_target
    torch.manual_seed(0)
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4,
                                  target_layer_ids=[0, target.config.num_hidden_layers - 1])
    drafter = DFlashDraftModel(config).eval()
    mask = drafter.mask_token_id
    blocks, positions, same_block = redraft_layout(7, 5, [3, 9, 4], 4, mask, torch.device("cpu"))
    assert blocks.tolist() == [[7, 3, mask, mask], [7, 9, mask, mask], [7, 4, mask, mask]]
    assert positions.tolist() == [[5, 6, 7, 8] * 3]
    assert torch.equal(same_block, torch.block_diag(*[torch.ones(4, 4, dtype=torch.bool)] * 3))

    prompt = [5, 17, 42, 8, 99, 3, 61]
    with torch.no_grad():
        hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    runner, start = DrafterRunner(drafter, target), len(prompt)
    root = 11
    firsts = runner.propose(root, start, runner.features(hidden), 3)[0].topk(3).indices.tolist()
    context = copy.deepcopy(runner.cache)  # the prompt's, before the re-draft
    redrafted = runner.redraft(root, start, firsts, 3)  # (3 firsts, depths 2..3, V)
    no_context = drafter.fc.weight.new_zeros(1, 0, drafter.fc.in_features)
    for row, first in zip(redrafted, firsts):
        block = torch.tensor([[root, first, mask, mask]])
        with torch.no_grad():  # one block, as propose drafts it: it sees the context and the whole of itself
            alone = drafter(noise_embedding=runner.embedding(block), target_hidden=no_context,
                            position_ids=torch.arange(start, start + 4)[None], past_key_values=copy.deepcopy(context))
        torch.testing.assert_close(row, runner._logits(alone[0, 2:], first_depth=2), atol=1e-5, rtol=0)


def test_static_runners_reused_across_generations_of_other_lengths_and_shapes_stay_greedy(tiny_target):
    """A generation takes the static target and drafter the last one of its shape left (static_target, fix_shapes):
    a shorter prompt after a longer one over its stale slots, a dflash verify (a block of rows) after ddtree's (budget
    + 1 rows) on the same target, and a prompt past the drafter's context slots, which needs larger ones. Each reply
    is transformers' greedy one, token for token. (The slow test_lossless::test_static_runners_outlive_their_generation
    covers the first on SmolLM2.) 16 tokens each (10 past the slots) are rounds enough over the shorter prompt's stale
    slots, and keep the first generations in 128 slots; 40, 40, 30 and 20 were twice the forwards."""
    from ddtree.decoder import load_drafter
    from ddtree.decoding import generate
    from ddtree.target_runner import static_target
    from rigged import hf_greedy  # tests/rigged.py

    target, tokenizer = tiny_target
    target = copy.deepcopy(target)  # its own pool of static runners: none left by another test
    runner = DrafterRunner(load_drafter("random", target, tokenizer, "tiny-random"), target)
    longer, shorter = [5 + (7 * i) % 90 for i in range(60)], [5, 17, 42, 8, 99, 3, 61]
    past_the_slots = [5 + i % 50 for i in range(150)]  # past the 128 context slots the generations before it took
    budget, drafters, verifiers = 8, [], []
    for prompt, method, new in [(longer, "ddtree", 16), (shorter, "ddtree", 16), (longer, "dflash", 16),
                                (past_the_slots, "ddtree", 10)]:
        result = generate(target, prompt, method, runner, budget, new, [], static=True, redraft=2)
        assert result.new_tokens == hf_greedy(target, prompt, new), (len(prompt), method)
        drafters.append(runner.static)
        verifiers.append(static_target(target, True, budget + 1, needed=1))  # ddtree's, as it stands now
    assert drafters[0] is drafters[1] is drafters[2] and verifiers[0] is verifiers[1] is verifiers[2]  # reused
    assert drafters[3].capacity >= len(past_the_slots) + 10
    assert verifiers[3].capacity >= len(past_the_slots) + 10 + budget + 1


def test_a_dynamic_generation_after_a_static_one_drafts_over_the_growing_cache(tiny_target):
    """reset drops the fixed-shape drafter the last generation's static cache took: kept, a dynamic generation after a
    static one drafted through its fixed slots, and a prompt past them was a ValueError after the prefill."""
    from ddtree.decoding import generate
    from rigged import hf_greedy  # tests/rigged.py

    target, tokenizer = tiny_target
    target = copy.deepcopy(target)  # its own pool of static runners: none left by another test
    runner = DrafterRunner(load_drafter("random", target, tokenizer, "tiny-random"), target)
    generate(target, [5, 17, 42, 8], "ddtree", runner, 8, 4, [], static=True)  # 128 context slots
    past_the_slots = [5 + i % 50 for i in range(150)]
    result = generate(target, past_the_slots, "ddtree", runner, 8, 10, [], static=False)
    assert result.new_tokens == hf_greedy(target, past_the_slots, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_give_the_uncaptured_logits(smollm2, drafter):
    model, _ = smollm2
    target, on_gpu = copy.deepcopy(model).to("cuda"), copy.deepcopy(drafter).to("cuda")
    uncaptured, graphed = DrafterRunner(on_gpu, target), DrafterRunner(on_gpu, target)
    uncaptured.fix_shapes(CAPACITY, cuda_graph=False)
    graphed.fix_shapes(CAPACITY)
    got = runs(graphed)
    assert graphed.static.cuda_graph and set(graphed.static.graphs) == {"propose", 3}  # both forwards replayed
    assert largest_difference(got, runs(uncaptured)) < 1e-4


def test_replays_of_the_first_forward_of_each_kind_give_the_growing_caches_logits(tiny_target, monkeypatch):
    """A CUDA graph replays the forward it captured, over the tensors that forward read: every later call of its kind
    (propose, a re-draft of so many blocks) must write its inputs into those. Replay emulated on the CPU: the first
    forward of each kind kept and called again in place of every later one."""
    monkeypatch.setattr(StaticDrafter, "_replay", lambda self, key, forward: self.graphs.setdefault(key, forward)())
    target, tokenizer = tiny_target
    drafter = load_drafter("random", target, tokenizer, "tiny-random", seed=3)
    with torch.no_grad():  # scaled up as the smollm2 drafter's, so that a stale input moves the logits far
        for parameter in drafter.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    replayed = DrafterRunner(drafter, target)
    replayed.fix_shapes(CAPACITY, cuda_graph=False)
    got = runs(replayed)
    assert set(replayed.static.graphs) == {"propose", 3}  # both kinds kept, once each
    assert largest_difference(got, runs(DrafterRunner(drafter, target))) < 1e-4


@pytest.fixture
def static_pool(monkeypatch) -> weakref.WeakKeyDictionary:
    """static_target's pool of StaticTargets, empty of what other tests left in it (put back after)."""
    from ddtree import target_runner

    monkeypatch.setattr(target_runner, "_STATIC_TARGETS", weakref.WeakKeyDictionary())
    return target_runner._STATIC_TARGETS


def test_a_generation_that_needs_every_slot_of_the_static_target_reuses_it(tiny_target, static_pool):
    """static_target rebuilds a StaticTarget only for a generation it does not fit: one that needs exactly its slots
    fits, and a rebuild there would capture the target's CUDA graphs again inside that generation's prefill."""
    from ddtree.target_runner import CAPACITY_STEP, static_target

    target, _ = tiny_target
    runner = static_target(target, False, 5, needed=CAPACITY_STEP - 3)
    assert runner.capacity == CAPACITY_STEP  # rounded up to a whole step
    assert static_target(target, False, 5, needed=CAPACITY_STEP) is runner
    assert static_target(target, False, 5, needed=CAPACITY_STEP + 1).capacity == 2 * CAPACITY_STEP


def test_a_capacity_is_the_least_whole_number_of_steps_holding_what_is_needed():
    """padded_capacity by hand: 1 and 127 slots need one 128-slot step, 128 exactly one too (not two, twice the cache's
    memory), 129 two, 384 three. static_target's reuse test above reached only needs short of or past a step."""
    from ddtree.target_runner import CAPACITY_STEP, padded_capacity

    assert CAPACITY_STEP == 128
    assert [padded_capacity(n) for n in (1, 127, 128, 129, 384)] == [128, 128, 128, 256, 384]


def test_a_static_target_with_hidden_states_is_pooled_apart_from_one_without(tiny_target, static_pool):
    """static_target keys its pool by every setting a StaticTarget is built with: one without hidden states handed to a
    caller asking for them (the drafter reads them) returned None for them. (generate asks for them exactly when its
    verify has more than one row, so only a direct caller could meet this.)"""
    from ddtree.target_runner import static_target

    target, _ = tiny_target
    plain = static_target(target, False, 5, needed=64)
    featured = static_target(target, True, 5, needed=64)
    assert featured is not plain and featured.hidden_states and not plain.hidden_states
    assert static_target(target, False, 5, needed=64) is plain  # both pooled, one per setting


def test_a_dropped_target_is_freed_though_its_static_target_is_pooled(static_pool):
    """static_target pools a StaticTarget under its target, weakly: one holding its target strongly kept every target a
    process decoded with (a bench over several, a checkpoint evaluation after another) alive in memory."""
    import gc

    from transformers import LlamaConfig, LlamaForCausalLM

    from ddtree.target_runner import static_target

    target = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    static_target(target, False, 5, needed=16)
    dropped = weakref.ref(target)
    del target
    gc.collect()
    assert dropped() is None and len(static_pool) == 0


def test_a_static_target_is_not_reused_once_the_targets_buffers_moved(tiny_target, static_pool):
    """A captured graph reads the rotary inv_freq by address like the weights: a target whose buffer was replaced (a
    dynamic rope's update assigns a new one) gets a new StaticTarget, not one whose graph reads the freed tensor."""
    from ddtree.target_runner import static_target

    target, _ = tiny_target
    runner = static_target(target, False, 5, needed=64)
    assert static_target(target, False, 5, needed=64) is runner
    rotary, saved = target.model.rotary_emb, target.model.rotary_emb.inv_freq
    rotary.inv_freq = saved.clone()  # the same values at another address (monkeypatch's undo deletes a buffer)
    try:
        assert static_target(target, False, 5, needed=64) is not runner
    finally:
        rotary.inv_freq = saved


def test_a_drafter_runner_fixes_shapes_anew_once_the_targets_embedding_and_head_moved(tiny_target):
    """The drafter reads the target's embedding and lm_head: a target cast there and back (the drafter untouched)
    moves them, and a captured graph of the drafter reads them by address, so the next generation's drafter runner is
    made again."""
    from ddtree.decoding import generate
    from ddtree.modeling_dflash import DFlashDraftModel
    from ddtree.targets import build_drafter_config

    target, tokenizer = tiny_target
    target = copy.deepcopy(target)
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4,
                                  target_layer_ids=[0, target.config.num_hidden_layers - 1])
    runner = DrafterRunner(DFlashDraftModel(config).eval(), target)
    generate(target, [5, 6, 7, 8], "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    before = runner.static
    generate(target, [5, 6, 7, 8], "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    assert runner.static is before  # reused while nothing moved
    # the old weights held, or the allocator may hand a freed address back to the cast's copy (which a captured graph
    # would then read rightly, but which would move nothing here)
    held = [tensor.data for tensor in (*target.parameters(), *target.buffers())]
    target.to(torch.bfloat16).to(torch.float32)
    generate(target, [5, 6, 7, 8], "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    assert runner.static is not before
    del held  # (kept until the check)
