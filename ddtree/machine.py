"""What a measurement ran on: the record `ddtree bench` writes beside its figures, and the line its tools print.

    record = describe_machine(torch.device("cpu"))   # {"cpu": "Intel(R) Xeon(R) ...", "threads": 2, ...}
    machine_line(record)                             # "Intel(R) Xeon(R) Processor (AVX512, avx512_bf16), 2 threads, torch 2.13.0+cpu"

A decoding figure depends on the chip as much as on the code: on a CPU, whether bf16 is fast (AMX, AVX512-BF16, or
neither: 6.7x slower on an AVX2-only EPYC), how many threads torch uses, and the torch build. A results file without
them cannot be compared with another machine's, so it carries them.
"""

from __future__ import annotations

import platform
import time

import torch

# The CPU features that decide which precision is fast here (ddtree/precision.py), as /proc/cpuinfo names them.
PRECISION_FLAGS = ("amx_bf16", "avx512_bf16")  # the vector width beside them is torch's cpu_capability


def cpu_model_and_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """The CPU's model name and which of PRECISION_FLAGS it has; where /proc/cpuinfo cannot be read (macOS, Windows),
    the platform's processor name and no flags."""
    try:
        with open(cpuinfo) as file:
            text = file.read()
    except OSError:
        return platform.processor() or "unknown CPU", []
    fields = {}
    for line in text.splitlines():  # the first processor's block names them all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return fields.get("model name") or platform.processor() or "unknown CPU", [f for f in PRECISION_FLAGS if f in flags]


def describe_machine(device: torch.device) -> dict:
    """The facts a figure measured on `device` depends on: CPU (model, features, torch's threads), GPU where one ran,
    the versions of torch and transformers, and the UTC time."""
    import transformers

    model, flags = cpu_model_and_flags()
    record = {
        "cpu": model,
        "cpu_flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels torch picked: AVX2, AVX512, ...
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
        record["cuda"] = torch.version.cuda
    return record


def machine_line(record: dict) -> str:
    """The record in one line, for a printed table's header."""
    cpu = f"{record['cpu']} ({', '.join([record['cpu_capability'], *record['cpu_flags']])})"
    threads = f"{record['threads']} thread{'' if record['threads'] == 1 else 's'}"  # (OMP_NUM_THREADS=1: "1 threads")
    where = f"{record['gpu']} (CUDA {record['cuda']}), host {cpu}" if "gpu" in record else f"{cpu}, {threads}"
    return f"{where}, torch {record['torch']}"
