"""Training prompts written by the target itself (Magpie, Xu et al. 2024).

A chat model given its template up to the start of a user turn, and nothing else, writes a user
message: sampled, these are prompts from the distribution the model was tuned on, as many as one
asks for, offline. The draft is short of prompts, not of positions per prompt, so these are the cheap
way to grow its data when no hub is reachable: on SmolLM2-135M, 1081 such prompts raised a 4-layer
draft's validation agreement from 0.31 to 0.36 at equal steps (README, Distillation).

Free samples repeat the few openings the model favours (45% of SmolLM2's start with "I'm": advice
requests), none of them a translation, summary or extraction. With `opening_words=N` each message starts
with the first N words of a random training prompt ("Translate the", "You are") and the target writes
the rest: the real set's kinds of request, in new words. Added to the free ones on SmolLM2-135M, they
tied on the validation prompts (agreement 0.351 vs 0.348) and gained 0.021 on the test prompts.

The prompts are saved as a JSONL prompts file (`{"prompt": ...}` per line, the format
`data.prompts_file` reads) under a key that hashes the target and these settings, and reloaded on reruns.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specpolicy.atomic import atomic_path
from specpolicy.data import PromptSource
from specpolicy.data.prompts import Conversation
from specpolicy.distill.data import cache_key, fingerprint, generate_responses
from specpolicy.errors import SpecPolicyError, check_count, check_int, check_number
from specpolicy.models.loading import eos_ids

log = logging.getLogger(__name__)
SENTINEL = "<<specpolicy-user-message>>"


@dataclass
class PromptSynthesis:
    """How many user prompts the target samples, and how; each entry of `distill.synthetic` sets one.

    Samples that do not end within `max_tokens` (no end-of-turn token), add nothing to their opening, or
    repeat are dropped, so the set holds at most `num_prompts` prompts; the log says how many were kept.
    """

    num_prompts: int = 1000
    max_tokens: int = 64
    temperature: float = 0.8  # lower than 1 with top-p: a 135M model's T=1 samples drift into run-on text
    top_p: float = 0.95
    batch_size: int = 32
    seed: int = 0
    opening_words: int = 0  # N > 0: each message starts with the first N words of a random training prompt

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_tokens", "batch_size"):  # batch_size=0 was a range() ValueError
            check_count(name, getattr(self, name))
        check_number("temperature", self.temperature, 0, low_open=True, why="greedy sampling writes one prompt")
        check_number("top_p", self.top_p, 0, 1, low_open=True)  # was refused by the engine, as engine.top_p
        check_int("seed", self.seed)
        check_int("opening_words", self.opening_words, 0)

    def conversations(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache_dir: str | Path,
                      train: list[Conversation] = ()) -> list[Conversation]:
        """The prompts as conversations, sampled once per (target, settings, openings) and then read from the
        cache. `train` is the real training set whose first words open the messages (with `opening_words`)."""
        # a prompt's sample does not depend on its batch: its random stream is its index (`generate_responses`)
        settings = {k: v for k, v in asdict(self).items() if k not in ("opening_words", "batch_size")}
        openings = self.openings(train)
        if openings:
            settings |= {"opening_words": self.opening_words, "openings": openings}
        key = cache_key({"target": fingerprint(model), **settings})
        path = Path(cache_dir) / "distill" / f"synthetic-prompts-{key}.jsonl"
        if not path.exists():
            prompts = self.sample(model, tokenizer, openings)
            with atomic_path(path) as tmp:
                tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        else:
            log.info("synthetic prompts: cached at %s", path)
        return PromptSource(prompts_file=str(path), split="all").load()

    def openings(self, train: list[Conversation]) -> list[str]:
        """The first `opening_words` words of each training prompt's first message (none when 0)."""
        if not self.opening_words:
            return []
        if not train:
            raise SpecPolicyError("distill.synthetic opening_words > 0 needs training prompts to take openings from; "
                                  "set opening_words=0")
        return [" ".join(c[0]["content"].split()[: self.opening_words]) for c in train]

    def sample(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, openings: list[str] = ()) -> list[str]:
        """Up to `num_prompts` distinct, complete user messages sampled from the target, each continuing a
        random one of `openings` (or written from scratch without them)."""
        rng = random.Random(self.seed)
        starts = [rng.choice(openings) for _ in range(self.num_prompts)] if openings else [""] * self.num_prompts
        prefix = user_turn_prefix(tokenizer)
        prompts = [tokenizer(prefix + start, add_special_tokens=False)["input_ids"] for start in starts]
        outputs = generate_responses(model, prompts, self.max_tokens, self.batch_size, self.temperature, self.seed,
                                     top_p=self.top_p, desc="sampling synthetic prompts")
        eos = set(eos_ids(model.generation_config.eos_token_id))
        finished = [(start, tokenizer.decode(out[:-1], skip_special_tokens=True))
                    for start, out in zip(starts, outputs) if out and out[-1] in eos]
        texts = [(start + written).strip() for start, written in finished if written.strip()]
        prompts = list(dict.fromkeys(texts))  # distinct, in sampling order
        log.info("synthetic prompts: kept %d of %d samples (%d ran past max_tokens=%d, %d empty or repeated)",
                 len(prompts), len(outputs), len(outputs) - len(finished), self.max_tokens,
                 len(finished) - len(prompts))
        if not prompts:
            raise SpecPolicyError(f"none of {len(outputs)} synthetic prompts ended within "
                                  f"distill.synthetic.max_tokens={self.max_tokens}; raise it")
        return prompts


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template's text up to where a user message's text begins (system turn included)."""
    if not tokenizer.chat_template:
        raise SpecPolicyError("distill.synthetic needs a chat model: the target's tokenizer has no chat template "
                              "to prompt with; set distill.synthetic=null or use data.prompts_file=PATH")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise SpecPolicyError("the target's chat template rewrites user messages, so the start of a user turn cannot "
                              "be found; set distill.synthetic=null")
    return text[: text.index(SENTINEL)]
