"""Writing outputs that later runs trust by their existence: all or nothing.

Every stage skips work whose output exists, so a run killed mid-save must not leave a half-written
file or folder behind. One mechanism serves all of them: write at a temporary path beside the output,
then rename it into place (a rename within one file system is atomic).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("specpolicy")


@contextmanager
def atomic_path(out: str | Path) -> Iterator[Path]:
    """Yield a fresh path to write `out`'s file or folder at; on success it replaces `out`, on error
    `out` stays as it was and the temporary is removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        yield tmp / out.name
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(tmp / out.name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def written(stage: str, out: Path, marker: Path | None = None) -> bool:
    """Whether `stage` wrote `out` already (`marker`: the file it saves last, when not `out` itself). Then the
    stage is skipped, and the log says how to rerun it: new settings alone do not replace what exists."""
    if not (marker or out).exists():
        return False
    log.info("%s: %s exists, skipping (delete it, or set another experiment_name, to run %s again)", stage, out, stage)
    return True
