"""Training loss and metrics of the block-diffusion drafter, as small standalone functions.

    weights = block_position_weights(block_size, gamma)                       # (B,)
    weighted, total, hits, tokens = block_loss_sums(hidden, labels, lm_head, weights)
    loss = weighted / total                                                   # what DistillModule trains

A block is [anchor, MASK x (B-1)]; its output at block position k (k = 1..B-1) predicts the data
token at anchor_position + k, and the anchor itself (k = 0) is never in the loss. The per-token
functions take only the block tokens that are counted, flattened over all blocks of the batch:

    logits (M, V), labels (M,), block_positions (M,) in 1..B-1

so `block_loss_sums` computes LM-head logits for those M rows only (an LM head over a 49K-150K
vocabulary is the drafter's largest matmul; anchors and ignored tokens would waste it), possibly in
chunks, normalising once over the batch with the two sums the functions return.

Reference: DFlash (arXiv 2602.06036), training appendix: cross-entropy on block positions
k = 1..B-1 weighted w_k = exp(-(k - 1) / gamma), gamma = 7 for B = 16 (5 for B = 10, 4 for B = 8);
decayed weights beat uniform ones.

Distillation (model.distill_weight, off in every recipe): the data-token cross-entropy is mixed
with a cross-entropy against the target's whole next-token distribution at the same position
(`teacher_states`, `decayed_soft_cross_entropy_sums`). At distill_weight 0 none of it runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .masks import IGNORE_INDEX, block_position_ids


def block_position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """(B,) loss weight per block position: 0 for the anchor, exp(-(k - 1) / gamma) for k = 1..B-1.

    Early positions weigh most because a draft is accepted left to right: a miss at position k
    wastes every later position, so position 1 is worth more than position 15.
    """
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def decayed_cross_entropy_sums(
    logits: torch.Tensor,  # (M, V) counted block tokens
    labels: torch.Tensor,  # (M,) the data token each one predicts
    block_positions: torch.Tensor,  # (M,) long, k in 1..B-1
    weights: torch.Tensor,  # (B,) from block_position_weights
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_i w_{k_i} * CE_i, sum_i w_{k_i}): the decayed loss is their ratio.

    Two sums instead of a mean so chunks of one batch can be added up and normalised once.
    The cross-entropy is taken in fp32 whatever the logits' dtype (bf16 log-softmax over a large
    vocabulary loses the small probabilities the loss is made of).
    """
    token_ce = F.cross_entropy(logits.float(), labels, reduction="none")  # (M,)
    token_weight = weights[block_positions]  # (M,)
    return (token_ce * token_weight).sum(), token_weight.sum()


