"""A killed DeepSpeed op build leaves torch's FileBaton lock file; later runs waited forever without a word.

vlmfast names the file before DeepSpeed initialises and, while the wait goes on, says why and what to do.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

from torch.utils.file_baton import FileBaton

from vlmfast.engines.build_locks import build_locks, explain_build_locks, lock_holders

KILLED_BUILD = "import os, signal, sys; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); os.kill(os.getpid(), 9)"


def test_a_killed_builds_lock_is_named_and_the_wait_explained(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    done = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(lock)], timeout=60)  # FileBaton.try_acquire's
    assert done.returncode == -9 and lock.exists() and build_locks() == [lock]      # open, then the build is killed
    waited = threading.Event()

    def remove_after_the_explanation() -> None:
        deadline = time.monotonic() + 30
        while "still waiting" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        lock.unlink()

    with caplog.at_level(logging.WARNING, logger="vlmfast.engines.build_locks"), \
            explain_build_locks(after_s=0.2, every_s=0.2):
        assert "no process on this machine holds" in caplog.text and f"rm {lock}" in caplog.text
        threading.Thread(target=remove_after_the_explanation, daemon=True).start()
        FileBaton(str(lock), wait_seconds=0.05).wait()  # what torch's _jit_compile does when it finds the lock
        waited.set()
    assert waited.is_set() and "still waiting after" in caplog.text


def test_a_lock_held_by_a_running_build_is_waited_for_not_called_stale(tmp_path, caplog):
    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | "
                               "os.O_EXCL); print('held', flush=True); time.sleep(600)", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_holders(lock) == [holder.pid]
        with caplog.at_level(logging.WARNING, logger="vlmfast.engines.build_locks"), \
                explain_build_locks(after_s=0.1, every_s=10, root=tmp_path):
            assert "no process" not in caplog.text  # not stale: nothing said up front
            time.sleep(0.4)
        assert f"holds this lock (pid {holder.pid})" in caplog.text  # the long wait is explained
    finally:
        holder.kill()
        holder.wait()
