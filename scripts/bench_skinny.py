"""Benchmark: `python scripts/bench_skinny.py experiment=smollm2_135m`.

Prints and saves JSON with the target's forward latency through plain `nn.Linear` and through
`specpolicy.models.skinny`'s tall GEMMs (`runtime.skinny_gemm`), timed side by side in one process, in the
same rounds, over the profile stage's grid (`profile.rows` x `profile.tokens` new tokens per row): the
milliseconds of each, and plain / skinny per cell (above 1: skinny is faster). Float32 on a CPU only: skinny
GEMMs leave other models alone, so both sides would time the same `nn.Linear`.
"""

import copy
import os
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from specpolicy.cli import entry, publish
from specpolicy.cost.profile import time_grid
from specpolicy.errors import SpecPolicyError
from specpolicy.models.skinny import applies, use_skinny_gemm
from specpolicy.runtime import check_runtime, device_name, resolve_device, resolve_dtype
from specpolicy.stages import check_grid_fits, check_profile

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[1]))


def bench(cfg: DictConfig) -> None:
    check_profile(cfg)  # the grid it times: `profile.tokens=[]` was a max() traceback
    check_runtime(cfg.runtime)
    if not applies(resolve_device(cfg.runtime.device), resolve_dtype(cfg.runtime.dtype)):  # its JSON timed noise
        raise SpecPolicyError(f"bench_skinny compares skinny GEMMs with nn.Linear, and they apply to float32 on a CPU "
                              f"only (runtime.device={cfg.runtime.device} runtime.dtype={cfg.runtime.dtype} runs "
                              f"nn.Linear both ways); set runtime.device=cpu runtime.dtype=float32")
    target = instantiate(cfg.target, skinny_gemm=False).load()
    check_grid_fits(cfg.profile, target)
    models = {"linear": target.model, "skinny": use_skinny_gemm(copy.deepcopy(target.model))}
    p = cfg.profile
    ms = time_grid(models, list(p.rows), list(p.tokens), p.context, p.repeats)
    speedup = [[round(a / b, 3) for a, b in zip(*rows)] for rows in zip(ms["linear"], ms["skinny"])]
    report = {"target": target.name, "device": device_name(target.model.device), "dtype": cfg.runtime.dtype,
              "context": p.context, "rows": list(p.rows), "tokens": list(p.tokens),
              "ms": {k: [[round(v, 2) for v in row] for row in grid] for k, grid in ms.items()},
              "linear_over_skinny": speedup}
    publish(report, Path(cfg.paths.experiment_dir) / "bench" / f"skinny-{report['device']}-{cfg.runtime.dtype}.json")


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    entry(bench, cfg)


if __name__ == "__main__":
    main()
