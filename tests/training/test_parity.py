"""Train/inference parity: a block's logits in the multi-block training forward equal a plain decoding call.

    .venv/bin/pytest -q tests/training/test_parity.py

Public ports of DFlash broke exactly here (a causal in-block mask; a context window off by one),
which collapses served acceptance to about 1 while training accuracy looks fine. The inference-style
call below is what a decoding round does: the block [anchor token, MASK...] at positions a..a+B-1,
the target features of positions 0..a-1 as context, no mask (the block sees all of it).

The padded-batch tests go through decoding's own DrafterRunner instead, round after round over a context
cache that grows (DynamicCache, or StaticDrafter's fixed buffers), and through its re-draft (`--redraft`).
"""

from __future__ import annotations

import pytest
import torch

from ddtree.decoding import DrafterRunner
from training.data import collate
from training.masks import sample_anchors, sample_given
from training.module import DistillModule
from training.target import target_layer_features

BLOCK = 8


@pytest.fixture(scope="module")
def module() -> DistillModule:
    torch.manual_seed(0)
    module = DistillModule(
        target="tiny-random", num_layers=2, block_size=BLOCK, target_layer_ids=[0, 2, 4], target_dtype="float32"
    )
    module.configure_model()
    with torch.no_grad():  # random weights are tiny; scale them so a wrong mask shows up far above the tolerance
        for p in module.drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return module.eval()


def inference_logits(module, input_ids, features, anchor: int, mask_token_id: int, context_cut: int | None = None):
    """One decoding round's logits for the block opened at `anchor` (context = positions before it)."""
    cut = anchor if context_cut is None else context_cut
    block = torch.full((1, BLOCK), mask_token_id)
    block[0, 0] = input_ids[0, anchor]
    noise = module.target.get_input_embeddings()(block)  # (1, B, H)
    position_ids = torch.cat([torch.arange(cut), anchor + torch.arange(BLOCK)])[None]  # (1, cut + B)
    hidden = module.drafter(
        noise_embedding=noise, target_hidden=features[:, :cut], position_ids=position_ids, attention_mask=None
    )
    return module.target.get_output_embeddings()(hidden)[0]  # (B, V)


@torch.no_grad()
def test_every_block_of_the_training_forward_equals_its_inference_call(module):
    generator = torch.Generator().manual_seed(0)
    length = 48
    input_ids = torch.randint(100, 40000, (1, length), generator=generator)
    loss_mask = torch.zeros(1, length, dtype=torch.bool)
    loss_mask[0, 5:] = True
    features = target_layer_features(module.target, input_ids, module.target_layer_ids)  # (1, T, K*H)
    # adjacent anchors, random ones, and one whose block runs past the end of the sequence
    drawn, _ = sample_anchors(loss_mask, 4, generator)
    anchors = torch.cat([torch.tensor([[5, 6, 20, 46]]), drawn], dim=1).sort(dim=1).values
    hidden = module.block_hidden_states(features, input_ids, anchors)  # (1, n*B, H)
    training = module.target.get_output_embeddings()(hidden).view(anchors.shape[1], BLOCK, -1)  # (n, B, V)
    mask_id = module.drafter.config.mask_token_id
    for i, anchor in enumerate(anchors[0].tolist()):
        expected = inference_logits(module, input_ids, features, anchor, mask_id)
        torch.testing.assert_close(training[i], expected, atol=1e-4, rtol=1e-4, msg=f"block at anchor {anchor}")


@torch.no_grad()
def test_parity_check_would_catch_an_off_by_one_context(module):
    """The tolerance is meaningful: one extra context row (the anchor's own features) moves the logits far."""
    input_ids = torch.randint(100, 40000, (1, 32), generator=torch.Generator().manual_seed(1))
    features = target_layer_features(module.target, input_ids, module.target_layer_ids)
    anchor, mask_id = 17, module.drafter.config.mask_token_id
    hidden = module.block_hidden_states(features, input_ids, torch.tensor([[anchor]]))
    training = module.target.get_output_embeddings()(hidden)[0]
    leaky = inference_logits(module, input_ids, features, anchor, mask_id, context_cut=anchor + 1)
    assert (training - leaky).abs().max() > 1e-2


# Three conversations of lengths 40, 25 and 16 and their reply spans. The first has two replies: the second's blocks
# see the first turn, as decoding a multi-turn prompt does. It has 28 anchor candidates (a reply token whose next
# token is one too), more than PADDED_ANCHORS, so its anchors leave gaps that decoding crosses in one round; the
# other two have fewer, so their last slots are invalid. The third's first reply token comes after more than a
# block of prompt, which StaticDrafter writes by a forward of its own.
CONVERSATIONS = [(40, [(5, 15), (20, 40)]), (25, [(3, 25)]), (16, [(10, 16)])]
PADDED_ANCHORS = 24


