"""One exception type for bad input, so entry points can print one line instead of a traceback."""


class SpecPolicyError(Exception):
    """A problem with the user's input or configuration; the message names the problem and the fix."""


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_count(setting: str, value) -> int:
    """`value` (a depth, a number of prompts or rounds) as an integer >= 1, or a SpecPolicyError naming `setting`."""
    if not _is_count(value):
        raise SpecPolicyError(f"{setting} must be an integer >= 1, got {value}")
    return value


def check_depth(policy: str, k) -> int:
    """A policy's maximum draft depth `k` as an integer >= 0 (0: no speculation), or a SpecPolicyError."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise SpecPolicyError(f"{policy} depth must be an integer >= 0, got {k!r}")
    return k


def check_counts(setting: str, values, increasing: bool = False) -> list[int]:
    """`values` (batch sizes, grid points) as a list of integers >= 1, strictly increasing if `increasing` (a
    grid the cost model interpolates on); otherwise a SpecPolicyError that names `setting`."""
    values = list(values)
    ok = bool(values) and all(map(_is_count, values))
    if ok and increasing:
        ok = all(a < b for a, b in zip(values, values[1:]))
    if not ok:
        order = " in increasing order" if increasing else ""
        raise SpecPolicyError(f"{setting} must be a non-empty list of integers >= 1{order}, got {values}")
    return values
