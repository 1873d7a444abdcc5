"""A byte-level tokenizer built in memory, so tiny test models need no downloaded vocabulary."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# bos, eos, pad, unk. The unk token is never produced (every byte has a token), but a folder saved with a qwen2
# config loads as Qwen2Tokenizer, which adds an unk token of its own when the files name none (260 tokens).
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|pad|>", "<|unk|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens + ChatML specials: every string encodes, vocabulary stays tiny (260 tokens)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({tok: len(alphabet) + i for i, tok in enumerate(SPECIALS)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    bos, eos, pad, unk = SPECIALS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad,
                                        unk_token=unk)
    tokenizer.chat_template = CHATML
    return tokenizer
