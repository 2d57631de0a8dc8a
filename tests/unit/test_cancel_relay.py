"""dynamic_arm.cancel_relay: postprocessing posts a row's key, llm_dynamic sees it, clears it, and old posts go; a
board another user could reach, or a symlink in its place or inside it, is never trusted."""
import logging
import os
import shutil
import stat
import time

import pytest

from dynamic_arm.cancel_relay import CancelRelay, default_directory, new_key


def test_post_is_seen_until_cleared(tmp_path):
    relay, key, other = CancelRelay(tmp_path / "board"), new_key(), new_key()
    assert not relay.is_posted(key)
    assert relay.post(key)  # creates the board on first use
    assert relay.is_posted(key) and not relay.is_posted(other)
    assert CancelRelay(tmp_path / "board").is_posted(key)  # another process's view of the same board
    relay.clear(key)
    relay.clear(key)  # twice is fine
    assert not relay.is_posted(key)


@pytest.mark.parametrize("key", ["../../etc/passwd", "A" * 32, "", "x", new_key() + "0", "/tmp/" + new_key()[:27]])
def test_a_key_that_is_not_32_hex_digits_never_names_a_file(tmp_path, key):
    relay = CancelRelay(tmp_path / "board")
    assert relay.post(key) is False
    assert not relay.is_posted(key)
    assert not (tmp_path / "board").exists() or list((tmp_path / "board").iterdir()) == []
    with pytest.raises(ValueError, match="row_key=.*allowed 32 lowercase hex digits"):
        relay._checked(key)


def test_sweep_removes_only_old_posts_and_at_most_once_a_period(tmp_path):
    relay = CancelRelay(tmp_path / "board", max_age_s=60, sweep_period_s=30)
    old, fresh = new_key(), new_key()
    relay.post(old)
    relay.post(fresh)
    (tmp_path / "board" / "README").write_text("not a key: left alone")
    past = time.time() - 120
    os.utime(tmp_path / "board" / old, (past, past))
    now = time.time()
    assert relay.sweep(now) == 1
    assert not relay.is_posted(old) and relay.is_posted(fresh)
    os.utime(tmp_path / "board" / fresh, (past, past))
    assert relay.sweep(now + 10) == 0  # within the period: no scan
    assert relay.sweep(now + 31) == 1
    assert sorted(p.name for p in (tmp_path / "board").iterdir()) == ["README"]


def test_a_board_that_cannot_be_written_costs_only_the_relay(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the board's directory should be")
    relay = CancelRelay(blocker / "board")
    assert relay.post(new_key()) is False
    assert relay.is_posted(new_key()) is False
    assert relay.sweep() == 0


def test_default_board_is_per_user():
    assert default_directory().name == f"llm-cancel-relay-{os.getuid()}"


NOBODY = 65534


def refusals(caplog, board) -> list[str]:
    """The relay's warnings that it refused this board."""
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return [m for m in said if str(board) in m and "relayed cancels are off" in m]


def old_post_in(directory) -> str:
    """A file named like a post, older than any max_age_s, in a directory the relay must not touch."""
    name = new_key()
    (directory / name).write_text("not the relay's")
    past = time.time() - 3600
    os.utime(directory / name, (past, past))
    return name


def test_a_board_other_users_can_enter_is_refused_and_left_as_it_is(tmp_path, caplog):
    board = tmp_path / "board"
    board.mkdir()
    board.chmod(0o777)  # made by someone else before the server started
    planted = new_key()
    (board / planted).touch()  # a forged cancel
    relay = CancelRelay(board, max_age_s=60, sweep_period_s=0, recheck_period_s=0)  # tries the board every call
    assert relay.post(new_key()) is False
    assert relay.is_posted(planted) is False
    assert relay.sweep(time.time() + 3600) == 0
    assert stat.S_IMODE(board.stat().st_mode) == 0o777 and os.listdir(board) == [planted]
    [message] = refusals(caplog, board)  # said once, not once per call
    assert "mode 0777" in message and "0700" in message


@pytest.mark.skipif(os.getuid() != 0, reason="giving the board to another owner needs root")
def test_a_board_of_another_owner_is_refused(tmp_path, caplog):
    board = tmp_path / "board"
    board.mkdir(mode=0o700)
    os.chown(board, NOBODY, -1)
    relay = CancelRelay(board)
    assert relay.post(new_key()) is False
    assert os.listdir(board) == []
    [message] = refusals(caplog, board)
    assert f"owned by uid {NOBODY}" in message and f"uid {os.getuid()}" in message


def test_a_board_that_is_a_symlink_is_refused_and_nothing_behind_it_is_touched(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    victim = old_post_in(elsewhere)
    board = tmp_path / "board"
    board.symlink_to(elsewhere)
    relay = CancelRelay(board, max_age_s=60, sweep_period_s=0)
    assert relay.sweep() == 0
    assert relay.post(new_key()) is False
    assert relay.is_posted(victim) is False
    assert os.listdir(elsewhere) == [victim]
    [message] = refusals(caplog, board)
    assert "symbolic link" in message


def test_a_symlink_inside_the_board_is_never_followed(tmp_path):
    board, outside = tmp_path / "board", tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_text("someone's file")
    relay = CancelRelay(board, max_age_s=60, sweep_period_s=0)
    assert relay.post(new_key())  # makes the board
    to_create, to_read, to_sweep = new_key(), new_key(), new_key()
    (board / to_create).symlink_to(outside / "created")
    (board / to_read).symlink_to(outside / "kept")
    (board / to_sweep).symlink_to(outside / "kept")
    past = time.time() - 3600
    os.utime(board / to_sweep, (past, past), follow_symlinks=False)
    assert relay.post(to_create) is False
    assert not (outside / "created").exists()
    assert relay.is_posted(to_read) is False
    assert relay.sweep() == 1  # the old link itself goes, not what it points to
    relay.clear(to_read)
    assert sorted(os.listdir(outside)) == ["kept"] and (outside / "kept").read_text() == "someone's file"
    assert not (board / to_sweep).is_symlink() and not (board / to_read).is_symlink()


def test_a_board_swapped_for_a_symlink_after_start_is_refused(tmp_path, caplog):
    board, elsewhere = tmp_path / "board", tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    victim = old_post_in(elsewhere)
    relay = CancelRelay(board, max_age_s=60, sweep_period_s=0, recheck_period_s=0)
    assert relay.post(new_key())
    board.rename(tmp_path / "board.old")
    board.symlink_to(elsewhere)
    assert relay.post(new_key()) is False
    assert relay.sweep() == 0
    assert os.listdir(elsewhere) == [victim]
    assert "symbolic link" in refusals(caplog, board)[0]


def test_a_board_removed_after_start_is_made_anew_and_private(tmp_path):
    board = tmp_path / "board"
    poster, reader = CancelRelay(board), CancelRelay(board, recheck_period_s=0)
    assert poster.post(new_key()) and not reader.is_posted(new_key())  # both hold the board open
    shutil.rmtree(board)
    old_umask = os.umask(0)
    try:
        key = new_key()
        assert poster.post(key)  # at once: a post that finds its board gone makes it again
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(board.lstat().st_mode) == 0o700 and board.is_dir() and not board.is_symlink()
    assert reader.is_posted(key)  # the reader follows to the new board
