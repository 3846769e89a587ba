"""Decoding loops over one target and its KV cache, batch size 1: `ar`, `dflash` and `ddtree`.

    result = generate(target, prompt_ids, method="ddtree", drafter=DrafterRunner(drafter, target),
                      budget=32, max_new_tokens=256, stop_ids=[2])
    result.new_tokens, result.tau, result.rounds

Every method is lossless: each committed token is the target's own choice (its argmax at T=0,
a sample from its processed distribution at T>0), drafts only decide how many of those choices
one target forward can confirm. A round of `dflash`/`ddtree`:
  1. the drafter proposes per-depth logits for the block after the root (the last bonus token);
  2. `dflash` keeps the argmax chain, `ddtree` the best-first tree under the node budget;
  3. one target forward over [root, nodes...] with an ancestor-only mask;
  4. the walk accepts nodes while the target's token is a child; the target's token after the
     last accepted node is the next bonus;
  5. the target KV cache keeps the root and the accepted rows only (compacted to be contiguous),
     and the drafter context grows by the target features of exactly those rows.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Callable, Iterable

import torch
from transformers import DynamicCache, PreTrainedModel

from .arguments import STATIC_CACHE
from .calibration import OnlineCalibration
from .corpus import CorpusLookup
from .errors import error_line
from .modeling_dflash import DFlashDraftModel, fuse_target_features
from .names import METHODS
from .target_runner import DynamicTarget, context_limit, padded_capacity, static_target, storage_key
from .targets import DDTreeError, check_drafter_fits
from .sizing import TreeSizer
from .static_drafter import StaticDrafter, redraft_layout
from .tree import (
    DraftTree, ancestor_matrix, build_tree, chain_tree, context_lookup, graft_path, tree_positions, truncated, walk,
)

# Depth-1 tokens re-drafted behind, for drafters trained with model.redraft_prob (their config's `redraft`). On the
# CPU recipe's drafter (all 40 held-out prompts, budget 32): 4 and 8 both gave tau 2.16 (1 re-draft forward, 5 ms).
DEFAULT_REDRAFT = 4
# The draft temperatures a drafter config may hold (its fitted ones lie within 0.5..4, training/replay.py). Far below,
# fp32 logits divided by one overflow to inf and the tree's log-probabilities become NaN: no node is drafted.
DRAFT_TEMPERATURE_RANGE = (1e-2, 1e2)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus cut over the last axis (..., V): keep the smallest set of most likely tokens whose mass
    reaches top_p (the most likely token always stays), renormalised. The one top-p rule of the
    project: serving (Sampling) and data regeneration (data/regenerate.py) both use it.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before a token already reaches top_p
    probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum(dim=-1, keepdim=True)


# The three settings as a command's flags name them, for its errors (Sampling(..., names=SAMPLING_FLAGS)).
SAMPLING_FLAGS = ("--temperature", "--top-p", "--top-k")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    # how an error names the three: the keywords by default, a command's flags (SAMPLING_FLAGS); not stored
    names: InitVar[tuple[str, str, str]] = ("temperature", "top_p", "top_k")

    def __post_init__(self, names: tuple[str, str, str]):
        temperature, top_p, top_k = names
        # written so that NaN fails every test (NaN compares False with everything)
        broken = [rule for rule, holds in (
            (f"{temperature} {self.temperature} must be a finite number >= 0", 0 <= self.temperature < math.inf),
            (f"{top_p} {self.top_p} must be in (0, 1]", 0 < self.top_p <= 1),
            # a float (a config's 2.5) was a TypeError in the first token's topk, after the prefill
            (f"{top_k} {self.top_k!r} must be a whole number >= 0",
             whole_number(self.top_k) is not None and self.top_k >= 0),
        ) if not holds]
        if broken:
            raise DDTreeError(f"bad sampling settings: {'; '.join(broken)}")

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's sampling distribution for one row of logits (V,), after temperature, top-k, top-p."""
        # In float64, shifted so that the best score is 0: a tiny temperature then sends the others to -inf and
        # leaves the argmax at probability 1. In float32 the raw logits over it overflowed to +-inf, a temperature
        # under 1e-45 rounded to 0, and softmax gave NaN (1e-39 already did on logits of about 30).
        scores = logits.double()
        scores = (scores - scores.max()) / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth_best = scores.topk(self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth_best, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return top_p_filter(probs, self.top_p).float()

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """The target's own decoding rule on one row of logits (V,)."""
        if self.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(self.probabilities(logits), 1, generator=generator))

    def chooser(self, logits: torch.Tensor, generator: torch.Generator | None):
        """row -> `choose` on logits[row], for the rows of (R, V) logits that a walk visits, in order.

        Greedy on CUDA, every row's argmax in one kernel and one read instead of a launch and a wait per row
        walked; on a CPU the rows walked (about tau of them) cost less than all R."""
        if self.temperature == 0 and logits.is_cuda:
            return logits.argmax(dim=-1).tolist().__getitem__
        return lambda row: self.choose(logits[row], generator)


