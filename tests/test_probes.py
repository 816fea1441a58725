"""First-pass probes (policy.probe_first): one sample of each prompt of unknown lengths goes first, its siblings
wait at the end and are ordered as the probes finish; in the pure functions, the simulator and the real engine."""


import pytest
from omegaconf import OmegaConf

from rollout.policy.probes import SiblingOrder, probe_first_order, reorder_siblings


def test_a_probe_of_each_unknown_prompt_goes_first_and_its_siblings_last():
    groups = ["a", "a", "a", "b", "b", "c", "c", "c", "d"]
    unknown = [True, True, True, False, False, True, True, True, True]  # b is known: whole; d alone: no probe
    assert probe_first_order(groups, unknown) == ([0, 3, 4, 5, 8, 1, 2, 6, 7], [0, None, None, 1, None, 0, 0, 1, 1])
    assert probe_first_order(groups, [False] * 9) == (list(range(9)), [None] * 9)


def test_waiting_siblings_go_longest_first_with_unfinished_groups_ahead():
    order = SiblingOrder()
    assert not order.dirty
    order.observe(1, 10)
    order.observe(2, 300)
    assert order.dirty
    # Queue: a preempted request of group 1 (started), then siblings of groups 1, 2 and 3 (3's probe still runs).
    queue = [("p", 1, True), ("x", 1, False), ("y", 1, False), ("z", 2, False), ("w", 3, False), ("v", None, False)]
    reordered = reorder_siblings(queue, order, [r[1] for r in queue], [r[2] for r in queue])
    assert [r[0] for r in reordered] == ["p", "w", "z", "x", "y", "v"]
    assert not order.dirty
    order.observe(2, 300)  # a group's later samples refine its place but do not call for a reordering
    assert not order.dirty
    order.observe(3, 5)
    assert order.dirty and order.sort_key(3) == -5.0
    order.forget()
    assert not order.dirty and order.sort_key(2) == float("-inf")


def test_in_the_simulator_a_long_groups_siblings_start_before_a_short_ones():
    from rollout.policy import PolicyConfig, make_policy
    from rollout.sim import StepTimeModel, simulate

    model = StepTimeModel(base=5e-3, per_seq=2e-5, per_kv_token=0.0, per_prefill_token=1.7e-5, per_mixed_step=5e-3)
    # Four prompts x 4 samples, in submission order short, long, short, long; two run at a time.
    lengths = {0: 8, 1: 200, 2: 8, 3: 200}
    requests = [(32, lengths[g], 1.0, g) for g in range(4) for _ in range(4)]
    order, probed = probe_first_order([r[3] for r in requests], [True] * len(requests))
    finished = []

    class Recording(type(make_policy({"name": "static", "b_max": 2}))):
        def observe_finished(self, prompt_tokens, output_tokens, length_scale=1.0, group=-1, row=-1):
            finished.append((group, row))

    policy = Recording(PolicyConfig(name="static", b_max=2))
    result = simulate([(*requests[k], g) for k, g in zip(order, probed)], policy, kv_capacity_blocks=1000,
                      block_size=16, max_num_seqs=2, token_budget=4096, step_time=model, sibling_order=SiblingOrder())
    assert result.generated_tokens == sum(r[1] for r in requests)
    probes = {row for row in range(4)}  # rows 0-3 of the submitted order are the probes
    siblings = [group for group, row in finished if row not in probes]
    # The long groups' siblings first (their probes still ran when the short ones finished), the group whose probe
    # ran longest ahead; a short sibling finishes only once the last long one has started.
    assert siblings[:5] == [3, 3, 3, 1, 1] and sorted(siblings[5:]) == [0, 0, 0, 1, 2, 2, 2], siblings


@pytest.mark.engine
def test_in_the_engine_long_prompts_siblings_run_before_short_ones_and_a_known_pass_has_no_probes(
        tiny_model, tmp_path):
    from rollout.config import RunConfig, validate
    from rollout.engine import RolloutEngine
    from rollout.workloads import lognormal_workload

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(tiny_model), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                  "max_model_len": 2048},
        "data": {"source": "synthetic"},
        "sampling": {"n": 4, "ignore_eos": True},
        "policy": {"name": "forecast", "b_max": 2, "order": "longest_first", "probe_first": True},
        "output": {"stats_in": None},
    }))
    validate(cfg)
    prompts, _ = lognormal_workload(4, seed=1)
    lengths = [4, 48, 4, 48]  # prompts 1 and 3 are long
    with RolloutEngine(cfg, tmp_path) as engine:
        for iteration in range(2):
            order = []
            result = engine.generate(prompts, progress=False, max_tokens=lengths,
                                     sink=lambda records: order.extend((r["group_index"], r["sample_index"])
                                                                       for r in records))
            assert [r["completion_tokens"] for r in result.records] == [lengths[i] for i in range(4) for _ in range(4)]
            assert sorted(order) == [(i, s) for i in range(4) for s in range(4)]
            if iteration == 0:
                # Probes first (0:0 and 2:0 finish at once, 1:0 and 3:0 run on); then the siblings of the prompts
                # whose probes still ran, ahead of those of the short prompts (submitted before them).
                siblings = [i for i, s in order if s > 0]
                assert set(siblings[:5]) == {1, 3}, order
            else:
                # The lengths are known: longest first, every sample of a prompt together, no probes.
                assert [i for i, _ in order][:2] != [0, 0] and order[0][0] in (1, 3), order
