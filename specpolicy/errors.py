"""One exception type for bad input, so entry points can print one line instead of a traceback."""

import logging
import math
from collections.abc import Mapping, Sequence

log = logging.getLogger("specpolicy")


class SpecPolicyError(Exception):
    """A problem with the user's input or configuration; the message names the problem and the fix."""


def _is_int(value: object, low: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def check_int(setting: str, value: object, low: int | None = None) -> int:
    """`value` as an integer (>= `low` when given), or a SpecPolicyError naming `setting`."""
    if not _is_int(value, low):
        raise SpecPolicyError(f"{setting} must be an integer{'' if low is None else f' >= {low}'}, got {value!r}")
    return value


def check_count(setting: str, value: object) -> int:
    """`value` (a number of prompts, steps or rounds) as an integer >= 1, or a SpecPolicyError naming `setting`."""
    return check_int(setting, value, 1)


def check_depth(policy: str, k: object) -> int:
    """A policy's maximum draft depth `k` as an integer >= 0 (0: no speculation), or a SpecPolicyError."""
    return check_int(f"{policy} depth", k, 0)


def check_counts(setting: str, values: object, increasing: bool = False) -> list[int]:
    """`values` (batch sizes, grid points) as a list of distinct integers >= 1, increasing if `increasing` (a
    grid the cost model interpolates on); otherwise a SpecPolicyError that names `setting`. A repeated batch size
    decoded twice and reported in two rows under one name."""
    if not isinstance(values, Sequence) or isinstance(values, str):  # `eval.batch_sizes=8`: list(8) was a TypeError
        raise SpecPolicyError(f"{setting} must be a list, e.g. {setting}=[{values}], got {values!r}")
    values = list(values)
    ok = bool(values) and all(_is_int(v, 1) for v in values) and len(set(values)) == len(values)
    if ok and increasing:
        ok = all(a < b for a, b in zip(values, values[1:]))
    if not ok:
        order = " in increasing order" if increasing else ""
        raise SpecPolicyError(f"{setting} must be a non-empty list of distinct integers >= 1{order}, got {values}")
    return values


def fitting_batch_sizes(setting: str, sizes: Sequence[int], prompts: int, fix: str) -> list[int]:
    """The batch sizes that `prompts` prompts can fill, with a warning naming those left out: a batch of 8 over 4
    prompts runs 4 rows, and its numbers would be reported as batch 8's. None left is an error."""
    fitting = [size for size in sizes if size <= prompts]
    too_big = [size for size in sizes if size > prompts]
    if not fitting:
        raise SpecPolicyError(f"{setting} {too_big} all exceed the {prompts} prompts to decode (a batch cannot "
                              f"have more rows than prompts); {fix}, or give a batch size <= {prompts}")
    if too_big:
        log.warning("%s %s exceed the %d prompts to decode and are left out (%s)", setting, too_big, prompts, fix)
    return fitting


def is_number(value: object) -> bool:
    """A finite real number (not a bool, which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(setting: str, value: object, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, why: str = "") -> float:
    """`value` as a finite real number in [low, high] (a bound excluded when `low_open`/`high_open`, none when
    None), or a SpecPolicyError naming `setting` and `why` the bound holds (`engine.temperature=abc` used to end
    in a TypeError traceback)."""
    ok = is_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            bounds = f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            bounds = f" {'>' if low_open else '>='} {low}"
        else:
            bounds = "" if high is None else f" {'<' if high_open else '<='} {high}"
        raise SpecPolicyError(f"{setting} must be a number{bounds}{f' ({why})' if why else ''}, got {value!r}")
    return value


# Lightning Trainer knobs it accepts when built and fails on only inside fit (`max_epochs="abc"` in an
# AssertionError, `num_sanity_val_steps="abc"` in a TypeError): the lowest value each takes, None allowed.
TRAINER_INTS = {"max_epochs": -1, "max_steps": -1, "min_epochs": 0, "min_steps": 0, "log_every_n_steps": 1,
                "check_val_every_n_epoch": 1, "num_sanity_val_steps": -1, "accumulate_grad_batches": 1}


def check_trainer(setting: str, trainer: Mapping[str, object]) -> None:
    """The integer knobs of a Trainer config (`setting`: where it lives, e.g. `head.trainer`) that are set. A limit
    of 0 epochs or steps trains nothing: `head.trainer.max_epochs=0` saved a random head as if trained."""
    for key, low in TRAINER_INTS.items():
        if trainer.get(key) is not None:
            check_int(f"{setting}.{key}", trainer[key], low)
    for key in ("max_epochs", "max_steps"):
        if trainer.get(key) == 0:
            raise SpecPolicyError(f"{setting}.{key}=0 trains nothing; set it to 1 or more (-1: no limit)")


def check_bool(setting: str, value: object) -> bool:
    """`value` as a bool: Hydra passes `no`, `off` or a typo through as a string, which Python reads as true."""
    if not isinstance(value, bool):
        raise SpecPolicyError(f"{setting} must be true or false, got {value!r}")
    return value
