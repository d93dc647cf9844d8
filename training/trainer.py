"""The trainer: build (process group, tokenizer, model, engine, loader, resume), one optimizer step, the loop.

Everything around the loop (loss windows, throughput, router health, test-only fault injection) is a callback
(training/callbacks/); parallelism is set up by training/parallelize.py (built sharded by
training/parallel/construct.py) and DeepSpeed (training/engine.py);
checkpoints and the resume policy live in training/checkpoint/. One step, in order: the loader's micro-batches ->
model forward/backward under the DeepSpeed engine -> engine.step -> the guard's skip decision -> the balancers
(global routing statistics, training/balance.py) -> callbacks add to the log record -> logger -> checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from data import GlobalBatchLoader, Tokenizer, atomic_write, prepare_tokenizer
from data.images import MEDIA_PAD, ImageRules
from model import K3Config
from model.k3 import K3ForCausalLM
from training import balance, checkpoint
from training.callbacks import CallbackList, default_callbacks, load_callback
from training.checkpoint import safe_load
from training.checks import checkpoint_tokenizer
from training.config import (
    TrainConfigError,
    data_parallel_size,
    global_batch_rows,
    resolve_run_dir,
)
from training.distributed import all_reduce_sum, barrier, init_distributed
from training.engine import base_param_groups, build_ds_config, initialize
from training.eval.callback import eval_callbacks
from training.freeze import freeze
from training.guard import StepGuard, TooManyBadSteps
from training.guard import install as install_guard
from training.lora import (
    adapter_record,
    checkpoint_without_autoep,
    gather_adapters,
    lora_spec,
    write_adapter_record,
    write_adapter_weights,
)
from training.metrics import RunLogger, flops_per_token, peak_flops
from training.optim.qk_clip import QKClip
from training.parallel.construct import build_model
from training.parallel.ulysses import gradient_averaging_ranks
from training.step import StepResult, pack_microbatch


def image_rules(mcfg: K3Config) -> ImageRules | None:
    """The data pipeline's image geometry from the model's tower (None: a text model, image rows are skipped)."""
    v = mcfg.vision_config
    if v is None:
        return None
    return ImageRules(v.patch_size, v.merge_kernel_size[0], v.in_patch_limit, v.patch_limit_per_side)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


CONVERSION_NOTE = """# Converting these checkpoints

Use `python -m training.export <run_dir> <out_dir>`: it writes a consolidated Hugging Face checkpoint (config,
safetensors, tokenizer) from any ZeRO stage and any expert-parallel size, and `model.load_hf_checkpoint(out_dir)`
reads it back.

DeepSpeed copies `zero_to_fp32.py` next to its checkpoints. It fails on expert-parallel checkpoints (ZeRO 1/2 with
`parallel.ep_size > 1` store one `layer_*_expert_*_model_states.pt` file per expert, which it reads as a model
state file: "... is not a model state checkpoint"), and DeepSpeed's `ds_to_universal` refuses them too (no
`universal_checkpoint_info`). `training.export` consolidates the per-expert files by global expert id.

ZeRO-3 checkpoints (any `parallel.ep_size`) hold the experts inside the ZeRO shards ("zero3_partitioned"):
`zero_to_fp32.py` refuses them and `python -m deepspeed.checkpoint.ds_to_universal` consolidates them, which is what
`training.export` (and a resume at another EP size or world size) runs.
"""


def write_conversion_note(ckpt_root: str) -> None:
    """`checkpoints/README.md` beside DeepSpeed's zero_to_fp32.py: which converter works for these checkpoints."""
    path = os.path.join(ckpt_root, "README.md")
    if not os.path.exists(path):
        atomic_write(path, CONVERSION_NOTE)


