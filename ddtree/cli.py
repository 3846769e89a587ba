"""The `ddtree` command: generate text or benchmark decoding methods with a target and a drafter.

    ddtree generate --target smollm2-135m --drafter random --prompt "Hello"
    ddtree bench --target smollm2-135m --drafter outputs/.../drafter --prompts data/eval_prompts.jsonl \
        --methods ar,dflash,ddtree --budgets 16,32,64 --max-new-tokens 128 --out results.json
    ddtree calibrate --target smollm2-135m --drafter outputs/.../drafter --prompts my_prompts.jsonl

`--drafter random` builds an untrained drafter for the target (smoke tests); otherwise it is a
drafter folder (config.json + safetensors, the published DFlash format), checked against the target
and its own weights before it loads. `--dtype auto` (the default) runs the target in bf16 where this
machine computes it fast (a CPU measures it), else float32 (ddtree/precision.py), and says which on stderr; in fp32 on a CPU,
`--packed-weights auto` packs the linear layers' weights for oneDNN where that measures faster
(ddtree/packed_linear.py), and says so likewise. Bad input
prints one line, `error: ...`, and exits with status 2 (ddtree/errors.py).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .arguments import STATIC_CACHE, build_parser, default_device
from .bench import (
    chat_prompt_ids, compare_packed_verify_cost, format_summary, format_tau, measure_verify_cost, method_keys,
    prompts_fingerprint, read_prompts, resolved_options, run_benchmark, tokenize_prompts,
)
from .calibration import (CALIBRATION_FILE, learning_from, load_calibration, note_in_card, save_calibration,
                          weights_fingerprint)
from .corpus import CORPUS_FILE, CorpusLookup, read_corpus
from .drafters import read_drafter_config
from .decoder import (chosen_calibration, drafter_runner, given_corpus, load_drafter,  # noqa: F401
                      measured_sizer, parse_device, sampling_facts, say_on_stderr)  # (load_drafter, parse_device: importers read them from here too)
from .decoding import (
    METHODS, SAMPLING_FLAGS, DrafterRunner, OnlineCalibration, Sampling, check_budget, check_sizer, drafter_defaults,
    generate, static_cache,
)
from .errors import DDTreeError, Terminated, check_text, command
from .files import WriteFailed, check_output_file, not_a_file, saved_elsewhere, write_results_json
from .inputs import method_list, uses_drafter
from .machine import describe_machine, machine_line
from .packed_linear import apply_packing, check_packing_choice, is_packed, packing_available, packs_as
from .precision import resolve_dtype
from .sizing import TreeSizer
from .targets import load_target, stop_token_ids


def _load_target(args):
    """The target in --dtype on --device; `auto` resolved for this machine, with the reason printed to stderr."""
    dtype, reason = resolve_dtype(args.dtype, args.device, "--dtype")
    if reason:
        print(reason, file=sys.stderr)
    check_packing_choice(args.packed_weights, dtype, args.device)
    device = torch.device(args.device)
    if getattr(args, "compare_plain", False) and not packs_as(dtype, device):
        # said before the target loads (it was said after: seconds, minutes for a large target)
        raise DDTreeError(f"--compare-plain needs fp32 on a CPU, and the target runs in "
                          f"{str(dtype).removeprefix('torch.')} on {device.type}: drop --compare-plain, or use "
                          f"--dtype float32{' --device cpu' if device.type != 'cpu' else ''}")
    target, tokenizer = load_target(args.target, dtype, args.device)
    _, reason = apply_packing(args.packed_weights, target)
    if reason:
        print(reason, file=sys.stderr)
    return target, tokenizer


def _setup(args, trees: bool = True):
    """The settings checked, the files named read (InputFiles), then the target loaded."""
    sampling = Sampling(args.temperature, args.top_p, args.top_k, SAMPLING_FLAGS)
    if args.max_new_tokens < 1:
        raise DDTreeError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    budgets = getattr(args, "budgets", None) or [getattr(args, "budget", 1)]
    for budget in budgets if trees else []:  # `ar` and `dflash` build no tree: their budget is unused
        if budget < 1:
            raise DDTreeError(f"budget {budget} must be at least 1")
    if getattr(args, "limit", None) is not None and args.limit < 1:
        raise DDTreeError(f"--limit {args.limit} must be at least 1; omit it to use every prompt")
    if args.adaptive_size == "on":  # said now, not once the target, the drafter and its corpus had loaded
        check_sizer("ddtree", True, static_cache(STATIC_CACHE[args.static_cache], torch.device(args.device)))
    files = check_input_files(args)
    target, tokenizer = _load_target(args)
    for budget in budgets if trees else []:
        check_budget(budget, target)  # before --adaptive-size measures verifies of that many rows
    return sampling, target, tokenizer, files


def describe_target(args, target: PreTrainedModel) -> str:
    """The target as a printed table's header names it: name, dtype, packed or plain linear layers, and the machine."""
    dtype = str(target.dtype).removeprefix("torch.")
    layers = "packed linear layers" if is_packed(target) else "plain linear layers"
    return f"target {args.target}, {dtype}, {layers}; {machine_line(describe_machine(target.device))}"


