"""The `ddtree` command's arguments, in a module free of torch and transformers.

The console script `ddtree` (ddtree/__main__.py) parses with them before those load, so `--help` and a bad flag answer
at once (they waited about 8 s for torch and transformers on the 2-core EPYC); ddtree/cli.py runs the command.
"""

from __future__ import annotations

import argparse

from .errors import CommandParser
from .files import path_argument
from .names import AUTO, CALIBRATION_FILE, DTYPE_NAMES, METHODS, PACKED_KERNELS

DESCRIPTION = "generate text or benchmark decoding methods with a target and a drafter"
DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda where this machine has a GPU, else cpu)"
ONLINE_CALIBRATION_HELP = ("learn the draft temperature from the verified rounds, so the drafter's expected tau tracks "
                           "the measured one (changes the tree's shape, never the output); it starts from the "
                           "drafter's calibration file, if any")
CALIBRATION_HELP = ("a calibration file (`ddtree calibrate`): its draft temperatures and lookup acceptances shape and "
                    f"score every tree, as it is; default: the drafter folder's {CALIBRATION_FILE}, else the "
                    "calibration its config holds (model.replay_calibration); none = neither it nor the calibration "
                    "the drafter's config holds (a model.calibrate drafter's per-position draft_temperatures stay: "
                    "they are the drafter's, as its weights are)")
DTYPE_HELP = ("auto (bf16 on a GPU of compute capability 8.0 on, or where a quick matmul timing takes under 0.9x "
              "float32's time on this CPU; else float32), float32, bfloat16 or float16")


def _dtype(text: str) -> str:
    """--dtype: auto or a dtype's name (as ddtree.targets.parse_dtype reads it, torch.float32 too), checked here: a
    misspelt one (fp32, bf16) was refused only once torch had loaded, 4 s on."""
    if text != AUTO and text.removeprefix("torch.") not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"choose auto or one of {', '.join(DTYPE_NAMES)}, got {text!r}")
    return text


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _seed(text: str) -> int:
    """--seed: an integer torch.manual_seed takes (-2**63 to 2**64 - 1); a larger one was a traceback once the target
    had loaded."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -2**63 <= seed < 2**64:
        raise argparse.ArgumentTypeError(f"{text} is outside the seeds torch takes, -2**63 to 2**64-1")
    return seed


def _non_negative(text: str) -> int:
    """--lookup, --redraft: a count, 0 = off. A negative one was refused only after the target, the drafter and the
    corpus had loaded, behind a calibration note that suggested the same value."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 (0 = off), got {text}")
    return count


STATIC_CACHE = {"auto": None, "on": True, "off": False}  # --static-cache -> generate(static=...)
ADAPTIVE_SIZE = ("auto", "on", "off")


def _add_packed_weights(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--packed-weights", choices=PACKED_KERNELS, default="auto",
                        help="run the target's and drafter's linear layers through oneDNN with their weights packed "
                             "once (fp32 on a CPU; same tokens, faster forwards of few rows: docs/decoding.md); auto = "
                             "on where a measurement at start finds them faster and the packed copy fits easily in "
                             "memory")


