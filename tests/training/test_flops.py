"""The FLOP model of a training step (training/flops.py) against torch's own FLOP counter.

On the CPU the attention kernels SDPA picks are not in torch's counter, so the counter sees the matmuls
alone: those are compared exactly (to rounding of the rotary embedding's small matmul), and the
attention term's key count is checked against the training mask itself.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from training.flops import (Widths, flex_width, main, mean_keys_per_query, recipe_on_cuda, recipe_settings,
                            recipe_step_flops, step_flops, target_config_for, target_forward_flops)
from training.masks import dense_block_mask, pad_for_flex, sample_anchors
from training.module import DistillModule
from training.target import target_layer_features

LAYER_IDS = [0, 2, 4]


def tiny_module(**overrides) -> DistillModule:
    settings = dict(target="tiny-random", num_layers=2, block_size=4, target_layer_ids=LAYER_IDS, num_anchors=5,
                    gamma=4.0, target_dtype="float32")
    module = DistillModule(**{**settings, **overrides})
    module.configure_model()
    return module


def batch(length: int, prompt: int = 10, sequences: int = 2, vocab: int = 900) -> dict:
    """Tokens 100..100+vocab: with a draft vocabulary of those ids every label is counted."""
    input_ids = torch.randint(100, 100 + vocab, (sequences, length), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    loss_mask[:, :prompt] = False
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("draft_vocab_size, loss_chunk_size", [(None, None), (64, 8)])
def test_the_step_matmuls_are_what_the_model_counts(draft_vocab_size, loss_chunk_size, monkeypatch):
    torch.manual_seed(0)
    # Training picks the draft vocabulary from its data; the count depends on its size alone.
    monkeypatch.setattr(DistillModule, "_training_reply_vocabulary", lambda self, vocab_size: list(range(100, 100 + self.hparams.draft_vocab_size)))
    module = tiny_module(draft_vocab_size=draft_vocab_size, loss_chunk_size=loss_chunk_size)
    step_batch = batch(length=40, vocab=draft_vocab_size or 900)
    sequences, length = step_batch["input_ids"].shape
    target_config = module.target.config
    widths = Widths.of(target_config)

    target_counted = counted(lambda: target_layer_features(module.target, step_batch["input_ids"], LAYER_IDS))
    forward = {}
    forward_counted = counted(lambda: forward.setdefault("loss", module.shared_step(step_batch, 0, "train").loss))
    backward_counted = counted(lambda: forward["loss"].backward())

    model = step_flops(
        widths, Widths.of(module.drafter.config), length=length, width=length, blocks=5, block_size=4,
        drafter_layers=2, feature_layers=len(LAYER_IDS), read_depth=max(LAYER_IDS) + 1,
        target_layers=target_config.num_hidden_layers,
        head_rows=draft_vocab_size or target_config.vocab_size, keys_per_query=0.0,
        loss_chunked=loss_chunk_size is not None,
    )
    read_matmuls = (max(LAYER_IDS) + 1) * widths.layer_matmuls(length)  # attention is not in the CPU count
    assert target_counted == pytest.approx(sequences * read_matmuls, rel=1e-3)
    drafter_forward = forward_counted - target_counted  # the step runs the same target forward first
    assert drafter_forward == pytest.approx(sequences * model.drafter_forward, rel=5e-3)
    assert backward_counted == pytest.approx(sequences * model.backward, rel=5e-3)


@pytest.mark.parametrize("distill", [dict(distill_weight=0.5), dict(distill_weight=0.5, loss_chunk_size=8),
                                     dict(distill_weight=0.5, distill_top_k=8),
                                     # the top-k teacher head is the target's, outside the chunked loss: not recomputed
                                     dict(distill_weight=0.5, distill_top_k=8, loss_chunk_size=8)])
def test_online_distillation_counts_the_whole_target_and_the_teachers_head(distill):
    """With distill_weight > 0 the step runs every target layer (the final hidden states are the teacher) and the
    teacher's LM head: the model had counted neither (the counter found 1.45x and 1.60x of it)."""
    torch.manual_seed(0)
    module = tiny_module(**distill)
    step_batch = batch(length=40)
    sequences, length = step_batch["input_ids"].shape
    forward = {}
    forward_counted = counted(lambda: forward.setdefault("loss", module.shared_step(step_batch, 0, "train").loss))
    backward_counted = counted(lambda: forward["loss"].backward())

    settings = dict(target="tiny-random", num_layers=2, block_size=4, target_layer_ids=LAYER_IDS, num_anchors=5, **distill)
    target_config = module.target.config
    model = recipe_step_flops(target_config, settings, length, cuda=False, prompt=10)
    # the CPU counter sees no SDPA attention: the target's and the drafter's (forward, and twice in backward) apart
    target_attention = target_config.num_hidden_layers * Widths.of(target_config).attention(length, (length + 1) / 2)
    matmuls = model.total - target_attention - 3 * model.attention
    assert forward_counted + backward_counted == pytest.approx(sequences * matmuls, rel=0.02)


