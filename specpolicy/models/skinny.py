"""Linear layers that run a product of a few rows as one tall GEMM on a CPU in float32.

Decoding multiplies every weight by 1-16 rows, one per token in flight. Through `F.linear`, MKL runs
such skinny float32 products at a fraction of memory bandwidth: on a 2-core AMD EPYC (torch 2.13,
MKL 2024.2) a SmolLM2-135M forward of 1, 2, 3 and 5 tokens took 43, 72, 90 and 62 ms, so verifying a
draft token cost as much as generating one. The same product written as `weight @ x.T` (the rows become
the columns of a tall GEMM, which streams the weight once) took 25, 26, 33 and 43 ms: plain decoding runs
~1.7x faster and a 2-token verify costs about what 1 token does, as on a GPU. A single row is stacked
twice, because a one-column product falls back to the slow matrix-vector path (stacked by `torch.cat`:
`Tensor.repeat` took 6 us against 1 us, ~1 ms of the 211 products in a one-token forward). Other dtypes, devices and
products of more than `MAX_ROWS` rows keep `F.linear`: this CPU's bfloat16 kernels were already flat
(29-32 ms for 1-16 tokens) and slower through this path. `scripts/bench_skinny.py` measures both ways
(`runtime.skinny_gemm=false` switches it off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 16


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether models on `device` in `dtype` get skinny layers (`use_skinny_gemm`): float32 on a CPU only."""
    return device.type == "cpu" and dtype == torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as a tall GEMM when `x` holds few float32 rows on a CPU."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or not applies(x.device, x.dtype):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(weight, torch.cat([flat, flat]).T if rows == 1 else flat.T).T[:rows]
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters, state dict and peft handling) whose forward is `skinny.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_skinny_gemm(model: torch.nn.Module) -> torch.nn.Module:
    """Make every plain `nn.Linear` in a float32 CPU `model` a `SkinnyLinear`, in place (it keeps its
    weights). Other models are left as they are: there it would only add a Python call per layer."""
    param = next(model.parameters())
    if not applies(param.device, param.dtype):
        return model
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
    return model
