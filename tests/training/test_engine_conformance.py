"""A fresh export against what vLLM and SGLang read (training/engines.py); `make export` refusing what they reject.

    .venv/bin/pytest -q tests/training/test_engine_conformance.py

No engine is imported (their GPU wheels do not install here). Each engine's rules, restated from its
source in training/engines.py (every rule names its file), are applied to a fresh `make export` of an
untrained tiny drafter (one checkpoint, no training), in the default and the speculators format; each
rule is then shown to fail on a config or weights broken on purpose. The layer-id convention is
checked against this project's own feature extraction and the engines' way of capturing hidden states.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import AutoConfig, Qwen3Config

import training.publish as publish
from training.engines import (
    RULES, SGLANG, VLLM, Export, TargetFacts, engine_problems, expected_weights, refusal, sglang_value,
    serve_commands, target_facts, vllm_layer_config, vllm_mask_token_id, vllm_target_layer_ids, weight_shapes,
)
from training.module import DistillModule
from training.target import target_layer_features

BLOCK_SIZE = 8
LAYER_IDS = [1, 3, 4]  # of the tiny target's 6 layers; 4 + 1 is the deepest layer vLLM can tap


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder holding one checkpoint of an untrained tiny drafter, as training saves it."""
    root = tmp_path_factory.mktemp("conformance") / "run"
    torch.manual_seed(0)
    module = DistillModule(target="tiny-random", num_layers=2, block_size=BLOCK_SIZE, target_layer_ids=LAYER_IDS,
                           target_dtype="float32")
    module.configure_model()
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 3}
    module.on_save_checkpoint(checkpoint)
    (root / "checkpoints").mkdir(parents=True)
    torch.save(checkpoint, root / "checkpoints" / "last.ckpt")
    return root


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory) -> dict[str, Path]:
    """`make export` of that checkpoint: the default folder and the --speculators one."""
    root = tmp_path_factory.mktemp("exports")
    folders = {"default": root / "default", "speculators": root / "speculators"}
    assert publish.main([str(run), "--out", str(folders["default"]), "--ckpt", "last"]) == 0
    assert publish.main([str(run), "--out", str(folders["speculators"]), "--ckpt", "last", "--speculators"]) == 0
    return folders


def fresh(folder: Path) -> Export:
    """The folder as `make export` checks it before publishing (training/publish.py)."""
    config = json.loads((folder / "config.json").read_text())
    return Export(config, weight_shapes(folder), target_facts("tiny-random", config))


def failing(export: Export) -> set[tuple[str, str]]:
    return {(problem.rule.engine, problem.rule.field) for problem in engine_problems(export)}


# ----------------------------------------------------------------------------- a fresh export meets both engines


@pytest.mark.parametrize("variant", ["default", "speculators"])
def test_a_fresh_export_breaks_no_rule_of_either_engine(exports, variant):
    assert engine_problems(fresh(exports[variant])) == []


def test_the_default_export_reads_as_qwen3_without_remote_code_as_the_published_drafters(exports):
    # vLLM and SGLang read the draft config with AutoConfig; the published DFlash drafters set model_type qwen3.
    config = AutoConfig.from_pretrained(exports["default"])  # no trust_remote_code
    assert type(config) is Qwen3Config
    assert config.architectures == ["DFlashDraftModel"] and config.block_size == BLOCK_SIZE
    assert config.dflash_config["target_layer_ids"] == LAYER_IDS
    assert isinstance(config.dflash_config["mask_token_id"], int)
    assert config.layer_types == ["full_attention"] * config.num_hidden_layers  # non-causal in both engines


