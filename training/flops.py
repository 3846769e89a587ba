"""What a training step computes against the target's forward, in matmul FLOPs, from the shapes alone.

    python -m training.flops --recipe qwen3-8b                       # the recipe's settings
    python -m training.flops --recipe qwen3-8b --anchors 256 --draft-vocab 32768

The aim of a training step within 1.5 target forwards (docs/benchmarks.md, "On a GPU") is a ratio of times. Where
both sides run their matmuls at the same efficiency, as large ones do on a GPU, the ratio of their
FLOPs is the floor that no kernel work can go under; `training/throughput.py` prints it beside the
measured ratio. Counted, per sequence of `length` tokens:

- the target: its decoder layers up to the deepest one the drafter reads (the step's forward), and all
  of them (what throughput times as "target forward"); no LM head. Causal attention counts half the
  score matrix, as flash kernels skip the masked half. Its MLP has a gate, an up and a down projection
  (Llama, Qwen), or, in the families of UNGATED_MLP (GPT-NeoX, Phi, GPT-2), the last two only.
- the drafter's forward (Qwen3's layers at the target's widths, the MLP gated whatever the target's): `fc`
  over the context rows, every layer's key/value projections over the context and the block rows, its
  query/output projections and MLP over the block rows (anchors x block size), attention over the keys
  each query sees (its anchor's context and its own block), and the frozen LM head over the drafted rows,
  those with a label (anchors x (block size - 1)), through the draft vocabulary's rows where the drafter
  has one. Anchors are counted as a step draws them: at most one per reply token with a successor
  (length - 61 of them), where the CUDA path still runs the drafter's layers over num_anchors blocks.
- online distillation (model.distill_weight > 0): the whole target runs (its final hidden states are the
  teacher), and the teacher's LM head: with model.distill_top_k the target's own, full vocabulary, over every block
  row; else the drafter's over the labelled rows, inside the loss (so again in backward where the loss is chunked).
- the backward: twice the forward for every trainable matmul (the input's gradient and the weight's),
  once for fc, which reads the detached target features (the weight's gradient only), and for the
  frozen LM head (the input's gradient only), whose forward is run again where the loss is chunked
  (model.loss_chunk_size: each chunk is recomputed in backward); attention twice its forward (four
  matmuls against two; a flash kernel recomputes the scores besides). The first layer's block
  projections read the frozen embedding, but through its norm's trainable weight, so their input's
  gradient is computed too.

The drafter's context rows are the sequence's own where the recipe trains on the CPU, and padded to the flex
kernel's width (training/masks.py, pad_for_flex; 1024 rows at least) where it trains on CUDA, as its
trainer.accelerator says.

Element-wise work (norms, softmax, the loss over the vocabulary) is not counted: it is memory-bound,
cheap on a GPU, and dominant only on a CPU at tiny widths.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from functools import cache

import torch
from transformers import AutoConfig, LlamaConfig, Qwen3Config

from ddtree.errors import CommandParser, DDTreeError, command
from ddtree.targets import default_layer_ids, resolve_target, target_field

from .arguments import check_recipe_name, recipe_path
from .feature_store import init_from_config
from .masks import FLEX_MIN_CONTEXT
from .recipe import GPU_ACCELERATORS, read_recipe

# The recipe's prompt share when no real batch is at hand: the positions neither counts nor supervises, here and in
# throughput's random batches (training/throughput.py), whose timings the counts stand beside.
PROMPT_TOKENS = 60

# Target families whose MLP has no gate: an up and a down projection (2 matrices, against Llama's and Qwen's 3).
UNGATED_MLP = {"gpt_neox", "phi", "gpt2"}

# Targets by their published config.json (architecture only): training/throughput.py builds them with random
# weights, and their FLOPs need nothing more.
RANDOM_TARGETS = {
    "Qwen/Qwen3-8B": Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-4B": Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
    ),
    "meta-llama/Llama-3.1-8B-Instruct": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    ),
}


@cache  # read once: a recipe of precision auto times the CPU's matmuls as it is read
def parsed_recipe(name: str):
    check_recipe_name(name)
    return read_recipe(recipe_path(name), [])


def recipe_settings(name: str) -> tuple[dict, int, int]:
    """DistillModule settings, max_length and per-GPU batch size of a recipe."""
    config = parsed_recipe(name)
    model = config.model.as_dict()
    model.pop("target_dtype", None)
    if model.get("init_from"):  # a warm start's drafter is its folder's shape where the recipe leaves it unset
        folder = init_from_config(model["init_from"])
        for field, value in (("num_layers", folder.num_hidden_layers), ("block_size", folder.block_size),
                             ("target_layer_ids", list(folder.target_layer_ids))):
            model[field] = value if model.get(field) is None else model[field]
    return model, config.data.max_length, config.data.batch_size


def recipe_on_cuda(name: str) -> bool:
    """Whether a recipe's steps take the CUDA path, which pads the drafter's context to the flex width
    (trainer.accelerator gpu or cuda, or auto where torch sees a GPU); the CPU path reads the sequence at its length."""
    accelerator = str(parsed_recipe(name).trainer.accelerator)
    return accelerator in GPU_ACCELERATORS or (accelerator == "auto" and torch.cuda.is_available())


@dataclass(frozen=True)
class Widths:
    """The matmul widths of one decoder stack (a target or a drafter); attention heads x head_dim."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = True  # the MLP's gate, up and down projections; else up and down only

    @classmethod
    def of(cls, config) -> "Widths":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # GPT-2 spells the MLP's width n_inner, and leaves it unset for 4 x (as build_drafter_config reads it)
        intermediate = target_field(config, config.model_type, ("intermediate_size", "n_inner"), 4 * config.hidden_size)
        return cls(config.hidden_size, intermediate, config.num_attention_heads,
                   getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                   gated=config.model_type not in UNGATED_MLP)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def query_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_matmuls(self, rows: float) -> float:
        """FLOPs of one decoder layer's projections and MLP over `rows` tokens (attention scores apart)."""
        per_row = (2 * self.hidden * (2 * self.query_width + 2 * self.kv_width)
                   + 2 * self.mlp_matrices * self.hidden * self.intermediate)
        return rows * per_row

    def attention(self, rows: float, keys_per_query: float) -> float:
        """FLOPs of `rows` queries against `keys_per_query` keys each: Q K^T and P V."""
        return 2 * 2 * rows * keys_per_query * self.query_width


