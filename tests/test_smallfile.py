"""``io.smallfile``: the one way colibri reads a model's small files and its own state.
Only regular files, checked before anything opens them (a FIFO would block the open,
/dev/zero would never end), and never more than a limit."""

from __future__ import annotations

import os
import signal

import pytest

from colibri_core.errors import ModelFormatError
from colibri_core.io import smallfile


@pytest.fixture(autouse=True)
def no_hang():
    """A regression that opens a FIFO fails after 10 s instead of hanging the suite."""
    def expired(signum, frame):
        raise TimeoutError("blocked: a special file was opened")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def special(tmp_path, kind):
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)
    else:
        path.symlink_to(tmp_path / "absent.json")
    return path


@pytest.mark.parametrize("kind, said", [("fifo", "is a named pipe (FIFO), not a regular file"),
                                        ("dev_zero", "is a character device (a link to /dev/zero), not a regular file"),
                                        ("directory", "is a directory, not a regular file"),
                                        ("loop", "is a symlink loop"),
                                        ("broken", "is a broken symlink")])
def test_anything_but_a_regular_file_is_refused_unopened(tmp_path, kind, said):
    path = special(tmp_path, kind)
    assert smallfile.present(path)  # so an optional file of this name is read, and refused, not skipped
    for read in (smallfile.read_bytes, smallfile.read_text, smallfile.read_json):
        with pytest.raises(ModelFormatError) as info:
            read(path, 1 << 20, "model config")
        assert str(info.value).startswith(f"{path}: model config {said}"), info.value
    assert said in smallfile.why_not_regular(path)
    with pytest.raises(ModelFormatError, match="not a regular file|symlink"):
        smallfile.check_regular(path, "model config")


def test_a_file_is_read_up_to_its_limit_and_no_further(tmp_path):
    path = tmp_path / "index.json"
    path.write_bytes(b"[" + b" " * 98 + b"]")
    assert smallfile.read_json(path, 100, "index") == []
    with pytest.raises(ModelFormatError, match=r"index\.json: index is larger than 99 bytes"):
        smallfile.read_bytes(path, 99, "index")


def test_a_file_whose_size_lies_is_still_bounded():
    # /proc files report a size of 0; the read stops at the limit plus one byte all the same
    with pytest.raises(ModelFormatError, match="larger than 16 bytes"):
        smallfile.read_bytes("/proc/self/maps", 16, "file")


def test_a_missing_file_and_a_missing_directory(tmp_path):
    with pytest.raises(ModelFormatError, match="config.json: model config not found$"):
        smallfile.read_json(tmp_path / "config.json", 100, "model config")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelFormatError, match="a parent is not a directory"):
        smallfile.read_json(tmp_path / "file" / "config.json", 100, "model config")
    assert not smallfile.present(tmp_path / "config.json")


def test_text_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "chat_template.jinja"
    path.write_bytes(b"caf\xe9")
    with pytest.raises(ModelFormatError, match=r"chat_template\.jinja: chat template is not UTF-8 text \(byte 3\)"):
        smallfile.read_text(path, 100, "chat template")