def _sizer(args, target, budgets: list[int], method: str = "ddtree", flag: str = "--budgets") -> TreeSizer | None:
    """With --adaptive-size on (auto: the dynamic cache), the verify cost measured here (printed to stderr); else None.
    `flag` is the command's budget flag, which a budget too large to time is told to lower."""
    return measured_sizer(args.adaptive_size, STATIC_CACHE[args.static_cache], target, max(budgets), method,
                          say_on_stderr, f"lower {flag}, or pass --adaptive-size off")


BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback tokenizer's byte piece


class TextStream:
    """Writes a reply to `out` as its tokens are committed, and `finish` ends it with a newline; what it writes in all
    is the decode of all the tokens (the old whole print).

    Each call decodes only a window: the tokens written last time and the new ones, the difference of the two
    decodes being the new text (so a tokenizer that drops a leading space at a decode's start drops it alike in both),
    and the window moves on. Text is held back while it ends in half a character: a byte-level tokenizer decodes a
    character whose bytes have not all come as U+FFFD, and a byte-fallback one (<0xF0>-style byte tokens) may decode
    a whole run of them otherwise once it ends, so a trailing run of byte tokens waits for the next other token.
    """

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.byte_tokens = {index for piece, index in vocabulary.items() if BYTE_TOKEN.fullmatch(piece)}
        self.ids: list[int] = []
        self.start = self.shown = 0  # the window: ids[start:shown] were written last time, ids[:shown] are written
        self.written: list[str] = []

    def __call__(self, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        end = len(self.ids)
        while end > self.shown and self.ids[end - 1] in self.byte_tokens:
            end -= 1
        before, text = self._decode(self.start, self.shown), self._decode(self.start, end)
        if len(text) > len(before) and text.startswith(before) and not text.endswith("\ufffd"):
            self._write(text[len(before):])
            self.start, self.shown = self.shown, end

    def finish(self) -> None:
        before, text = self._decode(self.start, self.shown), self._decode(self.start, len(self.ids))
        if text.startswith(before):
            self._write(text[len(before):])
        self._write("\n")
        whole = self._decode(0, len(self.ids)) + "\n"
        if "".join(self.written) != whole:  # a tokenizer whose decode of more tokens rewrites earlier text
            print("[generate] the streamed reply is not its decode (this tokenizer rewrites earlier text as tokens "
                  "come; --no-stream prints it once whole); the reply as decoded:", file=sys.stderr)
            self._write(whole)

    def end_line(self) -> None:
        """A reply cut short (Ctrl-C): its last line ended, so that what is said next has a line of its own."""
        if self.written and not self.written[-1].endswith("\n"):
            self._write("\n")

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.written.append(text)


def cmd_generate(args) -> None:
    check_text(args.prompt, "--prompt")  # said before the target loads, not by the tokenizer after
    if args.raw and not args.prompt:  # no token to predict from: else refused once the target had loaded
        raise DDTreeError("--prompt is empty, and with --raw no chat template adds tokens to it: give the text the "
                          "target continues from")
    check_calibration_flag(args, [args.method])
    check_flags_for_methods(args, [args.method])
    sampling, target, tokenizer, files = _setup(args, trees=args.method == "ddtree")
    drafter = None
    if uses_drafter(args):
        drafter = _drafter_runner(args, target, tokenizer, args.method == "ddtree")
    if args.raw:
        prompt_ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}], "--prompt",
                                     "give --raw to use the prompt as raw text")
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    corpus = _corpus(args, tokenizer, files.corpus)
    sizer = _sizer(args, target, [args.budget], args.method, "--budget")  # measured last: bad input is refused first
    if args.method == "ddtree":
        note_calibration_settings(drafter, args, target, sizer, corpus)
    stream = None if args.no_stream else TextStream(tokenizer)
    try:
        result = generate(
            target, prompt_ids, args.method, drafter, args.budget, args.max_new_tokens,
            stop_token_ids(target, tokenizer), sampling, generator, STATIC_CACHE[args.static_cache],
            learning_from(getattr(drafter, "default_calibration", None)) if args.online_calibration else None,
            args.lookup, sizer, args.redraft, corpus, on_tokens=stream,
        )
    except (KeyboardInterrupt, Terminated):  # the stop's one line (run_cli's) was glued to the reply streamed so far
        if stream is not None:
            stream.end_line()
        raise
    if stream is None:
        print(tokenizer.decode(result.new_tokens, skip_special_tokens=True))
    else:
        stream.finish()
    print(
        f"[{args.method}] {len(result.new_tokens)} tokens, tau {format_tau(result.tau)}, "
        f"{result.tokens_per_second:.1f} tok/s",
        file=sys.stderr,
    )
    if result.ended == "context":
        print(result.context_note(args.method, "--max-new-tokens", args.max_new_tokens), file=sys.stderr)


