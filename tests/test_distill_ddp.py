"""trainer=ddp: two CPU processes with gloo distil a tiny draft, rank 0 writes it and runs the stages after it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def test_ddp_two_cpu_processes(tmp_path):
    rows = [{"prompt": f"Count to {i}.", "split": "train" if i < 12 else "validation" if i < 16 else "test"}
            for i in range(20)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    overrides = ["debug=fast", "experiment=tiny", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                 "runtime.device=cpu", "draft.layers=[0,-1]", f"data.prompts_file={tmp_path / 'prompts.jsonl'}",
                 f"paths.checkpoints_dir={tmp_path}", "distill.batch_size=2", "distill.data.max_new_tokens=8",
                 "trainer.max_steps=4", "trainer.val_check_interval=4",
                 "callbacks.model_checkpoint.every_n_train_steps=2", "stages=[distil,prepare]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.run([sys.executable, str(HERE / "distill_ddp_main.py"), *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world_size: 2" in proc.stderr + proc.stdout or "MEMBER: 2/2" in proc.stderr + proc.stdout
    # rank 1 went on to the next stage too, before rank 0 had saved the draft it reads ("run the distil stage first")
    assert (proc.stderr + proc.stdout).count("stage distil") == 2
    assert (proc.stderr + proc.stdout).count("stage prepare") == 1
    metrics = json.loads((tmp_path / "tiny" / "draft" / "metrics.json").read_text())
    assert metrics["steps"] == 4 and set(metrics["after"]["test"]) == {"loss", "agreement", "expected_acceptance"}
    ckpt = torch.load(tmp_path / "tiny" / "distill" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 4
