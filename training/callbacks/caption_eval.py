"""Does the model look? Caption loss on held-out synthetic images, true vs shuffled (experiment=vlm_smoke).

At the end of training, `n` held-out records of data/synthetic.py (split `eval`, never trained on) are scored
twice with the trained model: `eval_caption_loss` is the mean next-token CE over the caption's tokens (the
assistant text only, not the format's closing markers) with each example's own image; `eval_caption_loss_shuffled`
is the same with every image moved to the next example (all synthetic images have one size, so each block fits
any image). A model that ignores the pixels scores both the same; one that reads them scores the first lower.
Every rank runs the same forward (expert parallelism needs all of them); the numbers go into summary.json.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from data.chat import conversation_images, encode_conversations, normalize_messages
from data.images import batch_images
from data.synthetic import example, record
from model.k3 import IGNORE_INDEX, shift_targets
from training.callbacks.base import Callback

_CHUNK = 16  # examples per forward


class CaptionEval(Callback):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def _examples(self, trainer: Any) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
        """(ids [n], caption labels [n], prepared image) per held-out example."""
        from training.trainer import image_rules

        rules, renderer, tok = image_rules(trainer.mcfg), trainer.loader.renderer, trainer.tokenizer
        out = []
        for i in range(self.n):
            caption = example(i, "eval")[1]
            msgs = normalize_messages(record(i, "eval")["messages"], rules)
            segs = [(s, c, (not c) and loss and s == caption) for s, c, loss in renderer.render(msgs)]
            ((ids, mask),) = encode_conversations(tok, [segs], "assistant")
            ids_t = torch.from_numpy(ids.astype("int64"))
            out.append((ids_t, ids_t.masked_fill(~torch.from_numpy(mask), IGNORE_INDEX), conversation_images(msgs)[0]))
        return out

    @torch.no_grad()
    def _loss(self, trainer: Any, examples: list, shift: int) -> float:
        module, device = trainer.module, trainer.device
        total, count = 0.0, 0
        images = [im for _, _, im in examples]
        images = images[shift:] + images[:shift]  # image k goes to example k - shift
        for a in range(0, len(examples), _CHUNK):
            chunk = examples[a : a + _CHUNK]
            ids = torch.cat([e[0] for e in chunk])[None]
            labels = torch.cat([e[1] for e in chunk])[None]
            cu = torch.tensor([0, *torch.tensor([len(e[0]) for e in chunk]).cumsum(0).tolist()], dtype=torch.int64)
            pixels, grids = batch_images(images[a : a + _CHUNK])
            out = module(
                ids.to(device),
                pixel_values=torch.from_numpy(pixels).to(device),
                grid_thws=torch.from_numpy(grids).to(device),
                cu_seqlens=cu.to(device),
            )
            targets = shift_targets(labels, cu)[0].to(device)
            ce = F.cross_entropy(out.logits[0].float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
            total += float(ce)
            count += int((targets != IGNORE_INDEX).sum())
        return total / max(1, count)

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        examples = self._examples(trainer)
        was_training = trainer.module.training
        trainer.module.eval()
        try:
            true, shuffled = self._loss(trainer, examples, 0), self._loss(trainer, examples, 1)
        finally:
            trainer.module.train(was_training)
        summary["eval_caption_loss"] = true
        summary["eval_caption_loss_shuffled"] = shuffled
        summary["eval_caption_examples"] = len(examples)
        if trainer.is_main:
            print(
                f"eval: caption loss {true:.4f} (true images) vs {shuffled:.4f} (shuffled), "
                f"ratio {true / shuffled:.3f} on {len(examples)} held-out examples",
                flush=True,
            )
