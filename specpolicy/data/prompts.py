"""Prompts as chat conversations, from the embedded set, a local file or a hub dataset.

Every source goes through `datasets.load_dataset`, so JSONL, JSON, Parquet, CSV and text files and hub
datasets behave alike. A row holds either a prompt string (in the column `prompt_field` names; a text
file's lines) or a chat: a `messages` list of role/content turns, or ShareGPT's `conversations` list of
from/value turns. Chat templates are applied by the tokenizer in `encode_prompts`, never by hand; a tokenizer
without one (a base model's) reads the turns' text joined by blank lines.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import jinja2
from transformers import PreTrainedTokenizerBase

from specpolicy.errors import SpecPolicyError, check_count

log = logging.getLogger("specpolicy")

EMBEDDED = Path(__file__).parent / "prompts" / "default.jsonl"
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
# ShareGPT's `from` names and Gemma-style data's "model" as the roles chat templates know; the rest (system, user, ...)
# are those roles already
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant"}
Conversation = list[dict[str, str]]
# beside a trained draft or depth head: digests of the prompts it was trained on (`digests_text`, `trained_on`)
TRAINED_ON = "trained_on.json"
PIPELINE_SPLITS = ("train", "validation", "test")  # distillation and rollouts, held-out metrics, evaluation


@dataclass
class PromptSource:
    """Where prompts come from. `prompts_file` wins over `hub_dataset`; with neither, the embedded set.

    `split` selects rows of the embedded set (or a hub split); a user's file is used whole unless
    it has a `split` column. `limit` keeps the first N prompts after splitting. `prompt_field` is the
    column that holds a plain prompt (`instruction`, `question`, ... in many data sets).
    """

    prompts_file: str | None = None
    hub_dataset: str | None = None
    split: str = "test"
    limit: int | None = None
    prompt_field: str = "prompt"

    def __post_init__(self) -> None:
        if self.limit is not None:
            check_count("data.limit (or null for every prompt)", self.limit)

    def load(self) -> list[Conversation]:
        rows, splits, named = self._rows, self.splits, self._split_names
        if splits is not None and self.split != "all":
            if self.split not in splits:  # a typo (`tset`) read as an empty split
                raise SpecPolicyError(f"data.split={self.split!r} is not a split of {self.name}; choose one of "
                                      f"{splits + ['all']}")
            unread = [s for s in named if s not in (*PIPELINE_SPLITS, self.split)]
            if unread:  # `TEST`, `dev`, or no split at all: rows no stage reads unless data.split names them
                _warn_unread(self.name, tuple(sorted(collections.Counter(unread).items())), len(rows))
            rows = rows.select([i for i, split in enumerate(named) if split == self.split])
        if self.limit is not None:
            rows = rows.select(range(min(self.limit, len(rows))))
        conversations = [self._conversation(row, i) for i, row in enumerate(rows)]
        if not conversations:
            raise SpecPolicyError(f"no prompts in {self.name} (split={self.split!r}); add rows or change data.split")
        replied = sum(c[-1]["role"] == "assistant" for c in conversations)
        if replied:  # a chat data set's reference reply: the model is to write its own
            log.warning("%d of %d conversations in %s end with an assistant turn; decoding starts before it "
                        "(the trailing assistant turns are dropped)", replied, len(conversations), self.name)
        conversations = [_without_reply(c) for c in conversations]
        repeats = len(conversations) - len(set(map(_digest, conversations)))
        if repeats:  # a copy weighs a prompt twice in every mean, and trains on it twice
            _warn_repeats(self.name, None if self.serves_every_split else self.split, repeats, len(conversations))
        return conversations

    def _conversation(self, row: dict[str, Any], index: int) -> Conversation:
        where = f"row {index} of {self.name}"
        turns = row.get("messages") or row.get("conversations")
        if turns:
            return _chat(turns, where)
        prompt = row.get(self.prompt_field)
        if isinstance(prompt, str) and prompt.strip():
            return [{"role": "user", "content": prompt}]
        if any(isinstance(value, list) for value in row.values()) and Path(self.name).suffix == ".json":
            fix = "a .json prompts file must hold a list of objects, one per prompt (or write JSONL, one per line)"
        elif prompt is not None and not isinstance(prompt, str):  # {"prompt": 42}: the column is there
            fix = f"its {self.prompt_field!r} is {prompt!r:.40}, not text; write prompts as strings"
        else:
            fix = "name the prompt's column with data.prompt_field=COLUMN"
        raise SpecPolicyError(f"{where} has neither a non-empty {self.prompt_field!r} string nor a 'messages' list "
                              f"(its columns: {', '.join(row)}); {fix}")

    @property
    def splits(self) -> list[str] | None:
        """The splits named in a `split` column of a file or the embedded set; None without one (a hub dataset's
        splits are its own)."""
        return None if self._split_names is None else sorted(set(self._split_names) - {""})  # "": a row without one

    @functools.cached_property
    def _split_names(self) -> list[str] | None:
        """Each row's split as text ("" for none), read once for `splits` and `load`; None without a `split` column."""
        if self.hub_dataset and not self.prompts_file or "split" not in self._rows.column_names:
            return None
        return ["" if s in (None, "") else str(s) for s in self._rows["split"]]

    @property
    def serves_every_split(self) -> bool:
        """A prompts file without a `split` column: every split is the whole file."""
        return bool(self.prompts_file) and self.splits is None

    @property
    def name(self) -> str:
        return self.prompts_file or self.hub_dataset or f"the embedded prompt set ({EMBEDDED.name})"

    @functools.cached_property
    def _rows(self) -> datasets.Dataset:
        """The source's rows, read once: `load`, `splits` and `serves_every_split` all need them."""
        if self.prompts_file:
            rows = _load_file(Path(self.prompts_file).expanduser(), self.prompt_field)
            if Path(self.prompts_file).suffix == ".txt":  # one prompt per line; blank lines separate nothing
                rows = rows.filter(lambda r: bool(r["text"].strip()))
                if self.prompt_field != "text":
                    rows = rows.rename_column("text", self.prompt_field)
            return rows
        if self.hub_dataset:
            try:
                return datasets.load_dataset(self.hub_dataset, split=self.split)
            except Exception as err:  # offline or missing: datasets raises many types from deep inside
                why = " ".join(str(err).split())[:300]  # e.g. 'Unknown split "test". Should be one of ['train'].'
                fix = ("set data.split to one of its splits (data.split=train, say)" if "split" in why.lower() else
                       "check the name and network, or use data.prompts_file=PATH")
                raise SpecPolicyError(f"cannot load hub dataset {self.hub_dataset!r} ({err.__class__.__name__}: "
                                      f"{why}); {fix}") from err
        return _load_file(EMBEDDED, self.prompt_field)


