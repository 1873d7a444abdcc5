"""Outputs that reruns trust by existence are written all or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpolicy.atomic import atomic_path


def test_a_file_and_a_folder_replace_what_was_there(tmp_path: Path) -> None:
    with atomic_path(tmp_path / "deep" / "a.json") as tmp:
        tmp.write_text("new")
    assert (tmp_path / "deep" / "a.json").read_text() == "new"

    old = tmp_path / "folder"
    old.mkdir()
    (old / "stale.txt").write_text("old")
    with atomic_path(old) as tmp:
        tmp.mkdir()
        (tmp / "fresh.txt").write_text("new")
    assert [p.name for p in old.iterdir()] == ["fresh.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "folder"]  # no temporaries left


def test_a_failed_write_leaves_the_old_output_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "data"
    out.mkdir()
    (out / "rows").write_text("complete")
    with pytest.raises(KeyboardInterrupt), atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "rows").write_text("half")
        raise KeyboardInterrupt  # killed mid-save
    assert (out / "rows").read_text() == "complete"
    assert [p.name for p in tmp_path.iterdir()] == ["data"]
