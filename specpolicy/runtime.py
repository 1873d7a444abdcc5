"""Device and dtype resolution shared by every stage, with errors that name valid values."""

from __future__ import annotations

from typing import Any

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
    except RuntimeError as err:
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