def note_calibration_settings(drafter: DrafterRunner, args, target: PreTrainedModel, sizer, corpus) -> None:
    """One line where the drafter's calibration file was learned with other lookups, re-drafting, corpus, sampling,
    target or dtype than ddtree decodes with here: decoding stays lossless, but its expected tau and tree order are
    priced for another tree, or for another acceptance."""
    calibration = drafter.default_calibration
    if calibration is None:
        return
    lookup, redraft, resolved = drafter_defaults("ddtree", drafter, args.lookup, args.redraft, sizer is not None, corpus)
    now = {"lookup": lookup, "redraft": redraft, "corpus": resolved is not None, **decoding_facts(args, target)}
    differences = calibration.differences(now)
    if differences:
        other_dtype = (calibration.decoded_with or {}).get("dtype", now["dtype"]) != now["dtype"]
        flags = calibrate_flags(args, lookup, redraft, resolved, sizer, now["dtype"] if other_dtype else None)
        print(f"[calibration] note: learned decoding with other settings ({'; '.join(differences)}): its expected tau "
              f"will be off; run `ddtree calibrate --overwrite {flags}` (with this --target and --drafter, and prompts "
              "like yours) to learn with these settings, or decode with --calibration none", file=sys.stderr)


def decoding_facts(args, target: PreTrainedModel) -> dict:
    """What calibration.json records of how it decoded besides the tree (decoded_with): sampling_facts'."""
    return sampling_facts(args.target, Sampling(args.temperature, args.top_p, args.top_k), target)


