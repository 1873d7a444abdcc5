"""Prompt sets: the embedded default, local files and hub datasets, all through `datasets`."""

from specpolicy.data.prompts import (
    TRAINED_ON,
    Conversation,
    PromptSource,
    digests_text,
    encode_prompts,
    fitting,
    trained_on,
    without,
)

__all__ = ["TRAINED_ON", "Conversation", "PromptSource", "digests_text", "encode_prompts", "fitting",
           "trained_on", "without"]
