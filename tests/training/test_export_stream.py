"""The streamed export (issue 37 §1, §2, §5): the same tensors, bitwise, as the consolidated path; disjoint shards
from several processes; a killed export leaves no directory that looks complete; a non-empty OUT is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model import K3ForCausalLM, K3ForConditionalGeneration
from tests.model.vision_micro import micro_mm_config, randomise
from tests.training.export_compare import assert_same_as_consolidated, tensors, zero0_tag
from training.launch import free_port
from training.tools.cli import ToolError
from training.tools.export import export_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mm_tag(tmp_path_factory) -> Path:
    return zero0_tag(tmp_path_factory.mktemp("mm"), randomise(K3ForConditionalGeneration(micro_mm_config()), std=0.1))


def test_streamed_export_equals_the_consolidated_one_bitwise(mm_tag, tmp_path):
    out = export_checkpoint(str(mm_tag), str(tmp_path / "hf"), max_shard_bytes=100_000)
    assert len(list(Path(out).glob("model-*.safetensors"))) > 2
    assert (Path(out) / "model.safetensors.index.json").is_file()
    assert_same_as_consolidated(mm_tag, Path(out), tmp_path)


def test_processes_write_disjoint_shards_with_the_same_bytes(mm_tag, tmp_path):
    one = Path(export_checkpoint(str(mm_tag), str(tmp_path / "one"), max_shard_bytes=100_000))
    two = Path(export_checkpoint(str(mm_tag), str(tmp_path / "two"), max_shard_bytes=100_000, procs=2))
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for f in one.glob("*.safetensors"):
        assert f.read_bytes() == (two / f.name).read_bytes(), f.name


def test_a_non_empty_out_is_refused_unless_overwrite(mm_tag, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ToolError, match="exists and is not empty; pass --overwrite"):
        export_checkpoint(str(mm_tag), str(out))
    assert (out / "notes.txt").read_text() == "mine"
    export_checkpoint(str(mm_tag), str(out), overwrite=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # nothing left beside it


KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
from training.tools import export_safetensors
from training.tools.export import export_checkpoint
export_safetensors.on_shard_written = lambda path: os.kill(os.getpid(), signal.SIGKILL)
export_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=100_000, overwrite=True)
"""


def test_a_killed_export_leaves_no_complete_looking_directory(mm_tag, tmp_path):
    out = tmp_path / "hf"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    p = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_SHARD, str(mm_tag), str(out)], cwd=REPO, env=env)
    assert p.returncode == -9 and not out.exists()
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.partial-")]
    assert len(staged) == 1 and not (staged[0] / "config.json").exists()  # hidden, and incomplete inside
    assert len(list(staged[0].glob("*.safetensors"))) == 1
    export_checkpoint(str(mm_tag), str(out))  # the next export sweeps the dead one's staging
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_launched_ranks_write_the_shards_of_one_process(mm_tag, tmp_path):
    one = Path(export_checkpoint(str(mm_tag), str(tmp_path / "one"), max_shard_bytes=100_000))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += ["-m", "training.export", str(mm_tag), str(tmp_path / "two"), "--shard-bytes", "100000"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    two = tmp_path / "two"
    assert sorted(x.name for x in one.iterdir()) == sorted(x.name for x in two.iterdir())
    for f in one.iterdir():
        assert f.read_bytes() == (two / f.name).read_bytes(), f.name


def test_text_state_with_a_tower_config_streams_text_only(tmp_path):
    tag = zero0_tag(tmp_path, K3ForCausalLM(micro_mm_config()))
    out = Path(export_checkpoint(str(tag), str(tmp_path / "hf")))
    assert not any(k.startswith("vision_tower.") for k in tensors(out))
    assert_same_as_consolidated(tag, out, tmp_path)
