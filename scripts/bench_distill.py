"""Benchmark the distil stage on the embedded pair: divergences x draft shapes, same data, one process.

    python scripts/bench_distill.py [bench.steps=60] ['bench.shapes=[layers,fresh]'] ['bench.losses=[forward_kl,tvd]']
                                    [any of train.py's overrides, for every variant]

Each variant is the real `distil` stage on `conf/bench_distill.yaml` (train.py's config with short-run settings)
plus its shape's overrides (`bench.drafts`) and its divergence (`distill/loss`); all share one cached dataset (the
target's responses to the train prompts, generated once). Validation prompts are held out. Prints a markdown
table and writes `bench.out`/distill.{json,md}, keeping the rows of earlier runs (a variant trained again replaces
its own row); with overrides, each run's folder name carries a hash of them, and its row lists them.
Not a test: it takes tens of minutes on a 2-core CPU.
"""

import json
import os
import shutil
from datetime import datetime
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from specpolicy.atomic import atomic_path
from specpolicy.cli import check_out_dir, entry
from specpolicy.distill.data import cache_key
from specpolicy.distill.stage import distil
from specpolicy.errors import SpecPolicyError, check_count

ROOT = Path(__file__).resolve().parents[1]
LOSSES = sorted(p.stem for p in (ROOT / "conf" / "distill" / "loss").glob("*.yaml"))  # one YAML per divergence
os.environ.setdefault("PROJECT_ROOT", str(ROOT))


def bench(cfg: DictConfig) -> None:
    b = cfg.bench
    steps = check_count("bench.steps", b.steps)
    for setting, known in (("shapes", list(b.drafts)), ("losses", LOSSES)):
        if not OmegaConf.is_list(b[setting]):  # bench.shapes=fresh: its letters were the shapes
            raise SpecPolicyError(f"bench.{setting} must be a list, e.g. 'bench.{setting}=[{b[setting]}]'")
        if unknown := [name for name in b[setting] if name not in known]:
            raise SpecPolicyError(f"bench.{setting}: {unknown} not among {known}")
    # what the user changed but the variants' names and where files go (a shape's own overrides, bench.drafts, too):
    # it names each run's folder and row
    task = list(HydraConfig.get().overrides.task)
    named = ("bench.steps", "bench.shapes", "bench.losses", "bench.out", "hydra.", "paths.")
    changed = [o for o in OverridesParser.create().parse_overrides(task) if not o.key_or_group.startswith(named)]
    for key, instead in (("trainer.max_steps", "bench.steps"), ("distill/loss", "bench.losses")):
        if any(o.key_or_group == key for o in changed):  # each run's folder and row are named after it
            raise SpecPolicyError(f"set {key} with {instead}: each run's folder and table row are named after it")
    extra = [o.input_line for o in changed]
    out, run_dir = Path(b.out), Path(b.out) / "runs"
    check_out_dir("bench.out", out)  # a file there was found by the first save, after the first training
    suffix = f"-{settings_key(changed)}" if changed else ""  # a run with another lr replaced the default run's folder
    variants = [(shape, loss, f"{shape}-{loss}-{steps}{suffix}") for shape in b.shapes for loss in b.losses]
    try:  # every variant's config before any training: a bad override is one line, not Hydra's traceback
        configs = [hydra.compose(config_name="bench_distill", overrides=[  # the user's overrides win but for paths
            *b.drafts[shape], f"distill/loss={loss}", f"trainer.max_steps={steps}", *task,
            f"paths.checkpoints_dir={run_dir}", f"experiment_name={name}", f"paths.cache_dir={cfg.paths.cache_dir}"])
            for shape, loss, name in variants]
    except HydraException as err:
        raise SpecPolicyError(" ".join(str(err).split())) from err
    rows = _earlier_rows(out / "distill.json", {name for *_, name in variants})
    for (shape, loss, name), variant in zip(variants, configs):
        shutil.rmtree(run_dir / name, ignore_errors=True)  # fresh training, shared data cache
        distil(variant)
        metrics = json.loads((run_dir / name / "draft" / "metrics.json").read_text())
        rows.append({"run": name, "draft": shape, "loss": loss, **_row(metrics), "overrides": extra,
                     "date": datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__})
        _write(out, rows)
    print(_markdown(rows))


def settings_key(overrides: list[Override]) -> str:
    """A short hash of `overrides` as Hydra parsed them: `lr=1e-3` typed in a run and `lr=0.001` as a multirun
    passes it on name one run (their text made two rows for one setting)."""
    return cache_key({"overrides": [[o.type.name, o.key_or_group, o.package, repr(o.value())] for o in overrides]})[:8]


def _earlier_rows(path: Path, rerun: set[str]) -> list[dict]:
    """The rows earlier runs wrote, but those this run trains again: each run replaced the whole table, so the
    README's table, from four commands, was in no file."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or not a table this script wrote
        return []
    return [r for r in rows if isinstance(r, dict) and r.get("run") not in rerun] if isinstance(rows, list) else []


def _row(m: dict) -> dict:
    return {"draft_vocab": m.get("draft_vocab") or "all", "agreement_before": m["before"]["agreement"],
            "agreement_after": m["after"]["agreement"],
            "acceptance_before": m["before"]["expected_acceptance"],
            "acceptance_after": m["after"]["expected_acceptance"], "c_flops": m["cost"]["flops_ratio"],
            "c_latency": m["cost"]["latency_ratio"], "train_s": m["train_seconds"], "steps": m["steps"]}


def _markdown(rows: list[dict]) -> str:
    head = ("| draft | head vocab | loss | agreement before → after | expected acceptance before → after | c (FLOPs) "
            "| c (latency) | steps | train time | overrides |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['draft']} | {r['draft_vocab']} | {r['loss']} "
             f"| {r['agreement_before']:.3f} → {r['agreement_after']:.3f} "
             f"| {r['acceptance_before']:.3f} → {r['acceptance_after']:.3f} | {r['c_flops']:.3f} "
             f"| {r['c_latency']:.3f} | {r['steps']} | {r['train_s'] / 60:.1f} min "
             f"| {' '.join(r.get('overrides') or []) or '–'} |" for r in rows]
    return "\n".join([head, *lines])


def _write(out: Path, rows: list[dict]) -> None:
    """Both files whole or not at all: a kill mid-write leaves the previous ones."""
    for name, text in (("distill.json", json.dumps(rows, indent=2)), ("distill.md", _markdown(rows) + "\n")):
        with atomic_path(out / name) as tmp:
            tmp.write_text(text)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_distill")
def main(cfg: DictConfig) -> None:
    entry(bench, cfg)  # a bad setting (bench.steps=0, a bad override) is one line, as in the pipeline's scripts


if __name__ == "__main__":
    main()
