"""Compatibility: the reference `dflash` package loads a drafter saved here and gives the same logits."""

import torch

from ddtree.cli import load_drafter
from ddtree.modeling_dflash import DFlashDraftModel, fuse_target_features


def test_reference_dflash_loads_our_folder_and_matches(tmp_path, tiny_target):
    from dflash import DFlashDraftModel as ReferenceDraftModel

    target, tokenizer = tiny_target
    ours = load_drafter("random", target, tokenizer, "tiny-random", seed=3)
    for p in ours.parameters():  # untrained norms are all ones; perturb so a mismatch could show
        p.data.add_(torch.randn_like(p) * 0.02)
    ours.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    assert '"DFlashDraftModel"' in config and '"block_size"' in config and '"num_target_layers"' in config

    reference = ReferenceDraftModel.from_pretrained(tmp_path).eval()
    reloaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    assert reference.target_layer_ids == ours.target_layer_ids
    assert reference.mask_token_id == ours.mask_token_id and reference.block_size == ours.block_size

    ids = torch.tensor([tokenizer("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        context = fuse_target_features(hidden, ours.target_layer_ids)  # (1, T, K*H)
        start = ids.shape[1]
        block = torch.full((1, ours.block_size), ours.mask_token_id)
        block[0, 0] = 42
        noise = target.get_input_embeddings()(block)
        positions = torch.arange(start + ours.block_size)[None]
        head = target.get_output_embeddings()
        mine = ours.compute_logits(ours(noise, context, positions), head)
        again = reloaded.compute_logits(reloaded(noise, context, positions), head)
        theirs = reference.compute_logits(
            reference(position_ids=positions, noise_embedding=noise, target_hidden=context), head
        )
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, again, atol=0, rtol=0)


def test_a_loaded_drafter_in_training_mode_drops_nothing_unasked(tmp_path, tiny_target):
    """Dropout is model.dropout's, which the training module sets: a drafter loaded to fine-tune in one's own loop
    computes in training mode what it does in eval mode."""
    target, tokenizer = tiny_target
    load_drafter("random", target, tokenizer, "tiny-random", seed=3).save_pretrained(tmp_path)
    drafter = DFlashDraftModel.from_pretrained(tmp_path)
    torch.manual_seed(0)
    context = torch.randn(1, 12, len(drafter.target_layer_ids) * drafter.config.hidden_size)
    noise = torch.randn(1, drafter.block_size, drafter.config.hidden_size)
    positions = torch.arange(12 + drafter.block_size)[None]
    with torch.no_grad():
        trained = drafter.train()(noise, context, positions)
        evaluated = drafter.eval()(noise, context, positions)
    torch.testing.assert_close(trained, evaluated, atol=0, rtol=0)
