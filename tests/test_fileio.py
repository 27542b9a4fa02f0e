"""atomic_open: a reader sees the old file or the new one, never a part."""

import os

import pytest

from mpdl.fileio import atomic_open


def test_the_new_file_replaces_the_old_one_whole(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with atomic_open(path, sync=True) as f:
        f.write("new")
        assert path.read_text() == "old"  # nothing visible until the block ends
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["out.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk"), atomic_open(path, "wb") as f:
        f.write(b"half")
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_read_modes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"), atomic_open(tmp_path / "x", "r"):
        pass
