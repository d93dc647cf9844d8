"""Training entry point: compose -> validate -> build -> loop.

    python -m training.train experiment=smoke train.steps=50            # one process (1-rank gloo group)
    deepspeed --no_local_rank --num_gpus 2 training/train.py experiment=smoke

Every rank composes the same config and writes into the same `run_dir`. A bad config exits with one line on
stderr and status 2 before any process group, run directory or checkpoint is touched.

Loss normalisation: each micro-batch's mean CE is rescaled by (its target count x DP x GA / global target count)
so that after DeepSpeed's 1/GA scaling and DP averaging the gradient is that of the global-batch token mean, the
same for any split of the global batch into ranks and micro-batches (DP=2,GA=1 == DP=1,GA=2).
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script by the deepspeed launcher: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _strip_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N (without --no_local_rank); Hydra would reject it."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank="):
            continue
        if a == "--local_rank":
            skip = True
            continue
        out.append(a)
    return out


PROCESS_START = __import__("time").time()  # for time-to-first-step (excludes the launcher's own start-up)
sys.argv = _strip_local_rank(sys.argv)

import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from training.config import (  # noqa: E402
    CONF_DIR,
    TrainConfigError,
    global_batch_rows,
    resolve_run_dir,
    validate,
)
from training.distributed import env_world  # noqa: E402

EXIT_ENV = "K3_TEST_EXIT_AFTER_STEP"
# DeepSpeed's ZeRO collectives call a torch API deprecated in 2.13; the warning repeats on every rank and step.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # silences DeepSpeed's accelerator-detection warning


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def mask_cross_segment_targets(labels_1N: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """-100 at every segment start: that target would be predicted from the previous document."""
    out = labels_1N.clone()
    starts = cu_seqlens[:-1].long()
    out[0, starts] = -100
    return out


def count_targets(labels_1N: torch.Tensor) -> int:
    """Targets the shifted CE averages over (position t predicts labels[t + 1])."""
    return int((labels_1N[:, 1:] != -100).sum())


def flatten_microbatch(mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """[b, T] rows -> one packed [1, b*T] stream with cu_seqlens; returns (ids, labels, cu, n_targets)."""
    ids_1N = mb["input_ids"].reshape(1, -1).long()
    cu = torch.as_tensor(mb["cu_seqlens"], dtype=torch.int64)
    labels_1N = mask_cross_segment_targets(mb["labels"].reshape(1, -1).long(), cu)
    return ids_1N, labels_1N, cu, count_targets(labels_1N)


def check_data_config(cfg: DictConfig) -> None:
    """Pre-flight data checks that need no process group: the data config itself, local paths, tokenizer file."""
    import glob

    from data import DataError
    from data.config import coerce_config

    try:
        dcfg = coerce_config(OmegaConf.to_object(cfg.data))
    except DataError as e:
        raise TrainConfigError(str(e)) from None
    tok = dcfg.tokenizer.model_path
    if tok and not os.path.isfile(tok):
        raise TrainConfigError(f"data.tokenizer.model_path={tok} does not exist; fix it, or set it to null to "
                               "train (and cache) the default tokenizer")
    for i, src in enumerate(dcfg.sources):
        if src.type in ("embedded", "hub"):
            continue
        if not os.path.exists(src.path) and not glob.glob(src.path):
            raise TrainConfigError(f"data.sources[{i}].path={src.path} does not exist; fix the path or glob")


class Trainer:
    """Owns the engine, loader, logger and the step counter; `run` is the whole job."""

    def __init__(self, cfg: DictConfig, mcfg) -> None:
        from data import GlobalBatchLoader, prepare_tokenizer
        from model import K3ForCausalLM
        from training import checkpoint as ckpt
        from training.distributed import DistStatsReducer, barrier, init_distributed
        from training.engine import build_ds_config, initialize, param_groups
        from training.metrics import RunLogger, flops_per_token, peak_flops

        self.cfg, self.mcfg = cfg, mcfg
        self.info = init_distributed()
        self.run_dir = resolve_run_dir(cfg)
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        t = cfg.train
        self.ga, self.world = int(t.grad_accum), self.info.world_size
        self.global_rows = global_batch_rows(cfg, self.world)
        seed_everything(int(t.seed))

        # --- run dir: resolved config + DeepSpeed JSON (rank 0), everyone waits for it ---------------------
        self.ds_config = build_ds_config(cfg, self.world)
        if self.info.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
            OmegaConf.save(cfg, os.path.join(self.run_dir, "config.yaml"), resolve=True)
            with open(os.path.join(self.run_dir, "ds_config.json"), "w", encoding="utf-8") as f:
                json.dump(self.ds_config, f, indent=2, sort_keys=True)
            mcfg.save(os.path.join(self.run_dir, "model"))
        # --- tokenizer: rank 0 trains/caches it first, the others then load the cached file -----------------
        data_cfg = OmegaConf.to_object(cfg.data)
        if self.info.is_main:
            self.tokenizer = prepare_tokenizer(data_cfg)
            self.tokenizer.save(self.run_dir)
        barrier()
        if not self.info.is_main:
            self.tokenizer = prepare_tokenizer(data_cfg)
        if self.tokenizer.vocab_size > mcfg.vocab_size:
            raise TrainConfigError(f"tokenizer vocab {self.tokenizer.vocab_size} > model.vocab_size "
                                   f"{mcfg.vocab_size}; raise model.vocab_size or use a smaller tokenizer")

        # --- model (same seed on every rank), optional HF init, EP, engine -------------------------------------
        torch.manual_seed(int(t.seed))
        self.model = K3ForCausalLM(mcfg)
        if cfg.model.init_from:
            from model import load_hf_checkpoint

            src = load_hf_checkpoint(cfg.model.init_from, dtype=torch.float32)
            self.model.load_state_dict(src.state_dict(), strict=True)
            del src
        if t.activation_checkpointing:
            for layer in self.model.model.layers:
                layer.gradient_checkpointing = True
        groups = param_groups(self.model, float(cfg.schedule.weight_decay))
        self.ep = None
        self.reducer = DistStatsReducer()
        resume_dir = self.resume_dir(cfg)
        if cfg.parallel.ep_size > 1 or (resume_dir and ckpt.has_expert_files(resume_dir)):
            from training.expert_parallel import setup_expert_parallel

            self.ep = setup_expert_parallel(self.model, int(cfg.parallel.ep_size), int(cfg.deepspeed.zero_stage))
            groups = self.ep.param_groups(self.model, groups)
            self.reducer = self.ep.stats_reducer()
        self.engine, self.optimizer, self.scheduler = initialize(cfg, self.model, self.ds_config, groups)
        from training import guard, safe_load

        safe_load.install(self.engine)  # checkpoints are untrusted: never unpickle code
        guard.install(self.engine)  # ZeRO-0: skip non-finite steps like the ZeRO optimizers do
        self.guard = guard.StepGuard(int(t.max_bad_steps))
        self.device = self.engine.device
        self.module = self.engine.module

        self.loader = GlobalBatchLoader(data_cfg, self.tokenizer, int(t.seq_len), self.global_rows,
                                        int(t.micro_batch_size), self.info.rank, self.world, int(t.seed))
        self.flops_per_token = flops_per_token(mcfg, int(t.seq_len), training=True)
        self.peak = peak_flops()  # per device; on CPU the machine's measured fp32 matmul peak
        self.step, self.tokens_seen, run_id = 0, 0, None

        # --- resume -------------------------------------------------------------------------------------------
        tag_dir, r = resume_dir, cfg.checkpoint.resume
        if tag_dir is not None:
            state, rank_state = ckpt.load(self.engine, tag_dir, self.info.rank, self.world,
                                          ep_load=self.ep.load_checkpoint if self.ep else None)
            self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
            self.guard.load_state_dict(state)
            run_id = state.get("wandb_run_id")
            if rank_state.get("data") is not None:
                self.loader.load_state_dict(rank_state["data"])
            if rank_state.get("rng") is not None:
                ckpt.set_rng_state(rank_state["rng"])
            if self.info.is_main:
                print(f"resumed from {tag_dir} at step {self.step}", flush=True)
        self.resumed_from = tag_dir
        self.logger = RunLogger(self.run_dir, OmegaConf.to_container(cfg, resolve=True), mode=cfg.logging.mode,
                                project=cfg.logging.project, run_id=run_id, total_steps=int(t.steps),
                                is_main=self.info.is_main, heatmap_every=int(cfg.logging.heatmap_every),
                                resume=tag_dir is not None, start_step=self.step,
                                progress=bool(cfg.logging.progress))
        self.moe_layer_ids = [i for i in range(mcfg.num_hidden_layers) if mcfg.is_moe_layer(i)]

    def resume_dir(self, cfg: DictConfig) -> str | None:
        """The checkpoint to resume from (auto: newest COMPLETE one in this run dir), or None for a fresh start."""
        from training import checkpoint as ckpt

        from training.safe_load import pick_resume

        r = cfg.checkpoint.resume
        if r == "none":
            return None
        found = ckpt.find_latest(self.ckpt_root) if r == "auto" else ckpt.resolve_checkpoint(r)
        return pick_resume(found, bool(cfg.checkpoint.fallback), self.info.is_main)

    # --- one optimizer step -------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        from training import faults
        from training.distributed import all_reduce_sum
        from training.guard import discard_balance_stats

        mbs = [flatten_microbatch(self.loader.next_microbatch()) for _ in range(self.ga)]
        local = torch.tensor([sum(m[3] for m in mbs), sum(int(m[0].numel()) for m in mbs)], dtype=torch.float64)
        n_global, tok_global = (int(x) for x in all_reduce_sum(local))
        scale_base = self.world * self.ga / max(1, n_global)
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        counts_LE = None
        lr = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else float(self.cfg.optim.lr)
        for ids, labels, cu, n in mbs:
            out = self.engine(ids.to(self.device), labels=labels.to(self.device), cu_seqlens=cu.to(self.device))
            loss = faults.poison_loss(out.loss, self.step + 1, self.info.rank)
            self.engine.backward(loss * (n * scale_base) if n > 0 else loss * 0.0)
            self.engine.step()
            ce = loss.detach().double() - (out.aux_loss.detach().double() if out.aux_loss is not None else 0.0)
            loss_sum += ce.cpu() * n
            if out.aux_loss is not None:
                aux_sum += out.aux_loss.detach().double().cpu() / self.ga
            if out.router_stats:
                c = torch.stack([s.tokens_per_expert.detach().cpu().long() for s in out.router_stats])
                counts_LE = c if counts_LE is None else counts_LE + c
        totals = all_reduce_sum(torch.stack([loss_sum, aux_sum]))
        skipped = self.guard.after_step(self.step + 1, self.engine.was_step_applied(),
                                        float(totals[0]) / max(1, n_global))
        if skipped:  # weights, optimizer, LR schedule untouched; the bad forward's routing stats are dropped
            discard_balance_stats(self.module)
            balance = {}
        else:
            balance = self.module.update_balance(self.reducer) or {}
        gn = self.engine.get_global_grad_norm()
        metrics: dict[str, Any] = {
            "loss": float(totals[0]) / max(1, n_global),
            "lr": lr,
            "grad_norm": float(gn) if gn is not None else float("nan"),
            "tokens": tok_global,
            "loss_tokens": n_global,
            "skipped_steps": self.guard.skipped_steps,
        }
        if self.module.config.moe_balance == "aux":
            metrics["aux_loss"] = float(totals[1]) / self.world
        if counts_LE is not None:  # tokens of every rank (global expert ids): the global batch's loads
            counts_LE = all_reduce_sum(counts_LE)
        return metrics, counts_LE, balance

    def biases_LE(self) -> torch.Tensor | None:
        layers = self.module.moe_layers()
        if not layers:
            return None
        return torch.stack([m.gate.e_score_correction_bias.detach().float().cpu() for m in layers])

    def balance_extra(self, balance: dict[str, Any]) -> list[dict[str, float]] | None:
        """update_balance's {"layer{i}/name": v} -> one dict of scalars per MoE layer (router_metrics' extra)."""
        per = [{} for _ in self.moe_layer_ids]
        index = {i: n for n, i in enumerate(self.moe_layer_ids)}
        for key, v in balance.items():
            head, _, name = key.partition("/")
            if head.startswith("layer") and head[5:].isdigit() and int(head[5:]) in index and isinstance(
                    v, (int, float)) and not name.startswith("bias_"):
                per[index[int(head[5:])]][name] = float(v)
        return per if any(per) else None

    def save(self) -> None:
        from training import checkpoint as ckpt
        from training.checkpoint import rng_state

        state = {"step": self.step, "tokens_seen": self.tokens_seen, "wandb_run_id": self.logger.run_id,
                 "world_size": self.world, "global_batch_rows": self.global_rows, **self.guard.state_dict()}

        def extra(tag_dir: str) -> None:
            self.mcfg.save(tag_dir)
            self.tokenizer.save(tag_dir)

        ckpt.save(self.engine, self.ckpt_root, self.step, state,
                  {"rng": rng_state(), "data": self.loader.state_dict()}, self.info.rank,
                  int(self.cfg.checkpoint.keep_last), extra_files=extra,
                  client_extra=self.ep.client_state() if self.ep else None)

    def stop_bad_steps(self) -> None:
        """Too many consecutive non-finite steps: checkpoint (weights of the last good step) and stop."""
        from training.guard import TooManyBadSteps

        self.save()
        msg = self.guard.message(self.step, os.path.join(self.ckpt_root, f"step_{self.step:08d}"))
        self.logger.close()
        raise TooManyBadSteps(msg)

    def run(self) -> None:
        from training import faults
        from training.metrics import memory_stats, mfu, router_metrics

        cfg, t = self.cfg, self.cfg.train
        exit_after = t.exit_after_step if t.exit_after_step is not None else (
            int(os.environ[EXIT_ENV]) if os.environ.get(EXIT_ENV) else None)
        every, ck_every = int(cfg.logging.every), int(cfg.checkpoint.every)
        t_start, first_loss, last, first_step_s = time.time(), None, {}, None
        t_last, tok_last = time.time(), 0
        window: list[float] = []  # per-step losses since the last log line
        first_avg = None
        while self.step < int(t.steps):
            metrics, counts_LE, balance = self.train_step()
            self.step += 1
            self.tokens_seen += metrics["tokens"]
            tok_last += metrics["tokens"]
            if first_loss is None:
                first_loss = metrics["loss"]
                metrics["time_to_first_step_s"] = first_step_s = time.time() - PROCESS_START
            last = metrics
            window.append(float(metrics["loss"]))
            if self.step % every == 0 or self.step == int(t.steps):
                metrics["loss_avg"] = sum(window) / len(window)
                first_avg = metrics["loss_avg"] if first_avg is None else first_avg
                window.clear()
                now = time.time()
                tps = tok_last / max(1e-9, now - t_last)
                t_last, tok_last = now, 0
                metrics.update(tokens_per_s=tps, mfu=mfu(tps / self.world, self.flops_per_token, self.peak),
                               tokens_seen=self.tokens_seen, **memory_stats())
                if counts_LE is not None:
                    metrics.update(router_metrics(counts_LE.float(), self.biases_LE(), self.moe_layer_ids,
                                                  self.balance_extra(balance)))
                    self.logger.log_heatmap(self.step, counts_LE, self.moe_layer_ids)
                stats = self.loader.stats() if hasattr(self.loader, "stats") else {}
                metrics.update({f"data/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
                self.logger.log(self.step, metrics)
            faults.after_step(self.step, self.info.rank)
            if self.guard.exhausted:
                self.stop_bad_steps()
            if (ck_every and self.step % ck_every == 0) or (
                    self.step == int(t.steps) and cfg.checkpoint.save_final):
                self.save()
            if exit_after is not None and self.step == int(exit_after):
                self.logger.close()
                os._exit(17)  # a hard kill for the resume tests: no cleanup, no final checkpoint
        elapsed = time.time() - t_start
        self.logger.summary({"steps": self.step, "final_loss": last.get("loss"), "first_loss": first_loss,
                             "first_loss_avg": first_avg, "final_loss_avg": last.get("loss_avg"),
                             "tokens_seen": self.tokens_seen, "elapsed_s": elapsed,
                             "time_to_first_step_s": first_step_s,
                             "tokens_per_s": self.tokens_seen / max(1e-9, elapsed)})
        self.logger.close()
        if hasattr(self.loader, "close"):
            self.loader.close()


def run(cfg: DictConfig, mcfg) -> None:
    Trainer(cfg, mcfg).run()


def launch_sweep_job(cfg: DictConfig) -> None:
    """In a Hydra multirun, start this job as its own deepspeed launch and wait for it (one process group per
    job; the sweeping process itself never joins one)."""
    import subprocess

    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if not o.startswith(("launcher.", "hydra."))]
    if not any(o.startswith("run_dir=") for o in overrides):
        overrides.append(f"run_dir={os.path.join('runs', 'sweep', cfg.name, str(hc.job.num))}")
    cmd = ["deepspeed", "--no_local_rank", "--num_gpus", str(cfg.launcher.num_gpus)]
    if cfg.launcher.hostfile:
        cmd += ["--hostfile", cfg.launcher.hostfile]
    cmd += [os.path.abspath(__file__), *overrides]
    print("sweep job:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(f"sweep job {hc.job.num} failed with exit status {rc}")


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    info = env_world()
    if cfg.launcher.num_gpus > 0 and "RANK" not in os.environ:
        launch_sweep_job(cfg)
        return
    from training.guard import RunDirError, TooManyBadSteps, check_run_dir, checkpoint_bytes_estimate
    from training.safe_load import CheckpointError

    try:
        mcfg = validate(cfg, info.world_size)
        check_data_config(cfg)
        from model.params import count_params

        check_run_dir(resolve_run_dir(cfg), checkpoint_bytes_estimate(count_params(mcfg)[0],
                                                                      int(cfg.checkpoint.keep_last)))
    except (TrainConfigError, ValueError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        run(cfg, mcfg)
    except (CheckpointError, TooManyBadSteps) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
