"""Latency profile: how long one forward of the target and of the draft takes for a given number of
rows in flight and tokens per row, measured on this device and dtype.

This curve is why the right depth depends on load: while the hardware is memory-bound, extra tokens
per row are nearly free; once it is compute-bound they cost in proportion. It has steps where kernels
change, so the cost model interpolates between measured points instead of fitting a line.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specpolicy.atomic import atomic_path
from specpolicy.decode.cache import RaggedCache, forward
from specpolicy.errors import SpecPolicyError, check_bool, check_counts, is_number
from specpolicy.models import skinny
from specpolicy.models.fusion import timing_features
from specpolicy.runtime import device_name, resolve_device, resolve_dtype, synchronize


@dataclass
class LatencyProfile:
    device: str
    dtype: str
    context: int  # tokens already in each row's cache while timing
    rows: list[int]
    tokens: list[int]
    target_ms: list[list[float]]  # [len(rows)][len(tokens)], every token scored by the LM head (a verify pass)
    draft_ms: list[list[float]]  # the last token scored (a draft forward; since 2026-12-06, every one before)
    # [len(rows)] what a decode step that drafts costs beyond the forwards above, signed (cost.overhead); none: 0
    draft_step_overhead_ms: list[float] | None = None
    other_load_cores: float | None = None  # CPU others took while it was timed (runtime.OtherLoad); none: unknown

    def save(self, path: str | Path) -> None:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path, settings: str = "") -> LatencyProfile:
        """`settings`: the overrides the profile stage needs to write this file (e.g. `runtime.dtype=bfloat16`)."""
        path = Path(path)
        if not path.is_file():
            others = sorted(p.name for p in path.parent.glob("*.json") if not p.name.endswith(".settings.json")
                            ) if path.parent.is_dir() else []
            found = f" (this folder holds {others}: other hardware, dtypes or kernel paths)" if others else ""
            command = " ".join(["python scripts/train.py experiment=... 'stages=[profile]'", settings]).strip()
            raise SpecPolicyError(f"no latency profile at {path}{found}; run the profile stage on this machine "
                                  f"({command})")
        damaged = f"latency profile {path} is damaged; delete it and run the profile stage again (stages=[profile])"
        try:
            profile = cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as err:  # not JSON, or not a profile's fields
            raise SpecPolicyError(f"{damaged}: {err}") from err
        if problem := profile.problem():
            raise SpecPolicyError(f"{damaged}: {problem}")
        return profile

    def problem(self) -> str | None:
        """What makes a profile (edited by hand, say) unusable by the cost model, or None. A grid listed in
        another order was interpolated as if sorted (numpy's `interp` assumes it), so its costs were silently
        wrong; a zero latency divided by zero mid-decoding; a string one failed inside numpy."""
        try:
            check_grid(self.rows, self.tokens, "its ")
        except SpecPolicyError as err:
            return str(err)
        shape = f"{len(self.rows)} x {len(self.tokens)}"
        for name, ms in (("target_ms", self.target_ms), ("draft_ms", self.draft_ms)):
            if not (isinstance(ms, list) and len(ms) == len(self.rows)
                    and all(isinstance(row, list) and len(row) == len(self.tokens) for row in ms)):
                return f"its {name} do not fill its {shape} grid"
            if not all(is_number(v) and v > 0 for row in ms for v in row):
                return f"its {name} are not all numbers > 0"
        if self.other_load_cores is not None and not (is_number(self.other_load_cores) and self.other_load_cores >= 0):
            return "its other_load_cores is not a number >= 0"
        overhead = self.draft_step_overhead_ms
        if overhead is None:
            return None
        if not (isinstance(overhead, list) and len(overhead) == len(self.rows) and all(map(is_number, overhead))):
            return f"its draft_step_overhead_ms are not one number per row count ({len(self.rows)})"
        if any(ms + row[0] < 0 for ms, row in zip(overhead, self.draft_ms)):  # `cost.overhead` stops there
            return "its draft_step_overhead_ms make a draft position cost less than nothing"
        return None

    def outliers(self, factor: float = 1.5) -> list[str]:
        """Timings a busy machine would explain: a forward `factor` times slower than one of at least as many rows
        and tokens, or a drafting correction above the target's whole forward at its rows. Kernel changes make
        steps in the curve, not inversions this large; the cost model would price every decision from them."""
        found = []
        for name, ms in (("target", self.target_ms), ("draft", self.draft_ms)):
            for i, j in itertools.product(range(len(self.rows)), range(len(self.tokens))):
                larger = min(ms[a][b] for a in range(i, len(self.rows)) for b in range(j, len(self.tokens)))
                if ms[i][j] > factor * larger:
                    found.append(f"the {name}'s forward of {self.rows[i]} rows x {self.tokens[j]} tokens took "
                                 f"{ms[i][j]:.1f} ms, {ms[i][j] / larger:.1f}x a larger one")
        for rows, extra, row in zip(self.rows, self.draft_step_overhead_ms or [], self.target_ms):
            if extra > row[0]:
                found.append(f"a drafting step at {rows} rows cost {extra:.1f} ms beyond its forwards, more than a "
                             f"target forward ({row[0]:.1f} ms)")
        return found


def check_grid(rows: object, tokens: object, prefix: str = "profile.") -> tuple[list[int], list[int]]:
    """A profile's grid (the profile settings, or a saved profile's fields: `prefix`), which must rise because the
    cost model interpolates on it, and must time plain decoding's 1-token pass, where the model clamps."""
    rows = check_counts(f"{prefix}rows", rows, increasing=True)
    tokens = check_counts(f"{prefix}tokens", tokens, increasing=True)
    if tokens[0] != 1:
        raise SpecPolicyError(f"{prefix}tokens must start at 1 (plain decoding's pass), got {tokens}")
    return rows, tokens


