"""Random anchors and the sparse attention mask that trains all blocks of a sequence in ONE forward.

For a batch of S sequences of T tokens, n anchors per sequence and block size B:

    queries = the n*B block tokens, block b = [token at anchor_b, MASK x (B-1)]
    keys    = [target context (T positions) ; all n*B block tokens]

Block b sees the context positions strictly before its anchor and its own B tokens
(bidirectionally), never another block. This is exactly what one inference round sees: the target
features of every committed token except the newest (the anchor, fed as the block's first token).
Positions (for RoPE): context j at j; block token k of anchor a at a + k.

On CPU the mask is a dense bool tensor for SDPA; on CUDA it is a flex-attention BlockMask built
from `block_mask_mod`, which the tests check against the dense mask on CPU index grids. The flex
path runs at fixed shapes (`pad_for_flex`), so one compiled kernel serves every batch.

Reference: DFlash (arXiv 2602.06036), training appendix (random anchors among response tokens,
all blocks of a sequence in one forward under a sparse mask).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

# Label of a block position with nothing to predict (anchor, past the end, outside the reply).
IGNORE_INDEX = -100


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """(S, T) bool: positions that may open a block.

    An anchor is a supervised token whose next token is supervised too, so the block has at least
    one label. At inference the anchor is the newest token the target produced, i.e. always a reply
    token, and it always has context before it (hence position 0 is excluded).
    Anchors near the end of a reply are kept even though their block runs past it (the missing
    labels are ignored): the last tokens of every reply, end-of-turn included, are exactly what the
    drafter must learn to propose at short range, and requiring a full block would never train
    block position 1 on them.
    """
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, 1:-1] = loss_mask[:, 1:-1] & loss_mask[:, 2:]
    return candidates


def sample_anchors(
    loss_mask: torch.Tensor,  # (S, T) bool, True on supervised (assistant) tokens
    num_anchors: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` distinct anchors per sequence, uniformly among its candidates.

    Returns anchors (S, n) long, ascending within each sequence, and valid (S, n) bool, with
    n = min(num_anchors, most candidates in any sequence). A sequence with fewer candidates gets
    invalid slots at the end (anchor 0, no labels) so the batch stays rectangular.
    The generator lives on the CPU and is seeded per step by the caller, so anchors are redrawn
    every step and every epoch yet reproduce exactly on resume.
    """
    candidates = anchor_candidates(loss_mask)
    num_sequences, length = candidates.shape
    n = min(num_anchors, int(candidates.sum(dim=1).max()))
    # Random scores, non-candidates forced last: the top n scores are a uniform sample without replacement.
    scores = torch.rand(num_sequences, length, generator=generator).to(loss_mask.device)
    scores = scores.masked_fill(~candidates, -1.0)
    top_scores, top_positions = scores.topk(n, dim=1)  # (S, n)
    valid = top_scores >= 0
    # Ascending anchors keep neighbouring blocks' context rows together (denser flex-attention tiles).
    sort_key = torch.where(valid, top_positions, length)
    sort_key, order = sort_key.sort(dim=1)
    valid = valid.gather(1, order)
    anchors = torch.where(valid, sort_key, 0)
    return anchors, valid


def block_labels(
    input_ids: torch.Tensor,  # (S, T)
    loss_mask: torch.Tensor,  # (S, T) bool
    anchors: torch.Tensor,  # (S, n)
    valid: torch.Tensor,  # (S, n) bool
    block_size: int,
) -> torch.Tensor:
    """(S, n, B) long: block position k of anchor a is labelled with the token at a + k, else IGNORE_INDEX.

    Ignored: k = 0 (the anchor is given), positions past the sequence, invalid anchors, and every
    position from the first unsupervised token on. The drafter is only ever asked to continue the
    target's own reply, which ends at its end-of-turn token; what follows (padding, a next user
    turn) is text the target did not write and a draft never has to reach across.
    """
    length = input_ids.shape[1]
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # (S, n, B)
    inside = positions < length
    flat = positions.clamp(max=length - 1).flatten(1)  # (S, n*B)
    tokens = input_ids.gather(1, flat).view_as(positions)
    supervised = loss_mask.gather(1, flat).view_as(positions) & inside
    # Keep only the unbroken supervised run that starts at the anchor.
    in_reply = torch.cumprod(supervised.long(), dim=2).bool() & valid[:, :, None]
    in_reply[:, :, 0] = False
    return torch.where(in_reply, tokens, IGNORE_INDEX)


def block_input_ids(
    input_ids: torch.Tensor,  # (S, T)
    anchors: torch.Tensor,  # (S, n)
    block_size: int,
    mask_token_id: int,
    given: torch.Tensor | None = None,  # (S, n) long: tokens after the anchor each block is given; None = 0
) -> torch.Tensor:
    """(S, n*B) long: every block is [token at its anchor, MASK x (B-1)], or with `given` g > 0,
    [the tokens at anchor .. anchor + g, MASK x (B-1-g)]: the block the decoder re-drafts behind g draft
    tokens it already holds (`--redraft`, ddtree/decoding.py). Given positions are not labelled (`given_labels`).
    """
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # (S, n, B)
    tokens = input_ids.gather(1, positions.clamp(max=input_ids.shape[1] - 1).flatten(1)).view_as(positions)
    kept = 1 if given is None else 1 + given[:, :, None]  # block positions below this hold real tokens
    blocks = torch.where(torch.arange(block_size, device=anchors.device) < kept, tokens, mask_token_id)
    return blocks.flatten(1)


