"""One exception type for bad input, so entry points can print one line instead of a traceback."""


class SpecPolicyError(Exception):
    """A problem with the user's input or configuration; the message names the problem and the fix."""


def check_counts(setting: str, values, increasing: bool = False) -> list[int]:
    """`values` (batch sizes, grid points) as a list of integers >= 1, strictly increasing if `increasing` (a
    grid the cost model interpolates on); otherwise a SpecPolicyError that names `setting`."""
    values = list(values)
    ok = bool(values) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
    if ok and increasing:
        ok = all(a < b for a, b in zip(values, values[1:]))
    if not ok:
        order = " in increasing order" if increasing else ""
        raise SpecPolicyError(f"{setting} must be a non-empty list of integers >= 1{order}, got {values}")
    return values
