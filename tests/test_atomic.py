"""Outputs that reruns trust by existence are written all or nothing, and trusted only for the settings
they were made with."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from specpolicy.atomic import (atomic_path, check_replaceable, made_for, model_identity, read_record, record,
                               record_path, settings, written)
from specpolicy.cli import resumable
from specpolicy.errors import SpecPolicyError
from specpolicy.models import PretrainedSource


def test_a_file_or_an_empty_folder_is_replaced_and_a_folder_of_files_never(tmp_path: Path) -> None:
    """A stage reuses its complete outputs, so a folder of files in the way is not one of ours: `paths.draft_dir`
    or `bench.out` naming a parent folder lost everything in it."""
    with atomic_path(tmp_path / "deep" / "a.json") as tmp:
        tmp.write_text("new")
    with atomic_path(tmp_path / "deep" / "a.json") as tmp:
        tmp.write_text("newer")
    assert (tmp_path / "deep" / "a.json").read_text() == "newer"

    folder = tmp_path / "folder"
    folder.mkdir()
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        (tmp / "fresh.txt").write_text("new")
    assert [p.name for p in folder.iterdir()] == ["fresh.txt"]
    with pytest.raises(SpecPolicyError, match=r"^/.*/folder is a folder holding other files \(e.g. fresh.txt\), which "
                                              r"writing folder there would delete; write it elsewhere, or empty it"):
        with atomic_path(folder) as tmp:
            tmp.write_text("a file over the folder")
    assert [p.name for p in folder.iterdir()] == ["fresh.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "folder"]  # no temporaries left
    check_replaceable(folder, "paths.draft_dir", marker="fresh.txt")  # a complete output: reused, not written


def test_a_failed_write_leaves_the_old_output_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "data"
    out.mkdir()
    (out / "rows").write_text("complete")
    with pytest.raises(KeyboardInterrupt), atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "rows").write_text("half")
        raise KeyboardInterrupt  # killed mid-save
    assert (out / "rows").read_text() == "complete"
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_an_output_is_reused_only_with_the_settings_it_was_made_with(tmp_path: Path) -> None:
    """Where outputs go and how a trainer logs are not what they hold; a changed setting or a remade upstream
    output stops the rerun and is named."""
    cfg = OmegaConf.create({"head": {"hidden": 32, "out_dir": str(tmp_path / "a"),
                                     "trainer": {"max_epochs": 20, "log_every_n_steps": 5}}, "seed": 0})
    upstream, out = tmp_path / "rollouts", tmp_path / "head"
    record(upstream, {"k": 6})
    made_with = settings(cfg, ["head", "seed"], [upstream])
    assert made_with["head"] == {"hidden": 32, "trainer": {"max_epochs": 20}}
    assert not written("head", out, made_with)
    out.mkdir()
    record(out, made_with)
    moved = OmegaConf.merge(cfg, {"head": {"out_dir": str(tmp_path / "b"), "trainer": {"log_every_n_steps": 50}}})
    assert written("head", out, settings(moved, ["head", "seed"], [upstream]))
    wider = OmegaConf.merge(cfg, {"head": {"hidden": 64}})
    with pytest.raises(SpecPolicyError, match=r"^head: .* was made with other settings \(head.hidden: 32 -> 64\); "
                                              r"delete it"):
        written("head", out, settings(wider, ["head", "seed"], [upstream]))
    record(upstream, {"k": 8})
    with pytest.raises(SpecPolicyError, match=r"\(from rollouts: the rollouts it was made from was remade\)"):
        written("head", out, settings(cfg, ["head", "seed"], [upstream]))
    record_path(upstream).unlink()  # it was not remade: its record is gone
    with pytest.raises(SpecPolicyError, match=r"\(from rollouts: the rollouts it was made from has no settings record"):
        written("head", out, settings(cfg, ["head", "seed"], [upstream]))
    record_path(out).write_text("garbage")  # a JSONDecodeError traceback
    with pytest.raises(SpecPolicyError, match=r"^head: the settings record .*head.settings.json is damaged .*; delete "
                                              r"it and .*head to remake head$"):
        written("head", out, made_with)


def test_a_moved_experiment_folder_keeps_its_outputs_reusable(tmp_path: Path) -> None:
    """The draft a profile was made with is recorded by where it lies in the experiment, not on this disk."""
    def made_with(home: Path) -> dict:
        cfg = OmegaConf.create({"paths": {"experiment_dir": str(home)},
                                "trained_draft": {"source": {"path": str(home / "draft")}},
                                "target": {"path": "/models/other/draft"}})
        return settings(cfg, ["trained_draft", "target"])

    assert made_with(tmp_path / "a") == made_with(tmp_path / "b")
    assert made_with(tmp_path / "a")["trained_draft"] == {"source": {"path": "<experiment>/draft"}}
    assert made_with(tmp_path / "a")["target"] == {"path": "/models/other/draft"}
    out = tmp_path / "b" / "profile"  # recorded before paths were kept relative: absolute, the same draft
    record(out, {**made_with(tmp_path / "b"), "trained_draft": {"source": {"path": str(tmp_path / "b" / "draft")}}})
    out.mkdir()
    assert written("profile", out, made_with(tmp_path / "b"))


def test_a_setting_only_an_old_record_has_is_no_longer_depended_on(tmp_path: Path) -> None:
    """Drafts recorded the target's dtype, which distillation never used: a bf16 rerun refused its own draft. A key
    the new settings lack is one the output does not depend on any more; a key they add still counts."""
    out = tmp_path / "draft"
    out.mkdir()
    record(out, {"target": {"path": "m", "dtype": "float32"}, "seed": 0})
    assert written("distil", out, {"target": {"path": "m"}, "seed": 0})
    with pytest.raises(SpecPolicyError, match=r"\(data.prompt_field: \(unset\) -> prompt\)"):
        written("distil", out, {"target": {"path": "m"}, "seed": 0, "data.prompt_field": "prompt"})


def test_what_an_output_was_made_for_is_read_from_its_record(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert made_for("evaluate", out, {"path": "a"}) is None  # no record: nothing to say
    record(out, {"target": {"path": "a", "dtype": "float32", "device": "auto", "skinny_gemm": True}})
    assert model_identity({"path": "a", "dtype": "bfloat16", "device": "cpu"}) == {"path": "a"}
    assert made_for("evaluate", out, {"path": "a"}) is None  # how it ran is not which model it is
    assert made_for("evaluate", out, {"path": "b"}) == "target.path: a -> b"


def test_a_model_saved_again_at_the_same_path_is_another_model(tmp_path: Path) -> None:
    """Outputs were reused for a target retrained into the same folder: its files are part of the settings."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64}')
    (folder / "model.safetensors").write_bytes(bytes(3 << 20))  # past the sampled ends
    cfg = OmegaConf.create({"target": {"_target_": "specpolicy.models.PretrainedSource", "path": str(folder)}})
    made_with = settings(cfg, ["target"])
    assert made_with["target"]["files"] is not None
    out = tmp_path / "profile.json"
    record(out, made_with)
    out.write_text("{}")
    assert written("profile", out, settings(cfg, ["target"]))
    (folder / "model.safetensors").write_bytes(bytes(3 << 20)[:-1] + b"\x01")  # retrained: its last bytes differ
    with pytest.raises(SpecPolicyError, match=r"other settings \(target.files: \w+ -> \w+\)"):
        written("profile", out, settings(cfg, ["target"]))
    hub = OmegaConf.create({"target": {"_target_": "specpolicy.models.PretrainedSource", "path": "owner/model"}})
    assert settings(hub, ["target"])["target"]["files"] is None  # a hub id: its revision is the hub's to keep
    own = OmegaConf.create({"target": {"_target_": f"{__name__}.OwnSource", "path": str(folder)}})
    assert settings(own, ["target"])["target"]["files"] == settings(cfg, ["target"])["target"]["files"]