@functools.cache  # once per file: distil reads three splits of it, evaluate one more
def _warn_unread(name: str, splits: tuple[tuple[str, int], ...], rows: int) -> None:
    counts = ", ".join(f"{n} {'with no `split`' if split == '' else f'in split {split!r}'}" for split, n in splits)
    log.warning("%d of the %d rows of %s are in no split the pipeline reads (%s); it reads %s, data.split=<name> "
                "one split and data.split=all every row", sum(n for _, n in splits), rows, name, counts,
                ", ".join(PIPELINE_SPLITS))


@functools.cache  # once per file and split: a file without splits serves distil's three and evaluate's alike
def _warn_repeats(name: str, split: str | None, repeats: int, prompts: int) -> None:
    where = name if split is None else f"{name} (split={split!r})"
    log.warning("%d of %d prompts in %s repeat an earlier one; the copies are kept", repeats, prompts, where)


def _load_file(path: Path, prompt_field: str) -> datasets.Dataset:
    """A prompts file's rows; a CSV's `prompt_field` column is read as text as written (pandas made a column of
    numbers, `12` or `007`, floats, and a prompt `NA` or `None` a missing value; the error then said the prompt was
    missing)."""
    if path.is_dir():
        raise SpecPolicyError(f"prompts file {str(path)!r} is a folder; point data.prompts_file at a file in it")
    if not path.is_file():
        raise SpecPolicyError(f"prompts file {str(path)!r} does not exist; fix data.prompts_file=PATH")
    builder = FILE_BUILDERS.get(path.suffix)
    if builder is None:
        raise SpecPolicyError(f"prompts file {path.name!r} has an unknown format; use one of {sorted(FILE_BUILDERS)}")
    if builder != "parquet":  # text: pyarrow's JSON reader took bytes that are not UTF-8, and failed on reading rows
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise SpecPolicyError(f"prompts file {str(path)!r} is not UTF-8 text (byte {err.object[err.start]:#x} at "
                                  f"offset {err.start}); save it as UTF-8") from err
        if not text.strip():  # only blank lines: datasets said 'Instruction "train" corresponds to no data!'
            raise SpecPolicyError(f"prompts file {str(path)!r} is empty; add one JSON object per line with a "
                                  f"'prompt' field")
    # a text file's byte-order mark stayed in its first prompt (the JSON and CSV readers drop it)
    csv = {"converters": {prompt_field: str}, "keep_default_na": False}
    options = {"text": {"encoding": "utf-8-sig"}, "csv": csv}.get(builder, {})
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as err:  # datasets wraps the parser's error: name the innermost one, which says where
        cause = err
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise SpecPolicyError(f"cannot parse prompts file {str(path)!r}: {cause}") from err