def profile_file(directory: str | Path, device: str, dtype: str, skinny_gemm: bool = False) -> Path:
    """Where the profile for this device, dtype and kernel path lives: `<directory>/<device>-<dtype>.json` (a
    `directory` ending in .json is taken as the file itself, which a user may name: it was looked for inside),
    or `...-skinny.json` where `runtime.skinny_gemm` runs few-row float32 CPU products as tall GEMMs
    (`models.skinny`). Those are other kernels with another curve (a 2-token forward at batch 1: 25.4 ms
    against 63.6 ms through `nn.Linear`), so a profile of one path must never price the other."""
    device = resolve_device(device)
    check_bool("runtime.skinny_gemm", skinny_gemm)
    if Path(directory).suffix == ".json":
        return Path(directory)
    kernels = "-skinny" if skinny_gemm and skinny.applies(device, resolve_dtype(dtype)) else ""
    return Path(directory) / f"{device_name(device)}-{dtype}{kernels}.json"


class ForwardTimer:
    """Times one forward of `t` new tokens per row for `rows` rows over a `context`-token cache, through the
    engine's own `forward` (a fusing draft reads features too; call it in inference mode). The LM head scores
    every token (`score_all`: a verify pass) or only the last (a draft forward: its catch-up reads many tokens
    and proposes from the last)."""

    def __init__(self, model: PreTrainedModel, rows: int, context: int, max_tokens: int, score_all: bool = True):
        self.model, self.rows, self.context, self.score_all = model, rows, context, score_all
        device, vocab = model.device, model.config.vocab_size
        self.cache = RaggedCache(rows, context + max_tokens)
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        prompt = torch.randint(0, vocab, (rows, context), device=device)
        forward(model, self.cache, prompt, zeros, context, zeros[:, None], context,
                features=timing_features(model, prompt))
        self.starts = torch.full_like(zeros, context)

    def __call__(self, t: int) -> float:
        device = self.model.device
        chunk = torch.randint(0, self.model.config.vocab_size, (self.rows, t), device=device)
        keep = torch.arange(0 if self.score_all else t - 1, t, device=device).expand(self.rows, -1)
        features = timing_features(self.model, chunk)
        synchronize(device)
        t0 = time.perf_counter()
        forward(self.model, self.cache, chunk, self.starts, self.context + t, keep, self.context + t, features=features)
        synchronize(device)
        return 1e3 * (time.perf_counter() - t0)


@torch.inference_mode()
def measure(target: PreTrainedModel, draft: PreTrainedModel, rows: list[int], tokens: list[int], context: int,
            repeats: int, dtype: str) -> LatencyProfile:
    """The latency profile of a target and its draft on the (rows x tokens) grid."""
    grids = time_grid({"target": target, "draft": draft}, rows, tokens, context, repeats)
    return LatencyProfile(device_name(target.device), dtype, context, list(rows), list(tokens),
                          grids["target"], grids["draft"])


@torch.inference_mode()
def time_grid(models: dict[str, PreTrainedModel], rows: list[int], tokens: list[int], context: int,
              repeats: int, progress: str | None = "profile (rounds over the grid)") -> dict[str, list[list[float]]]:
    """Milliseconds per forward of each model on the (rows x tokens) grid: the fastest of `repeats` rounds,
    each round one pass over every model and the whole grid, so a slow spell of a shared machine spreads
    over many cells instead of spoiling one (interference only ever adds time). One round more than
    `repeats` runs, for warm-up: the first round is timed too, and its slower times lose the minimum.

    Each (model, rows) pass through the grid starts with an untimed forward of its first cell: right after
    the other model's widest cell, the first forward ran slower in every round (fp32 CPU: the draft's 1 x 1
    cell 6.1 ms against 3.5 ms for 1 x 2; once after a distillation in the same process, the target's 36.4
    against 24.3 ms). Decoding repeats similar shapes, and a 1 x 1 cell is what plain decoding at batch 1
    is priced at, so an inflated one made drafting look cheap there. `progress` labels the rounds' bar (None: none)."""
    timers = {(name, r): ForwardTimer(model, r, context, max(tokens), score_all=name != "draft")
              for name, model in models.items() for r in rows}
    best = {key: [float("inf")] * len(tokens) for key in timers}
    for _ in tqdm(range(repeats + 1), desc=progress, disable=progress is None):
        for key, timer in timers.items():
            timer(tokens[0])
            best[key] = [min(b, timer(t)) for b, t in zip(best[key], tokens)]
    return {name: [best[(name, r)] for r in rows] for name in models}
