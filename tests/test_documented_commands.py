"""Every command README.md, data/README.md and docs/*.md show runs as written (with tiny overrides where a full
run would take minutes), so a documented command cannot rot; where one runs as shown (a tool: the planner, the
tokenizer, export), every output line the docs show beside it must be among what it prints. A new command in the
docs fails `test_every_documented_command_is_run_or_exempt` until it is given a tiny form here (or an exemption
with the reason it cannot run on a CPU-only machine)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "data" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_ENV = r"(?:[A-Z_]+=\S+\s+)*"
COMMAND = re.compile(
    rf"^{_ENV}(?:(?:\.venv/bin/)?python -m |deepspeed |launch/\S+\.sh|make |(?:\.venv/bin/)?k3-"
    r"|bench/gpu\.sh|sbatch )"
)
# a form with placeholders (<run_dir>, ..., [--quick], a / b, a glob launch/*.sh), not a command; `<|open|>` is a K3
# marker, not one
TEMPLATE = re.compile(r"<(?!\|)[^>]*>|\.\.\.|\[[^\]]*\]|\s/\s|/\*")

# Commands that cannot run here, and why (each is exercised in another way where possible).
EXEMPT = {
    "make test": "is the suite itself (CI runs it)",
    "launch/multinode.sh": "needs ssh-reachable nodes: tests/multinode runs it on two network-namespace nodes",
    "HOSTFILE=hostfile GPUS_PER_NODE=1 GLOO_SOCKET_IFNAME=k3eth0 launch/multinode.sh experiment=tiny_ci "
    "deepspeed=zero3 parallel.ep_size=2 run_dir=/shared/runs/two-nodes": "needs ssh-reachable nodes: "
    "tests/multinode/test_two_nodes.py runs this job on two network-namespace nodes with their own sshd",
    "sbatch --nodes=2 --gpus-per-node=0 --cpus-per-task=1 launch/slurm.sbatch experiment=tiny_ci deepspeed=zero3 "
    "parallel.ep_size=2 run_dir=/shared/runs/slurm": "needs a Slurm cluster: tests/multinode/test_slurm.py submits "
    "this job to a local slurmctld + two slurmd nodes",
    "launch/fault_matrix.sh": "the full fault matrix (~9 min); its CI subset is tests/fault",
    "bench/gpu.sh": "needs an NVIDIA GPU; without one it exits 2 in one line (test_gpu_script_refuses_without_cuda)",
    "DS_ACCELERATOR=cpu .venv/bin/python -m bench.bf16": "two 50-step smoke trainings (~10 min); "
    "tests/training/test_bf16.py checks the bf16 casts and the ZeRO-0 refusal",
    "python -m tests.golden.make": "rewrites the committed golden files (tests/golden/test_golden.py checks them)",
    "python -m bench.startup --launcher": "times cold and cached starts (minutes); tests/training/test_entry_points.py"
    " and tests/distributed start the same jobs",
    "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python -m bench.startup --reps 2 --launcher": "as above",
    "python -m bench.sharded_start": "a 1.7 GB checkpoint through 1- and 2-rank jobs (minutes, ~20 GB RAM); "
    "tests/distributed/test_zero3_ep.py checks the sharded start it measures",
    "python -m bench.export": "exports small and a 2.4 GB model from 8 child processes (minutes, ~8 GB RAM); "
    "tests/training/test_export_stream.py checks the streamed export it measures",
    "python -m bench.lora": "four 2-rank jobs on small (~10 min); tests/training/test_lora_plan.py runs its tiny job",
    "python -m bench.memory_dist": "2-rank ZeRO-3 jobs on tiny and small (minutes); bench/results/memory_dist.json",
    "python -m bench.memory --sp tiny:4096": "1- and 2-rank launcher jobs (~2.5 min even at tiny:64); "
    "tests/distributed/test_sequence_parallel.py runs the same SP build, engine and step; bench/results/memory_sp.json",
    "deepspeed --num_gpus 2 training/evaluate.py checkpoint=runs/eval_demo parallel=ep2 deepspeed=zero3": "a 2-rank "
    "launch; tests/distributed/test_eval_loop.py runs this evaluation at EP=2 ZeRO-3 and SP=2 against 1 rank",
    "python -m training.launch experiment=vlm_smoke run_dir=runs/vlm_smoke": "tests/distributed/test_vision_train.py "
    "launches experiment=vlm_smoke at four layouts (its caption evaluation included) against one process",
    "python -m training.launch experiment=passkey_smoke": "a bench-sized 2-rank job (minutes); "
    "tests/training/test_eval.py runs its passkey task on a tiny model",
    "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python -m bench.kda --threads 1 --fla-path /tmp/fla/pkg": (
        "needs fla-core's wheel unpacked at /tmp/fla/pkg (no network in CI); bench.kda itself runs above"
    ),
}

TRAIN = " train.steps=2 checkpoint.every=0 logging.mode=disabled"
NO_EVAL = " eval.every=0 eval.on_start=false"  # commands that do not ask for evaluation skip the smoke job's
BENCH_TINY = {
    "bench.kda": " --T 256 --chunk-sizes 64 --reps 1 --loop-reps 1",  # (--quick would force T 2048 and 3 reps)
    "bench.moe": " --quick --reps 1 --tokens 128 --experts 8",
    "bench.moe_ep": " --quick --reps 1",
    "bench.vision": " --quick --reps 1",
    "bench.train": " --cases tiny:64 --reps 1",
    "bench.data": " --reps 1 --model-reps 1 --fresh-tokens 20000 --fresh-reps 1",
    "bench.memory": " --cases tiny:64",
    "bench.long_context": " --seqs 256",
    "bench.optim_loss": " --steps 2 --seeds 0",  # one seed, 2 steps: both optimizers' smoke jobs
    "bench.speculative": " --steps 3 --prompts 1 --new 8",  # 3 training steps, one short generation
    "bench.gpu_check": " --reps 1 --steps 1",  # its CPU dry run: 1 timed rep of each part (a bf16 step takes seconds)
    "bench.qk_clip_memory": " --seq 256",  # three 1-layer children at 256 tokens
}


def scan_docs() -> tuple[list[str], dict[str, list[str]]]:
    """Commands in fenced or indented code blocks (`$ ` prompts stripped, `\\` continuations joined) and in
    inline code spans, in document order, without duplicates; and the output a fenced block shows under a
    `$ command` (up to the next command or the fence; `...` stands for lines left out), by command."""
    out: list[str] = []
    shown: dict[str, list[str]] = {}
    for doc in DOCS:
        fenced, buf, prompted, last = False, "", False, None
        for raw in doc.read_text().splitlines():
            if raw.strip().startswith("```"):
                fenced, last = not fenced, None
                continue
            line = raw.strip().removeprefix("$ ")
            if fenced or raw.startswith("    "):
                if buf:
                    buf += " " + line.rstrip("\\").strip()
                    if not line.endswith("\\"):
                        out.append(buf)
                        last, buf = (buf if prompted else None), ""
                elif COMMAND.match(line):
                    prompted = raw.startswith("$ ")
                    if line.endswith("\\"):
                        buf = line.rstrip("\\").strip()
                    else:
                        out.append(line)
                        last = line if prompted else None
                elif fenced and last is not None and line != "...":
                    shown.setdefault(last, []).append(raw)
                continue
            out += [m.group(1).strip() for m in re.finditer(r"`([^`]+)`", raw) if COMMAND.match(m.group(1).strip())]
    cleaned = [re.sub(r"\s+#.*$", "", c).strip() for c in out]
    return list(dict.fromkeys(c for c in cleaned if not TEMPLATE.search(c))), shown


def documented_commands() -> list[str]:
    return scan_docs()[0]


def tiny(cmd: str, tmp: Path) -> str:
    """The command with tiny overrides, every output path moved under `tmp` (the checkout is never written)."""
    cmd = re.sub(r"(?<![\w/.])runs/", f"{tmp}/runs/", cmd)
    cmd = cmd.replace("out=/tmp/", f"out={tmp}/").replace("plan.out=", f"plan.out={tmp}/")
    train = TRAIN + ("" if "eval" in cmd else NO_EVAL)
    if "launch/sweep.sh" in cmd:  # a multirun: every job into its own directory under run_dir
        return cmd + f" run_dir={tmp}/runs/sweep" + train
    if re.search(r"training\.train\b|training\.launch\b|training/train\.py|launch/smoke\.sh|k3-train", cmd):
        if "run_dir=" not in cmd:  # where the job writes as documented: runs/<experiment name> (smoke.sh: smoke)
            m = re.search(r"experiment=(\w+)", cmd)
            cmd += f" run_dir={tmp}/runs/{m.group(1) if m else 'smoke' if 'smoke.sh' in cmd else 'default'}"
        return cmd + train
    if cmd == "make smoke":
        return f'make smoke ARGS="{train.strip()} run_dir={tmp}/runs/smoke"'
    if cmd == "make venv":
        return cmd
    m = re.search(r"-m (bench\.\w+)", cmd)
    if m and m.group(1) in BENCH_TINY:
        cmd = re.sub(r"--cases(\s+\S+:\d+)+|--reps \d+|--quick", "", cmd)
        cmd = re.sub(r"--sp(\s+\S+:\d+)+", "--sp tiny:64", cmd)  # the sequence-parallel mode: a tiny sequence
        cmd = re.sub(r"--seqs(\s+\d+)*|--steps(\s+\d+)+", "", cmd)  # bench.long_context: tiny lengths below
        return cmd + BENCH_TINY[m.group(1)]
    return cmd


def unchanged(cmd: str, line: str, tmp: Path) -> bool:
    """Whether `tiny` only moved the command's paths under tmp (it runs as shown: its output can be compared)."""
    return line.replace(f"{tmp}/", "") == cmd