def calibrate_flags(args, lookup: int, redraft: int, corpus: CorpusLookup | None, sizer, dtype: str | None = None) -> str:
    """The flags that make `ddtree calibrate` learn on the trees decoded here. Its defaults are generate's (on a CPU,
    sized trees and so no re-drafting): a bare `calibrate --overwrite` after a bench note learned what it had learned
    before, and the note came back (found in a review). All four are named, as one of them changes another's default
    (--adaptive-size off turns the drafter's re-drafting back on); the sampling where it is not calibrate's greedy
    default, and `dtype` where the file was learned in another."""
    flags = [f"--lookup {lookup}", f"--redraft {redraft}", f"--adaptive-size {'off' if sizer is None else 'on'}"]
    if corpus is None:
        flags.append("--corpus none")
    elif args.corpus is not None:  # a file given here; the drafter's own is calibrate's default too
        flags.append(f"--corpus {shlex.quote(args.corpus)}")
    if args.temperature > 0:
        # as given (Python's shortest round-trip form, 1.0 as 1): :g kept 6 digits, so --temperature 0.1234567 asked
        # calibrate to learn at 0.123457, and the note came back after it had
        flags.append(f"--temperature {str(args.temperature).removesuffix('.0')}")
        flags += [f"--top-p {str(args.top_p).removesuffix('.0')}"] if args.top_p != 1 else []
        flags += [f"--top-k {args.top_k}"] if args.top_k else []
    if dtype is not None:
        flags.append(f"--dtype {dtype}")
    return " ".join(flags)


def _corpus(args, tokenizer, read: list[str] | CorpusLookup | None) -> CorpusLookup | bool | None:
    """--corpus: the index of what was read from its file (InputFiles.corpus: a corpus.safetensors' token ids indexed as
    they were read, a JSONL's replies tokenized and indexed here, a few seconds for 2048 replies), checked against the
    target's tokenizer; False for `none`; None (the drafter's own, DrafterRunner.default_corpus) when left out."""
    if args.corpus is None or args.corpus == "none":
        return None if args.corpus is None else False
    return given_corpus(read, tokenizer, f"--corpus {args.corpus}", args.corpus, say_on_stderr)


LEAVE_OUT = {"corpus": "--corpus none", "calibration": "--calibration none"}  # how the command decodes without them


def _drafter_runner(args, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    trees: bool = True) -> DrafterRunner:
    """The --drafter, with the corpus its folder ships (if any, no --corpus given, and `trees`: ddtree among the
    methods) as its default corpus lookup, and the calibration it holds (if any, or --calibration FILE) as its default
    calibration. The chain grafts no corpus: a dflash-only run indexed the folder's, said it decoded with it, and
    refused a corrupt one it never read."""
    return drafter_runner(args.drafter, target, tokenizer, args.target, args.seed, trees and args.corpus is None,
                          _calibration(args), say_on_stderr, LEAVE_OUT)


def check_calibration_flag(args, methods: list[str]) -> None:
    """--calibration FILE shapes drafted trees: with `ar` alone it would do nothing, silently."""
    if args.calibration not in (None, "none") and all(method == "ar" for method in methods):
        raise DDTreeError(f"--calibration {args.calibration} shapes the drafter's trees; method 'ar' drafts none: drop it")


def check_flags_for_methods(args, methods: list[str]) -> None:
    """Options that none of the methods uses, refused before the target loads: else generate took them without a word
    (or refused some once the target had loaded and the corpus was indexed), and bench recorded them in results.json
    as if they had been used."""
    if args.command == "bench":
        chosen, add = f"--methods {args.methods}", "add {} to --methods"
    else:
        chosen, add = f"--method {args.method}", "give --method {}"
    if "ddtree" not in methods:
        shaping = [flag for flag, given in (("--lookup", args.lookup is not None),
                                            ("--corpus", args.corpus not in (None, "none")),
                                            ("--adaptive-size on", args.adaptive_size == "on")) if given]
        if shaping:
            raise DDTreeError(f"{', '.join(shaping)} shape the ddtree method's trees, and {chosen} runs no ddtree: "
                              f"{add.format('ddtree')}, or drop them")
    if all(method == "ar" for method in methods):
        drafting = [flag for flag, given in (("--redraft", args.redraft is not None),  # 0 (off) too, as --lookup 0
                                             ("--online-calibration", args.online_calibration)) if given]
        if drafting:
            raise DDTreeError(f"{', '.join(drafting)} act on the drafter's drafts, and {chosen} drafts none: "
                              f"{add.format('dflash or ddtree')}, or drop them")