def family_config(family: str):
    """A tiny random target of `family`, its MLP 4 x its width wide."""
    import transformers

    shape = dict(num_hidden_layers=4, num_attention_heads=4, vocab_size=1000, max_position_embeddings=256)
    return {
        # head_dim apart from hidden / heads (16), as Qwen3-4B's 128 is apart from its 2560 / 32
        "qwen3": lambda: transformers.Qwen3Config(hidden_size=64, intermediate_size=256, num_key_value_heads=2,
                                                  head_dim=32, **shape),
        # no head_dim in its config: hidden / heads (16), though its key/value heads are fewer
        "qwen2": lambda: transformers.Qwen2Config(hidden_size=64, intermediate_size=256, num_key_value_heads=2,
                                                  **shape),
        "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_key_value_heads=2,
                                                  **shape),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=256, **shape),
        "phi": lambda: transformers.PhiConfig(hidden_size=64, intermediate_size=256, **shape),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=4, n_head=4),  # n_inner unset: 4 x
    }[family]()


@pytest.mark.parametrize("top_k", [0, 5])
def test_the_teachers_head_on_cuda_runs_over_the_blocks_drawn_not_the_padding(top_k):
    """The CUDA path pads the drafter's blocks to num_anchors for flex attention, but the teacher's LM head, like the
    drafter's, reads the drawn blocks alone: 80 tokens after a 60-token prompt draw 19 of 32, and a teacher counted
    over the 32 counted its head 32/19 of what the step computes."""
    settings = dict(target="tiny-random", num_layers=2, block_size=4, target_layer_ids=[0, 2], num_anchors=32,
                    distill_weight=1.0, distill_top_k=top_k)
    padded, drawn = (recipe_step_flops(family_config("qwen3"), settings, 80, cuda=True, anchors=anchors)
                     for anchors in (32, 19))
    assert padded.teacher == drawn.teacher > 0 and padded.blocks == pytest.approx(32 / 19 * drawn.blocks)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "gpt_neox", "phi", "gpt2"])
def test_a_targets_forward_is_what_the_counter_counts_in_every_family(family):
    """Qwen3 and Llama gate their MLP (3 matrices); GPT-NeoX, Phi and GPT-2 do not (2): every target's MLP was
    counted gated, 1.26x the counter for GPT-NeoX and Phi, and GPT-2's config (n_inner) was an AttributeError. Qwen2
    records no head_dim and fewer key/value heads than query heads: its heads are hidden / heads wide, whatever the
    key/value heads."""
    import transformers

    config = family_config(family)
    config._attn_implementation = "eager"  # the counter sees Q K^T and P V too, over the whole score matrix
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    length = 100
    with torch.no_grad():
        measured = counted(lambda: model.get_decoder()(input_ids=torch.randint(0, 1000, (1, length)), use_cache=False))
    modelled = target_forward_flops(Widths.of(config), length, config.num_hidden_layers, causal=False)
    assert modelled == pytest.approx(measured, rel=1e-3)


