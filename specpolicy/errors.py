"""One exception type for bad input, so entry points can print one line instead of a traceback."""


class SpecPolicyError(Exception):
    """A problem with the user's input or configuration; the message names the problem and the fix."""
