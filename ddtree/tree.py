"""Draft trees (DDTree): build the best tree under a node budget, flatten it, mask it, walk it.

The drafter's per-depth distributions are factorised, Q(y_1..L) = prod_i q_i(y_i), so the
expected accepted depth of a prefix-closed tree is the sum of its nodes' path probabilities,
and the best tree under a budget of B nodes is the B most probable prefixes. A best-first
heap finds them in O(B log B) using only the top-B tokens of each depth.

Flattened layout fed to the target in one forward: row 0 is the root (the bonus token already
committed but not yet in the KV cache), rows 1..n are the nodes in pop order, which is
topological (parents before children). Each row sees the committed prefix, the root, its
ancestors and itself; siblings share a position (start + depth).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Set
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: list[int]  # (n,) token of each node, in pop (topological) order
    parents: list[int]  # (n,) row of each node's parent in the flattened tree (0 = the root)
    depths: list[int]  # (n,) 1-based depth of each node
    log_probs: list[float]  # (n,) log of the path probability of each node under the drafter
    children: list[dict[int, int]] = field(default_factory=list)  # per row (0..n): token -> child row
    grafted: list[int] = field(default_factory=list)  # depths of the nodes the context lookup's graft added
    quoted: list[int] = field(default_factory=list)  # depths of the nodes the corpus lookup's graft added

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def expected_acceptance(self) -> float:
        """The drafter's own estimate of tau for this tree: 1 + sum of path probabilities (DDTree Prop. 1)."""
        return 1.0 + float(np.exp(np.asarray(self.log_probs, dtype=np.float64)).sum()) if self.tokens else 1.0

    def expected_acceptance_before(self, stop: Set[int]) -> float:
        """expected_acceptance over the nodes a reply can commit: none below a stop token. The reply ends at an
        accepted stop token, so the nodes under it are never counted as accepted, and the estimate should not
        count them either (it ran above the measured tau by their probability in every reply's last round)."""
        if not stop or stop.isdisjoint(self.tokens):
            return self.expected_acceptance
        below = [False] * (len(self.tokens) + 1)  # per row, the root's row 0 included
        total = 1.0
        for row, (parent, log_prob) in enumerate(zip(self.parents, self.log_probs), start=1):
            below[row] = below[parent] or (parent > 0 and self.tokens[parent - 1] in stop)
            total += 0.0 if below[row] else math.exp(log_prob)
        return total


def _empty_tree() -> DraftTree:
    return DraftTree([], [], [], [], [{}])


def build_tree(
    draft_logits: torch.Tensor, budget: int, branches: dict[int, torch.Tensor] | None = None,
    vocab: torch.Tensor | None = None,
) -> DraftTree:
    """Best-first tree of the `budget` most probable prefixes. draft_logits: (L, V), one row per depth.

    branches: depth-1 token -> (L - 1, V) logits for depths 2..L re-drafted behind that token (`--redraft`);
    the subtree below such a token scores those instead of the block's own rows. Path probabilities stay
    exact products of what the drafter said at each node, so pops stay topological.
    vocab: the only token ids whose logits can be finite (a draft vocabulary), or None; the same tree, built
    over those columns alone (the normalisation over all 49K columns was most of a re-drafted round's tree cost).
    """
    depth_count = draft_logits.shape[0]
    if budget < 1 or depth_count == 0:
        return _empty_tree()
    branches = branches if branches and depth_count > 1 else {}
    # Table 0 is the block's own rows; table j > 0 the j-th branch's, its depth-1 row a copy of the block's.
    tables = torch.stack([draft_logits] + [torch.cat([draft_logits[:1], rows]) for rows in branches.values()])
    tables = (tables if vocab is None else tables[..., vocab]).float()
    top = min(budget, tables.shape[-1])
    top_logits, top_tokens = tables.topk(top, dim=-1)  # (1 + k, L, top)
    if vocab is not None:
        top_tokens = vocab[top_tokens]
    top_log_probs = top_logits - torch.logsumexp(tables, dim=-1, keepdim=True)  # log-softmax of the top only
    top_log_probs, top_tokens = top_log_probs.cpu().tolist(), top_tokens.cpu().tolist()
    branch_table = {token: j for j, token in enumerate(branches, start=1)}

    tree = _empty_tree()
    # Heap entries: (-path score, depth index, rank at that depth, parent row, table). Scores are exact
    # sums of log-probs, so a popped node's score is never above its parent's: pops are topological.
    # A depth-1 row that is not finite (NaN or +inf logits; all -inf) gives no node at all: a NaN path score would
    # reach the tree's log-probs, where the sizer and the expected acceptance read it.
    heap = [(-top_log_probs[0][0][0], 0, 0, 0, 0)] if math.isfinite(top_log_probs[0][0][0]) else []
    while heap and len(tree.tokens) < budget:
        neg_score, depth, rank, parent, table = heapq.heappop(heap)
        score = -neg_score
        token = top_tokens[table][depth][rank]
        row = len(tree.tokens) + 1
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth + 1)
        tree.log_probs.append(score)
        tree.children.append({})
        tree.children[parent][token] = row
        log_probs = top_log_probs[table][depth]
        # A token the drafter gives probability 0 (a -inf logit) is never a node: its path could not be drafted, and
        # its score (-inf - -inf for a sibling) would be NaN.
        if rank + 1 < top and log_probs[rank + 1] > -math.inf:  # next sibling: same parent, next-best token
            heapq.heappush(heap, (-(score - log_probs[rank] + log_probs[rank + 1]), depth, rank + 1, parent, table))
        if depth + 1 < depth_count:  # first child: best token at the next depth, from the branch below it if any
            below = branch_table.get(token, 0) if depth == 0 else table
            if top_log_probs[below][depth + 1][0] > -math.inf:
                heapq.heappush(heap, (-(score + top_log_probs[below][depth + 1][0]), depth + 1, 0, row, below))
    return tree


