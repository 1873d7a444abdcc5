"""Prompt sets: the embedded default, local files and hub datasets, all through `datasets`."""

from specpolicy.data.prompts import PromptSource, encode_prompts, without

__all__ = ["PromptSource", "encode_prompts", "without"]
