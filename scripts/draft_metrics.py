"""Held-out metrics of a saved draft, as the distil stage measures them, and as the engine decodes with it:

    python scripts/draft_metrics.py experiment=smollm2_135m_long [overrides]
    python scripts/draft_metrics.py draft@trained_draft=pretrained trained_draft.source.path=DIR_OR_HUB_ID
    python scripts/draft_metrics.py experiment=... decode_depth=6 engine.max_new_tokens=64

Greedy agreement and expected acceptance of `trained_draft` (the experiment's distilled draft by default)
on the validation prompts (what distillation settings are chosen on) and the test prompts (what evaluate
decodes; never tuned on). Agreement scores a draft's first token after the target's context only; past
it a draft reads its own guesses (a fusing draft its own hidden states too), so under "decoded" the
engine decodes the validation prompts greedily at static depth `decode_depth` (in batches of
`decode_batch_size`; conf/draft_metrics.yaml) and reports the acceptance at each draft position. Needs no
training data. Prints JSON and writes it to `checkpoints/<experiment>/draft_held_out.json`.
"""

import json
import os
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from specpolicy.atomic import atomic_path
from specpolicy.cli import entry, per_job
from specpolicy.data import encode_prompts
from specpolicy.decode.engine import check_settings
from specpolicy.decode.stats import DecodeStats
from specpolicy.distill.stage import held_out_metrics
from specpolicy.errors import check_count
from specpolicy.models import LoadedModel
from specpolicy.policy import StaticPolicy
from specpolicy.stages import load_pair

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[1]))


def decoded(cfg: DictConfig, target: LoadedModel, draft: LoadedModel, depth: int, batch_size: int) -> dict:
    """Acceptance by draft position when the engine decodes the validation prompts at static depth `depth`."""
    engine = instantiate(cfg.engine, temperature=0.0)(target.model, draft.model)  # greedy, whatever engine says
    conversations = instantiate(cfg.data, split="validation", limit=cfg.distill.data.val_prompts).load()
    prompts = encode_prompts(target.tokenizer, conversations, target.context_length, reserve=engine.max_new_tokens)
    total = DecodeStats.total([engine.generate(prompts[i : i + batch_size], StaticPolicy(k=depth)).stats
                               for i in range(0, len(prompts), batch_size)])
    return {"depth": depth, "dtype": str(target.model.dtype).removeprefix("torch."),  # float32, as distil measures
            "prompts": len(prompts), "max_new_tokens": engine.max_new_tokens,
            "mean_accepted": total.mean_accepted,  # tau: per row and verify step
            **{name: getattr(total, name).tolist() for name in ("drafted_at", "reached_at", "accepted_at")},
            # P(position i accepted | the draft proposed it and the target kept positions 1..i-1); null: never reached
            "conditional_at": [round(a / r, 4) if r else None for a, r in zip(total.accepted_at.tolist(),
                                                                              total.reached_at.tolist())]}


def report(cfg: DictConfig) -> None:
    check_settings(cfg.engine)
    depth = check_count("decode_depth", cfg.decode_depth)  # before the held-out metrics; 0 decodes no drafts
    batch_size = check_count("decode_batch_size", cfg.decode_batch_size)
    target, draft = load_pair(cfg, cfg.trained_draft, "float32")  # as distil measures its drafts
    metrics = {**held_out_metrics(cfg, target, draft), "decoded": decoded(cfg, target, draft, depth, batch_size)}
    text = json.dumps(metrics, indent=2)
    print(text)
    with atomic_path(per_job(cfg.paths.experiment_dir) / "draft_held_out.json") as tmp:
        tmp.write_text(text)


@hydra.main(version_base="1.3", config_path="../conf", config_name="draft_metrics")
def main(cfg: DictConfig) -> None:
    entry(report, cfg)


if __name__ == "__main__":
    main()
