"""The entry points, run as a user runs them: bad input is one line naming the fix, exit code != 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compose import ROOT


def run(script: str, *overrides: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), f"paths.checkpoints_dir={tmp_path}", *overrides],
        capture_output=True, text=True, env=env, timeout=300,
    )


def assert_clean_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["target=pretrained", "target.path=./nowhere/model"], "model path './nowhere/model' does not exist"),
        (["target=pretrained", "target.path=/tmp/absent.gguf"], "GGUF file '/tmp/absent.gguf' does not exist"),
        (["target=nope"], "Could not find 'target/nope'"),
        (["runtime.dtype=float33"], "unknown dtype 'float33'"),
        (["data.prompts_file=/tmp/no_prompts_here.jsonl"], "does not exist; fix data.prompts_file"),
        (["draft=layers", "draft.layers=[0,9]"], "indexes outside the target's 4 layers"),
    ],
)
def test_bad_input_is_one_line(overrides: list[str], message: str, tmp_path: Path) -> None:
    assert_clean_error(run("evaluate.py", "experiment=tiny", "debug=fast", *overrides, tmp_path=tmp_path), message)


def test_prompt_longer_than_context_and_empty_file(tmp_path: Path) -> None:
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 200}) + "\n")
    proc = run("evaluate.py", "experiment=tiny", "debug=fast", f"data.prompts_file={long}",
               "target.config.max_position_embeddings=128", tmp_path=tmp_path)
    assert_clean_error(proc, "exceeds the model's context of 128")
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    assert_clean_error(run("evaluate.py", "debug=fast", f"data.prompts_file={empty}", tmp_path=tmp_path), "is empty")


def test_evaluate_debug_fast_runs_and_is_lossless(tmp_path: Path) -> None:
    proc = run("evaluate.py", "experiment=tiny", "debug=fast", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "policy" not in line]
    assert {line.split("|")[1].strip() for line in table} == {"ar", "static_k2", "static_k4", "heuristic", "confidence"}
    assert all(line.rstrip(" |").endswith("yes") for line in table), proc.stdout
