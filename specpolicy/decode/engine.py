"""Batched speculative decoding with a per-row, per-step depth chosen by a policy.

One step, for every row in flight:
  budget  the policy gives each row its maximum depth for the current batch load;
  draft   the draft first reads every committed token it has not seen (catching up after
          depth-0 steps, so its cache never goes stale), then proposes one token per position,
          and the policy may stop any row after each position; a draft that fuses the target's
          features (`models.fusion`) reads the feature the target computed before each committed
          token, and its own last hidden state while it drafts;
          a row with many unseen tokens (a prompt) reads them alone first, so ragged prompts are
          not padded to the longest one (unless padding them together wastes little: `max_padding`);
  verify  the target reads the tokens it has not seen plus each row's drafts, in one pass;
  accept  per row, the lossless rejection rule (greedy = exact match) keeps a prefix + one token;
  commit  rows advance by what they kept; caches roll back by length, never by copying;
  retire  rows at EOS or max_new_tokens leave the batch, so they stop costing compute.
Plain autoregressive decoding is the same loop with depth 0 (no draft model is even needed).
Statistics that decoding does not need (FLOP buckets, acceptance histograms) are queued each step and
flushed once the clock stops (`DecodeStats.later`), so the timed loop pays only for decoding.

What the engine does not know: which policy it runs, or anything about the model family beyond
the transformers Cache API (`base_model`, `get_output_embeddings`, 4D attention masks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from numbers import Integral
from typing import Any

import torch
from transformers import PreTrainedModel

from specpolicy.cost.flops import FlopModel
from specpolicy.decode import sampling
from specpolicy.decode.cache import RaggedCache, forward
from specpolicy.decode.stats import DecodeStats
from specpolicy.errors import SpecPolicyError, check_count, check_int, check_number
from specpolicy.models.attention import ignored_window
from specpolicy.models.compat import check_models
from specpolicy.models.fusion import fuses_features, unwrap
from specpolicy.models.loading import LoadedModel, context_length, eos_ids
from specpolicy.models.vocab import draft_ids, logits_width, spread, subset_of
from specpolicy.policy.base import DepthPolicy, StepState
from specpolicy.rollout.features import COLUMN, draft_features
from specpolicy.runtime import synchronize

log = logging.getLogger("specpolicy")

Host = dict[str, torch.Tensor]  # host copies of per-row counters (`Rows.host`), [A] each


@dataclass
class Rows:
    """Per-row decode state of the rows in flight; every tensor is [A, ...] on the model's device."""

    seq: torch.Tensor  # [A, cap] prompt + committed tokens (+ tentative drafts past `length`)
    length: torch.Tensor  # committed tokens
    t_len: torch.Tensor  # tokens in the target's cache
    d_len: torch.Tensor  # tokens in the draft's cache
    generated: torch.Tensor  # new tokens committed
    prompt_len: torch.Tensor
    row_ids: torch.Tensor  # index in the original batch
    seeds: torch.Tensor  # per-row random state (counter-based sampling)
    feat: torch.Tensor  # [A, cap + 1, d]: feat[:, j] is the target's hidden state at j - 1, which a fusing
    # draft reads with token j (valid for j <= t_len; zeros at 0); [A, 0] when the draft fuses none

    def select(self, keep: torch.Tensor) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name)[keep])

    def host(self) -> Host:
        """One device-to-host copy of the small per-row counters the next step sizes its tensors with (and those
        that retiring rows need)."""
        names = ("length", "t_len", "d_len", "generated", "prompt_len", "row_ids")
        values = torch.stack([getattr(self, n) for n in names]).cpu()
        return dict(zip(names, values))


@dataclass
class DecodeResult:
    outputs: list[list[int]]  # generated ids per prompt (EOS included when hit)
    stats: DecodeStats


def check_settings(settings: Mapping[str, Any]) -> None:
    """Refuse engine settings that cannot decode, naming each as `engine.<key>`: Engine() checks its own, the
    pipelines check `cfg.engine` before any model loads (`engine.seed=abc` used to end in a traceback there)."""
    counts = {"max_new_tokens", "solo_above"}  # solo_above=0 would read empty backlogs alone
    ranges = {"temperature": (0, None, False), "top_p": (0, 1, True), "max_padding": (0, 1, False)}
    for key, value in settings.items():
        if key in counts:
            check_count(f"engine.{key}", value)
        elif key in ranges:
            check_number(f"engine.{key}", value, *ranges[key])
        elif key == "seed":
            check_int("engine.seed", value)


