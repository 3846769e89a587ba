"""The block-diffusion (DFlash) drafter: one forward proposes a whole block of future tokens.

The drafter reads hidden features of a frozen target LLM (K chosen layers, concatenated and
fused by `fc` + `hidden_norm`) and injects them as extra keys/values into every one of its
N Qwen3-style layers. Its input is a block [anchor, MASK, ..., MASK] embedded with the
target's embedding; output at block position k predicts the token at anchor_position + k,
read through the target's LM head. The block attends bidirectionally within itself and to
all context strictly before the anchor. Embedding and LM head belong to the target and are
never stored here.

Parameter names match the published DFlash checkpoints, so the reference implementation
(`dflash.DFlashDraftModel`) loads a folder saved by this class and computes the same logits.
This file ships to the Hub as remote code: it imports torch and transformers only.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .configuration_dflash import DFlashDrafterConfig

try:  # flex attention serves the sparse training mask on CUDA; SDPA with a dense mask elsewhere
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch < 2.5
    BlockMask, flex_attention = None, None
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA's backends on CUDA, cuDNN's left out. Seen on an H200 (torch 2.11, 2026-11-26), with cuDNN's kernel
# chosen: a decoding round cost tens of milliseconds more at lengths the process had not yet met (re-drafted
# ddtree rounds drafted in 74 ms a round on a first pass over one prompt's lengths, 4.8 ms on a second pass
# over the same lengths; `ddtree bench`, always at new lengths, 30 ms), and decoding meets a new key length
# every round. cuDNN builds its attention graph per shape, the likely cause; the gain is not yet measured.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device):
    """Context for attention calls whose shapes change call after call: SDPA without cuDNN on CUDA, as is elsewhere."""
    return sdpa_kernel(_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def fuse_target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate target layer outputs on the feature axis: (B, T, H) x K -> (B, T, K*H).

    Layer id l is the output of decoder layer l, i.e. hidden_states[l + 1] (index 0 is the embedding).
    """
    return torch.cat([hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)


_COMPILED_FLEX = None
# The main flex kernel always. Without gradients and under 128 queries inductor picks its flex-decoding kernel
# instead, and on an H200 (torch 2.11, bf16 autocast) that one missed the dense mask's output by 2.0, as large
# as the output itself, in every block of a 6 x 4-query batch, while the same call with gradients, or in fp32,
# matched it to 0.02 and 0.000 (2026-11-26). Training's own batches have 64 blocks of 16 queries; validation with few
# anchors or small blocks would have met it.
FLEX_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def _compiled_flex_attention():
    """flex_attention compiled once per input shape; callers keep the shapes fixed across batches.

    Why static shapes: uncompiled, flex attention materialises the whole score matrix, and dynamo
    compiles a new kernel for each new shape until its recompile limit (8), then runs uncompiled. A
    shape-generic compile (dynamic=True) did not build with torch 2.13's CPU inductor (C++ compile
    errors in the code generated for flex_attention and for create_block_mask; CUDA not tried),
    whereas padded to fixed shapes it compiled once (about 6 s on a loaded 2-core CPU) and ran every
    later batch without recompiling, the same code on every device. Training pads its batches
    (training/masks.py, `pad_for_flex`).
    """
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, D); cos/sin: (B, T, D)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _attention(q, k, v, mask, scaling):
    """q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D); mask: None, bool (B|1, 1, Tq, Tk) or a flex BlockMask."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        # Compiled, flex attention runs the sparse kernel (forward only on CPU: it has no CPU backward).
        return _compiled_flex_attention()(q, k, v, block_mask=mask, scale=scaling, enable_gqa=True,
                                          kernel_options=FLEX_KERNEL_OPTIONS)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head across its query heads
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    with sdpa_backends(q.device):  # the drafter's context grows every decoding round
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [target context ; block], each with its own RoPE positions."""

    def __init__(self, config: DFlashDrafterConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        batch, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v  # (B, Hkv, T, D) each

    def forward(
        self,
        block: torch.Tensor,  # (B, Tq, H) normalised block states
        context: torch.Tensor,  # (B, Tc, H) fused target features (Tc may be 0 with a cache)
        cos: torch.Tensor,  # (B, Tc + Tq, D)
        sin: torch.Tensor,
        attention_mask,
        cache: Cache | None,
    ) -> torch.Tensor:
        batch, block_len, _ = block.shape
        context_len = context.shape[1]
        q = self.q_norm(self.q_proj(block).view(batch, block_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos[:, context_len:], sin[:, context_len:])
        k_ctx, v_ctx = self._keys_values(context, cos[:, :context_len], sin[:, :context_len])
        if cache is not None:  # only the context is cached; the block is recomputed every round
            k_ctx, v_ctx = cache.update(k_ctx, v_ctx, self.layer_idx)
        k_blk, v_blk = self._keys_values(block, cos[:, context_len:], sin[:, context_len:])
        k = torch.cat([k_ctx, k_blk], dim=2)  # (B, Hkv, Tc_total + Tq, D)
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = _attention(q, k, v, attention_mask, self.scaling)  # (B, Hq, Tq, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, block_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashDrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin, attention_mask, cache, dropout: float = 0.0):
        attended = self.self_attn(self.input_layernorm(hidden), context, cos, sin, attention_mask, cache)
        hidden = hidden + _dropout(attended, dropout, self.training)
        return hidden + _dropout(self.mlp(self.post_attention_layernorm(hidden)), dropout, self.training)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p and training else x  # no kernel at all when off


class DFlashDraftModel(PreTrainedModel):
    """The drafter network. See the module docstring; `forward` returns final hidden states."""

    config_class = DFlashDrafterConfig
    config: DFlashDrafterConfig
    base_model_prefix = "drafter"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: DFlashDrafterConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        num_features = len(config.target_layer_ids)
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.gradient_checkpointing = False
        # Training only (model.dropout), like gradient_checkpointing not part of the saved config: the share of
        # the fused context and of each layer's residual branches zeroed in training mode.
        self.dropout = 0.0
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def forward(
        self,
        noise_embedding: torch.Tensor,  # (B, Tq, H): target embedding of [anchor, MASK...] block(s)
        target_hidden: torch.Tensor,  # (B, Tc, K*H): raw concatenated target features
        position_ids: torch.LongTensor,  # (B, Tc + Tq): context positions, then block positions
        attention_mask=None,  # None = every query sees everything; else bool (B|1, 1, Tq, Tc_total+Tq) or BlockMask
        past_key_values: Cache | None = None,  # caches context keys/values across decoding rounds
    ) -> torch.Tensor:
        context = _dropout(self.hidden_norm(self.fc(target_hidden)), self.dropout, self.training)  # (B, Tc, H)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)  # (B, Tc + Tq, D)
        hidden = noise_embedding
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden = torch.utils.checkpoint.checkpoint(
                    layer, hidden, context, cos, sin, attention_mask, past_key_values, self.dropout, use_reentrant=False
                )
            else:
                hidden = layer(hidden, context, cos, sin, attention_mask, past_key_values, self.dropout)
        return self.norm(hidden)  # (B, Tq, H)

    def draft_head(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(config.draft_vocab as a (V',) tensor, those rows of the target's LM head (V', H)), or None without one.

        Gathered once per head weight and vocabulary (the head is frozen) and reused; a change in place through the
        weight (not its `.data`, which no version counter sees) gathers again, and so does another weight, at a freed
        one's address too, and another vocabulary (the config's setter stores a new list, compared by identity).
        """
        vocab = self.config.draft_vocab
        if vocab is None:
            return None
        weight = lm_head.weight
        key = (weight.data_ptr(), weight.device, weight.dtype, weight._version)
        # The weight gathered from, by identity: a freed head's address and version 0 go to the next tensor allocated,
        # which the key alone served the freed head's rows. Held weakly, not as packed_linear holds its layer's own
        # weight: this one is the target's, which a strong hold would keep alive past the target.
        source = getattr(self, "_draft_head_source", None)
        if (getattr(self, "_draft_head_key", None) != key or getattr(self, "_draft_head_vocab", None) is not vocab
                or source is None or source() is not weight):
            ids = torch.tensor(vocab, device=weight.device)
            self._draft_head, self._draft_head_key = (ids, weight.detach()[ids]), key
            self._draft_head_source, self._draft_head_vocab = weakref.ref(weight), vocab
        return self._draft_head

    def __getstate__(self) -> dict:
        # draft_head's cache is this process's: its weak reference does not pickle (torch.save of the whole model), and
        # a copy (copy.deepcopy reads this too) gathers its own rows on first use
        return {key: value for key, value in super().__getstate__().items() if not key.startswith("_draft_head")}

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Draft logits through the target's (frozen) LM head: (..., H) -> (..., V).

        With a draft vocabulary only its rows are computed; every other token gets -inf (probability 0).
        """
        head = self.draft_head(lm_head)
        if head is None:
            return lm_head(hidden)
        ids, rows = head
        logits = hidden.new_full((*hidden.shape[:-1], lm_head.weight.shape[0]), float("-inf"))  # (..., V)
        logits[..., ids] = F.linear(hidden, rows)
        return logits