@dataclass
class Round:
    committed: int  # tokens this round added (accepted nodes + the bonus), after stop/length cuts
    tree_size: int  # draft nodes verified (0 for ar)
    draft_s: float = 0.0  # drafter forward and its logits
    verify_s: float = 0.0  # the target forward
    other_s: float = 0.0  # tree build, mask, walk, cache compaction, bookkeeping
    expected: float = 1.0  # the drafter's own predicted acceptance for this tree or chain (1 + sum of path probs)
    accepted_depth: int = 0  # accepted draft nodes, down to a stop token (committed - 1 unless a stop token ended it)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    new_tokens: list[int]
    rounds: list[Round] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped: bool = False  # ended on a stop token (else on max_new_tokens or the context limit)
    # why it ended: "stop" (a stop token), "max_new_tokens", or "context" (the target's context ran out first, short of
    # max_new_tokens): the one record `ddtree generate` and Decoder say the context's note from (context_note)
    ended: str = "max_new_tokens"

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per verification round (accepted drafts + the bonus); None when no round ran (the
        prefill's token was the last: max_new_tokens 1, or a stop token)."""
        return sum(r.committed for r in self.rounds) / len(self.rounds) if self.rounds else None

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_s + self.decode_s
        return len(self.new_tokens) / total if total > 0 else 0.0

    def context_note(self, method: str, asked: str, max_new_tokens: int) -> str:
        """The line said where the target's context ended the reply (ended "context"); `asked` names max_new_tokens
        as the caller gave it (`--max-new-tokens`). The reply filled the context, so the two lengths make it."""
        prompt, limit = len(self.prompt_ids), len(self.prompt_ids) + len(self.new_tokens)
        return (f"[{method}] stopped at the target's context of {limit} tokens (the prompt holds {prompt}), "
                f"{max_new_tokens - len(self.new_tokens)} short of {asked} {max_new_tokens}: give a shorter prompt for "
                "a longer reply")


def config_calibration(config) -> OnlineCalibration:
    """The replayed calibration a drafter's config holds (DFlashDrafterConfig.calibration), frozen; a broken one is
    one line naming the drafter's folder and the field."""
    try:
        calibration = OnlineCalibration.from_state(config.calibration)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as error:
        raise DDTreeError(f"drafter {config.name_or_path or '(given to DrafterRunner)'}: dflash_config.calibration in "
                          f"its config.json cannot be read ({error}): remove the field, or decode with --calibration "
                          "none") from None
    # Replayed as greedy decoding (training refuses sampled replies for it): decoding at a temperature is told so
    calibration.decoded_with = {"temperature": 0.0, **(calibration.decoded_with or {})}
    return calibration


class DrafterRunner:
    """Runs a DFlash drafter with the target's frozen embedding and LM head, caching its context.

    The decoding loop (`generate`) calls `reset`, `features` and `propose`, plus `redraft` when re-drafting, and
    reads `block_size`. `check_drafter_runner` checks a drafter for the calls it always makes, which the rigged
    drafters tests substitute (tests/rigged.py) provide too. Only a DrafterRunner is asked to `fix_shapes` (static
    decoding); the defaults it carries (default_lookup, default_redraft, default_corpus, default_calibration,
    draft_vocab) are read where present.
    """

    def __init__(
        self, drafter: DFlashDraftModel, target: PreTrainedModel, calibrated: bool = True,
        corpus: CorpusLookup | None = None, calibration: OnlineCalibration | None | bool = None,
    ):
        # calibrated=False ignores the config's draft temperatures: the raw logits, to fit new ones from;
        # corpus: the replies it was trained on, which generate grafts by default (the drafter folder's corpus file);
        # calibration: what `ddtree calibrate` learned on served prompts, which generate uses by default (frozen);
        # None takes the config's replayed calibration (model.replay_calibration) if it holds one, False neither
        # A drafter built for another target failed deep in its first forward (a shape mismatch, an index out of range).
        check_drafter_fits(drafter.config, target, "given to DrafterRunner")
        self.drafter = drafter.eval()
        self.embedding = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.layer_ids = drafter.target_layer_ids
        self.block_size = drafter.block_size
        self.mask_token_id = drafter.mask_token_id
        temperatures = getattr(drafter.config, "draft_temperatures", None)  # calibrated drafters only
        low, high = DRAFT_TEMPERATURE_RANGE
        if calibrated and temperatures and (len(temperatures) != drafter.block_size - 1
                                            or not all(low <= t <= high for t in temperatures)):
            raise DDTreeError(f"the drafter's config.json has draft_temperatures {temperatures}: give one positive number "
                              f"per drafted position ({drafter.block_size - 1}), each within {low:g}..{high:g}, or "
                              "remove the field to decode uncalibrated")
        self.temperatures = (
            None if not temperatures or not calibrated
            else torch.tensor(temperatures, dtype=torch.float32, device=self.lm_head.weight.device)[:, None]
        )  # (B-1, 1)
        self.draft_vocab = None if drafter.config.draft_vocab is None else torch.tensor(
            drafter.config.draft_vocab, device=self.lm_head.weight.device)  # the only tokens with finite logits
        self.default_redraft = drafter.config.redraft  # generate's redraft=None: what the drafter was trained for
        self.default_lookup = drafter.config.lookup  # generate's lookup=None: what its recipe measured to pay
        self.default_corpus = corpus  # generate's corpus=None: the one shipped with it (recipes with model.corpus)
        # whether the default below is the config's (model.replay_calibration), not a calibration file's
        # (an empty one, [] or {}, too: read, and refused, rather than taken for none without a word)
        self.calibration_from_config = calibration is None and calibrated and drafter.config.calibration is not None
        if self.calibration_from_config:
            calibration = config_calibration(drafter.config)
        # generate's online=None: the calibration given (the CLI's: the folder's calibration.json), else its config's
        self.default_calibration = calibration or None
        self._fixed: StaticDrafter | None = None  # the last fix_shapes' drafter, for the next generation that fits
        self.reset()

    def reset(self) -> None:
        """A new generation: an empty context, in a growing cache until `fix_shapes`."""
        self.cache = DynamicCache()
        self.context_end = 0  # positions [0, context_end) are in the drafter's cache
        self.static: StaticDrafter | None = None

    def fix_shapes(self, capacity: int, cuda_graph: bool | None = None) -> None:
        """Run this generation's forwards at fixed shapes over `capacity` context positions, replayed as CUDA
        graphs on a GPU (cuda_graph None) (ddtree/static_drafter.py); generate does this with the static cache.
        Later generations that fit reuse it, graphs and all (as static_target does for the target)."""
        fixed, storage = self._fixed, storage_key(self.drafter, self.embedding, self.lm_head)
        if (fixed is None or fixed.capacity < capacity or fixed.requested != cuda_graph
                or fixed.storage != storage):  # weights cast or moved since (a cast moves them): new buffers
            self._fixed = None  # its buffers go before the new ones are allocated
            fixed = self._fixed = StaticDrafter(self, padded_capacity(capacity), cuda_graph)
            fixed.storage = storage
        self.static = fixed

    def features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return fuse_target_features(hidden_states, self.layer_ids)  # (1, T, K*H)

    @torch.no_grad()
    def propose(self, root_token: int, start: int, new_context: torch.Tensor, depth: int) -> torch.Tensor:
        """Draft logits (depth, V) for positions start+1 .. start+depth.

        new_context: (1, T, K*H) target features of positions [start - T, start), the rows committed
        since the last call; they join the cached context. The root sits at `start`.
        """
        device = new_context.device
        context_start = start - new_context.shape[1]
        if context_start != self.context_end:
            raise RuntimeError(f"drafter context gap: cached up to {self.context_end}, new rows from {context_start}")
        if self.static is not None:
            logits = self.static.propose(root_token, start, new_context, depth)
            self.context_end = start
            return logits
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = root_token
        positions = torch.arange(context_start, start + self.block_size, device=device)[None]
        hidden = self.drafter(
            noise_embedding=self.embedding(block).to(self.drafter.dtype),
            target_hidden=new_context.to(self.drafter.dtype),
            position_ids=positions,
            past_key_values=self.cache,
        )  # (1, B, H)
        self.context_end = start
        return self._logits(hidden[0, 1 : 1 + depth], first_depth=1)

    def _logits(self, hidden: torch.Tensor, first_depth: int) -> torch.Tensor:
        """(..., n, V) draft logits of depths first_depth .. first_depth + n - 1 from drafter states (..., n, H)."""
        # The head runs on 2-D rows: on a strided 3-D slice it became a bmm that copied the head's weight per block.
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self.lm_head.weight.dtype)
        logits = self.drafter.compute_logits(rows, self.lm_head).view(*hidden.shape[:-1], -1)
        if self.temperatures is not None:  # calibrated
            logits = logits.float() / self.temperatures[first_depth - 1 : first_depth - 1 + hidden.shape[-2]]
        return logits

    @torch.no_grad()
    def redraft(self, root_token: int, start: int, firsts: list[int], depth: int) -> torch.Tensor:
        """Draft logits (len(firsts), depth - 1, V) for positions start+2 .. start+depth, one block per first token:
        [root, first, MASK...], re-drafted behind that depth-1 token (a drafter trained with model.redraft_prob).

        Called after `propose` for the same root: the context is already cached. All blocks run in one
        forward, each seeing the context and its own tokens only (training's block mask).
        """
        if start != self.context_end:
            raise RuntimeError(f"redraft at {start} without propose: the drafter's context ends at {self.context_end}")
        if self.static is not None:
            return self.static.redraft(root_token, start, firsts, depth)
        device, count, size = self.lm_head.weight.device, len(firsts), self.block_size
        blocks, positions, same_block = redraft_layout(root_token, start, firsts, size, self.mask_token_id, device)
        mask = torch.cat([torch.ones(count * size, start, dtype=torch.bool, device=device), same_block], 1)
        hidden = self.drafter(
            noise_embedding=self.embedding(blocks.view(1, -1)).to(self.drafter.dtype),
            target_hidden=self.drafter.fc.weight.new_zeros(1, 0, self.drafter.fc.in_features),  # nothing new to cache
            position_ids=positions,
            attention_mask=mask[None, None],
            past_key_values=self.cache,
        ).view(count, size, -1)
        return self._logits(hidden[:, 2 : 1 + depth], first_depth=2)


