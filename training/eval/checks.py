"""Pre-flight of the `eval` section, run by `training.config.validate` before any process group: names, files,
task types. Reading the sets (empty, malformed, shorter than one row) needs the tokenizer: the suite's build at
the start of training checks that (training/eval/sets.py), before the first step; both say one line, exit 2."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from data import DataError, SourceConfig
from data.config import coerce_config
from training.checks import TrainConfigError


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise TrainConfigError(msg)


def check_eval(cfg: DictConfig) -> None:
    from data.sources import resolve_files
    from training.eval.tasks import TASK_TYPES, task_class

    e = cfg.eval
    _need(e.every >= 0, f"eval.every must be >= 0 (0 = off), got {e.every}")
    _need(e.batch_rows >= 0, f"eval.batch_rows must be >= 0 (0 = train.micro_batch_size), got {e.batch_rows}")
    names: list[str] = []
    data_sources = coerce_config(cfg.data).sources
    for i, s in enumerate(e.sets):
        _need(bool(s.name), f"eval.sets[{i}] has no name; give it name: <set> (its metrics are eval/<set>/...)")
        names.append(str(s.name))
        _need(s.rows >= 0, f"eval.sets[{i}].rows must be >= 0 (0 = the whole set), got {s.rows}")
        _need(
            bool(s.heldout) != bool(len(s.sources)),
            f"eval.sets[{i}] ({s.name}) needs exactly one of heldout: true (the held-out share of data.sources) "
            f"or sources: [...]",
        )
        if s.heldout:
            _need(
                any(d.holdout > 0 for d in data_sources),
                f"eval.sets[{i}] ({s.name}) is the held-out part of data.sources, but none holds any out: set "
                f"data.sources[i].holdout (e.g. 0.02) or give the set its own sources",
            )
        for j, src in enumerate(s.sources):
            try:
                resolve_files(SourceConfig(**OmegaConf.to_container(src, resolve=True)), j)  # type: ignore[arg-type]
            except (DataError, TypeError) as err:
                raise TrainConfigError(f"eval.sets[{i}] ({s.name}): {str(err).replace('data.', '', 1)}") from None
    for i, t in enumerate(e.tasks):
        spec: dict[str, Any] = OmegaConf.to_container(t, resolve=True)  # type: ignore[assignment]
        kind = spec.get("type")
        _need(bool(kind), f"eval.tasks[{i}] has no type; give type: <{'|'.join(sorted(TASK_TYPES))}>")
        cls = task_class(str(kind))
        names.append(str(spec.get("name") or kind))
        cls.check(spec, cfg)
    dup = sorted({n for n in names if names.count(n) > 1})
    _need(not dup, f"eval set/task names {dup} repeat: give each a distinct name (metrics are eval/<name>/...)")
    best = cfg.checkpoint.get("keep_best")
    if best:
        from training.eval.goals import goal

        parts = str(best).split("/", 2)
        _need(
            len(parts) == 3 and parts[0] == "eval" and parts[1] in names and goal(str(best)) is not None,
            f"checkpoint.keep_best={best} is not a metric this run evaluates: give eval/<set or task>/<loss|ppl|bpb|"
            f"acc|acc_norm> with one of the names {names or '(none configured)'}",
        )
        _need(e.every > 0, f"checkpoint.keep_best={best} needs evaluations: set eval.every > 0")
