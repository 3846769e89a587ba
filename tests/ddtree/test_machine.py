"""The machine a figure was measured on (ddtree/machine.py), as results files record it and tables print it."""

import torch

from ddtree.machine import cpu_model_and_flags, describe_machine, machine_line

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_the_cpu_model_and_its_bf16_features_are_read_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_model_and_flags(str(path)) == ("Intel(R) Xeon(R) Platinum 8480+", ["amx_bf16", "avx512_bf16"])
    path.write_text(CPUINFO.replace(" avx512_bf16 amx_bf16 amx_tile", ""))  # an AVX-512 chip without bf16
    assert cpu_model_and_flags(str(path)) == ("Intel(R) Xeon(R) Platinum 8480+", [])


def test_without_cpuinfo_the_platform_names_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.processor", lambda: "arm")
    assert cpu_model_and_flags(str(tmp_path / "absent")) == ("arm", [])


def test_the_line_names_cpu_features_threads_and_torch():
    record = describe_machine(torch.device("cpu"))
    record.update(cpu="EPYC 7B13", cpu_flags=[], cpu_capability="AVX2", threads=2, torch="2.13.0+cpu")
    assert machine_line(record) == "EPYC 7B13 (AVX2), 2 threads, torch 2.13.0+cpu"
    record.update(gpu="NVIDIA H100 80GB HBM3", cuda="12.8")
    assert machine_line(record) == "NVIDIA H100 80GB HBM3 (CUDA 12.8), host EPYC 7B13 (AVX2), torch 2.13.0+cpu"


def test_one_thread_is_one_thread():
    """Under OMP_NUM_THREADS=1 every bench and verify-cost table opened with "..., 1 threads, torch ..."."""
    record = describe_machine(torch.device("cpu"))
    record.update(cpu="EPYC 7B13", cpu_flags=[], cpu_capability="AVX2", threads=1, torch="2.13.0+cpu")
    assert machine_line(record) == "EPYC 7B13 (AVX2), 1 thread, torch 2.13.0+cpu"


def test_the_line_names_the_bf16_features_that_decide_the_precision():
    """Two machines that differ only in AMX time bf16 several times apart: a line without the flags hides why."""
    record = describe_machine(torch.device("cpu"))
    record.update(cpu="Xeon 8480+", cpu_flags=["amx_bf16", "avx512_bf16"], cpu_capability="AVX512", threads=2,
                  torch="2.13.0+cpu")
    assert machine_line(record) == "Xeon 8480+ (AVX512, amx_bf16, avx512_bf16), 2 threads, torch 2.13.0+cpu"


def test_the_threads_are_the_ones_torch_computes_on():
    """torch's intra-op threads, what a figure was timed with (OMP_NUM_THREADS, training.throughput's --threads): not
    its inter-op pool, another count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert describe_machine(torch.device("cpu"))["threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_a_gpu_record_names_the_gpu_it_was_measured_on(monkeypatch):
    """On a machine of several GPUs the figures of `--device cuda:1` were measured there, not on the current device.
    CUDA is mocked: device 0, the current one, is a T4, device 1 an H100."""
    names = {0: "Tesla T4", 1: "NVIDIA H100 80GB HBM3"}
    index = lambda device: torch.device(device or "cuda").index or 0  # noqa: E731 - "cuda" alone is the current device
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[index(device)])
    assert describe_machine(torch.device("cuda", 1))["gpu"] == "NVIDIA H100 80GB HBM3"
