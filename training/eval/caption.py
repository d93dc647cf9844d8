"""Does the model look? Caption loss on held-out synthetic images, true vs shuffled: `{type: caption, name, n}`.

`n` held-out records of data/synthetic.py (split `eval`, never trained on: training draws split `train`) are
rendered in the chat format the loader uses and scored twice: `loss` is the mean next-token CE over the caption's
tokens (the assistant text only, not the format's closing markers) with each example's own image;
`loss_shuffled` the same with every image moved to the next example (all synthetic images have one size, so each
placeholder block fits any image); `ratio` = loss / loss_shuffled. A model that ignores the pixels scores both the
same (ratio 1); one that reads them scores the first lower. Needs a multimodal model (`model.vision_config`).

One example per row, rows padded to one length; rows are dealt over data-parallel ranks and the CE sums reduced
like every task's (training/eval/forward.py), so the numbers do not depend on the layout. A rank's padding rows
repeat example 0 with no target, image included: every rank runs the vision tower in every forward (ZeRO-3
gathers its parameters collectively, model/vision/multimodal.py `idle_tower`).
"""

from __future__ import annotations

from typing import Any

import torch

from data.chat import conversation_images, encode_conversations, normalize_messages, renderer_for
from data.images import PreparedImage, batch_images
from data.synthetic import example, record
from model.k3 import IGNORE_INDEX
from training.eval.forward import EvalContext, reduce_sum, score_rows, shard_rows
from training.eval.sets import EvalConfigError

_ROUND = 16  # row length: a multiple of this (x parallel.sp_size)


class CaptionTask:
    def __init__(self, name: str, spec: dict[str, Any], tokenizer: Any, seq_len: int) -> None:
        self.name, self.n, self.tokenizer = name, int(spec.get("n") or 64), tokenizer
        self._examples: list[tuple[torch.Tensor, torch.Tensor, PreparedImage]] | None = None

    def examples(self, model_config: Any) -> list[tuple[torch.Tensor, torch.Tensor, PreparedImage]]:
        """(ids [L], caption labels [L], prepared image) per held-out example, built once (the tower's geometry
        comes with the model, so on the first evaluation)."""
        if self._examples is None:
            from training.trainer import image_rules

            rules, renderer = image_rules(model_config), renderer_for(self.tokenizer)
            out = []
            for i in range(self.n):
                caption = example(i, "eval")[1]
                msgs = normalize_messages(record(i, "eval")["messages"], rules)
                segs = [(s, c, (not c) and loss and s == caption) for s, c, loss in renderer.render(msgs)]
                ((ids, mask),) = encode_conversations(self.tokenizer, [segs], "assistant")
                ids_L = torch.from_numpy(ids.astype("int64"))
                labels_L = ids_L.masked_fill(~torch.from_numpy(mask), IGNORE_INDEX)
                out.append((ids_L, labels_L, conversation_images(msgs)[0]))
            self._examples = out
        return self._examples

    def _loss(self, ctx: EvalContext, shift: int) -> float:
        """Mean caption CE with example k's row given image k + shift (cyclically)."""
        examples = self.examples(ctx.model_config)
        n, step = len(examples), _ROUND * ctx.sp_size
        T = -(-max(len(e[0]) for e in examples) // step) * step
        sums = torch.zeros(2, dtype=torch.float64)  # summed CE, counted targets
        for index in shard_rows(n, ctx):
            ids = torch.zeros(len(index), T, dtype=torch.int64)
            labels = torch.full((len(index), T), IGNORE_INDEX, dtype=torch.int64)
            images = []
            for k, r in enumerate(index):
                ids_L, labels_L, _ = examples[r if r is not None else 0]
                ids[k, : len(ids_L)] = ids_L
                if r is not None:  # a padding row: example 0 without targets (see the module docstring)
                    labels[k, : len(labels_L)] = labels_L
                images.append(examples[((r if r is not None else 0) + shift) % n][2])
            pixels, grids = batch_images(images)
            sc = score_rows(ctx, ids, labels, [[0]] * len(index), (torch.from_numpy(pixels), torch.from_numpy(grids)))
            sums[0] += sc.nll_N.sum()
            if ctx.sp_rank == 0:  # targets_N is the whole stream's on every rank of a sequence-parallel group
                sums[1] += (sc.targets_N != IGNORE_INDEX).sum()
        sums = reduce_sum(sums)
        return float(sums[0] / sums[1].clamp_min(1))

    def evaluate(self, ctx: EvalContext) -> dict[str, float]:
        true, shuffled = self._loss(ctx, 0), self._loss(ctx, 1)
        return {"loss": true, "loss_shuffled": shuffled, "ratio": true / shuffled, "n": float(self.n)}

    @staticmethod
    def check(spec: dict[str, Any], cfg: Any) -> None:
        name = spec.get("name") or "caption"
        if not cfg.model.get("vision_config"):
            raise EvalConfigError(
                f"eval task {name} scores captions of images: it needs a multimodal model (model.vision_config: "
                f"true, as experiment=vlm_smoke)"
            )
        if int(spec.get("n") or 64) < 2:
            raise EvalConfigError(f"eval task {name}: n={spec.get('n')} must be >= 2 (the shuffled score moves images)")
