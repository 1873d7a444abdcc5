"""Writing outputs that later runs trust by their existence: all or nothing, and only for the same settings.

Every stage skips work whose output exists, so a run killed mid-save must not leave a half-written
file or folder behind. One mechanism serves all of them: write at a temporary path beside the output,
then rename it into place (a rename within one file system is atomic). Beside each output lies the record
of the settings it was made with (`draft` -> `draft.settings.json`), including a digest of the records of
the outputs it was made from: a rerun with other settings, or after an upstream output was remade, stops
and names what changed instead of reusing it (a redistilled draft used to keep the old draft's profile,
rollouts and head).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from specpolicy.errors import SpecPolicyError

log = logging.getLogger("specpolicy")
# keys that say where outputs go or whether to resume, not what they hold
WHERE = frozenset({"out_dir", "default_root_dir", "dirpath", "cache_dir", "ckpt_path", "missing"})
# of a model source's settings, those that say how it runs here, not which model it is (`model_identity`)
RUNTIME = frozenset({"dtype", "device", "skinny_gemm"})
# of a Lightning Trainer's settings, those that change what it trains (not how it logs or validates)
TRAINING = frozenset({"max_steps", "max_epochs", "precision", "accumulate_grad_batches", "gradient_clip_val",
                      "gradient_clip_algorithm", "devices", "num_nodes", "strategy"})


@contextmanager
def atomic_path(out: str | Path) -> Iterator[Path]:
    """Yield a fresh path to write `out`'s file or folder at; on success it replaces `out` (a file, or an empty
    folder), on error `out` stays as it was and the temporary is removed. A folder that holds files is never
    replaced: it is not an output of ours (a stage reuses its complete ones), and a user's `paths.draft_dir` or
    `bench.out` naming a parent folder lost everything in it (the stages refuse such a path before their work)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        yield tmp / out.name
        check_replaceable(out)
        if out.is_dir():
            out.rmdir()
        os.replace(tmp / out.name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_replaceable(out: str | Path, setting: str | None = None, marker: str | None = None) -> None:
    """Refuse an output path that is a folder holding files, which writing the output would delete, unless it holds
    `marker`, the file a complete output of the stage holds (it is reused, not written); stages check before their
    work, `atomic_path` again before it replaces anything."""
    out = Path(out).expanduser()
    if marker is not None and (out / marker).exists():
        return
    if out.is_dir() and (inside := next(out.iterdir(), None)) is not None:
        key = f"{setting}=" if setting else ""
        fix = f"set {setting} to a new path" if setting else "write it elsewhere"
        raise SpecPolicyError(f"{key}{out} is a folder holding other files (e.g. {inside.name}), which writing "
                              f"{out.name} there would delete; {fix}, or empty it")


def written(stage: str, out: Path, made_with: dict[str, Any], marker: Path | None = None) -> bool:
    """Whether `stage` wrote `out` already (`marker`: the file it saves last, when not `out` itself) with the
    settings `made_with`; then the stage is skipped, and the log says how to rerun it. Written with other
    settings: a SpecPolicyError that names them (new settings alone do not replace what exists)."""
    if not (marker or out).exists():
        return False
    check_made_with(stage, out, made_with, f"delete it, or set another experiment_name, to run {stage} with these")
    log.info("%s: %s exists, skipping (delete it, or set another experiment_name, to run %s again)", stage, out, stage)
    return True


def record_path(out: Path) -> Path:
    """Where the settings `out` was made with are kept: beside it, `draft` -> `draft.settings.json`."""
    return out.with_name(f"{out.stem}.settings.json")


def settings(cfg: DictConfig, keys: list[str], made_from: list[Path] = ()) -> dict[str, Any]:
    """The settings an output depends on: the config's `keys` (dotted), resolved, without `WHERE` keys and with
    only the `TRAINING` keys of a trainer; plus, per upstream output in `made_from`, a digest of its record.
    Paths inside the experiment's folder are kept relative to it, so a moved checkpoints folder stays reusable."""
    home = OmegaConf.select(cfg, "paths.experiment_dir", default=None)
    found = {key: _relative(_what(OmegaConf.select(cfg, key, default=None), key), home) for key in keys}
    for out in made_from:
        record = record_path(out)
        found[f"from {out.name}"] = hashlib.sha256(record.read_bytes()).hexdigest()[:12] if record.exists() else None
    return found


def _what(node: Any, key: str) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        keep = TRAINING if key.split(".")[-1] == "trainer" else None
        found = {k: _what(v, k) for k, v in node.items() if k not in WHERE and (keep is None or k in keep)}
        if _loads_files(node.get("_target_")) and isinstance(node.get("path"), str):
            from specpolicy.models.loading import files_digest  # which imports this module
            found["files"] = files_digest(node["path"])  # a model saved again at the same path is another model
        return found
    return [_what(v, key) for v in node] if isinstance(node, list) else node


def _loads_files(target: Any) -> bool:
    """Whether a `_target_` is a `PretrainedSource`, or a subclass of it: its `path` holds the model's files."""
    from specpolicy.models.loading import PretrainedSource  # which imports this module

    module, _, name = str(target).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:  # instantiate names it, where the model loads
        return False
    return isinstance(found, type) and issubclass(found, PretrainedSource)


def _relative(tree: Any, home: str | None) -> Any:
    if isinstance(tree, dict):
        return {k: _relative(v, home) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_relative(v, home) for v in tree]
    if home and isinstance(tree, str) and Path(tree).is_relative_to(home):
        return f"<experiment>/{Path(tree).relative_to(home).as_posix()}"
    return tree


def model_identity(source: dict[str, Any]) -> dict[str, Any]:
    """A model source's recorded settings without the `RUNTIME` keys (a draft's also in its `source`): which model,
    not how it ran here."""
    return {k: model_identity(v) if k == "source" and isinstance(v, dict) else v
            for k, v in source.items() if k not in RUNTIME}


def identity(cfg: DictConfig, key: str) -> dict[str, Any]:
    """Which model `cfg.<key>` (a target or draft config) is, as an output's record names it."""
    return model_identity(settings(cfg, [key])[key])


def made_for(stage: str, out: Path, model: dict[str, Any], role: str = "target") -> str | None:
    """What differs between the model `out` was made for in `role` (its record's `target`, or `trained_draft`)
    and `model` (`model_identity`), as "key: old -> new; ..."; None when they agree, or no record says."""
    old = (read_record(stage, out) or {}).get(role)
    if not isinstance(old, dict):
        return None
    return _listed(_changes(_flat({role: model_identity(old)}), _flat({role: model}))) or None


def record(out: Path, made_with: dict[str, Any]) -> None:
    with atomic_path(record_path(out)) as tmp:
        tmp.write_text(json.dumps(made_with, indent=2, sort_keys=True))


def check_made_with(stage: str, out: Path, made_with: dict[str, Any], fix: str) -> None:
    """Refuse `out` if its record says it was made with other settings than `made_with`, naming them and `fix`.
    An output without a record (made before records were kept) is reused, with a warning."""
    old = read_record(stage, out)
    if old is None:
        log.warning("%s: %s has no record of the settings it was made with; reusing it as it is", stage, out)
        return
    if changed := _changed(old, made_with):
        raise SpecPolicyError(f"{stage}: {out} was made with other settings ({_listed(changed)}); {fix}")


def same_settings(stage: str, out: Path, made_with: dict[str, Any]) -> bool:
    """Whether `out` has a record of exactly `made_with`: partial work (a cache, a shard) is reused only then."""
    old = read_record(stage, out)
    return old is not None and not _changed(old, made_with)


def _changed(old: dict[str, Any], made_with: dict[str, Any]) -> list:
    return _changes(_flat(old), _flat(json.loads(json.dumps(made_with))))


def read_record(stage: str, out: Path) -> dict[str, Any] | None:
    """`out`'s settings record, None without one (made before records were kept)."""
    path = record_path(out)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:  # written whole by `record`: damaged by hand or by the disk
        raise SpecPolicyError(f"{stage}: the settings record {path} is damaged ({err}); delete it and {out} to "
                              f"remake {out.name}") from err


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """"key: old -> new" for each flat key of `new` that `old` lacks or holds otherwise. A key only `old` has is
    one the output no longer depends on (a record written by older code)."""
    return [_change(k, old.get(k, "(unset)"), new[k]) for k in sorted(new) if not _same(old.get(k), new[k])]


def _listed(changed: list[str]) -> str:
    more = f"; and {len(changed) - 4} more" if len(changed) > 4 else ""
    return "; ".join(changed[:4]) + more


def _same(old: Any, new: Any) -> bool:
    """Equal, or a path recorded absolute (before records kept them relative) that ends as `new` does: which
    output it names is settled by the upstream digest, `from <output>`."""
    if isinstance(new, str) and new.startswith("<experiment>/") and isinstance(old, str) and Path(old).is_absolute():
        return Path(old).parts[-len(Path(new).parts) + 1:] == Path(new).parts[1:]
    return old == new


def _change(key: str, old: Any, new: Any) -> str:
    if not key.startswith("from "):
        return f"{key}: {old} -> {new}"
    upstream = key.removeprefix("from ")
    if new is None:  # `settings` found no record beside it
        return f"{key}: the {upstream} it was made from has no settings record now"
    return f"{key}: the {upstream} it was made from was remade"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}, so a change is named by its dotted key."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}.{key}" if prefix else key).items()}