def check_calibration_file(given: str) -> Path:
    problem = not_a_file(given)  # a pipe is refused: it is read twice (at the check and to use)
    if problem:
        raise DDTreeError(f"--calibration {given}: {problem}; give a file `ddtree calibrate` wrote, or none")
    return Path(given)


class InputFiles(NamedTuple):
    """What check_input_files read, kept for the command: a pipe (`--prompts /dev/stdin`, `--corpus <(...)`) can be
    read only once."""

    prompts: list[tuple[str, str, dict]] | None  # read_prompts' records; None without --prompts
    corpus: list[str] | CorpusLookup | None  # read_corpus' replies as text, or index of token ids; None without one


def check_input_files(args) -> InputFiles:
    """The files named on the command line, read or checked before the target loads (which takes seconds and memory):
    the drafter folder's config.json, the prompts, --corpus and --calibration."""
    if getattr(args, "drafter", "random") != "random":  # given: checked under `ar` alone too (check_input_paths)
        read_drafter_config(Path(args.drafter))
    prompts = corpus = None
    if getattr(args, "prompts", None) is not None:
        prompts = read_prompts(args.prompts, getattr(args, "limit", None))
    if getattr(args, "corpus", None) not in (None, "none"):
        corpus = read_corpus(args.corpus)
    if getattr(args, "calibration", None) not in (None, "none"):
        load_calibration(check_calibration_file(args.calibration))  # its contents too, as the corpus file's
    return InputFiles(prompts, corpus)


def _calibration(args) -> OnlineCalibration | None | bool:
    """--calibration: the file given, else the drafter folder's; None where there is neither (the drafter's config
    may hold one); False for `none` and for `calibrate` (which learns from a fresh start)."""
    given = getattr(args, "calibration", None)
    if args.command == "calibrate" or given == "none":
        return False
    return chosen_calibration(None if given is None else check_calibration_file(given),
                              None if args.drafter == "random" else args.drafter, say_on_stderr, LEAVE_OUT["calibration"])


def check_out_is_no_input(args) -> None:
    """bench --out (--overwrite or not) is none of the files the run reads: the prompts, --calibration, --corpus, or a
    file in the drafter's (its config.json is read and checked under `ar` alone too) or a local target's folder; else
    the results replace the run's own input."""
    out = Path(args.out)
    if not os.path.exists(out):  # (False for a name the OS will not look up, which check_output_file then refuses)
        return
    out = out.resolve()
    for flag, given in (("--prompts", args.prompts), ("--calibration", args.calibration), ("--corpus", args.corpus)):
        if given not in (None, "none") and out == Path(given).resolve():
            raise DDTreeError(f"--out {args.out} is the {flag} file: the results would replace it; give another --out")
    drafter = args.drafter if args.drafter != "random" else None
    for flag, folder in (("--drafter", drafter), ("--target", args.target)):
        if folder is not None and Path(folder).is_dir() and out.is_relative_to(Path(folder).resolve()):
            raise DDTreeError(f"--out {args.out} is in the {flag} folder {folder}: the results would replace its "
                              f"{out.relative_to(Path(folder).resolve())}; give another --out")


def check_named_once(flag: str, values: list) -> None:
    """A method or budget named twice would be decoded twice, its second result replacing the first (and calibrate
    learning from twice its rounds)."""
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise DDTreeError(f"{flag} repeats {', '.join(map(str, repeated))}: name each once")


