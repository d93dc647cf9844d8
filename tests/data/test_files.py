"""atomic_write / atomic_dir: a reader sees the old content or the new one, never a torn file; no temp left over."""

from __future__ import annotations

import pytest

from data.files import atomic_dir, atomic_open, atomic_write


def test_atomic_write_replaces_the_content_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "sub" / "f.txt"
    atomic_write(p, "first")
    atomic_write(p, b"second \xff")
    assert p.read_bytes() == b"second \xff" and [x.name for x in p.parent.iterdir()] == ["f.txt"]
    assert oct(p.stat().st_mode & 0o777) == "0o644"


def test_a_failure_mid_write_keeps_the_old_file(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write(p, "old")
    with pytest.raises(RuntimeError), atomic_open(p, "w") as f:
        f.write("half of the new")
        raise RuntimeError("crash")
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["f.txt"]


def test_atomic_dir_appears_whole_and_a_finished_copy_is_kept(tmp_path):
    d = tmp_path / "tok"
    with atomic_dir(d) as tmp:
        (tmp / "a").write_text("1")
        assert not d.exists()
    assert (d / "a").read_text() == "1"
    with atomic_dir(d) as tmp:  # a second builder finishing later: the first copy stays
        (tmp / "a").write_text("2")
    assert (d / "a").read_text() == "1" and [x.name for x in tmp_path.iterdir()] == ["tok"]
