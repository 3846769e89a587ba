"""Decoding from Python: a target and its drafter loaded once, as `ddtree generate` loads them, and prompts decoded
with its defaults.

    from ddtree import Decoder

    decoder = Decoder("smollm2-135m", drafter="outputs/smollm2-135m/<run>/drafter")
    reply = decoder.generate("Write a haiku about caches", max_new_tokens=64)
    print(reply.text, reply.tau, reply.tokens_per_second)

Unless told otherwise it decodes as the command does: with the drafter folder's corpus (corpus.safetensors: corpus
lookup) and calibration (calibration.json, else the calibration its config holds); dtype auto (bf16 where this machine
computes it fast); on a CPU, packed weights where they measure faster and trees sized to the verify cost measured at
load (adaptive size, which leaves re-drafting off); the chat template around a text prompt. Whatever the drafter, the
committed tokens are the target's own: its greedy tokens at temperature 0, its sampling distribution above.

Each keyword is the `ddtree generate` flag of the same name (docs/decoding.md); bad values raise DDTreeError (a
ValueError) naming the keyword. What was chosen (the dtype, the corpus, the calibration, the tree sizing) is said on
stderr as the command says it; quiet=True keeps it silent, transformers' progress bars too.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from .arguments import ADAPTIVE_SIZE, STATIC_CACHE
from .bench import chat_prompt_ids
from .calibration import CALIBRATION_FILE, OnlineCalibration, learning_from, load_calibration, weights_fingerprint
from .corpus import CORPUS_FILE, CorpusLookup, read_corpus
from .decoding import (DrafterRunner, GenerationResult, Sampling, check_budget, check_sizer, drafter_defaults,
                       generate, prompt_token_ids, whole_number)
from .decoding import static_cache as static_cache_on
from .drafters import load_drafter_folder, read_drafter_config
from .errors import DDTreeError, check_text
from .files import not_a_file
from .inputs import prompt_messages
from .modeling_dflash import DFlashDraftModel
from .names import METHODS, PACKED_KERNELS
from .packed_linear import apply_packing, check_packing_choice, is_packed, pack_linears
from .precision import resolve_dtype
from .sizing import TreeSizer
from .targets import Say, build_drafter_config, load_target, say_on_stderr, stop_token_ids


def load_drafter(
    spec: str, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target_name: str, seed: int = 0,
    say: Say = say_on_stderr,
) -> DFlashDraftModel:
    """`random` (an untrained drafter shaped for the target, its layer notices said to `say`) or a drafter folder,
    checked against the target."""
    if spec == "random":
        # its weights drawn from a generator of their own: torch's global one, reseeded here, changed what the
        # caller's program drew after a Decoder(drafter="random") was built
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = DFlashDraftModel(build_drafter_config(target, tokenizer, target_name, say=say))
        return drafter.to(device=target.device, dtype=target.dtype).eval()
    drafter = load_drafter_folder(Path(spec), target.dtype, target=target)
    return drafter.to(target.device).eval()


def parse_device(name: str, where: str = "--device") -> torch.device:
    """A torch device by name, one that exists on this machine; `where` names the flag in the error."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DDTreeError(f"{where} {name!r} is not a device name; give cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):  # mps, xpu, meta...: else a torch error once the target had loaded
        raise DDTreeError(f"{where} {name}: this code runs on a CPU or a CUDA GPU only; give {where} cpu, cuda or cuda:N")
    if device.type == "cpu" and device.index not in (None, 0):  # torch took cpu:1 and ran on every core, unsaid
        raise DDTreeError(f"{where} {name}: torch has one CPU device, whose threads use every core (OMP_NUM_THREADS "
                          f"sets how many); give {where} cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DDTreeError(f"{where} {name}: this machine has no CUDA GPU that torch can use; give {where} cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DDTreeError(f"{where} {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    return device


def folder_corpus(folder: Path, tokenizer: PreTrainedTokenizerBase, say: Say, leave_out: str) -> CorpusLookup | None:
    """The corpus a drafter folder ships (corpus.safetensors), checked against the target's tokenizer; None where it
    ships none. `leave_out` says how the caller decodes without it (`--corpus none`)."""
    shipped = Path(folder) / CORPUS_FILE
    if not shipped.is_file():
        return None
    started = time.perf_counter()
    corpus = CorpusLookup.from_file(shipped).check_runs()
    corpus.check_tokenizer(tokenizer)
    say(f"[corpus] the drafter's {shipped.name}: {len(corpus)} runs of {corpus.ngram} tokens in "
        f"{time.perf_counter() - started:.1f} s ({leave_out} leaves it out)")
    return corpus


def read_calibration(path: Path, drafter: str | None, say: Say, leave_out: str, own: bool) -> OnlineCalibration:
    """A calibration file, said on stderr, with a note where it was learned on other weights than the drafter folder
    holds now. `leave_out` says how the caller decodes without it (`--calibration none`); `own`: the folder's file,
    not one given."""
    calibration = load_calibration(path, leave_out)
    say(f"[calibration] {path}: draft temperature {calibration.describe()}{f' ({leave_out} leaves it out)' if own else ''}")
    if (drafter is not None and calibration.weights is not None  # (a file written before it kept them: no read)
            and calibration.weights != weights_fingerprint(Path(drafter))):
        say(f"[calibration] note: {path} was learned on other weights than {drafter} holds now: its expected tau "
            f"and tree order are another drafter's; run `ddtree calibrate --overwrite` on this one, or decode with "
            f"{leave_out}")
    return calibration


def given_corpus(read: list[str] | CorpusLookup, tokenizer: PreTrainedTokenizerBase, source: str, file: str,
                 say: Say) -> CorpusLookup:
    """A corpus `file` given to decode with (read_corpus' replies as text, or a corpus.safetensors' index), indexed and
    checked against the target's tokenizer; `source` names it as the caller's user gave it (`--corpus FILE`)."""
    started = time.perf_counter()
    if isinstance(read, CorpusLookup):
        corpus, took = read, ""
    else:
        corpus = CorpusLookup.from_text(read, tokenizer, source=source).check_runs()
        took = f" in {time.perf_counter() - started:.1f} s"
    corpus.check_tokenizer(tokenizer)
    say(f"[corpus] {len(corpus)} runs of {corpus.ngram} tokens from {file}{took}")
    return corpus


def chosen_calibration(given: Path | bool | None, drafter: str | None, say: Say,
                       leave_out: str) -> OnlineCalibration | bool | None:
    """The calibration to decode with: False for none; a file given (checked to exist); else the drafter folder's
    calibration.json; None where there is neither (the drafter's config may hold one). `drafter`: the folder, None for
    a random drafter; `leave_out` says how the caller decodes without it (`--calibration none`)."""
    if given is False:
        return False
    path = given if isinstance(given, Path) else None if drafter is None else Path(drafter) / CALIBRATION_FILE
    if path is None or not path.is_file():
        return None
    return read_calibration(path, drafter, say, leave_out, own=not isinstance(given, Path))


def drafter_runner(spec: str, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target_name: str,
                   seed: int, shipped_corpus: bool, calibration: OnlineCalibration | bool | None, say: Say,
                   leave_out: dict[str, str]) -> DrafterRunner:
    """The drafter `spec` names (a folder or "random") as a DrafterRunner of the target: its linear layers packed where
    the target's are, the corpus its folder ships (where shipped_corpus: no corpus was given to replace it) and
    `calibration` (chosen_calibration's) as its defaults, each said. leave_out: how the caller decodes without the
    corpus and the calibration ({"corpus": "--corpus none", "calibration": "--calibration none"})."""
    drafter = load_drafter(spec, target, tokenizer, target_name, seed, say)
    if is_packed(target):  # the target's linear layers packed: the drafter's own too
        pack_linears(drafter.requires_grad_(False))
    corpus = None
    if spec != "random" and shipped_corpus:
        corpus = folder_corpus(Path(spec), tokenizer, say, leave_out["corpus"])
    runner = DrafterRunner(drafter, target, corpus=corpus, calibration=calibration)
    if runner.calibration_from_config:
        say(f"[calibration] the drafter's config (replayed on its validation replies): draft temperature "
            f"{runner.default_calibration.describe()} ({leave_out['calibration']} leaves it out)")
    return runner


def measured_sizer(adaptive_size: str, static: bool | None, target: PreTrainedModel, max_budget: int, method: str,
                   say: Say, instead: str) -> TreeSizer | None:
    """Adaptive size on (auto: the dynamic cache, ddtree only): the verify cost measured here and said; else None.
    `instead`: what to do where the target's context leaves no room to measure, as the caller spells its settings
    ("lower --budget, or pass --adaptive-size off")."""
    static = static_cache_on(static, target.device)
    if adaptive_size == "off" or (adaptive_size == "auto" and (static or method != "ddtree")):
        return None
    check_sizer(method, True, static)
    sizer = TreeSizer.measure(target, max_rows=max_budget + 1, instead=instead)
    say(f"[adaptive size] {sizer.describe()} (measured up to {max_budget + 1} rows)")
    return sizer


@contextmanager
def progress_bars_off(off: bool):
    """Where `off`, transformers' progress bars off for the block (its "Loading weights" bar, and the Hub's download
    bars, which it turns off with its own), each set back after as it was found."""
    if not off:
        yield
        return
    bars, hub_bars = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()  # (the Hub's too: set back below where they were off)
        if hub_bars == are_progress_bars_disabled():
            (enable_progress_bars if hub_bars else disable_progress_bars)()


def sampling_facts(target_name: str, sampling: Sampling, target: PreTrainedModel) -> dict:
    """What calibration.json records of how it decoded besides the tree (decoded_with), and what decoding compares
    with it: the sampling (its acceptance is another than greedy decoding's), the target and the dtype it ran in. A
    local target folder is named by its absolute path, which another working folder names alike."""
    given = Path(target_name).expanduser()
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "target": str(given.resolve()) if given.is_dir() else target_name,
            "dtype": str(target.dtype).removeprefix("torch.")}


@dataclass(frozen=True)
class Reply:
    """One prompt's reply: its text, its token ids and the decoding's record (rounds, timings)."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    result: GenerationResult

    @property
    def tau(self) -> float | None:
        """Committed tokens per verify round; None where no round ran."""
        return self.result.tau

    @property
    def tokens_per_second(self) -> float:
        return self.result.tokens_per_second

    @property
    def ended(self) -> str:
        """Why the reply ended: "stop" (a stop token), "max_new_tokens", or "context" (the target's context, short of
        max_new_tokens)."""
        return self.result.ended


def user_path(value, where: str) -> str:
    """A target or drafter given as text or a path, its leading `~` the home folder."""
    if not isinstance(value, (str, os.PathLike)):
        raise DDTreeError(f"{where}={value!r}: give a name or a folder, as text or a path")
    text = os.fspath(value)
    return os.path.expanduser(text) if text.startswith("~") else text


def user_file(value, where: str, what: str):
    """A file keyword (corpus=, calibration=) as the command's flag takes it, its `~` the home folder: each was looked
    for under a folder named `~`; a number was "no such file", and "" the working folder ("corpus=.: a folder").
    None, False and True (the drafter folder's own, none) pass as they are."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        raise DDTreeError(f"{where}={value!r}: give {what}, as text or a path; None (the drafter folder's) or False "
                          "(none)")
    return user_path(value, where)