def target_forward_flops(target: Widths, length: int, layers: int, causal: bool = True) -> float:
    """One sequence through `layers` decoder layers: projections, MLP and attention scores."""
    keys = (length + 1) / 2 if causal else length  # mean keys per query
    return layers * (target.layer_matmuls(length) + target.attention(length, keys))


def mean_keys_per_query(length: int, block_size: int, prompt: int = PROMPT_TOKENS) -> float:
    """Keys a block query sees on average with anchors uniform over a reply spanning positions prompt..length-2:
    the anchor's context (positions before it) and its own block."""
    first, last = prompt, length - 2
    return (first + last) / 2 + block_size


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step on one sequence, by part."""

    target: float  # the target's forward up to the deepest layer read
    context: float  # fc over the context rows, and every layer's context key/value projections
    blocks: float  # every layer's block projections and MLP
    attention: float  # block queries against the keys they see
    head: float  # the LM head over the block rows
    backward: float  # everything the drafter's backward computes (and the teacher's head recomputed in it)
    full_target: float  # a forward through every target layer (throughput's "target forward")
    teacher: float = 0.0  # online distillation: the teacher's LM head over the block rows (no gradient)

    @property
    def drafter_forward(self) -> float:
        return self.context + self.blocks + self.attention + self.head

    @property
    def total(self) -> float:
        return self.target + self.drafter_forward + self.teacher + self.backward

    @property
    def ratio(self) -> float:
        """The step against the target's full forward: the floor of throughput's ratio at equal efficiency."""
        return self.total / self.full_target


def step_flops(
    target: Widths,
    drafter: Widths,
    *,
    length: int,  # tokens of the sequence (the target's forward)
    width: int,  # context rows the drafter reads (length, or padded to the flex width on CUDA)
    blocks: int,  # blocks the drafter's layers run per sequence (on CUDA padded to num_anchors)
    block_size: int,
    drafter_layers: int,
    feature_layers: int,  # target layers read (fc's input is feature_layers x target hidden)
    read_depth: int,  # decoder layers the step's target forward runs (deepest layer id + 1)
    target_layers: int,  # all of the target's decoder layers
    head_rows: int,  # LM head rows the drafter's logits use (the draft vocabulary, or the whole)
    keys_per_query: float,  # mean keys a block query attends (mean_keys_per_query, or counted from a mask)
    loss_chunked: bool = False,  # model.loss_chunk_size set: the LM head's forward is recomputed in backward
    teacher_rows: int = 0,  # online distillation: rows through the teacher's LM head per block (0: none)
    teacher_vocab: int = 0,  # the rows of that LM head
    teacher_recomputed: bool = False,  # the teacher's head runs inside the chunked loss, so again in backward
    drawn: int | None = None,  # blocks drawn, whose rows reach the LM heads (default: blocks; on CUDA the padding's do not)
) -> StepFlops:
    drawn = blocks if drawn is None else drawn
    rows = blocks * block_size
    fc = 2 * width * feature_layers * target.hidden * drafter.hidden
    context_kv = drafter_layers * 2 * width * drafter.hidden * 2 * drafter.kv_width
    block_qo = 2 * rows * drafter.hidden * 2 * drafter.query_width
    block_kv = 2 * rows * drafter.hidden * 2 * drafter.kv_width
    block_mlp = 2 * rows * drafter.mlp_matrices * drafter.hidden * drafter.intermediate
    blocks_flops = drafter_layers * (block_qo + block_kv + block_mlp)
    attention = drafter_layers * drafter.attention(rows, keys_per_query)
    head = 2 * drawn * (block_size - 1) * drafter.hidden * head_rows  # the anchor's own row has no label
    teacher = 2 * drawn * teacher_rows * target.hidden * teacher_vocab
    backward = (fc + 2 * context_kv + 2 * blocks_flops + 2 * attention + (2 if loss_chunked else 1) * head
                + (teacher if teacher_recomputed else 0))
    return StepFlops(
        target=target_forward_flops(target, length, read_depth),
        context=fc + context_kv, blocks=blocks_flops, attention=attention, head=head, backward=backward,
        full_target=target_forward_flops(target, length, target_layers), teacher=teacher,
    )


def drawn_anchors(num_anchors: int, length: int, prompt: int = PROMPT_TOKENS) -> int:
    """Anchors a step draws in a sequence of `length` tokens (training/masks.py, sample_anchors): at most one per reply
    token that has a successor, positions prompt..length-2."""
    return max(0, min(num_anchors, length - prompt - 1))


def flex_width(length: int) -> int:
    """The context width the CUDA path pads to (training/masks.py, pad_for_flex)."""
    return max(FLEX_MIN_CONTEXT, 1 << (length - 1).bit_length())


def recipe_step_flops(target_config, settings: dict, length: int, cuda: bool = True,
                      anchors: int | None = None, draft_vocab: int | None = None, prompt: int = PROMPT_TOKENS) -> StepFlops:
    """A recipe's step (its model settings, as recipe_settings reads them) on one sequence whose first `prompt`
    tokens are the prompt."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    widths = Widths.of(text)
    # The drafter is Qwen3-shaped after the target, whatever its family (ddtree.targets.build_drafter_config): the
    # target's widths, with a gated MLP
    drafter = replace(widths, gated=True)
    layer_ids = settings.get("target_layer_ids") or default_layer_ids(text.num_hidden_layers)
    # Unset (None) in a recipe, they are DistillModule.configure_model's defaults (a warm start's are its folder's)
    block_size, num_layers = settings.get("block_size") or 16, settings.get("num_layers") or 5
    head_rows = draft_vocab or settings.get("draft_vocab_size") or text.vocab_size
    loss_chunked = bool(settings.get("loss_chunk_size"))
    # Online distillation runs the whole target (its final hidden states are the teacher) and the teacher's LM head:
    # with distill_top_k the target's own over every block row (next_token_top_k), else the drafter's over the
    # labelled rows, inside the loss (so again in backward where the loss is chunked).
    distill, top_k = (settings.get("distill_weight") or 0) > 0, settings.get("distill_top_k") or 0
    # A short reply has fewer anchors than asked: the CUDA path pads the drafter's blocks to the count asked (fixed
    # shapes for flex attention) but sends only the drawn ones to the LM heads; the CPU path runs the drawn ones alone.
    anchors = anchors or settings["num_anchors"]
    drawn = drawn_anchors(anchors, length, prompt)
    return step_flops(
        widths, drafter, length=length, width=flex_width(length) if cuda else length,
        blocks=anchors if cuda else drawn, drawn=drawn, block_size=block_size,
        drafter_layers=num_layers, feature_layers=len(layer_ids),
        read_depth=text.num_hidden_layers if distill else max(layer_ids) + 1,
        target_layers=text.num_hidden_layers, head_rows=head_rows,
        keys_per_query=mean_keys_per_query(length, block_size, prompt), loss_chunked=loss_chunked,
        teacher_rows=(block_size if top_k else block_size - 1) if distill else 0,
        teacher_vocab=text.vocab_size if top_k else head_rows, teacher_recomputed=distill and not top_k and loss_chunked,
    )


