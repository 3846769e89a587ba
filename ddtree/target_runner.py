"""The target's forwards during decoding, over one KV cache: prefill, verify a flattened tree, keep rows.

    runner = StaticTarget(target, max_rows=budget + 1, capacity=len(prompt) + max_new_tokens + budget + 1)
    logits, hidden = runner.prefill(prompt_ids)                # (V,) after the prompt's last token; hidden states
    logits, hidden = runner.verify(tokens, positions, visible, start)   # (1 + n, V) under the tree mask
    runner.keep(start, rows)                                           # the cache = prefix + those rows

`hidden` is the tuple of every layer's hidden states (1, rows, H) when the runner was built with
hidden_states=True (the drafter reads them), else None.

Two implementations with one interface; `ddtree.decoding.generate` picks one (its `static` argument):

- `DynamicTarget`: transformers' DynamicCache, which grows by concatenation; every forward has the
  exact shape of its tree. The reference path, and the faster one on the CPU measured (docs/benchmarks.md).
- `StaticTarget`: a StaticCache allocated once for the whole generation, and every verify padded to
  the same row count (1 for `ar`, the block for the chain, budget + 1 for a tree), so the target's
  decoding forward has ONE shape. On CUDA that forward is captured once as a CUDA graph and replayed
  each round: a 135M target's step is otherwise almost all kernel-launch and Python overhead. The
  padding rows repeat the root at the root's position and see only themselves; their keys land past
  the committed prefix, where no later row looks.

How the static cache is driven: transformers' StaticLayer writes a forward's keys at
[cumulative_length, cumulative_length + rows) and returns the whole buffer; attention is masked by
the 4-D mask we pass (visible prefix, the tree's ancestors, nothing past them). Before each verify
every layer's cumulative_length is set to `start`, the first free slot; `keep` copies the kept rows
down to [start, start + len(rows)) in place, so the buffers never move (a CUDA graph reads them by
address).

A StaticTarget outlives its generation: `static_target` keeps one per target and verify shape and hands it to the
next generation that fits, so the cache is allocated and the graphs captured once, not per prompt (on an H200 that
set-up was ~95 ms of every 0.3-0.55 s generation of 128 tokens). Capacities are rounded up to CAPACITY_STEP slots,
so prompts of similar length share one.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from .modeling_dflash import sdpa_backends


def _run(target: PreTrainedModel, *args, **kwargs):
    """One forward of the target; on CUDA its attention skips cuDNN, whose per-shape set-up decoding's
    ever-new key lengths would pay every round (ddtree/modeling_dflash.py, sdpa_backends)."""
    with sdpa_backends(target.device):
        return target(*args, **kwargs)


class DynamicTarget:
    """Forwards over a growing DynamicCache, each at its own shape."""

    def __init__(self, target: PreTrainedModel, hidden_states: bool):
        self.target = target
        self.hidden_states = hidden_states
        self.cache = DynamicCache(config=target.config)

    def prefill(self, prompt_ids: list[int]):
        out = _run(
            self.target,
            torch.tensor([prompt_ids], device=self.target.device), past_key_values=self.cache, use_cache=True,
            output_hidden_states=self.hidden_states, logits_to_keep=1,
        )
        return out.logits[0, -1], out.hidden_states

    def verify(self, tokens: list[int], positions: torch.Tensor, visible: np.ndarray, start: int):
        """tokens (1 + n,), positions (1 + n,), visible (1 + n, 1 + n) bool (row sees column), start = cache length.

        Returns (logits (1 + n, V), hidden states of the 1 + n rows or None).
        """
        device = self.target.device
        rows = len(tokens)
        allowed = np.ones((rows, start + rows), dtype=bool)
        allowed[:, start:] = visible
        out = _run(
            self.target,
            torch.tensor([tokens], device=device),
            position_ids=positions.to(device)[None],
            attention_mask=additive_mask(allowed, self.target.dtype).to(device)[None, None],
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.hidden_states,
        )
        return out.logits[0], out.hidden_states

    def keep(self, start: int, rows: list[int]) -> None:
        """Compact the cache to the prefix [0, start) plus the given rows (offsets past start), in that order."""
        if rows == list(range(len(rows))):  # already in place (every ar step, every chain, a tree's first-choice path)
            for layer in self.cache.layers:  # views, no copy: the rows after them are dropped
                layer.keys = layer.keys[..., : start + len(rows), :]
                layer.values = layer.values[..., : start + len(rows), :]
            return
        tail = torch.tensor(rows, dtype=torch.long, device=self.cache.layers[0].keys.device) + start
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, tail)], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, tail)], dim=-2)


CAPACITY_STEP = 128  # static caches hold a multiple of this many slots (static_target, DrafterRunner.fix_shapes)


def context_limit(target: PreTrainedModel) -> int:
    """The positions the target was made for (max_position_embeddings; none named: no limit)."""
    return int(getattr(target.config.get_text_config(), "max_position_embeddings", 1 << 30))


def padded_capacity(needed: int) -> int:
    return -(-needed // CAPACITY_STEP) * CAPACITY_STEP


def capturing(graph: torch.cuda.CUDAGraph, device: torch.device):
    """torch.cuda.graph on a side stream of `device`, the model's GPU: torch's default capture stream is made once per
    process, on whichever GPU was current then, and the kernels of a model on another GPU would run outside the
    capture. thread_local: another thread's CUDA call (a DataLoader's pin-memory thread beside training's evaluation)
    must not break the capture, as it would under the default "global" mode."""
    return torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local")


def storage_key(*modules: torch.nn.Module) -> tuple[int, ...]:
    """Where the modules' weights and buffers live: a captured CUDA graph reads them by address, so a runner is reused
    only while this holds (a cast there and back, or weights loaded with assign=True, move them; training's in-place
    updates do not)."""
    return tuple(t.data_ptr() for module in modules for t in (*module.parameters(), *module.buffers()))


_STATIC_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {shape key: StaticTarget}


def static_target(target: PreTrainedModel, hidden_states: bool, max_rows: int, needed: int,
                  cuda_graph: bool | None = None) -> StaticTarget:
    """A StaticTarget of at least `needed` slots for a new generation: the one the last generation of this target and
    shape used when it is large enough (its graphs already captured), else a new one of padded_capacity(needed)
    slots that replaces it. One per shape, so memory stays at one cache of the longest generation seen.
    Not for two generations at once: they would share the cache."""
    runners = _STATIC_TARGETS.setdefault(target, {})
    key = (hidden_states, max_rows, cuda_graph, target.dtype, target.device)
    runner, storage = runners.get(key), storage_key(target)
    if runner is None or runner.capacity < needed or runner.storage != storage:
        runners.pop(key, None)  # its buffers go before the new ones are allocated
        runner = runners[key] = StaticTarget(target, hidden_states, max_rows, padded_capacity(needed), cuda_graph)
        runner.storage = storage
    return runner


class StaticTarget:
    """Forwards over a preallocated StaticCache at one fixed row count; replayed as a CUDA graph on a GPU.

    Reusable: each prefill starts a new sequence in the same buffers (static_target hands one on)."""

    def __init__(self, target: PreTrainedModel, hidden_states: bool, max_rows: int, capacity: int,
                 cuda_graph: bool | None = None):
        self._target = weakref.ref(target)  # weak: static_target's pool must not keep a dropped target alive
        self.hidden_states = hidden_states
        self.max_rows = max_rows  # every verify runs this many rows
        self.capacity = capacity  # cache slots: the prompt, every committed token, and one padded verify
        self.cache = StaticCache(config=target.config, max_cache_len=capacity)
        device = target.device
        self.cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        # The inputs of the decoding forward live in fixed buffers, so a captured graph reads each round's values.
        self.tokens = torch.zeros(1, max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, max_rows, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, 1, max_rows, capacity, dtype=target.dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_output = None
        # keep's (source, target) slot pairs, padded to max_rows, so that it too is one replay on a GPU: it is two
        # small kernels per layer and K/V (120 launches for a 30-layer target), most of a round's other time.
        self.keep_source = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.keep_target = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.keep_graph: torch.cuda.CUDAGraph | None = None

    @property
    def target(self) -> PreTrainedModel:
        return self._target()

    def prefill(self, prompt_ids: list[int]):
        """A new sequence: the prompt written from slot 0 (an earlier sequence's slots are never read again)."""
        length = len(prompt_ids)
        if length + self.max_rows > self.capacity:
            raise ValueError(f"a {length}-token prompt and {self.max_rows} verify rows exceed the cache's {self.capacity} slots")
        self._reset_lengths(0)
        allowed = np.zeros((length, self.capacity), dtype=bool)
        allowed[:, :length] = np.tril(np.ones((length, length), dtype=bool))  # causal over the prompt
        device = self.target.device
        out = _run(
            self.target,
            torch.tensor([prompt_ids], device=device),
            position_ids=torch.arange(length, device=device)[None],
            attention_mask=additive_mask(allowed, self.target.dtype).to(device)[None, None],
            past_key_values=self.cache, use_cache=True, output_hidden_states=self.hidden_states, logits_to_keep=1,
        )
        if self.cuda_graph and self.graph is None:
            self._capture(start=length)
        return out.logits[0, -1], out.hidden_states

    def verify(self, tokens: list[int], positions: torch.Tensor, visible: np.ndarray, start: int):
        """As DynamicTarget.verify: the real rows' logits and hidden states (views of buffers the next verify reuses)."""
        rows = len(tokens)
        if rows > self.max_rows or start + self.max_rows > self.capacity:
            raise ValueError(f"{rows} rows at slot {start} do not fit {self.max_rows} rows / {self.capacity} slots")
        padded = np.zeros((self.max_rows, self.capacity), dtype=bool)
        padded[:, :start] = True  # the committed prefix
        padded[:rows, start : start + rows] = visible
        pad = np.arange(rows, self.max_rows)
        padded[pad, :start] = False
        padded[pad, start + pad] = True  # a padding row sees itself only: no row of the mask is empty
        self.tokens.copy_(torch.tensor([tokens + [tokens[0]] * (self.max_rows - rows)]), non_blocking=True)
        self.positions.copy_(torch.cat([positions, positions[:1].expand(self.max_rows - rows)])[None], non_blocking=True)
        self.mask.copy_(additive_mask(padded, self.mask.dtype)[None, None], non_blocking=True)
        self._reset_lengths(start)  # this forward writes its rows at [start, start + max_rows)
        if self.graph is not None:
            self.graph.replay()
            out = self.graph_output
        else:
            out = self._forward()
        hidden = None if out.hidden_states is None else tuple(h[:, :rows] for h in out.hidden_states)
        return out.logits[0, :rows], hidden

    def keep(self, start: int, rows: list[int]) -> None:
        if rows == list(range(len(rows))):
            return  # already in place; the next verify overwrites whatever lies past them
        # The unused pairs copy the verify's last slot onto itself: every source is read before any slot is
        # written, and no kept row's target reaches that slot when there is padding (fewer rows than max_rows).
        scratch, pad = start + self.max_rows - 1, self.max_rows - len(rows)
        self.keep_source.copy_(torch.tensor([start + row for row in rows] + [scratch] * pad), non_blocking=True)
        self.keep_target.copy_(torch.tensor(list(range(start, start + len(rows))) + [scratch] * pad), non_blocking=True)
        if self.keep_graph is not None:
            self.keep_graph.replay()
            return
        self._keep()
        if self.graph is not None:  # the forward is captured: capture keep too, for the rounds after this one
            self.keep_graph = torch.cuda.CUDAGraph()
            with capturing(self.keep_graph, self.mask.device):
                self._keep()

    def _keep(self) -> None:
        for layer in self.cache.layers:  # in place: the buffers keep their addresses
            layer.keys.index_copy_(2, self.keep_target, layer.keys.index_select(2, self.keep_source))
            layer.values.index_copy_(2, self.keep_target, layer.values.index_select(2, self.keep_source))

    def _forward(self):
        return _run(
            self.target,
            self.tokens, position_ids=self.positions, attention_mask=self.mask, past_key_values=self.cache,
            use_cache=True, output_hidden_states=self.hidden_states,
        )

    def _capture(self, start: int) -> None:
        """Record the decoding forward once. Warm-up and capture write scratch rows at [start, start + max_rows),
        the free slots every round overwrites before reading them."""
        self.mask.fill_(0)  # any finite mask: the captured kernels read the buffer, not these values
        self.tokens.fill_(0)
        self.positions.fill_(start)
        try:
            device = self.mask.device
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # allocations and kernel choices happen outside the capture
                    self._reset_lengths(start)
                    self._forward()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self._reset_lengths(start)
            with capturing(graph, device):
                self.graph_output = self._forward()
            self.graph = graph
        except RuntimeError as error:  # a model whose forward syncs with the host cannot be captured
            warnings.warn(f"CUDA graph capture of the target failed ({error}); decoding runs its forwards uncaptured")
            self.graph, self.graph_output, self.cuda_graph = None, None, False

    def _reset_lengths(self, start: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(start)


def additive_mask(allowed: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """(R, K) bool -> (R, K) additive mask: 0 where a row sees a key, dtype-min elsewhere (SDPA and eager alike)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(dtype).min)
