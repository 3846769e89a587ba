"""Measure training throughput: a full training step vs the frozen target's forward alone, same batch.

    python -m training.throughput --target smollm2-135m --batch-size 2 --length 320 \
        --settings 16x5x16,32x5x8 --threads 2
    python -m training.throughput --recipe qwen3-8b --random-target          # on a CUDA GPU

Each setting is ANCHORSxLAYERSxBLOCK. For each, the script times (median of --repeats, after
--warmup calls, which also compile flex attention on CUDA) the target's plain forward over the batch
(all layers, no LM head) and one training step of DistillModule (target features, drafter forward +
backward, AdamW step) under bf16 autocast, and prints the ratio and the target tokens per second;
then the same step from precomputed features (offline mode, training/features.py: no target
forward; with distillation the batch also carries the teacher a store keeps, the target's top
model.distill_top_k or its final hidden states), and its tokens per second. On CUDA the times come from CUDA events and each line adds the
peak GPU memory of the step. The batch is random tokens, ids the target's vocabulary holds, with the first 60
positions of each sequence marked as prompt, the rest as reply; --length may not pass the target's
max_position_embeddings.

Each result line names the target it timed. --recipe takes the target and the drafter settings (anchors, layers,
block, target layers, MASK id, loss chunk, compile), max_length (the batch length) and the per-GPU batch size from a
recipe; --target and --settings beside it are refused (--batch-size and --length override the recipe's). With
--random-target the target is not downloaded: it is built with random weights from its published configuration
(RANDOM_TARGETS), which is all its speed depends on.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from unittest import mock

from training.arguments import (THROUGHPUT_SETTINGS, THROUGHPUT_TARGET, answer_early, check_throughput_args,
                                parse_setting, recipes_for_target, throughput_parser)

# python -m: --help and a bad flag or recipe before torch and transformers load (14 s on the 2-core EPYC)
answer_early(__name__, throughput_parser, check_throughput_args)

import torch
from transformers import AutoModelForCausalLM

from ddtree.cli import parse_device
from ddtree.errors import DDTreeError, command
from ddtree.machine import describe_machine, machine_line
from ddtree.target_runner import context_limit

from . import target as target_loading
from .flops import PROMPT_TOKENS, RANDOM_TARGETS, recipe_settings, recipe_step_flops
from .loss import next_token_top_k
from .module import DistillModule
from .target import target_layer_features

FIRST_TOKEN = 100  # random batches skip the lowest ids (special tokens)
LAST_TOKEN = 40000  # and stay below this one, or below the target's vocabulary where it is smaller



def time_call(fn, repeats: int, warmup: int, device: torch.device, label: str = "",
              first=None) -> tuple[float, int | None]:
    """Median seconds of `fn` after `warmup` calls, and the peak GPU bytes of the timed calls (None on CPU).

    With a label, each warm-up call's seconds are printed as it ends: where a run that never finishes stalls.
    `first`, if given, stands in for `fn` as the first warm-up call (one that prints its phases, say)."""
    for call in range(warmup):  # first calls allocate, pick kernels and compile
        started = time.perf_counter()
        (first if call == 0 and first is not None else fn)()
        if label:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            print(f"{label}: warm-up {call + 1}/{warmup} took {time.perf_counter() - started:.1f} s", flush=True)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    # An event records on the current device's stream: outside this, GPU 0's, idle while --device cuda:N runs the step,
    # so end.synchronize() would not wait for it and the times would be the host's launches.
    with torch.cuda.device(device):
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times), torch.cuda.max_memory_allocated(device)


def phase_clock(label: str, device: torch.device):
    """mark(phase) prints the seconds since the last mark (the device synchronised first) under `label`; no label,
    no line and no synchronisation."""
    last = [time.perf_counter()]

    def mark(phase: str) -> None:
        if not label:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        print(f"{label}: {phase} took {now - last[0]:.1f} s", flush=True)
        last[0] = now

    return mark


def random_target_loader(name: str, build_on: torch.device):
    """A stand-in for ddtree.targets.load_target: the named target's architecture with random weights."""

    def load(name_or_path, dtype=torch.float32, device="cpu"):
        with torch.device(build_on):  # built where it runs: an 8B model is slow to initialise on a CPU
            model = AutoModelForCausalLM.from_config(RANDOM_TARGETS[name], dtype=dtype, attn_implementation="sdpa")
        return model.eval().requires_grad_(False), None  # the recipe names its MASK id: no tokenizer needed

    return load


