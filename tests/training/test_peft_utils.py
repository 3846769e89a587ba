"""A target given as base model + PEFT adapter (training/peft_utils.py): adapters that cannot be merged.

    .venv/bin/pytest -q tests/training/test_peft_utils.py
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ddtree.errors import DDTreeError
from ddtree.files import cache_dir
from training import peft_utils
from training.peft_utils import adapter_fingerprint, check_adapter_folder
from training.target import load_frozen_target


def lora(model, path, modules=("q_proj",)):
    from peft import LoraConfig, get_peft_model

    get_peft_model(model, LoraConfig(r=2, target_modules=list(modules), init_lora_weights=False)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A fitting adapter, and six that do not fit tiny-random: made for a model of another hidden size, for models of
    its width but 12 and 3 layers (it has 6), naming modules it lacks, a folder holding the config alone (a copy cut
    short), and a prompt-tuning adapter (virtual tokens, no weight update to merge)."""
    from peft import PromptTuningConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from ddtree.targets import load_target, resolve_target

    folder = tmp_path_factory.mktemp("adapters")
    fits = lora(load_target("tiny-random")[0], folder / "fits")
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    other.name_or_path = "someone/other-llama"  # what the adapter's base_model_name_or_path records
    wrong_shape = lora(other, folder / "wrong_shape")
    depth = {}
    for layers in (12, 3):
        config = AutoConfig.from_pretrained(resolve_target("tiny-random"))
        config.num_hidden_layers = layers
        model = AutoModelForCausalLM.from_config(config)
        model.name_or_path = f"someone/llama-{layers}-layers"
        depth[layers] = lora(model, folder / f"layers{layers}")
    missing_modules = lora(load_target("tiny-random")[0], folder / "missing_modules")
    config = json.loads((folder / "missing_modules" / "adapter_config.json").read_text())
    (folder / "missing_modules" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["c_attn"]}))
    (folder / "no_weights").mkdir()
    shutil.copy(folder / "fits" / "adapter_config.json", folder / "no_weights")
    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    get_peft_model(load_target("tiny-random")[0], prompt_tuning).save_pretrained(folder / "prompt")
    return {"fits": fits, "wrong_shape": wrong_shape, "deeper": depth[12], "shallower": depth[3],
            "missing_modules": missing_modules, "no_weights": str(folder / "no_weights"),
            "prompt": str(folder / "prompt")}


@pytest.mark.parametrize("kind, said", [
    ("wrong_shape", r"\(it was made for someone/other-llama\): Error\(s\) in loading state_dict for PeftModel: size "
                    r"mismatch for .*lora_A"),
    ("missing_modules", r"\(it was made for .*tiny-random\): Target modules \{'c_attn'\} not found"),
    # peft loads an adapter's weights with strict=False: those of layers 6-11 were dropped without a word, and layers
    # 3-5 left unadapted with a warning only, so training and data generation went on against a half-adapted target
    ("deeper", r"\(it was made for someone/llama-12-layers\): 12 of its tensors match no module of the target "
               r"\(the first: base_model\.model\.model\.layers\.([6-9]|1[01])\.self_attn\.q_proj\.lora_[AB]\.weight\)"),
    ("shallower", r"\(it was made for someone/llama-3-layers\): it has no weights for 6 adapter tensors the target "
                  r"takes \(the first: base_model\.model\.model\.layers\.3\.self_attn\.q_proj\.lora_A\.weight\)"),
])
def test_an_adapter_made_for_another_model_is_one_line_naming_it_and_the_target(adapters, kind, said):
    adapter = adapters[kind]
    with pytest.raises(DDTreeError) as error:
        load_frozen_target("tiny-random", torch.float32, adapter)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"model.target_adapter={adapter} does not fit target tiny-random (it was made for ")
    assert re.search(said, message) and message.endswith("give an adapter trained on tiny-random, or the target it was "
                                                         "made for")


