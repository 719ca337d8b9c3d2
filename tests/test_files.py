"""protein_performer.files: atomic writes keep the old file until the new one is whole, the
journal removes exactly what it recorded, and a held lock answers a second writer at once."""
import hashlib
import subprocess
import sys

import pytest

from protein_performer import files
from protein_performer.errors import UserError

from conftest import dead_pid


def test_sha256_matches_hashlib_and_cache_survives(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(b"MKV" * 1000)
    expected = hashlib.sha256(b"MKV" * 1000).hexdigest()
    assert files.file_sha256(p) == expected
    assert files.file_sha256(p, cache_dir=tmp_path / "c") == expected
    assert len(list((tmp_path / "c" / "checksums").iterdir())) == 1
    assert files.file_sha256(p, cache_dir=tmp_path / "c") == expected


def test_atomic_write_keeps_old_on_error(tmp_path):
    p = tmp_path / "out.txt"
    files.write_text(p, "old\n")
    with pytest.raises(RuntimeError):
        with files.atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert p.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.txt"]  # no temporary left
    files.write_json(p, {"a": 1})
    assert p.read_text() == '{\n "a": 1\n}\n'


def test_atomic_folder_swap(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "old.bin").write_text("x")
    with files.atomic_path(d) as tmp:
        tmp.mkdir()
        (tmp / "new.bin").write_text("y")
    assert [x.name for x in d.iterdir()] == ["new.bin"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["model"]


def test_journal_removes_only_recorded(tmp_path):
    user = tmp_path / "notes.txt"
    user.write_text("mine")
    user_pt = tmp_path / "mine.pt"
    user_pt.write_text("mine too")
    w = files.WrittenFiles(tmp_path / ".written.json")
    for name in ("a.pt", "b.pt"):
        files.write_text(w.record(tmp_path / name), name)
    assert (tmp_path / "a.pt") in w and user_pt not in w
    w.remove(user_pt)  # not recorded: stays
    again = files.WrittenFiles(tmp_path / ".written.json")  # a later process reads the journal
    again.remove_all()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["mine.pt", "notes.txt"]
    assert user.read_text() == "mine"


def test_journal_sweeps_the_temporary_a_killed_write_of_itself_left(tmp_path):
    """A SIGKILL inside the journal's atomic write leaves ``.<journal name>.<pid>.tmp``; the next
    owner of the folder removes it, and only it: a live process's temporary and a user's
    look-alike names stay."""
    journal = tmp_path / ".written.json"
    files.WrittenFiles(journal).record(tmp_path / "a.txt")
    left = tmp_path / f"..written.json.{dead_pid()}.tmp"  # temp_path's name in that process
    live = files.temp_path(journal)  # this process's own, mid-write
    user = [tmp_path / "..written.json.mine.tmp", tmp_path / ".written.json.123.tmp", tmp_path / "..other.json.1.tmp",
            tmp_path / "..written.json.\u00b2.tmp", tmp_path / f"..written.json.{'9' * 30}.tmp"]  # no pid: kept, no crash
    for p in (left, live, *user):
        p.write_text('{"written": []}\n')
    again = files.WrittenFiles(journal)
    assert left.exists()  # opening only reads: the sweep is explicit, where the process owns the folder
    again.remove_dead_temporaries()
    assert not left.exists()
    assert live.exists() and all(p.exists() for p in user)
    assert again.paths == ["a.txt"]


def test_lock_refuses_second_process(tmp_path):
    lock = tmp_path / "out.h5.lock"
    code = ("import sys; from protein_performer import files\n"
            "from protein_performer.errors import UserError\n"
            "try:\n    with files.exclusive_lock(sys.argv[1], what='out.h5'): pass\n"
            "except UserError as e:\n    print(e); sys.exit(2)\n")
    with files.exclusive_lock(lock, what="out.h5"):
        r = subprocess.run([sys.executable, "-c", code, str(lock)], capture_output=True, text=True)
        assert r.returncode == 2 and "another process is writing it" in r.stdout
    r = subprocess.run([sys.executable, "-c", code, str(lock)], capture_output=True, text=True)
    assert r.returncode == 0
    with files.exclusive_lock(lock):  # released: this process can take it again
        pass
    with pytest.raises(UserError):
        with files.exclusive_lock(lock):
            with files.exclusive_lock(lock):  # flock on a second descriptor blocks even in one process
                pass