def _words(text: str) -> str:
    return " ".join(text.split())


def _env(tmp: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "K3_BENCH_RESULTS": str(tmp / "bench"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)
    return env


def test_every_documented_command_is_run_or_exempt():
    cmds = documented_commands()
    assert len(cmds) >= 20 and "make smoke" in cmds
    stale = sorted(set(EXEMPT) - set(cmds))
    assert stale == [], f"exemptions for commands the docs no longer show: {stale}"


def test_gpu_script_refuses_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: bench/gpu.sh would run for real")
    p = subprocess.run(
        ["bash", "bench/gpu.sh"], cwd=REPO, env=_env(Path("/nonexistent")), capture_output=True, text=True, timeout=300
    )
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]


# Commands run two at a time (the CI machine's 2 cores; most are 1-process jobs with OMP_NUM_THREADS=1), also beside
# the other pytest-xdist worker: this is the suite's longest test, and with a larger share of the machine it ends
# before the other worker's queue runs dry instead of last, alone on one core.
WORKERS = 2


def shared(line: str, tmp: Path) -> set[str]:
    """What a tiny command shares with other commands: the paths under `tmp` it names (a run dir, an export, a
    tokenizer; by their first part below tmp/runs/ or tmp/), a bench's results file (one per bench module) and the
    checkout's virtualenv (make). Not a master port: every launch picks a free one (training/launch.py)."""
    keys = set(re.findall(rf"{re.escape(str(tmp))}/((?:runs/)?[^/\s\"']+)", line))
    keys.update(re.findall(r"-m (bench\.\w+)", line))
    if line.startswith("make "):
        keys.add(".venv")
    return keys


