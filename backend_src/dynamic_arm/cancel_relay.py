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

The board's name is predictable (every stub must find it), so it is trusted only when it is private: it is made
0700, and taken only if it is a real directory (not a symlink) of this uid that no other user can enter; otherwise
the relay is off in that process (one warning naming the path and why; rows then run to their end, as without the
relay). Posts are made, read and removed through the board's directory fd, never following a symlink, and the path
is checked again every recheck_period_s, so a board removed after start is made anew and one swapped is refused.

A cancel before llm_dynamic's step starts marks that step itself (Triton's queue drops it, or the runner's
is_cancelled check sees it). Not covered: a non-streaming call, whose only response is its final one, so no step
follows the cancel: it runs to its end.
"""
from __future__ import annotations

import logging
import math
import os
import re
import stat
import tempfile
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

KEY_PATTERN = re.compile(r"[0-9a-f]{32}")


def default_directory() -> Path:
    """Shared memory where the host has it (no disk writes), else the temp directory; per user, so one account's
    board is never another's. The name is predictable: open_board refuses it unless it is private."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"llm-cancel-relay-{os.getuid()}"


def new_key() -> str:
    return uuid.uuid4().hex


class UnsafeBoard(Exception):
    """The board's path holds something another user could read, write or redirect."""


def open_board(directory: Path) -> int:
    """The board's directory fd, the directory made private if it is new. Raises UnsafeBoard unless it is a directory
    (not a symlink) owned by this uid that no other user can enter; its parent must exist."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if directory.is_symlink():  # O_NOFOLLOW's ELOOP does not say so
            raise UnsafeBoard(f"cancel relay board {directory} refused: it is a symbolic link") from e
        raise
    try:
        check_private(os.fstat(fd), directory)
    except UnsafeBoard:
        os.close(fd)
        raise
    return fd


def check_private(st: os.stat_result, directory: Path) -> None:
    if st.st_uid != os.getuid():
        raise UnsafeBoard(f"cancel relay board {directory} refused: it is owned by uid {st.st_uid}, "
                          f"not this server's uid {os.getuid()}")
    if st.st_mode & 0o077:
        raise UnsafeBoard(f"cancel relay board {directory} refused: its mode {stat.S_IMODE(st.st_mode):04o} "
                          "lets other users in (allowed: 0700 or stricter; remove it and it is made anew)")


class CancelRelay:
    _fd: int | None = None  # the board's directory fd, opened on first use

    def __init__(self, directory: Path | None = None, max_age_s: float = 600.0, sweep_period_s: float = 60.0,
                 recheck_period_s: float = 1.0):
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_age_s = max_age_s
        self.sweep_period_s = sweep_period_s
        self.recheck_period_s = recheck_period_s
        self._last_sweep = 0.0
        self._checked_at = -math.inf
        self._refusal = ""  # the last reason logged, so a board that stays refused is reported once
        self._lock = threading.Lock()  # an fd closed while another thread uses it could name another directory

    @staticmethod
    def _checked(key: str) -> str:
        if not KEY_PATTERN.fullmatch(key):  # it names a file: never a path
            raise ValueError(f"row_key={key[:40]!r} is malformed: allowed 32 lowercase hex digits")
        return key

    def post(self, key: str) -> bool:
        """postprocessing: this row's client has gone. False (and a log line) when the board cannot be written:
        the row then runs to its end, as without the relay."""
        try:
            name = self._checked(key)
            with self._lock:
                try:
                    self._create(name)
                except FileNotFoundError:  # the board was removed since it was opened: make it anew, once
                    self._reopen()
                    self._create(name)
            return True
        except (OSError, ValueError, UnsafeBoard) as e:
            log.warning("cannot post a cancel for row %r: %s", key[:40], e)
            return False

    def _create(self, name: str) -> None:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=self._board()))

    def is_posted(self, key: str) -> bool:
        """llm_dynamic, once per step for each live row: one stat call (and the board's check once a period)."""
        try:
            name = self._checked(key)
            with self._lock:
                st = os.stat(name, dir_fd=self._board(), follow_symlinks=False)
            return stat.S_ISREG(st.st_mode)
        except (OSError, ValueError, UnsafeBoard):
            return False

    def clear(self, key: str) -> None:
        """llm_dynamic, when a row ends: its post, if any, is done with."""
        try:
            name = self._checked(key)
            with self._lock:
                os.unlink(name, dir_fd=self._board())  # removes a symlink itself, never what it points to
        except (OSError, ValueError, UnsafeBoard):
            pass

    def sweep(self, now: float | None = None) -> int:
        """Remove posts older than max_age_s (a cancel that came after its row ended); at most once per
        sweep_period_s. Returns how many went."""
        now = time.time() if now is None else now
        if now - self._last_sweep < self.sweep_period_s:
            return 0
        self._last_sweep = now
        removed = 0
        with self._lock:
            try:
                board = self._board()
                entries = list(os.scandir(board))
            except (OSError, UnsafeBoard):
                return 0
            for entry in entries:
                try:
                    if (KEY_PATTERN.fullmatch(entry.name)
                            and now - entry.stat(follow_symlinks=False).st_mtime > self.max_age_s):
                        os.unlink(entry.name, dir_fd=board)
                        removed += 1
                except OSError:
                    continue  # another instance swept it first
        return removed

    def close(self) -> None:
        with self._lock:
            self._reopen()  # on next use

    def __del__(self) -> None:
        self._drop()

    # ---- the board's fd (callers hold the lock) -------------------------------------------------------------
    def _board(self) -> int:
        """The board's fd, its path checked again at most once per recheck_period_s. Raises UnsafeBoard or
        OSError (and logs the first time) while the board cannot be used."""
        now = time.monotonic()
        if now - self._checked_at >= self.recheck_period_s:
            self._checked_at = now
            if self._fd is not None and not self._still_the_board(self._fd):
                self._drop()
            if self._fd is None:
                self._open()
        if self._fd is None:
            raise UnsafeBoard(self._refusal)
        return self._fd

    def _open(self) -> None:
        try:
            self._fd = open_board(self.directory)
        except (OSError, UnsafeBoard) as e:
            reason = str(e) if isinstance(e, UnsafeBoard) else f"cancel relay board {self.directory} refused: {e}"
            if reason != self._refusal:
                log.warning("%s; relayed cancels are off in this process until it is fixed", reason)
            self._refusal = reason
            return
        if self._refusal:
            log.info("cancel relay board %s is usable again", self.directory)
            self._refusal = ""

    def _still_the_board(self, fd: int) -> bool:
        """The path still names the directory that fd holds, and it is still private."""
        try:
            at_path, held = os.stat(self.directory, follow_symlinks=False), os.fstat(fd)
            check_private(held, self.directory)
        except (OSError, UnsafeBoard):
            return False
        return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)

    def _reopen(self) -> None:
        self._drop()
        self._checked_at = -math.inf

    def _drop(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
