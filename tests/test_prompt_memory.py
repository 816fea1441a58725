"""The scheduler's own memory of prompts (rollout.policy.prompt_memory), without vLLM."""

import numpy as np
import pytest

from rollout.policy.prompt_memory import PromptMemory, arrival_order, pass_arrivals


def test_scales_are_relative_to_the_remembered_mean_and_fixed_for_a_pass():
    memory = PromptMemory()
    assert memory.open_pass() is None  # nothing remembered: no prior
    for key, n in (("a", 100), ("b", 300)):
        memory.arrive(key)
        memory.finished(key, n)
    assert memory.close_pass() == {"a": [100], "b": [300]}
    prior = memory.open_pass()
    # The mean is 200: a runs half of it, b 1.5 times; the prior is each prompt's lengths in those units.
    assert memory.arrive("a").scale == pytest.approx(0.5)
    assert memory.arrive("b").scale == pytest.approx(1.5)
    assert memory.arrive("new").scale == 1.0
    assert sorted(prior) == pytest.approx([200.0, 200.0])
    memory.finished("new", 1000)  # learned only when the pass closes
    assert memory.arrive("a").scale == pytest.approx(0.5)


def test_an_unseen_prompt_becomes_a_probe_group_at_its_second_request():
    memory = PromptMemory()
    memory.open_pass()
    first, second, third = memory.arrive("x"), memory.arrive("x"), memory.arrive("x")
    assert (first.probe_group, first.held) == (None, False)
    assert (second.probe_group, second.held, second.probes_first) == (0, True, True)
    assert (third.probe_group, third.held, third.probes_first) == (0, True, False)
    assert memory.arrive("y").probe_group is None and memory.arrive("y").probe_group == 1
    # Known prompts and fifo order are never probed.
    memory.finished("x", 5)
    memory.close_pass()
    memory.open_pass()
    assert [memory.arrive("x").probe_group for _ in range(2)] == [None, None]
    fifo = PromptMemory(order="fifo")
    fifo.open_pass()
    assert [fifo.arrive("x") for _ in range(2)] == [(1.0, None, False, False, None)] * 2


def test_a_pass_seen_whole_gives_each_request_what_the_scheduler_learns_as_they_arrive():
    """The simulator's view (pass_arrivals) against arrive() one request at a time, as the adapter calls it: the
    probed prompt's first request gets its group when the second arrives; a known prompt is scaled."""
    memory = PromptMemory()
    memory.open_pass()
    memory.arrive("k")
    memory.finished("k", 10)
    memory.close_pass()
    memory.open_pass()
    arrivals = pass_arrivals(memory, ["x", "k", "x", "y", "x"])
    assert [a.probe_group for a in arrivals] == [0, None, 0, None, 0]
    assert [a.held for a in arrivals] == [False, False, True, False, True]
    assert [a.scale for a in arrivals] == [1.0, 1.0, 1.0, 1.0, 1.0]  # k is the remembered mean
    assert arrivals[2].first == 0  # the handle given with x's first request


def test_arrival_order_keeps_started_requests_in_place_and_puts_held_ones_last():
    started = [True, False, False, False, True, False]
    held = [False, True, False, False, False, False]
    scales = [1.0, 1.0, 0.5, 2.0, 0.1, 2.0]
    # Places 1, 2, 3, 5 take: 3 (2.0), 5 (2.0, later), 2 (0.5), then the held 1.
    order = arrival_order(started, held, scales)
    assert order[0] == 0 and order[4] == 4
    assert [order[k] for k in (1, 2, 3, 5)] == [3, 5, 2, 1]


def test_the_memory_survives_a_save_and_a_load(tmp_path):
    memory = PromptMemory()
    memory.open_pass()
    memory.arrive("a")
    memory.finished("a", 42)
    memory.close_pass()
    memory.save(tmp_path / "m.json")
    loaded = PromptMemory.load(tmp_path / "m.json")
    loaded.open_pass()
    assert loaded.lengths.mean == {"a": 42.0} and np.array_equal(loaded.open_pass(), [42.0])
    assert PromptMemory.load(tmp_path / "absent.json").lengths.mean == {}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        PromptMemory.load(tmp_path / "bad.json")