def after(lines: list[str], tmp: Path) -> list[set[int]]:
    """For each command, the earlier commands it must wait for: the last earlier one sharing each of its
    `shared` keys (so commands sharing anything keep their document order: later ones use what earlier ones
    wrote)."""
    last: dict[str, int] = {}
    deps = []
    for i, line in enumerate(lines):
        keys = shared(line, tmp)
        deps.append({last[k] for k in keys if k in last})
        last.update(dict.fromkeys(keys, i))
    return deps


def test_commands_sharing_a_path_keep_their_document_order():
    tmp = Path("/t")
    lines = [
        tiny("make smoke", tmp),
        tiny("python -m training.report runs/smoke", tmp),
        tiny("python -m training.train experiment=sft_tiny_base", tmp),
        tiny("python -m training.export runs/sft_tiny_base runs/sft_tiny_base-hf", tmp),
        tiny("python -m training.train experiment=sft_tiny model.init_from=runs/sft_tiny_base-hf", tmp),
        tiny("python -m bench.memory", tmp),
        tiny("python -m bench.memory --sp tiny:4096", tmp),
        tiny("python -m training.launch experiment=smoke run_dir=runs/z3", tmp),
        tiny("launch/sweep.sh", tmp),
        tiny("python -m training.plan model=k3 plan.out=k3_plan.json", tmp),
    ]
    assert after(lines, tmp) == [set(), {0}, set(), {2}, {3}, set(), {5}, set(), set(), set()]