def table(rows: list[tuple[str, StepFlops]]) -> str:
    """A markdown table of FLOPs per sequence by part (in TFLOPs, or GFLOPs for small models), and the ratio floor."""
    scale, unit = (1e12, "TFLOPs") if max(f.total for _, f in rows) >= 1e12 else (1e9, "GFLOPs")
    lines = [f"| case ({unit} per sequence) | target read | drafter forward (context / blocks / attention / head) | "
             "teacher head | backward | step | full target forward | step / target |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, f in rows:
        n = lambda x: f"{x / scale:.2f}"  # noqa: E731
        lines.append(f"| {name} | {n(f.target)} | {n(f.drafter_forward)} ({n(f.context)} / {n(f.blocks)} / "
                     f"{n(f.attention)} / {n(f.head)}) | {n(f.teacher)} | {n(f.backward)} | {n(f.total)} | {n(f.full_target)} | "
                     f"{f.ratio:.2f} |")
    return "\n".join(lines)


def target_config_for(target: str):
    """A target's configuration without its weights: the published one for the targets throughput builds
    at random, else the target's own config.json (the built-in target's is local)."""
    if target in RANDOM_TARGETS:
        return RANDOM_TARGETS[target]
    return AutoConfig.from_pretrained(resolve_target(target))


@command
def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipes/<name>.yaml: its model settings and max_length")
    parser.add_argument("--length", type=int, default=None, help="tokens per sequence (default: the recipe's max_length)")
    parser.add_argument("--anchors", type=int, nargs="*", default=[], help="also count these anchor counts")
    parser.add_argument("--draft-vocab", type=int, nargs="*", default=[], help="also count these draft vocabularies")
    args = parser.parse_args(argv)
    for flag, values, least in (("--length", [args.length] if args.length is not None else [], 2),
                                ("--anchors", args.anchors, 1), ("--draft-vocab", args.draft_vocab, 1)):
        for value in values:
            if value < least:
                raise DDTreeError(f"{flag} {value}: give at least {least}")
    settings, max_length, _ = recipe_settings(args.recipe)
    length = args.length or max_length
    # A block anchors on a reply token whose successor is one too (training/masks.py): 2 reply tokens hold one, 1 none,
    # and the counts would be of blocks that cannot exist
    if length <= PROMPT_TOKENS + 1:
        given = f"--length {length}" if args.length else f"{args.recipe}'s data.max_length {length}"
        raise DDTreeError(f"{given} leaves no reply token with a successor to anchor a block on after the "
                          f"{PROMPT_TOKENS}-token prompt the count assumes; give --length more than {PROMPT_TOKENS + 1}")
    config = target_config_for(settings["target"])
    vocab = config.get_text_config().vocab_size
    head = settings.get("draft_vocab_size") or vocab
    for size in args.draft_vocab:
        if size > vocab:
            raise DDTreeError(f"--draft-vocab {size}: the target's vocabulary holds {vocab} tokens; give at most that")
    def anchors_label(anchors: int) -> str:  # a reply too short for them all: the count drawn, which is counted
        drawn = drawn_anchors(anchors, length)
        return f"{anchors} anchors" + (f" ({drawn} fit the reply)" if drawn < anchors else "")

    base = f"{anchors_label(settings['num_anchors'])}, head {head} rows"
    cuda = recipe_on_cuda(args.recipe)  # a CPU recipe's context is not padded to the CUDA path's flex width
    rows = [(f"{args.recipe} ({base})", recipe_step_flops(config, settings, length, cuda))]
    rows += [(anchors_label(anchors), recipe_step_flops(config, settings, length, cuda, anchors=anchors))
             for anchors in args.anchors]
    rows += [(f"draft vocabulary {size}", recipe_step_flops(config, settings, length, cuda, draft_vocab=size))
             for size in args.draft_vocab]
    context = f"the context padded to {flex_width(length)} rows (CUDA)" if cuda else "the context unpadded (CPU)"
    print(f"a sequence of {length} tokens, {context}; matmuls only, counted from the shapes (training/flops.py)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
