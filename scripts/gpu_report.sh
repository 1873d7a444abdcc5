#!/usr/bin/env bash
# GPU readiness in a few minutes: the quick pipeline on CUDA in bf16, then the same report as on CPU
# (profile, engine and timings device-synchronised), under checkpoints/smollm2_135m_quick_gpu/report/.
# Usage on a machine with an NVIDIA GPU: bash scripts/gpu_report.sh [extra Hydra overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
make venv   # picks a CUDA build of torch when nvidia-smi sees a GPU
common=(experiment=smollm2_135m_quick experiment_name=smollm2_135m_quick_gpu runtime.device=cuda
        runtime.dtype=bfloat16 trainer.precision=bf16-mixed "$@")
.venv/bin/python scripts/train.py "${common[@]}"
.venv/bin/python scripts/evaluate.py "${common[@]}" 'eval.batch_sizes=[1,4,16,64]' eval.num_prompts=64
