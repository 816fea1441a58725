import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.policy import LengthStats, Moments

values = st.lists(st.integers(min_value=0, max_value=20000), min_size=0, max_size=200)


@given(values)
def test_welford_matches_numpy(xs):
    m = Moments()
    for x in xs:
        m.add(x)
    assert m.count == len(xs)
    if xs:
        assert m.mean == pytest.approx(np.mean(xs), rel=1e-9, abs=1e-9)
        assert m.variance == pytest.approx(np.var(xs), rel=1e-7, abs=1e-6)
    else:
        assert m.variance == 0.0


@given(values, values)
def test_merge_equals_concatenation(xs, ys):
    a, b = Moments(), Moments()
    for x in xs:
        a.add(x)
    for y in ys:
        b.add(y)
    a.merge(b)
    both = xs + ys
    assert a.count == len(both)
    if both:
        assert a.mean == pytest.approx(np.mean(both), rel=1e-9, abs=1e-9)
        assert a.variance == pytest.approx(np.var(both), rel=1e-7, abs=1e-6)


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=100), st.integers(2, 30))
def test_window_keeps_only_recent(xs, window):
    m = Moments(forgetting="window", window=window)
    for x in xs:
        m.add(x)
    recent = xs[-window:]
    assert m.mean == pytest.approx(np.mean(recent))
    assert m.variance == pytest.approx(np.var(recent), abs=1e-6)
    assert m.count == len(xs)


def test_exponential_forgetting_follows_drift():
    plain, decayed = Moments(), Moments(forgetting="exponential", decay=0.9)
    for _ in range(200):
        plain.add(100)
        decayed.add(100)
    for _ in range(50):
        plain.add(400)
        decayed.add(400)
    assert plain.mean == pytest.approx((200 * 100 + 50 * 400) / 250)
    # 0.9**50 of the weight is left on the old regime.
    assert decayed.mean == pytest.approx(400 - 300 * 0.9**50, rel=1e-6)


def test_exponential_with_decay_one_is_welford():
    xs = np.random.default_rng(0).integers(0, 1000, 300)
    plain, decayed = Moments(), Moments(forgetting="exponential", decay=1.0)
    for x in xs:
        plain.add(x)
        decayed.add(x)
    assert decayed.mean == pytest.approx(plain.mean)
    assert decayed.variance == pytest.approx(plain.variance)


def test_unknown_forgetting_rejected():
    with pytest.raises(ValueError, match="forgetting"):
        Moments(forgetting="sometimes")


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 4000)), min_size=1, max_size=60),
       st.sampled_from([16, 128]))
def test_block_demand_exact_when_block_size_known(pairs, block_size):
    stats = LengthStats(block_size=block_size)
    for prompt, output in pairs:
        stats.observe(prompt, output)
    blocks = [math.ceil((p + o) / block_size) for p, o in pairs]
    mean, var = stats.demand_blocks(block_size)
    assert mean == pytest.approx(np.mean(blocks))
    assert var == pytest.approx(np.var(blocks), abs=1e-9)