def cmd_bench(args) -> None:
    methods = method_list(args.methods)
    if not methods:
        raise DDTreeError(f"--methods {args.methods!r} names no method: choose from {', '.join(METHODS)}")
    check_named_once("--methods", methods)
    check_named_once("--budgets", args.budgets)
    method_keys(methods, args.budgets)  # an unknown method or a budget below 1: said before the target loads
    check_calibration_flag(args, methods)
    check_flags_for_methods(args, methods)
    if args.overwrite and not args.out:  # else taken without a word, and the results went to no file
        raise DDTreeError("--overwrite replaces an existing --out, and no --out was given: give --out FILE for the "
                          "results JSON, or drop --overwrite")
    if args.out:
        check_out_is_no_input(args)
        check_output_file(args.out, overwrite=args.overwrite)
    sampling, target, tokenizer, files = _setup(args, trees="ddtree" in methods)
    prompts = tokenize_prompts(files.prompts, tokenizer)
    drafter = weights = None
    if uses_drafter(args):
        drafter = _drafter_runner(args, target, tokenizer, "ddtree" in methods)
        # the weights as loaded: a folder retrained in place keeps its path, so the path alone does not say which
        weights = (f"random, seed {args.seed}" if args.drafter == "random"
                   else weights_fingerprint(Path(args.drafter)))
    corpus = _corpus(args, tokenizer, files.corpus)
    sizer = _sizer(args, target, args.budgets) if "ddtree" in methods else None  # it sizes ddtree's trees only
    if drafter is not None and "ddtree" in methods:
        note_calibration_settings(drafter, args, target, sizer, corpus)
    results = run_benchmark(
        target, drafter, prompts, methods, args.budgets, args.max_new_tokens,
        stop_token_ids(target, tokenizer), sampling, seed=args.seed, static=STATIC_CACHE[args.static_cache],
        online=args.online_calibration, lookup=args.lookup, sizer=sizer, redraft=args.redraft, corpus=corpus,
    )
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    # what the paths held: --prompts may be a pipe or a file edited since, --drafter a folder retrained in place
    settings["prompts_sha256"] = prompts_fingerprint(prompts)
    settings["drafter_weights"] = weights
    settings["dtype_resolved"] = str(target.dtype).removeprefix("torch.")  # what `dtype` (maybe "auto") ran as
    settings["packed_weights_resolved"] = is_packed(target)  # what `packed_weights` (maybe "auto") ran as
    if drafter is not None:
        # What ddtree and the chain ran with where --lookup, --redraft and --corpus were left to the drafter: under
        # --adaptive-size the chain re-drafts as the drafter says and sized trees do not, so each has its own.
        for method in ("ddtree", "dflash"):
            if method in methods:
                lookup, redraft, resolved = resolved_options(method, drafter, args.lookup, args.redraft,
                                                             sizer is not None, corpus)
                settings[f"{method}_resolved"] = {"lookup": lookup, "redraft": redraft, "corpus": None if resolved is None
                                                  else args.corpus or f"the drafter's {CORPUS_FILE}"}
        shipped = drafter.default_calibration is not None  # the chain and ddtree use it alike
        settings["calibration_resolved"] = None if not shipped else (
            "the drafter's config (replayed)" if drafter.calibration_from_config
            else args.calibration or f"the drafter's {CALIBRATION_FILE}")
    if sizer is not None:
        settings["verify_cost_ms"] = {"fixed": sizer.fixed_ms, "per_row": sizer.row_ms}  # what --adaptive-size used
    results = {"settings": settings, "machine": describe_machine(target.device), **results}

    def save() -> None:  # --out, or beside it where another run wrote it meanwhile
        out = Path(args.out)
        if out.exists() and not args.overwrite:  # absent at the start: another run, started beside this one, wrote it
            kept = next(path for number in range(1, 10**6)
                        if not (path := out.with_name(f"{out.stem}.{number}{out.suffix}")).exists())
            write_results_json(kept, results)
            raise DDTreeError(f"--out {out} was written by another run while this one decoded, so it is left as it is; "
                              f"this run's results are in {kept}")
        write_results_json(out, results)

    try:  # the table first: where the disk refuses --out, the results are printed below it (write_results_json)
        print(describe_target(args, target))
        print(format_summary(results["summary"], target.dtype))
    except BrokenPipeError:  # stdout's reader has gone (`| head -1`, unbuffered): the results of every prompt decoded
        if args.out:  # were lost with it
            save()
        raise
    if args.out:
        save()
        print(f"results written to {args.out}")


