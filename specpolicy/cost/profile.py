"""Latency profile: how long one forward of the target and of the draft takes for a given number of
rows in flight and tokens per row, measured on this device and dtype.

This curve is why the right depth depends on load: while the hardware is memory-bound, extra tokens
per row are nearly free; once it is compute-bound they cost in proportion. It has steps where kernels
change, so the cost model interpolates between measured points instead of fitting a line.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specpolicy.decode.cache import RaggedCache, forward
from specpolicy.errors import SpecPolicyError
from specpolicy.runtime import resolve_device, synchronize


@dataclass
class LatencyProfile:
    device: str
    dtype: str
    context: int  # tokens already in each row's cache while timing
    rows: list[int]
    tokens: list[int]
    target_ms: list[list[float]]  # [len(rows)][len(tokens)]
    draft_ms: list[list[float]]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        path = Path(path)
        if not path.is_file():
            raise SpecPolicyError(f"no latency profile at {path}; run the profile stage first "
                                  f"(python scripts/train.py experiment=... stages=[profile])")
        return cls(**json.loads(path.read_text()))


def profile_file(directory: str | Path, device: str, dtype: str) -> Path:
    """Where the profile for this device and dtype lives: `<directory>/<device>-<dtype>.json`."""
    return Path(directory) / f"{device_name(resolve_device(device))}-{dtype}.json"


def device_name(device: torch.device) -> str:
    """A file-name-safe name for the hardware: the GPU's model, or `cpu`."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


@torch.inference_mode()
def time_forward(model: PreTrainedModel, rows: int, tokens: list[int], context: int, repeats: int) -> list[float]:
    """Milliseconds of one forward of `t` new tokens per row over a `context`-token cache, per t: the
    fastest of `repeats` timed runs after a warm-up, since interference only ever adds time."""
    device, vocab = model.device, model.config.vocab_size
    cache = RaggedCache(rows, context + max(tokens))
    prefix = torch.randint(0, vocab, (rows, context), device=device)
    zeros = torch.zeros(rows, dtype=torch.long, device=device)
    forward(model, cache, prefix, zeros, context, zeros[:, None], context)
    starts = torch.full_like(zeros, context)
    out = []
    for t in tokens:
        chunk = torch.randint(0, vocab, (rows, t), device=device)
        keep = torch.arange(t, device=device).expand(rows, t)  # verification needs logits at every token
        times = []
        for r in range(repeats + 1):  # one warm-up
            synchronize(device)
            t0 = time.perf_counter()
            forward(model, cache, chunk, starts, context + t, keep, context + t)
            synchronize(device)
            if r:
                times.append(time.perf_counter() - t0)
        out.append(1e3 * min(times))
    return out


def measure(target: PreTrainedModel, draft: PreTrainedModel, rows: list[int], tokens: list[int], context: int,
            repeats: int, dtype: str) -> LatencyProfile:
    grids = {"target": [], "draft": []}
    for r in tqdm(rows, desc="profile (rows)"):
        for name, model in (("target", target), ("draft", draft)):
            grids[name].append(time_forward(model, r, tokens, context, repeats))
    return LatencyProfile(device_name(target.device), dtype, context, list(rows), list(tokens),
                          grids["target"], grids["draft"])