class OwnSource(PretrainedSource):
    """A user's own source (its name no longer ends in PretrainedSource): its files count as well."""


def test_a_run_that_starts_over_deletes_the_checkpoints_its_record_would_vouch_for(tmp_path: Path) -> None:
    """A run with distill.ckpt_path=null recorded its settings beside the last run's last.ckpt; killed before its
    own first save, it left that checkpoint under its record, and the next run resumed the old training as the new
    one. A run that does not resume now deletes the last*.ckpt that "last" would resume; a file it starts from,
    and other files in the folder, are kept."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    trainer = SimpleNamespace(checkpoint_callback=SimpleNamespace(dirpath=str(folder)), is_global_zero=True)
    old, new = {"lr": 3e-4}, {"lr": 1e-3}
    record(folder, old)
    torch.save({"run": "old"}, folder / "last.ckpt")
    resumable("distil", trainer, None, new)
    assert not (folder / "last.ckpt").exists() and read_record("distil", folder) == new
    torch.save({"run": "new"}, folder / "last.ckpt")
    resumable("distil", trainer, "last", new)  # settings the same: resumed, kept
    assert (folder / "last.ckpt").exists()
    with pytest.raises(SpecPolicyError, match=r"made with other settings \(lr: 0.001 -> 0.0003\)"):
        resumable("distil", trainer, "last", old)
    torch.save({"run": "elsewhere"}, folder / "start.ckpt")
    torch.save({"run": "older"}, folder / "last-v1.ckpt")  # Lightning's name when last.ckpt was taken
    resumable("distil", trainer, str(folder / "start.ckpt"), old)
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["start.ckpt"]
    torch.save({"run": "mine"}, folder / "mine.ckpt")  # a user's file where the checkpoints go is not ours
    resumable("distil", trainer, None, new)
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["mine.ckpt", "start.ckpt"]