def _chat(turns: Any, where: str) -> Conversation:
    """A `messages` (role/content) or ShareGPT `conversations` (from/value) list as role/content turns."""
    chat = []
    for turn in turns if isinstance(turns, list) else [None]:
        turn = turn if isinstance(turn, dict) else {}
        role = turn.get("role", turn.get("from"))
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        content = turn.get("content", turn.get("value"))
        if not (isinstance(role, str) and isinstance(content, str)):
            raise SpecPolicyError(f"{where}: 'messages' must be a list of {{'role': str, 'content': str}} objects "
                                  f"(or 'conversations' of {{'from': str, 'value': str}})")
        chat.append({"role": role, "content": content})
    if all(turn["role"] == "assistant" for turn in chat):
        raise SpecPolicyError(f"{where}: the conversation has no turn before the assistant's; add the user's")
    return chat


def _without_reply(conversation: Conversation) -> Conversation:
    end = len(conversation)
    while conversation[end - 1]["role"] == "assistant":
        end -= 1
    return conversation[:end]


def without(conversations: list[Conversation], excluded: list[Conversation], stage: str,
            dropped: str | None) -> list[Conversation]:
    """`conversations` minus those also in `excluded`, compared whole: a prompts file without a `split` column
    serves every split, so held-out prompts must be taken out of what trains by value. When any go, `stage`
    warns how many, then `dropped` (what they were and what becomes of them); None: a check, which says nothing."""
    seen = {_digest(c) for c in excluded}
    kept = [c for c in conversations if _digest(c) not in seen]
    if dropped is not None and len(kept) < len(conversations):
        log.warning("%s: %d of %d %s", stage, len(conversations) - len(kept), len(conversations), dropped)
    return kept


def digests_text(conversations: list[Conversation]) -> str:
    """The `TRAINED_ON` file's text: a digest per prompt, so a model's folder says what it was trained on
    without carrying the prompts, and `trained_on` knows them again whatever file, copy or split they come from."""
    return json.dumps(sorted({_digest(c) for c in conversations}), indent=0)


