"""The graph cap: whether more requests than the engine's largest CUDA-graph batch pay for the eager steps they
bring (rollout/policy/graph_cap.py), alone, inside the policies, in the simulator, and as read from vLLM's config."""

from types import SimpleNamespace

import pytest

from rollout.policy import make_policy
from rollout.policy.graph_cap import GraphCap
from rollout.sim import StepTimeModel, simulate
from rollout.workloads import ProfileConfig, profile_requests

G, B = 64, 128
PROBE = GraphCap(G, B).probe  # requests a probe runs above the graph's batch


def graph_steps(cap: GraphCap, n: int = 8, latency: float = 0.020) -> int:
    for _ in range(n):
        limit = cap.observe(latency, G, 0)
    return limit


def test_the_cap_starts_at_the_graph_then_probes_once_above_it():
    cap = GraphCap(G, B)
    assert cap.limit == G
    assert graph_steps(cap, cap.samples - 1) == G
    assert graph_steps(cap, 1) == G + PROBE  # enough steps at the graph's batch: measure above it
    assert 0 < PROBE < (B - G) / 8  # a small probe: each step above the graph may cost its eager time


def test_steps_with_prompt_tokens_and_small_batches_say_nothing():
    cap = GraphCap(G, B)
    for _ in range(50):
        cap.observe(0.5, G, 300)  # prompt tokens: a step of another kind
        cap.observe(0.001, G // 4, 0)  # far below the graph's batch: its rate says nothing of the graph's best
        cap.observe(0.5, B, 100)
    assert (cap.limit, len(cap.graph_steps), len(cap.eager_steps)) == (G, 0, 0)


@pytest.mark.parametrize("eager_s, limit", [(0.050, G), (0.030, B)])
def test_the_probe_decides_by_tokens_a_second(eager_s, limit):
    # Graph steps: 64 requests in 20 ms (3200/s); their GPU work at 128 at most 40 ms. A probe of 68 requests
    # in 50 ms: 128 take at least that (2560/s), and the graph makes 1.25x it: held. In 30 ms, 128 take the
    # GPU's 40 ms (3200/s), no better than the graph, but a larger batch drains the queue sooner: above.
    cap = GraphCap(G, B)
    graph_steps(cap)
    for _ in range(8):
        cap.observe(eager_s, G + 4, 0)
    assert cap.limit == limit


def test_eager_steps_over_a_range_of_batches_are_read_at_the_largest():
    # A flat probe looked worth it, but eager steps at larger batches grow 0.4 ms a request: at 128, 64 ms for
    # 128 requests (2000/s) against the graph's 3200/s. Without the slope it would stay above the graph.
    cap = GraphCap(G, B)
    graph_steps(cap)
    for batch in range(G + 1, B + 1, 2):
        cap.observe(0.013 + 0.0004 * batch, batch, 0)
    assert cap.limit == G
    flat = GraphCap(G, B)
    graph_steps(flat)
    for batch in range(G + 1, B + 1, 2):
        flat.observe(0.021, batch, 0)
    assert flat.limit == B


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="graph_batch"):
        GraphCap(B, B)
    with pytest.raises(ValueError, match="graph_batch"):
        GraphCap(0, B)


@pytest.mark.parametrize("name", ["memory", "memory-clt", "forecast"])
def test_policies_hold_their_cap_at_what_the_graph_cap_allows(name):
    settings = {"name": name, "b_max": B, "eps_m": 0.05, "graph_cap": True}
    policy = make_policy(settings, graph_batch=G)
    assert policy.max_cap == G and policy.trace_fields()["graph_limit"] == G
    for _ in range(8):
        policy.observe_step(0.020, G, 0)
    assert policy.max_cap == G + PROBE
    for _ in range(8):
        policy.observe_step(0.060, G + 4, 0)
    assert policy.max_cap == G
    assert make_policy({**settings, "graph_cap": False}, graph_batch=G).max_cap == B
    assert make_policy({k: v for k, v in settings.items() if k != "graph_cap"}, graph_batch=G).max_cap == B  # off
    assert make_policy(settings, graph_batch=0).max_cap == B  # no CUDA graphs (CPU, enforce_eager)
    assert make_policy(settings, graph_batch=B).max_cap == B  # every batch is a graph
    sla = make_policy({**settings, "name": "sla", "d_sla_ms": 50}, graph_batch=G)
    for _ in range(8):
        sla.observe_step(0.020, G, 0)
    assert sla.max_cap == G + PROBE  # Algorithm 2's own window still hears the steps


