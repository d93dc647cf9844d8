"""Streaming sources: `datasets.load_dataset(..., streaming=True)` + our own record validation.

One `SourceStream` per configured source yields valid documents for one epoch at a time: a str (format text), or
for format chat the validated conversation (list of messages), rendered into segments when a chat renderer is
given (data/chat.py). Its exact position is a small JSON-able dict (`state_dict()`: epoch, the IterableDataset's
own `state_dict()`, counters), taken and restored between records. JSON Lines and plain text are read through
datasets' `text` builder as latin-1 (every byte sequence decodes, lines split on b"\\n" only) and re-decoded as
UTF-8 here, so one malformed line, one invalid UTF-8 byte or one missing field is skipped and counted instead of
aborting the whole file. Each skip kind is reported once per source on stderr (one line, counts in
`loader.stats()` as `<name>/skipped_<kind>`).
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from data.chat import CHAT_SKIP_REASONS, ChatDoc, ChatRowError, conversation_images, normalize_messages
from data.config import DataError, SourceConfig, file_digest
from data.holdout import keeps

TEXT_SKIP_REASONS = ("invalid_utf8", "malformed_json", "missing_field", "not_text", "empty")
SKIP_REASONS = TEXT_SKIP_REASONS + CHAT_SKIP_REASONS
log = logging.getLogger("data")
_EXTENSIONS = {
    "jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "json": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "text": (".txt", ".md", ".text", ".txt.gz"),
    "parquet": (".parquet",),
}
_MIN_RECORDS_FOR_BAD_CHECK = 100


def resolve_files(src: SourceConfig, index: int) -> list[str]:
    """Local files of a source, sorted: a file, a directory (recursive, by extension) or a glob."""
    if src.type == "embedded":
        from data.corpus import default_corpus_path, heldout_corpus_path

        if src.part == "heldout" and src.holdout > 0:  # its held-out records only, cached (same lines)
            return [str(heldout_corpus_path(src.holdout))]
        return [str(default_corpus_path())]
    if src.type in ("hub", "synthetic"):
        return []
    path = os.path.expanduser(src.path)
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"data.sources[{index}].path glob {src.path!r} matches no files: fix the pattern")
        return files
    if os.path.isdir(path):
        exts = _EXTENSIONS[src.type]
        files = sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and str(p).endswith(exts))
        if not files:
            raise DataError(f"data.sources[{index}].path directory {src.path!r} has no {'/'.join(exts)} files")
        return files
    if os.path.isfile(path):
        return [path]
    raise DataError(f"data.sources[{index}].path {src.path!r} does not exist (for a hub dataset set type: hub)")


def source_identity(src: SourceConfig, files: list[str]) -> dict:
    """What the fingerprint records about a source's data: file names + sizes (content hash for embedded)."""
    if src.type == "embedded":
        return {"embedded_sha256": file_digest(files[0])}
    if src.type == "hub":
        return {"hub": src.path, "config": src.hub_config, "split": src.split}
    if src.type == "synthetic":
        return {"synthetic": src.path, "split": src.split, "size": src.size}
    base = os.path.commonpath([os.path.dirname(f) for f in files]) if files else ""
    return {"files": [[os.path.relpath(f, base), os.path.getsize(f)] for f in files]}


