"""One compiled flex-attention kernel for every batch: fixed shapes, no recompilation, same output as the dense mask.

    OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/training/test_masks_compile.py

Training pads every batch to a few fixed shapes (training/masks.py, `pad_for_flex`) so dynamo compiles
flex attention once per shape instead of once per batch (it stops compiling after 8 shapes and then
materialises every score). The CPU test runs the compiled kernel forward only (flex attention has no
CPU backward); the CUDA tests run the training path itself, backward included, and skip without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from torch._dynamo.utils import counters
from torch.nn import functional as F

from training.arguments import RECIPES_DIR
from training.masks import (
    FLEX_MIN_CONTEXT, block_input_ids, block_position_ids, dense_block_mask, flex_block_mask, pad_for_flex,
    sample_anchors, sample_given,
)
from training.module import DistillModule
from training.target import target_layer_features

BLOCK = 4
NUM_ANCHORS = 6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_module(block_size: int = BLOCK, num_anchors: int = NUM_ANCHORS) -> DistillModule:
    torch.manual_seed(0)
    module = DistillModule(
        target="tiny-random", num_layers=2, block_size=block_size, target_layer_ids=[0, 2, 4], num_anchors=num_anchors,
        target_dtype="float32",
    )
    module.configure_model()
    with torch.no_grad():  # random weights are tiny; scale them so a wrong mask shows far above the tolerance
        for p in module.drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return module


def batch_of(length: int, reply_start: int, seed: int, device="cpu"):
    """input_ids (2, length) and anchors (2, n): n varies with how many reply tokens there are."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(100, 40000, (2, length), generator=generator)
    loss_mask = torch.zeros(2, length, dtype=torch.bool)
    loss_mask[:, reply_start:] = True
    anchors, _ = sample_anchors(loss_mask, NUM_ANCHORS, generator)
    return input_ids.to(device), anchors.to(device)


# Key lengths and anchor counts change batch to batch, as in training; two context widths in all.
BATCHES = [(24, 6, 0), (40, 37, 1), (31, 10, 2), (FLEX_MIN_CONTEXT + 9, 1000, 3), (17, 14, 4),
           (FLEX_MIN_CONTEXT + 50, 20, 5), (29, 26, 6)]


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def flex_hidden(module, features, input_ids, anchors, given=None):
    """DistillModule.block_hidden_states' CUDA branch (padded, a flex BlockMask), which runs on CPU forward only."""
    block, num_blocks = module.block_size, anchors.shape[1]
    features, anchors = pad_for_flex(features, anchors, module.hparams.num_anchors)
    if given is not None:
        given = F.pad(given, (0, anchors.shape[1] - given.shape[1]))
    context_len = features.shape[1]
    block_ids = block_input_ids(input_ids, anchors, block, module.drafter.config.mask_token_id, given)
    noise = module.target.get_input_embeddings()(block_ids)
    hidden = module.drafter(noise, features, block_position_ids(context_len, anchors, block),
                            attention_mask=flex_block_mask(anchors, context_len, block))
    return hidden[:, : num_blocks * block]


def test_flex_shapes_are_a_few_fixed_widths_and_the_anchor_count():
    features = torch.randn(2, 31, 5)
    padded, anchors = pad_for_flex(features, torch.tensor([[3, 9], [4, 0]]), NUM_ANCHORS)
    assert padded.shape == (2, FLEX_MIN_CONTEXT, 5) and torch.equal(padded[:, :31], features)
    assert not padded[:, 31:].any()
    assert anchors.tolist() == [[3, 9, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]]  # anchor 0: a block that sees only itself
    widths = {length: pad_for_flex(torch.zeros(1, length, 1), anchors[:1], NUM_ANCHORS)[0].shape[1]
              for length in (1, FLEX_MIN_CONTEXT, FLEX_MIN_CONTEXT + 1, 3072)}
    assert widths == {1: FLEX_MIN_CONTEXT, FLEX_MIN_CONTEXT: FLEX_MIN_CONTEXT, FLEX_MIN_CONTEXT + 1: 2 * FLEX_MIN_CONTEXT,
                      3072: 4096}


