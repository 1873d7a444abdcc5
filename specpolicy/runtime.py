"""Device and dtype resolution shared by every stage, with errors that name valid values, the names
profiles and reports give the hardware, and how busy the rest of the machine was while they timed it."""

from __future__ import annotations

import os
import platform
import re
import time
from typing import Any

import psutil
import torch

from specpolicy.errors import SpecPolicyError, check_bool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise SpecPolicyError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)} (e.g. runtime.dtype=float32)")
    return DTYPES[name]


def check_runtime(runtime: Any) -> None:
    """`runtime.*`, checked before a pipeline's first stage: a dtype typo stopped the profile stage, after a
    distillation it had not been used in."""
    resolve_dtype(runtime.dtype)
    resolve_device(runtime.device)
    check_bool("runtime.skinny_gemm", runtime.skinny_gemm)


def resolve_device(name: str | torch.device) -> torch.device:
    """`auto` means the GPU when there is one; anything else must be a device torch knows."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:  # TypeError: null, a number or a list
        raise SpecPolicyError(f"unknown device {name!r}; use auto, cpu or cuda[:N] (runtime.device=...)") from err
    if device.type not in ("cpu", "cuda"):  # timings synchronise, and profiles are named, for these two only
        raise SpecPolicyError(f"device {name!r} is not supported: specpolicy runs on cpu or cuda[:N]; use "
                              f"runtime.device=cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecPolicyError(f"device {name!r} asked for but no CUDA GPU is visible; use runtime.device=cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SpecPolicyError(f"device {name!r} asked for but only {torch.cuda.device_count()} CUDA GPU(s) are "
                              f"visible; use runtime.device=cuda:0")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings measure work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """A file-name-safe name for the hardware a profile holds for: the GPU's model, or for a CPU the vector
    instructions torch dispatches to, plus `bf16` where the CPU has bf16 dot products (AVX512-BF16 or AMX).
    VMs that all call themselves `AMD EPYC` came with AVX2 on one day and AVX-512 BF16 on another, and
    their curves differ most in bf16, so a profile of one must not price the other."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        name = f"cpu-{torch.backends.cpu.get_cpu_capability()}{'-bf16' if bf16 else ''}"
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def hardware(device: torch.device) -> str:
    """What a report says it was measured on: the GPU's model, or the CPU's architecture, ISA and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} {device_name(device)}, {os.cpu_count()} CPU cores, torch {torch.__version__}"


class OtherLoad:
    """Measures, as a context manager, the CPU that everything but this process took while the block ran, in
    cores: other processes, and on a VM the hypervisor's steal time. A timing describes the hardware only if
    nothing else ran, and a profile timed on a busy machine is slow in every cell alike, which no consistency
    check of its own (`LatencyProfile.outliers`) can see. On a 2-core VM a busy-looping process took 0.79 cores
    from a 2-thread matmul loop, which then got 1.17 cores instead of 1.98; an idle machine read 0.01."""

    busy_share = 0.1  # of the machine's cores: above it, timings are flagged as a busy machine's

    def __enter__(self) -> OtherLoad:
        self.cores, self._start = 0.0, self._clocks()
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, own = (end - start for start, end in zip(self._start, self._clocks()))
        self.cores = max(busy - own, 0.0) / wall  # the system counts in ticks, a process exactly: never below 0

    @property
    def busy(self) -> bool:
        return self.too_busy(self.cores)

    @classmethod
    def too_busy(cls, cores: float) -> bool:
        """Whether `cores` taken by others, measured on this machine, make its timings a busy machine's."""
        return cores > cls.busy_share * os.cpu_count()

    def __str__(self) -> str:
        return f"{self.cores:.2f} of {os.cpu_count()} CPU cores"

    @staticmethod
    def _clocks() -> tuple[float, float, float]:
        """Wall seconds, CPU seconds the whole machine was busy (guest time is inside user time already),
        and CPU seconds of this process's threads."""
        machine, own = psutil.cpu_times()._asdict(), psutil.Process().cpu_times()
        busy = sum(v for k, v in machine.items() if k not in ("idle", "iowait", "guest", "guest_nice"))
        return time.perf_counter(), busy, own.user + own.system