def test_vllm_reads_what_the_drafter_was_trained_with(exports, tiny_target):
    target, _ = tiny_target
    export = fresh(exports["default"])
    config, layer = export.config, vllm_layer_config(export.config)
    hidden = target.config.hidden_size
    assert config["model_type"] == "qwen3" and "DFlashDraftModel" in config["architectures"]
    assert vllm_target_layer_ids(config) == LAYER_IDS and 0 <= vllm_mask_token_id(config) < target.config.vocab_size
    assert layer["hidden_size"] == hidden and layer["head_dim"] == target.config.head_dim
    # the fc input is len(ids) x (target_hidden_size or hidden_size); weight names carry no prefix
    assert export.weights["fc.weight"] == (hidden, len(LAYER_IDS) * hidden)
    assert not any(name.startswith("model.") or "embed_tokens" in name or "lm_head" in name for name in export.weights)
    assert set(export.weights) == set(expected_weights(layer, len(LAYER_IDS) * hidden))

    speculators = fresh(exports["speculators"]).config  # vLLM's speculators reader: aux ids are ids + 1
    assert "model_type" not in speculators and speculators["speculators_model_type"] == "dflash"
    assert speculators["aux_hidden_state_layer_ids"] == [k + 1 for k in LAYER_IDS]
    assert vllm_target_layer_ids(speculators) == LAYER_IDS
    assert vllm_mask_token_id(speculators) == vllm_mask_token_id(config)


def test_sglang_reads_what_the_drafter_was_trained_with(exports, tiny_target):
    target, _ = tiny_target
    config = fresh(exports["default"]).config
    assert sglang_value(config, "block_size") == BLOCK_SIZE and sglang_value(config, "target_layer_ids") == LAYER_IDS
    assert 0 <= sglang_value(config, "mask_token_id") < target.config.vocab_size
    assert config["num_hidden_layers"] == 2 and config["intermediate_size"] > 0 and config["hidden_act"] == "silu"
    assert config["hidden_size"] == target.config.hidden_size  # fc: len(ids) * hidden_size -> hidden_size


