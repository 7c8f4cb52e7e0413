"""`run_shm_dir`: a folder per process for its segments' files, removed at its exit (never by a
forked child's), and folders of processes that died without removing theirs swept by the next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvfabric.testing.cluster import RUN_SHM_PREFIX, _remove_dead_runs_shm_dirs

# Makes its folder, forks a child that exits normally (running atexit), then says whether the
# folder is still there; the folder's path is printed first.
FORK_THEN_EXIT = """
import os, sys
from kvfabric.testing.cluster import run_shm_dir
folder = run_shm_dir()
print(folder, flush=True)
pid = os.fork()
if pid == 0:
    sys.exit(0)
os.waitpid(pid, 0)
print(folder.is_dir(), oct(folder.stat().st_mode & 0o777), flush=True)
"""


def test_the_folder_outlives_a_forked_child_and_goes_with_its_process() -> None:
    out = subprocess.run([sys.executable, "-c", FORK_THEN_EXIT], capture_output=True, text=True, check=True)
    folder, after_fork = out.stdout.split("\n", 1)
    assert Path(folder).name.startswith(f"{RUN_SHM_PREFIX}") and Path(folder).parent == Path("/dev/shm")
    assert after_fork.split() == ["True", "0o700"]
    assert not Path(folder).exists()  # removed when its process exited


def test_folders_of_dead_processes_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{RUN_SHM_PREFIX}{gone.pid}-abc"
    alive = tmp_path / f"{RUN_SHM_PREFIX}{os.getpid()}-def"
    unrelated = tmp_path / f"{RUN_SHM_PREFIX}notapid-x"
    for folder in (dead, alive, unrelated):
        folder.mkdir()
        (folder / "kvf-seg-a-1").write_bytes(b"arena")
    assert _remove_dead_runs_shm_dirs(tmp_path) == [dead]
    assert not dead.exists() and alive.is_dir() and unrelated.is_dir()
