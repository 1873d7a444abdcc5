"""Distillation data: responses to the training prompts, with the target's top-k next-token log-probs.

Two sources (DistillSpec, Zhou et al. 2024, §4: on-policy data helps): `target` (self-distillation:
the target's own responses) and `draft` (the draft generates, the target scores: data from the
draft's own distribution, generated once with the draft as the run starts). Either way the target scores
every response in one teacher-forced pass, so a row holds the sequence plus, per response position, the
target's top-k log-probs. An untrained draft writes gibberish (0.02 held-out agreement after 600 steps on
SmolLM2-135M); a distilled one continued on its own responses gained 0.03 over more of the target's.

A few hundred prompts are little data: a 4-layer draft of SmolLM2-135M distilled on 42k response tokens
agrees with the target on 96% of its training positions and 31% of held-out ones, and held-out agreement
stops rising after a third of the run. Two options buy more positions per prompt: `samples_per_prompt`
responses sampled at `temperature`, and `prompt_loss`, which also trains on the prompt's own positions
(the scoring pass computes the target's distributions there anyway). Measured there, they moved held-out
agreement by 0.000 and +0.006: the draft is short of prompts, not of positions. 1081 more prompts, written
by the target itself (`distill.synthetic`), moved it by +0.037 on the validation prompts and +0.053 on
the test prompts (README, Distillation).

Generating is the slow part on a CPU (minutes for a few hundred responses), so each dataset is saved
with `datasets.save_to_disk` under a key that hashes everything it depends on (both models' configs
and weights, the prompt ids, the generation settings) and is reloaded on reruns.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from specpolicy.atomic import atomic_path
from specpolicy.errors import SpecPolicyError, check_count, check_int, check_number
from specpolicy.models.attention import layer_masks, sliding_window
from specpolicy.models.fusion import model_inputs, shift, unwrap
from specpolicy.models.vocab import scorer, subset_of

log = logging.getLogger(__name__)
SOURCES = ("target", "draft")


@dataclass
class DistillData:
    """What to generate and cache; `conf/distill/*.yaml` sets it under `distill.data`."""

    source: str = "target"  # target | draft: who writes the responses (the target always scores)
    train_prompts: int | None = 400  # first N prompts of the train split (None: all)
    val_prompts: int | None = 48  # first N prompts of the validation split
    test_prompts: int | None = 64  # first N prompts of the test split (0: no test metrics)
    max_new_tokens: int = 128
    temperature: float = 0.0  # of the generator; 0 = greedy
    samples_per_prompt: int = 1  # responses per prompt, each from its own random stream (needs temperature > 0)
    prompt_loss: bool = False  # also distil at the prompt's positions, not only the response's
    top_k: int = 64  # target log-probs kept per position; 0 = keep none (targets computed on the fly)
    batch_size: int = 16  # generation and scoring batch
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise SpecPolicyError(f"distill.data.source={self.source!r}; choose one of {list(SOURCES)}")
        for setting in ("max_new_tokens", "batch_size", "samples_per_prompt"):
            check_count(f"distill.data.{setting}", getattr(self, setting))
        for setting in ("train_prompts", "val_prompts"):  # null: the whole split
            if getattr(self, setting) is not None:
                check_count(f"distill.data.{setting} (or null for the whole split)", getattr(self, setting))
        if self.test_prompts is not None:
            check_int("distill.data.test_prompts (0: no test metrics; null: the whole split)", self.test_prompts, 0)
        check_int("distill.data.top_k (0: targets computed on the fly)", self.top_k, 0)
        check_int("distill.data.seed", self.seed)
        if check_number("distill.data.temperature", self.temperature, 0) == 0 and self.samples_per_prompt > 1:
            raise SpecPolicyError(f"distill.data.samples_per_prompt={self.samples_per_prompt} needs "
                                  f"distill.data.temperature > 0 (greedy decoding repeats one response), or 1")

    def key(self, target: PreTrainedModel, generator: PreTrainedModel, prompts: list[list[int]], top_k: int) -> str:
        """Of what the data depends on: the prompts are hashed themselves; the batch changes no response (a prompt's
        random stream is its index); `top_k` is what this set keeps (held-out sets and online targets: none, whatever
        distill.data.top_k says); the seed changes no greedy response (a seed sweep regenerated every set)."""
        which = ("train_prompts", "val_prompts", "test_prompts", "batch_size", "top_k",
                 *(("seed",) if self.temperature == 0 else ()))
        settings = {k: v for k, v in asdict(self).items() if k not in which}
        return cache_key({"target": fingerprint(target), "generator": fingerprint(generator), "prompts": prompts,
                          "settings": settings, "top_k": top_k})

    def build(self, target: PreTrainedModel, generator: PreTrainedModel, prompts: list[list[int]], top_k: int,
              cache_dir: str | Path, desc: str) -> Path:
        """Generate and score once; later calls (and other ranks) find the folder and return at once."""
        out = Path(cache_dir) / "distill" / f"{desc}-{self.key(target, generator, prompts, top_k)}"
        if (out / "dataset_info.json").exists():
            log.info("distillation data %s: cached at %s", desc, out)
            return out
        prompts = [p for p in prompts for _ in range(self.samples_per_prompt)]  # copies of a prompt side by side
        responses = generate_responses(generator, prompts, self.max_new_tokens, self.batch_size, self.temperature,
                                       self.seed, desc=f"generating {desc} responses ({self.source})")
        rows = {"input_ids": [p + r for p, r in zip(prompts, responses)], "prompt_len": [len(p) for p in prompts]}
        if self.prompt_loss:  # every position after the first predicts a token the draft will learn
            rows["loss_from"] = [1] * len(prompts)
        if top_k:
            rows["topk_ids"], rows["topk_logp"] = score(target, rows, top_k, self.batch_size,
                                                        desc=f"scoring {desc} responses")
        with atomic_path(out) as tmp:
            datasets.Dataset.from_dict(rows).save_to_disk(str(tmp))
        return out


def cache_key(parts: dict) -> str:
    """A short name for a cache entry: a hash of everything (JSON-serialisable) the entry depends on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(model: PreTrainedModel) -> str:
    """Config + each weight's shape and a sample of its values + the tokens a subset head scores (not in the state
    dict): two models hash alike only if they compute alike (in practice). The folder a model was loaded from is left
    out, so a moved or freshly cloned project keeps its caches."""
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().flatten()[:64].float().cpu().numpy().tobytes())
    if (ids := subset_of(model)) is not None:
        h.update(ids.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.inference_mode()
def generate_responses(model: PreTrainedModel, prompt_ids: list[list[int]], max_new_tokens: int, batch_size: int,
                       temperature: float = 0.0, seed: int = 0, top_p: float = 1.0,
                       desc: str = "generating") -> list[list[int]]:
    """Each prompt's response (EOS included when hit), decoded by the engine in batches."""
    from specpolicy.decode import Engine
    from specpolicy.policy import ArPolicy

    engine = Engine(model, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    out: list[list[int]] = []
    training = model.training  # a draft about to train writes its on-policy data: without dropout, as it drafts
    model.eval()
    try:
        for start in tqdm(range(0, len(prompt_ids), batch_size), desc=desc, unit="batch"):
            batch = prompt_ids[start:start + batch_size]
            out += engine.generate(batch, ArPolicy(), first_id=start).outputs  # each prompt its own random stream
    finally:
        model.train(training)
    return out


@torch.inference_mode()
def score(target: PreTrainedModel, rows: dict[str, list], top_k: int, batch_size: int,
          desc: str = "scoring") -> tuple[list, list]:
    """Per sequence of `rows` (columns as `collate_rows` reads them), the target's top-k (ids, log-probs) at
    each position that `collate_rows` trains on."""
    all_ids, all_logp = [], []
    n = len(rows["input_ids"])
    for start in tqdm(range(0, n, batch_size), desc=desc, unit="batch"):
        chunk = [{k: v[i] for k, v in rows.items()} for i in range(start, min(start + batch_size, n))]
        batch = collate_rows(chunk, pad_id=0, max_length=None)
        batch = {k: v.to(target.device) for k, v in batch.items()}
        logp = torch.log_softmax(masked_logits(target, batch).float(), -1)  # [N, V]
        top = logp.topk(top_k, dim=-1)  # [N, k]
        counts = batch["loss_mask"].sum(1).tolist()
        for ids, lp in zip(top.indices.split(counts), top.values.split(counts)):
            all_ids.append(ids.int().cpu().tolist())
            all_logp.append(lp.half().float().cpu().tolist())  # fp16 precision is plenty, and rows stay small
    return all_ids, all_logp


@torch.inference_mode()
def featurize(target: PreTrainedModel, path: Path, batch_size: int, desc: str) -> Path:
    """The target's final hidden state at every token of each row of the dataset at `path` (what a fusing
    draft reads, `specpolicy.models.fusion`), as fp16 bytes [len, d] per row in a dataset cached beside it.
    Rows go through in order of length, so a batch pads little."""
    out = path.with_name(path.name + "-features")
    if (out / "dataset_info.json").exists():
        return out
    ids = datasets.load_from_disk(str(path))["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    features: list[bytes] = [b""] * len(ids)
    for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch"):
        picked = order[start:start + batch_size]
        batch = collate_rows([{"input_ids": ids[i], "prompt_len": len(ids[i])} for i in picked], 0, None)
        hidden = hidden_states(target, {k: v.to(target.device) for k, v in batch.items()})
        for i, h in zip(picked, hidden):
            features[i] = h[: len(ids[i])].half().cpu().numpy().tobytes()
    with atomic_path(out) as tmp:
        datasets.Dataset.from_dict({"features": features}).save_to_disk(str(tmp))
    return out


def hidden_states(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Final hidden states [B, L, d] of a batch; a fusing draft reads the target's, `batch["features"]`, each
    token j with the target's state at j - 1."""
    hf = unwrap(model)  # a peft model wraps the HF one
    features = batch.get("features")
    inputs = model_inputs(hf, batch["input_ids"], None if features is None else shift(features))
    return hf.base_model(**inputs, attention_mask=batch["attention_mask"]).last_hidden_state


def unrolled_hidden_states(model: PreTrainedModel, batch: dict[str, torch.Tensor], passes: int) -> list[torch.Tensor]:
    """A fusing draft's final hidden states [B, L, d] at draft positions 1..`passes` (EAGLE-3's training-time
    test): while drafting, it reads its own states, not the target's, and this trains it on them.

    Pass 1 is `hidden_states`. In pass m, token j stands for the m-th token drafted after a committed prefix
    ending at t = j - m + 1: it reads the draft's own state at j - 1 from pass m - 1, and attends to pass 1's
    keys up to t and to pass k's key at t + k - 1 for k = 2..m (the drafted tokens before it and itself),
    which is exactly what the engine's draft sees at that depth (sliding-window layers: of those, the keys less
    than a window behind it). The passes share one KV cache, so pass m costs one pass of L tokens attending to
    m * L keys."""
    hf = unwrap(model)
    tokens = batch["input_ids"]
    B, L = tokens.shape
    j = torch.arange(L, device=tokens.device)
    query, key = j[:, None], j[None, :]
    # a cache without the config keeps every key in every layer (a sliding layer's would drop all but its last
    # window), so each pass attends to the earlier passes' keys; the masks slide where the model does
    cache, features, out = DynamicCache(), shift(batch["features"]), []
    window = sliding_window(hf.config)
    for m in range(1, passes + 1):
        visible = torch.cat([key <= query - m + 1] + [key == query - m + k for k in range(2, m + 1)], dim=1)
        behind = query - key.repeat(1, m)  # [L, m * L]: every pass's key j sits at position j
        mask = layer_masks(hf.config, window, visible.expand(B, 1, -1, -1), behind.expand(B, 1, -1, -1), hf.dtype)
        hidden = hf.base_model(**model_inputs(hf, tokens, features), attention_mask=mask,
                               position_ids=j.expand(B, -1), cache=cache, use_cache=True).last_hidden_state
        out.append(hidden)
        features = shift(hidden)
    return out


def masked_logits(model: PreTrainedModel, batch: dict[str, torch.Tensor],
                  hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Logits at the positions of `loss_mask` only, in row-major order: [N, V], or [N, n] over the tokens
    of a draft's `SubsetHead`. The LM head over a 49k vocabulary is the largest matmul of a small draft,
    so it is not run on prompt tokens (nor, with a subset head, on tokens the draft never proposes).
    `hidden`: the model's hidden states when the caller has them already."""
    hf = unwrap(model)
    hidden = hidden_states(hf, batch) if hidden is None else hidden
    return scorer(hf)[0](hidden[batch["loss_mask"]])  # [N, H] -> [N, V|n]


def collate_rows(rows: list[dict], pad_id: int, max_length: int | None) -> dict[str, torch.Tensor]:
    """Right-padded batch; `loss_mask` marks positions whose next token is trained on: the response's
    tokens, or every token from index `loss_from` where a row has that column (`prompt_loss`).

    With cached targets, `topk_ids`/`topk_logp` [N, k] follow the same row-major order as
    `input_ids[loss_mask]`, truncated with the sequence at `max_length`. Rows with cached target
    `features` (`featurize`) give `features` [B, L, d], the target's final hidden state at each position.
    """
    seqs = [torch.tensor(r["input_ids"][:max_length], dtype=torch.long) for r in rows]
    input_ids = pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    lengths = torch.tensor([len(seq) for seq in seqs])
    firsts = torch.tensor([row.get("loss_from", row["prompt_len"]) for row in rows])
    at = torch.arange(input_ids.shape[1])
    attention_mask = (at < lengths[:, None]).long()
    loss_mask = (at >= firsts[:, None] - 1) & (at < lengths[:, None] - 1)
    n_pos = (lengths - firsts).clamp(min=0).tolist()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if "topk_ids" in rows[0]:
        k = len(rows[0]["topk_ids"][0])
        batch["topk_ids"] = torch.cat([torch.tensor(r["topk_ids"][:n]).reshape(n, k) for r, n in zip(rows, n_pos)])
        batch["topk_logp"] = torch.cat([torch.tensor(r["topk_logp"][:n]).reshape(n, k) for r, n in zip(rows, n_pos)])
    if "features" in rows[0]:
        hidden = [np.frombuffer(r["features"], np.float16).reshape(len(r["input_ids"]), -1)[: len(seq)]
                  for r, seq in zip(rows, seqs)]
        batch["features"] = pad_sequence([torch.from_numpy(h.astype(np.float32)) for h in hidden], batch_first=True)
    return batch