def _add_common(parser: argparse.ArgumentParser, learns: bool = False) -> None:
    """The options generate, bench and calibrate share. learns: calibrate's, which writes into a drafter folder and
    learns from a fresh start: --online-calibration and --calibration, which it refuses (saying why), stay out of its
    --help."""
    parser.add_argument("--target", type=path_argument, default="smollm2-135m",
                        help="built-in name, local HF folder or Hub id (default: smollm2-135m, built in)")
    parser.add_argument("--drafter", type=path_argument, default="random",
                        # the default said: left out, generate and bench decoded with an untrained drafter unasked
                        help="the drafter folder to calibrate (required)" if learns
                        else "a drafter folder, or 'random': an untrained drafter, for smoke tests (default: random)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="at T > 0, sample from the smallest set of likeliest tokens whose probability reaches "
                        "this, after --top-k (default: 1, no cut)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="at T > 0, sample from the k likeliest tokens and any tied with the k-th, before --top-p "
                        "(default: 0, no cut)")
    parser.add_argument("--dtype", type=_dtype, default=AUTO, help=DTYPE_HELP)
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    _add_packed_weights(parser)
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="at most this many new tokens a reply (default: %(default)s)")
    parser.add_argument("--seed", type=_seed, default=0,
                        help=f"random seed of the sampling{'' if learns else ', and of --drafter random weights'} "
                             "(default: 0). In bf16 a verify's logits depend on its row count, which --adaptive-size "
                             "times on this machine: a run repeats its tokens exactly in fp32 or with --adaptive-size off")
    parser.add_argument("--static-cache", choices=STATIC_CACHE, default="auto",
                        help="the target's KV cache: static (one verify shape, a CUDA graph on a GPU) or dynamic; "
                             "auto = static on CUDA only")
    parser.add_argument("--online-calibration", action="store_true",
                        help=argparse.SUPPRESS if learns else ONLINE_CALIBRATION_HELP)
    parser.add_argument("--calibration", type=path_argument, default=None, metavar="FILE",
                        help=argparse.SUPPRESS if learns else CALIBRATION_HELP)
    parser.add_argument("--adaptive-size", choices=ADAPTIVE_SIZE, default="off",
                        help="per round, verify only the leading nodes of the budget's ddtree tree that pay for their "
                             "rows, under this machine's verify cost measured at start (docs/benchmarks.md, Which budget); auto = "
                             "on with the dynamic cache (a CPU), off with the static one (generate: auto; calibrate: "
                             "auto too, so that it learns on the trees generate decodes; bench: off, so that budgets "
                             "compare as published)")
    parser.add_argument("--lookup", type=_non_negative, default=None, metavar="N",
                        help="graft into every ddtree tree up to N tokens that followed the last recurrence of the "
                             "context's latest tokens, within the budget (docs/decoding.md, Context lookup); 0 = off; "
                             "default: the drafter's own (7 for the smollm2-135m recipe's drafter, else 0)")
    parser.add_argument("--corpus", type=path_argument, default=None, metavar="FILE",
                        help="graft into every ddtree tree what the target's replies in this JSONL file of "
                             "conversations (the drafter's training data, say), or in a corpus.safetensors a drafter "
                             "folder ships, mostly said after the context's "
                             "last 3 tokens, within the budget (docs/decoding.md, Corpus lookup); none = off; default: the "
                             "corpus the drafter folder ships (the smollm2-135m recipe's drafters do), else off")
    parser.add_argument("--redraft", type=_non_negative, default=None, metavar="K",
                        help="re-draft the block behind each of the K most likely first tokens (the chain: its first) "
                             "in one more drafter forward, and grow the tree from those (docs/decoding.md, Re-drafting); 0 = off; "
                             "default: the drafter's own (4 if trained with model.redraft_prob, else 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="ddtree", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt")
    _add_common(gen)
    gen.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    gen.add_argument("--raw", action="store_true", help="use the prompt as raw text, without the chat template")
    gen.add_argument("--no-stream", action="store_true",
                     help="print the reply once it is whole, not as each round commits its tokens")
    gen.add_argument("--method", choices=METHODS, default="ddtree")
    gen.add_argument("--budget", type=int, default=32, help="tree node budget for ddtree (published: 32; on a CPU, "
                     "where each node adds to the verify's cost, --adaptive-size verifies fewer: docs/benchmarks.md, Which budget)")
    gen.set_defaults(adaptive_size="auto")

    bench = commands.add_parser("bench", help="run methods over a prompts file and summarise")
    _add_common(bench)
    bench.add_argument("--prompts", type=path_argument, required=True, help="JSONL of {prompt} or {messages} objects")
    bench.add_argument("--methods", default="ar,dflash,ddtree",
                       help=f"comma-separated, from {', '.join(METHODS)} (default: all three; dflash is the chain)")
    bench.add_argument("--budgets", type=_int_list, default=[16, 32, 64],
                       help="comma-separated ddtree node budgets, one row each (default: 16,32,64)")
    bench.add_argument("--limit", type=int, default=None, help="use the first N prompts (default: all)")
    bench.add_argument("--out", type=path_argument, default=None, help="write results JSON here")
    bench.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    calibrate = commands.add_parser(
        "calibrate", help=f"learn the drafter's calibration on a prompts file and write it into its folder ({CALIBRATION_FILE})")
    _add_common(calibrate, learns=True)
    calibrate.add_argument("--prompts", type=path_argument, required=True,
                           help="JSONL of {prompt} or {messages} objects: prompts like the ones it will serve")
    calibrate.add_argument("--budgets", type=_int_list, default=[32], help="the ddtree budgets to calibrate (the chain "
                           "always is; another budget takes the nearest one's temperature; default: 32)")
    calibrate.add_argument("--limit", type=int, default=None, help="use the first N prompts (default: all)")
    calibrate.add_argument("--overwrite", action="store_true", help=f"replace the folder's {CALIBRATION_FILE}")
    # generate's sizing, and so its re-drafting (off where it sizes, unless given): else a default generate decoded
    # other trees than the file was learned on, and said so every time
    calibrate.set_defaults(max_new_tokens=64, adaptive_size="auto")

    cost = commands.add_parser("verify-cost", help="time tree verification vs one AR step (a benchmark)")
    cost.add_argument("--target", type=path_argument, default="smollm2-135m",
                      help="as for generate (default: smollm2-135m)")
    cost.add_argument("--dtype", type=_dtype, default=AUTO, help=DTYPE_HELP)
    cost.add_argument("--device", default=None, help=DEVICE_HELP)
    _add_packed_weights(cost)
    cost.add_argument("--compare-plain", action="store_true",
                      help="time each size with the plain and the packed linear layers alternately (a benchmark of "
                           "--packed-weights, so not given with it; a CPU in fp32)")
    cost.add_argument("--sizes", type=_int_list, default=[16, 32, 64, 128])
    cost.add_argument("--context", type=int, default=300, help="tokens already in the KV cache")
    cost.add_argument("--repeats", type=int, default=7)
    return parser


def default_device(args: argparse.Namespace) -> argparse.Namespace:
    """--device left out: cuda where this machine has a GPU, else cpu (asked once torch is loaded)."""
    if getattr(args, "device", "") is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args
