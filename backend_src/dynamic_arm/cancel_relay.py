"""A client's cancel of `llm_ensemble`, carried from postprocessing to the llm_dynamic row it belongs to.

Triton 2.51's ensemble does not cancel a step that is already running: it only marks the steps it schedules after
the cancel (core's ensemble scheduler, "propagate the cancellation to the next request step"). llm_dynamic's step
runs for the whole stream, so it never sees the cancel, and its static batch would go on computing a row nobody
reads, up to its max_tokens, holding back every batch queued behind it. For a stream, though, each llm_dynamic
response schedules a postprocessing step, and the first one after the cancel arrives marked: postprocessing posts
the row's key here, and llm_dynamic, which checks its live rows once per step, aborts that row.

The key is a random id llm_dynamic gives each row and sends with every response (the `row_key` output, which the
ensemble maps to postprocessing). The board is a directory of empty files named by key, shared by every Triton stub
on the host (each model instance is a process of its own); keys are random, so servers sharing the directory never
mix. A post for a row that has already ended is removed by age.

A cancel before llm_dynamic's step starts marks that step itself (Triton's queue drops it, or the runner's
is_cancelled check sees it). Not covered: a non-streaming call, whose only response is its final one, so no step
follows the cancel: it runs to its end.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

KEY_PATTERN = re.compile(r"[0-9a-f]{32}")


def default_directory() -> Path:
    """Shared memory where the host has it (no disk writes), else the temp directory; per user, so a directory
    left by another account never blocks this one."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"llm-cancel-relay-{os.getuid()}"


def new_key() -> str:
    return uuid.uuid4().hex


class CancelRelay:
    def __init__(self, directory: Path | None = None, max_age_s: float = 600.0, sweep_period_s: float = 60.0):
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_age_s = max_age_s
        self.sweep_period_s = sweep_period_s
        self._last_sweep = 0.0

    def _path(self, key: str) -> Path:
        if not KEY_PATTERN.fullmatch(key):  # it names a file: never a path
            raise ValueError(f"row_key={key[:40]!r} is malformed: allowed 32 lowercase hex digits")
        return self.directory / key

    def post(self, key: str) -> bool:
        """postprocessing: this row's client has gone. False (and a log line) when the board cannot be written:
        the row then runs to its end, as without the relay."""
        try:
            path = self._path(key)
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.touch()
            return True
        except (OSError, ValueError) as e:
            log.warning("cannot post a cancel for row %r: %s", key[:40], e)
            return False

    def is_posted(self, key: str) -> bool:
        """llm_dynamic, once per step for each live row: one stat call."""
        try:
            return self._path(key).exists()
        except ValueError:
            return False

    def clear(self, key: str) -> None:
        """llm_dynamic, when a row ends: its post, if any, is done with."""
        try:
            self._path(key).unlink(missing_ok=True)
        except (OSError, ValueError):
            pass

    def sweep(self, now: float | None = None) -> int:
        """Remove posts older than max_age_s (a cancel that came after its row ended); at most once per
        sweep_period_s. Returns how many went."""
        now = time.time() if now is None else now
        if now - self._last_sweep < self.sweep_period_s:
            return 0
        self._last_sweep = now
        removed = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return 0
        for entry in entries:
            try:
                if KEY_PATTERN.fullmatch(entry.name) and now - entry.stat().st_mtime > self.max_age_s:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                continue  # another instance swept it first
        return removed