def draft_tree(
    draft_logits: torch.Tensor, budget: int | None, lookup: list[int] = (), sizer: TreeSizer | None = None,
    online: OnlineCalibration | None = None, branches: dict[int, torch.Tensor] | None = None,
    vocab: torch.Tensor | None = None,
    quoted: list[int] = (),
) -> DraftTree:
    """What a round verifies, from the drafter's (depth, V) logits: the best-first tree of `budget` nodes
    (`ddtree`), or with budget None the argmax chain (`dflash`), its path probabilities recorded as build_tree does.

    lookup (ddtree only): a continuation grafted into the tree as one more path (context_lookup); it takes
    len(lookup) of the budget, at most budget - 1 (the drafter keeps a node), so the tree never holds more than `budget`
    nodes. It may run deeper than the draft:
    its nodes there score -inf (the drafter says nothing of them), adding nothing to the expected acceptance.
    sizer (ddtree only): keep only the leading nodes that pay for their verify rows on this machine (ddtree/sizing.py).
    online: grafted nodes score their lookup's learned acceptance (OnlineCalibration) instead of the drafter's probability.
    branches: depth-1 token -> its re-drafted logits (depth - 1, V) for depths 2.. (`DrafterRunner.redraft`); the
    tree (or the chain, behind its first token) continues from those below that token.
    vocab: the drafter's draft vocabulary (DrafterRunner.draft_vocab), where the tree is built; None = every token.
    quoted (ddtree only): one more grafted path, the corpus's continuation (ddtree/corpus.py); it takes its length of
    the budget too, leaving the drafter at least one node. Its nodes keep the drafter's own path probabilities (online:
    the corpus's learned acceptance).
    """
    if budget is None:
        first = int(draft_logits[0].argmax())
        if branches and first in branches:  # the chain continues as re-drafted behind its first token
            draft_logits = torch.cat([draft_logits[:1], branches[first].to(draft_logits.dtype)])
        log_probs, tokens = torch.log_softmax(draft_logits.float(), dim=-1).max(dim=-1)  # (depth,) the argmax chain
        tree = chain_tree(tokens.tolist())
        tree.log_probs = log_probs.cumsum(0).tolist()
        return tree
    # A lookup may reach past the drafter's block (the target verifies any depth), but it leaves the drafter a node:
    # at a budget no larger than the copy, a copy that is wrong at depth 1 would otherwise leave nothing to accept.
    lookup = list(lookup)[: budget - 1]
    quoted = list(quoted)[: max(0, min(budget - len(lookup) - 1, draft_logits.shape[0]))]
    tree = build_tree(draft_logits, budget - len(lookup) - len(quoted), branches, vocab)
    if sizer is not None:
        tree = truncated(tree, sizer.size(tree.log_probs, extra_rows=len(lookup) + len(quoted)))
    if lookup:
        scores = [online.graft_log_prob("context", depth) for depth in range(1, len(lookup) + 1)] if online else None
        tree.grafted = graft_path(tree, lookup, _path_log_probs(draft_logits, branches, lookup), scores)
    if quoted:
        scores = [online.graft_log_prob("corpus", depth) for depth in range(1, len(quoted) + 1)] if online else None
        tree.quoted = graft_path(tree, quoted, _path_log_probs(draft_logits, branches, quoted), scores)
    return tree


