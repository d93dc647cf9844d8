"""How a process that joined a process group ends (training/distributed.py `leave`): after its exit handlers, with
its exit code and flushed output, but without the interpreter's teardown, where a gloo worker thread dropping its
last work can abort a rank that did all its work (a launched export failed CI that way, ~1 run in 20)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from training.launch import free_port

REPO = Path(__file__).resolve().parents[2]

RANK = """
import atexit, sys
import torch
import torch.distributed as dist
from training.distributed import leave

class Witness:
    def __del__(self):
        print("torn down", flush=True)  # runs only in the interpreter's teardown

witness = Witness()
if sys.argv[1] == "group":
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
    dist.all_reduce(torch.ones(2))
atexit.register(print, "exit handlers ran")
print("unflushed", end="")
sys.exit(leave(3))
"""


def _end(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", RANK, mode, str(free_port())]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_rank_with_a_group_ends_after_its_exit_handlers_without_teardown():
    p = _end("group")
    assert p.returncode == 3, p.stderr[-2000:]
    assert p.stdout.startswith("unflushed") and "exit handlers ran" in p.stdout
    assert "torn down" not in p.stdout


def test_a_process_without_a_group_exits_normally():
    p = _end("alone")
    assert p.returncode == 3, p.stderr[-2000:]
    assert "exit handlers ran" in p.stdout and "torn down" in p.stdout