def decayed_soft_cross_entropy_sums(
    logits: torch.Tensor,  # (M, V) drafter logits of the counted block tokens
    teacher_logits: torch.Tensor,  # (M, V) the target's logits for the same next tokens (no grad)
    block_positions: torch.Tensor,  # (M,) long, k in 1..B-1
    weights: torch.Tensor,  # (B,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like decayed_cross_entropy_sums, against the target's whole next-token distribution.

    -sum_v p_target(v) log q(v) = KL(p_target || q) + H(p_target): the same gradient as the KL, one
    number per token instead of one hit or miss, and it teaches the runner-up tokens a draft tree
    branches on. Not part of the published recipe (it uses data-token CE only); see `distill_weight`.
    """
    teacher = F.softmax(teacher_logits.float(), dim=-1)
    token_ce = -(teacher * F.log_softmax(logits.float(), dim=-1)).sum(dim=-1)  # (M,)
    token_weight = weights[block_positions]
    return (token_ce * token_weight).sum(), token_weight.sum()


def position_hit_counts(
    logits: torch.Tensor,  # (M, V)
    labels: torch.Tensor,  # (M,)
    block_positions: torch.Tensor,  # (M,)
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block position: (top-1 hits, counted tokens), each (B,) long; position 0 stays 0."""
    hits = (logits.argmax(dim=-1) == labels).long()  # (M,)
    hit_counts = torch.zeros(block_size, dtype=torch.long, device=labels.device)
    token_counts = torch.zeros(block_size, dtype=torch.long, device=labels.device)
    hit_counts.index_add_(0, block_positions, hits)
    token_counts.index_add_(0, block_positions, torch.ones_like(hits))
    return hit_counts, token_counts


def chain_acceptance(position_accuracy: torch.Tensor) -> torch.Tensor:
    """Mean accepted length a greedy chain draft would get, bonus token included: a scalar.

    position_accuracy: (B - 1,) top-1 accuracy at block positions 1..B-1. If position k were
    accepted independently with its accuracy, it would survive with prod_{i<=k} acc_i, so
    tau = 1 + sum_k prod_{i<=k} acc_i (the 1 is the target's bonus token). Real drafts are
    correlated (right at k makes right at k+1 likelier), so this is a guide, not the served tau.
    """
    return 1.0 + torch.cumprod(position_accuracy.float(), dim=0).sum()


def teacher_states(final_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The target's final hidden state where it predicted each block token's label: (S, n*B, H).

    final_hidden (S, T, H), anchors (S, n). Block token k of anchor a is labelled with the token at
    a + k, which the target predicted at position a + k - 1. Positions past the sequence are
    clamped (their labels are ignored anyway).
    """
    before_label = (block_position_ids(0, anchors, block_size) - 1).clamp(0, final_hidden.shape[1] - 1)  # (S, n*B)
    return final_hidden.gather(1, before_label[:, :, None].expand(-1, -1, final_hidden.shape[-1]))


def block_loss_sums(
    hidden: torch.Tensor,  # (S, n*B, H) drafter outputs for every block token
    labels: torch.Tensor,  # (S, n, B) the data token each one predicts, IGNORE_INDEX where none is counted
    lm_head: nn.Module,  # the target's frozen output projection, H -> V
    weights: torch.Tensor,  # (B,) from block_position_weights
    chunk_size: int | None = None,
    teacher_hidden: torch.Tensor | None = None,  # (S, n*B, H) from teacher_states; only with distill_weight > 0
    distill_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of w * loss, sum of w, hits (B,), tokens (B,)) over the M counted block tokens of a batch.

    Only the M counted rows of `hidden` go through the LM head. With `chunk_size`, at most that many
    rows at a time, each chunk recomputed in backward (activation checkpointing), so only one chunk's
    (m, V) logits are alive at once: (M, V) logits over a 150K vocabulary would not fit.
    With distill_weight a > 0 the loss per token is (1 - a) * CE(label) + a * CE(target's distribution).
    """
    block_size = weights.shape[0]
    flat_labels = labels.flatten()  # (S*n*B,)
    counted = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
    rows = hidden.flatten(0, 1)[counted]  # (M, H)
    # (M, H), or (M, 0): checkpoint() takes tensors only, and an empty one costs nothing
    teacher_rows = teacher_hidden.flatten(0, 1)[counted] if distill_weight > 0 else rows[:, :0]
    targets = flat_labels[counted]  # (M,)
    positions = counted % block_size  # (M,) block position k of each row

    def chunk_terms(chunk_rows, chunk_teacher, chunk_targets, chunk_positions):
        logits = lm_head(chunk_rows).float()  # (m, V); one fp32 copy serves the loss and the argmax
        weighted, weight_total = decayed_cross_entropy_sums(logits, chunk_targets, chunk_positions, weights)
        if distill_weight > 0:
            with torch.no_grad():
                teacher_logits = lm_head(chunk_teacher)  # (m, V)
            soft, _ = decayed_soft_cross_entropy_sums(logits, teacher_logits, chunk_positions, weights)
            weighted = (1 - distill_weight) * weighted + distill_weight * soft
        hits, tokens = position_hit_counts(logits.detach(), chunk_targets, chunk_positions, block_size)
        return weighted, weight_total, hits, tokens

    chunk = chunk_size or max(1, rows.shape[0])
    totals = None
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        args = (rows[part], teacher_rows[part], targets[part], positions[part])
        if chunk_size and torch.is_grad_enabled():
            terms = checkpoint(chunk_terms, *args, use_reentrant=False)
        else:
            terms = chunk_terms(*args)
        totals = terms if totals is None else tuple(a + b for a, b in zip(totals, terms))
    return totals
