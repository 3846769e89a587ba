"""Training loss and metrics of the block-diffusion drafter, as small standalone functions.

A block is [anchor, MASK x (B-1)]; its output at block position k (k = 1..B-1) predicts the data
token at anchor_position + k, and the anchor itself (k = 0) is never in the loss. The functions
take only the block tokens that are counted, flattened over all blocks of the batch:

    logits (M, V), labels (M,), block_positions (M,) in 1..B-1

so a caller computes LM-head logits for those M rows only (an LM head over a 49K-150K vocabulary
is the drafter's largest matmul; anchors and ignored tokens would waste it) and may split the rows
into chunks, normalising once over the batch with the two sums returned below.

Reference: DFlash (arXiv 2602.06036), training appendix: cross-entropy on block positions
k = 1..B-1 weighted w_k = exp(-(k - 1) / gamma), gamma = 7 for B = 16 (5 for B = 10, 4 for B = 8);
decayed weights beat uniform ones.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


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


def decayed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, block_positions: torch.Tensor, block_size: int, gamma: float
) -> torch.Tensor:
    """Position-decayed cross-entropy (DFlash): sum_i w_{k_i} CE_i / sum_i w_{k_i}, a scalar."""
    weights = block_position_weights(block_size, gamma, device=logits.device)
    weighted_sum, weight_total = decayed_cross_entropy_sums(logits, labels, block_positions, weights)
    return weighted_sum / weight_total.clamp_min(1e-8)


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