def test_block_demand_estimated_for_another_block_size():
    rng = np.random.default_rng(1)
    totals = rng.integers(200, 3000, 5000)
    stats = LengthStats(block_size=16)
    for t in totals:
        stats.observe(int(t) // 2, int(t) - int(t) // 2)
    mean, var = stats.demand_blocks(128)  # no exact moments for 128: estimated from tokens
    exact = np.ceil(totals / 128)
    assert mean == pytest.approx(exact.mean(), rel=0.01)
    assert var == pytest.approx(exact.var(), rel=0.02)


@pytest.mark.parametrize("forgetting", ["none", "window", "exponential"])
def test_save_load_roundtrip(tmp_path, forgetting):
    stats = LengthStats(forgetting=forgetting, window=50, decay=0.95, block_size=128)
    rng = np.random.default_rng(2)
    for _ in range(80):
        stats.observe(int(rng.integers(10, 100)), int(rng.integers(0, 900)))
    path = tmp_path / "sub" / "stats.json"
    stats.save(path)
    loaded = LengthStats.load(path)
    for name in ("prompt_tokens", "output_tokens", "total_tokens", "total_blocks"):
        a, b = getattr(stats, name), getattr(loaded, name)
        assert (b.count, b.mean, b.variance) == pytest.approx((a.count, a.mean, a.variance))
    assert loaded.demand_blocks(128) == pytest.approx(stats.demand_blocks(128))
    assert loaded.output_histogram == pytest.approx(stats.output_histogram)
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("forgetting", ["none", "window", "exponential"])
def test_output_histogram_weighs_lengths_as_the_moments_do(forgetting):
    from rollout.policy.length_stats import HISTOGRAM_BIN_TOKENS

    stats = LengthStats(forgetting=forgetting, window=50, decay=0.9)
    rng = np.random.default_rng(4)
    outputs = rng.integers(0, 900, 120)
    for n in outputs:
        stats.observe(10, int(n))
    histogram = stats.output_histogram
    assert histogram.sum() == pytest.approx(stats.output_tokens.weight)
    centers = (np.arange(len(histogram)) + 0.5) * HISTOGRAM_BIN_TOKENS
    # the histogram's mean is the moments' mean to within half a bin
    assert (histogram * centers).sum() / histogram.sum() == pytest.approx(stats.output_tokens.mean,
                                                                          abs=HISTOGRAM_BIN_TOKENS / 2)
    if forgetting == "none":
        assert histogram == pytest.approx(np.bincount(outputs // HISTOGRAM_BIN_TOKENS))


def test_load_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        LengthStats.load(bad)
    bad.write_text(json.dumps({"format_version": 99}))
    with pytest.raises(ValueError, match="format"):
        LengthStats.load(bad)
    with pytest.raises(ValueError, match="missing.json"):
        LengthStats.load(tmp_path / "missing.json")


def test_merged_stats_match_single_stream():
    rng = np.random.default_rng(3)
    pairs = [(int(rng.integers(5, 60)), int(rng.integers(0, 700))) for _ in range(100)]
    whole, first, second = (LengthStats(block_size=16) for _ in range(3))
    for i, (p, o) in enumerate(pairs):
        whole.observe(p, o)
        (first if i < 40 else second).observe(p, o)
    first.merge(second)
    assert first.output_histogram == pytest.approx(whole.output_histogram)
    assert first.count == whole.count
    assert first.demand_blocks(16) == pytest.approx(whole.demand_blocks(16))
    assert first.total_tokens.variance == pytest.approx(whole.total_tokens.variance)


def test_prior_from_another_block_size_is_estimated_until_complete():
    prior = LengthStats(block_size=16)
    for total in range(100, 2100, 20):
        prior.observe(50, total - 50)
    prior.set_block_size(128)  # the new engine's block size: block moments restart
    estimated = prior.demand_blocks(128)
    assert estimated[0] == pytest.approx((prior.total_tokens.mean + 63.5) / 128)
    prior.observe(50, 950)  # one exact observation does not replace a hundred estimated ones
    assert prior.demand_blocks(128)[0] == pytest.approx((prior.total_tokens.mean + 63.5) / 128)


def test_prompt_memory_blends_passes_and_survives_a_round_trip(tmp_path):
    from rollout.policy.length_stats import PromptLengths, prompt_key

    memory = PromptLengths(keep=0.5)
    a, b, c = prompt_key([1, 2, 3]), prompt_key([1, 2, 4]), prompt_key([9])
    assert a != b
    memory.update(a, [100, 300])
    memory.update(b, [50])
    memory.update(a, [400])
    assert memory.mean[a] == pytest.approx(0.5 * 200 + 0.5 * 400)
    scales = memory.scales([a, b, c])  # unseen c ranks at the mean of the known
    assert scales[0] > scales[2] > scales[1] and scales.mean() == pytest.approx(1.0)
    memory.save(tmp_path / "m.json")
    again = PromptLengths.load(tmp_path / "m.json")
    assert again.mean == memory.mean and again.keep == 0.5
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read prompt length memory"):
        PromptLengths.load(tmp_path / "bad.json")
