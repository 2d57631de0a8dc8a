"""dynamic_arm.cancel_relay: postprocessing posts a row's key, llm_dynamic sees it, clears it, and old posts go."""
import os
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
        relay._path(key)


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