def test_the_longest_recipe_pads_to_fewer_widths_than_dynamo_compiles():
    """Each width compiles a kernel with gradients (training) and one without (validation), and a smaller last batch
    one more. Past torch._dynamo.config.recompile_limit dynamo stops compiling and flex attention materialises every
    score: a smaller FLEX_MIN_CONTEXT would cross it at max_length 3072 (512, 1024, 2048, 4096: 8 kernels)."""
    longest = max(yaml.safe_load(path.read_text())["data"]["max_length"] for path in RECIPES_DIR.glob("*.yaml"))
    one_anchor = torch.zeros(1, 1, dtype=torch.long)
    widths = {pad_for_flex(torch.zeros(1, length, 1), one_anchor, 1)[0].shape[1] for length in range(1, longest + 1)}
    assert 2 * len(widths) < torch._dynamo.config.recompile_limit, sorted(widths)


def test_flex_block_mask_keeps_the_tiles_of_every_sequence():
    """Flex attention skips the tiles its BlockMask leaves out and never asks mask_mod about them. A mask built for one
    sequence and broadcast over the batch would drop the context tiles that only a later sequence reads: its blocks
    would train without their context on CUDA, while small CPU batches, all in one tile, still agree with SDPA."""
    anchors, context_len, block = torch.tensor([[3, 9, 100], [300, 301, 450]]), 512, 4  # row 1 reads tiles 1-3
    flex = flex_block_mask(anchors, context_len, block)
    dense = dense_block_mask(anchors, context_len, block)  # (S, 1, Q, K)
    q_tile, kv_tile = flex.BLOCK_SIZE
    sequences, _, queries, keys = dense.shape
    dense = F.pad(dense, (0, -keys % kv_tile, 0, -queries % q_tile))  # whole tiles
    tiles = (sequences, 1, dense.shape[2] // q_tile, q_tile, dense.shape[3] // kv_tile, kv_tile)
    touched = dense.view(tiles).any(dim=(3, 5))  # (S, 1, query tiles, key tiles)
    assert touched[0].sum() < touched[1].sum()  # the case under test: the rows read different tiles
    assert torch.equal(flex.to_dense().bool(), touched)


@torch.no_grad()
def test_compiled_flex_on_cpu_compiles_once_per_width_and_equals_the_dense_mask():
    """The padded flex path of `block_hidden_states`, forward only, against its dense path on the same batch."""
    module = tiny_module().eval()

    def check(batch):
        input_ids, anchors = batch_of(*batch)
        features = target_layer_features(module.target, input_ids, module.target_layer_ids)
        dense = module.block_hidden_states(features, input_ids, anchors)  # the CPU path: SDPA, dense mask
        torch.testing.assert_close(flex_hidden(module, features, input_ids, anchors), dense, atol=1e-5, rtol=1e-5)
        return anchors.shape[1]

    for batch in BATCHES[:4]:  # warm-up: both widths seen
        check(batch)
    compiled = graphs_compiled()
    with torch._dynamo.config.patch(error_on_recompile=True):
        anchor_counts = {check(batch) for batch in BATCHES}
    assert graphs_compiled() == compiled
    assert len(anchor_counts) > 1  # the anchor count changed too, and the kernel did not see it


@torch.no_grad()
def test_compiled_flex_on_cpu_equals_the_dense_mask_at_an_odd_block_size_with_given_tokens():
    """Block size 5 and 7 anchors (35 queries: no power of two), a batch with invalid slots and one with fewer blocks
    than the padded count, some blocks given their first draft token (model.redraft_prob)."""
    block, num_anchors, length = 5, 7, 37
    module = tiny_module(block, num_anchors).eval()
    generator = torch.Generator().manual_seed(3)
    # reply spans of three rows: 32 anchor candidates, 4 and 2; then 4, 1 and 2 (n = 4 blocks, 3 padding blocks)
    for replies in ([(4, length), (31, 36), (10, 13)], [(30, 35), (20, 22), (10, 13)]):
        input_ids = torch.randint(100, 40000, (3, length), generator=generator)
        loss_mask = torch.zeros(3, length, dtype=torch.bool)
        for row, (start, end) in enumerate(replies):
            loss_mask[row, start:end] = True
        anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
        given = sample_given(anchors, 0.5, generator)
        assert not valid.all() and (given * valid).any() and not given.all()
        features = target_layer_features(module.target, input_ids, module.target_layer_ids)
        dense = module.block_hidden_states(features, input_ids, anchors, given)  # the CPU path: SDPA, dense mask
        flex = flex_hidden(module, features, input_ids, anchors, given)
        torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- CUDA


@pytest.fixture(scope="module")
def cuda_module() -> DistillModule:
    return tiny_module().to("cuda")


@needs_cuda
def test_training_path_on_cuda_never_recompiles_and_equals_the_dense_mask(cuda_module):
    """block_hidden_states' flex path, forward and backward, batch after batch of other lengths."""
    module = cuda_module.train()

    def step(batch):
        input_ids, anchors = batch_of(*batch, device="cuda")
        features = target_layer_features(module.target, input_ids, module.target_layer_ids)
        hidden = module.block_hidden_states(features, input_ids, anchors)  # flex: padded, compiled
        hidden.square().mean().backward()
        with torch.no_grad():  # the same blocks under the dense mask (SDPA), unpadded
            context_len = input_ids.shape[1]
            noise = module.target.get_input_embeddings()(
                block_input_ids(input_ids, anchors, BLOCK, module.drafter.config.mask_token_id))
            dense = module.drafter(noise, features, block_position_ids(context_len, anchors, BLOCK),
                                   attention_mask=dense_block_mask(anchors, context_len, BLOCK))
        torch.testing.assert_close(hidden.detach(), dense, atol=1e-4, rtol=1e-4)
        module.drafter.zero_grad(set_to_none=True)

    for batch in BATCHES[:4]:
        step(batch)
    compiled = graphs_compiled()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in BATCHES:
            step(batch)
    assert graphs_compiled() == compiled


@needs_cuda
def test_flex_on_cuda_never_holds_a_dense_mask_or_dense_scores():
    """Peak memory of building the mask and of attention forward + backward stays far below their dense sizes."""
    from ddtree.modeling_dflash import _attention

    num_blocks, block, context_len, heads, head_dim = 256, 16, 1024, 8, 64
    queries, keys = num_blocks * block, context_len + num_blocks * block
    anchors = torch.sort(torch.randint(1, context_len, (1, num_blocks), device="cuda"), dim=1).values
    flex_block_mask(anchors, context_len, block)  # warm-up: compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mask = flex_block_mask(anchors, context_len, block)
    assert torch.cuda.max_memory_allocated() - before < queries * keys // 8  # the dense bool mask: queries * keys bytes

    q = torch.randn(1, heads, queries, head_dim, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, heads // 2, keys, head_dim, device="cuda", requires_grad=True) for _ in range(2))
    _attention(q, k, v, mask, head_dim**-0.5).sum().backward()  # warm-up: compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _attention(q, k, v, mask, head_dim**-0.5).sum().backward()
    assert torch.cuda.max_memory_allocated() - before < heads * queries * keys * 4 // 8  # fp32 scores of every head


@needs_cuda
def test_train_inference_parity_in_bf16_on_cuda(cuda_module):
    """Each block of the bf16 training forward (flex) matches a plain decoding call (SDPA, no mask).

    The tolerance is set by what it must catch: the same call with one context row too many (the
    anchor's own features, the classic off-by-one) moves the output many times further. A failure also
    reports how far the flex forward lies from the same blocks under the dense mask, to tell which side
    is off: on an H200 with torch 2.11 it was the flex side, by 2.0 in every block, when inductor ran its
    flex-decoding kernel for these 24 gradient-free queries (ddtree/modeling_dflash.py, FLEX_KERNEL_OPTIONS).
    """
    module = cuda_module.eval()
    input_ids, anchors = batch_of(48, 5, 7, device="cuda")
    input_ids, anchors = input_ids[:1], anchors[:1]
    mask_id = module.drafter.config.mask_token_id
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        features = target_layer_features(module.target, input_ids, module.target_layer_ids)
        training = module.block_hidden_states(features, input_ids, anchors).float().view(anchors.shape[1], BLOCK, -1)
        noise = module.target.get_input_embeddings()(block_input_ids(input_ids, anchors, BLOCK, mask_id))
        dense = module.drafter(noise, features, block_position_ids(input_ids.shape[1], anchors, BLOCK),
                               attention_mask=dense_block_mask(anchors, input_ids.shape[1], BLOCK))
        flex_vs_dense = (training - dense.float().view_as(training)).abs().max().item()

        def inference(anchor: int, cut: int):
            block = torch.full((1, BLOCK), mask_id, device="cuda")
            block[0, 0] = input_ids[0, anchor]
            positions = torch.cat([torch.arange(cut), anchor + torch.arange(BLOCK)])[None].cuda()
            noise = module.target.get_input_embeddings()(block)
            return module.drafter(noise, features[:, :cut], positions, attention_mask=None).float()[0]

        for i, anchor in enumerate(anchors[0].tolist()):
            error = (training[i] - inference(anchor, anchor)).abs().max()
            leak = (training[i] - inference(anchor, anchor + 1)).abs().max()
            assert error < 0.1 and error < leak / 4, (anchor, error.item(), leak.item(), flex_vs_dense)