def cmd_calibrate(args) -> None:
    """Decode the prompts with the chain and each ddtree budget, learning as --online-calibration does from a fresh
    start, and write what was learned into the drafter folder, where generate and bench find it by default. It decodes
    as generate does by default (--adaptive-size auto: on a CPU, sized trees and so no re-drafting unless given)."""
    if args.drafter == "random":
        raise DDTreeError("ddtree calibrate writes into a drafter folder: give --drafter FOLDER, not random")
    if args.calibration is not None or args.online_calibration:
        raise DDTreeError("ddtree calibrate always learns from a fresh start: drop --calibration and --online-calibration")
    check_named_once("--budgets", args.budgets)
    out = Path(args.drafter) / CALIBRATION_FILE
    existed = out.exists()
    if existed and not args.overwrite:
        raise DDTreeError(f"{out} exists and decoding uses it by default; pass --overwrite to replace it")
    if Path(args.drafter).is_dir():  # (a missing folder is named by the drafter's own check)
        check_output_file(out, "--drafter")  # a read-only drafter folder: said now, not after every prompt is decoded
    sampling, target, tokenizer, files = _setup(args)
    prompts = tokenize_prompts(files.prompts, tokenizer)
    drafter = _drafter_runner(args, target, tokenizer)
    corpus = _corpus(args, tokenizer, files.corpus)
    sizer = _sizer(args, target, args.budgets)
    calibration = OnlineCalibration(record=True)
    results = run_benchmark(
        target, drafter, prompts, ["dflash", "ddtree"], args.budgets, args.max_new_tokens,
        stop_token_ids(target, tokenizer), sampling, seed=args.seed, static=STATIC_CACHE[args.static_cache],
        online=calibration, lookup=args.lookup, sizer=sizer, redraft=args.redraft, corpus=corpus,
    )
    lookup, redraft, resolved = drafter_defaults("ddtree", drafter, args.lookup, args.redraft, sizer is not None, corpus)
    # printed before an error's line, and otherwise once the file is written: a write to a pipe whose reader has gone
    # (`| head -1`, unbuffered) ends the command, which lost what every prompt decoded had taught
    table = format_summary(results["summary"])
    settled = calibration.settled()  # its temperatures averaged over the last half of the rounds
    if not settled.log_temperatures:  # an empty file would still displace the drafter's own calibration
        print(table)
        raise DDTreeError(f"ddtree calibrate: no round was verified (--max-new-tokens {args.max_new_tokens} over "
                          f"{len(prompts)} prompts), so nothing was learned and {out} is left as it was; give more "
                          "--max-new-tokens or prompts")
    if out.exists() and not existed and not args.overwrite:  # another calibrate run on this folder finished first
        print(table)
        raise DDTreeError(f"ddtree calibrate: {out} was written by another run while this one decoded, so it is left as "
                          f"it is (learned here: draft temperature {settled.describe()}); rerun with --overwrite to "
                          "replace it")
    created = time.strftime("%Y-%m-%d")
    facts = {
        "target": args.target, "dtype": str(target.dtype).removeprefix("torch."), "prompts": args.prompts,
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "decoded_with": {"lookup": lookup, "redraft": redraft, "corpus": resolved is not None,
                         **decoding_facts(args, target)},
        "weights": weights_fingerprint(Path(args.drafter)),  # a folder given other weights since then is told so
        "temperatures_at_the_end": calibration.state()["temperatures"],  # the last step's, not kept
        # expected against measured while it learned, the first rounds (before it settled) included
        "while_learning": {key: {"tau": stats["tau"], "expected_tau": stats["expected_tau"]}
                           for key, stats in results["summary"].items()},
        "created": created,
    }
    try:
        save_calibration(out, settled, facts)
    except WriteFailed as failure:  # (a full disk) what was learned is not lost: kept elsewhere, or said in the line
        copy = saved_elsewhere(out, lambda copy: save_calibration(copy, settled, facts))
        kept = (f"what was learned is saved in {copy} instead: {failure.remedy} and move it into {out.parent} "
                f"(generate and bench take it meanwhile with --calibration {copy})" if copy else
                f"nothing could be saved (learned here: draft temperature {settled.describe()}): {failure.remedy} "
                "and run it again")
        print(table)
        raise DDTreeError(f"ddtree calibrate: cannot write {out} ({failure.why}); {kept}") from None
    print(table)
    print(f"calibration written to {out} (draft temperature {settled.describe()}, the mean over the last half of "
          "the rounds): generate and bench use it by default (--calibration none leaves it out)")
    if note_in_card(Path(args.drafter), created):  # an export's figures are of the drafter without it
        print(f"the folder's card ({Path(args.drafter) / 'README.md'}) now says its figures were measured without "
              f"{CALIBRATION_FILE}, which --calibration none reproduces")