def test_an_adapter_folder_without_its_weights_says_so(adapters):
    """peft asked the Hub for the folder's path as a repo id and failed on its shape: a message about repo names."""
    with pytest.raises(DDTreeError, match=r"^model.target_adapter=.*no_weights: adapter_config.json is there but not "
                                          r"the adapter's weights \(adapter_model.safetensors or adapter_model.bin\)"):
        load_frozen_target("tiny-random", torch.float32, adapters["no_weights"])


def test_an_adapter_folder_refused_at_load_names_the_option_it_was_given_by(adapters):
    """data/regenerate.py gives the adapter as --target-adapter and training.evaluate takes it from a checkpoint's
    record: an error saying model.target_adapter sent the user to a recipe field they never set."""
    with pytest.raises(DDTreeError, match=r"^--target-adapter=.*no_weights: adapter_config.json is there but not "):
        load_frozen_target("tiny-random", torch.float32, adapters["no_weights"], adapter_field="--target-adapter")


def test_an_adapter_folder_without_its_config_says_so(adapters, tmp_path):
    """A copy holding the weights alone: reading its config was a FileNotFoundError traceback, not a line naming it."""
    shutil.copy(Path(adapters["fits"]) / "adapter_model.safetensors", tmp_path)
    with pytest.raises(DDTreeError, match=rf"^model.target_adapter={re.escape(str(tmp_path))}: no adapter_config.json "
                                          r"there; give a PEFT adapter folder"):
        check_adapter_folder(str(tmp_path))


def test_an_adapter_saved_in_torchs_format_merges_as_its_safetensors_copy_does(adapters, tmp_path):
    """save_pretrained(safe_serialization=False) writes adapter_model.bin: a folder holding it is a whole adapter."""
    from safetensors.torch import load_file

    shutil.copy(Path(adapters["fits"]) / "adapter_config.json", tmp_path)
    torch.save(load_file(Path(adapters["fits"]) / "adapter_model.safetensors"), tmp_path / "adapter_model.bin")
    assert check_adapter_folder(str(tmp_path))["peft_type"] == "LORA"
    merged, _ = load_frozen_target("tiny-random", torch.float32, str(tmp_path))
    expected, _ = load_frozen_target("tiny-random", torch.float32, adapters["fits"])
    assert all(torch.equal(merged.state_dict()[name], value) for name, value in expected.state_dict().items())


@pytest.mark.parametrize("content, said", [
    (b"{", "is not valid JSON"),
    ('{"peft_type": "LORA", "note": "\xe9"}'.encode("latin-1"), "is not valid JSON"),  # a UnicodeDecodeError
    (b"[1, 2]", "holds a JSON list, not a PEFT adapter's settings"),  # an AttributeError on .get
])
def test_an_adapter_config_that_is_no_settings_is_refused_by_the_folder_check(tmp_path, content, said):
    """Each was a traceback from the folder check itself."""
    (tmp_path / "adapter_config.json").write_bytes(content)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(DDTreeError, match=rf"^model.target_adapter={re.escape(str(tmp_path))}: adapter_config.json "
                                          rf"{said}.*; copy the whole folder `save_pretrained` wrote again$"):
        check_adapter_folder(str(tmp_path))


def test_the_adapter_fingerprint_reads_the_adapter_files_alone(adapters, tmp_path):
    """save_pretrained writes a README.md beside the adapter, and people edit it: hashed, the edit refused the feature
    store as another target's, and marked make eval's taus and regenerate --check's data as changed since."""
    folder = shutil.copytree(adapters["fits"], tmp_path / "fits")
    first = adapter_fingerprint(str(folder))
    (folder / "README.md").write_text("trained on the support chats\n")
    (folder / "notes.txt").write_text("lr 1e-4\n")
    assert adapter_fingerprint(str(folder)) == first
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the last weight changed, as a retraining changes them
    assert adapter_fingerprint(str(folder)) != first


def test_the_adapter_fingerprint_does_not_depend_on_the_order_the_folder_lists_its_files(adapters, monkeypatch):
    """A copy of the folder (another disk, another file system) lists its files in another order: the same adapter."""
    first = adapter_fingerprint(adapters["fits"])
    listed = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda folder: reversed(list(listed(folder))))
    assert adapter_fingerprint(adapters["fits"]) == first


