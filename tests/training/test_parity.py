"""Train/inference parity: a block's logits in the multi-block training forward equal a plain decoding call.

    .venv/bin/pytest -q tests/training/test_parity.py

Public ports of DFlash broke exactly here (a causal in-block mask; a context window off by one),
which collapses served acceptance to about 1 while training accuracy looks fine. The inference-style
call below is what a decoding round does: the block [anchor token, MASK...] at positions a..a+B-1,
the target features of positions 0..a-1 as context, no mask (the block sees all of it).
"""

from __future__ import annotations

import pytest
import torch

from training.masks import sample_anchors
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