def batch_token_ids(settings: dict, vocab_rows: int = LAST_TOKEN) -> range:
    """The token ids a random batch draws from: with a draft vocabulary, those ids, so that every label counts; else
    ids below LAST_TOKEN that the target's embedding (`vocab_rows` rows) holds: Llama-2's and Mistral's hold 32000."""
    size = settings.get("draft_vocab_size")
    return range(FIRST_TOKEN, FIRST_TOKEN + size) if size else range(FIRST_TOKEN, min(LAST_TOKEN, vocab_rows))


def build_module(settings: dict, random_target: bool, device: torch.device) -> DistillModule:
    module = DistillModule(**settings, target_dtype="bfloat16")
    patches = []
    if random_target:
        # configure_model loads the target by name; here the loader builds it from its configuration, so the
        # drafter, layer ids and MASK id are wired exactly as training wires them.
        patches.append(mock.patch.object(target_loading, "load_target", random_target_loader(settings["target"], device)))
    if settings.get("draft_vocab_size"):
        # Training chooses the draft vocabulary from its data; its speed depends only on the size.
        patches.append(mock.patch.object(DistillModule, "_training_reply_vocabulary",
                                         lambda self, vocab_size: list(batch_token_ids(settings))))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        module.configure_model()
    return module.to(device)


def store_batch(module: DistillModule, batch: dict) -> dict:
    """`batch` as a feature store serves it (training/feature_store.py shard_tensors): the target's features, and
    with distillation the teacher the store keeps, the target's top model.distill_top_k after each token ((B, T, k)
    ids and log-probabilities), or its final hidden states (B, T, H) when distill_top_k is 0."""
    distill = module.hparams.distill_weight > 0
    with torch.no_grad():
        features = target_layer_features(module.target, batch["input_ids"], module.target_layer_ids, final_hidden=distill)
    if not distill:
        return {**batch, "features": features}
    features, final = features  # (B, T, K*H), (B, T, H)
    if not module.hparams.distill_top_k:
        return {**batch, "features": features, "final_hidden": final}
    ids, log_probs = next_token_top_k(final, module.target.get_output_embeddings(), module.hparams.distill_top_k,
                                      target_config=module.target.config)
    return {**batch, "features": features, "teacher_ids": ids, "teacher_log_probs": log_probs}


def gigabytes(size: int | None) -> str:
    return "" if size is None else f", peak {size / 2**30:.1f} GiB"


