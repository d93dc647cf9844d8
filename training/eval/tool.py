"""Evaluate a saved model with the loop's own evaluation code: held-out loss sets and tasks, any layout.

    python -m training.evaluate checkpoint=<run dir | step dir | HF export> [eval overrides] [out=<file>]
    deepspeed --num_gpus 2 training/evaluate.py checkpoint=runs/smoke parallel=ep2 deepspeed=zero3

A DeepSpeed checkpoint (any ZeRO stage / EP size; a LoRA run is its base + adapters, merged) is first
consolidated into an HF checkpoint by training.export's reader (rank 0, into a temp dir); the model is then built
like a training run's `model.init_from`, laid out by the overrides (`parallel=ep2`, `parallel=sp2`,
`deepspeed=zero3`: a model that does not fit one rank), and scored by training/eval/suite.py. The run's own
config (config.yaml beside checkpoints/) supplies `data`, `eval`, `train.seq_len`, `train.loss_on` and
`train.micro_batch_size` unless an override names them. Prints a table and writes JSON (set or task -> metric ->
value) to `out`, by default `eval.json` inside the directory given.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from omegaconf import DictConfig, OmegaConf

from training.tools.cli import ToolError, run_tool

_FROM_RUN = ("data", "eval", "train.seq_len", "train.loss_on", "train.micro_batch_size")


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path)
    )


def run_config_of(tag_dir: str) -> str | None:
    """config.yaml of the run a step dir belongs to (<run>/checkpoints/<tag>), if there is one."""
    run = os.path.dirname(os.path.dirname(os.path.abspath(tag_dir)))
    path = os.path.join(run, "config.yaml")
    return path if os.path.isfile(path) else None


def _overridden(key: str, overrides: list[str]) -> bool:
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    return any(k == key or key.startswith(k + ".") for k in keys)  # the section itself, or a parent


def _is_group(override: str) -> bool:
    from training.config import CONF_DIR

    key = override.split("=", 1)[0].lstrip("+~")
    return "." not in key and os.path.isdir(os.path.join(CONF_DIR, key))


def _set(cfg: DictConfig, key: str, value: Any) -> None:
    """cfg[key] = value for a dotted key whose parts may index lists (eval.sets.0.rows=8). A whole section is
    merged in as Hydra does, so a list of mappings takes its schema (eval.sets=[{name: x, sources: [...]}])."""
    *path, last = key.split(".")
    if not any(p.isdigit() for p in (*path, last)):
        nested: Any = value
        for part in reversed([*path, last]):
            nested = {part: nested}
        cfg.merge_with(nested)  # lists are replaced whole, mappings validated against the dataclass
        return
    node: Any = cfg
    for part in path:
        node = node[int(part)] if OmegaConf.is_list(node) else node[part]
    if OmegaConf.is_list(node):
        node[int(last)] = value
    else:
        node[last] = value


def compose_eval_config(overrides: list[str], hf_dir: str, run_config: str | None, work: str) -> DictConfig:
    """Defaults + group choices (parallel=ep2, eval=heldout) -> the run's own sections -> the dotted overrides."""
    import yaml

    from training.config import compose

    fixed = [f"model.init_from={hf_dir}", f"run_dir={work}", "logging.mode=disabled", "logging.progress=false"]
    fixed += ["checkpoint.resume=none", "checkpoint.save_final=false", "finetune=none", "train.steps=1"]
    cfg = compose([*(o for o in overrides if _is_group(o)), *fixed])
    if run_config is not None:
        saved = OmegaConf.load(run_config)
        for key in _FROM_RUN:
            value = OmegaConf.select(saved, key)
            if value is not None and not _overridden(key, overrides):
                OmegaConf.update(cfg, key, value, merge=True)
    for o in overrides:
        if not _is_group(o):
            key, raw = o.lstrip("+").split("=", 1)
            try:
                _set(cfg, key, yaml.safe_load(raw) if raw else None)
            except Exception as e:  # noqa: BLE001 - one line naming the override
                raise ToolError(f"override {o!r}: {str(e).splitlines()[0]}") from None
    if not len(cfg.eval.sets) and not len(cfg.eval.tasks):
        raise ToolError("nothing to evaluate: add eval=heldout, eval.sets=[...] or eval.tasks=[...]")
    return cfg


def consolidate(path: str, work: str) -> tuple[str, str | None, str]:
    """(HF dir, the run's config.yaml or None, the dir `eval.json` goes into by default) for `path`."""
    from training.checkpoint import resolve_checkpoint

    path = os.path.abspath(path)
    if is_hf_dir(path):
        return path, None, path
    tag_dir = resolve_checkpoint(path)
    return os.path.join(work, "hf"), run_config_of(tag_dir), path if os.path.isdir(path) else tag_dir


