"""Adaptive tree size: each round verifies only as many of the best-first tree's nodes as pay for themselves.

    sizer = TreeSizer.measure(target, max_rows=budget + 1)       # once per machine and target
    generate(target, prompt_ids, "ddtree", drafter, budget, sizer=sizer)

Where the target's forward is compute-bound (a CPU), every verified row costs time: on a 2-core EPYC
SmolLM2-135M's one-token step takes 41 ms and each tree node adds about 1.1 ms, so a 32-node tree
costs 1.9 steps and budget 32 barely beats plain decoding (docs/benchmarks.md, Which budget). Where it is
launch-bound (a GPU) rows are nearly free. The best budget is therefore the machine's.

The best-first tree is nested: its first n nodes are exactly the best tree of n nodes (build_tree
pops in order of path probability), and a round verifying them commits 1 + the sum of their path
probabilities tokens in expectation (DDTree Prop. 1). So each round takes the n <= budget that
maximises expected tokens per millisecond, with a verify cost `fixed_ms + row_ms x rows` measured
once on this machine. The drafter's probabilities are its own: an over-confident drafter gets trees
larger than the best, `--online-calibration` corrects that. Sizing decides what is verified, never
what is committed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from .errors import DDTreeError
from .target_runner import DynamicTarget, context_limit
from .tree import DraftTree, ancestor_matrix, build_tree, tree_positions

PROBE_ROWS = (1, 2, 5, 9, 17, 33, 65, 129)  # verify shapes timed by TreeSizer.measure, up to its max_rows


def verify_seconds(runner: DynamicTarget, tree: DraftTree, context: int, repeats: int) -> float:
    """Median wall time of the target's forward over [root + tree] against `context` cached tokens.

    The first call at the shape is untimed (a warm-up); the cache is cropped back after every call.
    """
    device = runner.target.device
    positions, mask = tree_positions(tree, context), ancestor_matrix(tree)  # decoding counts them in the overhead

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        runner.verify([7] + tree.tokens, positions, mask, context)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        runner.cache.crop(-(len(tree) + 1))  # (transformers 5: a negative count of tokens to remove)
        return elapsed

    once()
    return statistics.median(once() for _ in range(repeats))


def probe_runner(target: PreTrainedModel, context: int, seed: int = 0) -> DynamicTarget:
    """A dynamic-cache runner holding `context` random tokens, to time verifies against."""
    generator = torch.Generator().manual_seed(seed)
    vocab = target.get_output_embeddings().weight.shape[0]
    runner = DynamicTarget(target, hidden_states=False)  # the decoding loop's own forwards
    low = min(100, vocab - 1)  # above the special tokens, where the vocabulary has room
    runner.prefill(torch.randint(low, vocab, (context,), generator=generator).tolist())
    return runner


def probe_tree(vocab: int, nodes: int, seed: int = 0) -> DraftTree:
    """A best-first tree of `nodes` nodes over random 15-depth logits (the shape a 16-token block drafts)."""
    generator = torch.Generator().manual_seed(seed)
    return build_tree(torch.randn(15, vocab, generator=generator) * 4, nodes)


@dataclass
class TreeSizer:
    """A round's cost, fixed_ms + overhead_ms + row_ms x rows (the root is a row), and the tree size it makes best.

    fixed_ms and row_ms are the verify's, measured; overhead_ms is the rest of a round (drafting, building the
    tree, bookkeeping), a running mean of the rounds decoding reports through observe_overhead.
    """

    fixed_ms: float
    row_ms: float
    overhead_ms: float = 0.0
    rounds: int = 0

    OVERHEAD_WINDOW = 50  # the running mean weighs the last ~50 rounds once it has seen that many

    def observe_overhead(self, ms: float) -> None:
        self.rounds += 1
        self.overhead_ms += (ms - self.overhead_ms) / min(self.rounds, self.OVERHEAD_WINDOW)

    @classmethod
    def measure(cls, target: PreTrainedModel, max_rows: int, context: int = 300, repeats: int = 3,
                instead: str = "lower --budget, or pass --adaptive-size off") -> TreeSizer:
        """Fit the cost line to the verify's median time at PROBE_ROWS up to max_rows (and max_rows itself).

        The `context` cached tokens are fewer where the target's context leaves less room beside max_rows: past its
        positions a learned position table fails and rotary positions are ones decoding never reaches. Where it
        leaves none, the error says `instead`, what to do as the caller's user spells it (the command's flags)."""
        limit = context_limit(target)
        if limit - max_rows < 1:
            raise DDTreeError(f"the target's context of {limit} positions leaves no room to time verifies of "
                              f"{max_rows} rows: {instead}")
        context = min(context, limit - max_rows)
        vocab = target.get_output_embeddings().weight.shape[0]
        runner = probe_runner(target, context)
        rows = sorted({r for r in PROBE_ROWS if r < max_rows} | {max_rows})
        ms = [1000 * verify_seconds(runner, probe_tree(vocab, r - 1), context, repeats) for r in rows]
        if len(rows) == 1:
            return cls(fixed_ms=ms[0], row_ms=0.0)
        slope = max(float(np.polyfit(rows, ms, 1)[0]), 0.0)  # noise can tilt a flat line below zero: rows are free
        return cls(fixed_ms=max(float(np.mean(ms) - slope * np.mean(rows)), 1e-3), row_ms=slope)  # through the mean

    def size(self, log_probs: list[float], extra_rows: int = 0) -> int:
        """How many leading nodes of a best-first tree to verify: the n >= 1 maximising
        (1 + sum of their path probabilities) / (fixed_ms + overhead_ms + row_ms x (1 + n + extra_rows)); 0 for none.

        log_probs: the tree's path log-probabilities in pop order; extra_rows: rows verified whatever n is
        (a grafted lookup path).
        """
        if not log_probs:
            return 0
        gains = 1.0 + np.cumsum(np.exp(np.asarray(log_probs, dtype=np.float64)))
        costs = self.fixed_ms + self.overhead_ms + self.row_ms * (1 + extra_rows + np.arange(1, len(log_probs) + 1))
        ratio = gains / costs
        return int(np.flatnonzero(ratio >= ratio.max() * (1 - 1e-12))[-1]) + 1  # ties go to the larger tree

    def describe(self) -> str:
        return f"verify cost {self.fixed_ms:.1f} ms + {self.row_ms:.2f} ms per row"
