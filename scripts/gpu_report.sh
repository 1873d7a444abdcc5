#!/usr/bin/env bash
# GPU readiness in a few minutes: the quick pipeline on CUDA in bf16, then the same report as on CPU
# (profile, engine and timings device-synchronised), under checkpoints/smollm2_135m_quick_gpu/report/.
# Usage on a machine with an NVIDIA GPU: bash scripts/gpu_report.sh [extra Hydra overrides that both
# scripts/train.py and scripts/evaluate.py accept: target.*, runtime.*, engine.*, data.*, ...]
set -euo pipefail
cd "$(dirname "$0")/.."
make venv   # picks a CUDA build of torch when nvidia-smi sees a GPU
common=(experiment=smollm2_135m_quick experiment_name=smollm2_135m_quick_gpu runtime.device=cuda
        runtime.dtype=bfloat16)
# 16 prompts: at batch 1 each of the nine decoders reads every token alone (64 prompts: 1536 tokens each);
# the user's overrides come last, so they win over these defaults
evaluate=(.venv/bin/python scripts/evaluate.py "${common[@]}" 'eval.batch_sizes=[1,4,16]' eval.num_prompts=16 "$@")
# an override evaluate.py has no key for (trainer.*, distill.*) stopped it after the training: compose it first
"${evaluate[@]}" --cfg job >/dev/null
# trainer.* is the distil stage's: evaluate.py has no trainer to override
.venv/bin/python scripts/train.py "${common[@]}" trainer.precision=bf16-mixed "$@"
"${evaluate[@]}"