def test_layer_k_is_hidden_states_k_plus_1_as_the_engines_capture_it(exports, tiny_target):
    """Id k is the output of layer k: this project's features are hidden_states[k + 1], and the engines,
    which capture the residual stream ENTERING a layer, capture it entering layer k + 1."""
    target, tokenizer = tiny_target
    ids = torch.tensor([tokenizer("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]])
    config = fresh(exports["default"]).config
    layer_ids = config["dflash_config"]["target_layer_ids"]
    hidden = target.config.hidden_size

    features = target_layer_features(target, ids, layer_ids)  # (1, T, K*H), as training reads the target
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    for i, k in enumerate(layer_ids):
        torch.testing.assert_close(features[..., i * hidden:(i + 1) * hidden], states[k + 1], rtol=0, atol=0)

    # The engines' capture, as vLLM's decoder loop does it: the hidden state entering layer `aux`.
    captured: dict[int, torch.Tensor] = {}

    def entering(aux: int):
        def hook(module, args, kwargs):
            captured[aux] = args[0] if args else kwargs["hidden_states"]
        return hook

    for aux_ids in ([k + 1 for k in layer_ids], fresh(exports["speculators"]).config["aux_hidden_state_layer_ids"]):
        captured.clear()
        assert max(aux_ids) < target.config.num_hidden_layers  # layer k + 1 exists for every id
        layers = target.model.layers
        handles = [layers[aux].register_forward_pre_hook(entering(aux), with_kwargs=True) for aux in aux_ids]
        try:
            with torch.no_grad():
                target(ids)
        finally:
            for handle in handles:
                handle.remove()
        torch.testing.assert_close(torch.cat([captured[aux] for aux in aux_ids], dim=-1), features, rtol=0, atol=0)


# ----------------------------------------------------------------------------- every rule can fail


def _config(change):
    def breaking(export: Export) -> Export:
        config = copy.deepcopy(export.config)
        change(config)
        return Export(config, dict(export.weights), export.target)
    return breaking


def _weights(change):
    def breaking(export: Export) -> Export:
        weights = dict(export.weights)
        change(weights)
        return Export(copy.deepcopy(export.config), weights, export.target)
    return breaking


def _target(**changes):
    def breaking(export: Export) -> Export:
        facts = {**export.target.__dict__, **changes}
        return Export(copy.deepcopy(export.config), dict(export.weights), TargetFacts(**facts))
    return breaking


def _set(**values):
    return lambda config: config.update(values)


def _delete(*keys):
    return lambda config: [config.pop(key) for key in keys]


def _dflash(**values):
    return lambda config: config["dflash_config"].update(values)


# (name, variant, breakage, the (engine, rule) pairs that must fail, no more)
BREAKAGES = [
    ("another architecture", "default", _config(_set(architectures=["Qwen3ForCausalLM"])),
     {(VLLM, "architectures"), (SGLANG, "architectures")}),
    ("the old model_type", "default", _config(_set(model_type="dflash_drafter")), {(VLLM, "model_type")}),
    ("a model_type in the speculators format", "speculators", _config(_set(model_type="qwen3")),
     {(VLLM, "model_type")}),
    ("another speculators algorithm", "speculators", _config(_set(speculators_model_type="eagle3")),
     {(VLLM, "model_type")}),  # vLLM's speculators reader picks the draft model by this name
    ("a speculators layer config naming no model_type", "speculators",
     _config(lambda c: c["transformer_layer_config"].pop("model_type")), {(VLLM, "model_type")}),
    ("no mask id", "default", _config(lambda c: c["dflash_config"].pop("mask_token_id")),
     {(VLLM, "mask_token_id"), (SGLANG, "mask_token_id")}),
    ("a mask id past the target's vocabulary", "default", _config(_dflash(mask_token_id=49152)),
     {(VLLM, "mask_token_id"), (SGLANG, "mask_token_id")}),
    ("a negative mask id", "default", _config(_dflash(mask_token_id=-1)),  # an index from the end of the embedding
     {(VLLM, "mask_token_id"), (SGLANG, "mask_token_id")}),
    ("the last layer's output, which neither engine taps", "default", _config(_dflash(target_layer_ids=[1, 3, 5])),
     {(VLLM, "target_layer_ids"), (SGLANG, "target_layer_ids")}),
    ("no target layer ids", "default", _config(_dflash(target_layer_ids=[])),  # not an fc of width 0 to blame
     {(VLLM, "target_layer_ids"), (SGLANG, "target_layer_ids")}),
    ("a layer the target lacks", "default", _config(_dflash(target_layer_ids=[1, 3, 6])),
     {(VLLM, "target_layer_ids"), (SGLANG, "target_layer_ids")}),
    ("aux ids that disagree with dflash_config", "speculators", _config(_set(aux_hidden_state_layer_ids=[1, 3, 5])),
     {(VLLM, "target_layer_ids")}),
    ("a dflash_config id SGLang cannot tap, the aux ids fine", "speculators",  # SGLang reads no aux ids
     _config(_dflash(target_layer_ids=[1, 3, 5])), {(VLLM, "target_layer_ids"), (SGLANG, "target_layer_ids")}),
    ("no head_dim", "default", _config(_delete("head_dim")), {(VLLM, "Qwen3 fields")}),
    ("no rope theta", "default", _config(_delete("rope_parameters", "rope_theta", "rope_scaling")),
     {(VLLM, "Qwen3 fields")}),
    ("no head_dim in a speculators layer config", "speculators",  # the one vLLM builds the draft layers from
     _config(lambda c: c["transformer_layer_config"].pop("head_dim")), {(VLLM, "Qwen3 fields")}),
    ("gelu in a speculators layer config", "speculators",  # vLLM builds the draft MLP from it, not the top level
     _config(lambda c: c["transformer_layer_config"].update(hidden_act="gelu")), {(VLLM, "hidden_act")}),
    ("no layer count", "default", _config(_delete("num_hidden_layers", "layer_types")),
     {(VLLM, "Qwen3 fields"), (SGLANG, "num_hidden_layers")}),
    ("a layer count of 0", "default", _config(_set(num_hidden_layers=0, layer_types=[])),  # SGLang wants 1 or more
     {(SGLANG, "num_hidden_layers"), (VLLM, "weights")}),  # and vLLM finds the layers' weights unclaimed
    ("gelu", "default", _config(_set(hidden_act="gelu")), {(VLLM, "hidden_act"), (SGLANG, "hidden_act")}),
    ("no hidden_act", "default", _config(_delete("hidden_act")),  # SGLang's DFlashMLP takes it as silu: served there
     {(VLLM, "Qwen3 fields"), (VLLM, "hidden_act")}),
    ("a sliding-window layer", "default", _config(_set(layer_types=["full_attention", "sliding_attention"])),
     {(VLLM, "layer_types"), (SGLANG, "layer_types")}),
    ("layer types for fewer layers than the drafter has", "default", _config(_set(layer_types=["full_attention"])),
     {(VLLM, "layer_types"), (SGLANG, "layer_types")}),
    ("a target of another width", "default", _target(hidden_size=128),
     {(VLLM, "hidden_size"), (SGLANG, "hidden_size")}),
    ("a speculators target_hidden_size that is not the target's", "speculators",
     _config(_set(target_hidden_size=128)), {(VLLM, "hidden_size"), (VLLM, "weights")}),  # and the fc width it sets
    ("a vocabulary that is not the target's", "default", _config(_set(vocab_size=1000)), {(VLLM, "vocab_size")}),
    ("no vocabulary size", "default", _config(_delete("vocab_size")),  # absent is no match for the target's either
     {(VLLM, "Qwen3 fields"), (VLLM, "vocab_size")}),
    ("a speculators draft vocabulary that is not the target's", "speculators", _config(_set(draft_vocab_size=1000)),
     {(VLLM, "vocab_size")}),  # read before the layer config's vocab_size, which stays the target's
    ("no block size", "default", _config(_delete("block_size")), {(SGLANG, "block_size")}),
    ("a block size of 0", "default", _config(_set(block_size=0)), {(SGLANG, "block_size")}),
    ("a dflash_config block size, which SGLang reads before the top level's", "default",
     _config(_dflash(block_size=0)), {(SGLANG, "block_size")}),
    ("no MLP width", "default", _config(_set(intermediate_size=0)),
     {(SGLANG, "intermediate_size"), (VLLM, "weights"), (SGLANG, "weights")}),
    ("a prefixed weight name", "default", _weights(lambda w: w.update({"model.norm.weight": w["norm.weight"]})),
     {(VLLM, "weights")}),  # SGLang drops the names it does not know
    ("a missing weight", "default", _weights(lambda w: w.pop("layers.1.mlp.down_proj.weight")),
     {(VLLM, "weights"), (SGLANG, "weights")}),
    ("an fc of the wrong width", "default", _weights(lambda w: w.update({"fc.weight": (64, 128)})),
     {(VLLM, "weights"), (SGLANG, "weights")}),
]


@pytest.mark.parametrize("name, variant, breaking, expected", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_a_broken_export_fails_exactly_the_rules_it_breaks(exports, name, variant, breaking, expected):
    assert failing(breaking(fresh(exports[variant]))) == expected


def test_a_drafter_shipping_its_own_embedding_and_lm_head_still_serves(exports):
    """vLLM takes embed_tokens and lm_head as optional (the target's serve when absent) and SGLang drops them: a drafter
    that ships its own is served by both, and a rule that counted them as unknown names would refuse a good export."""
    export = fresh(exports["default"])
    vocab, hidden = export.config["vocab_size"], export.config["hidden_size"]
    shipped = {**export.weights, "embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    assert failing(Export(export.config, shipped, export.target)) == set()


# A good config.json in another form the engines read than the one `make export` writes (an older export's, a drafter
# published elsewhere): a rule that read only the export's own form would refuse a drafter both engines serve.
SERVED_FORMS = [
    ("a rope theta at the top level alone, as transformers 4 wrote it", "default",
     _config(lambda c: c.update(rope_theta=c.pop("rope_parameters")["rope_theta"]))),
    ("a mask id at the top level alone", "default",  # each engine's fallback when dflash_config names none
     _config(lambda c: c.update(mask_token_id=c["dflash_config"].pop("mask_token_id")))),
    ("speculators layer ids for SGLang at the top level alone", "speculators",  # vLLM reads the aux ids
     _config(lambda c: c.update(target_layer_ids=c["dflash_config"].pop("target_layer_ids")))),
]


@pytest.mark.parametrize("name, variant, changing", SERVED_FORMS, ids=[form[0] for form in SERVED_FORMS])
def test_a_config_in_another_form_the_engines_read_still_serves(exports, name, variant, changing):
    assert failing(changing(fresh(exports[variant]))) == set()


def test_a_drafter_with_attention_bias_needs_every_projections_bias(exports):
    """With attention_bias, vLLM's DFlashQwen3Attention builds qkv_proj and o_proj with a bias, as ddtree's drafter
    does: a drafter that ships the four serves, and one that lacks o_proj's is refused (both engines' weight rules
    read the same names, expected_weights)."""
    export = fresh(exports["default"])
    config = {**export.config, "attention_bias": True}
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    biases = {}
    for i in range(config["num_hidden_layers"]):
        attention = f"layers.{i}.self_attn."
        biases |= {f"{attention}q_proj.bias": (q_width,), f"{attention}k_proj.bias": (kv_width,),
                   f"{attention}v_proj.bias": (kv_width,), f"{attention}o_proj.bias": (config["hidden_size"],)}
    weights = {**export.weights, **biases}
    assert failing(Export(config, weights, export.target)) == set()
    weights.pop("layers.0.self_attn.o_proj.bias")
    assert failing(Export(config, weights, export.target)) == {(VLLM, "weights"), (SGLANG, "weights")}


def test_every_rule_of_each_engine_can_fail():
    broken = set().union(*(expected for *_, expected in BREAKAGES))
    assert {(rule.engine, rule.field) for rule in RULES} == broken
    assert all(rule.source.startswith(("vllm/", "python/sglang/")) for rule in RULES)  # each names its engine file


def test_a_refusal_for_one_broken_rule_counts_no_others(exports):
    """`make export`'s line counts the problems after the first; with none, a "; 0 more ()" would read as a
    truncated list of further problems the user must go and find."""
    gelu = _config(lambda c: c["transformer_layer_config"].update(hidden_act="gelu"))  # breaks vLLM's one rule
    export = gelu(fresh(exports["speculators"]))
    assert refusal(engine_problems(export)) == (
        "vLLM would reject this drafter: hidden_act is 'gelu'; vLLM's Qwen3 MLP supports only 'silu' "
        "(vllm/model_executor/models/qwen2.py (Qwen2MLP)); fix the drafter, or pass --allow-engine-mismatch "
        "(ALLOW_ENGINE_MISMATCH=1) to export it anyway")


# ----------------------------------------------------------------------------- make export refuses what an engine would


def tampered_run(run: Path, tmp_path: Path, change, target: str | None = None) -> Path:
    """A copy of the run whose checkpoint's drafter config went through `change`; with `target`, a run that trained
    against that target (its model.target and its drafter's record both name it: export reads the run's)."""
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    change(checkpoint["drafter_config"])
    if target is not None:
        checkpoint["drafter_config"]["target_name_or_path"] = checkpoint["hyper_parameters"]["target"] = target
    copy_of_run = tmp_path / "run"
    (copy_of_run / "checkpoints").mkdir(parents=True)
    torch.save(checkpoint, copy_of_run / "checkpoints" / "last.ckpt")
    return copy_of_run


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def test_an_export_for_a_target_of_another_width_is_refused_unless_allowed(run, tmp_path, capsys):
    wider = tmp_path / "wider-target"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 6,
                                                   "vocab_size": 49152}))
    tampered = tampered_run(run, tmp_path, lambda config: None, target=str(wider))
    out = tmp_path / "export"
    assert publish.main([str(tampered), "--out", str(out), "--ckpt", "last"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: vLLM would reject this drafter: hidden_size 64 != the target's 128")
    # how much else is wrong: the others counted and named, the first one not again
    assert line.endswith("; 1 more (SGLang hidden_size); fix the drafter, or pass --allow-engine-mismatch "
                         "(ALLOW_ENGINE_MISMATCH=1) to export it anyway")
    assert not out.exists() and not any(p.name.startswith(".export") for p in tmp_path.iterdir())

    assert publish.main([str(tampered), "--out", str(out), "--ckpt", "last", "--allow-engine-mismatch"]) == 0
    assert "warning (--allow-engine-mismatch): SGLang would reject" in capsys.readouterr().err
    card = (out / "README.md").read_text()
    assert "an engine would reject this drafter" in card and "hidden_size 64 != the target's 128" in card


def measured(run: Path, chain_tau: float) -> Path:
    """The run with a config.yaml and an acceptance evaluation of its checkpoint's step, as training writes them: the
    card then gives its serving table."""
    (run / "config.yaml").write_text("trainer: {}\n")
    (run / "eval").mkdir()
    (run / "eval" / "step-000003.json").write_text(json.dumps({
        "step": 3, "settings": {"prompts": "data/eval_prompts.jsonl", "num_prompts": 2, "max_new_tokens": 8,
                                "budgets": [4], "primary_budget": 4, "block_size": BLOCK_SIZE},
        "summary": {"dflash": {"tau": chain_tau}, "ddtree@4": {"tau": chain_tau + 0.25}}, "prompts": []}))
    return run


def test_an_engine_that_rejects_the_drafter_is_never_said_to_serve_it(run, tmp_path, capsys):
    """With --allow-engine-mismatch, the card's bold list said vLLM and SGLang would reject the drafter, yet its table
    gave both the measured chain tau, and the card and the export printed the commands serving it with each (found in
    a review)."""
    wider = tmp_path / "wider-target"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 6,
                                                   "vocab_size": 49152}))
    both = measured(tampered_run(run, tmp_path / "both", lambda config: None, target=str(wider)), 1.5)
    out = tmp_path / "both-export"
    assert publish.main([str(both), "--out", str(out), "--ckpt", "last", "--allow-engine-mismatch"]) == 0
    printed = capsys.readouterr().out
    card = (out / "README.md").read_text()
    serving = card[card.index("## Serving with vLLM and SGLang"):]
    assert "| `ddtree --method dflash` | chain of 7 drafted tokens | 1.500 |" in serving
    assert "So this card gives no command for vLLM or SGLang, and does not count them among what serves" in serving
    assert "vllm serve" not in card and "sglang.launch_server" not in card and "serve with" not in printed

    # one engine rejects it (vLLM: the drafter's vocabulary is not the target's), the other still serves it
    vllm_only = measured(tampered_run(run, tmp_path / "vllm", lambda config: config.update(vocab_size=1000)), 1.25)
    out = tmp_path / "vllm-export"
    assert publish.main([str(vllm_only), "--out", str(out), "--ckpt", "last", "--allow-engine-mismatch"]) == 0
    printed = capsys.readouterr().out
    card = (out / "README.md").read_text()
    serving = card[card.index("## Serving with vLLM and SGLang"):]
    assert "- vLLM would reject this drafter: vocab_size 1000" in serving and "SGLang would reject" not in serving
    assert "| SGLang, `ddtree --method dflash` | chain of 7 drafted tokens | 1.250 |" in serving
    assert "Block size 8: SGLang counts the anchor, `--speculative-num-draft-tokens` = 8." in serving
    assert "vllm serve" not in card and "python -m sglang.launch_server" in serving
    assert "serve with vLLM" not in printed and "serve with SGLang" in printed


def test_an_export_with_a_mask_id_outside_the_targets_vocabulary_is_refused(run, tmp_path, capsys):
    tampered = tampered_run(run, tmp_path, lambda config: config["dflash_config"].update(mask_token_id=10**6))
    assert publish.main([str(tampered), "--out", str(tmp_path / "export"), "--ckpt", "last"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: vLLM would reject this drafter: mask_token_id 1000000 is not a token")
    assert "SGLang mask_token_id" in line and not (tmp_path / "export").exists()


def test_a_target_that_cannot_be_read_is_stood_in_for_by_the_drafters_record(run, tmp_path, capsys):
    unreadable = tmp_path / "moved-target"
    unreadable.mkdir()  # a folder without config.json: the target the run named is gone
    tampered = tampered_run(run, tmp_path, lambda config: None, target=str(unreadable))
    assert publish.main([str(tampered), "--out", str(tmp_path / "export"), "--ckpt", "last"]) == 0
    assert "engine rules were checked against the drafter's own record" in capsys.readouterr().err
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    facts = target_facts(str(unreadable), config)
    assert (facts.hidden_size, facts.num_hidden_layers, facts.vocab_size) == (None, 6, config["vocab_size"])
    assert "the target's hidden size is not checked" in (tmp_path / "export" / "README.md").read_text()
    # the rules that need only what the drafter recorded still apply
    broken = Export({**config, "dflash_config": {**config["dflash_config"], "target_layer_ids": [1, 3, 6]}},
                    weight_shapes(tmp_path / "export"), facts)
    assert failing(broken) == {(VLLM, "target_layer_ids"), (SGLANG, "target_layer_ids")}


def test_a_target_whose_sizes_sit_under_text_config_is_checked_against_them(exports, tmp_path):
    """A multimodal target (Qwen3-VL, Gemma 3) keeps its text model's sizes under text_config: read at the top level,
    the drafter's own record stood in and a drafter of the wrong width was exported with a note."""
    text = {"hidden_size": 128, "num_hidden_layers": 6, "vocab_size": 49152}
    vision = {"hidden_size": 32}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "text_config": text,
                                                      "vision_config": vision}))
    export = fresh(exports["default"])
    facts = target_facts(str(tmp_path), export.config)
    assert (facts.hidden_size, facts.num_hidden_layers, facts.vocab_size) == (128, 6, 49152)
    assert failing(Export(export.config, export.weights, facts)) == {(VLLM, "hidden_size"), (SGLANG, "hidden_size")}


