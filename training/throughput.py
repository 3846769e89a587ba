"""Measure training throughput: a full training step vs the frozen target's forward alone, same batch.

    python -m training.throughput --target smollm2-135m --batch-size 2 --length 320 \
        --settings 16x5x16,32x5x8 --threads 2

Each setting is ANCHORSxLAYERSxBLOCK. For each, the script times (median of --repeats, after one
warm-up) the target's plain forward over the batch (all layers, no LM head) and one training step
of DistillModule (target features, drafter forward + backward, AdamW step) under bf16 autocast,
and prints the ratio and the target tokens per second; then the same step from precomputed features
(offline mode, training/features.py: no target forward), and its tokens per second. The batch is random tokens with the first
60 positions of each sequence marked as prompt, the rest as reply.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ddtree.errors import command

from .module import DistillModule
from .target import target_layer_features


def time_call(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--settings", default="16x5x16", help="comma-separated ANCHORSxLAYERSxBLOCK")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(100, 40000, (args.batch_size, args.length), generator=generator)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    loss_mask[:, :60] = False
    batch = {"input_ids": input_ids, "loss_mask": loss_mask}
    tokens = input_ids.numel()
    print(f"target {args.target}, batch {args.batch_size} x {args.length}, {torch.get_num_threads()} threads, bf16")
    for setting in args.settings.split(","):
        anchors, layers, block = (int(x) for x in setting.split("x"))
        module = DistillModule(
            target=args.target, target_dtype="bfloat16", num_anchors=anchors, num_layers=layers, block_size=block,
            gamma=7.0 if block >= 16 else 4.0,
        )
        module.configure_model()
        optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-4)

        def target_forward():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                module.target.get_decoder()(input_ids=input_ids, use_cache=False)

        def training_step(step_batch: dict):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module.shared_step(step_batch, 0, "train").loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with torch.no_grad():
            features = target_layer_features(module.target, input_ids, module.target_layer_ids)
        offline_batch = {**batch, "features": features}  # the step then skips the target, as from a store

        target_seconds = time_call(target_forward, args.repeats)
        step_seconds = time_call(lambda: training_step(batch), args.repeats)
        offline_seconds = time_call(lambda: training_step(offline_batch), args.repeats)
        print(
            f"{setting:>10}: target forward {target_seconds:.2f} s, training step {step_seconds:.2f} s, "
            f"ratio {step_seconds / target_seconds:.2f}, {tokens / step_seconds:.0f} target tokens/s; "
            f"offline step {offline_seconds:.2f} s, {tokens / offline_seconds:.0f} tokens/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