def test_an_adapter_named_by_a_hub_id_or_none_has_no_fingerprint():
    """Its files are not here to hash: the records keep the id alone, rather than the hash of reading a folder that is
    not there (a FileNotFoundError traceback)."""
    assert adapter_fingerprint("someone/sql-adapter") is None
    assert adapter_fingerprint(None) is None


def test_an_adapter_that_cannot_be_merged_is_refused_by_the_folder_check(adapters, monkeypatch):
    """A prompt-tuning adapter passed the folder check (config and weights are there) and the merge then failed with
    an AttributeError traceback, after the recipe's data had been generated with the base target."""
    said = (rf"^model.target_adapter={re.escape(adapters['prompt'])}: a PROMPT_TUNING adapter, which cannot be "
            r"merged into the target's weights \(it adds virtual tokens, not weight updates\); give a weight adapter \(LoRA")
    with pytest.raises(DDTreeError, match=said):
        check_adapter_folder(adapters["prompt"])
    # a type the folder check does not know: refused at the merge, in one line too
    monkeypatch.setattr(peft_utils, "UNMERGEABLE_PEFT_TYPES", {})
    check_adapter_folder(adapters["prompt"])
    with pytest.raises(DDTreeError, match=r"^model.target_adapter=.*prompt: a PROMPT_TUNING adapter, which cannot "
                                          r"be merged into the target's weights; give a weight adapter \(LoRA"):
        load_frozen_target("tiny-random", torch.float32, adapters["prompt"])


def test_a_fitting_adapter_still_merges(adapters):
    merged, _ = load_frozen_target("tiny-random", torch.float32, adapters["fits"])
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_an_adapter_under_tilde_is_in_the_home_folder(adapters, tmp_path, monkeypatch):
    """A recipe's `target_adapter: ~/lora` (or `--model.target_adapter=~/lora`) reaches no shell: the folder check
    said "no adapter_config.json there" for an adapter that was there, where model.target's and model.init_from's ~
    are the home folder; its fingerprint was None, as for a Hub id."""
    # the converted targets stay where they are (under the moved home, tiny-random was converted again: ~50 s)
    monkeypatch.setenv("DDTREE_CACHE", str(cache_dir()))
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(adapters["fits"], tmp_path / "lora")
    assert check_adapter_folder("~/lora")["peft_type"] == "LORA"
    assert adapter_fingerprint("~/lora") == adapter_fingerprint(adapters["fits"])
    merged, _ = load_frozen_target("tiny-random", torch.float32, "~/lora")
    expected, _ = load_frozen_target("tiny-random", torch.float32, adapters["fits"])
    assert all(torch.equal(merged.state_dict()[name], value) for name, value in expected.state_dict().items())


def test_an_adapter_config_without_a_peft_type_or_with_one_peft_does_not_know_is_one_line(adapters, tmp_path):
    """No peft_type (a config not written by peft) was peft's TypeError traceback at the merge, after the folder
    check had passed it; one a newer peft saved said "does not fit target tiny-random (...): 'NEWTHING'; give an
    adapter trained on tiny-random", of an adapter that was."""
    folder = shutil.copytree(adapters["fits"], tmp_path / "adapter")
    settings = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({k: v for k, v in settings.items() if k != "peft_type"}))
    with pytest.raises(DDTreeError, match=r"^model.target_adapter=.*adapter: adapter_config.json names no peft_type, "
                                          r"so it is no PEFT adapter's settings"):
        check_adapter_folder(str(folder))
    (folder / "adapter_config.json").write_text(json.dumps({**settings, "peft_type": "NEWTHING"}))
    with pytest.raises(DDTreeError, match=r"^model.target_adapter=.*adapter: peft_type NEWTHING is none that peft "
                                          r"\S+ knows \(an adapter saved by a newer peft\?\): upgrade peft"):
        load_frozen_target("tiny-random", torch.float32, str(folder))
