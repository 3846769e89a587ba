"""The frozen target: loaded one way for training, evaluation and the feature store, and its layer features.

    model, tokenizer = load_frozen_target("smollm2-135m", dtype=torch.bfloat16, adapter=None)
    features = target_layer_features(model, input_ids, layer_ids=[1, 9, 17])   # (S, T) -> (S, T, K*H)
    features, final = target_layer_features(model, input_ids, [1, 9, 17], final_hidden=True)  # and (S, T, H)
    logits = target_logits(model.get_output_embeddings()(final).float(), model.config)  # model(input_ids).logits

Training (training/module.py), the offline feature store (training/feature_store.py) and
`make eval` (training/evaluate.py) all load the target here, so the three see the same weights:
the same dtype rule and the same PEFT adapter merged at load. Distillation's teacher (training/loss.py) takes the
target's logits through `target_logits`: some families transform the LM head's output in their forward (Gemma-2's
softcap, Granite's and Cohere's scales).
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
# What a trainer.precision the drafter does not train in is told to be
PRECISION_CHOICES = f"give one of {', '.join(sorted(TRAINING_PRECISIONS))}, or auto (the fastest on this machine)"


def dtype_for_precision(precision: str | None, target_dtype: str = "auto") -> torch.dtype:
    """The frozen target's weight dtype: model.target_dtype if set, else what the Trainer computes in.

    No fp32 copy of a frozen model under bf16-mixed: the target runs in the training precision.
    A model.target_dtype that is not a dtype is a DDTreeError (the recipe checks call this before anything loads).
    """
    precision = str(precision or "32")
    if precision not in TRAINING_PRECISIONS:  # 64 trained the drafter in fp64 against an fp32 target: a traceback
        raise DDTreeError(f"trainer.precision={precision} is not one the drafter trains in: {PRECISION_CHOICES}")
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


# What a family's causal-LM forward does to its LM head's output x, by config.model_type (transformers'
# models/<family>/modeling_<family>.py): the field of its text config holding c, and softcap (c * tanh(x / c)), times
# (x * c) or over (x / c). The soft targets of distillation are the target's own distribution, softmax of those logits:
# softmax(x) is another (Granite's c = 16: a near one-hot). Monotone, so the argmax, and greedy decoding, are the same.
# Gemma-3's multimodal class (model_type gemma3) caps nothing, whatever its text config holds; MiniCPM3 divides the
# hidden state instead, the same through its bias-free head.
LOGIT_TRANSFORMS = {
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified",
                     "gemma4_unified_text", "vaultgemma", "nanochat", "beam"), ("final_logit_softcapping", "softcap")),
    "recurrent_gemma": ("logits_soft_cap", "softcap"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), ("logit_scale", "times")),
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
                     "minicpm3"), ("logits_scaling", "over")),
    "hyperclovax": ("logits_scaling", "times"),  # MuP: multiplies where Granite divides
    "falcon_h1": ("lm_head_multiplier", "times"),
}


def logit_transform(config) -> str | None:
    """What the target's forward does to its LM head's output, as "<field>=<value>" (LOGIT_TRANSFORMS): recorded in a
    top-k feature store, whose teacher it changes. None where it does nothing (most families; a Gemma-2 config with
    final_logit_softcapping null). config: the target's model.config."""
    field, _ = LOGIT_TRANSFORMS.get(getattr(config, "model_type", None), (None, None))
    value = None if field is None else getattr(config.get_text_config(), field, None)
    return None if value is None else f"{field}={float(value):g}"


def target_logits(head_output: torch.Tensor, config) -> torch.Tensor:
    """The target's next-token logits from its LM head's output (..., V), as its forward computes them: the output
    transformed as its family does (LOGIT_TRANSFORMS), in place (give a tensor of the caller's own: in fp32, the
    transform is exact where a bf16 forward rounds), returned; as it is where the family does nothing.
    config: the target's model.config; None: a head whose output is the logits."""
    if logit_transform(config) is None:
        return head_output
    field, operation = LOGIT_TRANSFORMS[config.model_type]
    value = float(getattr(config.get_text_config(), field))
    if operation == "softcap":
        return head_output.div_(value).tanh_().mul_(value)
    return head_output.mul_(value) if operation == "times" else head_output.div_(value)


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
