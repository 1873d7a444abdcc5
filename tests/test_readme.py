"""The README's Python example runs as written (with the undistilled draft it names, since a test has no demo
run's draft): a notebook user's first contact with the engine, policies and runner."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_readme_python_example_decodes_losslessly() -> None:
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## From Python\n.*?```python\n(.*?)```", readme, re.S).group(1)
    distilled = "draft = PretrainedDraft("
    assert distilled in code and "# or, undistilled: draft = LayerSubsetDraft(" in code
    code = "\n".join(line.replace("# or, undistilled: ", "") if "undistilled" in line else line
                     for line in code.splitlines() if not line.startswith(distilled))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0] in
                ("ar", "static_k1", "confidence"))
    assert rows["ar"] == "1.00x None" and all(row.endswith("x None") for row in rows.values())  # lossless
