"""The frozen target: loaded one way for training, evaluation and the feature store, and its layer features.

    model, tokenizer = load_frozen_target("smollm2-135m", dtype=torch.bfloat16, adapter=None)
    features = target_layer_features(model, input_ids, layer_ids=[1, 9, 17])   # (S, T) -> (S, T, K*H)

Training (training/module.py), the offline feature store (training/feature_store.py) and
`make eval` (training/evaluate.py) all load the target here, so the three see the same weights:
the same dtype rule and the same PEFT adapter merged at load.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ddtree.errors import DDTreeError
from ddtree.modeling_dflash import sdpa_backends
from ddtree.targets import load_target, parse_dtype

from .peft_utils import merge_target_adapter


# Lightning's precision names the drafter trains in -> the frozen target's dtype under them
TRAINING_PRECISIONS = {
    "32": torch.float32, "32-true": torch.float32,
    "bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
    "16": torch.float16, "16-mixed": torch.float16, "16-true": torch.float16,
}


def dtype_for_precision(precision: str | None, target_dtype: str = "auto") -> torch.dtype:
    """The frozen target's weight dtype: model.target_dtype if set, else what the Trainer computes in.

    No fp32 copy of a frozen model under bf16-mixed: the target runs in the training precision.
    A model.target_dtype that is not a dtype is a DDTreeError (the recipe checks call this before anything loads).
    """
    precision = str(precision or "32")
    if precision not in TRAINING_PRECISIONS:  # 64 trained the drafter in fp64 against an fp32 target: a traceback
        raise DDTreeError(f"trainer.precision={precision} is not one the drafter trains in: give one of "
                          f"{', '.join(sorted(TRAINING_PRECISIONS))}, or auto (the fastest on this machine)")
    if target_dtype and target_dtype != "auto":
        try:
            return parse_dtype(target_dtype, "model.target_dtype")
        except DDTreeError as error:
            raise DDTreeError(f"{error}, or auto (the trainer's precision)") from None
    return TRAINING_PRECISIONS[precision]


def load_frozen_target(
    name_or_path: str, dtype: torch.dtype, adapter: str | None = None, device: str | torch.device = "cpu",
    adapter_field: str = "model.target_adapter",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target in eval mode with no gradients, an optional PEFT adapter folded into its weights (an adapter that
    does not fit is a DDTreeError naming `adapter_field`, where it was given)."""
    model, tokenizer = load_target(name_or_path, dtype=dtype, device=device)
    if adapter:
        model = merge_target_adapter(model, adapter, name_or_path, adapter_field)
    return model.eval().requires_grad_(False), tokenizer


class _EnoughLayers(Exception):
    """Raised by a forward hook once the deepest needed layer has run: the rest of the target is skipped."""


def decoder_layers(target: PreTrainedModel, decoder: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layers, whose outputs are the target's hidden states: decoder.layers (Llama, Qwen, Mistral,
    Gemma and most), or decoder.h (GPT-2, GPT-J, CodeGen, Falcon: hidden_states[l + 1] is h[l]'s output there too)."""
    for name in ("layers", "h"):
        if isinstance(getattr(decoder, name, None), torch.nn.ModuleList):
            return getattr(decoder, name)
    raise DDTreeError(f"target {getattr(target, 'name_or_path_for_ddtree', target.config.model_type)!r} "
                      f"({target.config.model_type}) keeps its decoder layers elsewhere than decoder.layers or "
                      "decoder.h, where training reads the target's features: train against a Llama-, Qwen-, "
                      "Mistral- or Gemma-style target")


@torch.no_grad()
def target_layer_features(
    target: PreTrainedModel, input_ids: torch.Tensor, layer_ids: list[int], final_hidden: bool = False
):
    """Hidden states of the chosen target layers, concatenated: (S, T) -> (S, T, K*H).

    Layer id l is the output of decoder layer l (hidden_states[l + 1] of a full forward), the same
    features `fuse_target_features` builds at inference. The last layer's entry there is the decoder's
    final normed output (transformers hands out hidden_states[-1] so), so the last layer is read so here
    too. Layers past max(layer_ids) and the LM head never run, unless final_hidden=True: then the whole
    decoder runs and its final (normed) hidden states (S, T, H) come back too, as (features, final), for
    soft targets through the LM head.
    No attention mask is passed: batches are right-padded and attention is causal, so no real token
    ever sees padding (and SDPA keeps its causal fast path).
    """
    decoder = target.get_decoder()
    layers = decoder_layers(target, decoder)
    captured: dict[int, torch.Tensor] = {}
    deepest, last = max(layer_ids), len(layers) - 1
    whole = final_hidden or deepest == last  # the last layer's features are the decoder's normed output

    def capture(layer_id: int):
        def hook(module, args, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == deepest and not whole:
                raise _EnoughLayers

        return hook

    handles = [layers[i].register_forward_hook(capture(i)) for i in sorted(set(layer_ids))]
    try:
        # Batch lengths vary: on CUDA, SDPA without cuDNN's per-shape set-up (ddtree/modeling_dflash.py). In the
        # H200 run the forward took 0.067-0.098 s over the first 40 steps and around 0.03 s after, with a
        # 0.09 s step at 79: lengths not met before, the likely cost.
        with sdpa_backends(input_ids.device):
            output = decoder(input_ids=input_ids, use_cache=False)
    except _EnoughLayers:
        output = None
    finally:
        for handle in handles:
            handle.remove()
    if deepest == last:
        captured[last] = output.last_hidden_state
    features = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return (features, output.last_hidden_state) if final_hidden else features