def test_the_drafter_is_counted_with_its_own_gated_mlp_after_an_ungated_target(tmp_path):
    """The drafter is Qwen3-shaped whatever the target (ddtree.targets.build_drafter_config): after a GPT-NeoX
    target its MLP keeps 3 matrices. A whole step on such a target, against the counter."""
    import transformers

    from ddtree.targets import resolve_target

    folder = tmp_path / "neox"
    # (a spare embedding row past the tokenizer's 49152 tokens is the drafter's MASK)
    config = transformers.GPTNeoXConfig(vocab_size=49153, hidden_size=64, intermediate_size=256, num_hidden_layers=6,
                                        num_attention_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_target("tiny-random")).save_pretrained(folder)
    module = tiny_module(target=str(folder))
    step_batch = batch(length=40)
    sequences, length = step_batch["input_ids"].shape
    forward = {}
    forward_counted = counted(lambda: forward.setdefault("loss", module.shared_step(step_batch, 0, "train").loss))
    backward_counted = counted(lambda: forward["loss"].backward())

    settings = dict(target=str(folder), num_layers=2, block_size=4, target_layer_ids=LAYER_IDS, num_anchors=5)
    model = recipe_step_flops(module.target.config, settings, length, cuda=False, prompt=10)
    # the CPU counter sees no SDPA attention: the target's (the layers read) and the drafter's (and twice in backward)
    target_attention = (max(LAYER_IDS) + 1) * Widths.of(config).attention(length, (length + 1) / 2)
    matmuls = model.total - target_attention - 3 * model.attention
    assert forward_counted + backward_counted == pytest.approx(sequences * matmuls, rel=5e-3)


def test_a_reply_too_short_for_the_anchors_is_counted_at_the_blocks_drawn():
    """80 tokens after a 60-token prompt hold 19 anchors: a step asked for 32 draws 19, and the model counted 32
    (throughput printed a FLOP ratio of 62.65 for 64x1x4 at --length 80, where the step computes 19.33)."""
    torch.manual_seed(0)
    module = tiny_module(num_anchors=32)
    step_batch = batch(length=80, prompt=60)
    sequences, length = step_batch["input_ids"].shape
    forward = {}
    forward_counted = counted(lambda: forward.setdefault("loss", module.shared_step(step_batch, 0, "train").loss))
    backward_counted = counted(lambda: forward["loss"].backward())

    settings = dict(target="tiny-random", num_layers=2, block_size=4, target_layer_ids=LAYER_IDS, num_anchors=32)
    model = recipe_step_flops(module.target.config, settings, length, cuda=False)
    # the CPU counter sees no SDPA attention: the target's (the layers read) and the drafter's (and twice in backward)
    target_attention = (max(LAYER_IDS) + 1) * Widths.of(module.target.config).attention(length, (length + 1) / 2)
    # every candidate is drawn, so the last blocks run past the sequence: anchors 77 and 78 lose 1 and 2 labelled rows,
    # which the model counts (at a recipe's length such rows are a fraction of a percent of the head's)
    head_row = model.head / (19 * 3)  # forward, and the input's gradient in backward
    matmuls = model.total - target_attention - 3 * model.attention - 2 * 3 * head_row
    assert forward_counted + backward_counted == pytest.approx(sequences * matmuls, rel=5e-3)
    # CUDA pads the drafter's blocks to the 32 asked, and sends the 19 drawn to the LM head
    on_cuda, drawn = (recipe_step_flops(module.target.config, settings, length, cuda=True, anchors=anchors)
                      for anchors in (32, 19))
    assert on_cuda.head == drawn.head == model.head and on_cuda.blocks == pytest.approx(32 / 19 * drawn.blocks)


def test_the_cli_names_the_anchors_a_short_reply_holds(capsys):
    """smollm2-135m at --length 70: 16 anchors asked, 9 fit; the step was counted at 1.84 target forwards, not 1.49."""
    row, = printed_rows(capsys, ["--recipe", "smollm2-135m", "--length", "70"])
    assert "(16 anchors (9 fit the reply), head 8192 rows)" in row
    nine, = printed_rows(capsys, ["--recipe", "smollm2-135m", "--length", "70", "--anchors", "9"])[1:]
    assert row.rsplit("|", 2)[1] == nine.rsplit("|", 2)[1]  # the same ratio as 9 anchors asked


