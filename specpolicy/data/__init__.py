"""Prompt sets: the embedded default, local files and hub datasets, all through `datasets`."""

from specpolicy.data.prompts import PromptSource, encode_fitting, encode_prompts, without

__all__ = ["PromptSource", "encode_fitting", "encode_prompts", "without"]
