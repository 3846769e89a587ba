"""What vLLM and SGLang read from an exported drafter folder: their rules, and the commands that serve it.

    export = Export(config, weight_shapes(folder), target_facts("tiny-random", config))   # as `make export` reads it
    problems = engine_problems(export)       # [Problem]: each engine rule the folder breaks, none if it serves
    vllm_command(target, folder, block_size), sglang_command(target, folder, block_size)

No engine is imported (their GPU wheels do not install here): each rule restates, from the engine's
source, one thing it reads from config.json or the weights and what it does with it, and names that
file. `make export` (training/publish.py) applies every rule to the folder it is about to publish and
refuses it, in one line, when an engine would not load it or would serve it wrong.

Both engines serve the DFlash block as a chain: neither verifies a draft tree on its main branch
(open pull requests: vLLM #42910, SGLang #31069 and #36196). DDTree's tree is this project's decoder.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from huggingface_hub import hf_hub_download

from ddtree.drafters import weight_shapes as folder_weight_shapes
from ddtree.errors import DDTreeError, error_line
from ddtree.targets import is_int, resolve_target

VLLM, SGLANG = "vLLM", "SGLang"
ARCHITECTURE = "DFlashDraftModel"  # the class name both engines register for a DFlash drafter
OPTIONAL_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")  # vLLM uses the target's when absent


@dataclass(frozen=True)
class TargetFacts:
    """The target as the engines compare a drafter with it (its text config)."""

    hidden_size: int | None  # None when only the drafter's own record of its target could be read
    num_hidden_layers: int
    vocab_size: int
    source: str  # where these came from, for the messages


@dataclass(frozen=True)
class Export:
    """A drafter folder as an engine reads it."""

    config: dict  # config.json
    weights: dict[str, tuple[int, ...]]  # tensor name -> shape, from model.safetensors
    target: TargetFacts


@dataclass(frozen=True)
class Rule:
    engine: str
    field: str  # what it reads: a config.json field, or the weights
    source: str  # the engine file the rule comes from
    check: Callable[[Export], str | None]  # what is wrong (with the value), or None


@dataclass(frozen=True)
class Problem:
    rule: Rule
    message: str

    def line(self) -> str:
        return f"{self.rule.engine} would reject this drafter: {self.rule.field} {self.message} ({self.rule.source})"


# ----------------------------------------------------------------------------- reading a folder and its target


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a drafter folder's weights, from the safetensors headers (ddtree.drafters reads them)."""
    return {name: tuple(shape) for name, (shape, _) in folder_weight_shapes(Path(folder)).items()}


def target_facts(target: str | None, drafter_config: dict) -> TargetFacts:
    """The target's facts from its config.json (a built-in's, a folder's, or a Hub id's, cached or fetched).

    When it cannot be read (offline, no Hub id), the drafter's own record of the target it was built
    for stands in: its num_target_layers and vocab_size; the target's hidden size is then unknown.
    """
    try:
        if target is None:
            raise DDTreeError("the checkpoint names no target")
        source = resolve_target(target)
        path = Path(source) / "config.json"
        if not path.is_file():
            path = Path(hf_hub_download(source, "config.json"))
        config = json.loads(path.read_text())
        text = config.get("text_config") or config
        return TargetFacts(text["hidden_size"], text["num_hidden_layers"], text["vocab_size"],
                           f"{target}'s config.json")
    except (DDTreeError, OSError, ValueError, KeyError) as error:
        return TargetFacts(
            hidden_size=None, num_hidden_layers=drafter_config["num_target_layers"],
            vocab_size=drafter_config["vocab_size"],
            source=(f"the drafter's own record of its target, as {target!r} could not be read "
                    f"({error_line(error)}); the target's hidden size is not checked"),
        )


# ----------------------------------------------------------------------------- shared reading


def _is_id_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(i) for i in value)


def rope_theta(layer: dict):
    return (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))