def padded_batch(seed: int):
    """The conversations right-padded into one batch by training's collate, its anchors and a generator for more."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for length, replies in CONVERSATIONS:
        loss_mask = torch.zeros(length, dtype=torch.bool)
        for start, end in replies:
            loss_mask[start:end] = True
        input_ids = torch.randint(100, 40000, (length,), generator=generator)
        examples.append({"input_ids": input_ids, "loss_mask": loss_mask})
    batch = collate(examples, pad_id=0)
    anchors, valid = sample_anchors(batch["loss_mask"], PADDED_ANCHORS, generator)  # (S, n) each
    assert not valid.all()  # the case under test: invalid slots beside valid ones
    return batch, anchors, valid, generator


def training_logits(module, batch, anchors, given=None):
    """(S, n, B, V) logits of every block of the batch, by the training forward."""
    input_ids = batch["input_ids"]
    features = target_layer_features(module.target, input_ids, module.target_layer_ids)  # (S, T, K*H), padded
    hidden = module.block_hidden_states(features, input_ids, anchors, given)  # (S, n*B, H)
    return module.target.get_output_embeddings()(hidden).view(*anchors.shape, BLOCK, -1)


def decoding_rounds(module, batch, anchors, valid, static: bool):
    """Each row decoded alone as generate does: its own unpadded target features, one DrafterRunner.propose per valid
    anchor in order, each round adding the rows since the last to the drafter's cached context.

    Yields (row, slot, anchor, runner, logits (B-1, V)) after each round, before the next overwrites anything.
    """
    runner = DrafterRunner(module.drafter, module.target, calibrated=False)
    for row, length in enumerate(batch["attention_mask"].sum(dim=1).tolist()):
        input_ids = batch["input_ids"][row : row + 1, :length]
        features = target_layer_features(module.target, input_ids, module.target_layer_ids)  # (1, length, K*H)
        runner.reset()
        if static:
            runner.fix_shapes(length, cuda_graph=False)  # the later, shorter rows reuse the first row's buffers
        for slot in valid[row].nonzero().flatten().tolist():
            anchor = int(anchors[row, slot])
            new_context = features[:, runner.context_end : anchor]
            logits = runner.propose(int(input_ids[0, anchor]), anchor, new_context, BLOCK - 1)
            yield row, slot, anchor, runner, logits


@pytest.mark.parametrize("static", [False, True], ids=["growing-cache", "static-drafter"])
@torch.no_grad()
def test_padded_batch_blocks_equal_drafter_runner_rounds(module, static):
    """Every valid block of a padded multi-row batch equals the decoding round opened at its anchor."""
    batch, anchors, valid, _ = padded_batch(2)
    training = training_logits(module, batch, anchors)
    rounds = 0
    for row, slot, anchor, _, logits in decoding_rounds(module, batch, anchors, valid, static):
        torch.testing.assert_close(logits, training[row, slot, 1:], atol=1e-4, rtol=1e-4,
                                   msg=f"row {row}, block at anchor {anchor}")
        rounds += 1
    assert rounds == valid.sum()


@pytest.mark.parametrize("static", [False, True], ids=["growing-cache", "static-drafter"])
@torch.no_grad()
def test_blocks_given_their_first_draft_token_equal_the_redraft(module, static):
    """Training with model.redraft_prob gives some blocks their first draft token; decoding re-drafts behind it.

    Each re-draft also holds a block behind another first token, in the same forward: it must not change the first.
    The blocks given nothing, in the same training forward, still equal propose.
    """
    batch, anchors, valid, generator = padded_batch(3)
    given = sample_given(anchors, 0.5, generator)  # (S, n): 1 = the block holds the token after its anchor
    training = training_logits(module, batch, anchors, given)
    redrafts = 0
    for row, slot, anchor, runner, logits in decoding_rounds(module, batch, anchors, valid, static):
        where = f"row {row}, block at anchor {anchor}"
        if not given[row, slot]:
            torch.testing.assert_close(logits, training[row, slot, 1:], atol=1e-4, rtol=1e-4, msg=where)
            continue
        root, first = batch["input_ids"][row, anchor : anchor + 2].tolist()
        redrafted = runner.redraft(root, anchor, [first, first + 1], BLOCK - 1)  # (2, B-2, V)
        torch.testing.assert_close(redrafted[0], training[row, slot, 2:], atol=1e-4, rtol=1e-4, msg=where)
        redrafts += 1
    assert 0 < redrafts < valid.sum()
