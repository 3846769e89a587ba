"""Training loss and metrics of the block-diffusion drafter, as small standalone functions.

    weights = block_position_weights(block_size, gamma)                       # (B,)
    weighted, total, hits, tokens, top_hits = block_loss_sums(hidden, labels, lm_head, weights, objective="tree")
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

Distillation (model.distill_weight): the data-token cross-entropy is mixed with a loss against the
target's whole next-token distribution p at the same position (`teacher_states`; the softmax of the logits its forward
gives, training.target.target_logits), model.distill_loss:
  kl  -sum_v p(v) log q(v) = KL(p || q) + H(p), the KL's gradient, which also teaches the runner-up
      tokens a draft tree branches on;
  lk  -log sum_v min(p(v), q(v)), minus the log of the acceptance rate of a draft sampled from q
      against p (the LK losses, arXiv 2602.23881): it optimises acceptance itself.
At distill_weight 0 none of it runs.

Objectives (model.objective, `block_loss_sums`): the published decayed cross-entropy, D-PACE's
expected-length weights, `tree`, the same weights with a draft tree's survival rule, and `frontier`,
the slope of a soft count of the label prefixes inside the drafter's own best-first tree.

Calibration (model.calibrate) fits draft temperatures on replayed decoding rounds: training/replay.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .masks import IGNORE_INDEX, block_position_ids
from .target import target_logits


PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}  # DFlash's loss decay per block size


def published_gamma(block_size: int) -> float:
    """The loss decay DFlash published for a block size (4 for 8, 5 for 10, 7 for 16), and for another size the value
    on the line through the two nearest of those (block / 2 up to 10, 5 + (block - 10) / 3 above)."""
    if block_size in PUBLISHED_GAMMA:
        return PUBLISHED_GAMMA[block_size]
    return block_size / 2 if block_size <= 10 else 5.0 + (block_size - 10) / 3


def block_position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """(B,) loss weight per block position: 0 for the anchor, exp(-(k - 1) / gamma) for k = 1..B-1.

    Early positions weigh most because a draft is accepted left to right: a miss at position k
    wastes every later position, so position 1 is worth more than position 15.
    """
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def position_counts(flags: torch.Tensor, block_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B,) long: how many of the M rows at each block position have their flag set; flags (M,) bool, block_positions (M,)."""
    counts = torch.zeros(block_size, dtype=torch.long, device=flags.device)
    return counts.index_add_(0, block_positions, flags.long())


