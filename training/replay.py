"""Tree decoding replayed on the training data's replies: the rounds DDTree would run, without the target.

    runner = DrafterRunner(drafter, target)
    rounds = replay_reply(runner, features, input_ids, *reply_span(loss_mask), budget=32, max_new_tokens=64)
    sum(r.committed for r in rounds) / len(rounds)   # tau, as decoding counts it (GenerationResult.tau)

The replies are the target's own greedy continuations (data/regenerate.py), so at T=0 the target's
choice after every reply position is known: the next reply token. A launch whose data says otherwise
(training/recipe.py, check_replay_data) is refused where its regeneration.json says the replies were sampled,
and noted where it names another target. A round of `generate` can then be
replayed from the sequence's target features alone: the drafter proposes a block at the root (the
last bonus token) through the same `DrafterRunner.propose` decoding uses, `draft_tree` builds the
same tree, and `walk` follows the reply instead of a target forward. The next round starts where the
walk stopped, exactly as in decoding. Rounds therefore start where decoding starts them, after a
rejection, and not at uniformly drawn anchors as the training loss and validation do; decoding
acceptance is measured at those places, so this is where the drafter's probabilities must be
calibrated (`RoundNLL`, used by model.calibrate).

Greedy decoding in another batch shape or precision can differ from the stored reply at a few
positions; the replay follows the reply. It is a validation measurement, never a lossless decoder.

With the decoding defaults a drafter ships (context lookup, corpus lookup, re-drafting), the replay grafts and
re-drafts as `generate` does, and an OnlineCalibration learns from every replayed round as `--online-calibration`
learns from decoded ones: model.replay_calibration keeps what it learned in the drafter's config, so that the
expected acceptance counts the lookups' nodes by their measured acceptance (`learn_calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterable

import torch

from ddtree.calibration import OnlineCalibration
from ddtree.corpus import CorpusLookup
from ddtree.decoding import DrafterRunner, draft_tree, drafter_defaults
from ddtree.tree import context_lookup, walk


CALIBRATION_TEMPERATURES = torch.logspace(-1, 2, 49, base=2.0).tolist()  # 0.5 .. 4, steps of 2^(1/16) (~4%)


@dataclass
class ReplayRound:
    accepted: int  # accepted draft nodes
    expected: float  # the tree's expected acceptance under the drafter's (temperature-scaled) probabilities
    committed: int  # tokens the round commits: accepted + 1 (the bonus), or up to an accepted stop token, no bonus


def reply_span(loss_mask: torch.Tensor) -> tuple[int, int] | None:
    """[start, end) of the first supervised run of one sequence's (T,) loss mask: the target's reply, or None."""
    supervised = loss_mask.bool().nonzero().flatten()
    if supervised.numel() < 2 or int(supervised[0]) == 0:  # a reply needs a prompt before it and a token after its first
        return None
    start = int(supervised[0])
    gaps = (supervised[1:] - supervised[:-1] != 1).nonzero().flatten()
    end = int(supervised[gaps[0]]) + 1 if gaps.numel() else int(supervised[-1]) + 1
    return start, end


@torch.no_grad()
def replay_reply(
    runner: DrafterRunner,
    features: torch.Tensor,  # (T, K*H) target features of the whole sequence
    input_ids: torch.Tensor,  # (T,)
    start: int,  # the reply's first token: decoding's first bonus, from the prefill
    end: int,  # one past the reply's last token
    budget: int | None,  # tree node budget, or None for the chain (dflash)
    max_new_tokens: int,
    on_round: Callable[[torch.Tensor, list[int], int], None] | None = None,
    stop_ids: Collection[int] = (),
    lookup: int = 0,
    corpus: CorpusLookup | None = None,
    redraft: int = 0,
    online: OnlineCalibration | None = None,
) -> list[ReplayRound]:
    """The rounds `generate` would run on this reply. on_round(draft logits (depth, V), the reply's tokens at
    depths 1..depth, accepted nodes) sees each round, e.g. to fit temperatures on exactly these blocks: the rows the
    tree ranks the reply's path by, so past depth 1 the re-drafted block's behind the reply's first token, where
    one was drafted (decoding's temperatures divide both alike).
    stop_ids: the target's end-of-turn tokens (stop_token_ids); one ends the reply where decoding commits it, though
    the supervised reply goes on: a round that accepts one commits no bonus token, as decoding does.
    lookup, corpus, redraft, online: as `generate` takes them (explicit here: no drafter defaults are applied);
    online learns from every round unless frozen."""
    ids = input_ids.tolist()
    stops = set(stop_ids)
    runner.reset()
    root, new_context, committed = start, features[None, :start], 1
    shape = budget  # OnlineCalibration's key: the ddtree budget, None for the chain
    vocab = getattr(runner, "draft_vocab", None)
    rounds = []
    # As decoding: a root that is a stop token (the prefill's, an accepted one or a bonus) ends the reply there, though
    # the supervised reply may go on (<|im_end|> then <|endoftext|>).
    while committed < max_new_tokens and root < end - 1 and ids[root] not in stops:
        # As deep as decoding drafts: it cannot know where the reply ends. A lookup's copy may run past the block.
        graft_depth = max_new_tokens - committed - 1
        depth = min(graft_depth, runner.block_size - 1)
        if depth == 0:  # the last token allowed: a round that only commits the bonus
            rounds.append(ReplayRound(0, 1.0, 1))
            break
        logits = runner.propose(ids[root], root, new_context, depth)  # (depth, V)
        branches = None
        if redraft and depth > 1:
            # as decoding: a tree holds at most `budget` depth-1 nodes (the chain one), more blocks would go unused
            count = min(redraft, budget) if budget is not None else 1
            firsts = logits[0].topk(min(count, logits.shape[-1])).indices.tolist()
            branches = dict(zip(firsts, runner.redraft(ids[root], root, firsts, depth)))
        if online is not None:
            logits = logits.float() / online.temperature(shape)
            if branches:
                branches = {token: rows.float() / online.temperature(shape) for token, rows in branches.items()}
        context = ids[:root + 1]  # the prompt and every committed token, the root included
        grafted = context_lookup(context, min(lookup, graft_depth)) if lookup and budget is not None else []
        quoted = corpus.continuation(context, depth) if corpus is not None and budget is not None else []
        tree = draft_tree(logits, budget, grafted, None, online, branches, vocab, quoted)
        truth = ids[root + 1:min(root + 1 + depth, end)]
        depth_of = [0] + tree.depths
        # The reply's token after a row at depth d is ids[root + 1 + d]; past the reply nothing matches.
        accepted, _ = walk(tree, lambda row: ids[root + 1 + depth_of[row]] if root + 1 + depth_of[row] < end else -1)
        path = ids[root + 1:root + 1 + len(accepted)]
        # As decoding: the reply ends at an accepted stop token, the nodes below it neither accepted nor expected.
        stop = next((i for i, token in enumerate(path) if token in stops), None)
        path = path if stop is None else path[:stop + 1]
        expected = tree.expected_acceptance_before(stops)
        if online is not None:
            online.observe_round(shape, tree, expected, grafted, quoted, path)
        step = len(path) + 1 if stop is None else stop + 1
        rounds.append(ReplayRound(len(path), expected, step))
        if on_round is not None:
            if stop is not None:  # as the expected acceptance: below an accepted stop decoding's tree ranks nothing
                truth = truth[:stop + 1]
            if branches and truth and truth[0] in branches:  # the path's depths 2.. are that block's: (depth, V)
                on_round(torch.cat([logits[:1], branches[truth[0]]]), truth, len(path))
            else:
                on_round(logits, truth, len(path))
        new_context = features[None, root:root + step]  # the root and the accepted rows join the context
        root, committed = root + step, committed + step
    return rounds


def learn_calibration(
    runner: DrafterRunner,
    sequences: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],  # (features (T, K*H), ids (T,), loss mask (T,))
    budget: int,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
    lookup: int | None = None,
    redraft: int | None = None,
) -> OnlineCalibration:
    """What --online-calibration would learn decoding these replies, from replayed rounds: frozen, settled.

    The chain and tree decoding with `budget` nodes are replayed over each reply as `generate` decodes them with the
    runner's defaults (lookup, redraft: None = the drafter's; the runner's corpus), and one OnlineCalibration learns
    from every round from a fresh start: a temperature per shape, and each lookup's acceptance by depth, so that the
    expected acceptance counts the lookups' nodes. Kept: each temperature's mean over the last half of its path
    (OnlineCalibration.settled).
    """
    online = OnlineCalibration(record=True)
    shapes = [(None if method == "dflash" else budget, drafter_defaults(method, runner, lookup, redraft, False, None))
              for method in ("dflash", "ddtree")]
    for features, input_ids, loss_mask in sequences:
        span = reply_span(loss_mask)
        if span is None:
            continue
        for shape, (shape_lookup, shape_redraft, corpus) in shapes:
            replay_reply(runner, features, input_ids, *span, shape, max_new_tokens, stop_ids=stop_ids,
                         lookup=shape_lookup, corpus=corpus, redraft=shape_redraft, online=online)
    return online.settled()


class RoundNLL:
    """Label NLL per (temperature, depth) over replayed rounds: temperature scaling (Guo et al. 2017) per depth.

    Depth k of a round counts only where the reply's first k - 1 tokens were accepted: the drafter's
    probabilities at depth k enter a tree's ranking and its expected acceptance (a sum of path
    probabilities) through the nodes under an accepted prefix, so they are calibrated on those rows.
    """

    def __init__(self, block_size: int, temperatures: list[float] = CALIBRATION_TEMPERATURES):
        self.temperatures = torch.tensor(temperatures)[:, None]  # (N, 1)
        self.nll = torch.zeros(len(temperatures), block_size)  # (N, B); depth 0 (the root) stays 0
        self.counts = torch.zeros(block_size)

    def __call__(self, logits: torch.Tensor, truth: list[int], accepted: int) -> None:
        depths = min(accepted + 1, len(truth))
        rows = logits[:depths].float().cpu()  # (d, V)
        labels = torch.tensor(truth[:depths])
        label_logit = rows.gather(1, labels[:, None])[:, 0]  # (d,)
        for k in range(depths):
            if not torch.isfinite(label_logit[k]):  # outside the draft vocabulary: no temperature drafts it
                continue
            scaled = rows[k][None] / self.temperatures  # (N, V)
            self.nll[:, k + 1] += torch.logsumexp(scaled, dim=1) - label_logit[k] / self.temperatures[:, 0]
            self.counts[k + 1] += 1

    def best(self) -> list[float]:
        """Per depth 1..B-1, the temperature with the least NLL (1 where no round reached that depth)."""
        best = self.temperatures[:, 0][self.nll.argmin(dim=0)]  # (B,)
        return torch.where(self.counts > 0, best, torch.ones_like(best))[1:].tolist()
