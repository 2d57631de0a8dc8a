"""KV sizing on a shared device: a share that does not fit in the free memory is refused with the numbers,
and engines loading at once size one after the other (SizingLock), each seeing the pools taken before it."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from inflight.kv_sizing import SizingLock, kv_blocks_for_fraction

GiB = 2**30


def test_a_share_is_of_the_whole_device_and_must_fit_in_what_is_free():
    # 80 GiB x 0.45 = 36 GiB, minus a 2 GiB peak: 34 GiB of 1 GiB blocks, whether or not another engine
    # already holds 40 GiB, as long as the 34 GiB are free.
    assert kv_blocks_for_fraction(80 * GiB, 2 * GiB, 0, 0.45, GiB, free_bytes=35 * GiB) == 34
    with pytest.raises(ValueError, match=r"asks for a KV cache of 34.00 GiB, but 20.00 GiB .* is free"):
        kv_blocks_for_fraction(80 * GiB, 2 * GiB, 0, 0.45, GiB, free_bytes=20 * GiB)


def test_sizing_lock_serialises_engines(tmp_path, monkeypatch):
    monkeypatch.setattr(SizingLock, "PATH", str(tmp_path / "sizing.lock"))
    spans = []

    def engine():
        with SizingLock(torch.device("cpu")) as lock:
            start = time.monotonic()
            time.sleep(0.05)
            spans.append((start, time.monotonic(), lock.used_before))

    threads = [threading.Thread(target=engine) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 4 and all(used == 0 for _, _, used in spans)
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(spans, spans[1:])), spans
