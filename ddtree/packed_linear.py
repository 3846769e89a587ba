"""Linear layers through oneDNN with their weights packed once: faster decoding forwards on a CPU in fp32.

A decoding forward multiplies a handful of rows (1 for `ar`, up to budget + 1 for a tree) by every weight of the
model. torch's fp32 `F.linear` on the CPU calls MKL's sgemm; on a 2-core AMD EPYC with AVX2 a SmolLM2-135M verify of
2 to 33 rows through it cost 1.6-2.5x a one-token step. oneDNN's matmul over weights laid out once for it
(`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`) made those verifies 1.3-1.6x faster and tree
decoding 1.3-1.4x faster there (docs/benchmarks.md, Packed weights). Where it pays differs by machine and model (a
tiny test model's layers ran 2x slower packed), so `auto` measures before it packs.

`pack_linears(model)` gives each plain `nn.Linear` of a frozen fp32 CPU model a packed copy and a forward that
uses it; the module keeps its `weight` (ties, state dicts and `get_output_embeddings().weight` are untouched).
The packed forward is for inference: with autograd recording, on another device or dtype it runs the plain
`F.linear`, and a weight changed in place is packed again (a change through the parameter: one through `.data`
bypasses torch's version counter, unseen here as by autograd; `torch.no_grad()` and the parameter itself are the
way to change a packed model's weights). Results equal `F.linear`'s to fp32 rounding (1e-6), as
one BLAS's do another's; decoding stays lossless against greedy decoding of the same packed model (tests).
"""

from __future__ import annotations

import os
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .errors import DDTreeError
from .names import PACKED_KERNELS

PACK_ROWS = 16  # the rows oneDNN lays the weights out for; 4 to 32 measured alike on the EPYC, 1 slower above 1 row
PROBE_ROWS = (1, 8)  # an AR step's rows and a small tree's, the shapes decoding runs on a CPU
PROBE_REPEATS = 3
GAIN_NEEDED = 0.9  # auto packs where the packed layers take under this share of the plain ones' time


def packing_available() -> bool:
    """Whether this torch can pack weights for oneDNN's matmul (a CPU build with oneDNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear and weight is not None and weight.device.type == "cpu"
        and weight.dtype == torch.float32 and not weight.requires_grad
    )


def linear_bytes(model: nn.Module) -> int:
    """The bytes a packed copy of the model's packable linear weights would take (once per weight, ties counted once)."""
    seen = {id(m.weight): m.weight for m in model.modules() if _packable(m)}
    return sum(w.numel() * w.element_size() for w in seen.values())


def available_memory_bytes() -> int | None:
    """Memory this machine can still give (MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _pack(module: nn.Linear) -> None:
    module._ddtree_packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS)
    # The weight it was packed from, by storage and in-place version: a weight whose storage was swapped
    # (`.data = ...`, a dtype round trip) keeps its version count, so the version alone would miss it. Holding the
    # old storage keeps its address from being reused by a new one.
    module._ddtree_source = module.weight.detach()
    module._ddtree_version = module.weight._version


def _is_stale(module: nn.Linear) -> bool:
    """Whether the weight changed, in place or by a swapped storage, since it was packed."""
    weight, source = module.weight, module._ddtree_source
    return weight._version != module._ddtree_version or weight.data_ptr() != source.data_ptr() or weight.shape != source.shape


def _packed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if (
        x.device.type != "cpu" or x.dtype != torch.float32 or weight.device.type != "cpu"
        or weight.dtype != torch.float32 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, module.bias)
    if _is_stale(module):
        _pack(module)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), module._ddtree_packed, module.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Give every packable linear layer of `model` a packed copy of its weight and the packed forward; the count."""
    count = 0
    for module in model.modules():
        if _packable(module) and not hasattr(module, "_ddtree_packed"):
            _pack(module)
            module.forward = partial(_packed_forward, module)
            count += 1
    return count


def is_packed(model: nn.Module) -> bool:
    """Whether pack_linears packed any layer of `model`."""
    return any(hasattr(module, "_ddtree_packed") for module in model.modules())


def unpack_linears(model: nn.Module) -> int:
    """Undo pack_linears: the plain forward, the packed copies freed; the count."""
    count = 0
    for module in model.modules():
        if hasattr(module, "_ddtree_packed"):
            del module._ddtree_packed, module._ddtree_source, module._ddtree_version, module.forward
            count += 1
    return count


