"""The drafter's decoding forwards at fixed shapes over a context cache in fixed buffers, captured as CUDA graphs.

A drafter round is one forward over the block and, re-drafting, one more over the blocks behind the likeliest
first tokens: a few hundred small kernels each. On a GPU they are launch-bound (an H200, a 1-layer drafter for
SmolLM2-135M: 3.9 ms a round for both forwards, of which the GPU was busy 0.4 ms), so, as the target's verify
(ddtree/target_runner.py, StaticTarget), each forward is run at one shape and replayed from a CUDA graph:

- every layer's context keys and values live in buffers of `capacity + block` slots (StaticContextCache);
- a round's new context rows (the root and the accepted rows: at most a block) are padded to a block and written
  at the first free slots, the padding past them, where the next round writes again;
- queries see the slots below the context's end and their own block (a bool mask in a fixed buffer);
- the prompt's context, longer than a block, is written by one uncaptured forward.

The logits equal the growing-cache path's (DrafterRunner with a DynamicCache) up to float rounding: the same
keys, in other places, the unused ones masked out (a CPU test compares them; a CUDA test, replay with eager).
"""

from __future__ import annotations

import warnings

import torch

from .modeling_dflash import DFlashDraftModel
from .target_runner import capturing


def redraft_layout(root_token: int, start: int, firsts: list[int], block_size: int, mask_token_id: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The re-draft forward's inputs, for both paths (DrafterRunner.redraft): blocks (count, B) [root, first, MASK...],
    their positions (1, count * B), and which query sees which block key (count * B, count * B): its own only."""
    count = len(firsts)
    blocks = torch.full((count, block_size), mask_token_id, dtype=torch.long, device=device)
    blocks[:, 0] = root_token
    blocks[:, 1] = torch.tensor(firsts, dtype=torch.long, device=device)
    positions = torch.arange(start, start + block_size, device=device).repeat(count)[None]
    own = torch.arange(count, device=device).repeat_interleave(block_size)  # the block of each query
    return blocks, positions, own[:, None] == own[None]


class StaticContextCache:
    """What DFlashAttention asks of a cache (`update`), over fixed per-layer buffers (1, Hkv, slots, D)."""

    def __init__(self, drafter: DFlashDraftModel, slots: int, device: torch.device):
        config = drafter.config
        shape = (1, config.num_key_value_heads, slots, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=drafter.dtype, device=device) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=drafter.dtype, device=device) for _ in drafter.layers]
        self.slots: torch.Tensor | None = None  # (n,) where `update` writes the n context rows it is given

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int):
        if keys.shape[2]:
            self.keys[layer_idx].index_copy_(2, self.slots, keys)
            self.values[layer_idx].index_copy_(2, self.slots, values)
        return self.keys[layer_idx], self.values[layer_idx]


class StaticDrafter:
    """`propose` and `redraft` of a DrafterRunner (same arguments, same logits) at fixed shapes; on CUDA, replayed.

    Returned logits are views of buffers that the next call of the same kind overwrites. Reusable for a new
    generation as it is: the slots a call sees are those below its `start`, all written by this generation.
    """

    def __init__(self, runner, capacity: int, cuda_graph: bool | None = None):
        self.runner = runner
        drafter = runner.drafter
        self.device = runner.lm_head.weight.device
        self.dtype = drafter.dtype  # of its buffers: a runner whose drafter is cast since needs new ones
        self.requested = cuda_graph
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.capacity = capacity
        block = self.block_size = drafter.block_size
        self.slots = capacity + block  # the context of every committed position, then one padded block
        self.cache = StaticContextCache(drafter, self.slots, self.device)
        self.slot_ids = torch.arange(self.slots, device=self.device)
        # propose's inputs: new context rows (padded to a block), their slots, [context ; block] positions, the block
        self.context = torch.zeros(1, block, drafter.fc.in_features, dtype=drafter.dtype, device=self.device)
        self.context_slots = torch.zeros(block, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(1, 2 * block, dtype=torch.long, device=self.device)
        self.block = torch.full((1, block), runner.mask_token_id, dtype=torch.long, device=self.device)
        self.mask = torch.ones(1, 1, 1, self.slots + block, dtype=torch.bool, device=self.device)  # one row for all
        self.redrafts: dict[int, dict] = {}  # block count -> its inputs
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # "propose" / count -> replay

    # ------------------------------------------------------------------ propose

    @torch.no_grad()
    def propose(self, root_token: int, start: int, new_context: torch.Tensor, depth: int) -> torch.Tensor:
        """DrafterRunner.propose: draft logits (depth, V) for positions start+1 .. start+depth."""
        rows, block = new_context.shape[1], self.block_size
        context_start = start - rows
        if start > self.slots - block:
            raise ValueError(f"position {start} is past the drafter's {self.slots - block} context slots")
        self.mask[..., : self.slots] = self.slot_ids < start  # the context written so far, these rows included
        self.block[0, 0] = root_token
        self.positions[0, block:] = torch.arange(start, start + block, device=self.device)
        if rows > block:  # the prompt, or a round that took a lookup past the block: one forward at its own shape
            self.cache.slots = torch.arange(context_start, start, device=self.device)
            positions = torch.cat([self.cache.slots, self.positions[0, block:]])[None]
            return self._propose(new_context.to(self.context.dtype), positions)[:depth]
        self.context[:, :rows] = new_context
        self.context[:, rows:] = 0  # padding rows: written past `start`, masked, overwritten next round
        self.context_slots.copy_(torch.arange(context_start, context_start + block, device=self.device))
        self.positions[0, :block] = self.context_slots
        self.cache.slots = self.context_slots
        return self._replay("propose", lambda: self._propose(self.context, self.positions))[:depth]

    def _propose(self, context: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        hidden = runner.drafter(
            noise_embedding=runner.embedding(self.block).to(runner.drafter.dtype), target_hidden=context,
            position_ids=positions, attention_mask=self.mask, past_key_values=self.cache,
        )  # (1, B, H)
        return runner._logits(hidden[0, 1:], first_depth=1)  # (B - 1, V)

    # ------------------------------------------------------------------ redraft

    @torch.no_grad()
    def redraft(self, root_token: int, start: int, firsts: list[int], depth: int) -> torch.Tensor:
        """DrafterRunner.redraft: logits (len(firsts), depth - 1, V) for positions start+2 .. start+depth."""
        count = len(firsts)
        blocks, positions, same_block = redraft_layout(
            root_token, start, firsts, self.block_size, self.runner.mask_token_id, self.device)
        inputs = self.redrafts.get(count) or self._redraft_inputs(same_block)
        inputs["blocks"].copy_(blocks)
        inputs["positions"].copy_(positions)
        inputs["mask"][..., : self.slots] = self.mask[..., : self.slots]  # propose's, for this same start
        logits = self._replay(count, lambda: self._redraft(inputs))
        return logits[:, : depth - 1]

    def _redraft_inputs(self, same_block: torch.Tensor) -> dict:
        """Fixed buffers for re-drafts of one block count; the context part of the mask is set per call."""
        queries, count = same_block.shape[0], same_block.shape[0] // self.block_size
        mask = torch.zeros(1, 1, queries, self.slots + queries, dtype=torch.bool, device=self.device)
        mask[0, 0, :, self.slots :] = same_block
        inputs = {
            "blocks": torch.zeros(count, self.block_size, dtype=torch.long, device=self.device),
            "positions": torch.zeros(1, queries, dtype=torch.long, device=self.device),
            "mask": mask,
            "no_context": self.context.new_zeros(1, 0, self.context.shape[-1]),
        }
        self.redrafts[count] = inputs
        return inputs

    def _redraft(self, inputs: dict) -> torch.Tensor:
        runner, count, block = self.runner, inputs["blocks"].shape[0], self.block_size
        hidden = runner.drafter(
            noise_embedding=runner.embedding(inputs["blocks"].view(1, -1)).to(runner.drafter.dtype),
            target_hidden=inputs["no_context"], position_ids=inputs["positions"], attention_mask=inputs["mask"],
            past_key_values=self.cache,
        ).view(count, block, -1)
        return runner._logits(hidden[:, 2:], first_depth=2)  # (count, B - 2, V)

    # ------------------------------------------------------------------ CUDA graphs

    def _replay(self, key, forward) -> torch.Tensor:
        """forward() at its fixed shape: eagerly off CUDA; on CUDA captured on first use, then replayed."""
        if not self.cuda_graph:
            return forward()
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(forward)
            except RuntimeError as error:  # an op that syncs with the host cannot be captured
                warnings.warn(f"CUDA graph capture of the drafter failed ({error}); it runs uncaptured")
                self.cuda_graph = False
                return forward()
        graph, output = self.graphs[key]
        graph.replay()
        return output

    def _capture(self, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up and capture write this round's context rows into their slots: the same values the replay writes.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # allocations, the draft head's gather and kernel choices happen outside the capture
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.device):  # on the drafter's GPU (ddtree/target_runner.py)
            output = forward()
        return graph, output