class Trainer:
    """Owns the engine, loader, logger, callbacks and the step counter; `run` is the whole job."""

    def __init__(self, cfg: DictConfig, mcfg: K3Config) -> None:
        self.cfg, self.mcfg = cfg, mcfg
        self.info = init_distributed(float(cfg.parallel.timeout_s))
        self.is_main = self.info.is_main
        self.run_dir = resolve_run_dir(cfg)
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        t = cfg.train
        self.ga, self.world = int(t.grad_accum), self.info.world_size
        self.dp = data_parallel_size(cfg, self.world)  # ranks with different rows (sequence parallelism shares)
        self.global_rows = global_batch_rows(cfg, self.world)
        self.callbacks = CallbackList(
            [*default_callbacks(), *eval_callbacks(cfg), *(load_callback(p) for p in cfg.callbacks)]
        )
        seed_everything(int(t.seed))
        self.ds_config = build_ds_config(cfg, self.world)
        self.tokenizer = self._prepare_tokenizer()
        self.mcfg = mcfg = self._media_id(mcfg)
        self._write_run_files()

        # --- model: built sharded and laid out by training/parallel (each rank only what it owns), engine -------
        resume_from = checkpoint.resume_dir(
            cfg.checkpoint.resume, self.ckpt_root, bool(cfg.checkpoint.fallback), self.is_main
        )
        self.plan = checkpoint.plan_for(cfg, mcfg, self.world, resume_from, self.run_dir)  # same run? horizon
        self.model, self.ep = build_model(
            mcfg,
            int(t.seed),
            int(cfg.parallel.ep_size),
            int(cfg.deepspeed.zero_stage),
            self.ds_config,
            cfg.model.init_from,
            expert_files=bool(resume_from and checkpoint.has_expert_files(resume_from)),
            sp_size=int(cfg.parallel.sp_size),
            lora=lora_spec(cfg),
        )
        self.lora = self.model.lora_spec if hasattr(self.model, "lora_spec") else None
        self.model.set_gradient_checkpointing(bool(t.activation_checkpointing), offload=bool(t.activation_offload))
        self.model.set_loss_tiling(int(t.loss_tile_tokens))  # tiled logits + CE: no [T, V] logits (model/loss.py)
        self.model.set_ffn_tiling(int(t.ffn_tile_tokens))  # FFN recompute over sequence tiles (model/ffn.py)
        self.model.set_mixer_tiling(int(t.mixer_tile_tokens))  # KDA core over recomputed tiles (model/kda/tiled.py)
        self.model.set_expert_backend(str(cfg.model.get("expert_backend", "auto")))  # model/moe/grouped.py
        for lm in (m for m in self.model.modules() if isinstance(m, K3ForCausalLM)):
            lm.mtp_weight = float(t.mtp_weight)  # loss = main + mtp_weight x mean depth CE (model/mtp.py)
        self.frozen_params = freeze(self.model, [str(g) for g in t.freeze])  # before the optimizer sees them
        groups = self.ep.param_groups(self.model, base_param_groups(cfg, self.model))
        self.reducer = self.ep.stats_reducer()
        self.grad_ranks = gradient_averaging_ranks(self.world, self.ep.sp_size, int(cfg.deepspeed.zero_stage))
        if resume_from:  # another layout's ZeRO-3 checkpoint: DeepSpeed's universal format (training/parallel)
            self.ds_config = self.ep.prepare_resume(self.ds_config, resume_from, self.run_dir)
        self.engine, self.optimizer, self.scheduler = initialize(
            cfg, self.model, self.ds_config, groups, total_steps=self.plan.horizon, mpu=self.ep.mpu
        )
        safe_load.install(self.engine)  # checkpoints are untrusted: never unpickle code
        install_guard(self.engine)  # ZeRO-0: skip non-finite steps like the ZeRO optimizers do
        self.guard = StepGuard(int(t.max_bad_steps))
        self.device = self.engine.device
        self.module = self.engine.module
        self.moe_layers = self.module.moe_layers()
        self.qk_clip = QKClip(self.module, cfg.optim.qk_clip_tau)
        self.moe_layer_ids = [d.layer_idx for d in self.module.decoder_layers() if d.is_moe]  # MTP: L..L+D-1

        self.loader = GlobalBatchLoader(
            OmegaConf.to_object(cfg.data),
            self.tokenizer,
            int(t.seq_len),
            self.global_rows,
            int(t.micro_batch_size),
            self.info.rank // self.ep.sp_size,  # a sequence-parallel group reads its rows once per rank
            self.dp,
            int(t.seed),
            loss_on=str(t.loss_on),
            images=image_rules(mcfg),
        )
        self.flops_per_token = flops_per_token(mcfg, int(t.seq_len), training=True)
        self.peak = peak_flops()  # per device; on CPU the machine's measured fp32 matmul peak
        self.step, self.tokens_seen, run_id = 0, 0, None
        if resume_from is not None:
            run_id = self._resume(resume_from)
        self.start_step = self.step
        self.resumed_from = resume_from
        self.logger = RunLogger(
            self.run_dir,
            self.effective_config(),
            mode=cfg.logging.mode,
            project=cfg.logging.project,
            run_id=run_id,
            total_steps=int(t.steps),
            is_main=self.is_main,
            heatmap_every=int(cfg.logging.heatmap_every),
            resume=resume_from is not None,
            start_step=self.step,
            progress=bool(cfg.logging.progress),
        )

    # --- build helpers ------------------------------------------------------------------------------------------
    def effective_config(self) -> dict[str, Any]:
        """The resolved run config with the model section as the model actually built (every K3Config field,
        not nulls for what the preset filled in): what config.yaml and the W&B config record."""
        out = OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
        model = dataclasses.asdict(self.mcfg)
        out["model"] = {
            "preset": self.cfg.model.preset,
            "init_from": self.cfg.model.init_from,
            **{k: model[k] for k in out["model"] if k in model},
        }
        return out

    def _media_id(self, mcfg: K3Config) -> K3Config:
        """With a vision tower, `<|media_pad|>` must be the tokenizer's: a fresh model whose config does not set
        `model.media_placeholder_token_id` takes the tokenizer's id (said in one line); otherwise they must agree."""
        if mcfg.vision_config is None:
            return mcfg
        tid = self.tokenizer.token_to_id(MEDIA_PAD)
        if tid is None:
            raise TrainConfigError(
                "a model with a vision tower needs a tokenizer with <|media_pad|>: use data.tokenizer.type=tiktoken "
                "(K3's layout) or the checkpoint's own tokenizer"
            )
        if tid == mcfg.media_placeholder_token_id:
            return mcfg
        if self.cfg.model.media_placeholder_token_id is None and not self.cfg.model.init_from:
            if self.is_main:
                print(f"model: media_placeholder_token_id={tid} (the tokenizer's <|media_pad|>)", flush=True)
            return mcfg.replace(media_placeholder_token_id=tid)
        raise TrainConfigError(
            f"model.media_placeholder_token_id={mcfg.media_placeholder_token_id} but the tokenizer's <|media_pad|> "
            f"is {tid}; set model.media_placeholder_token_id={tid} or use the checkpoint's own tokenizer"
        )

    def _write_run_files(self) -> None:
        """Rank 0: resolved config, the generated DeepSpeed JSON and the model config."""
        if self.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
            OmegaConf.save(OmegaConf.create(self.effective_config()), os.path.join(self.run_dir, "config.yaml"))
            with open(os.path.join(self.run_dir, "ds_config.json"), "w", encoding="utf-8") as f:
                json.dump(self.ds_config, f, indent=2, sort_keys=True)
            self.mcfg.save(os.path.join(self.run_dir, "model"))

    def _prepare_tokenizer(self) -> Tokenizer:
        """The checkpoint's own tokenizer for `model.init_from`; otherwise rank 0 trains/caches the configured one
        first and the others then load the cached file."""
        data_cfg = OmegaConf.to_object(self.cfg.data)
        if self.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
        tok = checkpoint_tokenizer(self.cfg)
        if tok is not None:
            if self.is_main:
                tok.save(self.run_dir)
            return tok
        tok = prepare_tokenizer(data_cfg) if self.is_main else None
        if tok is not None:
            tok.save(self.run_dir)
        barrier()
        if tok is None:
            tok = prepare_tokenizer(data_cfg)
        if tok.vocab_size > self.mcfg.vocab_size:
            raise TrainConfigError(
                f"tokenizer vocab {tok.vocab_size} > model.vocab_size {self.mcfg.vocab_size}; "
                "raise model.vocab_size or use a smaller tokenizer"
            )
        return tok

    def _resume(self, tag_dir: str) -> str | None:
        """Restore engine, trainer counters, guard, data position and RNG; returns the W&B run id."""
        base_lrs = list(self.scheduler.base_lrs) if self.scheduler is not None else []
        with checkpoint_without_autoep(self.module, self.lora is not None and self.ep.autoep):
            state, rank_state = checkpoint.load(
                self.engine,
                tag_dir,
                self.info.rank,
                self.world,
                ep_load=self.ep.load_checkpoint,
                frozen_excluded=self.lora is not None,
            )
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.guard.load_state_dict(state)
        checkpoint.apply_plan(self.plan, self.loader, rank_state.get("data"), self.scheduler, base_lrs, self.is_main)
        if rank_state.get("rng") is not None:
            checkpoint.set_rng_state(rank_state["rng"])
        if self.is_main:
            print(f"resumed from {tag_dir} at step {self.step}", flush=True)
        return state.get("wandb_run_id")

    # --- one optimizer step -------------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        sp = (self.ep.sp_size, self.ep.sp_rank, self.mcfg.media_placeholder_token_id, self.mcfg.mtp_depth)
        mbs = [pack_microbatch(self.loader.next_microbatch(), *sp) for _ in range(self.ga)]
        local = torch.tensor(
            [sum(m.n_targets for m in mbs), sum(int(m.ids_1N.numel()) for m in mbs)], dtype=torch.float64
        )
        n_global, tok_global = (int(x) for x in all_reduce_sum(local))
        scale_base = self.grad_ranks * self.ga / max(1, n_global)
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        mtp_sums = torch.zeros(2 * self.mcfg.mtp_depth, dtype=torch.float64)  # per depth: CE sum, target count
        routing = balance.StepRouting()
        lr = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else float(self.cfg.optim.lr)
        self.qk_clip.begin_step(track=self.is_log_step(self.step + 1))
        for mb in mbs:
            out = self.engine(**mb.model_inputs(self.device))
            n = mb.n_targets
            loss_t, aux_t, mtp_t = out.loss, out.aux_loss, out.mtp_loss
            for k, (l_k, c_k) in enumerate(zip(out.mtp_losses or [], out.mtp_counts or [])):
                mtp_sums[2 * k : 2 * k + 2] += torch.stack([l_k.detach().double() * c_k, c_k.double()]).cpu()
            routing.add(out.router_stats)
            objective = mb.objective(out, float(self.cfg.train.mtp_weight), scale_base)
            del out  # its logits [B, T, V] would live through backward, the optimizer step and the next forward
            self.engine.backward(objective)
            self.engine.step()
            aux = aux_t.detach().double() if aux_t is not None else None
            mtp = mtp_t.detach().double() if mtp_t is not None else 0.0
            loss_sum += (loss_t.detach().double() - (aux if aux is not None else 0.0) - mtp).cpu() * n
            if aux is not None:
                aux_sum += aux.cpu() / self.ga
        totals = all_reduce_sum(torch.cat([torch.stack([loss_sum, aux_sum]), mtp_sums]))
        loss = float(totals[0]) / max(1, n_global)
        mtp_metrics = {f"loss/mtp_{k + 1}": float(totals[2 + 2 * k]) / max(1.0, float(totals[3 + 2 * k]))
                       for k in range(self.mcfg.mtp_depth)}  # fmt: skip
        skipped = self.guard.after_step(self.step + 1, self.engine.was_step_applied(), loss)
        global_stats = routing.reduce_global(self.reducer)  # collective on every rank, skipped or not
        extra = [] if skipped else balance.apply(self.moe_layers, global_stats)  # a bad step moves no bias
        qk = self.qk_clip.after_step(applied=not skipped)  # collective; clips the weights the next forward sees
        gn = self.engine.get_global_grad_norm()
        return StepResult(
            loss=loss,
            lr=lr,
            grad_norm=float(gn) if gn is not None else float("nan"),
            tokens=tok_global,
            loss_tokens=n_global,
            skipped=skipped,
            aux_loss=float(totals[1]) / self.world if self.mcfg.moe_balance == "aux" else None,
            counts_LE=balance.counts_LE(global_stats),
            balance_extra=extra,
            metrics={**mtp_metrics, **qk},
        )

    # --- checkpoints --------------------------------------------------------------------------------------------
    def save(self) -> None:
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "wandb_run_id": self.logger.run_id,
            "world_size": self.world,
            "global_batch_rows": self.global_rows,
            **self.guard.state_dict(),
            **self.plan.state(),
        }

        record = adapter_record(self.cfg, self.plan.identity) if self.lora is not None else None
        adapters = gather_adapters(self.module, self.ep) if self.lora is not None else None  # collective

        def extra(tag_dir: str) -> None:
            self.mcfg.save(tag_dir)
            self.tokenizer.save(tag_dir)
            if record is not None and adapters is not None:
                write_adapter_record(tag_dir, record)
                write_adapter_weights(tag_dir, adapters)

        def on_phase(phase: str, step: int) -> None:
            self.callbacks.on_checkpoint_phase(self, phase, step)

        if self.is_main:
            write_conversion_note(self.ckpt_root)
        with checkpoint_without_autoep(self.module, self.lora is not None and self.ep.autoep):
            checkpoint.save(
                self.engine,
                self.ckpt_root,
                self.step,
                state,
                {"rng": checkpoint.rng_state(), "data": self.loader.state_dict()},
                self.info.rank,
                int(self.cfg.checkpoint.keep_last),
                extra_files=extra,
                client_extra=self.ep.client_state() if self.ep.group_name else None,
                on_phase=on_phase,
                exclude_frozen=self.lora is not None,
            )

    def stop_bad_steps(self) -> None:
        """Too many consecutive non-finite steps: checkpoint (weights of the last good step) and stop."""
        self.save()
        msg = self.guard.message(self.step, os.path.join(self.ckpt_root, checkpoint.tag_for(self.step)))
        self.logger.close()
        raise TooManyBadSteps(msg)

    # --- the loop -----------------------------------------------------------------------------------------------
    def is_log_step(self, step: int | None = None) -> bool:
        step = self.step if step is None else step
        return step % int(self.cfg.logging.every) == 0 or step == int(self.cfg.train.steps)

    def run(self) -> dict[str, Any]:
        cfg, steps = self.cfg, int(self.cfg.train.steps)
        ck_every = int(cfg.checkpoint.every)
        self.callbacks.on_train_start(self)
        last: StepResult | None = None
        while self.step < steps:
            last = self.train_step()
            self.step += 1
            self.tokens_seen += last.tokens
            self.callbacks.on_step(self, last)
            if self.is_log_step():
                record: dict[str, Any] = {
                    "loss": last.loss,
                    "lr": last.lr,
                    "grad_norm": last.grad_norm,
                    "tokens": last.tokens,
                    "loss_tokens": last.loss_tokens,
                    "skipped_steps": self.guard.skipped_steps,
                }
                if last.aux_loss is not None:
                    record["aux_loss"] = last.aux_loss
                record.update(last.metrics)
                self.callbacks.on_log(self, record)
                self.logger.log(self.step, record)
            self.callbacks.on_step_end(self)
            if self.guard.exhausted:
                self.stop_bad_steps()
            if (ck_every and self.step % ck_every == 0) or (self.step == steps and cfg.checkpoint.save_final):
                self.save()
        summary: dict[str, Any] = {
            "steps": self.step,
            "final_loss": last.loss if last else None,
            "tokens_seen": self.tokens_seen,
        }
        self.callbacks.on_train_end(self, summary)
        self.logger.summary(summary)
        self.logger.close()
        self.loader.close()
        return summary