@command
def main(argv: list[str] | None = None) -> int:
    args = throughput_parser().parse_args(argv)
    check_throughput_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    # A name torch does not know, or a GPU this machine lacks: one line here, not a traceback once the models load
    device = parse_device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.recipe is not None:  # an empty one is refused above, not taken for the default target
        recipe, max_length, recipe_batch = recipe_settings(args.recipe)
        if args.random_target and recipe["target"] not in RANDOM_TARGETS:
            raise DDTreeError(f"--random-target: no configuration for {args.recipe}'s target {recipe['target']!r}; "
                              f"known: {', '.join(RANDOM_TARGETS)}")
        cases = [(args.recipe, recipe)]
    else:
        max_length, recipe_batch = 320, 2
        cases = []
        for setting in (THROUGHPUT_SETTINGS if args.settings is None else args.settings).split(","):
            anchors, layers, block = parse_setting(setting)
            cases.append((setting, dict(target=THROUGHPUT_TARGET if args.target is None else args.target, num_anchors=anchors, num_layers=layers,
                                        block_size=block)))
    batch_size = args.batch_size if args.batch_size is not None else recipe_batch
    length = args.length if args.length is not None else max_length
    if length <= PROMPT_TOKENS + 1:  # a block anchors on a reply token whose successor is one too (training/masks.py)
        given = f"--length {length}" if args.length is not None else f"{args.recipe}'s data.max_length {length}"
        raise DDTreeError(f"{given} leaves no reply token with a successor to anchor a block on after the "
                          f"{PROMPT_TOKENS}-token prompt; give --length more than {PROMPT_TOKENS + 1}")

    tokens = batch_size * length
    # --compile, or a recipe's model.compile: the step timed is the one its training runs
    compiled = args.compile or any(settings.get("compile") for _, settings in cases)
    where = machine_line(describe_machine(device))  # the figures below depend on it: the CPU's model and bf16 features
    # Reading a recipe resolved and printed its trainer.precision; this tool measures bf16 (the GPU recipes') anyway.
    print(f"batch {batch_size} x {length}, {where}, bf16"
          + (" autocast, whatever the recipe's trainer.precision" if args.recipe else "")
          + (", random-weight target" if args.random_target else "")
          + (", compiled drafter forward" if compiled else ""))
    for label, settings in cases:
        started = time.perf_counter()  # progress lines: where a slow or stopped run spent its time
        try:
            module = build_module({**settings, "compile": compiled}, args.random_target, device)
        except DDTreeError as error:  # a Hub target out of reach, say: its architecture alone is all the timing needs
            if args.random_target or settings["target"] not in RANDOM_TARGETS:
                raise
            how = "add --random-target"
            if args.recipe is None:  # --random-target is refused without one (a random target has no MASK id)
                recipes = recipes_for_target(settings["target"])
                if not recipes:
                    raise
                how = "time its recipe with " + " or ".join(f"--recipe {name} --random-target" for name in recipes)
            raise DDTreeError(f"{error}; or {how} to build its published architecture with random "
                              "weights, all its speed depends on") from None
        print(f"{label:>10}: target and drafter built in {time.perf_counter() - started:.0f} s", flush=True)
        limit = context_limit(module.target)
        if length > limit:  # past a learned position table (GPT-2) the forward stops in an index error
            given = f"--length {length}" if args.length is not None else f"{args.recipe}'s data.max_length {length}"
            raise DDTreeError(f"{given} is past the {limit} positions of target {settings['target']!r} "
                              f"(max_position_embeddings): give --length at most {limit}")
        ids = batch_token_ids(settings, module.target.get_input_embeddings().num_embeddings)
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(ids.start, ids.stop, (batch_size, length), generator=generator).to(device)
        loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
        loss_mask[:, :PROMPT_TOKENS] = False
        batch = {"input_ids": input_ids, "loss_mask": loss_mask}
        # Fused, as training's (configure_optimizers: one kernel instead of about a dozen foreach launches). The
        # first H200 session's figures (docs/benchmarks.md, On a GPU) were timed with the unfused optimizer this replaced.
        optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-4, fused=True)

        def target_forward():
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                module.target.get_decoder()(input_ids=input_ids, use_cache=False)

        def training_step(step_batch: dict, phases: str = ""):
            """One step; with `phases` (the first, compiling call) each phase's seconds printed as it ends: the
            qwen3-8b step's first call outlasted 227 s on the H200 (2026-12-04) with no word of where."""
            mark = phase_clock(phases, device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = module.shared_step(step_batch, 0, "train").loss
            mark("forward")
            loss.backward()
            mark("backward")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mark("optimizer step")

        offline_batch = store_batch(module, batch)  # the step then skips the target, as from a store

        target_seconds, _ = time_call(target_forward, args.repeats, args.warmup, device)
        print(f"{label:>10}: target forward timed; the full step next (its warm-up compiles)", flush=True)
        step_seconds, step_peak = time_call(lambda: training_step(batch), args.repeats, args.warmup, device,
                                            f"{label:>10}: step", lambda: training_step(batch, f"{label:>10}: step 1"))
        offline_seconds, offline_peak = time_call(lambda: training_step(offline_batch), args.repeats, args.warmup, device,
                                                  f"{label:>10}: step from features")
        # What each side computes (training/flops.py): the ratio a step would have at equal efficiency, and the
        # rate each side reached, which tells a launch-bound side from a compute-bound one.
        # the drafter as built: a recipe may leave its layers, block and target layers to the module (or init_from)
        built = {"target_layer_ids": module.target_layer_ids, "block_size": module.block_size,
                 "num_layers": module.drafter_config.num_hidden_layers}
        flops = recipe_step_flops(module.target.config, {**settings, **built}, length, cuda=device.type == "cuda")
        print(  # the target named: a line copied out alone still says whose forward it timed
            f"{label:>10} on {settings['target']}: target forward {target_seconds:.3f} s, training step "
            f"{step_seconds:.3f} s{gigabytes(step_peak)}, ratio {step_seconds / target_seconds:.2f}, {tokens / step_seconds:.0f} target "
            f"tokens/s; offline step {offline_seconds:.3f} s{gigabytes(offline_peak)}, "
            f"{tokens / offline_seconds:.0f} tokens/s; FLOP ratio {flops.ratio:.2f}, target "
            f"{batch_size * flops.full_target / target_seconds / 1e12:.3g} TFLOP/s, step "
            f"{batch_size * flops.total / step_seconds / 1e12:.3g} TFLOP/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