def _path_log_probs(draft_logits: torch.Tensor, branches: dict[int, torch.Tensor] | None, path: list[int]) -> list[float]:
    """The drafter's log-probability of path[d] at depth d + 1: from the block's own rows, or below a re-drafted
    first token from its re-drafted rows, as build_tree scores the nodes under that token."""
    rows = draft_logits[: len(path)]
    if branches and path[0] in branches:
        rows = torch.cat([rows[:1], branches[path[0]][: len(path) - 1].to(rows.dtype)])
    log_probs = torch.log_softmax(rows.float(), dim=-1)  # (len(path), V)
    drafted = log_probs.gather(1, torch.tensor(path[: len(rows)], device=rows.device)[:, None])[:, 0].tolist()
    return drafted + [-math.inf] * (len(path) - len(rows))  # past the block the drafter says nothing


# layer_types whose layers keep a cache of every position (attention over the whole context), or no state at all
# (Nemotron-H's MLP and MoE layers); a windowed attention layer keeps the window's keys only.
WHOLE_CONTEXT_LAYER_TYPES = ("full_attention", "mlp", "moe")
WINDOWED_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def check_full_attention(target: PreTrainedModel) -> None:
    """Sliding-window layers keep only their window's keys, so their caches hold other positions than the
    tree's masks and the cache compaction assume (every layer holds positions 0..n); recurrent and convolutional
    layers (Jamba's, Qwen3-Next's linear_attention, LFM2's conv, Falcon-H1's hybrid) carry one state forward, which a
    verify would advance through its rejected nodes too. Refused, not misread, each for its reason."""
    config = target.config.get_text_config()
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    stateful = sorted({t for t in types or () if t not in WHOLE_CONTEXT_LAYER_TYPES + WINDOWED_LAYER_TYPES})
    if stateful:
        raise DDTreeError(f"target {getattr(target, 'name_or_path_for_ddtree', config.model_type)!r} "
                          f"({config.model_type}) has layer_types {'/'.join(map(repr, stateful))}: layers that carry a "
                          "state forward instead of a cache of every position, which a tree verify cannot roll back to "
                          "the nodes it accepts; use a target whose layers all attend to the whole context")
    sliding = any(t in WINDOWED_LAYER_TYPES for t in types) if types is not None else (
        window is not None and getattr(config, "use_sliding_window", True))
    if sliding:
        raise DDTreeError(f"target {getattr(target, 'name_or_path_for_ddtree', config.model_type)!r} has sliding-window "
                          f"attention (sliding_window={window}); decoding here needs every layer's full cache: use a "
                          "target whose layers all attend to the whole context")


def check_fixed_rope(target: PreTrainedModel) -> None:
    """A "longrope" target (Phi-3 style) rotates every row of a forward with its long frequency table once the forward's
    deepest position passes original_max_position_embeddings: a verify whose deepest node passes it would score the rows
    it keeps with other frequencies than greedy decoding, and commit other tokens. Refused, not misread. ("dynamic"
    rescales only past max_position_embeddings, which no forward here reaches: see context_limit.)"""
    config = target.config.get_text_config()
    parameters = getattr(config, "rope_parameters", None) or {}
    # one dict, or one per layer type ({"full_attention": {...}, ...})
    for rope in [parameters] if "rope_type" in parameters else [p for p in parameters.values() if isinstance(p, dict)]:
        if rope.get("rope_type") == "longrope":
            raise DDTreeError(f"target {getattr(target, 'name_or_path_for_ddtree', config.model_type)!r} has "
                              f"rope_parameters['rope_type'] 'longrope': a forward reaching past position "
                              f"{rope.get('original_max_position_embeddings')} (original_max_position_embeddings) "
                              "rotates all its rows with the long frequencies, so a verify would change the tokens "
                              "greedy decoding commits; use a target with one frequency table (rope_type default, "
                              "linear, yarn or llama3)")


ALIBI_MODEL_TYPES = ("bloom", "mpt")  # ALiBi always; Falcon says so in config.alibi


def check_no_alibi(target: PreTrainedModel) -> None:
    """ALiBi biases a key by its slot in the cache, not by its position id: in a verify a node's ancestors sit at
    their rows' slots, not their depths, so every row off the first branch was scored with other biases than greedy
    decoding's (an MPT target committed another token at a 2e-4 margin), and Falcon's and Bloom's caches could not be
    read at all (a traceback). Refused, not misread."""
    config = target.config.get_text_config()
    if config.model_type in ALIBI_MODEL_TYPES or getattr(config, "alibi", False) or \
            getattr(config, "position_embedding_type", None) == "alibi":
        raise DDTreeError(f"target {getattr(target, 'name_or_path_for_ddtree', config.model_type)!r} "
                          f"({config.model_type}) uses ALiBi position biases, which follow a key's cache slot, not its "
                          "position: a verify would change the tokens greedy decoding commits; use a target with "
                          "rotary or learned positions")


MASKED_ATTENTION = ("sdpa", "eager")  # transformers' attention kernels that apply a verify's 4-D additive mask as given