def test_a_hub_id_target_in_the_local_cache_is_read_and_none_is_stood_in_for(exports, tmp_path, monkeypatch):
    """The usual real target is a Hub id whose config.json the Hub cache holds: its sizes are read from there, offline,
    not stood in for. A checkpoint that names no target gets the drafter's record, saying why."""
    snapshot = tmp_path / "hub" / "models--someone--cached-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 6, "vocab_size": 49152}))
    (tmp_path / "hub" / "models--someone--cached-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--cached-model" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    export = fresh(exports["default"])
    facts = target_facts("someone/cached-model", export.config)
    assert (facts.hidden_size, facts.num_hidden_layers, facts.vocab_size) == (128, 6, 49152)
    assert facts.source == "someone/cached-model's config.json"
    facts = target_facts(None, export.config)
    assert (facts.hidden_size, facts.vocab_size) == (None, export.config["vocab_size"])
    assert "as None could not be read (the checkpoint names no target)" in facts.source, facts.source


def test_the_serve_commands_keep_a_folder_with_a_space_or_a_quote_one_argument():
    """The printed commands pasted paths unquoted: `bob's drafter` left the shell waiting for a closing quote, and
    `my drafter` reached SGLang as two arguments."""
    target, drafter = "/data/my models/llama", "exports/bob's drafter"
    commands = serve_commands({"block_size": 8, "model_type": "dflash"}, target, drafter)
    vllm, sglang = (shlex.split(commands[engine]) for engine in (VLLM, SGLANG))
    assert vllm[:3] == ["vllm", "serve", target] and vllm[3] == "--speculative-config"
    assert json.loads(vllm[4]) == {"method": "dflash", "model": drafter, "num_speculative_tokens": 7}
    assert sglang[sglang.index("--model-path") + 1] == target
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == drafter
    assert sglang[-3:] == ["--speculative-num-draft-tokens", "8", "--trust-remote-code"]
    plain = serve_commands({"block_size": 16, "model_type": "qwen3"}, "Qwen/Qwen3-8B", "me/drafter")  # as documented
    assert plain[VLLM] == ("vllm serve Qwen/Qwen3-8B --speculative-config "
                           """'{"method": "dflash", "model": "me/drafter", "num_speculative_tokens": 15}'""")