class Engine:
    """Decode batches of prompts with `target`, speculating with `draft` as `policy` decides."""

    def __init__(
        self, target: PreTrainedModel, draft: PreTrainedModel | None = None, max_new_tokens: int = 64,
        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, eos_token_id: int | list[int] | None = None,
        solo_above: int = 16, max_padding: float = 0.3,
    ):
        """`solo_above`: rows of a batch with more unseen tokens than this read them in a forward of their own
        (16 prompts of 39-172 tokens: 3.1 s row by row vs 5.7 s padded to the longest, SmolLM2-135M on CPU),
        unless reading every row's backlog in one padded forward wastes at most `max_padding` of its slots:
        a few rows of similar length read faster together (0.3 chosen on validation prompts; on the test
        prompts, fp32 `ar` at batch 2 / 4 / 8: 62.3 / 86.2 / 85.4 tok/s against 58.3 / 82.5 / 86.0 with 0)."""
        check_settings({"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                        "solo_above": solo_above, "max_padding": max_padding})
        for role, model in (("target", target), ("draft", draft)):
            if isinstance(model, LoadedModel):  # what every source and draft builder returns
                raise SpecPolicyError(f"Engine takes models: pass {role}.model, not the LoadedModel")
            if not (isinstance(model, torch.nn.Module) or role == "draft" and model is None):
                raise SpecPolicyError(f"Engine's {role} must be a transformers causal LM (e.g. "
                                      f"PretrainedSource(path=...).load().model), got {model!r:.80}")
        # a peft-wrapped model (get_peft_model) decodes as the HF model its adapters live in: the engine reads
        # `base_model`, which for a PeftModel is the LoRA wrapper around the whole causal LM
        target, draft = unwrap(target), unwrap(draft) if draft is not None else None
        if draft is not None:
            check_models(target, draft)
        self.target, self.draft = target, draft
        self.max_new_tokens, self.temperature, self.top_p, self.seed = max_new_tokens, temperature, top_p, seed
        self.solo_above, self.max_padding = solo_above, max_padding
        eos = eos_ids(target.generation_config.eos_token_id if eos_token_id is None else eos_token_id)
        self.device = target.device
        self.eos = torch.tensor(eos, dtype=torch.long, device=self.device)
        self.context = context_length(target.config)
        for role, model in (("target", target), ("draft", draft)):
            if model is not None and (window := ignored_window(model.config)) and window < self.context:
                log.warning("the %s's config sets sliding_window=%d, which %s's attention does not read: the engine "
                            "attends to the whole prefix, as its forward does, where transformers' generate crops its "
                            "cache to the window (set config.sliding_window = None for generate to agree)", role,
                            window, model.config.model_type)
        self.vocab = logits_width(target)
        # reading each config's attention layers, these refuse those the engine's masks cannot express
        self.t_flops = FlopModel.from_model(target)
        self.d_flops = FlopModel.from_model(draft) if draft is not None else None
        self.fuse = fuses_features(draft)
        # a draft that scores a vocabulary subset (or fewer rows than the target) drafts in its own index
        # (`models.vocab`): its argmax, features and distributions cover 8k scores, not 49k mostly -inf ones;
        # `_draft` maps ids back
        self.draft_ids = draft_ids(draft, self.vocab) if draft is not None else None
        self.target_ids = subset_of(target)  # a subset draft decoding alone (writing its own distillation data)

    # ---------------------------------------------------------------- public
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], policy: DepthPolicy, first_id: int = 0) -> DecodeResult:
        """Decode `prompts`; `first_id` numbers them for their random streams (row i draws from stream first_id + i),
        so callers that decode batches of one prompt list give each prompt its own stream: numbered from 0 in every
        batch, row r of every batch drew the same uniforms, and sampled outputs were correlated across batches."""
        check_int("first_id", first_id, 0)  # a float reached the random streams' bit arithmetic
        synchronize(self.device)
        t0 = time.perf_counter()  # setup included, as transformers' generate is timed (`eval.hf_baselines`)
        prompts = self._check(prompts, policy)
        K = policy.max_depth
        policy.reset(len(prompts))
        rows = self._start(prompts, K, first_id)
        A, cap = rows.seq.shape
        caches = RaggedCache(A, cap), RaggedCache(A, cap) if K else None
        stats = DecodeStats(max_depth=K, batch_size=len(prompts))
        outputs: list[list[int]] = [[] for _ in prompts]
        host = rows.host()
        while rows.row_ids.numel():
            start = time.perf_counter()  # each step ends in a device-to-host copy: a synchronising clock
            host = self._step(rows, host, caches, policy, stats, outputs)
            stats.step_s.append(time.perf_counter() - start)
        synchronize(self.device)
        stats.wall_s = time.perf_counter() - t0
        stats.flush()
        stats.tokens = sum(map(len, outputs))
        return DecodeResult(outputs, stats)

    # ---------------------------------------------------------------- setup
    def _check(self, prompts: list[list[int]], policy: DepthPolicy) -> list[list[int]]:
        """`prompts` as lists of ids (a 1-D tensor per prompt is one too), or a SpecPolicyError naming the misuse."""
        if not isinstance(policy, DepthPolicy):
            raise SpecPolicyError(f"policy must be a DepthPolicy instance, e.g. StaticPolicy(k=4); got {policy!r}")
        if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:  # [B, T] ids, a tokenizer's unpadded batch
            prompts = list(prompts)
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) or isinstance(p, torch.Tensor) and p.dim() == 1 for p in prompts):
            raise SpecPolicyError("prompts must be a list of token-id lists, one per prompt (e.g. [[1, 2, 3]]): "
                                  "encode text with the target's tokenizer first (specpolicy.data.encode_prompts "
                                  "applies its chat template to messages)")
        prompts = [p.tolist() if isinstance(p, torch.Tensor) else p for p in prompts]
        if not prompts:
            raise SpecPolicyError("no prompts to decode: pass a list of token-id lists, e.g. [[1, 2, 3]]")
        if any(len(p) == 0 for p in prompts):
            raise SpecPolicyError("every prompt needs at least one token")
        bad = next((t for p in prompts for t in p if not isinstance(t, Integral) or not 0 <= t < self.vocab), None)
        if bad is not None:
            raise SpecPolicyError(f"prompt token {bad!r} is not an id of the target's vocabulary "
                                  f"(0..{self.vocab - 1}); encode prompts with the target's tokenizer")
        if policy.max_depth and self.draft is None:
            raise SpecPolicyError(f"{type(policy).__name__} drafts up to {policy.max_depth} tokens but no draft model "
                                  f"is set")
        if policy.greedy_only and self.temperature > 0:
            raise SpecPolicyError(f"{type(policy).__name__} is defined for greedy decoding only; set temperature=0")
        longest = max(map(len, prompts))
        if longest + self.max_new_tokens > self.context:
            raise SpecPolicyError(
                f"a prompt of {longest} tokens + max_new_tokens={self.max_new_tokens} exceeds the context of "
                f"{self.context}; shorten the prompt or lower max_new_tokens"
            )
        return prompts

    def _start(self, prompts: list[list[int]], K: int, first_id: int) -> Rows:
        A, cap = len(prompts), max(map(len, prompts)) + self.max_new_tokens + K + 1
        seq = torch.zeros(A, cap, dtype=torch.long)
        for i, p in enumerate(prompts):
            seq[i, : len(p)] = torch.tensor(p)
        length, zeros, ids = torch.tensor([len(p) for p in prompts]), torch.zeros(A, dtype=torch.long), torch.arange(A)
        state = dict(seq=seq, length=length, t_len=zeros, d_len=zeros, generated=zeros, prompt_len=length,
                     row_ids=ids, seeds=self.seed * 1_000_003 + first_id + ids)
        rows = Rows(**{k: v.to(self.device, copy=True) for k, v in state.items()},
                    feat=torch.zeros(A, 0, device=self.device))
        if self.fuse and K:
            rows.feat = torch.zeros(A, cap + 1, self.target.config.hidden_size, dtype=self.target.dtype,
                                    device=self.device)
        return rows

    # ---------------------------------------------------------------- one step
    def _step(self, rows: Rows, host: Host, caches: tuple[RaggedCache, RaggedCache | None], policy: DepthPolicy,
              stats: DecodeStats, outputs: list[list[int]]) -> Host:
        """One verify step for every row in flight: budget, draft, verify, settle, commit, observe, retire."""
        unread = int((host["length"] - host["d_len"]).max())
        state = StepState(rows.row_ids, rows.generated, rows.row_ids.numel(), int(host["length"].sum()),
                          self.max_new_tokens - int(host["generated"].min()), unread)
        budget, decides = self._budget(rows, host, policy, state, stats)
        depth = int(budget.max())
        if depth:
            drafts, p, n_draft, fed = self._draft(rows, host, caches[1], budget, policy, state, depth, stats)
        else:  # nobody drafts: the draft catches up later, in one chunk
            (drafts, p), n_draft, fed = self._no_drafts(len(budget)), torch.zeros_like(budget), None
        logits = self._verify(rows, host, caches[0], drafts, stats)
        n_acc, token = sampling.settle(drafts, p, logits, n_draft, rows.seeds, rows.generated, self.temperature,
                                       self.top_p)
        finished, n_new = self._commit(rows, drafts, n_acc, token, n_draft, fed)
        new_host = rows.host()  # the next step's sizes; a policy that copies its evidence to the host waits no more
        counts, done = self._observe(policy, state, decides, stats, budget, n_draft, n_acc, n_new, finished)
        stats.later(self._account, stats, host, counts, drafts.shape[1], fed, caches[0].capacity)
        return self._retire(rows, new_host, done, caches, outputs)

    def _budget(self, rows: Rows, host: Host, policy: DepthPolicy, state: StepState, stats: DecodeStats
                ) -> tuple[torch.Tensor, bool]:
        """Each row's draft budget [A], within the policy's depth and the row's remaining tokens (the bonus token
        always comes), and whether the policy decides this step. On the first step the target has not read the
        prompts, and a fusing draft must not read them without its features: that step is the target's alone,
        and the policy neither decides nor observes it."""
        remaining = self.max_new_tokens - rows.generated
        if self.fuse and bool((host["t_len"] + 1 < host["length"]).any()):
            return torch.zeros_like(remaining), False
        with stats.deciding():
            # as_tensor: a policy's float or Python int budget failed mid-decode (in gather, two steps on)
            budget = torch.as_tensor(policy.budget(state), device=self.device).long()
            return budget.clamp(0, policy.max_depth).minimum(remaining - 1), True

    def _observe(self, policy: DepthPolicy, state: StepState, decides: bool, stats: DecodeStats, budget: torch.Tensor,
                 n_draft: torch.Tensor, n_acc: torch.Tensor, n_new: torch.Tensor, finished: torch.Tensor
                 ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Tell the policy what each row drafted and kept, and queue the step's histograms; returns host copies of
        (budget, n_draft, kept, accepted) for the FLOP buckets, and of `finished`. A row that kept an EOS among its
        drafts ended there: the drafts after it were neither kept nor rejected, so neither the policy's evidence nor
        the stats count them (the FLOP buckets still do)."""
        ended = n_new <= n_acc
        drafted, accepted = torch.where(ended, n_new, n_draft), torch.where(ended, n_new, n_acc)
        if decides:
            with stats.deciding():
                policy.observe(state, drafted, accepted)
        counts = torch.stack([budget, n_draft, n_new - 1, accepted, drafted, finished]).cpu()  # one copy for the rest
        stats.later(stats.record_step, counts[4], counts[3])
        return tuple(counts[:4]), counts[5].bool()

    def _draft(self, rows: Rows, host: Host, cache: RaggedCache, budget: torch.Tensor, policy: DepthPolicy,
               state: StepState, depth: int, stats: DecodeStats
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
        """Propose up to `depth` tokens per row, the policy stopping rows after each position; returns drafts [A, k]
        (k: the most any row keeps; a token no row keeps goes no further), p [A, k, V] (None when greedy), n_draft
        [A], and how many drafts the draft read."""
        logits, own = self._catch_up(rows, host, cache, stats)
        tokens, dists = [], []
        drafting = budget > 0
        stopped = False  # whether `keep` stopped rows this step: then who still drafts must be asked, even at a
        # position where it answers None (no decision: the rows drafting go on)
        n_draft, cum = torch.zeros_like(budget), torch.ones_like(logits[:, 0])
        for i in range(1, depth + 1):
            x_i, p_i = sampling.propose(logits, self.temperature, self.top_p, rows.seeds, rows.generated + i - 1)
            if self.draft_ids is not None:
                x_i = self.draft_ids[x_i]
            features = None
            if policy.reads_features:  # on a GPU, time the policy, not the draft forward its copies would wait for
                synchronize(self.device)
            with stats.deciding():  # the features are the policy's cost: decoding itself needs none
                if policy.reads_features:  # softmax statistics over the vocabulary: ~5x an argmax, so on demand
                    features = draft_features(logits, cum, i, state.rows, state.tokens)
                    cum = features[:, COLUMN["cum_top1"]]
                keep = policy.keep(features, x_i, state, i)
            drafting &= budget >= i
            if keep is not None:
                drafting &= torch.as_tensor(keep, device=self.device).bool()  # 0/1 longs failed in the &=
                stopped = True
            if stopped and not bool(drafting.any()):
                break  # no row keeps x_i: the target does not verify it
            n_draft += drafting
            tokens.append(x_i)
            dists.append(p_i)
            if i == depth or (stopped and not bool((drafting & (budget > i)).any())):
                break  # no row drafts x_{i+1}: the draft need not read x_i
            logits, own = self._read(self.draft, cache, rows, rows.length + i - 1, 1, torch.zeros_like(x_i)[:, None],
                                     host["length"].max() + i - 1, token=x_i, feat=own)
            logits = logits[:, 0]
            stats.draft_forwards += 1
        fed = i - 1  # the draft read x_1..x_{i-1} (x_i, last proposed, is read next step if kept)
        return *self._pack(tokens, dists, len(budget)), n_draft, fed

    def _catch_up(self, rows: Rows, host: Host, cache: RaggedCache, stats: DecodeStats
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft reads the committed tokens it has not read (long backlogs alone, the rest in one forward);
        returns its logits [A, V] for x_1 and its own last hidden state [A, 1, d] (a fusing draft reads it next)."""
        stats.draft_forwards += self._read_alone(self.draft, cache, rows, host, "d_len", stats)
        unseen = rows.length - rows.d_len  # [A] committed tokens the draft has not read (>= 1)
        width = int((host["length"] - host["d_len"]).max())
        logits, hidden = self._read(self.draft, cache, rows, rows.d_len, width, (unseen - 1)[:, None],
                                    host["d_len"].max())
        stats.draft_forwards += 1
        own = hidden.gather(1, (unseen - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))  # [A, 1, d]
        return logits[:, 0], own

    def _pack(self, tokens: list[torch.Tensor], dists: list[torch.Tensor | None], rows: int
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [A, k] and, when sampling, their distributions [A, k, V] over the target's ids, which the
        rejection rule compares with the target's; none when every row stopped at x_1."""
        if not tokens:
            return self._no_drafts(rows)
        if self.temperature == 0:
            return torch.stack(tokens, 1), None
        p = torch.stack(dists, 1)
        if self.draft_ids is not None:
            p = spread(p, self.draft_ids, self.vocab, 0.0)
        return torch.stack(tokens, 1), p

    def _no_drafts(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [rows, 0] and, when sampling, their distributions [rows, 0, V]: a step that verifies none."""
        drafts = torch.zeros(rows, 0, dtype=torch.long, device=self.device)
        return drafts, None if self.temperature == 0 else torch.zeros(rows, 0, self.vocab, device=self.device)

    def _verify(self, rows: Rows, host: Host, cache: RaggedCache, drafts: torch.Tensor, stats: DecodeStats
                ) -> torch.Tensor:
        """Target logits [A, k+1, V] at the last committed token and after each draft token."""
        stats.target_forwards += self._read_alone(self.target, cache, rows, host, "t_len", stats)
        k = drafts.shape[1]
        slots = rows.length[:, None] + torch.arange(k, device=self.device)
        rows.seq.scatter_(1, slots, drafts)  # tentative: past `length`, overwritten by the commit
        unseen = rows.length - rows.t_len  # [A] >= 1 (the whole prompt on the first step)
        width = int((host["length"] - host["t_len"]).max()) + k
        keep = (unseen - 1)[:, None] + torch.arange(k + 1, device=self.device)  # [A, k+1]
        logits, hidden = self._read(self.target, cache, rows, rows.t_len, width, keep, host["t_len"].max())
        self._store(rows, slice(None), rows.t_len, hidden)
        stats.target_forwards += 1
        if self.target_ids is not None:  # scores in the subset's order: back to token ids, -inf elsewhere
            logits = spread(logits, self.target_ids, self.vocab, float("-inf"))
        return logits

    def _read_alone(self, model: PreTrainedModel, cache: RaggedCache, rows: Rows, host: Host, seen: str,
                    stats: DecodeStats) -> int:
        """Rows with more than `solo_above` committed tokens `model` has not read read all but the last
        one in a forward of their own (no LM head), and are charged for exactly those tokens; returns the
        number of forwards. `seen` names the counter ("t_len" or "d_len") that advances, on device and host."""
        if rows.row_ids.numel() == 1:  # nothing to pad against
            return 0
        target = seen == "t_len"  # the role, not the object: one model may be both (the target as its own draft)
        done, flops = host[seen], self.t_flops if target else self.d_flops
        behind = (host["length"] - done - 1).tolist()
        alone = [b for b, n in enumerate(behind) if n >= self.solo_above]
        if alone and 1 - sum(behind) / (len(behind) * max(behind)) <= self.max_padding:
            return 0  # one padded pass reads every backlog, little of it padding
        for b in alone:
            start, n = int(done[b]), behind[b]
            row = slice(b, b + 1)
            feat = rows.feat[row, start : start + n] if not target and self.fuse else None
            _, hidden = forward(model, cache, rows.seq[row, start : start + n], getattr(rows, seen)[row], start + n,
                                rows.seq.new_zeros(1, 0), self.context - 1, rows=row, features=feat)
            if target:
                self._store(rows, row, getattr(rows, seen)[row], hidden)
            stats.later(self._account_read, stats, flops, start, n, target)
            done[b] += n
            getattr(rows, seen)[b] += n
        return len(alone)

    @staticmethod
    def _account_read(stats: DecodeStats, flops: FlopModel, start: int, n: int, plain: bool) -> None:
        """Charge a row's solo read of `n` tokens from `start` as useful (and, for the target, as plain decoding's).
        It runs no LM head: the row's last token is read, and scored, by the step's own forward."""
        starts, read = torch.tensor([start]), torch.tensor([n])
        stats.flops += flops.buckets(starts, n, start + n, read, read)
        if plain:
            stats.ar_flops += float(flops.prefix(starts, read).sum())

    def _read(self, model: PreTrainedModel, cache: RaggedCache, rows: Rows, starts: torch.Tensor, width: int,
              keep: torch.Tensor, max_start: torch.Tensor, token: torch.Tensor | None = None,
              feat: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward `width` tokens per row from `starts` (from rows.seq, or `token` [A] when given, which a fusing
        draft reads with `feat` [A, 1, d]); logits at chunk positions `keep` [A, K], hidden states [A, width, d]."""
        if token is None:
            index = (starts[:, None] + torch.arange(width, device=self.device)).clamp(max=rows.seq.shape[1] - 1)
            chunk = rows.seq.gather(1, index)
            if model is self.draft and self.fuse:
                feat = rows.feat.gather(1, index[:, :, None].expand(-1, -1, rows.feat.shape[-1]))
        else:
            chunk = token[:, None]
        return forward(model, cache, chunk, starts, int(max_start) + width, keep.clamp(max=width - 1), self.context - 1,
                       features=feat)

    def _store(self, rows: Rows, row: slice, starts: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep the target's hidden states [B, W, d] of a forward from `starts` [B] for a fusing draft (the
        state at position p is read with token p + 1). Slots past a row's valid tokens are overwritten by a
        later verify before the draft reads them; those past the buffer land in its last, unread slot."""
        if not rows.feat.numel():
            return
        feat = rows.feat[row]
        index = (starts[:, None] + 1 + torch.arange(hidden.shape[1], device=self.device)).clamp(max=feat.shape[1] - 1)
        feat.scatter_(1, index[:, :, None].expand(-1, -1, feat.shape[2]), hidden.to(feat.dtype))

    def _commit(self, rows: Rows, drafts: torch.Tensor, n_acc: torch.Tensor, token: torch.Tensor,
                n_draft: torch.Tensor, fed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each row's kept drafts + its next token, cut at EOS; roll caches back to what was kept."""
        k = drafts.shape[1]
        new = torch.cat([drafts, token[:, None]], 1).scatter_(1, n_acc[:, None], token[:, None])  # [A, k+1]
        j = torch.arange(k + 1, device=self.device)
        eos = torch.isin(new, self.eos) & (j <= n_acc[:, None])
        hit = eos.any(1)
        n_new = torch.where(hit, eos.long().argmax(1) + 1, n_acc + 1)  # [A] tokens committed
        rows.seq.scatter_(1, (rows.length[:, None] + j).clamp(max=rows.seq.shape[1] - 1), new)
        if fed is not None:  # the draft read every unseen committed token, then x_1..x_fed: those the target
            # kept stay valid, unless the draft fuses features: it read them with its own, and rereads them with
            # the target's
            rows.d_len = rows.length + (0 if self.fuse else n_acc.clamp(max=fed).minimum(n_draft))
        rows.t_len = rows.length + n_acc
        rows.length = rows.length + n_new
        rows.generated = rows.generated + n_new
        return hit | (rows.generated >= self.max_new_tokens), n_new

    def _account(self, stats: DecodeStats, old: Host, counts: tuple[torch.Tensor, ...], depth: int,
                 fed: int | None, capacity: int) -> None:
        """Charge this step's FLOPs to useful / rejected / padding, from host copies of the counters.

        `depth` draft tokens per row went to the target; `kept` counts the drafts whose slots produced a
        committed token (a read of EOS produces none), `accepted` the drafts committed (an EOS among them too);
        `fed` is None when the draft did not run. The LM heads run where `_draft` and `_verify` keep logits:
        each draft forward's last token per row, and the target's last committed token and every draft slot;
        plain decoding scores each of its tokens but the last. A draft head's row goes with the token it
        proposes (`FlopModel.proposals`): the proposal of x_1 that a policy looked at and did not send was thrown
        away, though the committed tokens read with it were kept. A forward scores at most the cache's
        `capacity` keys (`RaggedCache.begin`), however far past it a row read alone puts the longest start."""
        budget, n_draft, kept, accepted = counts
        length = old["length"]
        t_unseen = length - old["t_len"]
        t_width = int(t_unseen.max()) + depth
        stats.flops += self.t_flops.buckets(old["t_len"], t_width, min(int(old["t_len"].max()) + t_width, capacity),
                                            t_unseen + kept, t_unseen + n_draft, (t_unseen - 1, depth + 1))
        stats.ar_flops += float(self.t_flops.prefix(old["t_len"], t_unseen + kept, kept + 1).sum())
        if fed is None:
            return
        d_unseen = length - old["d_len"]
        d_width = int(d_unseen.max())
        d_end = min(int(old["d_len"].max()) + d_width, capacity)
        stats.flops += self.d_flops.buckets(old["d_len"], d_width, d_end, d_unseen, d_unseen)
        stats.flops += self.d_flops.proposals(budget > 0, accepted >= 1)
        for i in range(1, fed + 1):  # the draft read x_i: kept if the target accepted it, unless the draft fuses
            read = (n_draft >= i).long()  # features: it rereads every kept x_i with the target's (`_commit`)
            kept_i = read * (kept >= i) * (not self.fuse)
            stats.flops += self.d_flops.buckets(length + i - 1, 1, int(length.max()) + i, kept_i, read)
            # a row whose budget ended at x_i rode along in this read: its proposal of x_(i+1) is padding
            stats.flops += self.d_flops.proposals(read.bool() & (budget > i), accepted >= i + 1)

    def _retire(self, rows: Rows, host: Host, done: torch.Tensor, caches: tuple[RaggedCache, RaggedCache | None],
                outputs: list[list[int]]) -> Host:
        """Move finished rows' outputs out (`done` [A], on the host) and drop them from the batch and the caches."""
        if not bool(done.any()):
            return host
        finished = done.nonzero().flatten()
        seqs = rows.seq[finished.to(self.device)].cpu()  # one copy for every finished row
        for seq, r in zip(seqs, finished.tolist()):
            outputs[int(host["row_ids"][r])] = seq[int(host["prompt_len"][r]) : int(host["length"][r])].tolist()
        keep = (~done).nonzero().flatten()
        rows.select(keep.to(self.device))
        for cache in caches:
            if cache is not None:
                cache.select(keep.to(self.device))
        return {name: value[keep] for name, value in host.items()}