def cmd_verify_cost(args) -> None:
    for flag, value in (("--sizes", min(args.sizes)), ("--context", args.context), ("--repeats", args.repeats)):
        if value < 1:
            raise DDTreeError(f"{flag} {value} must be at least 1")
    check_named_once("--sizes", args.sizes)  # else timed again and printed twice, each row with its own figures
    if args.compare_plain:
        if args.packed_weights != "auto":  # it would be ignored: both kinds of layer are timed
            raise DDTreeError(f"--compare-plain times both plain and packed linear layers: drop --packed-weights "
                              f"{args.packed_weights}")
        if not packing_available():
            raise DDTreeError("--compare-plain times packed linear layers, and this torch has no oneDNN weight packing: "
                              "drop --compare-plain")
        args.packed_weights = "off"  # the plain target; compare_packed_verify_cost packs a copy of it
    target, _ = _load_target(args)
    longest = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if longest is not None and args.context + max(args.sizes) + 1 > longest:
        raise DDTreeError(f"--context {args.context} with {max(args.sizes)} tree nodes and its root runs past target "
                          f"{args.target}'s {longest} positions: give a smaller --context or --sizes")
    if args.compare_plain:
        rows = compare_packed_verify_cost(target, args.sizes, args.context, args.repeats)
        print(f"target {args.target}, {str(target.dtype).removeprefix('torch.')}, {args.context}-token cache; "
              "plain and packed linear layers measured alternately (nodes 0: one AR step); "
              f"{machine_line(describe_machine(target.device))}")
        print(f"{'nodes':>6} {'plain ms':>9} {'packed ms':>10} {'plain / packed':>15}")
        for row in rows:
            print(f"{row['nodes']:>6} {row['plain_ms']:>9.1f} {row['packed_ms']:>10.1f} {row['ratio']:>14.2f}x")
        return
    rows = measure_verify_cost(target, args.sizes, args.context, args.repeats)
    print(f"{describe_target(args, target)}; {args.context}-token cache; one AR step {rows[0]['ar_step_ms']:.1f} ms")
    print(f"{'nodes':>6} {'verify ms':>10} {'x AR step':>10} {'tree overhead ms':>17}")
    for row in rows:
        print(f"{row['nodes']:>6} {row['verify_ms']:>10.1f} {row['ratio']:>10.2f} {row['overhead_ms']:>17.2f}")


@command
def main(argv: list[str] | None = None) -> int:
    args = default_device(build_parser().parse_args(argv))
    parse_device(args.device)  # one this machine lacks, or mps: said before any file is read or the target loads
    commands = {"generate": cmd_generate, "bench": cmd_bench, "calibrate": cmd_calibrate, "verify-cost": cmd_verify_cost}
    commands[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
