"""The batched speculative decode engine."""

from specpolicy.decode.engine import DecodeResult, Engine
from specpolicy.decode.stats import DecodeStats

__all__ = ["DecodeResult", "DecodeStats", "Engine"]