def run_concurrently(lines: list[str], tmp: Path) -> list[subprocess.CompletedProcess]:
    """Every command, at most WORKERS at a time, each started once the commands it comes `after` have ended
    (the first ready command in document order first); results in document order."""
    deps, done, results = after(lines, tmp), set(), [None] * len(lines)

    def run(line: str) -> subprocess.CompletedProcess:
        cmd = ["bash", "-c", line]
        return subprocess.run(cmd, cwd=REPO, env=_env(tmp), capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(WORKERS) as pool:
        running: dict = {}
        while len(done) < len(lines):
            for i, line in enumerate(lines):
                busy = i in done or i in running.values()
                if len(running) < WORKERS and not busy and deps[i] <= done:
                    running[pool.submit(run, line)] = i
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                i = running.pop(f)
                results[i] = f.result()
                done.add(i)
    return results


# How the README's main job is spelled: each form runs the next (the Makefile's smoke target, launch/smoke.sh)
SPELLINGS = (
    (re.compile(r'^make smoke(?: ARGS="(.*)")?$'), r"launch/smoke.sh \1"),
    (re.compile(r"^launch/smoke\.sh\b(.*)$"), r"python -m training.launch experiment=smoke\1"),
)
JOB = re.compile(rf"^(?P<env>{_ENV})(?:\.venv/bin/)?python -m training\.(?P<entry>launch|train) (?P<args>.*)$")


def training_job(line: str) -> str | None:
    """The training job a tiny command starts, as its rank count and resolved config without run_dir (composed
    with Hydra as the job itself does), or None for anything else (a sweep, a tool, a bench)."""
    from omegaconf import OmegaConf

    from training.config import compose

    for form, spelled in SPELLINGS:
        line = form.sub(spelled, line).strip()
    m = JOB.match(line)
    if m is None or "--multirun" in line:
        return None
    env = dict(kv.split("=", 1) for kv in m["env"].split())
    ranks = int(env.pop("NUM_RANKS", "2")) if m["entry"] == "launch" else 1
    cfg = compose([a for a in shlex.split(m["args"]) if not a.startswith("run_dir=")])
    return f"{sorted(env.items())} ranks={ranks} {OmegaConf.to_yaml(cfg, resolve=True)}"


def repeats(lines: list[str], tmp: Path) -> set[int]:
    """Commands that start a training job an earlier command already ran, where nothing later reads what they
    write beyond what that earlier command wrote: running them again proves nothing new."""
    first: dict[str, int] = {}
    out = set()
    for i, line in enumerate(lines):
        job = training_job(line)
        if job is None:
            continue
        if job not in first:
            first[job] = i
            continue
        own = shared(line, tmp) - shared(lines[first[job]], tmp)
        if not any(own & shared(later, tmp) for later in lines[i + 1 :]):
            out.add(i)
    return out


def test_spellings_of_the_smoke_job_are_one_job():
    tmp = Path("/t")
    lines = [
        tiny("make smoke", tmp),
        tiny("launch/smoke.sh", tmp),
        tiny("launch/smoke.sh train.steps=50 run_dir=runs/try", tmp),
        tiny("launch/smoke.sh parallel=ep2", tmp),
        tiny("launch/smoke.sh parallel=sp2 run_dir=runs/smoke-sp2", tmp),
        tiny("python -m training.train experiment=smoke parallel=dp run_dir=runs/smoke-1p", tmp),
        tiny("launch/smoke.sh run_dir=runs/used", tmp),
        tiny("python -m training.report runs/used", tmp),
    ]
    assert repeats(lines, tmp) == {1, 2, 3}


def test_documented_commands_run(tmp_path):
    """Every documented command runs; commands that share a path (`shared`) run in document order, later ones
    using what earlier ones wrote (a run dir, a tokenizer, an export), the others alongside them. A command that
    ran as shown prints every output line the docs show beside it (whitespace aside)."""
    ran, seen = [], set()
    for cmd in documented_commands():
        if cmd in EXEMPT:
            continue
        line = tiny(cmd, tmp_path)
        same = re.sub(r"\s+", " ", re.sub(rf"^{_ENV}(\.venv/bin/)?", "", line)).strip()
        if same in seen:  # the same tiny command behind another spelling (env prefix, .venv/bin/, spacing)
            continue
        seen.add(same)
        ran.append((cmd, line))
    again = repeats([line for _, line in ran], tmp_path)  # the same job behind another spelling
    ran = [r for i, r in enumerate(ran) if i not in again]
    results = run_concurrently([line for _, line in ran], tmp_path)
    failed = [
        f"{cmd}\n  ran: {line}\n  rc={p.returncode}\n  {p.stderr[-1500:]}"
        for (cmd, line), p in zip(ran, results)
        if p.returncode != 0
    ]
    assert failed == [], "\n\n".join(failed)
    shown = scan_docs()[1]
    compared, stale = 0, []
    for (cmd, line), p in zip(ran, results):
        if cmd in shown and unchanged(cmd, line, tmp_path):  # a tool run as shown: the docs show its output
            compared += 1
            printed = {_words(x) for x in p.stdout.replace(f"{tmp_path}/", "").splitlines()}
            stale += [f"{cmd}\n  shows: {x}" for x in shown[cmd] if _words(x) not in printed]
    assert stale == [], "output the docs show is not what the command prints:\n" + "\n".join(stale)
    assert compared >= 8  # the planner's and the tokenizer's blocks at least
    assert len(ran) >= 12
    assert not (REPO / "k3_plan.json").exists()  # nothing documented writes into the checkout
    assert shlex.split(ran[0][1])[:2] == ["make", "smoke"]  # the README's first command runs first