def export_to(tag_dir_or_run: str, hf_dir: str) -> None:
    from training.tools.export import export_checkpoint

    export_checkpoint(tag_dir_or_run, hf_dir, merge=_is_lora(tag_dir_or_run))  # LoRA: base + adapters, merged


def _is_lora(path: str) -> bool:
    from training.checkpoint import resolve_checkpoint
    from training.lora import read_adapter_record

    return read_adapter_record(resolve_checkpoint(path)) is not None


def table(results: dict[str, dict[str, float]]) -> str:
    rows = [(name, metric, v) for name, ms in results.items() for metric, v in ms.items()]
    w1 = max((len(r[0]) for r in rows), default=4)
    w2 = max((len(r[1]) for r in rows), default=6)
    lines = [f"{'task':<{w1}}  {'metric':<{w2}}  value"]
    lines += [f"{n:<{w1}}  {m:<{w2}}  {v:.6g}" for n, m, v in rows]
    return "\n".join(lines)


def nest(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """eval/<name>/<metric> -> {name: {metric: value}} (the suite's total time as eval/time_s -> all)."""
    out: dict[str, dict[str, float]] = {}
    for k, v in metrics.items():
        parts = k.split("/", 2)
        name, metric = (parts[1], parts[2]) if len(parts) == 3 else ("all", parts[-1])
        out.setdefault(name, {})[metric] = v
    return out


def _main(argv: list[str]) -> int:
    import torch.distributed as dist

    from training.config import validate
    from training.distributed import barrier, init_distributed

    args = [a for a in argv if not a.startswith("--local_rank")]
    ckpt = next((a.split("=", 1)[1] for a in args if a.startswith("checkpoint=")), None)
    out = next((a.split("=", 1)[1] for a in args if a.startswith("out=")), None)
    positional = [a for a in args if "=" not in a]
    if ckpt is None and positional:
        ckpt = positional.pop(0)
    if positional:
        raise ToolError(f"argument {positional[0]!r} is not key=value; give checkpoint=<dir> and Hydra overrides")
    if not ckpt:
        raise ToolError("checkpoint=<run dir | step dir | HF export> is required")
    overrides = [a for a in args if "=" in a and not a.startswith(("checkpoint=", "out="))]
    info = init_distributed()
    box: list[Any] = [None]
    if info.is_main:
        work = tempfile.mkdtemp(prefix="k3-eval-")
        try:
            hf_dir, run_cfg, where = consolidate(ckpt, work)
            if hf_dir.startswith(work):
                export_to(ckpt, hf_dir)
            box[0] = (work, hf_dir, run_cfg, where, None)
        except (ToolError, FileNotFoundError, ValueError, OSError) as e:
            box[0] = (work, None, None, None, str(e).splitlines()[0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    work, hf_dir, run_cfg, where, err = box[0]
    try:
        if err:
            raise ToolError(err)
        cfg = compose_eval_config(overrides, hf_dir, run_cfg, os.path.join(work, "run"))
        results = evaluate(cfg, validate(cfg, info.world_size))
        if info.is_main:
            path = out or os.path.join(where, "eval.json")
            print(table(results))
            with open(path, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1, sort_keys=True)
                f.write("\n")
            print(f"wrote {path}")
    finally:
        barrier()
        if info.is_main:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def evaluate(cfg: DictConfig, mcfg: Any) -> dict[str, dict[str, float]]:
    """Build the model like a training run (every rank) and run the evaluation suite once."""
    from training.eval.forward import EvalContext
    from training.eval.suite import EvalSuite
    from training.trainer import Trainer

    trainer = Trainer(cfg, mcfg)
    try:
        suite = EvalSuite(
            cfg.eval, trainer.loader.cfg, trainer.tokenizer, int(cfg.train.seq_len), str(cfg.train.loss_on)
        )
        rows = int(cfg.eval.batch_rows) or int(cfg.train.micro_batch_size)
        metrics = suite.run(EvalContext.of_trainer(trainer, rows))
    finally:
        trainer.logger.close()
        trainer.loader.close()
    return nest(metrics)


def main(argv: list[str] | None = None) -> int:
    from training.config import TrainConfigError

    return run_tool(_main, argv, __doc__ or "", (ToolError, TrainConfigError, FileNotFoundError, ValueError, OSError))


if __name__ == "__main__":
    from training.distributed import leave

    sys.exit(leave(main()))  # a launched rank ends without interpreter teardown (training/distributed.py)
