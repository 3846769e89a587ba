"""The drafter's forwards at fixed shapes (ddtree/static_drafter.py) give the growing cache's logits.

    .venv/bin/pytest -q tests/ddtree/test_static_drafter.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from ddtree.cli import load_drafter
from ddtree.decoding import DrafterRunner

# The context rows each call adds: the prompt (longer than a block: one uncaptured forward), then rounds
# that keep 1..block rows, as the decoding loop's root and accepted rows do; and the depth drafted.
ROUNDS = [(21, 7), (3, 7), (1, 7), (8, 7), (2, 3), (5, 7)]
CAPACITY = sum(rows for rows, _ in ROUNDS)


@pytest.fixture(scope="module")
def drafter(smollm2):
    model, tokenizer = smollm2
    drafter = load_drafter("random", model, tokenizer, "smollm2-135m")
    with torch.no_grad():  # random weights are small; scaled up, one context row moves the logits far
        for parameter in drafter.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.05)
    return drafter


def runs(runner: DrafterRunner, zero_row: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each round's propose logits, and its redraft logits behind the 3 likeliest first tokens.
    zero_row: that row of the prompt's context is zeros (a lost context row, to size the tolerance against)."""
    generator = torch.Generator().manual_seed(0)
    device, width = runner.lm_head.weight.device, runner.drafter.fc.in_features
    start, out = 0, []
    for round_, (rows, depth) in enumerate(ROUNDS):
        context = torch.randn(1, rows, width, generator=generator)
        if round_ == 0 and zero_row is not None:
            context[:, zero_row] = 0
        start += rows
        logits = runner.propose(100 + round_, start, context.to(device), depth)
        firsts = logits[0].topk(3).indices.tolist()
        out.append((logits.clone(), runner.redraft(100 + round_, start, firsts, depth).clone()))
    return out


def largest_difference(a, b) -> float:
    return max(max((x - y).abs().max().item() for x, y in zip(pair_a, pair_b)) for pair_a, pair_b in zip(a, b))


def test_fixed_shapes_give_the_growing_caches_logits(smollm2, drafter):
    model, _ = smollm2
    growing, fixed = DrafterRunner(drafter, model), DrafterRunner(drafter, model)
    fixed.fix_shapes(CAPACITY)
    assert not fixed.static.cuda_graph  # on the CPU the fixed-shape forwards run uncaptured
    expected, got = runs(growing), runs(fixed)
    for (want_block, want_redraft), (block, redraft) in zip(expected, got):
        assert block.shape == want_block.shape and redraft.shape == want_redraft.shape
    assert largest_difference(got, expected) < 1e-4
    growing.reset()
    assert largest_difference(runs(growing, zero_row=5), expected) > 100 * 1e-4  # what one lost row does


def test_a_runner_cast_to_another_dtype_gets_fixed_shapes_in_it(tiny_target):
    """fix_shapes hands the last generation's buffers to the next that fits: after the drafter was cast they were of
    the old dtype, and the first fixed-shape forward failed (float != BFloat16)."""
    from ddtree.decoding import generate
    from ddtree.modeling_dflash import DFlashDraftModel
    from ddtree.targets import build_drafter_config

    target, tokenizer = tiny_target
    target = copy.deepcopy(target)
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4,
                                  target_layer_ids=[0, target.config.num_hidden_layers - 1])
    runner = DrafterRunner(DFlashDraftModel(config).eval(), target)
    prompt = [5, 6, 7, 8]
    generate(target, prompt, "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    target.to(torch.bfloat16), runner.drafter.to(torch.bfloat16)
    result = generate(target, prompt, "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    fresh = generate(target, prompt, "ddtree", DrafterRunner(runner.drafter, target), budget=4, max_new_tokens=6,
                     static=True)  # the same bf16 forwards on new buffers
    assert runner.static.dtype == torch.bfloat16 and len(result.new_tokens) == 6
    assert result.new_tokens == fresh.new_tokens and result.tau == fresh.tau
    # There and back with no generation between: the same dtype, but the weights live elsewhere, and a captured CUDA
    # graph reads them by address. Both the drafter's and the target's fixed-shape runners are made again.
    from ddtree.target_runner import static_target

    before, target_runner = runner.static, static_target(target, True, 5, 64)
    assert static_target(target, True, 5, 64) is target_runner  # reused while nothing moved
    for model in (target, runner.drafter):
        model.to(torch.float32).to(torch.bfloat16)
    generate(target, prompt, "ddtree", runner, budget=4, max_new_tokens=6, static=True)
    assert runner.static is not before and static_target(target, True, 5, 64) is not target_runner


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_give_the_uncaptured_logits(smollm2, drafter):
    model, _ = smollm2
    target, on_gpu = copy.deepcopy(model).to("cuda"), copy.deepcopy(drafter).to("cuda")
    uncaptured, graphed = DrafterRunner(on_gpu, target), DrafterRunner(on_gpu, target)
    uncaptured.fix_shapes(CAPACITY, cuda_graph=False)
    graphed.fix_shapes(CAPACITY)
    got = runs(graphed)
    assert graphed.static.cuda_graph and set(graphed.static.graphs) == {"propose", 3}  # both forwards replayed
    assert largest_difference(got, runs(uncaptured)) < 1e-4