def check_tree_attention(target: PreTrainedModel, method: str) -> None:
    """A draft's verify hands the target one additive mask that lets each row see only its ancestors; a kernel that
    reads the mask as padding (flash attention does) would let rows see their siblings and commit tokens the target
    never chose, and the others are not checked here. Plain decoding passes no mask."""
    implementation = getattr(target.config.get_text_config(), "_attn_implementation", None) or "sdpa"
    if method != "ar" and implementation not in MASKED_ATTENTION:
        raise DDTreeError(f"target {getattr(target, 'name_or_path_for_ddtree', target.config.model_type)!r} attends "
                          f"with {implementation!r}; a verify's ancestor-only mask is applied as given by sdpa and eager "
                          f"only: load it with attn_implementation='sdpa' (or 'eager'), as ddtree.targets.load_target does")


def check_target_decodable(target: PreTrainedModel, method: str) -> None:
    """Every refusal of a target whose verify would commit other tokens than greedy decoding (generate's, and
    training's evaluation's before its first step). They read the config (and the attention kernel) only, so a
    stand-in `SimpleNamespace(config=..., name_or_path_for_ddtree=...)` is checked as a loaded target is."""
    check_full_attention(target)
    check_fixed_rope(target)
    check_no_alibi(target)
    check_tree_attention(target, method)


def check_corpus(method: str, corpus: CorpusLookup | bool | None) -> None:
    """A corpus given explicitly grafts into ddtree trees."""
    if isinstance(corpus, CorpusLookup) and method != "ddtree":
        raise DDTreeError(f"--corpus grafts into ddtree trees; method {method!r} has none: leave --corpus out")


def check_lookup(method: str, lookup: int) -> None:
    """A lookup length fits only ddtree."""
    if whole_number(lookup) is None:  # True was taken as 1, a float as a length
        raise DDTreeError(f"lookup {lookup!r} must be a whole number of tokens (an int), 0 = no context lookup")
    if lookup < 0:
        raise DDTreeError(f"lookup {lookup} must be >= 0 (0 = no context lookup)")
    if lookup and method != "ddtree":
        raise DDTreeError(f"lookup {lookup} grafts into ddtree trees; method {method!r} has none: give lookup 0")


def prompt_token_ids(prompt_ids, where: str = "prompt_ids") -> list[int]:
    """One prompt as a list of token ids, from a list or tuple of ids, a 1-D or (1, T) tensor or array, or what a
    tokenizer returns (a BatchEncoding: its "input_ids", less the padding its "attention_mask" marks); a batch of
    several, text or nothing is one line."""
    mask = None
    if isinstance(prompt_ids, Mapping):  # tokenizer(text, return_tensors="pt"), apply_chat_template(...) in transformers 5
        if "input_ids" not in prompt_ids:
            raise DDTreeError(f"{where} is a mapping without \"input_ids\" (keys {list(prompt_ids)[:5]}): give the "
                              "prompt's token ids")
        mask = prompt_ids.get("attention_mask")
        prompt_ids = prompt_ids["input_ids"]
    if isinstance(prompt_ids, (str, bytes)):
        raise DDTreeError(f"{where} is text ({prompt_ids[:40]!r}), not token ids: tokenize it first, "
                          "tokenizer(text)[\"input_ids\"]")
    try:
        given = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise DDTreeError(f"{where} must be token ids (a list of ints, or a 1-D or (1, length) tensor), got a "
                          f"{type(prompt_ids).__name__} ({error_line(error)})") from None
    if given.numel() and (given.is_floating_point() or given.is_complex()):  # 1.5 was cut to token 1 without a word
        raise DDTreeError(f"{where} must be token ids, whole numbers; got {given.dtype} values such as "
                          f"{given.reshape(-1)[0].item()!r}")
    if given.dtype == torch.bool:  # True decoded as token 1, a mask's [True, False] as the prompt [1, 0]
        raise DDTreeError(f"{where} must be token ids, whole numbers; got booleans: give the ids, not a mask")
    if given.dim() == 0:  # a bare 5 decoded as the one-token prompt [5], a slip for a list the message did not name
        raise DDTreeError(f"{where} must be token ids (a list of ints, or a 1-D or (1, length) tensor), got the single "
                          f"number {given.item()!r}: give [{given.item()!r}] for a one-token prompt")
    prompt = given.to(torch.long)
    if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
        raise DDTreeError(f"generate decodes one prompt at a time: {where} has shape {tuple(prompt.shape)}; give "
                          f"one sequence of token ids (or a (1, length) batch) per call")
    prompt = prompt.reshape(-1).tolist()
    if mask is not None:
        prompt = unpadded(prompt, mask, where)
    if not prompt:
        raise DDTreeError(f"the prompt is empty ({where} holds no token): give at least one, from which the target "
                          "predicts the first new one")
    return prompt


def unpadded(prompt: list[int], mask, where: str) -> list[int]:
    """The prompt's ids less a tokenizer's padding: the positions its attention_mask holds 0 at, when they are one
    leading run (left padding) or one trailing run (right padding). The pad ids were decoded as prompt before, and
    the reply silently differed from the unpadded prompt's."""
    try:
        attended = torch.as_tensor(mask).reshape(-1) != 0
    except (TypeError, ValueError, RuntimeError) as error:
        raise DDTreeError(f"{where}'s attention_mask is not 0s and 1s ({error_line(error)}): give the encoding as the "
                          "tokenizer returned it, or the prompt's token ids alone") from None
    if attended.numel() != len(prompt):
        raise DDTreeError(f"{where}'s attention_mask has {attended.numel()} positions for {len(prompt)} input_ids: "
                          "give the encoding as the tokenizer returned it, or the prompt's token ids alone")
    kept = int(attended.sum())
    if kept == len(prompt):
        return prompt
    if kept and attended[-kept:].all():  # left padding
        return prompt[-kept:]
    if kept and attended[:kept].all():  # right padding
        return prompt[:kept]
    raise DDTreeError(f"{where} has padding (attention_mask holds 0s) that is not one leading or trailing run "
                      f"(attended {kept} of {len(prompt)} positions): give the unpadded ids")


