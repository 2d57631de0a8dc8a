"""perf.soak --mix (one request path at a time, to find which one grows a process) and --env KEY=VALUE."""
import argparse

import pytest

from perf.soak.run import key_value, parse_mix
from perf.soak.traffic import IMAGE_MIX, MIX


def test_mix_reads_actions_and_weights_and_defaults_a_weight_to_one():
    assert parse_mix("ens_stream=3,ens_cancel") == {"ens_stream": 3.0, "ens_cancel": 1.0}
    assert parse_mix(" bad = 0.5") == {"bad": 0.5}


def test_every_action_of_the_standard_mixes_is_accepted():
    everything = ",".join(sorted(set(MIX) | set(IMAGE_MIX)))
    assert set(parse_mix(everything)) == set(MIX) | set(IMAGE_MIX)


@pytest.mark.parametrize("text, names", [
    ("streem=1", ["unknown action 'streem'", "known: bad,"]),
    ("stream=fast", ["weight of stream must be a number", "'fast'"]),
    ("stream=0", ["weight of stream must be > 0", "got 0"]),
    ("stream=-2", ["must be > 0", "got -2"]),
])
def test_a_bad_mix_names_the_action_and_the_value(text, names):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse_mix(text)
    for name in names:
        assert name in str(err.value)


def test_env_items_split_at_the_first_equals_and_a_bad_one_is_named():
    assert key_value("MALLOC_CONF=background_thread:true,dirty_decay_ms=1") == (
        "MALLOC_CONF", "background_thread:true,dirty_decay_ms=1")
    for bad in ("MALLOC_CONF", "=x"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            key_value(bad)
