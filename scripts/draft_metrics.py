"""Held-out metrics of a saved draft, as the distil stage measures them:

    python scripts/draft_metrics.py experiment=smollm2_135m_long [overrides]
    python scripts/draft_metrics.py draft@trained_draft=pretrained trained_draft.source.path=DIR_OR_HUB_ID

Greedy agreement and expected acceptance of `trained_draft` (the experiment's distilled draft by default)
on the validation prompts (what distillation settings are chosen on) and the test prompts (what evaluate
decodes; never tuned on). Needs no training data. Prints JSON and writes it to
`checkpoints/<experiment>/draft_held_out.json`.
"""

import json
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specpolicy.atomic import atomic_path
from specpolicy.cli import entry
from specpolicy.distill.stage import held_out_metrics

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[1]))


def report(cfg: DictConfig) -> None:
    text = json.dumps(held_out_metrics(cfg), indent=2)
    print(text)
    with atomic_path(Path(cfg.paths.experiment_dir) / "draft_held_out.json") as tmp:
        tmp.write_text(text)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    entry(report, cfg)


if __name__ == "__main__":
    main()