def trained_on(folder: str | Path, conversations: list[Conversation]) -> list[int]:
    """Indices of the `conversations` that the model saved in `folder` was trained on; none where the folder
    has no `TRAINED_ON` file (a model from elsewhere, or distilled before such files were written)."""
    path = Path(folder).expanduser() / TRAINED_ON
    if not path.is_file():
        return []
    try:
        seen = set(json.loads(path.read_text()))
    except (ValueError, TypeError) as err:  # written whole with the folder: a damaged or hand-edited file
        raise SpecPolicyError(f"{path} is damaged ({err}); delete it to evaluate without the check that no "
                              f"prompt was trained on, or train the model in {folder} again") from err
    return [i for i, c in enumerate(conversations) if _digest(c) in seen]


def _digest(conversation: Conversation) -> str:
    return hashlib.sha256(json.dumps(conversation, sort_keys=True).encode()).hexdigest()[:16]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], context_length: int, reserve: int = 0,
) -> list[list[int]]:
    """Token ids per prompt, chat template applied; `reserve` tokens of context (engine.max_new_tokens) are kept
    for generation, and a prompt without room for them is refused (training stages skip it: `fitting`)."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):  # a LoadedModel: its `.tokenizer`
        raise SpecPolicyError(f"encode_prompts needs a tokenizer (e.g. LoadedModel.tokenizer), got "
                              f"{type(tokenizer).__name__}")
    encoded = []
    for i, conversation in enumerate(conversations):
        if not (isinstance(conversation, list) and all(isinstance(turn, dict) for turn in conversation)):
            raise SpecPolicyError(f"prompt {i} is not a conversation: encode_prompts takes a list of them, e.g. "
                                  f"[[{{'role': 'user', 'content': 'Hi'}}]] (PromptSource(...).load() returns one)")
        if tokenizer.chat_template:
            try:  # templates refuse what their model was not trained on (a system turn, two user turns in a row)
                text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            except jinja2.TemplateError as err:
                raise SpecPolicyError(f"prompt {i}: the target's chat template refuses it ({err}); fix its messages "
                                      f"(roles, order) in the prompts file") from err
        else:  # a base model's tokenizer: the turns' text, with the special tokens it adds itself (a Llama's BOS,
            # which a template writes into its text)
            text = "\n\n".join(m["content"] for m in conversation)
        encoded.append(tokenizer(text, add_special_tokens=not tokenizer.chat_template)["input_ids"])
    over = [(i, len(ids)) for i, ids in enumerate(encoded) if len(ids) + reserve > context_length]
    if len(over) == 1:
        [(i, n)] = over
        raise SpecPolicyError(f"prompt {i} is {n} tokens, and with {reserve} tokens of generation it exceeds the "
                              f"model's context of {context_length}; shorten the prompt or lower engine.max_new_tokens")
    if over:  # all of them at once: naming the first alone made a user fix a file one prompt per run
        listed = ", ".join(f"{i} ({n} tokens)" for i, n in over[:5]) + (", ..." if len(over) > 5 else "")
        raise SpecPolicyError(f"{len(over)} of {len(encoded)} prompts, with {reserve} tokens of generation each, "
                              f"exceed the model's context of {context_length}: prompts {listed}, numbered from 0; "
                              f"shorten them or lower engine.max_new_tokens")
    return encoded


def fitting(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], longest: int, stage: str,
            limit: str) -> list[Conversation]:
    """The prompts of at most `longest` tokens: a training stage skips the others, saying how many and which `limit`
    sets the length (evaluate refuses them instead, `encode_prompts`: its prompts are the test). Conversations, not
    ids: what a stage trains on is also listed by content (`digests_text`)."""
    encoded = encode_prompts(tokenizer, conversations, context_length=2**62)
    kept = [c for c, ids in zip(conversations, encoded) if len(ids) <= longest]
    if len(kept) < len(encoded):
        log.warning("%s: %d of %d prompts are longer than %d tokens (%s); skipped", stage, len(encoded) - len(kept),
                    len(encoded), longest, limit)
    if not kept:
        raise SpecPolicyError(f"{stage}: every prompt is longer than {longest} tokens ({limit}); use shorter prompts "
                              f"or raise that limit")
    return kept