def expected_weights(layer: dict, fc_input: int) -> dict[str, tuple[int, ...]] | None:
    """Every tensor a DFlash drafter of this layer config holds, with its shape; None if a size is not an int.

    Both engines build the same names, without a prefix, from the same Qwen3 fields.
    """
    sizes = [layer.get(key) for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "intermediate_size", "num_hidden_layers")]
    if not all(is_int(size) for size in sizes) or not is_int(fc_input):
        return None
    hidden, heads, kv_heads, head_dim, intermediate, layers = sizes
    shapes = {"fc.weight": (hidden, fc_input), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        attention, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        shapes |= {
            f"{attention}q_proj.weight": (heads * head_dim, hidden),
            f"{attention}k_proj.weight": (kv_heads * head_dim, hidden),
            f"{attention}v_proj.weight": (kv_heads * head_dim, hidden),
            f"{attention}o_proj.weight": (hidden, heads * head_dim),
            f"{attention}q_norm.weight": (head_dim,),
            f"{attention}k_norm.weight": (head_dim,),
            f"{mlp}gate_proj.weight": (intermediate, hidden),
            f"{mlp}up_proj.weight": (intermediate, hidden),
            f"{mlp}down_proj.weight": (hidden, intermediate),
            f"layers.{i}.input_layernorm.weight": (hidden,),
            f"layers.{i}.post_attention_layernorm.weight": (hidden,),
        }
        if layer.get("attention_bias"):
            shapes |= {f"{attention}q_proj.bias": (heads * head_dim,), f"{attention}o_proj.bias": (hidden,),
                       f"{attention}k_proj.bias": (kv_heads * head_dim,),
                       f"{attention}v_proj.bias": (kv_heads * head_dim,)}
    return shapes


def missing_or_misshapen(export: Export, expected: dict[str, tuple[int, ...]]) -> str | None:
    missing = [name for name in expected if name not in export.weights]
    if missing:
        return f"lack {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    for name, shape in expected.items():
        if export.weights[name] != shape:
            return f"hold {name} of shape {list(export.weights[name])}, the config makes it {list(shape)}"
    return None


def layer_types_problem(layer: dict) -> str | None:
    """Both engines run a "full_attention" drafter layer non-causal, as the block was trained; not other types."""
    types = layer.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layer.get("num_hidden_layers"):
        return f"{types!r} must list one type per drafter layer ({layer.get('num_hidden_layers')})"
    others = sorted({kind for kind in types if kind != "full_attention"})
    if others:
        return (f"holds {others}: the engine would run those layers causal or windowed, but the drafter was "
                "trained with full attention within its block")
    return None


def hidden_size_problem(hidden_size, target: TargetFacts) -> str | None:
    if target.hidden_size is None or hidden_size == target.hidden_size:
        return None
    return f"{hidden_size} != the target's {target.hidden_size} ({target.source})"


def mask_range_problem(mask_token_id, target: TargetFacts) -> str | None:
    if mask_token_id is None:
        return "is missing (dflash_config.mask_token_id, or a top-level mask_token_id)"
    if not is_int(mask_token_id) or not 0 <= mask_token_id < target.vocab_size:
        return (f"{mask_token_id!r} is not a token of the target's vocabulary (0..{target.vocab_size - 1}, "
                f"{target.source}): the engine embeds MASK with the target's embedding")
    return None


# ----------------------------------------------------------------------------- vLLM

VLLM_MODEL = "vllm/model_executor/models/qwen3_dflash.py"


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def vllm_layer_config(config: dict) -> dict:
    # vllm/transformers_utils/configs/speculators: the speculators format keeps the draft layers' config apart.
    return (config.get("transformer_layer_config") or {}) if is_speculators(config) else config


def vllm_target_layer_ids(config: dict):
    """0-based ids, "the output of layer k", as vLLM resolves them (speculators: aux ids minus one)."""
    if is_speculators(config):
        aux = config.get("aux_hidden_state_layer_ids")
        return [i - 1 for i in aux] if _is_id_list(aux) else aux
    return (config.get("dflash_config") or {}).get("target_layer_ids")


def vllm_mask_token_id(config: dict):
    return (config.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id"))


def vllm_architectures(export: Export) -> str | None:
    # registry.py maps the name DFlashDraftModel to DFlashQwen3ForCausalLM; any other name fails to resolve.
    found = export.config.get("architectures")
    return None if ARCHITECTURE in (found or []) else f"is {found!r}; vLLM resolves only {ARCHITECTURE}"


def vllm_model_type(export: Export) -> str | None:
    # vLLM reads the draft config with transformers' AutoConfig, which knows "qwen3" without
    # --trust-remote-code (what the published DFlash drafters set); the speculators format is read by
    # vLLM's own SpeculatorsConfig, which it picks for a config.json that names no model_type.
    config = export.config
    if not is_speculators(config):
        found = config.get("model_type")
        return None if found == "qwen3" else f"is {found!r}; vLLM loads it without remote code only as 'qwen3'"
    if config["speculators_model_type"] != "dflash":
        return f"speculators_model_type is {config['speculators_model_type']!r}, not 'dflash'"
    if "model_type" in config:
        return f"is {config['model_type']!r}; a speculators config.json must name none"
    layer_type = vllm_layer_config(config).get("model_type")
    return None if layer_type == "qwen3" else f"of transformer_layer_config is {layer_type!r}, not 'qwen3'"


def vllm_mask(export: Export) -> str | None:
    # DFlashQwen3Model reads dflash_config.mask_token_id, a top-level mask_token_id as fallback, and
    # embeds the MASK slots with the target's embed_tokens; the DFlash proposer raises without it.
    return mask_range_problem(vllm_mask_token_id(export.config), export.target)


def vllm_layer_ids(export: Export) -> str | None:
    # vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config turns
    # dflash_config.target_layer_ids into aux layers k + 1: the hidden state ENTERING layer k + 1, which
    # is layer k's output. Layer k + 1 must exist, so the target's last layer cannot be read.
    ids, layers = vllm_target_layer_ids(export.config), export.target.num_hidden_layers
    if not _is_id_list(ids):
        return f"{ids!r} must be a non-empty list of layer ids"
    if any(not 0 <= k < layers - 1 for k in ids):
        return (f"{ids}: vLLM captures layer k's output entering layer k + 1, so each id must be within "
                f"0..{layers - 2} for the target's {layers} layers ({export.target.source})")
    recorded = (export.config.get("dflash_config") or {}).get("target_layer_ids")
    if is_speculators(export.config) and recorded is not None and recorded != ids:
        return f"aux_hidden_state_layer_ids - 1 = {ids} != dflash_config.target_layer_ids {recorded}"
    return None


QWEN3_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "hidden_act", "rms_norm_eps", "vocab_size", "attention_bias",
                "max_position_embeddings")


def vllm_qwen3_fields(export: Export) -> str | None:
    # DFlashQwen3DecoderLayer builds every draft layer from these; a missing rope theta is silently
    # replaced by 1e6 (set_default_rope_theta), which would rotate the drafter's positions wrong.
    layer = vllm_layer_config(export.config)
    missing = [key for key in QWEN3_FIELDS if layer.get(key) is None]
    if rope_theta(layer) is None:
        missing.append("rope_parameters.rope_theta")
    return f"lack {', '.join(missing)}" if missing else None


def vllm_hidden_act(export: Export) -> str | None:
    # qwen3_dflash.py builds the MLP with qwen2.py's Qwen2MLP, which raises for any activation but silu.
    act = vllm_layer_config(export.config).get("hidden_act")
    return None if act == "silu" else f"is {act!r}; vLLM's Qwen3 MLP supports only 'silu'"


def vllm_layer_types(export: Export) -> str | None:
    # _resolve_layer_attention: a "sliding_attention" layer runs causal and windowed, any other non-causal.
    return layer_types_problem(vllm_layer_config(export.config))


def vllm_hidden_size(export: Export) -> str | None:
    # _get_dflash_fc_input_size: fc reads len(ids) x (target_hidden_size or hidden_size) features, and
    # the draft layers take the target's embeddings, so the drafter's width must be the target's.
    config = export.config
    found = hidden_size_problem(vllm_layer_config(config).get("hidden_size"), export.target)
    if found is not None:
        return found
    if config.get("target_hidden_size") is not None:
        found = hidden_size_problem(config["target_hidden_size"], export.target)
        return found and f"(target_hidden_size) {found}"
    return None


def vllm_vocab_size(export: Export) -> str | None:
    # DFlashQwen3ForCausalLM: draft_vocab_size (default vocab_size) differing from the target's makes
    # vLLM expect a draft-to-target token map (d2t), which a DFlash drafter does not ship.
    vocab = export.config.get("draft_vocab_size") or vllm_layer_config(export.config).get("vocab_size")
    if vocab == export.target.vocab_size:
        return None
    return f"{vocab!r} != the target's {export.target.vocab_size} ({export.target.source})"


def vllm_weights(export: Export) -> str | None:
    # load_weights prefixes every name with "model." and AutoWeightsLoader raises on a name it does
    # not know; embed_tokens and lm_head are optional (the target's serve); the fc input is
    # len(ids) x (target_hidden_size or hidden_size).
    config, layer = export.config, vllm_layer_config(export.config)
    ids = vllm_target_layer_ids(config)
    width = config.get("target_hidden_size") or layer.get("hidden_size")
    expected = expected_weights(layer, len(ids) * width) if _is_id_list(ids) and is_int(width) else None
    if expected is None:
        return None  # the fields rules above name what is missing
    unknown = sorted(set(export.weights) - set(expected) - set(OPTIONAL_WEIGHTS))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        return f"hold {unknown[0]}, a name vLLM does not know{more}"
    return missing_or_misshapen(export, expected)


VLLM_RULES = (
    Rule(VLLM, "architectures", "vllm/model_executor/models/registry.py", vllm_architectures),
    Rule(VLLM, "model_type", "vllm/transformers_utils/config.py, vllm/config/speculative.py", vllm_model_type),
    Rule(VLLM, "mask_token_id", VLLM_MODEL, vllm_mask),
    Rule(VLLM, "target_layer_ids", "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", vllm_layer_ids),
    Rule(VLLM, "Qwen3 fields", VLLM_MODEL, vllm_qwen3_fields),
    Rule(VLLM, "hidden_act", "vllm/model_executor/models/qwen2.py (Qwen2MLP)", vllm_hidden_act),
    Rule(VLLM, "layer_types", VLLM_MODEL, vllm_layer_types),
    Rule(VLLM, "hidden_size", VLLM_MODEL, vllm_hidden_size),
    Rule(VLLM, "vocab_size", VLLM_MODEL, vllm_vocab_size),
    Rule(VLLM, "weights", VLLM_MODEL, vllm_weights),
)


# ----------------------------------------------------------------------------- SGLang

SGLANG_MODEL = "python/sglang/srt/models/dflash.py"
SGLANG_UTILS = "python/sglang/srt/speculative/dflash_utils.py"


def sglang_value(config: dict, key: str):
    # parse_dflash_draft_config: dflash_config first, the top level as fallback.
    return (config.get("dflash_config") or {}).get(key, config.get(key))


def sglang_architectures(export: Export) -> str | None:
    # The model file's EntryClass is DFlashDraftModel; SGLang picks the model class by that name.
    found = export.config.get("architectures")
    return None if ARCHITECTURE in (found or []) else f"is {found!r}; SGLang resolves only {ARCHITECTURE}"


def sglang_num_hidden_layers(export: Export) -> str | None:
    # DFlashDraftConfig.require_num_layers raises without it; _parse_optional_int wants a positive int.
    found = export.config.get("num_hidden_layers")
    return None if is_int(found) and found >= 1 else f"is {found!r}; SGLang requires a positive layer count"


def sglang_intermediate_size(export: Export) -> str | None:
    # DFlashMLP raises "Invalid intermediate_size" unless it is above 0.
    found = export.config.get("intermediate_size")
    return None if is_int(found) and found > 0 else f"is {found!r}; SGLang's DFlashMLP requires it above 0"


def sglang_hidden_act(export: Export) -> str | None:
    # DFlashMLP raises "Unsupported DFlash activation" for anything but silu.
    found = export.config.get("hidden_act", "silu")
    return None if found == "silu" else f"is {found!r}; SGLang's DFlashMLP supports only 'silu'"


def sglang_block_size(export: Export) -> str | None:
    # resolve_block_size(default=16): absent, SGLang would draft 16-token blocks whatever the drafter learnt.
    found = sglang_value(export.config, "block_size")
    if found is None:
        return "is missing (dflash_config or top level); SGLang would assume 16"
    return None if is_int(found) and found >= 1 else f"is {found!r}; SGLang requires a positive int"


def sglang_layer_ids(export: Export) -> str | None:
    # resolve_target_layer_ids: a non-empty list of 0-based ids, "the output of layer k". The target model's
    # set_dflash_layers_to_capture (models/qwen3.py, llama.py) captures each one before layer k + 1, and its
    # forward captures only at the layers it runs: id layers - 1 is never captured, so the drafter's fc
    # input comes up short (models/dflash.py raises), as in vLLM.
    ids, layers = sglang_value(export.config, "target_layer_ids"), export.target.num_hidden_layers
    if not _is_id_list(ids):
        return f"{ids!r} must be a non-empty list of layer ids (dflash_config or top level)"
    if any(not 0 <= k < layers - 1 for k in ids):
        return (f"{ids}: SGLang captures layer k's output before layer k + 1, so each id must be within "
                f"0..{layers - 2} for the target's {layers} layers ({export.target.source})")
    return None


def sglang_mask(export: Export) -> str | None:
    # parse_dflash_draft_config: a non-negative int in dflash_config or at the top level; the DFlash
    # worker embeds it with the target's embedding, so it must be below the target's vocabulary size.
    return mask_range_problem(sglang_value(export.config, "mask_token_id"), export.target)


def sglang_hidden_size(export: Export) -> str | None:
    # DFlashDraftModel builds fc as len(ids) * hidden_size -> hidden_size: the target's features come in
    # at the target's width, so the drafter's hidden size must equal the target's.
    return hidden_size_problem(export.config.get("hidden_size"), export.target)


def sglang_layer_types(export: Export) -> str | None:
    # _get_dflash_layer_attention_params: "full_attention" runs ENCODER_ONLY (non-causal), as trained;
    # "sliding_attention" runs a causal window; any other type raises.
    return layer_types_problem(export.config)


def sglang_weights(export: Export) -> str | None:
    # load_weights drops names it does not know, silently (embed_tokens and lm_head among them), and leaves
    # a parameter the file lacks uninitialised; only an fc of the wrong shape raises.
    ids, hidden = sglang_value(export.config, "target_layer_ids"), export.config.get("hidden_size")
    expected = expected_weights(export.config, len(ids) * hidden) if _is_id_list(ids) and is_int(hidden) else None
    return None if expected is None else missing_or_misshapen(export, expected)


SGLANG_RULES = (
    Rule(SGLANG, "architectures", SGLANG_MODEL, sglang_architectures),
    Rule(SGLANG, "num_hidden_layers", SGLANG_UTILS, sglang_num_hidden_layers),
    Rule(SGLANG, "intermediate_size", SGLANG_MODEL, sglang_intermediate_size),
    Rule(SGLANG, "hidden_act", SGLANG_MODEL, sglang_hidden_act),
    Rule(SGLANG, "block_size", SGLANG_UTILS, sglang_block_size),
    Rule(SGLANG, "target_layer_ids", SGLANG_UTILS, sglang_layer_ids),
    Rule(SGLANG, "mask_token_id", f"{SGLANG_UTILS}, python/sglang/srt/speculative/dflash_worker.py", sglang_mask),
    Rule(SGLANG, "hidden_size", SGLANG_MODEL, sglang_hidden_size),
    Rule(SGLANG, "layer_types", SGLANG_MODEL, sglang_layer_types),
    Rule(SGLANG, "weights", SGLANG_MODEL, sglang_weights),
)

RULES = VLLM_RULES + SGLANG_RULES


def engine_problems(export: Export) -> list[Problem]:
    """Every engine rule the folder breaks, in the order of RULES; empty when both engines serve it."""
    return [Problem(rule, message) for rule in RULES if (message := rule.check(export)) is not None]


def refusal(problems: list[Problem]) -> str:
    """The one line `make export` stops with: the first problem, how many more, and the way past it."""
    more = f"; {len(problems) - 1} more ({', '.join(f'{p.rule.engine} {p.rule.field}' for p in problems[1:])})"
    return (problems[0].line() + (more if len(problems) > 1 else "")
            + "; fix the drafter, or pass --allow-engine-mismatch (ALLOW_ENGINE_MISMATCH=1) to export it anyway")


# ----------------------------------------------------------------------------- serving commands


def serve_commands(config: dict, target: str, drafter: str) -> dict[str, str]:
    """{engine: the command that serves `target` with the drafter folder or repo `drafter`}, for its config.json."""
    block_size = config["block_size"]
    return {VLLM: vllm_command(target, drafter, block_size),
            SGLANG: sglang_command(target, drafter, block_size, trust_remote_code=config.get("model_type") != "qwen3")}


def vllm_command(target: str, drafter: str, block_size: int) -> str:
    """vLLM serves the target with the drafter: one block drafts block_size - 1 tokens after the anchor. Quoted for
    a POSIX shell (a folder with a space or a quote in its name stays one argument)."""
    spec = json.dumps({"method": "dflash", "model": drafter, "num_speculative_tokens": block_size - 1})
    return shlex.join(["vllm", "serve", target, "--speculative-config", spec])


def sglang_command(target: str, drafter: str, block_size: int, trust_remote_code: bool = False) -> str:
    """SGLang counts the anchor among its draft tokens: --speculative-num-draft-tokens is the block size.

    trust_remote_code: the config.json names no model_type transformers knows (the speculators variant),
    so SGLang must read it through auto_map.
    """
    return shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm",
                       "DFLASH", "--speculative-draft-model-path", drafter, "--speculative-num-draft-tokens",
                       str(block_size), *(["--trust-remote-code"] if trust_remote_code else [])])