def stop_id_set(stop_ids) -> set[int]:
    """generate's stop_ids as a set: None (none), one id, a tensor or array of any shape, or any iterable of ids (a
    list, a tuple, a set, dict keys, nested or not); anything else in it is one line."""
    if stop_ids is None:
        return set()
    if isinstance(stop_ids, torch.Tensor) or type(stop_ids).__module__ == "numpy":  # a numpy array or scalar too
        try:
            ids = torch.as_tensor(stop_ids)
        except (TypeError, ValueError, RuntimeError) as error:  # a numpy array of objects (None, say)
            raise DDTreeError(f"stop_ids is not integer token ids ({error_line(error)})") from None
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise DDTreeError(f"stop_ids holds {ids.dtype} values: give integer token ids")
        return set(ids.reshape(-1).tolist())
    if isinstance(stop_ids, (str, bytes)):
        raise DDTreeError(f"stop_ids is text ({stop_ids[:40]!r}): give token ids, e.g. [tokenizer.eos_token_id]")
    try:
        members = list(stop_ids)
    except TypeError:  # not iterable: one id
        members = [stop_ids]
    ids = set()
    for member in members:
        if isinstance(member, (list, tuple, set, frozenset)) or getattr(member, "ndim", 0) > 0:
            ids |= stop_id_set(member)  # [generation_config.eos_token_id], which can be a list itself
            continue
        try:
            if isinstance(member, bool):
                raise TypeError
            ids.add(operator.index(member))  # an int, a numpy int, a 0-d integer tensor
        except (TypeError, ValueError, RuntimeError):
            raise DDTreeError(f"stop_ids holds {member!r}, not a token id: give integer ids (a tokenizer without an "
                              "eos token has eos_token_id None: leave it out)") from None
    return ids


def whole_number(value) -> int | None:
    """value as an int (a numpy int or a 0-d integer tensor too), or None for anything else: a float, text, a bool."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def check_max_new_tokens(max_new_tokens) -> int:
    """max_new_tokens as an int >= 0 (a numpy int or a 0-d tensor too); anything else is one line."""
    count = whole_number(max_new_tokens)
    if count is None or count < 0:  # a negative count silently generated nothing, None was a TypeError in a comparison
        raise DDTreeError(f"max_new_tokens {max_new_tokens!r} must be a whole number >= 0: the most new tokens to generate")
    return count


def check_drafter_runner(drafter, target: PreTrainedModel, redraft: int = 0) -> None:
    """The drafter generate and run_benchmark decode with is a runner (or one with its interface) of this target.

    The interface is what the decoding loop calls and reads: reset, features, propose and block_size, and redraft when
    it re-drafts (redraft > 0). A drafter of its own without one of them was an AttributeError after the prefill.
    """
    missing = [name for name in ("reset", "features", "propose", "block_size") if not hasattr(drafter, name)]
    if missing:
        raise DDTreeError(f"drafter is a {type(drafter).__name__}, not a DrafterRunner: wrap it, "
                          "DrafterRunner(drafter, target), which runs it with the target's embedding and LM head (a "
                          "drafter of its own needs reset, features, propose and block_size; it has no "
                          f"{', '.join(missing)})")
    if redraft and not hasattr(drafter, "redraft"):
        raise DDTreeError(f"redraft {redraft} re-drafts with the drafter's redraft method, which this "
                          f"{type(drafter).__name__} has not: give redraft 0, or a DrafterRunner")
    # A runner drafts through the embedding and LM head it was built with: another target's drafted silently, or an
    # embedding of fewer rows failed deep in the verify.
    if isinstance(drafter, DrafterRunner) and (drafter.embedding is not target.get_input_embeddings()
                                               or drafter.lm_head is not target.get_output_embeddings()):
        raise DDTreeError("this DrafterRunner was built for another target (it holds that target's embedding and LM "
                          "head): build one for this target, DrafterRunner(drafter, target)")


def drafter_defaults(
    method: str, drafter: DrafterRunner | None, lookup: int | None, redraft: int | None, sized: bool,
    corpus: CorpusLookup | bool | None = False,
) -> tuple[int, int, CorpusLookup | None]:
    """generate's lookup, redraft and corpus, where None means the drafter's own (its config's `lookup` and
    `redraft`, the corpus shipped in its folder), corpus True means that corpus too, and corpus False means none.

    The lookups graft into ddtree trees only. Re-drafting needs a drafter, and sizing for tokens per second on a CPU
    leaves it off: one more drafter forward a round cost more than it gained (docs/decoding.md, Re-drafting: 1.25x over ar
    against 1.32x on the 2-core EPYC).
    """
    if lookup is None:
        lookup = getattr(drafter, "default_lookup", 0) if method == "ddtree" else 0
    if redraft is None:
        redraft = getattr(drafter, "default_redraft", 0) if method != "ar" and not sized else 0
    if corpus is None or corpus is True:  # True: a corpus, which can only be the drafter's own
        corpus = getattr(drafter, "default_corpus", None) if method == "ddtree" else None
    return lookup, redraft, corpus or None


def check_budget(budget: int, target: PreTrainedModel) -> None:
    """A tree is verified in one forward beside the context: its nodes must fit the target's context."""
    limit = context_limit(target)
    if budget >= limit:
        raise DDTreeError(f"budget {budget}: a tree of that many nodes cannot be verified within the target's context of "
                          f"{limit} tokens; give a budget below it (published: 32)")


def check_redraft(method: str, redraft: int) -> None:
    """Re-drafting needs a drafter."""
    if whole_number(redraft) is None:  # a float was a TypeError in the first re-draft's topk, after the prefill
        raise DDTreeError(f"redraft {redraft!r} must be a whole number of depth-1 tokens (an int), 0 = one draft per "
                          "round")
    if redraft < 0:
        raise DDTreeError(f"redraft {redraft} must be >= 0 (0 = one draft per round)")
    if redraft and method == "ar":
        raise DDTreeError("redraft re-drafts a drafter's block; method 'ar' has none: give redraft 0")


