"""Benchmark the distil stage on the embedded pair: divergences x draft shapes, same data, one process.

    python scripts/bench_distill.py [override ...] [--steps 60] [--shapes ...] [--losses ...] [--out DIR]

Each variant is the real `distil` stage on `experiment=smollm2_135m` plus a few Hydra overrides; all
share one cached dataset (the target's responses to the train prompts, generated once). Validation
prompts are held out. Prints a markdown table and writes checkpoints/bench/distill.{json,md}, keeping the rows
of earlier runs (a variant trained again replaces its own row); with overrides, each run's folder name carries
a hash of them, and its row lists them.
Not a test: it takes tens of minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from datetime import datetime
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from specpolicy.atomic import atomic_path
from specpolicy.cli import check_out_dir, entry
from specpolicy.distill.data import cache_key
from specpolicy.distill.stage import distil
from specpolicy.errors import SpecPolicyError, check_count

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "layers[0,1,2,-1]": ["draft=layers", "draft.layers=[0,1,2,-1]"],
    "fresh 4x256": ["draft=fresh", "draft.num_hidden_layers=4", "draft.hidden_size=256",
                    "draft.num_attention_heads=4", "draft.num_key_value_heads=2"],
}
LOSSES = ["forward_kl", "tvd"]
LOSS_DIR = ROOT / "conf" / "distill" / "loss"  # one YAML per divergence
COMMON = [  # short runs sized for a shared 2-core CPU; see the README for what longer runs would change
    "experiment=smollm2_135m", "logger=none", "runtime.device=cpu", "callbacks.progress_bar=null",
    "callbacks.lr_monitor=null", "trainer.enable_progress_bar=false", "trainer.check_val_every_n_epoch=null",
    "trainer.val_check_interval=1000000", "trainer.log_every_n_steps=5",
    "distill.data.train_prompts=128", "distill.data.val_prompts=32", "distill.data.max_new_tokens=64",
    "distill.data.top_k=32", "distill.data.batch_size=32", "distill.max_length=192", "distill.batch_size=4",
    "distill.freeze_embeddings=true", "distill.optimizer.lr=5e-4", "distill.scheduler.num_warmup_steps=5",
    "distill.draft_vocab=null",  # the full head, as the README's table was measured (the demo now sets 8192)
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="training steps of every variant (default: 60)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="draft shapes to distil (default: all)")
    parser.add_argument("--losses", nargs="+", default=LOSSES, choices=sorted(p.stem for p in LOSS_DIR.glob("*.yaml")),
                        help=f"divergences, from conf/distill/loss/ (default: {' '.join(LOSSES)})")
    parser.add_argument("--out", default=str(ROOT / "checkpoints" / "bench"),
                        help="folder for distill.json, distill.md and runs/ (default: checkpoints/bench)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every variant, before the flags")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    entry(bench, args)  # a bad setting (--steps 0, a bad override) is one line, as in the pipeline's scripts


def bench(args: argparse.Namespace) -> None:
    check_count("--steps", args.steps)
    if any(o.lstrip("+~").split("=")[0] == "trainer.max_steps" for o in args.overrides):  # named runs a step count
        raise SpecPolicyError("set the training steps with --steps, not trainer.max_steps (each run's folder and "
                              "table row are named after --steps)")
    out, run_dir = Path(args.out), Path(args.out) / "runs"
    check_out_dir("--out", out)  # a file there was found by the first save, after the first training
    # the overrides name the folder too: a run with another learning rate replaced the default run's folder
    extra = f"-{cache_key(args.overrides)[:8]}" if args.overrides else ""
    variants = [(shape, loss, f"{shape.split()[0].split('[')[0]}-{loss}-{args.steps}{extra}")
                for shape in args.shapes for loss in args.losses]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        try:  # every variant's config before any training: a bad override is one line, not Hydra's traceback
            configs = [compose(config_name="train", overrides=[
                *COMMON, *SHAPES[shape], f"distill/loss={loss}", f"trainer.max_steps={args.steps}",
                f"paths.checkpoints_dir={run_dir}", f"experiment_name={name}",
                f"paths.cache_dir={ROOT / 'checkpoints' / '.cache'}", *args.overrides])
                for shape, loss, name in variants]
        except HydraException as err:
            raise SpecPolicyError(' '.join(str(err).split())) from err
        rows = _earlier_rows(out / "distill.json", {name for *_, name in variants})
        for (shape, loss, name), cfg in zip(variants, configs):
            shutil.rmtree(run_dir / name, ignore_errors=True)  # fresh training, shared data cache
            distil(cfg)
            metrics = json.loads((run_dir / name / "draft" / "metrics.json").read_text())
            rows.append({"run": name, "draft": shape, "loss": loss, **_row(metrics), "overrides": args.overrides,
                         "date": datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__})
            _write(out, rows)
    print(_markdown(rows))


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


if __name__ == "__main__":
    main()