def top_entries(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((m, k) values, (m, k) indices) of the k largest entries of each row of scores (m, V), in no set order:
    torch.topk's, faster.

    A CPU's topk over a whole vocabulary row is slow (about 9 ms for 448 rows of 8192 at k = 32 on 2 Xeon cores),
    so the row is pruned first. Seen as `r` strided slices (m, r, V / r), column j's maximum over the slices is
    an element of that column, and every value of it is at most that maximum: a value outside the k columns with
    the largest maxima is below k distinct elements, so the k largest values all lie in those k columns, k * r
    candidates (ties included: the candidates' k largest values are the row's). Pruned while that halves the row;
    about 3 ms in all for that case.
    """
    indices = None  # (m, width) the original column of each candidate; None: the identity
    while True:
        width = scores.shape[1]
        slices = next((r for r in (32, 16, 8, 4, 2) if width % r == 0 and width // r >= 2 * k), None)
        if slices is None or 2 * k * slices > width:
            values, picked = scores.topk(k, dim=1, sorted=False)
            return values, picked if indices is None else indices.gather(1, picked)
        grid = scores.reshape(scores.shape[0], slices, width // slices)  # (m, r, V / r)
        columns = grid.amax(dim=1).topk(k, dim=1, sorted=False).indices[:, None, :].expand(-1, slices, -1)  # (m, r, k)
        scores = grid.gather(2, columns).flatten(1)  # (m, r * k)
        if indices is None:
            offsets = torch.arange(slices, device=columns.device)[None, :, None] * (width // slices)
            indices = (offsets + columns).flatten(1)
        else:
            indices = indices.reshape(grid.shape).gather(2, columns).flatten(1)


def next_token_top_k(final_hidden: torch.Tensor, lm_head: nn.Module, k: int, *, target_config,
                     rows_per_chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's k likeliest next tokens after each position: ((..., k) ids, (..., k) fp32 log-probabilities), unordered
    (all V tokens if k > V).

    final_hidden (..., H), the target's final normed hidden states; lm_head its LM head over the whole vocabulary;
    target_config the target's model.config, whose family may transform the head's output (training.target.target_logits:
    Gemma-2's softcap, Granite's scale), None for none: the log-probabilities are those of the target's own logits.
    What a distillation store keeps (model.distill_top_k; training/feature_store.py), and online training computes
    alike. In chunks of rows: (rows, V) fp32 logits of a 150K vocabulary are 0.6 GB per 1024 rows.
    The log-normaliser is logsumexp's own sum, shifted by the row's maximum (one of its top k), computed in place
    on the logits: torch.logsumexp allocates its own (rows, V) temporaries, and on a CPU their first touch cost
    more than the exponentials (122 ms against 41 for 1024 rows of 49152 on a 2-core AVX2 EPYC).
    """
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    ids, log_probs = [], []
    with torch.no_grad():
        for start in range(0, max(1, flat.shape[0]), rows_per_chunk):
            logits = lm_head(flat[start:start + rows_per_chunk]).float()  # (r, V), a tensor of this loop's own
            logits = target_logits(logits, target_config)  # the target's own logits (in place)
            values, chunk_ids = top_entries(logits, min(k, logits.shape[1]))  # k above V: all V
            peak = values.amax(dim=1, keepdim=True)  # (r, 1) the row's maximum
            log_norm = logits.sub_(peak).exp_().sum(dim=1, keepdim=True).log_().add_(peak)  # logits are spent here
            ids.append(chunk_ids)
            log_probs.append(values - log_norm)
    shape = (*final_hidden.shape[:-1], ids[0].shape[1])
    return torch.cat(ids).view(shape), torch.cat(log_probs).view(shape)


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


def draft_vocab_labels(labels: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Labels as indices into a draft vocabulary (token_ids (V',) of a vocab_size vocabulary): same shape as labels.

    A label outside the draft vocabulary becomes IGNORE_INDEX: the drafter can never propose it, so it
    is left out of the loss and the metrics (validation adds it back to its token counts as a miss:
    DistillModule.shared_step), and (for dpace, tree and frontier) ends its block's chain,
    given the block's read positions from before this mapping (block_loss_sums' `read`).
    """
    lookup = torch.full((vocab_size,), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    lookup[token_ids] = torch.arange(token_ids.shape[0], dtype=labels.dtype, device=labels.device)
    return torch.where(labels == IGNORE_INDEX, labels, lookup[labels.clamp_min(0)])


OBJECTIVES = ("decayed_ce", "dpace", "tree", "frontier", "intree")
# The objectives that read each loss setting of the model (block_loss_sums); the others leave it unused
OBJECTIVE_SETTINGS = {"gamma": ("decayed_ce", "frontier"),
                      "objective_smoothing": ("dpace", "tree", "frontier", "intree"),
                      "objective_top_k": ("tree",), "objective_budget": ("frontier", "intree")}
DISTILL_LOSSES = ("kl", "lk")
RECALL_K = 4  # the k of the top-k recall metric (and the default tree survival width)


def given_positions(counted: torch.Tensor) -> torch.Tensor:
    """(..., B) bool: the positions before each block's first label, which the drafter reads instead of drafting (the
    anchor, and a re-draft block's given first token, model.redraft_prob); counted (..., B) bool.

    Read from the data's labels, before a draft vocabulary drops some: a dropped first label would read as
    given (block_loss_sums' `read`)."""
    return counted.long().cumsum(dim=-1) == 0


def expected_length_weights(
    survival: torch.Tensor,  # (N, B) detached per-position survival in [0, 1]; position 0 (anchor) ignored
    counted: torch.Tensor,  # (N, B) bool, the positions with a label
    smoothing: float,
    read: torch.Tensor | None = None,  # (N, B) bool, the given positions; None: given_positions(counted)
) -> torch.Tensor:
    """(N, B) weights sum_{j >= k} prod_{i <= j} s_i with s = (1 - a) * survival + a, 0 where not counted.

    sum_j prod_{i<=j} s_i is a block's expected accepted length when position i survives with s_i;
    its derivative with respect to log s_k is the suffix sum from k, so weighting position k's loss by
    it spends the gradient where accepted length is won (D-PACE, arXiv 2605.18810). A position
    without a label after one with a label ends the chain: nothing after it can be accepted. Positions
    without a label before the first one with a label are given (the anchor, and a re-draft block's given
    first token, model.redraft_prob): they survive with 1, so the block's drafted tokens keep their weights.
    """
    given = given_positions(counted) if read is None else read
    s = torch.where(counted, (1 - smoothing) * survival + smoothing, given.to(survival.dtype))
    prefix = torch.cumprod(s, dim=1)
    prefix = prefix.masked_fill(given, 0.0)  # a given token is not an accepted draft token
    suffix = prefix.flip(1).cumsum(1).flip(1)  # (N, B): sum over j >= k
    return torch.where(counted, suffix, torch.zeros_like(suffix))


FRONTIER_SCALE = 1.0  # frontier: nats of path log-probability over which a prefix enters the tree (the sigmoid's width)


def tree_thresholds(top_log_probs: torch.Tensor, drafted: torch.Tensor, budget: int) -> torch.Tensor:
    """(N,) the path log-probability of the budget-th best node of each block's best-first draft tree.

    top_log_probs (N, B, K): the drafter's K best log-probabilities at every block position (K = budget,
    or the vocabulary if smaller); -inf where a position has none (past the data), and [0, -inf, ...] at a
    given position (the anchor, a re-draft block's given token), which the path passes through without a
    node. drafted (N, B) bool: the positions whose paths are nodes. A path's log-probability
    never rises with depth, so the budget best nodes of all depths are what the heap picks, and the best
    `budget` paths at each depth extend the best `budget` of the depth before: a beam of that width over
    the positions finds them exactly. -inf where the block has fewer than `budget` possible nodes.
    """
    num_blocks, block_size, _ = top_log_probs.shape
    beam = top_log_probs.new_zeros(num_blocks, 1)  # (N, width) best path log-probabilities so far
    depths = []
    for k in range(1, block_size):
        candidates = (beam[:, :, None] + top_log_probs[:, k, None, :]).flatten(1)  # (N, width * K)
        beam = candidates.topk(min(budget, candidates.shape[1]), dim=1).values
        depths.append(beam.masked_fill(~drafted[:, k, None], float("-inf")))
    nodes = torch.cat(depths, dim=1)  # (N, (B - 1) * width)
    if nodes.shape[1] < budget:
        return nodes.new_full((num_blocks,), float("-inf"))
    return nodes.topk(budget, dim=1).values[:, -1]


def label_paths(
    label_log_probs: torch.Tensor,  # (N, B) detached log q(label) at counted positions (anything elsewhere)
    top_log_probs: torch.Tensor,  # (N, B, K) as for tree_thresholds
    counted: torch.Tensor,  # (N, B) bool, the positions with a label
    budget: int,
    read: torch.Tensor | None = None,  # (N, B) bool, the given positions; None: given_positions(counted)
) -> tuple[torch.Tensor, torch.Tensor]:
    """((N, B) L_k, the path log-probability of each label prefix, (N,) the threshold of tree_thresholds).

    Given positions (before the first label) add log 1; a position without a label after one ends the
    chain (-inf from there on)."""
    given = given_positions(counted) if read is None else read
    step = torch.where(counted, label_log_probs, torch.where(given, 0.0, float("-inf")))
    return step.cumsum(dim=1), tree_thresholds(top_log_probs, counted, budget)


def tree_survival(
    label_log_probs: torch.Tensor, top_log_probs: torch.Tensor, counted: torch.Tensor, budget: int,
    read: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, B) 1.0 where the label prefix ending there is a node of the drafter's own best-first tree of `budget`
    nodes (L_k at least the threshold t), else 0; arguments as for label_paths.

    As the survival of expected_length_weights (objective intree): L_k never rises with k, so the product of
    the survivals up to k is the indicator at k itself, and the weights are D-PACE's with the tree's
    acceptance in place of the chain's top-1 confidence."""
    path, threshold = label_paths(label_log_probs, top_log_probs, counted, budget, read)
    return (counted & path.isfinite() & (path >= threshold[:, None])).float()  # -inf >= -inf: not a node


def frontier_weights(
    label_log_probs: torch.Tensor,  # (N, B) detached log q(label) at counted positions (anything elsewhere)
    top_log_probs: torch.Tensor,  # (N, B, K) as for tree_thresholds
    counted: torch.Tensor,  # (N, B) bool, the positions with a label
    budget: int,
    read: torch.Tensor | None = None,  # (N, B) bool, the given positions; None: given_positions(counted)
) -> torch.Tensor:
    """(N, B) position k's share of the gradient of a soft count of the label prefixes the drafter's own draft
    tree of `budget` nodes holds; 0 where not counted.

    The prefix of length k is in the tree when its path log-probability L_k = sum_{i<=k} log q(label_i) is at
    least the threshold t of the budget-th best node (tree_thresholds), so the accepted length is about
    A = sum_k sigmoid((L_k - t) / scale). Its derivative with respect to log q(label_j) is
    sum_{k>=j} sigmoid'((L_k - t) / scale) / scale: the gradient goes to the prefixes at the tree's frontier,
    not to those already deep inside it (which top-1 confidence weights, D-PACE, keep pushing) nor to those
    far outside it. Given positions (before the first label) add log 1; a position without a label after
    one ends the chain.
    """
    path, threshold = label_paths(label_log_probs, top_log_probs, counted, budget, read)
    z = ((path - threshold[:, None]) / FRONTIER_SCALE).nan_to_num(nan=float("-inf"))  # -inf - -inf: no prefix
    slope = torch.sigmoid(z) * torch.sigmoid(-z) / FRONTIER_SCALE  # (N, B) sigmoid'
    slope = torch.where(counted, slope, torch.zeros_like(slope))
    suffix = slope.flip(1).cumsum(1).flip(1)
    return torch.where(counted, suffix, torch.zeros_like(suffix))


def sparse_distill_loss(
    log_q: torch.Tensor,  # (m, V) the drafter's log-probabilities
    labels: torch.Tensor,  # (m,)
    teacher_ids: torch.Tensor,  # (m, k) the target's likeliest tokens, as columns of log_q; IGNORE_INDEX: none
    teacher_log_probs: torch.Tensor,  # (m, k) their log-probabilities
    distill_weight: float,
    distill_loss: str,
) -> torch.Tensor:
    """(m,) (1 - a) CE(label) + a * soft against the target's top k, renormalised over the tokens with a column (p = 0
    elsewhere; a row with none takes the label as its teacher): block_loss_sums' distillation with `teacher_top`.

    All from k + 1 columns of log_q: kl is -sum_j w_j log q_j with w the mixed target over [label, ids]; lk is
    -log sum_j min(p_j, q_j) over the same columns (the label's carries p only when it is the teacher)."""
    kept = teacher_ids != IGNORE_INDEX
    with torch.no_grad():
        p = torch.where(kept, teacher_log_probs.float().exp(), 0.0)  # (m, k)
        mass = p.sum(dim=1, keepdim=True)  # (m, 1)
        teacher = torch.cat([(mass == 0).float(), p / mass.clamp_min(torch.finfo(p.dtype).tiny)], dim=1)  # (m, 1 + k)
    columns = torch.cat([labels[:, None], torch.where(kept, teacher_ids, 0)], dim=1)  # (m, 1 + k)
    picked = log_q.gather(1, columns)  # (m, 1 + k): log q at the label, then at the teacher's tokens
    if distill_loss == "kl":
        with torch.no_grad():
            mixed = teacher * distill_weight
            mixed[:, 0] += 1 - distill_weight
        return -(mixed * picked).sum(dim=1)
    # the acceptance rate is at least exp(-CE) > 0 in exact arithmetic; the clamp guards fp32 underflow
    soft = -torch.minimum(teacher, picked.exp()).sum(dim=1).clamp_min(1e-12).log()
    return (1 - distill_weight) * -picked[:, 0] + distill_weight * soft


def block_loss_sums(
    hidden: torch.Tensor,  # (S, n*B, H) drafter outputs for every block token
    labels: torch.Tensor,  # (S, n, B) the data token each one predicts, IGNORE_INDEX where none is counted
    lm_head: nn.Module,  # the target's frozen output projection, H -> V
    weights: torch.Tensor,  # (B,) from block_position_weights
    chunk_size: int | None = None,
    teacher_hidden: torch.Tensor | None = None,  # (S, n*B, H) from teacher_states; only with distill_weight > 0
    distill_weight: float = 0.0,
    objective: str = "decayed_ce",
    smoothing: float = 0.5,
    top_k: int = RECALL_K,
    distill_loss: str = "kl",
    budget: int = 32,
    read: torch.Tensor | None = None,  # (S, n, B) bool: positions read, not drafted; None: before the first label
    teacher_top: tuple[torch.Tensor, torch.Tensor] | None = None,  # ((S, n*B, k) ids, log-probs): the target's top k
    target_config=None,  # the target's model.config: teacher_hidden's logits are lm_head's through target_logits
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of w * loss, sum of w, hits (B,), tokens (B,), top-RECALL_K hits (B,)) over the M counted block tokens.

    The hits are metrics, the same whatever the objective: `top_k` sets only the tree objective's survival.

    Only the M counted rows of `hidden` go through the LM head. With `chunk_size`, at most that many
    rows at a time, each chunk recomputed in backward (activation checkpointing), so only one chunk's
    (m, V) logits are alive at once: (M, V) logits over a 150K vocabulary would not fit.
    With distill_weight a > 0 the loss per token is (1 - a) * CE(label) + a * soft, soft the distill_loss
    against the target's distribution (the module docstring): from `teacher_hidden` through the LM head and what the
    target's forward does to its output (training.target.target_logits of `target_config`), or, given
    `teacher_top`, the target's k likeliest tokens (next_token_top_k; ids as the LM head's rows, IGNORE_INDEX where
    a token has none), sparse_distill_loss. That spares the step the teacher's LM head, its softmax and two passes
    over the vocabulary.

    The objective sets the weight w of each token's loss (detached, so it only decides where the
    gradient goes):
      decayed_ce  w = exp(-(k - 1) / gamma), normalised by the sum of w (DFlash, the published recipe);
      dpace       w = expected_length_weights(exp(-CE(label))), the drafter's own confidence in the label as
                  survival, normalised by the number of blocks (D-PACE): the chain's expected length;
      tree        the same weights with survival = 1 if the label is within the drafter's top `top_k`
                  at that position, else 0: a draft tree keeps a path alive while the target's token is
                  among the few candidates it expands at each depth, not only while it is the argmax.
      frontier    (1 - smoothing) * frontier_weights + smoothing * the decayed weights, normalised by the
                  number of blocks: the gradient of a soft count of the label prefixes that the drafter's
                  own best-first tree of `budget` nodes holds, with the published weights as a floor for
                  blocks whose labels are far outside the tree.
      intree      dpace's weights with survival = tree_survival: the label prefix is a node of the drafter's
                  own best-first tree of `budget` nodes, so a path stays alive as decoding's tree keeps it,
                  and prefixes deep inside the tree keep their weight (D-PACE's margin), unlike frontier.
    `read` marks the positions each block reads instead of drafting (the anchor, a re-draft block's given
    token): given_positions of the labels before a draft vocabulary dropped some. None infers them from
    `labels`, which reads a first label outside the draft vocabulary as given instead of ending the chain.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    if distill_loss not in DISTILL_LOSSES:
        raise ValueError(f"distill_loss {distill_loss!r}: choose one of {', '.join(DISTILL_LOSSES)}")
    block_size = weights.shape[0]
    flat_labels = labels.flatten()  # (S*n*B,)
    counted = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # (M,) the counted block tokens
    # (M, H), (M,), (M,): their drafter outputs, labels and block positions k
    rows, targets, positions = hidden.flatten(0, 1)[counted], flat_labels[counted], counted % block_size
    teacher = ()  # the teacher's rows, as tensors (checkpoint() passes tensors): (M, H), or (M, k) ids and log-probs
    if distill_weight > 0:
        teacher = tuple(t.flatten(0, 1)[counted] for t in (teacher_top or (teacher_hidden,)))
    tree_widths = objective in ("frontier", "intree")

    def chunk_terms(chunk_rows, chunk_targets, chunk_positions, *chunk_teacher):
        # one fp32 log-softmax serves the loss, the metrics and the weights
        log_q = F.log_softmax(lm_head(chunk_rows), dim=-1, dtype=torch.float32)  # (m, V)
        if len(chunk_teacher) == 2:  # the target's top k: k + 1 columns of log_q
            token_loss = sparse_distill_loss(log_q, chunk_targets, *chunk_teacher, distill_weight, distill_loss)
        elif chunk_teacher:  # the target's whole distribution, through the LM head
            with torch.no_grad():
                p = target_logits(lm_head(chunk_teacher[0]).float(), target_config).softmax(dim=-1)  # (m, V)
            if distill_loss == "kl":  # (1 - a) CE(label) + a CE(p) is one cross-entropy against the mixed target
                with torch.no_grad():
                    mixed = p.mul_(distill_weight)
                    mixed[torch.arange(mixed.shape[0], device=mixed.device), chunk_targets] += 1 - distill_weight
                token_loss = -(mixed * log_q).sum(dim=-1)  # (m,)
            else:  # the acceptance rate is at least exp(-CE) > 0 in exact arithmetic; the clamp guards fp32 underflow
                soft = -torch.minimum(p, log_q.exp()).sum(dim=-1).clamp_min(1e-12).log()  # (m,)
                token_loss = (1 - distill_weight) * F.nll_loss(log_q, chunk_targets, reduction="none") + distill_weight * soft
        else:
            token_loss = F.nll_loss(log_q, chunk_targets, reduction="none")  # (m,)
        detached = log_q.detach()
        vocab = detached.shape[1]
        label_log_q = detached.gather(1, chunk_targets[:, None])  # (m, 1)
        # the metric's k, the tree objective's survival k, the tree widths' K: one top_entries serves them all
        recall_k, survival_k, tree_k = min(RECALL_K, vocab), min(top_k, vocab), min(budget, vocab)
        top, _ = top_entries(detached, max(recall_k, survival_k, tree_k if tree_widths else 1))  # (m, K), unordered

        def within(k):  # (m,) fewer than k tokens rank above the label
            kth = top if top.shape[1] == k else top.topk(k, dim=1, sorted=False).values
            return label_log_q[:, 0] >= kth.amin(dim=1)

        in_top = within(survival_k)
        # the label is the drafter's argmax, ties broken as decoding breaks them: under bf16 a few % of rows tie at the
        # top, and a tie counted as a hit raised acc_k (and the chain estimate built on it) above what decoding accepts
        hits = position_counts(detached.argmax(dim=1) == chunk_targets, chunk_positions, block_size)
        tokens = position_counts(torch.ones_like(in_top), chunk_positions, block_size)
        top_hits = position_counts(within(recall_k), chunk_positions, block_size)
        best = detached[:, :0]
        if tree_widths:  # (m, 1 + K): log q(label), then the K best log-probabilities, unordered
            best = torch.cat([label_log_q, top if top.shape[1] == tree_k else top.topk(tree_k, dim=1).values], dim=1)
        elif objective == "dpace":  # (m, 1): log q(label), the confidence; token_loss is not it when distilling
            best = label_log_q
        return token_loss, in_top, hits, tokens, top_hits, best

    chunk = chunk_size or max(1, rows.shape[0])
    parts = []
    for start in range(0, max(1, rows.shape[0]), chunk):  # one empty chunk where no row is counted: sums of 0
        part = slice(start, start + chunk)
        args = (rows[part], targets[part], positions[part], *(t[part] for t in teacher))
        if chunk_size and torch.is_grad_enabled():
            parts.append(checkpoint(chunk_terms, *args, use_reentrant=False))
        else:
            parts.append(chunk_terms(*args))
    token_loss = torch.cat([p[0] for p in parts])  # (M,)
    in_top = torch.cat([p[1] for p in parts])  # (M,) the label within the drafter's top_k
    hits, tokens, top_hits = (sum(p[i] for p in parts) for i in (2, 3, 4))

    if objective == "decayed_ce":
        token_weight = weights[positions]  # (M,)
        total = token_weight.sum()
    else:
        mask = torch.zeros(flat_labels.shape[0], dtype=torch.bool, device=hidden.device)
        mask[counted] = True
        mask = mask.view(-1, block_size)  # (N, B)
        given = given_positions(mask) if read is None else read.reshape(-1, block_size)
        grid = torch.zeros(flat_labels.shape[0], device=hidden.device)
        scores = torch.cat([p[5] for p in parts])  # (M, 1 + K) log q(label) and the K best; (M, 1) dpace; (M, 0)
        if objective in ("frontier", "intree"):
            grid[counted] = scores[:, 0]
            best = torch.full((flat_labels.shape[0], scores.shape[1] - 1), float("-inf"), device=hidden.device)
            best[counted] = scores[:, 1:]
            best = best.view(*mask.shape, -1)  # (N, B, K)
            best[..., 0] = torch.where(given, 0.0, best[..., 0])  # given: passed through
            if objective == "frontier":
                tree = frontier_weights(grid.view(mask.shape), best, mask, budget, given)
                grid_weights = (1 - smoothing) * tree + smoothing * torch.where(mask, weights, 0.0)
            else:
                survival = tree_survival(grid.view(mask.shape), best, mask, budget, given)
                grid_weights = expected_length_weights(survival, mask, smoothing, given)
        else:
            grid[counted] = scores[:, 0].exp() if objective == "dpace" else in_top.float()  # q(label) for dpace
            grid_weights = expected_length_weights(grid.view(mask.shape), mask, smoothing, given)
        token_weight = grid_weights.flatten()[counted]  # (M,)
        # Normalised by the blocks that have a label (not by the weights' sum, which would undo the weighting).
        total = mask.any(dim=1).sum().float()
    return (token_loss * token_weight).sum(), total, hits, tokens, top_hits