def truncated(tree: DraftTree, nodes: int) -> DraftTree:
    """The first `nodes` nodes of a best-first tree: exactly build_tree's tree at that budget (its pops are in order)."""
    children = [{token: row for token, row in rows.items() if row <= nodes} for rows in tree.children[: nodes + 1]]
    return DraftTree(tree.tokens[:nodes], tree.parents[:nodes], tree.depths[:nodes], tree.log_probs[:nodes], children)


def context_lookup(tokens: list[int], length: int, max_ngram: int = 3) -> list[int]:
    """What followed the most recent earlier occurrence of the context's last n tokens, n = max_ngram down to 1.

    Up to `length` tokens, or [] when not even the last token occurred before. Small targets repeat
    themselves and answers quote their prompts, where a drafter that cannot copy misses (docs/decoding.md, Context lookup).
    A match that overlaps the end (the text repeats with a period shorter than `length`: 11 11 11, or a b a b)
    continues with that period past the end, as the loop would, instead of stopping where the context does.
    """
    if length < 1:
        return []
    seq = np.asarray(tokens)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        # match[j]: seq[j:j + n] equals the last n tokens; j < len - n, so a token follows every match
        match = np.ones(len(seq) - n, dtype=bool)
        for k in range(n):
            match &= seq[k:len(seq) - n + k] == seq[len(seq) - n + k]
        starts = np.flatnonzero(match)
        if starts.size:
            follow = int(starts[-1]) + n
            period = len(seq) - follow  # the context ends with seq[follow - period:follow] == seq[follow:]
            return [int(seq[follow + i % period]) for i in range(length)]
    return []


def graft_path(
    tree: DraftTree, tokens: list[int], log_probs: list[float], new_scores: list[float] | None = None
) -> list[int]:
    """Add the path `tokens` below the root, reusing the nodes the tree already holds (it stays prefix-closed);
    return the depths of the nodes it added (the caller keeps them in tree.grafted or tree.quoted).

    log_probs[d]: the drafter's log-probability of tokens[d] at depth d + 1, so every path score (and the
    expected acceptance) stays the drafter's own; or, given new_scores[d], a node the graft adds at depth d + 1
    scores that instead (a learned chance that the lookup is right that deep: OnlineCalibration). New nodes
    come after their parents: pop order stays topological.
    """
    row, score, added = 0, 0.0, []
    for depth, (token, log_prob) in enumerate(zip(tokens, log_probs), start=1):
        score += log_prob
        child = tree.children[row].get(token)
        if child is None:
            tree.tokens.append(token)
            tree.parents.append(row)
            tree.depths.append(depth)
            tree.log_probs.append(score if new_scores is None else new_scores[depth - 1])
            added.append(depth)
            tree.children.append({})
            child = len(tree.tokens)
            tree.children[row][token] = child
        row = child
    return added


def chain_tree(tokens: list[int]) -> DraftTree:
    """A single chain (DFlash verification) expressed as a tree: node i's parent is node i-1."""
    tree = _empty_tree()
    for i, token in enumerate(tokens):
        tree.tokens.append(token)
        tree.parents.append(i)
        tree.depths.append(i + 1)
        tree.log_probs.append(0.0)
        tree.children.append({})
        tree.children[i][token] = i + 1
    return tree


def tree_positions(tree: DraftTree, start: int) -> torch.LongTensor:
    """Positions of the flattened rows: the root at `start`, each node at start + depth. (1 + n,)"""
    return torch.tensor([start] + [start + d for d in tree.depths], dtype=torch.long)


def ancestor_matrix(tree: DraftTree) -> np.ndarray:
    """(1 + n, 1 + n) bool: row i sees column j iff j is i itself or one of i's ancestors (the root included)."""
    rows = len(tree) + 1
    visible = np.zeros((rows, rows), dtype=bool)
    visible[0, 0] = True
    for row, parent in enumerate(tree.parents, start=1):
        visible[row] = visible[parent]  # parents come first, so their row is complete
        visible[row, row] = True
    return visible


def walk(tree: DraftTree, next_token_at) -> tuple[list[int], int]:
    """Follow the target's own choices from the root while they are children in the tree.

    next_token_at(row) -> the target's token after that row (argmax at T=0, a sample at T>0); it is
    called only on the rows of the walk, in order, so sampling draws exactly one token per step.
    Returns (accepted node rows in path order, the bonus token after the last accepted row).
    """
    accepted, row = [], 0
    while True:
        token = next_token_at(row)
        child = tree.children[row].get(token)
        if child is None:
            return accepted, token
        accepted.append(child)
        row = child