def static_cache(static: bool | str | None, device: torch.device) -> bool:
    """generate's `static` resolved: None means the static cache on CUDA only (see generate); --static-cache's names
    ("auto", "on", "off") mean what they do there."""
    if isinstance(static, str) and static in STATIC_CACHE:
        static = STATIC_CACHE[static]
    if static is not None and not isinstance(static, bool):  # any text, "off" too, was taken as on
        raise DDTreeError(f"static {static!r} must be None (the static cache on CUDA only), True or False, or one of "
                          f"--static-cache's {', '.join(map(repr, STATIC_CACHE))}")
    return device.type == "cuda" if static is None else static


def check_sizer(method: str, adaptive: bool, static: bool) -> None:
    """Adaptive sizing fits only ddtree, and only a cache whose verify cost follows the rows (the dynamic one)."""
    if not adaptive:
        return
    if method != "ddtree":
        raise DDTreeError(f"adaptive tree size sizes ddtree trees; method {method!r} has none: drop it")
    if static:
        raise DDTreeError("adaptive tree size saves nothing with the static cache (every verify runs budget + 1 "
                          "rows): give --static-cache off, or drop adaptive sizing")


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # time what the GPU did, not when the launch returned
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate(
    target: PreTrainedModel,
    prompt_ids: list[int] | torch.Tensor | Mapping,  # a Mapping: a tokenizer's encoding, its unpadded "input_ids" decoded
    method: str = "ddtree",
    drafter: DrafterRunner | None = None,
    budget: int = 32,
    max_new_tokens: int = 256,
    stop_ids: Iterable[int] | torch.Tensor | int | None = (),  # a list, a set, a tensor or one id; None = none
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
    static: bool | str | None = None,
    online: OnlineCalibration | None = None,
    lookup: int | None = None,
    sizer: TreeSizer | None = None,
    redraft: int | None = None,
    corpus: CorpusLookup | bool | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` with one of METHODS. Batch size 1.

    on_tokens: called with each round's committed tokens as soon as they are (the first with the prefill's token), so a
    caller can show the reply as it grows (`ddtree generate`); its time is left out of the decoding's.

    online: temperatures learned from this call's rounds and kept for the next calls (OnlineCalibration); a frozen
    one (a calibration file) is used as it is; None = the drafter's default (DrafterRunner.default_calibration: the
    calibration the runner was built with, which the `ddtree` command reads from the drafter folder's calibration.json
    (`ddtree calibrate`), else the one the drafter's config holds (model.replay_calibration); none otherwise: a
    DrafterRunner reads no calibration.json itself).
    lookup (ddtree): graft up to this many tokens that followed the last recurrence of the context's
    latest tokens (`context_lookup`) into every tree, within the budget; 0 = the drafter's tree alone; None = the
    drafter's default (DrafterRunner.default_lookup: its config's `lookup`, 0 unless its recipe set model.lookup).
    sizer (ddtree, dynamic cache): each round verifies only the leading nodes of the budget's tree that pay
    for their rows under this machine's verify cost (ddtree/sizing.py); None = always the whole budget.
    redraft: after the block's draft, re-draft the rest of the block behind each of its `redraft` most likely
    depth-1 tokens (at most `budget`; the chain: behind its first), in one more drafter forward, and build the tree
    from those (DrafterRunner.redraft; for a drafter trained with model.redraft_prob). 0 = one draft per round; None = the
    drafter's default (DrafterRunner.default_redraft: its config's `redraft`, 0 for drafters not trained for it),
    except with a sizer (drafter_defaults).
    corpus (ddtree): graft what the target's replies most often said after the context's last tokens into every tree
    as one more path, within the budget (ddtree/corpus.py); False = none; None (or True) = the drafter's default
    (DrafterRunner.default_corpus: the corpus its folder ships, none unless its recipe set model.corpus).

    static: run the target over a preallocated cache at one verify shape (ddtree/target_runner.py), and a
    DrafterRunner's forwards at fixed shapes too (ddtree/static_drafter.py), each captured as a CUDA graph
    on a GPU; None = on CUDA only: on a CPU there is no launch overhead to save, and attention over every
    slot of the cache made rounds 10-19% slower (docs/benchmarks.md, Benchmarks). --static-cache's names ("auto",
    "on", "off") are taken too, as None, True and False.
    """
    if method not in METHODS:
        raise DDTreeError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    if method != "ar" and drafter is None:
        raise DDTreeError(f"method {method!r} needs a drafter")
    if method == "ddtree":
        count = whole_number(budget)  # a float was a TypeError deep in draft_tree's slicing
        if count is None:
            raise DDTreeError(f"budget {budget!r} must be a whole number of nodes (an int), at least 1")
        if count < 1:
            raise DDTreeError(f"budget {budget} must be at least 1")
        budget = count
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    stop = stop_id_set(stop_ids)
    check_corpus(method, corpus)
    lookup, redraft, corpus = drafter_defaults(method, drafter, lookup, redraft, sizer is not None, corpus)
    if corpus is not None:
        corpus.check_vocabulary(target.get_output_embeddings().weight.shape[0])
    if online is None and method != "ar":
        online = getattr(drafter, "default_calibration", None)
    check_lookup(method, lookup)
    check_redraft(method, redraft)
    if drafter is not None:  # after the defaults: a redraft the drafter's own default asks for needs its redraft too
        check_drafter_runner(drafter, target, redraft)
    device = target.device
    if sampling.temperature > 0 and generator is not None and generator.device.type != device.type:
        # else torch.multinomial's RuntimeError after the prefill; greedy decoding draws nothing from it
        raise DDTreeError(f"generator on {generator.device}, target on {device}: sampling draws on the target's device; "
                          "build it there (torch.Generator(device=target.device))")
    static = static_cache(static, device)
    check_sizer(method, sizer is not None, static)
    check_target_decodable(target, method)
    prompt = prompt_token_ids(prompt_ids)
    rows = target.get_input_embeddings().weight.shape[0]
    outside = [token for token in prompt if not 0 <= token < rows]
    if outside:  # else an IndexError deep in the embedding
        raise DDTreeError(f"prompt token id {outside[0]} is outside the target's {rows} embedding rows (0..{rows - 1}): "
                          "give ids from the target's own tokenizer")
    limit = context_limit(target)
    if len(prompt) >= limit:
        raise DDTreeError(f"prompt of {len(prompt)} tokens does not fit the target's context of {limit} tokens: "
                          f"give one of at most {limit - 1}, which leaves the position of one new token")
    if method == "ddtree":
        check_budget(budget, target)
    asked, max_new_tokens = max_new_tokens, min(max_new_tokens, limit - len(prompt))
    result = GenerationResult(prompt_ids=prompt, new_tokens=[])
    if max_new_tokens <= 0:
        return result
    use_drafter = method != "ar"
    if static:
        verify_rows = 1 + (budget if method == "ddtree" else drafter.block_size - 1 if use_drafter else 0)
        runner = static_target(target, use_drafter, verify_rows, needed=len(prompt) + max_new_tokens + verify_rows)
    else:
        runner = DynamicTarget(target, use_drafter)

    t0 = _now(device)
    last_logits, hidden = runner.prefill(prompt)
    root = sampling.choose(last_logits, generator)
    result.new_tokens.append(root)
    new_context = drafter.features(hidden) if use_drafter else None
    if use_drafter:
        drafter.reset()
        if static and isinstance(drafter, DrafterRunner):  # the drafter's forwards at fixed shapes too
            drafter.fix_shapes(capacity=len(prompt) + max_new_tokens)
    result.prefill_s = _now(device) - t0
    result.stopped = root in stop
    if on_tokens is not None:
        on_tokens([root])
    streamed_s = 0.0  # in on_tokens after each round, left out of decode_s

    start = len(prompt)  # position of the root: committed, not yet in the target's cache
    shape = OnlineCalibration.shape(method, budget)  # draft_tree's budget: None builds the chain
    t_decode = _now(device)
    while not result.stopped and len(result.new_tokens) < max_new_tokens:
        t_round = _now(device)
        room = max_new_tokens - len(result.new_tokens)  # tokens this round may still commit
        depth = min(room - 1, limit - 1 - start)  # deeper nodes could never be committed
        draft_s = 0.0
        expected = 1.0
        grafted, quoted = [], []  # the lookups' paths (ddtree only)
        if use_drafter and depth > 0:
            graft_depth = depth  # a lookup's copy can run past the block: the target verifies any depth
            depth = min(depth, drafter.block_size - 1)
            draft_logits = drafter.propose(root, start, new_context, depth)  # (depth, V)
            branches = None
            if redraft and depth > 1:
                # a tree holds at most `budget` depth-1 nodes (the chain one): more re-drafts would only cost memory
                count = min(redraft, budget) if method == "ddtree" else 1
                firsts = draft_logits[0].topk(min(count, draft_logits.shape[-1])).indices.tolist()
                branches = dict(zip(firsts, drafter.redraft(root, start, firsts, depth)))  # token -> (depth - 1, V)
            if online is not None:
                draft_logits = draft_logits.float() / online.temperature(shape)
                if branches:
                    branches = {token: rows.float() / online.temperature(shape) for token, rows in branches.items()}
            t_drafted = _now(device)
            draft_s = t_drafted - t_round
            grafted = context_lookup(prompt + result.new_tokens, min(lookup, graft_depth)) if lookup else []
            quoted = corpus.continuation(prompt + result.new_tokens, depth) if corpus is not None else []
            tree = draft_tree(draft_logits, shape, grafted, sizer, online, branches, getattr(drafter, "draft_vocab", None),
                              quoted)
            expected = tree.expected_acceptance_before(stop)
        else:
            t_drafted = t_round
            tree = chain_tree([])
        positions, mask = tree_positions(tree, start), ancestor_matrix(tree)  # in other_s, as Round says
        t_verify = _now(device)
        logits, hidden = runner.verify([root] + tree.tokens, positions, mask, start)
        t_verified = _now(device)  # logits (1 + n, V)

        accepted, bonus = walk(tree, sampling.chooser(logits, generator))
        path = [tree.tokens[row - 1] for row in accepted]  # the accepted draft tokens
        # The reply ends at an accepted stop token: the nodes below it, which the target also accepted, are never
        # committed, nor counted as accepted (accepted_depth, online calibration), nor expected (above).
        cut = next((i + 1 for i, token in enumerate(path) if token in stop), len(path))
        accepted, path = accepted[:cut], path[:cut]
        if online is not None:
            online.observe_round(shape, tree, expected, grafted, quoted, path)
        committed = (path + [bonus])[:room]
        for i, token in enumerate(committed):
            if token in stop:
                committed = committed[: i + 1]
                result.stopped = True
                break
        result.new_tokens.extend(committed)
        kept_rows = [0] + accepted  # the root and the accepted nodes enter the cache
        if not result.stopped and len(result.new_tokens) < max_new_tokens:
            runner.keep(start, kept_rows)
            if use_drafter:
                new_context = drafter.features(hidden)[:, kept_rows]
            start += len(kept_rows)
            root = bonus
        t_end = _now(device)
        if sizer is not None and len(tree):
            sizer.observe_overhead(1000 * ((t_end - t_round) - (t_verified - t_verify)))  # all but the verify
        result.rounds.append(
            Round(
                committed=len(committed),
                tree_size=len(tree),
                draft_s=draft_s,
                verify_s=t_verified - t_verify,
                other_s=(t_end - t_round) - draft_s - (t_verified - t_verify),
                expected=expected,
                accepted_depth=len(accepted),
            )
        )
        if on_tokens is not None:  # (a round commits at least its bonus token)
            t_stream = time.perf_counter()
            on_tokens(committed)
            streamed_s += time.perf_counter() - t_stream
    result.decode_s = _now(device) - t_decode - streamed_s
    result.ended = "stop" if result.stopped else "context" if max_new_tokens < asked else "max_new_tokens"
    return result
