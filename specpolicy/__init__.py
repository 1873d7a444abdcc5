"""specpolicy: learned, load-aware speculation policies for speculative decoding."""

from specpolicy.errors import SpecPolicyError

__all__ = ["SpecPolicyError"]
