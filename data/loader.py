"""GlobalBatchLoader: the stateful, layout-invariant source of micro-batches for one data-parallel rank.

The rows of optimizer step s are rows [s*G, (s+1)*G) of one global packed stream that depends only on
(data config, tokenizer, seq_len, seed): every rank runs the whole (cheap) pipeline and keeps its share, rows
[r*G/W, (r+1)*G/W) of each step, cut into grad_accum = G // (b*W) micro-batches of b rows. So the same sequences
reach the model in the same steps whatever the world size and accumulation split (parallel-invariance tests,
portable golden losses). The cost is that every rank tokenizes the whole stream (see bench/data.py for margin).

Chat sources (`format: chat`) are rendered with `data.chat.renderer_for(tokenizer)` and pack like text, with a
loss mask: `labels` is -100 wherever no loss is taken; `loss_on` ("assistant" | "all") is the trainer's
`train.loss_on`.

State (`state_dict()`, JSON-able, ~ a few KB): the step, the micro-batches of it already returned, the position
of the first row of that step (window anchor + doc + offset, see data/packing.py), stats and a fingerprint of
everything that decides the stream. It describes the position after the last micro-batch handed to the caller,
never what the prefetch thread produced ahead.

World size change on resume: a state taken at a step boundary (after the last micro-batch of a step, as a
checkpoint after an optimizer step is) restores at any world size / micro-batch size / global batch size: the
pointer is a row position, rows of the next step are re-split for the new layout (nothing repeated or skipped; with
a new global batch size, steps simply hold more or fewer rows from there on). A mid-step state restores only with
the identical layout; otherwise load_state_dict raises.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

from data.config import LOSS_ON, DataConfig, DataError, coerce_config, digest, stream_dict
from data.mixing import DocumentMixer, ShuffledWindows
from data.packing import Packer, collate
from data.sources import resolve_files, source_identity
from data.tokenizer_base import Tokenizer

STATE_VERSION = 1


@dataclass
class _Item:
    step: int
    micro: int
    ptr_start: dict  # packer position of the first row of `step`
    ptr_end: dict  # packer position of the first row of `step + 1`
    stats: dict  # global pipeline stats after producing `step`
    batch: dict


class _End:
    pass


class GlobalBatchLoader:
    """Micro-batches of rank `rank` of `world_size`; the global batch of step s depends on (cfg, seed, s) only."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        loss_on: str = "assistant",
        images=None,
    ):
        """`images`: the vision tower's ImageRules (data/images.py); image parts of chat sources decode and pack
        as their placeholder blocks, batches carry pixel_values/grid_thws. None: a text model (image rows skip)."""
        self.cfg = coerce_config(cfg)
        self.images = images
        self.tokenizer = tokenizer
        if loss_on not in LOSS_ON:
            raise DataError(f"loss_on={loss_on!r} is not one of {LOSS_ON} (train.loss_on)")
        self.loss_on = loss_on
        self.has_chat = any(s.format == "chat" for s in self.cfg.sources)
        self.renderer = None
        if self.has_chat:
            from data.chat import renderer_for

            self.renderer = renderer_for(tokenizer)
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.global_batch_size, self.micro_batch_size = int(global_batch_size), int(micro_batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self._check_layout()
        if self.cfg.add_eos and tokenizer.eos_id is None:
            raise DataError("data.add_eos is set but the tokenizer has no eos piece: use a model with eos_id >= 0")
        if self.cfg.add_bos and tokenizer.bos_id is None:
            raise DataError("data.add_bos is set but the tokenizer has no bos piece: use a model with bos_id >= 0")
        idents = [source_identity(s, resolve_files(s, i)) for i, s in enumerate(self.cfg.sources)]
        fp = {
            "data": stream_dict(self.cfg),
            "sources": idents,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "tokenizer": tokenizer.fingerprint,
        }
        if self.has_chat:  # conversations' rows and labels depend on these (text rows never do)
            fp["chat"] = {
                "loss_on": loss_on,
                "format": self.renderer.name,
                "template": digest(getattr(tokenizer, "chat_template", None) or ""),
            }
            if images is not None:
                fp["images"] = repr(images)
        self.fingerprint = digest(fp)
        self._step, self._micro_done, self._ptr = 0, 0, None  # next micro-batch to hand out
        self._stats: dict = {}
        self._rank_tokens = 0
        self._gen: Optional[Iterator] = None
        self._thread: Optional[threading.Thread] = None
        self._queue: Optional[queue.Queue] = None
        self._stop = threading.Event()
        self._finished = False

    def _check_layout(self) -> None:
        G, b, W = self.global_batch_size, self.micro_batch_size, self.world_size
        if self.seq_len < 2:
            raise DataError(f"seq_len={self.seq_len} must be >= 2")
        if not (0 <= self.rank < W):
            raise DataError(f"rank={self.rank} is outside world_size={W}")
        if G <= 0 or b <= 0 or G % (b * W):
            raise DataError(
                f"global_batch_size={G} is not a multiple of micro_batch_size*world_size={b}*{W}: "
                f"choose global_batch_size = k*{b * W}"
            )
        self.grad_accum = G // (b * W)

    # -- pipeline -----------------------------------------------------------------------------------------------
    def _build_packer(self, ptr: Optional[dict]) -> tuple[Packer, DocumentMixer]:
        mixer = DocumentMixer(self.cfg, self.seed, self.renderer, report=self.rank == 0, images=self.images)
        windows = ShuffledWindows(mixer, self.cfg.shuffle_buffer, self.seed)
        tok = self.tokenizer
        pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id if tok.eos_id is not None else 0)
        packer = Packer(
            windows,
            tok,
            self.seq_len,
            self.cfg.packing,
            tok.bos_id if self.cfg.add_bos else None,
            tok.eos_id if self.cfg.add_eos else None,
            pad,
            self.loss_on,
            self.cfg.long_conversations,
        )
        if ptr is not None:
            packer.load_state_dict(ptr)
        return packer, mixer

    def _produce(self, step: int, skip_micro: int, ptr: Optional[dict]) -> Iterator[_Item]:
        """This rank's micro-batches from (step, skip_micro) on, each tagged with the pointers of its step."""
        packer, mixer = self._build_packer(ptr)
        G, b, share = self.global_batch_size, self.micro_batch_size, self.global_batch_size // self.world_size
        while True:
            ptr_start = packer.state_dict()
            rows = []
            for _ in range(G):
                row = packer.next_row()
                if row is None:
                    return  # stream ended (exhaustion: stop): the incomplete step is dropped
                rows.append(row)
            ptr_end = packer.state_dict()
            c = packer.counters
            stats = {
                "step": step,
                **c,
                "packing_efficiency": c["tokens"] / max(1, c["tokens"] + c["padding"]),
                "loss_token_fraction": c["loss_tokens"] / max(1, c["tokens"]),
                "image_token_fraction": c["image_tokens"] / max(1, c["tokens"]),
                **mixer.stats(),
            }
            mine = rows[self.rank * share : (self.rank + 1) * share]
            for k in range(skip_micro, self.grad_accum):
                yield _Item(step, k, ptr_start, ptr_end, stats, collate(mine[k * b : (k + 1) * b]))
            step, skip_micro = step + 1, 0

    def _worker(self, gen: Iterator[_Item], q: queue.Queue) -> None:
        try:
            for item in gen:
                while not self._stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            q.put(_End())
        except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
            q.put(e)

    def _next_item(self) -> Optional[_Item]:
        if self._finished:
            return None
        if self._gen is None and self._thread is None:
            gen = self._produce(self._step, self._micro_done, self._ptr)
            if self.cfg.num_workers == 0:
                self._gen = gen
            else:
                self._stop.clear()
                self._queue = queue.Queue(maxsize=self.cfg.prefetch * self.grad_accum)
                self._thread = threading.Thread(
                    target=self._worker, args=(gen, self._queue), daemon=True, name=f"k3-data-r{self.rank}"
                )
                self._thread.start()
        if self._gen is not None:
            item = next(self._gen, None)
        else:
            got = self._queue.get()
            if isinstance(got, BaseException):
                self.close()
                raise got
            item = None if isinstance(got, _End) else got
        if item is None:
            self._finished = True
            self.close()
        return item

    # -- public API ---------------------------------------------------------------------------------------------
    def next_microbatch(self) -> dict:
        """{input_ids [b,T] int64, labels [b,T] int64, cu_seqlens [n+1] int32, num_tokens, step, micro}."""
        item = self._next_item()
        if item is None:
            raise StopIteration
        if item.micro == self.grad_accum - 1:
            self._step, self._micro_done, self._ptr = item.step + 1, 0, item.ptr_end
        else:
            self._step, self._micro_done, self._ptr = item.step, item.micro + 1, item.ptr_start
        self._stats = item.stats
        self._rank_tokens += item.batch["num_tokens"]
        return {**item.batch, "step": item.step, "micro": item.micro}

    def __iter__(self) -> GlobalBatchLoader:
        return self

    def __next__(self) -> dict:
        return self.next_microbatch()

    def stats(self) -> dict:
        """Global pipeline counters as of the last returned micro-batch's step, plus this rank's tokens.

        Keys: step, rows, tokens, padding, packing_efficiency, documents, loss_tokens, loss_token_fraction
        (tokens carrying loss / non-pad tokens), images, image_tokens, image_token_fraction (`<|media_pad|>` /
        non-pad tokens), conversations, conversations_truncated, conversations_dropped,
        records_read, skipped {kind: n}, skipped_total, source_docs, source_epochs, `<source>/skipped_<kind>`
        per source (the trainer logs numbers as data/<key>), rank_tokens."""
        return {**self._stats, "rank_tokens": self._rank_tokens}

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "step": self._step,
            "micro_done": self._micro_done,
            "pointer": self._ptr,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "stats": self._stats,
            "rank_tokens": self._rank_tokens,
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue exactly after the state's last micro-batch (see module doc for world-size changes)."""
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data loader state version {state.get('version')} != {STATE_VERSION}: "
                f"it was written by an incompatible k3-train"
            )
        if strict and state["fingerprint"] != self.fingerprint:
            raise DataError(
                f"data loader state fingerprint {state['fingerprint']} != {self.fingerprint}: the data "
                f"config, files, tokenizer, seq_len or seed changed (load_state_dict(strict=False) to "
                f"continue anyway)"
            )
        same_layout = (state["world_size"], state["micro_batch_size"], state["global_batch_size"]) == (
            self.world_size,
            self.micro_batch_size,
            self.global_batch_size,
        )
        if state["micro_done"] and not same_layout:
            raise DataError(
                f"data loader state is {state['micro_done']} micro-batches into step {state['step']} "
                f"and the layout changed (world_size/micro/global batch): resume from a step-boundary "
                f"checkpoint or keep world_size={state['world_size']}, "
                f"micro_batch_size={state['micro_batch_size']}"
            )
        self.close()
        self._step, self._micro_done, self._ptr = int(state["step"]), int(state["micro_done"]), state["pointer"]
        self._stats, self._rank_tokens = dict(state["stats"]), int(state["rank_tokens"])
        self._finished = False

    def close(self) -> None:
        """Stop the prefetch thread (safe to call twice); the loader restarts from its state when used again."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                with contextlib.suppress(queue.Empty):
                    self._queue.get(timeout=0.05)
            self._thread.join()
        self._thread, self._queue, self._gen = None, None, None

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