def check_seed(seed, none: str = "") -> int:
    """A seed torch.manual_seed takes, as the command's --seed: a whole number from -2**63 to 2**64 - 1, returned as
    an int (a numpy int or a 0-d tensor, which whole_number takes, was a TypeError in manual_seed once the target had
    loaded). `none`: what None means where the caller takes it (generate's), for the error."""
    number = whole_number(seed)
    if number is None or not -2**63 <= number < 2**64:
        raise DDTreeError(f"seed={seed!r}: give a whole number from -2**63 to 2**64 - 1{none}")
    return number


def _choice(value, choices, where: str) -> str:
    if value not in choices:
        raise DDTreeError(f"{where}={value!r}: choose one of {', '.join(map(repr, choices))}")
    return value


class Decoder:
    """A target, optionally a drafter, and what `ddtree generate` decodes with, loaded once for many prompts.

    target: a built-in name (smollm2-135m), a local Hugging Face folder or a Hub id. drafter: a drafter folder,
    "random" (an untrained drafter, for smoke tests) or None (plain decoding only). corpus: None = the one the drafter
    folder ships, False (or "none", as the command spells it) = none, or a file (a JSONL of conversations, or a
    corpus.safetensors). calibration: None = the folder's calibration.json, else its config's; False (or "none") =
    neither; or a file `ddtree calibrate` wrote. budget: the
    ddtree node budget, which the adaptive size is measured for. seed: a random drafter's weights, and the sampling
    of the generate calls that give no seed of their own.
    """

    def __init__(
        self, target: str = "smollm2-135m", drafter: str | Path | None = None, *, dtype: str = "auto",
        device: str | None = None, packed_weights: str = "auto", corpus: str | Path | bool | None = None,
        calibration: str | Path | bool | None = None, budget: int = 32, adaptive_size: str = "auto",
        static_cache: str = "auto", seed: int = 0, quiet: bool = False,
    ):
        say = self.say = (lambda line: None) if quiet else say_on_stderr
        # A path is taken as the command takes it: its `~` the home folder (else a drafter's corpus and calibration
        # were looked for under a folder named `~`, and decoded without, found in a review)
        target, drafter = user_path(target, "target"), None if drafter is None else user_path(drafter, "drafter")
        # "none" as `--corpus none` and `--calibration none` spell it: it was read as a file of that name, and refused
        corpus, calibration = (False if value == "none" else value for value in (corpus, calibration))
        corpus = user_file(corpus, "corpus", "a JSONL file of conversations or a corpus.safetensors")
        calibration = user_file(calibration, "calibration", "a file `ddtree calibrate` wrote")
        seed = check_seed(seed)
        _choice(packed_weights, PACKED_KERNELS, "packed_weights")
        self.target_name = target
        self._noted: set[tuple[str, ...]] = set()  # calibration notes said already (each once a Decoder)
        # Everything checked and every file read before the target loads (seconds, and memory)
        self.budget = whole_number(budget)
        if self.budget is None or self.budget < 1:
            raise DDTreeError(f"budget={budget!r}: give a whole number of tree nodes, at least 1 (published: 32)")
        self.adaptive_size = _choice(adaptive_size, ADAPTIVE_SIZE, "adaptive_size")
        self.static = STATIC_CACHE[_choice(static_cache, tuple(STATIC_CACHE), "static_cache")]
        self.drafter_path = None if drafter in (None, "random") else str(drafter)
        if self.drafter_path is not None:
            read_drafter_config(Path(self.drafter_path))
        if drafter is None and (corpus not in (None, False) or calibration not in (None, False)):
            raise DDTreeError("corpus and calibration shape a drafter's trees, and no drafter was given: give drafter=")
        read = None if corpus in (None, False, True) else read_corpus(str(corpus), "corpus=")
        given_calibration = None
        if calibration not in (None, False, True):
            problem = not_a_file(calibration)
            if problem:
                raise DDTreeError(f"calibration={str(calibration)!r}: {problem}; give a file `ddtree calibrate` "
                                  "wrote, None (the drafter folder's) or False")
            given_calibration = Path(calibration)
            load_calibration(given_calibration, "calibration=False")  # its contents too, as the command reads them
        device = parse_device(device, "device") if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if self.adaptive_size == "on" and static_cache_on(self.static, device):
            raise DDTreeError("adaptive_size='on' saves nothing with the static cache (every verify runs budget + 1 "
                              "rows): give static_cache='off', or adaptive_size 'auto' or 'off'")

        chosen, reason = resolve_dtype(dtype, device, "dtype")
        if reason:
            say(reason)
        check_packing_choice(packed_weights, chosen, device, "packed_weights", "dtype='float32'")
        with progress_bars_off(quiet):  # quiet: transformers' "Loading weights" bar too, not only this project's lines
            self.target, self.tokenizer = load_target(target, chosen, device, say)
        _, reason = apply_packing(packed_weights, self.target, "packed_weights")
        if reason:
            say(reason)
        check_budget(self.budget, self.target)
        self.stop_ids = stop_token_ids(self.target, self.tokenizer)
        # generate(seed=None) samples from it: seeded once, so a script's runs repeat while its calls differ
        self._generator = torch.Generator(device=self.target.device).manual_seed(seed)

        self.drafter: DrafterRunner | None = None
        self._online: OnlineCalibration | None = None  # generate(online_calibration=True)'s, kept across prompts
        self.corpus: CorpusLookup | bool | None = False if corpus is False else None
        self.sizer: TreeSizer | None = None
        if drafter is None:
            return
        if read is not None:
            self.corpus = given_corpus(read, self.tokenizer, f"corpus={corpus}", str(corpus), say)
        loaded = chosen_calibration(False if calibration is False else given_calibration, self.drafter_path, say,
                                    "calibration=False")
        with progress_bars_off(quiet):
            self.drafter = drafter_runner(drafter, self.target, self.tokenizer, target, seed, corpus in (None, True),
                                          loaded, say, {"corpus": "corpus=False", "calibration": "calibration=False"})
        self.sizer = measured_sizer(self.adaptive_size, self.static, self.target, self.budget, "ddtree", say,
                                    "give a lower budget=, or adaptive_size='off'")

    def prompt_ids(self, prompt: str | list[int] | list[dict], chat: bool = True) -> list[int]:
        """A prompt as token ids: text as a user message under the target's chat template (with chat=False, the text
        itself); a list of {"role", "content"} messages (a system prompt, earlier turns) under the template, its
        trailing assistant turns cut as bench cuts them (prompt_messages; said); token ids (or a tokenizer's encoding)
        as they are."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            if not chat:
                if not prompt:
                    raise DDTreeError("prompt is empty, and with chat=False no chat template adds tokens to it: give "
                                      "the text the target continues from")
                return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}], "prompt",
                                   "give chat=False to use the prompt as raw text")
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(message, Mapping) for message in prompt):
            if not chat:
                raise DDTreeError("prompt is a list of messages, which only a chat template renders: drop chat=False, "
                                  "or give text or token ids")
            for number, message in enumerate(prompt, 1):
                if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                    raise DDTreeError(f"prompt message {number} is not a {{\"role\": ..., \"content\": ...}} pair "
                                      f"of strings: {str(dict(message))[:80]}")
                check_text(message["content"], f"prompt message {number}")
            # as every prompt reader cuts them (bench, calibrate, eval): after a reply, the generation prompt would
            # open a second assistant turn no user sends
            messages = prompt_messages([dict(message) for message in prompt])
            if not messages:
                raise DDTreeError("prompt holds only assistant turns: give a conversation with a turn for the target "
                                  "to answer (a user's)")
            cut = len(prompt) - len(messages)
            if cut:
                self.say(f"[prompt] prompt ended with {cut} assistant turn{'s' if cut > 1 else ''}: cut, decoded from "
                         f"the turn before {'them' if cut > 1 else 'it'}")
            return chat_prompt_ids(self.tokenizer, messages, "prompt", "give text or token ids")
        return prompt_token_ids(prompt, "prompt")

    def generate(
        self, prompt: str | list[int], *, method: str | None = None, max_new_tokens: int = 256, chat: bool = True,
        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
        lookup: int | None = None, redraft: int | None = None, online_calibration: bool = False,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Reply:
        """Decode one prompt (text, or token ids) with `method` (default: ddtree with a drafter, else ar) and return
        its Reply. on_tokens is called with each round's committed token ids as they are committed.
        seed: None = draw on from this Decoder's generator, seeded once from its own seed, so each call samples anew
        (and a script's runs repeat); a number = this call's draws from that seed alone, the same reply each time.
        online_calibration: learn the draft temperature from the verified rounds, starting from the drafter's
        calibration, and go on learning over this Decoder's later prompts that ask for it too."""
        for name, value in (("chat", chat), ("online_calibration", online_calibration)):
            # a string is true whatever it says: chat="false" applied the chat template without a word
            if value not in (True, False):
                raise DDTreeError(f"{name}={value!r}: give True or False")
        method = method or ("ar" if self.drafter is None else "ddtree")
        if method not in METHODS:
            raise DDTreeError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
        if method != "ar" and self.drafter is None:
            raise DDTreeError(f"method={method!r} drafts with a drafter, and this Decoder has none: give drafter= "
                              "when building it, or method='ar'")
        if online_calibration and self.drafter is None:
            raise DDTreeError("online_calibration learns from a drafter's drafts, and this Decoder has none: give "
                              "drafter= when building it, or drop it")
        if seed is not None:
            seed = check_seed(seed, ", or None to draw on from this Decoder's own seed")
        if on_tokens is not None and not callable(on_tokens):
            raise DDTreeError(f"on_tokens={on_tokens!r}: give a function of a list of token ids, or None")
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            # numbers.Real: a numpy float too (np.float32(0.7) was refused as no number, where top_k and seed take
            # numpy ints)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise DDTreeError(f"{name}={value!r}: give a number")
        if online_calibration and method == "ar":
            raise DDTreeError("online_calibration learns from a drafter's drafts, and method 'ar' drafts none: give "
                              "method 'dflash' or 'ddtree', or drop it")
        sampling = Sampling(temperature, top_p, top_k)
        ids = self.prompt_ids(prompt, chat)
        generator = (self._generator if seed is None
                     else torch.Generator(device=self.target.device).manual_seed(seed))
        online = None
        if online_calibration:  # one learner for the Decoder's life: each prompt goes on from what the last taught
            online = self._online = self._online or learning_from(self.drafter.default_calibration)
        result = generate(
            self.target, ids, method, self.drafter, self.budget, max_new_tokens, self.stop_ids, sampling, generator,
            self.static, online, lookup, self.sizer if method == "ddtree" else None, redraft,
            self.corpus if method == "ddtree" else None, on_tokens=on_tokens,
        )
        if method == "ddtree":  # after generate checked lookup and redraft: a bad one was advised to calibrate with
            self._note_calibration(sampling, lookup, redraft)
        if result.ended == "context":  # else a short reply looked like one max_new_tokens ended, as the command says
            self.say(result.context_note(method, "max_new_tokens", max_new_tokens))
        text = self.tokenizer.decode(result.new_tokens, skip_special_tokens=True)
        return Reply(text, list(result.new_tokens), ids, result)

    def _note_calibration(self, sampling: Sampling, lookup: int | None, redraft: int | None) -> None:
        """One line, once a Decoder for each set of differences, where the drafter's calibration was learned with
        other lookups, re-drafting, corpus, sampling, target or dtype than this ddtree decodes with, as `ddtree
        generate` says it: decoding stays lossless, but its expected tau and tree order are priced for another tree."""
        calibration = self.drafter.default_calibration
        if calibration is None:
            return
        lookup, redraft, corpus = drafter_defaults("ddtree", self.drafter, lookup, redraft, self.sizer is not None,
                                                   self.corpus)
        now = {"lookup": lookup, "redraft": redraft, "corpus": corpus is not None,
               **sampling_facts(self.target_name, sampling, self.target)}
        differences = tuple(calibration.differences(now))
        if differences and differences not in self._noted:
            self._noted.add(differences)
            self.say(f"[calibration] note: learned decoding with other settings ({'; '.join(differences)}): its "
                     "expected tau will be off; run `ddtree calibrate --overwrite` with these settings on prompts like "
                     "yours, or decode with calibration=False")
