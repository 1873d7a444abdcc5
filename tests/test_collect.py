"""Collect: rollouts from prompts the draft was not distilled on (when enough are left), resumed shard by
shard; the head stage starts from their acceptance."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from lightning.pytorch import Callback
from omegaconf import OmegaConf

from specpolicy.atomic import record, record_path
from specpolicy.data import TRAINED_ON, PromptSource, digests_text, trained_on
from specpolicy.errors import SpecPolicyError
from specpolicy.stages import _not_evaluated, _unseen_by_draft


def _cfg(train_prompts: int | None):
    return OmegaConf.create({"distill": {"data": {"train_prompts": train_prompts}},
                             "collect": {"batch_sizes": [1, 4], "min_prompts_per_size": 3}})


def test_collect_skips_the_distillation_prompts():
    assert _unseen_by_draft(_cfg(6), list(range(10))) == [6, 7, 8, 9]


def test_collect_reuses_distillation_prompts_with_a_warning_when_too_few_are_left(caplog):
    with caplog.at_level(logging.WARNING, logger="specpolicy"):
        assert _unseen_by_draft(_cfg(7), list(range(10))) == list(range(10))
        assert _unseen_by_draft(_cfg(None), list(range(10))) == list(range(10))
    assert caplog.text.count("the rollouts reuse distillation prompts") == 2


def test_collect_skips_what_the_draft_s_folder_lists_whatever_the_count_says(tmp_path, caplog):
    """A draft made elsewhere, or distilled with another distill.data.train_prompts: its folder's list decides (the
    count skipped the first 6 rows here, and the rollouts came from the 4 prompts the draft had trained on)."""
    (tmp_path / TRAINED_ON).write_text(digests_text([6, 7, 8, 9]))
    cfg = OmegaConf.merge(_cfg(6), {"trained_draft": {"source": {"path": str(tmp_path)}}})
    assert _unseen_by_draft(cfg, list(range(10))) == [0, 1, 2, 3, 4, 5]
    (tmp_path / TRAINED_ON).write_text(digests_text(list(range(3, 10))))
    with caplog.at_level(logging.WARNING, logger="specpolicy"):
        assert _unseen_by_draft(cfg, list(range(10))) == list(range(10))  # 3 left: too few for batches of 4
    assert f"after the 7 that {tmp_path} lists" in caplog.text
    (tmp_path / TRAINED_ON).write_text(digests_text([0, 1, 3, 4, 5]))  # distil skipped 2 as too long
    assert _unseen_by_draft(cfg, list(range(10))) == [6, 7, 8, 9, 2]  # a typical prompt first


def test_collect_counts_whole_batches_when_it_picks_its_prompts():
    """Batches of 3 with at least 4 prompts decode 6: 5 unseen prompts are too few (they were taken as enough, and
    the bs3 rollouts then held a batch of 2)."""
    cfg = OmegaConf.create({"distill": {"data": {"train_prompts": 5}},
                            "collect": {"batch_sizes": [3], "min_prompts_per_size": 4}})
    assert _unseen_by_draft(cfg, list(range(10))) == list(range(10))
    assert _unseen_by_draft(cfg, list(range(11))) == [5, 6, 7, 8, 9, 10]


def test_collect_never_decodes_the_evaluation_prompts(tmp_path, caplog):
    """A train row that is also a test row is left out; a file without splits (every row is every split) is
    refused, as distillation refuses it, rather than training the head on the evaluation's sequences."""
    def data(rows: list[dict]):
        (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return OmegaConf.create({"data": {"_target_": "specpolicy.data.PromptSource", "split": "test",
                                          "prompts_file": str(tmp_path / "p.jsonl")}})

    rows = [{"prompt": p, "split": s} for p, s in (("a", "train"), ("b", "train"), ("b", "test"), ("c", "test"))]
    cfg = data(rows)
    from hydra.utils import instantiate

    train = instantiate(cfg.data, split="train").load()
    with caplog.at_level(logging.WARNING, logger="specpolicy"):
        assert _not_evaluated(cfg, train, warn=False) == train[:1]
    assert not caplog.text  # check_collect, before the stages run: the stage itself says it, once
    with caplog.at_level(logging.WARNING, logger="specpolicy"):
        assert _not_evaluated(cfg, train) == train[:1]
    assert "1 of 2 rollout prompts are evaluation prompts" in caplog.text
    cfg = data([{"prompt": p} for p in "abc"])
    with pytest.raises(SpecPolicyError, match="every rollout prompt is also an evaluation prompt"):
        _not_evaluated(cfg, instantiate(cfg.data, split="train").load())


class LastCheckpointAtEpoch1(Callback):
    """Whether the head's last.ckpt existed when its second epoch began (a killed run resumes from it)."""
    seen: list[bool] = []

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            LastCheckpointAtEpoch1.seen.append((self.dirpath / "last.ckpt").exists())


def test_collect_resumes_at_the_missing_shard_and_the_head_starts_from_its_acceptance(tmp_path, monkeypatch):
    """An interrupted collection keeps the shards it finished (a marked bs1 shard survives into the rollouts)
    and decodes only the missing ones, unless they were decoded with other settings (then a changed collect.k
    was recorded over the old k's rows); the head's prior is the rollouts' acceptance at draft position 1, and a
    killed head training has a checkpoint to resume from after each epoch (Lightning wrote last.ckpt only at the
    end)."""
    import datasets
    import torch

    from compose import compose_config
    from specpolicy import stages
    from specpolicy.pipeline import train
    from specpolicy.rollout.collect import COLUMNS

    cfg = compose_config("train", ["experiment=tiny", "debug=fast", "stages=[distil]"], tmp_path)
    train(cfg)  # collect decodes with the distilled draft
    marked = torch.zeros(2, len(COLUMNS))
    marked[:, COLUMNS.index("group")] = 999
    marked[:, COLUMNS.index("position")] = 1
    marked[:, COLUMNS.index("accepted")] = torch.tensor([1.0, 0.0])
    shards, out = tmp_path / "tiny" / "rollouts_shards", tmp_path / "tiny" / "rollouts"
    for made_with, kept in (({"collect": {"k": 99}}, 0), (stages.collect_settings(cfg), 2)):
        stages._dataset(marked).save_to_disk(str(shards / "bs1"))
        record(shards, made_with)
        shutil.rmtree(out, ignore_errors=True)
        stages.collect(cfg)
        rollouts = datasets.load_from_disk(str(out)).with_format("torch")[:]
        assert int((rollouts["group"] == 999).sum()) == kept  # bs1: the shard on disk, not decoded again
    assert set(rollouts["batch_size"].tolist()) == {0.0, 4.0}  # bs4 decoded now (the marked rows say 0)
    assert not shards.exists() and not record_path(shards).exists()
    checkpoints = cfg.head.trainer.callbacks[0].dirpath
    cfg.head.trainer.callbacks.append({"_target_": f"{__name__}.LastCheckpointAtEpoch1", "dirpath": checkpoints})
    with monkeypatch.context() as patched:  # killed as it records its settings: it saved the head before that
        patched.setattr(stages, "record", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            stages.head(cfg)
    assert not (tmp_path / "tiny" / "head" / "head.pt").exists()  # else reused, whatever settings made it
    assert LastCheckpointAtEpoch1.seen == [True]
    stages.head(cfg)  # resumed from the finished training's last.ckpt
    assert (tmp_path / "tiny" / "head" / TRAINED_ON).read_text() == (tmp_path / "tiny" / "rollouts" / TRAINED_ON
                                                                      ).read_text()  # what evaluate checks
    made_for = {k: json.loads((tmp_path / "tiny" / "rollouts.settings.json").read_text())[k]
                for k in ("target", "trained_draft", "engine")}  # what evaluate compares with what it scores
    assert made_for.items() <= json.loads((tmp_path / "tiny" / "head.settings.json").read_text()).items()
    first = rollouts["position"] == 1
    config = json.loads((tmp_path / "tiny" / "head" / "config.json").read_text())
    assert config["prior"] == pytest.approx(float(rollouts["accepted"][first].float().mean()))
    assert config["positions"] == int(rollouts["position"].max())  # the deepest the learned policy may go
    (tmp_path / "tiny" / "head" / "head.pt").unlink()  # as if cut short: its last.ckpt stays
    wider = compose_config("train", ["experiment=tiny", "debug=fast", "head.hidden=16", "head.ckpt_path=last"],
                           tmp_path)
    with pytest.raises(SpecPolicyError, match=r"head: .*checkpoints was made with other settings \(head.hidden: 8 "
                                              r"-> 16\); delete .*checkpoints to start over"):
        stages.head(wider)  # it resumed the 8-unit head's checkpoint into a 16-unit one: a Lightning traceback


def test_collect_with_fewer_prompts_than_it_asks_for_decodes_those_there_are(tmp_path, caplog):
    """3 train prompts: batch 4 cannot be filled (left out, by name), batch 1 decodes the 3 (min_prompts_per_size
    asked for 4: the engine got an empty batch and stopped in "every prompt needs at least one token")."""
    import datasets

    from compose import compose_config
    from specpolicy import stages

    rows = [{"prompt": f"Say {w}.", "split": "train"} for w in "abc"] + [{"prompt": "Say d.", "split": "test"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    layers = ["trained_draft._target_=specpolicy.models.draft.LayerSubsetDraft", "~trained_draft.source",
              "+trained_draft.layers=[0,-1]"]  # an undistilled draft: no distil stage to run first
    cfg = compose_config("train", ["experiment=tiny", "debug=fast", *layers,
                                   f"data.prompts_file={tmp_path / 'p.jsonl'}", "distill.data.train_prompts=null"],
                         tmp_path)
    with caplog.at_level(logging.WARNING, logger="specpolicy"):
        stages.collect(cfg)
    assert "collect.batch_sizes [4] exceed the 3 prompts to decode and are left out" in caplog.text
    rollouts = datasets.load_from_disk(str(tmp_path / "tiny" / "rollouts")).with_format("torch")[:]
    assert set(rollouts["batch_size"].tolist()) == {1.0} and len(set(rollouts["group"].tolist())) == 3
    every = PromptSource(prompts_file=str(tmp_path / "p.jsonl"), split="all").load()
    assert trained_on(tmp_path / "tiny" / "rollouts", every) == [0, 1, 2]  # the decoded ones, for the head's folder


def test_a_batch_size_past_every_prompt_does_not_send_collect_to_the_distillation_prompts(tmp_path, caplog):
    """`collect.batch_sizes=[1,4,512]`: 512 counted towards the prompts needed, so every batch size decoded the
    prompts the draft was distilled on, though 6 unseen ones covered what ran (512 is left out anyway)."""
    from compose import compose_config
    from specpolicy import stages

    rows = [{"prompt": f"Say {i}.", "split": "train"} for i in range(10)] + [{"prompt": "Say x.", "split": "test"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    layers = ["trained_draft._target_=specpolicy.models.draft.LayerSubsetDraft", "~trained_draft.source",
              "+trained_draft.layers=[0,-1]"]
    cfg = compose_config("train", ["experiment=tiny", "debug=fast", *layers, f"data.prompts_file={tmp_path}/p.jsonl",
                                   "distill.data.train_prompts=4", "collect.batch_sizes=[1,4,512]"], tmp_path)
    with caplog.at_level(logging.WARNING, logger="specpolicy"):
        stages.collect(cfg)
    assert "reuse distillation prompts" not in caplog.text
    every = PromptSource(prompts_file=str(tmp_path / "p.jsonl"), split="train").load()
    assert trained_on(tmp_path / "tiny" / "rollouts", every) == [4, 5, 6, 7]  # after the 4 distilled on


def test_rollouts_of_one_prompt_are_refused_by_the_head_stage(tmp_path):
    """Validation takes whole prompts: one prompt left the training set empty, and Lightning stopped in
    "num_samples should be a positive integer value, but got num_samples=0"."""
    import torch

    from compose import compose_config
    from specpolicy import stages
    from specpolicy.errors import SpecPolicyError
    from specpolicy.rollout.collect import COLUMNS

    records = torch.rand(6, len(COLUMNS))
    records[:, COLUMNS.index("group")] = 3
    stages._dataset(records).save_to_disk(str(tmp_path / "tiny" / "rollouts"))
    cfg = compose_config("train", ["experiment=tiny", "debug=fast"], tmp_path)
    with pytest.raises(SpecPolicyError, match=r"come from 1 prompt\(s\); the head needs 2 or more"):
        stages.head(cfg)
    assert not (tmp_path / "tiny" / "head").exists()