def given_labels(labels: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """labels (S, n, B) with the `given` (S, n) positions after each anchor ignored: the drafter reads them."""
    block_size = labels.shape[-1]
    read = torch.arange(block_size, device=labels.device) <= given[:, :, None]
    return labels.masked_fill(read, IGNORE_INDEX)


def sample_given(anchors: torch.Tensor, probability: float, generator: torch.Generator) -> torch.Tensor | None:
    """(S, n) long: 1 for a random `probability` share of the blocks, else 0; None when probability is 0.

    A block given its first draft token learns the rest of the block conditioned on it: what the decoder
    asks when it re-drafts under each of its best depth-1 candidates (`--redraft`).
    """
    if probability <= 0:
        return None
    draw = torch.rand(anchors.shape, generator=generator).to(anchors.device)
    return (draw < probability).long()


def block_position_ids(context_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(S, T + n*B) long: context positions 0..T-1, then a + k for block token k of anchor a."""
    num_sequences = anchors.shape[0]
    context = torch.arange(context_len, device=anchors.device).expand(num_sequences, -1)
    blocks = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).flatten(1)
    return torch.cat([context, blocks], dim=1)


def block_mask_mod(anchors: torch.Tensor, context_len: int, block_size: int):
    """The mask as a flex-attention mask_mod(b, h, q_idx, kv_idx) -> bool (True = attend).

    q_idx indexes the n*B block tokens; kv_idx indexes [context (T) ; blocks (n*B)].
    Works on scalars (flex attention's vmap) and on broadcast index grids alike.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        sees_context = kv_idx < anchors[b, q_block]  # anchor <= T-1, so this is context only
        same_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == q_block)
        return sees_context | same_block

    return mask_mod


def dense_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """(S, 1, n*B, T + n*B) bool mask for SDPA, True = attend. Same rule as `block_mask_mod`."""
    num_sequences, num_blocks = anchors.shape
    q_block = torch.arange(num_blocks * block_size, device=anchors.device) // block_size  # (Q,)
    q_anchor = anchors[:, q_block]  # (S, Q)
    sees_context = torch.arange(context_len, device=anchors.device) < q_anchor[:, :, None]  # (S, Q, T)
    same_block = (q_block[:, None] == q_block[None, :]).expand(num_sequences, -1, -1)  # (S, Q, Q)
    return torch.cat([sees_context, same_block], dim=2)[:, None]


# The compiled flex kernel and its mask are built for fixed shapes (see ddtree/modeling_dflash.py,
# `_compiled_flex_attention`, for why): the context is padded to a power of two of at least this many
# positions, so a recipe's max_length 3072 gives three widths (1024, 2048, 4096). Padded context rows
# cost only their fc and key/value projections, at most ~2% of the drafter's matmul FLOPs at the
# qwen3-8b recipe's shapes (2047 padded rows next to 512 x 16 block rows; arithmetic, not measured):
# no block attends them, and flex attention skips the tiles they fill. Each width compiles once with
# gradients (training) and once without (validation): 6 kernels at most for max_length 3072, under
# dynamo's limit of 8 per function, plus one per smaller last batch (never at batch size 1).
FLEX_MIN_CONTEXT = 1024


def pad_for_flex(
    features: torch.Tensor,  # (S, T, K*H)
    anchors: torch.Tensor,  # (S, n), n <= num_anchors
    num_anchors: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (S, W, K*H), zero-padded to the flex context width W, and anchors (S, num_anchors).

    The extra anchors are 0: such a block sees no context, only itself, so the real blocks' outputs
    do not change; the caller keeps the first n blocks of the drafter's output.
    """
    length = features.shape[1]
    width = max(FLEX_MIN_CONTEXT, 1 << (length - 1).bit_length())
    features = F.pad(features, (0, 0, 0, width - length))
    anchors = F.pad(anchors, (0, num_anchors - anchors.shape[1]))
    return features, anchors


_COMPILED_CREATE_BLOCK_MASK = None


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int):
    """A flex-attention BlockMask of the same rule: tiles no block touches are skipped.

    On CUDA it is built by a compiled create_block_mask, which never holds the dense
    (S, n*B, T + n*B) mask the eager one materialises; like the kernel, it compiles once per shape.
    On CPU (tests only: flex attention has no CPU backward) it is built eagerly, as torch 2.13's
    CPU inductor fails to compile it for some shapes (a C++ error, e.g. 12 queries x 36 keys).
    """
    global _COMPILED_CREATE_BLOCK_MASK
    from torch.nn.attention.flex_attention import create_block_mask

    if _COMPILED_CREATE_BLOCK_MASK is None:
        _COMPILED_CREATE_BLOCK_MASK = torch.compile(create_block_mask, dynamic=False)
    num_sequences, num_blocks = anchors.shape
    create = _COMPILED_CREATE_BLOCK_MASK if anchors.is_cuda else create_block_mask
    return create(
        block_mask_mod(anchors, context_len, block_size),
        B=num_sequences,
        H=None,  # same mask for every head
        Q_LEN=num_blocks * block_size,
        KV_LEN=context_len + num_blocks * block_size,
        device=anchors.device,
    )