class SourceStream:
    """Valid documents of one source, epoch by epoch, with an exact, restorable position."""

    def __init__(
        self,
        src: SourceConfig,
        index: int,
        max_bad_fraction: float,
        renderer=None,
        report: bool = True,
        label: Optional[str] = None,
        images=None,
    ):
        self.src, self.index, self.max_bad_fraction = src, index, max_bad_fraction
        self.images = images  # the tower's ImageRules (data/images.py): image parts decode; None: a text model
        self.chat = src.format == "chat"
        self.renderer, self.report = renderer, report  # chat: segments when given, else validated messages
        self.files = resolve_files(src, index)
        self.name = f"sources[{index}] {src.type}:{src.path or 'stdlib'}"
        self.label = label or f"s{index}"
        if src.type == "parquet":
            self._check_parquet_columns()
        self.epoch = 0
        self.read = 0  # records read in this epoch (valid + skipped)
        self.valid = 0  # valid documents in this epoch
        self.total_read = 0
        self.skipped = dict.fromkeys(self.reasons, 0)
        self._ds = None
        self._it: Optional[Iterator[dict]] = None
        self._ds_state: Optional[dict] = None  # position to resume from before the first next()

    # -- position -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        ds_state = copy.deepcopy(self._ds.state_dict()) if self._it is not None else self._ds_state
        return {
            "epoch": self.epoch,
            "read": self.read,
            "valid": self.valid,
            "total_read": self.total_read,
            "skipped": dict(self.skipped),
            "ds": ds_state,
        }

    def load_state_dict(self, st: dict) -> None:
        self.epoch, self.read, self.valid, self.total_read = st["epoch"], st["read"], st["valid"], st["total_read"]
        self.skipped = {r: int(st["skipped"].get(r, 0)) for r in self.reasons}
        self._ds_state, self._it = st["ds"], None

    # -- reading ------------------------------------------------------------------------------------------------
    def _open(self):
        if self.src.type == "synthetic" and self.src.path == "passkey":
            from data.passkey import PasskeyDocs

            try:
                return PasskeyDocs(self.src.split, self.src.size)
            except ValueError as e:
                raise DataError(f"data.{self.name}: {e}") from None
        if self.src.type == "synthetic":
            from data.synthetic import SyntheticCaptions

            try:
                return SyntheticCaptions(self.src.path, self.src.split, self.src.size)
            except ValueError as e:
                raise DataError(f"data.{self.name}: {e}") from None
        import datasets

        datasets.disable_progress_bars()
        t = self.src.type
        try:
            if t in ("jsonl", "json", "embedded"):
                ds = datasets.load_dataset(
                    "text", data_files=self.files, split="train", streaming=True, encoding="latin-1"
                )
            elif t == "text":
                ds = datasets.load_dataset(
                    "text",
                    data_files=self.files,
                    split="train",
                    streaming=True,
                    encoding="latin-1",
                    sample_by=self.src.text_sample_by,
                )
            elif t == "parquet":
                ds = datasets.load_dataset("parquet", data_files=self.files, split="train", streaming=True)
            else:  # hub
                ds = datasets.load_dataset(self.src.path, self.src.hub_config, split=self.src.split, streaming=True)
        except Exception as e:  # noqa: BLE001 - re-raised as one line naming the source
            first = str(e).splitlines()[0] if str(e) else ""
            raise DataError(f"cannot open data.{self.name}: {type(e).__name__}: {first}") from e
        return ds

    def _check_parquet_columns(self) -> None:
        """A parquet file without the configured field is a config error: one line now, not a skip storm later."""
        import pyarrow.parquet as pq

        field = self.src.messages_field if self.chat else self.src.text_field
        key = "messages_field" if self.chat else "text_field"
        for f in self.files:
            try:
                cols = pq.read_schema(f).names
            except Exception as e:  # noqa: BLE001 - unreadable file: one line naming it
                raise DataError(
                    f"data.{self.name}: {f} is not a readable parquet file ({type(e).__name__}): fix or remove it"
                ) from None
            if field not in cols:
                raise DataError(
                    f"data.{self.name}: {os.path.basename(f)} has no column {field!r} (columns: "
                    f"{', '.join(cols[:8])}): set data.sources[{self.index}].{key}"
                )

    def _close(self) -> None:
        """Close the datasets generator now (not at interpreter exit, where its cleanup would print noise)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "close"):
            with contextlib.suppress(Exception):  # closing is best effort
                it.close()

    def _start(self) -> None:
        self._ds = self._open()
        if self._ds_state is not None:
            self._ds.load_state_dict(self._ds_state)
        self._it = iter(self._ds)

    def next_doc(self) -> Any:
        """The next valid document of the current epoch (str, or a conversation for format chat), or None at the
        end of the epoch (then `new_epoch()`)."""
        if self._it is None:
            self._start()
        for record in self._it:
            if not keeps(self.src, record):  # the other side of a held-out split (data/holdout.py)
                continue
            self.read += 1
            self.total_read += 1
            doc, reason = self._parse(record)
            if reason is None:
                self.valid += 1
                return doc
            self.skipped[reason] += 1
            if self.skipped[reason] == 1 and self.report:
                log.warning(
                    "data: %s: skipping %s rows (first at record %d of epoch %d); counted in data/%s/skipped_%s",
                    self.name,
                    reason,
                    self.read,
                    self.epoch,
                    self.label,
                    reason,
                )
            if self.total_read >= _MIN_RECORDS_FOR_BAD_CHECK:
                self._check_bad_fraction()
        if self.total_read:
            self._check_bad_fraction()
        return None

    @property
    def reasons(self) -> tuple[str, ...]:
        """The skip kinds that can happen for this source's format (the ones reported in stats)."""
        return ("invalid_utf8", "malformed_json", "empty") + CHAT_SKIP_REASONS if self.chat else TEXT_SKIP_REASONS

    def check_usable(self) -> None:
        """DataError when the epoch just read had no usable document (never an endless wait for one)."""
        if self.valid == 0:
            self._close()
            field = "messages_field" if self.chat else "text_field"
            raise DataError(
                f"data.{self.name} has no usable documents ({self.read} records read, skipped: "
                f"{ {k: v for k, v in self.skipped.items() if v} }): fix the source or its {field}"
            )

    def new_epoch(self) -> None:
        self.check_usable()
        self.epoch, self.read, self.valid = self.epoch + 1, 0, 0
        self._ds_state, self._it = None, None

    def _check_bad_fraction(self) -> None:
        bad = sum(self.skipped.values())
        if bad > self.max_bad_fraction * self.total_read:
            self._close()
            raise DataError(
                f"data.{self.name}: {bad} of {self.total_read} records skipped "
                f"({ {k: v for k, v in self.skipped.items() if v} }) > max_bad_fraction="
                f"{self.max_bad_fraction}: fix the data or raise data.max_bad_fraction"
            )

    def _parse(self, record: dict) -> tuple[Any, Optional[str]]:
        t = self.src.type
        if t in ("jsonl", "json", "embedded", "text"):
            try:
                line = record["text"].encode("latin-1").decode("utf-8")
            except UnicodeDecodeError:
                return None, "invalid_utf8"
            if t == "text":
                return (line, None) if line.strip() else (None, "empty")
            if not line.strip():
                return None, "empty"
            try:
                record = json.loads(line)
            except ValueError:
                return None, "malformed_json"
            if not isinstance(record, dict):
                return None, "malformed_json"
        if self.chat:
            return self._parse_chat(record.get(self.src.messages_field))
        field = "text" if t == "embedded" else self.src.text_field
        if field not in record or record[field] is None:
            return None, "missing_field"
        text = record[field]
        if not isinstance(text, str):
            return None, "not_text"
        return (text, None) if text.strip() else (None, "empty")

    def _parse_chat(self, messages: Any) -> tuple[Any, Optional[str]]:
        try:
            msgs = normalize_messages(messages, self.images, drop_images=self.renderer is None)
            if self.renderer is None:
                return msgs, None
            images = conversation_images(msgs)
            segments = self.renderer.render(msgs)
            return (ChatDoc(segments, images) if images else segments), None
        except ChatRowError as e:
            return None, e.kind