def cap_bound_requests():
    profile = ProfileConfig(num_prompts=600, prompt_tokens=64, median_output=120, sigma=0.8, max_output=800)
    return [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0, 0)]


def run(eager_s: float, graph_cap: bool):
    model = StepTimeModel(base=4e-3, per_seq=3e-5, per_kv_token=0.0, per_prefill_token=1e-5, per_mixed_step=2e-3,
                          graph_batch=G, per_eager_step=eager_s)
    policy = make_policy({"name": "forecast", "b_max": B, "eps_m": 0.05, "graph_cap": graph_cap}, graph_batch=G)
    return simulate(cap_bound_requests(), policy, kv_capacity_blocks=100000, block_size=16, max_num_seqs=B,
                    token_budget=4096, step_time=model, keep_trace=True)


def test_in_the_simulator_a_costly_eager_step_keeps_the_batch_at_the_graph_and_finishes_sooner():
    capped, uncapped = run(0.015, True), run(0.015, False)
    assert capped.generated_tokens == uncapped.generated_tokens
    assert max(running for _, running, *_ in capped.trace) <= G + PROBE
    assert max(running for _, running, *_ in uncapped.trace) == B
    assert capped.makespan_s < 0.9 * uncapped.makespan_s


def test_in_the_simulator_a_cheap_eager_step_lets_the_batch_past_the_graph():
    capped, uncapped = run(0.0005, True), run(0.0005, False)
    assert max(running for _, running, *_ in capped.trace) == B
    assert capped.makespan_s < 1.03 * uncapped.makespan_s  # the probe's few steps cost little


def test_the_graph_batch_is_read_from_vllms_compilation_config():
    from vllm.config import CompilationConfig

    from rollout.vllm.settings import graph_batch

    def config(enforce_eager=False, **compilation):
        return SimpleNamespace(compilation_config=CompilationConfig(**compilation),
                               model_config=SimpleNamespace(enforce_eager=enforce_eager))

    assert graph_batch(config(cudagraph_mode="FULL_DECODE_ONLY", max_cudagraph_capture_size=512)) == 512
    assert graph_batch(config(cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=[1, 2, 4, 8, 256])) == 256
    assert graph_batch(config(cudagraph_mode="NONE", max_cudagraph_capture_size=512)) == 0
    assert graph_batch(config(True, cudagraph_mode="FULL_DECODE_ONLY", max_cudagraph_capture_size=512)) == 0


def test_once_held_at_the_graph_it_stays_there_as_steps_slow():
    # Later graph steps are slower (longer contexts) than the eager steps read before: read against those, the
    # larger batch would look the faster, and the answer would turn back and forth.
    cap = GraphCap(G, B)
    graph_steps(cap)
    for _ in range(8):
        cap.observe(0.050, G + 1, 0)
    assert cap.limit == G and cap.held
    graph_steps(cap, 32, latency=0.045)
    assert cap.limit == G


def test_above_the_graph_it_is_decided_again_every_few_eager_steps_not_at_each():
    # Cheap eager steps first: above the graph. Then eager steps of 128 requests turn slow (90 ms: 1422/s
    # against the graph's 3200/s): seven of them leave the decision as it was, the eighth brings the cap down.
    cap = GraphCap(G, B)
    graph_steps(cap)
    for _ in range(8):
        cap.observe(0.021, G + 1, 0)
    assert cap.limit == B and not cap.held
    for _ in range(7):
        assert cap.observe(0.090, B, 0) == B
    assert cap.observe(0.090, B, 0) == G and cap.held


def test_a_policy_that_fails_while_probing_falls_back_to_the_configured_cap_not_the_probe():
    from rollout.policy import FallbackPolicy

    policy = make_policy({"name": "memory", "b_max": B, "eps_m": 0.05, "graph_cap": True}, graph_batch=G)
    guarded = FallbackPolicy(policy, fallback_cap=B)
    for _ in range(8):
        guarded.observe_step(0.020, G, 0)
    assert policy.max_cap == G + PROBE  # probing
    policy.batch_cap = None  # a bug: the next step's call raises
    assert guarded.batch_cap(SimpleNamespace(num_running=G)) == B
    held = make_policy({"name": "memory", "b_max": B, "eps_m": 0.05, "graph_cap": True}, graph_batch=G)
    guarded = FallbackPolicy(held, fallback_cap=B)
    for latency, batch in [(0.020, G)] * 8 + [(0.060, G + 4)] * 8:
        guarded.observe_step(latency, batch, 0)
    held.batch_cap = None
    assert guarded.batch_cap(SimpleNamespace(num_running=G)) == G  # what the graph cap decided stays