@torch.no_grad()
def measure_packing(model: nn.Module) -> tuple[float, float]:
    """Milliseconds of every packed layer of `model` over PROBE_ROWS rows of random input: (plain, packed), each the
    best of PROBE_REPEATS, the two measured alternately."""
    layers = [m for m in model.modules() if hasattr(m, "_ddtree_packed")]
    inputs = [[torch.randn(rows, m.in_features) for m in layers] for rows in PROBE_ROWS]
    best = {"plain": float("inf"), "packed": float("inf")}
    for _ in range(PROBE_REPEATS):
        for name in best:
            start = time.perf_counter()
            for xs in inputs:
                for layer, x in zip(layers, xs):
                    layer(x) if name == "packed" else F.linear(x, layer.weight, layer.bias)
            best[name] = min(best[name], 1000 * (time.perf_counter() - start))
    return best["plain"], best["packed"]


def cannot_pack(model: nn.Module) -> str | None:
    """Why pack_linears would pack nothing in `model`, or None where it can pack."""
    if not packing_available():
        return "this torch has no oneDNN weight packing"
    if linear_bytes(model) == 0:
        return "the model has no fp32 CPU linear layers (packing is for fp32 on a CPU)"
    return None


def require_packing(model: nn.Module, option: str = "--packed-weights") -> None:
    """One error line where `model` cannot be packed (--packed-weights on, verify-cost --compare-plain)."""
    reason = cannot_pack(model)
    if reason:
        raise DDTreeError(f"{option} on: {reason}; use {option} off (or auto)")


def packs_as(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model that will run in `dtype` on `device` is one packing is for: fp32 on a CPU."""
    return dtype == torch.float32 and torch.device(device).type == "cpu"


def check_packing_choice(choice: str, dtype: torch.dtype, device: torch.device | str,
                         option: str = "--packed-weights", float32: str = "--dtype float32") -> None:
    """`on` for a model that will run in bf16 or fp16, or on a GPU: one line before it loads (require_packing said it
    only once the model had loaded: seconds, minutes for a large target). `float32`: how the caller's user asks for
    fp32, which on a CPU is the way to get the packing asked for."""
    device = torch.device(device)
    if choice == "on" and not packs_as(dtype, device):
        # on a CPU the dtype alone stands in the way, often one `auto` chose (bf16 on an AMX Xeon): the line only
        # said to give packing up
        keep = f"give {float32} to pack, or " if device.type == "cpu" else ""
        raise DDTreeError(f"{option} on: packing is for fp32 on a CPU, and the target would run in "
                          f"{str(dtype).removeprefix('torch.')} on {device}; {keep}use {option} off (or auto)")


def apply_packing(choice: str, model: nn.Module, option: str = "--packed-weights") -> tuple[bool, str]:
    """--packed-weights auto|on|off applied to `model`: whether it ended packed, and a line saying why (the CLI prints it).
    option: the setting's name as the caller's user gives it (training's evaluation: eval.packed_weights).

    auto packs a CPU fp32 model where oneDNN can, where the packed copy takes under a quarter of the memory this
    machine has available, and where its linear layers then measure faster packed (measure_packing, on the model's own
    layers: about a second for SmolLM2-135M; unpacked again where they do not); on insists (an error where it cannot),
    off never packs.
    """
    if choice not in PACKED_KERNELS:
        raise DDTreeError(f"{option} {choice!r}: choose one of {', '.join(PACKED_KERNELS)}")
    if choice == "off":
        return False, ""
    if choice == "on":
        require_packing(model, option)
    reason = cannot_pack(model)
    if reason:
        return False, f"[packed weights] off: {reason}"
    size, available = linear_bytes(model), available_memory_bytes()
    if choice == "auto" and available is not None and size > available / 4:
        return False, (f"[packed weights] off: a packed copy takes {size / 2**20:.0f} MiB, over a quarter of the "
                       f"{available / 2**20:.0f} MiB available; {option} on packs anyway")
    pack_linears(model)
    size_text = f"{size / 2**20:.0f} MiB more"
    if choice == "on":
        return True, f"[packed weights] on: linear layers through oneDNN, weights packed once ({size_text})"
    plain, fast = measure_packing(model)
    measured = f"its linear layers over {' and '.join(map(str, PROBE_ROWS))} rows took {fast:.1f} ms packed, {plain:.1f} plain"
    # the threshold said either way: packed a little faster and left off read as a wrong decision
    share = f"{fast / plain:.2f}x of plain; auto packs below {GAIN_NEEDED}x"
    if fast >= GAIN_NEEDED * plain:
        unpack_linears(model)
        return False, f"[packed weights] off: {measured} ({share}); {option} on packs anyway"
    return True, f"[packed weights] on: {measured} ({share}; {size_text})"