def test_the_header_says_the_rows_a_cuda_recipes_context_is_counted_at(capsys):
    """smollm2-135m-gpu trains on CUDA: at --length 70 its context is counted at the flex width training pads it to,
    and the line above the table must name that width, not the sequence's length, or the counts read as of 70 rows."""
    assert flex_width(70) != 70
    assert main(["--recipe", "smollm2-135m-gpu", "--length", "70"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("a sequence of "))
    assert header.startswith(f"a sequence of 70 tokens, the context padded to {flex_width(70)} rows (CUDA); ")


def test_the_shortest_length_counted_holds_one_anchor_as_training_draws_it(capsys):
    """A 2-token reply after the 60-token prompt anchors one block on its first token (a recipe keeps such a reply at
    data.min_supervised_tokens 2): --length 62 was refused as leaving no reply."""
    _, valid = sample_anchors(batch(62, prompt=60)["loss_mask"], 16, torch.Generator().manual_seed(0))
    assert valid.sum(dim=1).tolist() == [1, 1]
    row, = printed_rows(capsys, ["--recipe", "smollm2-135m", "--length", "62"])
    assert "(16 anchors (1 fit the reply), head 8192 rows)" in row


def test_the_mean_key_count_is_the_training_masks():
    """Anchors uniform over the reply: each block query sees its anchor's context and its own block."""
    length, prompt, block_size, anchors = 300, 60, 16, 32
    step_batch = batch(length, prompt, sequences=1)
    seen, generator = [], torch.Generator().manual_seed(0)
    for _ in range(1000):  # 32000 anchors: the mean's standard error is 0.4 keys
        drawn, _ = sample_anchors(step_batch["loss_mask"], anchors, generator)
        mask = dense_block_mask(drawn, length, block_size)
        seen.append(mask.sum().item() / mask.shape[2])
    assert sum(seen) / len(seen) == pytest.approx(mean_keys_per_query(length, block_size, prompt), rel=0.01)


def test_the_published_settings_put_the_step_above_two_target_forwards(capsys):
    """qwen3-8b's recipe at 512 anchors x 16: the drafter reads 8192 block rows against the target's 3072."""
    assert main(["--recipe", "qwen3-8b", "--anchors", "128", "--draft-vocab", "32768"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "case" not in line]
    ratios = [float(line.rsplit("|", 2)[1]) for line in lines]
    assert len(ratios) == 3 and ratios[0] > 2 and ratios[1] < ratios[0] and ratios[2] < ratios[0]


def printed_rows(capsys, argv: list[str]) -> list[str]:
    assert main(argv) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "case" not in line]


@pytest.mark.parametrize("recipe", ["qwen3-4b", "llama3.1-8b"])
def test_every_large_recipe_is_counted_without_the_hub(recipe, monkeypatch, capsys):
    """Their targets' configurations are in RANDOM_TARGETS: the count needed the Hub, and offline stopped."""
    monkeypatch.setattr("training.flops.AutoConfig.from_pretrained", lambda *args, **kwargs: pytest.fail("read the Hub"))
    row, = printed_rows(capsys, ["--recipe", recipe])
    assert row.startswith(f"| {recipe} (512 anchors, head ")


def test_a_cpu_recipe_is_counted_at_its_own_context_width(capsys):
    """A CPU recipe's step reads the context at the sequence's length; the CUDA path pads it to the flex width
    (1024 rows at least). The CLI counted every recipe as on CUDA: smollm2-135m's context term at 3.85 G, not 1.44."""
    settings, length, _ = recipe_settings("tiny")  # trainer.accelerator: cpu, 256 tokens
    target = target_config_for(settings["target"])
    on_cpu, on_cuda = (recipe_step_flops(target, settings, length, cuda=cuda) for cuda in (False, True))
    assert on_cuda.context > 2 * on_cpu.context  # 1024 rows against 256
    row, = printed_rows(capsys, ["--recipe", "tiny"])
    context = float(re.search(r"\((\S+) / ", row).group(1))
    assert context == pytest.approx(on_cpu.context / 1e9, abs=0.006), row


@pytest.mark.parametrize("length", [384, 1024, 1025, 4096])
def test_the_flex_width_is_the_width_training_pads_to(length):
    """At a power of two (max_length 1024, 2048, 4096) the context is not padded further."""
    padded, _ = pad_for_flex(torch.zeros(1, length, 1), torch.zeros(1, 1, dtype=torch.long), 1)
    assert flex_width(length) == padded.shape[1]


@pytest.mark.parametrize("gpu", [True, False])
def test_a_recipe_on_auto_takes_the_cuda_path_where_torch_sees_a_gpu(monkeypatch, gpu):
    """Lightning's default accelerator, auto, which no shipped recipe names but a user's own may leave."""
    auto = SimpleNamespace(trainer=SimpleNamespace(accelerator="auto"))
    monkeypatch.setattr("training.flops.parsed_recipe", lambda name: auto)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert recipe_on_cuda("mine") == gpu


def test_the_benchmarks_flop_tables_are_the_clis_output(capsys):
    """docs/benchmarks.md's table kept smollm2-135m's row from before it distilled online (94.1 G where the CLI counts
    107.08, no teacher column): each command the section names must print its rows as the page shows them."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    section = page[page.index("- **What a step computes**"):page.index("- **The GPU recipe, 900 steps**")]
    commands = [shlex.split(command) for command in re.findall(r"`python -m training\.flops ([^`\[]+)`", section)]
    shown = {line.strip() for line in section.splitlines() if line.strip().startswith("| ") and "case" not in line}
    printed = [row for argv in commands for row in printed_rows(capsys, argv)]
    assert len(commands) >= 3 and set(printed) == shown, (sorted(shown - set(printed)), printed)


@pytest.mark.parametrize("flags, said", [
    (["--length", "0"], "--length 0: give at least 2"),
    (["--length", "61"], "--length 61 leaves no reply token with a successor to anchor a block on after the "
                         "60-token prompt the count assumes; give --length more than 61"),  # at 10: 177 target forwards
    (["--anchors", "-4"], "--anchors -4: give at least 1"),
    (["--draft-vocab", "0"], "--draft-vocab 0: give at least 1"),
    (["--draft-vocab", "200000"], "--draft-vocab 200000: the target's vocabulary holds 151936 tokens; give at most that"),
])
def test_bad_numbers_are_one_line(capsys, flags, said):
    assert main(["--recipe", "qwen3-8b", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"error: {said}"


def test_the_least_count_each_flag_names_is_counted_not_refused(capsys):
    """The refusals above say "give at least 1": one anchor and a one-row head are the smallest counts a user can ask
    for, and each gets its own row."""
    recipe, one_anchor, one_row = printed_rows(capsys, ["--recipe", "qwen3-8b", "--anchors", "1", "--draft-vocab", "1"])
    assert one_anchor.startswith("| 1 anchors |") and one_row.startswith("| draft vocabulary 1 |")


def test_the_draft_vocab_flag_sets_its_rows_head_up_to_the_whole_vocabulary(capsys):
    """smollm2-135m's recipe sets draft_vocab_size 8192: each flag's row counts its own head against it, the target's
    whole vocabulary (49152) included, which the refusal above invites."""
    recipe, quarter, whole = printed_rows(capsys, ["--recipe", "smollm2-135m", "--draft-vocab", "2048", "49152"])
    head = lambda row: float(re.search(r"/ ([\d.]+)\) \|", row).group(1))  # noqa: E731 (drafter forward's last term)
    assert head(quarter) == pytest.approx(head(recipe) / 4, abs=0.01)  # each printed to 0.01
    assert head(whole) == pytest.approx(head(recipe) * 6, abs=0.05)


def test_a_shallow_target_without_layer_ids_is_counted_with_the_ids_training_picks():
    """Under 8 layers training picks distinct ids (ddtree.targets.default_layer_ids: [0, 1, 2] on 4); the estimate
    used the published spread, [1, 1, 1, 1, 1], counting five layers' features and a target stopped at layer 1."""
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    settings = dict(num_layers=1, block_size=4, num_anchors=4)
    assert recipe_step_flops(target, settings, 64, cuda=False) == recipe_step_flops(
        target, {**settings, "target_layer_ids": [0, 1, 2]}, 64, cuda=False)


def test_a_recipe_that_leaves_the_drafters_shape_unset_is_counted_at_the_modules_defaults():
    """model.num_layers and model.block_size may be left unset (None): the module builds 5 layers of block 16. The
    count stopped in a TypeError traceback (None + a float), in training.flops and after throughput's timings."""
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    unset = dict(num_layers=None, block_size=None, num_anchors=4, target_layer_ids=[0, 1, 2])
    assert recipe_step_flops(target, unset, 96, cuda=False) == recipe_step_flops(
        target, {**unset, "num_layers": 5, "block_size": 16}, 96, cuda=False)


def test_a_recipe_that_leaves_the_drafters_shape_to_its_warm_start_is_counted_at_the_folders(tmp_path, monkeypatch):
    """model.init_from with model.num_layers, block_size and target_layer_ids unset: the module builds the folder's
    drafter (1 layer of block 4 reading layers 0, 2, 4), and the count must be of it, not of 5 layers of block 16."""
    tiny_module(num_layers=1).drafter.save_pretrained(tmp_path / "drafter")
    model = dict(target="tiny-random", num_layers=None, block_size=None, target_layer_ids=None, num_anchors=8,
                 init_from=str(tmp_path / "drafter"))
    recipe = SimpleNamespace(model=SimpleNamespace(as_dict=lambda: dict(model)),
                             data=SimpleNamespace(max_length=96, batch_size=2))
    monkeypatch.setattr("training.flops.parsed_recipe", lambda name: recipe)
    settings, _, _ = recipe_settings("mine")
    assert (settings["num_layers"], settings["block_size"], settings["target_layer_ids"]) == (1, 4, LAYER_IDS)


def small_llama():
    """A Llama of width 8 (2 heads of 4, 1 key/value head), MLP 16, 4 layers, vocabulary 32: FLOPs to derive by hand."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4)


def test_a_small_step_is_counted_as_the_docstring_derives_it_by_hand():
    """Every term of the module docstring, derived by hand for small_llama at 70 tokens after the 60-token prompt on
    the CPU path: 1 drafter layer reading target layers 0 and 1, 3 anchors of block 4. A term counted twice or
    dropped, a wrong layer count or the causal half missed moves one of these."""
    target = small_llama()
    settings = dict(num_layers=1, block_size=4, num_anchors=3, target_layer_ids=[0, 1])
    f = recipe_step_flops(target, settings, 70, cuda=False)
    # a target layer per row: q, o 8x8 and k, v 8x4 (192 multiply-adds), gate, up, down 8x16 (384): 2 x 576 FLOPs
    layer = 70 * 2 * 576 + 2 * 2 * 70 * 35.5 * 8  # attention: Q K^T and P V over (70 + 1) / 2 keys a query, 8 wide
    assert (f.target, f.full_target) == (2 * layer, 4 * layer)  # layers 0..1 read; all 4 for throughput's forward
    fc = 2 * 70 * 16 * 8  # 70 context rows of 2 target layers' features (16) into the drafter's width
    context_kv = 2 * 70 * 2 * 8 * 4
    assert f.context == fc + context_kv
    assert f.blocks == 12 * 2 * 576  # 3 anchors x 4 block rows through the drafter's layer (gated, as the target's)
    assert f.attention == 2 * 2 * 12 * ((60 + 68) / 2 + 4) * 8  # an anchor's context over positions 60..68, its block
    assert f.head == 2 * 3 * 3 * 8 * 32  # the 3 labelled rows of each block, through the whole vocabulary
    assert f.teacher == 0
    assert f.backward == fc + 2 * context_kv + 2 * f.blocks + 2 * f.attention + f.head
    assert f.total == f.target + f.context + f.blocks + f.attention + f.head + f.backward
    assert f.ratio == f.total / f.full_target < 1  # at 70 tokens a step is under one target forward


@pytest.mark.parametrize("top_k, rows, vocab", [(0, 3, 16), (8, 4, 32)])
def test_the_teachers_head_is_the_drafters_draft_vocabulary_unless_it_is_the_targets_top_k(top_k, rows, vocab):
    """Without distill_top_k the teacher's logits come from the drafter's head over the labelled rows, so through its
    draft vocabulary (16 rows here); with it, the target's own head over every block row and its whole vocabulary."""
    target = small_llama()
    settings = dict(num_layers=1, block_size=4, num_anchors=3, target_layer_ids=[0, 1], draft_vocab_size=16,
                    distill_weight=0.5, distill_top_k=top_k)
    f = recipe_step_flops(target, settings, 70, cuda=False)
    assert f.head == 2 * 3 * 3 * 8 * 16
    assert f.teacher == 2 * 3 * rows * 8 * vocab
    assert f.target == f.full_target  # the teacher is the final hidden state: every target layer runs
