"""Length-aware admission from predicted lengths (issue #4): the oracle's rule with estimates instead of truth.

Output lengths are estimated with censoring: early in a pass the finished requests are the short ones, so the
finished lengths alone understate E[l_out]. Each running request that has generated g tokens says "l_out > g";
the Kaplan-Meier estimator over fixed-width bins combines both. From it, a running request's remaining length
is E[l_out - g | l_out > g] (conditional on what it already generated), and a fresh request's is E[l_out].

Admission then follows the oracle (`oracle.py`) with expectations: waiting requests, in queue order, are
admitted while, at every future time, the expected KV demand of everything running plus them (each request's
tokens weighted by the probability it is still running then) plus theta standard deviations fits the cache.
Samples of one prompt (a GRPO group) share its prompt blocks, counted once, and its length: what a group's
finished samples say moves the estimate for the rest of the group (`SiblingLengths`).
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import numpy as np

from rollout.policy.length_stats import HISTOGRAM_BIN_TOKENS, add_to_bin
from rollout.policy.memory import clamp_cap
from rollout.policy.base import StepState, register
from rollout.policy.policies import MemoryPolicy


MAX_POINTS = 48
FIRST_WINDOW = 16  # waiting requests forecast first (most steps admit fewer)
WAITING_LIMIT = 256  # waiting requests described to the policy each step (at least)
MARGIN_WIDEN, MARGIN_NARROW = 2.0, 0.99  # preemption feedback: theta's scale per step that preempted / quiet forecast
MARGIN_SCALE_MIN, MARGIN_SCALE_MAX = 0.5, 2.0
MARGIN_QUIET_FORECASTS = 32  # forecasts without a preemption before the margin narrows
STABLE_COUNT = 512  # finished lengths after which one more finish barely moves the estimate
# Before that, a forecast that admitted nothing where its first request left out overshoots later (not now) is
# repeated once the finishes since add this share of the lengths seen (any finish below 128). In the simulator
# (long-cot, 4 seeds) 1/128 and 1/64 were the same, 1/32 lost 0.6%, none at all 1.2%; 1/64 lost 1.5% on
# small grpo passes (384 requests, where the estimate never settles).
ESTIMATE_MOVE = 1 / 128
# While the cap (B_max) binds, a forecast waits until this share of the running requests could be admitted: on
# an H100 (cap-bound, 1024 running) a forecast after every finish cost 1.2% of the step time in CPU, and each
# admission of a few requests a step with prefill (+2.9 ms). In the simulator: 237 -> 66 forecasts, +0.9%.
HEADROOM_SHARE = 1 / 64
# A wave too small to admit waits for twice as many finishes as it lacked requests before the next forecast:
# once as many, a third of grpo-groups' forecasts were such re-checks that admitted nothing again (simulator;
# the GPU's policy time 1.17% of a step there, 1.22% on kv-bound). Twice cut the forecasts by a third for
# 0.3-0.4% of simulated throughput, which leaves out the policy's own time.
WAVE_WAIT = 2
# A forecast the estimate's move called for that admitted nothing doubles the finishes the next one waits for, up
# to this factor (any admission resets it). 95-98% of those forecasts admitted nothing (simulator: kv-bound 158 of
# 160, long-cot 198 of 202), and each cost ~1 ms of an H100 host's CPU. With 4, forecasts 285 -> 178 (kv-bound),
# 223 -> 82 (long-cot), 413 -> 267 (real); throughput within +-0.4% by profile over 4-8 seeds.
ESTIMATE_WAIT_MAX = 4
# Least correlation taken between the lengths of a group's samples once some of them finished, in a pass that
# starts from nothing (see SiblingLengths.informed). Simulator, grpo-groups' first pass (H200 model, seeds 0-7),
# against 1 (stop 29): the posterior's own 0.2-0.45 ran +0.4..2.2% and recomputed up to 1.6%; 0.3 up to 1.3%;
# 0.5 ran +0.7..1.3% (recomputed <= 0.64%, one seed 1.22%); 0.7 +0.0..0.8%.
SIBLING_CORRELATION_MIN = 0.5


def censored_normal_fit(values: np.ndarray, weights: np.ndarray, censored: np.ndarray,
                        censored_weights: np.ndarray, standard_errors: bool = False):
    """Maximum-likelihood mean and sd of a normal from weighted observations and weighted right-censored ones
    (known only to exceed their value). What scipy.stats.norm.fit does with CensoredData, over distinct values
    with weights. Newton's method in (mean / sd, 1 / sd), where the log-likelihood is concave (Olsen, 1978):
    4-7 steps, ~0.4 ms against Nelder-Mead's ~2 ms over 300 random fits (kv-bound's refits were a fifth of its
    forecasts' time).
    `standard_errors`: also those of the mean and of log(sd), from the likelihood's curvature at its maximum
    (0 where it is flat)."""
    values, weights = np.asarray(values, dtype=float), np.asarray(weights, dtype=float)
    censored, censored_weights = np.asarray(censored, dtype=float), np.asarray(censored_weights, dtype=float)
    total = weights.sum()
    if not total:  # only censored: no maximum (the mean runs off past them)
        return _nelder_mead_fit(values, weights, censored, censored_weights, standard_errors)
    mean = float(np.sum(weights * values) / total)
    sd = max(float(np.sqrt(np.sum(weights * (values - mean) ** 2) / total)), 1e-3)
    params = np.array([mean / sd, 1.0 / sd])
    terms = _censored_normal_terms(params, values, weights, censored, censored_weights)
    for _ in range(NEWTON_FIT_STEPS):
        log_likelihood, gradient, hessian = terms
        try:
            step = np.linalg.solve(hessian, -gradient)
        except np.linalg.LinAlgError:
            step = gradient / max(float(np.abs(np.diag(hessian)).max()), 1e-12)
        shrink = 1.0
        while shrink > 1e-6:  # halved until it climbs (and 1/sd stays positive)
            trial = params + shrink * step
            if trial[1] > 0:
                trial_terms = _censored_normal_terms(trial, values, weights, censored, censored_weights)
                if trial_terms[0] >= log_likelihood - 1e-12 * abs(log_likelihood):
                    break
            shrink /= 2
        else:
            break
        moved = np.abs(trial - params).max() / max(np.abs(params).max(), 1e-12)
        params, terms = trial, trial_terms
        if moved < 1e-10:
            break
    else:  # not converged (a flat likelihood): the simplex, as before
        return _nelder_mead_fit(values, weights, censored, censored_weights, standard_errors)
    scaled_mean, inverse_sd = params
    mean, sd = float(scaled_mean / inverse_sd), float(1.0 / inverse_sd)
    if not standard_errors:
        return mean, sd
    # Covariance in (mean/sd, 1/sd), carried to (mean, log sd) by the map's Jacobian.
    jacobian = np.array([[1.0 / inverse_sd, -scaled_mean / inverse_sd ** 2], [0.0, -1.0 / inverse_sd]])
    try:
        cov = jacobian @ np.linalg.inv(-terms[2]) @ jacobian.T
        se = np.sqrt(np.diag(cov)) if np.all(np.diag(cov) > 0) else np.zeros(2)
    except np.linalg.LinAlgError:
        se = np.zeros(2)
    return mean, sd, float(se[0]), float(se[1])


NEWTON_FIT_STEPS = 50


def _censored_normal_terms(params: np.ndarray, values, weights, censored, censored_weights):
    """Log-likelihood, gradient and Hessian in (g, t) = (mean / sd, 1 / sd)."""
    from scipy import special

    g, t = params
    z = t * values - g
    c = g - t * censored  # standardized distance below the mean of each censoring point
    log_cdf = special.log_ndtr(c)
    mills = np.exp(-0.5 * c * c - 0.5 * np.log(2 * np.pi) - log_cdf)  # pdf / cdf, stable far in the tail
    curvature = censored_weights * mills * (c + mills)
    total = weights.sum()
    log_likelihood = total * np.log(t) - 0.5 * np.sum(weights * z * z) + np.sum(censored_weights * log_cdf)
    weighted_mills = censored_weights * mills
    gradient = np.array([np.sum(weights * z) + weighted_mills.sum(),
                         total / t - np.sum(weights * z * values) - np.sum(weighted_mills * censored)])
    cross = np.sum(weights * values) + np.sum(curvature * censored)
    hessian = np.array([[-total - curvature.sum(), cross],
                        [cross, -total / t ** 2 - np.sum(weights * values ** 2) - np.sum(curvature * censored ** 2)]])
    return float(log_likelihood), gradient, hessian


def _nelder_mead_fit(values, weights, censored, censored_weights, standard_errors):
    """The same likelihood by the simplex in (mean, log sd), where Newton has no maximum to climb to."""
    from scipy import optimize, special

    total = weights.sum()
    mean = float(np.sum(weights * values) / total) if total else float(np.mean(censored))
    sd = float(np.sqrt(np.sum(weights * (values - mean) ** 2) / total)) if total else 1.0

    def negative_log_likelihood(params: np.ndarray) -> float:
        mu, log_sigma = params
        sigma = np.exp(log_sigma)
        observed = np.sum(weights * (-0.5 * ((values - mu) / sigma) ** 2 - log_sigma))
        return -(observed + np.sum(censored_weights * special.log_ndtr((mu - censored) / sigma)))

    fit = optimize.minimize(negative_log_likelihood, [mean, np.log(max(sd, 1e-3))], method="Nelder-Mead",
                            options={"xatol": 1e-4, "fatol": 1e-6})
    if not standard_errors:
        return float(fit.x[0]), float(np.exp(fit.x[1]))
    return float(fit.x[0]), float(np.exp(fit.x[1])), 0.0, 0.0


class CensoredLengths:
    """Kaplan-Meier estimate of the output-length distribution over bins of `bin_tokens` tokens."""

    def __init__(self, bin_tokens: int = 16, tail: str = "lognormal", tail_confidence: float = 1.5) -> None:
        self.bin_tokens = bin_tokens
        self.tail = tail
        self.tail_confidence = tail_confidence
        # Finished samples per distinct prompt among them: samples of one prompt run about as long as each
        # other, so the fit knows less than its count of lengths says (the variance of its parameters grows by
        # up to this factor; 1 for groups of one).
        self.design_effect = 1.0
        # Finished requests per length bin (weights: earlier passes count less): a list (`add_to_bin`), read
        # whole as an array (`finished`).
        self._finished = [0.0] * 64
        self.count = 0.0
        self.longest_bin = 0
        self._tail_fit: tuple[int, float, float] | None = None  # (count when fitted, log-mean, log-sd)
        self._tail_ratio = None  # survival past the longest finished request, relative to it, for a fit

    @property
    def finished(self) -> np.ndarray:
        return np.array(self._finished)

    @finished.setter
    def finished(self, weights) -> None:
        self._finished = np.asarray(weights, dtype=float).tolist()

    def observe(self, output_tokens: float, weight: float = 1.0) -> None:
        k = int(output_tokens // self.bin_tokens)
        add_to_bin(self._finished, k, weight)
        self.count += weight
        if k > self.longest_bin:
            self.longest_bin = k

    def forget(self, keep: float) -> None:
        """Weigh everything observed so far by `keep` (a new pass: lengths drift between RL iterations)."""
        self._finished = [w * keep for w in self._finished]
        self.count *= keep
        self._tail_fit = self._tail_ratio = None
        if keep == 0:
            self.longest_bin = 0

    def _lognormal(self, generated: np.ndarray) -> tuple[float, float]:
        """Log-mean and log-sd of a lognormal fitted (censored maximum likelihood) to the finished lengths and
        the running requests' output so far; refitted each time the finished count doubles."""
        if self._tail_fit is None or self.count >= 2 * self._tail_fit[0]:
            finished = self.finished
            centers = (np.arange(len(finished)) + 0.5) * self.bin_tokens
            # Carried-over passes weigh each length by a fraction: rounding the running total (not each bin)
            # keeps their mass and shape.
            counts = np.diff(np.round(np.cumsum(finished)), prepend=0.0)
            censored, times = np.unique(np.log(np.maximum(generated, 1)), return_counts=True)
            log_mean, log_sd, se_mean, se_log_sd = censored_normal_fit(
                np.log(centers[counts > 0]), counts[counts > 0], censored, times, standard_errors=True)
            # Toward longer lengths by `tail_confidence` standard errors: the first finishes are few and short,
            # and a fit to them that came out low (long-cot, simulator: 1,504 tokens for a true mean of 2,035
            # after 32) admitted a wave that preempted 2-4% of the tokens later on.
            # Bounded (lengths e times longer, a spread twice as wide) where a flat likelihood (a handful of
            # finishes) has no useful curvature.
            k = self.tail_confidence * np.sqrt(self.design_effect)
            log_mean, log_sd = log_mean + min(k * se_mean, 1.0), log_sd * np.exp(min(k * se_log_sd, np.log(2.0)))
            self._tail_fit = (self.count, log_mean, max(log_sd, 1e-3))
        return self._tail_fit[1:]

    def reach(self, generated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The censored (Kaplan-Meier) estimate: reach[k] = P(l_out reaches bin k), with `generated`, the output
        so far of requests still running, as the censored observations. Also returns their bins. Mass never seen
        to finish (only censored past it) ends one bin past the longest request seen."""
        generated = np.asarray(generated, dtype=float)
        bins = (generated // self.bin_tokens).astype(np.int64)
        top = int(bins.max(initial=0))
        size = max(self.longest_bin, top) + 2
        events = np.zeros(size)
        events[:min(size, len(self._finished))] = self._finished[:size]
        censored = np.bincount(bins, minlength=size).astype(float) if len(generated) else np.zeros(size)
        at_risk = np.cumsum((events + censored)[::-1])[::-1]  # length or censoring point in bin k or later
        hazard = np.divide(events, at_risk, out=np.zeros(size), where=at_risk > 0)
        reach = np.concatenate([[1.0], np.cumprod(1.0 - hazard)])
        if self.tail == "lognormal" and reach[-1] > 0 and self.count >= 2:
            # Past the longest finished request the data say nothing: a censored lognormal fit carries the tail.
            from scipy import special

            fit = self._lognormal(generated)
            last = self.longest_bin + 1
            if self._tail_ratio is None or self._tail_ratio[0] != (fit, last) or len(self._tail_ratio[1]) < 2 * size:
                edges = np.arange(last, last + 4 * size + 64) * self.bin_tokens  # long enough for most tails
                survival = special.ndtr((fit[0] - np.log(edges)) / fit[1])  # lognormal sf; scipy.stats' costs 10x
                ratio = survival / max(survival[0], 1e-300)
                self._tail_ratio = ((fit, last), ratio, int(np.searchsorted(-ratio, -1e-3)))
            _, ratio, above = self._tail_ratio  # `above`: bins until the tail falls under 1e-3
            keep = max(above, top + 2 - last, 1)
            reach = np.concatenate([reach[:last + 1], reach[last] * ratio[1:keep]])
        return bins, np.concatenate([reach, [0.0]])

    def conditional(self, generated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the remaining output length of running requests that have generated
        `generated` tokens."""
        generated = np.asarray(generated, dtype=np.int64)
        bins, reach = self.reach(generated)
        mass = reach[:-1] - reach[1:]  # P(l_out ends in bin k)
        centers = (np.arange(len(mass)) + 0.5) * self.bin_tokens
        m0, m1, m2 = (np.cumsum((mass * centers ** p)[::-1])[::-1] for p in (0, 1, 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_len = np.where(m0[bins] > 0, m1[bins] / m0[bins], generated + self.bin_tokens)
            var_len = np.where(m0[bins] > 0, m2[bins] / m0[bins] - mean_len ** 2, 0.0)
        return np.maximum(mean_len - generated, 1.0), np.maximum(var_len, 0.0)


# The least within-group variance of log lengths the sibling model assumes (a 1% spread).
WITHIN_VAR_MIN = 1e-4


class Informed(NamedTuple):
    """Rows whose estimate their group's finished samples informed (SiblingLengths): in log length relative to
    the row's scale, the estimate's quantiles move by `offset` and narrow by `spread` about `pivot`."""

    offset: np.ndarray  # per row (running, then waiting): 0 where nothing was learned
    spread: np.ndarray  # per row: 1 where nothing was learned
    pivot: float  # log tokens, relative to scale: the pass's log-mean length
    # Per row: the correlation of its length with its group's other samples (None: 1 for every row).
    correlation: np.ndarray | None = None


class SiblingLengths:
    """Within a pass, what a group's finished samples say of its running ones: the n samples of one prompt run
    about as long as each other. In log output length relative to a request's predicted scale,
    x = mu + offset_g + noise, with offset_g ~ N(0, between) across groups and noise ~ N(0, within). A group's
    offset is its posterior mode given its finished samples (exact) and its running ones (censored: longer than
    what they generated so far, so the first, short finishers do not pull the group down alone). mu and the
    total spread come from a censored fit over the pass; the within-group spread from the previous pass's
    groups (complete by then), or half the total in a first pass (the simulator's grpo-groups, whose groups
    hold 16% of the spread, preempted 1.6% of its tokens with the true share in its first pass)."""

    # Finished samples (any group) before offsets are estimated: with 16 or 32, a pass's first fit (short
    # finishers, many censored) over-narrowed, and 48-group passes in the simulator recomputed 2-6% of tokens.
    MIN_FINISHED = 64
    NEWTON_STEPS = 6

    def __init__(self) -> None:
        self.within_var: float | None = None
        # The pass starts from nothing: no earlier pass's lengths carried, no per-prompt predictions (see
        # `informed`; the policy says at each `start_pass`).
        self.fresh = True
        self._reset()

    def _reset(self) -> None:
        # Per group id (ids are small integers, a pass's groups in arrival order): finished samples, and the
        # sum and sum of squares of their log(length / scale).
        self.count, self.total, self.sum_squares = np.zeros(64), np.zeros(64), np.zeros(64)
        self.values: list[float] = []
        self._fit: tuple[int, float, float] | None = None  # (finished when fitted, mu, total sd)

    def start_pass(self, fresh: bool = True) -> None:
        self.fresh = fresh
        multi = self.count >= 2  # at a pass's end every group is complete: an unbiased within-group spread
        if np.count_nonzero(multi) >= 8:
            deviation = self.sum_squares[multi] - self.total[multi] ** 2 / self.count[multi]
            # Floored: samples of a prompt with one length (greedy decoding, imposed lengths) have none, and a
            # zero spread would divide by zero in `informed`.
            self.within_var = max(float(deviation.sum() / (self.count[multi] - 1).sum()), WITHIN_VAR_MIN)
        self._reset()

    def observe(self, group: int, output_tokens: float, scale: float) -> None:
        if group < 0:
            return
        if group >= len(self.count):
            grow = max(group + 1, 2 * len(self.count)) - len(self.count)
            self.count, self.total, self.sum_squares = (np.pad(a, (0, grow)) for a in
                                                        (self.count, self.total, self.sum_squares))
        x = math.log(max(output_tokens, 1.0) / scale)  # numpy's log of one float costs ~10x math's
        self.count[group] += 1
        self.total[group] += x
        self.sum_squares[group] += x * x
        self.values.append(x)

    def informed(self, groups: np.ndarray, generated: np.ndarray, scale: np.ndarray, running: int) -> Informed | None:
        """What each row's group says of it (offset 0, spread 1 where no sibling finished), or None while
        nothing is known. Rows: requests with `groups`, output so far `generated` and predicted `scale`; the
        first `running` are running (their output so far is censored evidence), the rest wait."""
        from scipy import special

        if len(self.values) < self.MIN_FINISHED or not len(groups):
            return None
        groups = np.asarray(groups)
        in_range = (groups >= 0) & (groups < len(self.count))
        known = in_range.copy()
        known[in_range] = self.count[groups[in_range]] > 0
        # A waiting request whose siblings all still run learns from them alone: longer than their output so
        # far. First-pass probes put such requests first (their groups are the long ones); read as the pass's
        # average, their admission preempted up to 1.3% of tokens on an H200.
        # Only moved up, not narrowed: a censored look at a group is no measure of its spread (narrowed, the
        # simulator's grpo-groups preempted 1.7% of its tokens on one seed of four).
        only_running = np.zeros(len(groups), dtype=bool)
        only_running[running:] = in_range[running:] & ~known[running:] & np.isin(
            groups[running:], groups[:running][in_range[:running]])
        known |= only_running
        if not known.any():  # no running or waiting request has a finished sibling (groups of one)
            return None
        censored = np.log(np.maximum(generated[:running], 1.0) / scale[:running])
        if self._fit is None or len(self.values) >= 1.25 * self._fit[0]:
            values = np.asarray(self.values)
            mu, sd = censored_normal_fit(values, np.ones(len(values)), censored, np.ones(len(censored)))
            self._fit = (len(values), mu, max(sd, 1e-3))
        _, mu, sd = self._fit
        within = max(min(self.within_var if self.within_var is not None else sd ** 2 / 2, sd ** 2), WITHIN_VAR_MIN)
        between = max(sd ** 2 - within, 1e-4)
        used, index = np.unique(groups[known], return_inverse=True)
        count, total = self.count[used], self.total[used]
        evidence = in_range[:running] & np.isin(groups[:running], used)  # every running sample of those groups
        index_running, points = np.searchsorted(used, groups[:running][evidence]), censored[evidence]
        within_sd = np.sqrt(within)
        # Normal-normal posterior from the finished samples, then Newton steps on the censored likelihood (concave).
        offset = (total - count * mu) / (count + within / between)
        for _ in range(self.NEWTON_STEPS):
            z = (mu + offset[index_running] - points) / within_sd
            mills = np.exp(-0.5 * z ** 2 - 0.5 * np.log(2 * np.pi) - special.log_ndtr(z))  # phi(z) / Phi(z)
            grad = (total - count * (mu + offset)) / within - offset / between \
                + np.bincount(index_running, mills, len(used)) / within_sd
            hess = -count / within - 1.0 / between - np.bincount(index_running, mills * (z + mills), len(used)) / within
            offset -= grad / hess
        # A row of a known group: log length ~ N(mu + offset, within + posterior variance), against the whole
        # pass's N(mu, sd^2): the estimate's quantiles move by the offset and narrow by the sd ratio.
        spread = np.sqrt(np.minimum((within - 1.0 / hess) / sd ** 2, 1.0))
        row_offset, row_spread = np.zeros(len(groups)), np.ones(len(groups))
        row_offset[known], row_spread[known] = offset[index], spread[index]
        row_spread[only_running] = 1.0
        # Once a group's samples finished, its others vary together only by what is still unknown of the group:
        # the offset's posterior variance against the samples' own. Taken as 1 (all move together) they held
        # the cache 5-20% emptier than the oracle's in grpo-groups' first pass. Only in a fresh pass: in later
        # ones (lengths carried, per-prompt predictions) it recomputed up to 4.8% of grpo-groups' second pass
        # and 2.5% of small passes (simulator): there the pass's requests share an error (a mean that moved, as
        # RL's lengths drift) which the full correlation covered and this model leaves out.
        row_correlation = None
        if self.fresh:
            posterior = -1.0 / hess
            row_correlation = np.ones(len(groups))
            row_correlation[known] = np.maximum(posterior / (posterior + within), SIBLING_CORRELATION_MIN)[index]
            row_correlation[only_running] = 1.0
        return Informed(row_offset, row_spread, mu, row_correlation)


def _to_estimate(tokens: np.ndarray, scale: np.ndarray | None, informed: Informed | None) -> np.ndarray:
    """Output lengths of requests (rows) in the estimate's units: divided by their scale, and for rows their
    siblings informed, mapped by the quantile shift and narrowing `Informed` holds."""
    tokens = np.asarray(tokens, dtype=float)
    if scale is None:
        return tokens
    if tokens.ndim == 2:
        scale = scale[:, None]
    base = tokens / scale
    if informed is not None:
        offset, spread = (informed.offset, informed.spread) if tokens.ndim == 1 else (
            informed.offset[:, None], informed.spread[:, None])
        with np.errstate(divide="ignore"):
            base = np.exp(informed.pivot + (np.log(base) - informed.pivot - offset) / spread)
    return base


def _from_estimate(tokens: float, scale: np.ndarray, informed: Informed) -> np.ndarray:
    """The inverse of `_to_estimate`: a length in the estimate's units as each row's real output length."""
    return scale * np.exp(informed.pivot + informed.offset + informed.spread * (np.log(tokens) - informed.pivot))


def _alive(bins: np.ndarray, reach: np.ndarray, ahead: np.ndarray) -> np.ndarray:
    """P(still running `ahead` bins of the estimate later | has reached `bins`), one row per request. `ahead`:
    whole bins, the same for every row, or one row of fractional bins per request (a request with scale s runs
    s times as long as the estimate: t real tokens are t / s there)."""
    last = len(reach) - 1  # reach ends with 0: past the end, nobody runs
    if ahead.ndim == 1:
        later = reach[np.minimum(bins[:, None] + ahead[None, :], last)]
    else:  # linear interpolation between bins (np.interp's binary search per point is several times slower)
        position = np.minimum(bins[:, None] + ahead, last)
        below = position.astype(np.int64)
        above = reach[np.minimum(below + 1, last)]
        later = above + (reach[below] - above) * (below + 1 - position)
    now = reach[bins][:, None]
    if now.min(initial=1.0) > 0:
        alive = later / now
    else:
        alive = np.zeros(later.shape)
        alive[:, 0] = 1.0
        np.divide(later, now, out=alive, where=now > 0)
    # At most 1: interpolated at zero bins ahead, `later` can round a hair above `now`, and a survival over 1 made
    # a demand's variance negative, its sd NaN and every admission fail (simulator, grpo-groups seed 3: one
    # request at a time for 280,000 steps).
    return np.minimum(alive, 1.0, out=alive)


def _ahead(generated: np.ndarray, steps: np.ndarray, bin_tokens: int, scale: np.ndarray | None,
           informed: Informed | None) -> np.ndarray:
    """How far each request moves in the estimate's bins while it generates `steps` more tokens."""
    if scale is None:
        return steps // bin_tokens
    ahead = steps[None, :] / (bin_tokens * scale[:, None])
    if informed is not None:
        rows = np.flatnonzero((informed.offset != 0) | (informed.spread != 1))
        moved = _rows(informed, rows)
        start = _to_estimate(generated[rows], scale[rows], moved)
        end = _to_estimate(generated[rows, None] + steps[None, :], scale[rows], moved)
        ahead[rows] = (end - start[:, None]) / bin_tokens
    return ahead


def _rows(informed: Informed, rows: np.ndarray) -> Informed:
    return Informed(informed.offset[rows], informed.spread[rows], informed.pivot,
                    None if informed.correlation is None else informed.correlation[rows])


def survival_after(lengths: CensoredLengths, generated: np.ndarray, horizon_bins: int, stride: int = 1,
                   scale: np.ndarray | None = None) -> np.ndarray:
    """P(a running request that has generated g tokens is still running j * stride bins later),
    j = 0..horizon_bins-1, one row per request. `scale`: each request's predicted length relative to the
    average (the estimate is of lengths divided by it)."""
    generated = np.asarray(generated, dtype=float)
    scale = None if scale is None else np.asarray(scale, dtype=float)
    bins, reach = lengths.reach(_to_estimate(generated, scale, None))
    steps = stride * np.arange(horizon_bins) * lengths.bin_tokens
    return _alive(bins, reach, _ahead(generated, steps, lengths.bin_tokens, scale, None))


class Groups:
    """Rows (requests in queue order) by group, for sums over the earlier rows of each row's group. Only groups
    of two or more rows take part (most rows are alone in kv-bound work); a negative group is no group."""

    def __init__(self, group: np.ndarray) -> None:
        group = np.asarray(group)
        self.first = None
        if len(group) and group.min() >= 0:
            # Usually each group's rows are next to each other in the queue (a prompt's samples arrive and are
            # admitted together): then sums run in queue order, without gathering rows by group.
            change = np.r_[True, group[1:] != group[:-1]]
            heads = group[change]
            if len(np.unique(heads)) == len(heads):
                starts = np.flatnonzero(change)
                self.first = np.repeat(starts, np.diff(np.r_[starts, len(group)]))
                self.rows = None
                self.grouped = len(heads) < len(group)
                return
        order = np.argsort(group, kind="stable")
        g = group[order]
        starts = np.r_[True, g[1:] != g[:-1]] if len(g) else np.zeros(0, bool)
        ends = np.r_[g[1:] != g[:-1], True] if len(g) else np.zeros(0, bool)
        member = ~(starts & ends) & (g >= 0)
        self.rows = order[member]  # grouped, queue order within a group
        first = np.flatnonzero(starts[member])
        self.first = first[np.searchsorted(first, np.arange(len(self.rows)), side="right") - 1]
        self.grouped = len(self.rows) > 0

    def __bool__(self) -> bool:
        return self.grouped

    def earlier_sum(self, values: np.ndarray) -> np.ndarray:
        """For each row, the sum of `values` over earlier rows of its group."""
        if self.rows is None:  # groups contiguous in queue order
            through = np.cumsum(values, axis=0)
            return through - values - (through[self.first] - values[self.first])
        before = np.zeros_like(values)
        if not len(self.rows):
            return before
        v = values[self.rows]
        through = np.cumsum(v, axis=0)
        before[self.rows] = through - v - (through[self.first] - v[self.first])
        return before


def shared_prompt_holding(alive: np.ndarray, groups: Groups, shared: np.ndarray) -> np.ndarray:
    """Prompt tokens each row holds for its group at each future time, in expectation's terms: a group's shared
    prompt blocks stay while any member runs, so row i carries them only where no earlier row of its group is
    still running (probability prod(1 - alive_j)). A group's rows, weighted by their own survival, then sum to
    shared * P(any member alive) (members independent). Rows in queue order: running, then waiting."""
    if not groups or not np.any(shared > 0):
        return np.repeat(shared[:, None].astype(float), alive.shape[1], axis=1)
    none_before = np.exp(groups.earlier_sum(np.log(np.clip(1.0 - alive, 1e-300, 1.0))))
    return shared[:, None] * none_before


class Overshoot(NamedTuple):
    """Where the first request not admitted overshoots the cache most: how many tokens ahead, the expected
    demand and its variance there of each request forecast (running, then waiting), and their total variance.
    A request that ends before then takes its share away (see `ForecastPolicy.wants_requests`). Where it
    overshoots now the per-row lists are left empty: what frees room then is read from the cache itself."""

    tokens_ahead: float
    mean: list  # lists: read an item at a time, per finish and per step
    var: list
    total_var: float
    # The share of it expected to have ended by each future time up to then (tokens ahead, share): finishes
    # the forecast already counted on.
    expected_ahead: list
    expected_gone: list


def _interpolate(x: float, xs: list, ys: list) -> float:
    """np.interp for one point, in plain Python: it runs every step, where numpy's call overhead dominates."""
    k = bisect.bisect_right(xs, x)
    if k == 0:
        return ys[0]
    if k == len(xs):
        return ys[-1]
    x0, x1 = xs[k - 1], xs[k]
    return ys[k - 1] + (ys[k] - ys[k - 1]) * (x - x0) / (x1 - x0)


class Admission(NamedTuple):
    count: int  # waiting requests admitted (a prefix of the queue)
    margin_tokens: float  # kept free against uncertainty where the admitted demand comes closest to the cache
    shortfall_tokens: float  # how far the first request not admitted would overshoot the cache (0: all fit)
    overshoot: Overshoot | None = None  # where it does (None: all fit)


def expected_demand_admissions(running_tokens: np.ndarray, running_generated: np.ndarray,
                               waiting_tokens: np.ndarray, waiting_generated: np.ndarray,
                               lengths: CensoredLengths, capacity_tokens: float, block_size: int,
                               theta: float, running_scale: np.ndarray | None = None,
                               waiting_scale: np.ndarray | None = None, running_group: np.ndarray | None = None,
                               waiting_group: np.ndarray | None = None, running_shared: np.ndarray | None = None,
                               waiting_shared: np.ndarray | None = None, informed: Informed | None = None,
                               with_margin: bool = False, max_output: int = 0, horizon_tokens: int = 0,
                               pointwise_running_peak: bool = True):
    """How many waiting requests (a prefix, in queue order) fit: at every future time (in bins of output
    tokens), the expected KV demand of running and admitted requests plus theta standard deviations stays
    within the cache. A request holding c tokens demands c + t (plus a partly used block) at t steps ahead if it
    is still running then, with the probability `survival_after` gives. With groups and shared prompt tokens
    (prefix caching), a group's shared prompt blocks count once, while any member runs. `with_margin`: return
    an `Admission`, which adds the tokens kept free against uncertainty (theta standard deviations) where the
    admitted demand comes closest to the cache (the forecast's counterpart of Algorithm 1's safety buffer), and
    by how many tokens the first request not admitted overshoots it. `informed`: rows (running, then waiting)
    whose estimate their group's finished samples moved (see SiblingLengths). The `Admission` also tells
    where the first request not admitted overshoots (`Overshoot`), for the policy to know when to look again.
    `max_output` (0: none): the requests' max_tokens, past which none runs whatever the estimate says.
    `horizon_tokens` (0: none): look only this many output tokens ahead (the cold start's first wave).
    `pointwise_running_peak=False`: the running requests alone must fit with their largest expected demand plus
    theta times their largest standard deviation, wherever each falls (stricter than the test admissions pass)."""
    # Only a prefix whose tokens already held fit now can be admitted: the rest need not be forecast.
    sharing = running_shared is not None and waiting_shared is not None
    own_waiting = np.asarray(waiting_tokens, dtype=float) - (waiting_shared if sharing else 0)
    held_now = float(running_tokens.sum() - (running_shared.sum() if sharing else 0)) + np.cumsum(
        own_waiting + block_size - 1)
    fit_now = int(np.searchsorted(held_now, capacity_tokens, side="right"))
    waiting_tokens, waiting_generated = waiting_tokens[:fit_now + 1], waiting_generated[:fit_now + 1]
    if sharing:
        waiting_group, waiting_shared = waiting_group[:fit_now + 1], waiting_shared[:fit_now + 1]
    generated = np.concatenate([running_generated, waiting_generated]).astype(float)
    scale = None
    if running_scale is not None or waiting_scale is not None:
        scale = np.concatenate([np.ones(len(running_generated)) if running_scale is None else running_scale,
                                np.ones(len(waiting_generated)) if waiting_scale is None else
                                waiting_scale[:fit_now + 1]]).astype(float)
    if informed is not None:
        if scale is None:
            scale = np.ones(len(generated))
        informed = _rows(informed, np.arange(len(generated)))  # the waiting rows cut above
    bins, reach = lengths.reach(_to_estimate(generated, scale, informed))
    # Far enough ahead for the longest-predicted request to end, at most ~MAX_POINTS future times checked.
    longest = 1.0 if scale is None else max(scale.max(initial=1.0), 1.0)
    if informed is not None:  # the estimate's end as a real length, for the rows mapped by their siblings
        end = len(reach) * lengths.bin_tokens
        longest = max(longest, float(_from_estimate(end, scale, informed).max(initial=0.0)) / end)
    span = int(np.ceil(len(reach) * longest)) + 2
    if max_output:
        span = min(span, -(-max_output // lengths.bin_tokens) + 2)
    if horizon_tokens:
        span = min(span, -(-horizon_tokens // lengths.bin_tokens) + 2)
    stride = -(-span // MAX_POINTS)
    horizon = -(-span // stride) + 1
    steps = stride * np.arange(horizon) * lengths.bin_tokens
    tokens = np.concatenate([running_tokens, waiting_tokens]).astype(float)
    alive = _alive(bins, reach, _ahead(generated, steps, lengths.bin_tokens, scale, informed))
    if max_output:
        # The estimate's tail (a lognormal fit, the cold start's prior) runs past max_tokens; vLLM stops there.
        alive[generated[:, None] + steps[None, :] >= max_output] = 0.0
    if sharing:
        shared = np.concatenate([running_shared, waiting_shared]).astype(float)
        group = np.concatenate([running_group, waiting_group])
    n = len(running_tokens)

    def demand(rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Expected KV demand of the first `rows` requests (running, then waiting) at each future time, and
        its variance, one row per request."""
        held = tokens[:rows, None] + steps[None, :] + (block_size - 1)
        groups = Groups(group[:rows]) if sharing else None
        if groups:
            held += shared_prompt_holding(alive[:rows], groups, shared[:rows]) - shared[:rows, None]
        mean = held * alive[:rows]
        var = held ** 2 * alive[:rows] * (1.0 - alive[:rows])
        if groups:
            # A group's samples run about as long as each other (one prompt's difficulty): their demands move
            # together, so a group's standard deviations add up (variance increments 2 * earlier sd * sd + sd^2),
            # less where its finished samples told what the group is (Informed.correlation).
            sd = np.sqrt(var)
            together = 1.0 if informed is None or informed.correlation is None else informed.correlation[:rows, None]
            var = var + 2.0 * together * groups.earlier_sum(sd) * sd
        return mean, var

    def result(admit: int, demand_mean: np.ndarray, demand_var: np.ndarray, peak: float = 0.0,
               over: tuple | None = None):
        if not with_margin:
            return admit
        closest = int(np.argmax(demand_mean + theta * np.sqrt(demand_var))) if len(demand_mean) else 0
        overshoot = None
        if over is not None and peak > capacity_tokens:
            row_mean, row_var, total_var, upper = over  # per row and in total, at each future time
            at = int(np.argmax(upper))
            if at == 0:  # now: the policy waits for free blocks, the rows' shares go unused
                overshoot = Overshoot(0.0, [], [], float(total_var[0]), [], [])
            else:
                share = row_mean[:, at]
                overshoot = Overshoot(float(steps[at]), share.tolist(), row_var[:, at].tolist(), float(total_var[at]),
                                      steps[:at + 1].tolist(), (share @ (1.0 - alive[:len(share), :at + 1])).tolist())
        return Admission(admit, float(theta * np.sqrt(demand_var[closest])) if len(demand_var) else 0.0,
                         max(peak - capacity_tokens, 0.0), overshoot)

    # Most steps admit a few requests or none: forecast a short prefix of the queue first, longer ones only
    # while all of it fits (a row's demand does not depend on later rows, so the answer is the same).
    window = FIRST_WINDOW
    while True:
        considered = min(window, len(waiting_tokens))
        mean, var = demand(n + considered)
        base_mean, base_var = mean[:n].sum(axis=0), var[:n].sum(axis=0)
        base_upper = base_mean + theta * np.sqrt(base_var)
        if pointwise_running_peak:
            base_peak = float(base_upper.max(initial=0.0))
        else:
            base_peak = base_mean.max(initial=0.0) + theta * np.sqrt(base_var.max(initial=0.0))
        if base_peak > capacity_tokens:
            return result(0, base_mean, base_var, base_peak, (mean[:n], var[:n], base_var, base_upper))
        total_mean = base_mean[None, :] + np.cumsum(mean[n:], axis=0)
        total_var = base_var[None, :] + np.cumsum(var[n:], axis=0)
        upper = total_mean + theta * np.sqrt(total_var)
        fits = (upper <= capacity_tokens).all(axis=1)
        admit = int(np.argmin(fits)) if not fits.all() else len(fits)  # demand grows with m: the first misfit ends it
        if admit < considered or considered == len(waiting_tokens):
            break
        window *= 4
    peak, over = 0.0, None
    if admit < considered:  # the first request left out
        peak = float(upper[admit].max(initial=0.0))
        over = (mean[:n + admit + 1], var[:n + admit + 1], total_var[admit], upper[admit])
    if admit == 0:
        return result(0, base_mean, base_var, peak, over)
    return result(admit, total_mean[admit - 1], total_var[admit - 1], peak, over)


@register
class ForecastPolicy(MemoryPolicy):
    """Admission by the forecast peak KV of running and admitted requests, from censored length estimates.

    Until `forecast_after` requests, and `forecast_after_share` of the running ones, have finished (earlier
    passes counted at their carried weight) it forecasts with a prior in their place (`cold_start="gamma"`) or
    behaves as Algorithm 1 (`"memory"`); with the prior, until the pass's first finish it looks only
    `cold_start_horizon` x max_tokens ahead (the first wave)."""

    name = "forecast"
    needs_requests = True

    def __init__(self, config, stats=None, graph_batch: int = 0) -> None:
        super().__init__(config, stats, graph_batch)
        cold_start_horizon, forecast_after_share = config.forecast_cold_start_horizon, config.forecast_after_share
        pointwise_running_peak, min_wave = config.forecast_pointwise_running_peak, config.forecast_min_wave
        forecast_after, carry_over = config.forecast_after, config.forecast_carry_over
        cold_start, cold_start_shape = config.forecast_cold_start, config.forecast_cold_start_shape
        margin_feedback, siblings = config.forecast_margin_feedback, config.forecast_siblings
        tail_confidence = config.forecast_tail_confidence
        # The first wave of a pass that knows nothing is sized for `cold_start_horizon` x max_tokens of output
        # each, not for the prior's whole future: on long-cot (H100) it ran ~400 requests where the prior alone
        # ran ~70 until 8 had finished, 1.025x vLLM's default against 0.99-1.00x (1.2% recomputed). The prior
        # then stays until `forecast_after_share` of the running requests have finished (at least
        # `forecast_after`): in the simulator, 8 of a wave of 246 (the shortest 3%) had the fit admit 245 more,
        # and 9.7% of the tokens were recomputed. 0.08 of max_tokens since stop 24 (1/16 before): the wave's
        # overshoot was long-cot's recomputation, and the pointwise test below fills the cache after it.
        self.cold_start_horizon = cold_start_horizon
        self.forecast_after_share = forecast_after_share
        # The running requests are held to the test admissions pass, at each future time. Before stop 24 they
        # had to fit with their largest expected demand plus their largest spread wherever each fell: a margin
        # that kept long-cot's cache ~7% emptier than the oracle's after its first wave.
        self.pointwise_running_peak = pointwise_running_peak
        # A forecast admits nothing until `min_wave` x the running requests fit (or the whole queue): each
        # admission puts prompt tokens into a step, which leaves vLLM's decode-only CUDA graph (3-5 ms on an
        # H100). Pointwise without it trickled in (kv-bound: 340 steps with admissions against 45) and lost.
        self.min_wave = min_wave
        self._wave_wait = 0  # finishes the next forecast waits for (a wave too small to admit)
        self._pass_finished = 0
        # Until this many have finished a prior stands in for the missing lengths (see `_estimate`); its mean is
        # the requests' max_tokens, which in RL is a cap far above the mean. After them the fitted tail, pushed
        # toward longer lengths by its own uncertainty (`tail_confidence` standard errors), carries the estimate.
        # In the simulator with a cap as max_tokens, 8 with 1.5 standard errors against 32 with none: long-cot
        # +0.8% (5 seeds; recomputed <= 0.3% where 32 reached 2.7%), kv-bound +0.3..1.5%, cap-bound +0.4..0.9%,
        # grpo-groups +0.1..2.0%, real -1.1..0%; 8 alone preempted 5.6% on one long-cot seed.
        self.min_observations = max(self.min_observations, forecast_after)
        self.lengths = CensoredLengths(tail_confidence=tail_confidence)
        # Saved statistics carry earlier runs' lengths: they seed the estimate as earlier passes do (the first
        # pass's start weighs them by carry_over).
        for k, weight in enumerate(self.stats.output_histogram):
            if weight > 0:
                self.lengths.observe((k + 0.5) * HISTOGRAM_BIN_TOKENS, weight)
        self.carry_over = carry_over  # weight of earlier passes' lengths when a new pass starts
        self.cold_start = cold_start
        self.cold_start_shape = cold_start_shape
        self._prior_key, self._prior = None, None  # the last cold-start estimate and what it was built from
        self.admitted_last = 0
        self.shared_prompt_tokens = 0
        self.margin_blocks: float | None = None  # kept free against uncertainty at the forecast's closest point
        # A forecast that admitted nothing is not repeated until something changed: finishes that free what
        # its first waiting request lacked, or, before STABLE_COUNT finishes, enough finishes to move the
        # estimate (ESTIMATE_MOVE). Most steps
        # of a KV-bound pass admit nothing, and the forecast with the description of every running request
        # was 3-4% of an H100 step.
        self.shortfall_tokens = 0.0
        self.freed_tokens = 0.0
        self.finished_since_forecast = 0
        self._running_at_forecast: int | None = None
        # Where the first request left out overshoots (Overshoot): if now, it fits once the cache frees what it
        # lacked; if later, a finish frees its share of the expected demand there (a request that was to hold 10
        # tokens then frees 10, whatever it holds now), found by its row in the pass. Counting what finished
        # requests held instead, 80-90% of the forecasts that followed admitted nothing.
        self._overshoot: Overshoot | None = None
        self._overshoot_rows: np.ndarray | None = None  # row in the pass -> index into the overshoot's shares
        self._overshoot_theta = 0.0
        self._free_at_forecast: int | None = None  # free KV blocks at the last forecast
        self.freed_mean, self.freed_var = 0.0, 0.0
        self._forecast_step = 0  # StepState.step of the last forecast
        # Preemptions since the last forecast: they free memory the finishes do not count (and widen the margin).
        self.preempted_since_forecast = 0
        self._estimate_wait = 1
        self._estimate_forecast = False
        # Preemption feedback: theta is scaled down while forecasts admit nothing and nothing was preempted
        # for a while (the margin sits unused), and up after a preemption.
        self.margin_feedback = margin_feedback
        self.margin_scale = 1.0
        self.quiet_forecasts = 0  # forecasts since the last preemption
        # Sibling updates: a group's finished samples move the estimate of its others within the pass.
        self.siblings = SiblingLengths() if siblings else None
        self.informed_rows = 0  # requests whose estimate their siblings moved, at the last forecast
        self._finished_groups: set[int] = set()  # prompts (groups) with a finished sample in this pass
        self._finished_grouped = 0  # finished samples that belong to a group, in this pass

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1) -> None:
        super().observe_finished(prompt_tokens, output_tokens, length_scale, group, row)
        if self.siblings is not None:
            self.siblings.observe(group, output_tokens, length_scale)
        self.lengths.observe(output_tokens / max(length_scale, 1e-6))
        if group >= 0:
            self._finished_groups.add(group)
            self._finished_grouped += 1
            self.lengths.design_effect = self._finished_grouped / len(self._finished_groups)
        self.freed_tokens += prompt_tokens + output_tokens  # at most: a group's shared prompt stays while others run
        self.finished_since_forecast += 1
        self._pass_finished += 1
        if self._overshoot_rows is not None and 0 <= row < len(self._overshoot_rows):
            at = int(self._overshoot_rows[row])
            if at >= 0:
                self.freed_mean += self._overshoot.mean[at]
                self.freed_var += self._overshoot.var[at]

    def observe_preempted(self, computed_tokens: int) -> None:
        self.preempted_since_forecast += 1

    def _freed_at_overshoot(self) -> float:
        """How far the finishes since the last forecast lowered its overshoot: their shares of the mean, and of
        theta standard deviations (rows taken as independent)."""
        total = self._overshoot.total_var
        return self.freed_mean + self._overshoot_theta * (
            math.sqrt(total) - math.sqrt(max(total - self.freed_var, 0.0)))

    def _adjust_margin(self) -> None:
        """Before a forecast: wider after a preemption, narrower after many quiet forecasts of which the last
        admitted nothing (requests waited while the margin stayed free)."""
        if self.preempted_since_forecast:
            self.margin_scale = min(self.margin_scale * MARGIN_WIDEN, MARGIN_SCALE_MAX)
            self.quiet_forecasts = 0
        else:
            self.quiet_forecasts += 1
            if self.admitted_last == 0 and self.quiet_forecasts > MARGIN_QUIET_FORECASTS:
                self.margin_scale = max(self.margin_scale * MARGIN_NARROW, MARGIN_SCALE_MIN)

    def start_pass(self, prior: np.ndarray | None = None) -> None:
        """A new pass. `prior`: the driver's expectation of its lengths, in the units the requests' scales
        define (the previous pass's lengths of the same prompts divided by their new scales); it replaces what
        was observed before, at weight `carry_over` each. Without one, earlier lengths are kept at that weight."""
        super().start_pass(prior)
        self._running_at_forecast = None
        self._pass_finished = 0
        self._finished_groups.clear()
        self._finished_grouped = 0
        self.lengths.design_effect = 1.0
        if prior is None:
            self.lengths.forget(self.carry_over)
        else:
            self.lengths.forget(0.0)
            for length in np.asarray(prior, dtype=float):
                self.lengths.observe(length, self.carry_over)
        if self.siblings is not None:
            self.siblings.start_pass(fresh=self.lengths.count == 0)

    def _observed(self) -> float:
        """Finished lengths the estimate rests on: a pass's samples of one prompt count once (they run about as
        long as each other; a GRPO group's 8 short samples, finishing first, once passed for 8 observations and
        the estimate admitted 197 requests at a mean of 71 tokens); earlier passes at their carried weight."""
        return self.lengths.count - self._finished_grouped + len(self._finished_groups)

    def _forecasting(self, state: StepState) -> bool:
        if not state.num_waiting:
            return False
        if self.cold_start == "gamma":
            return self._observed() >= self.min_observations or state.pending_max_tokens_mean > 0
        # "memory": Algorithm 1 until the estimate rests on finished lengths alone (no prior to blend in)
        return self._missing(state) <= 0

    def _estimate(self, state: StepState) -> CensoredLengths:
        """The length estimate to forecast with. Until `forecast_after` have finished (cold start): what has
        finished plus, weighing the missing observations, a gamma prior whose mean is the unfinished requests'
        mean max_tokens. Shape 1 is exponential (the spread of a mean alone); larger shapes concentrate the
        lengths around the mean, towards Algorithm 1's cold start (every request as long as the mean, which
        holds the whole demand at once and admitted half of what fitted on long-cot). Shape 3: in the
        simulator with the H100 step model, 0-0.9% recomputed where shape 1 preempted 6% (real lengths: a
        third at the cap, which a gamma underweights), and 1.0-1.05x the Algorithm 1 cold start elsewhere."""
        from scipy import stats

        missing = self._missing(state)
        if missing <= 0:
            return self.lengths
        mean = max(state.pending_max_tokens_mean, 1.0)
        key = (round(mean / self.lengths.bin_tokens), self.lengths.count, missing)
        if self._prior_key == key:  # unchanged since the last step: no new finish, same pending mean
            return self._prior
        blended = CensoredLengths(self.lengths.bin_tokens, tail="none")
        edges = np.arange(int(np.ceil(5 * mean / self.lengths.bin_tokens)) + 1) * self.lengths.bin_tokens
        survival = stats.gamma.sf(edges, self.cold_start_shape, scale=mean / self.cold_start_shape)
        mass = -np.diff(survival)
        mass[-1] += survival[-1]
        finished = self.lengths.finished
        size = max(len(mass), len(finished))
        blended.finished = np.pad(mass * missing, (0, size - len(mass))) + np.pad(finished, (0, size - len(finished)))
        blended.count = self.lengths.count + missing
        blended.longest_bin = max(self.lengths.longest_bin, len(mass) - 1)
        self._prior_key, self._prior = key, blended
        return blended

    def _missing(self, state: StepState) -> float:
        """Finished lengths still wanted before the estimate rests on them alone (the prior stands in)."""
        wanted = max(self.min_observations, math.ceil(self.forecast_after_share * state.num_running))
        return wanted - self._observed()

    def _horizon(self, state: StepState) -> int:
        """Output tokens the forecast looks ahead: all the way (0) once a request of this pass has finished;
        before, while the prior stands in, a share of max_tokens. Not only the first step's forecast: requests
        reach vLLM's engine over its first steps."""
        if not self.cold_start_horizon or self._pass_finished or self._missing(state) <= 0:
            return 0
        return max(int(self.cold_start_horizon * max(state.pending_max_tokens_mean, 1.0)), 1)

    def wants_requests(self, state: StepState) -> bool:
        if not self._forecasting(state):
            return False
        if self._running_at_forecast is not None and (
                self.max_cap - state.num_running < state.num_running * HEADROOM_SHARE):
            return False
        if self._running_at_forecast is None or self.preempted_since_forecast:
            # Running requests that left other than by finishing free memory the finishes do not count.
            return True
        if self.finished_since_forecast < self._wave_wait:
            return False
        if self.admitted_last and self._overshoot is None:
            # All it was shown fit: more may (the admitted wait in the cap until scheduled, see batch_cap).
            return self._approved(state) == 0
        overshoot = self._overshoot
        if overshoot is not None and not overshoot.tokens_ahead and self._free_at_forecast is not None:
            # The first request left out does not fit now: it can once the cache has freed what it lacked
            # (finishes, less what running requests wrote since). The estimate plays no part in that.
            return (state.kv_free_blocks or 0) - self._free_at_forecast > self.shortfall_tokens / state.block_size
        if overshoot is not None and self._overshoot_rows is not None:
            # It overshoots later: finishes count beyond those the forecast expected by then; once that time
            # has come, the forecast is out of date.
            ahead = state.step - self._forecast_step
            if ahead >= overshoot.tokens_ahead:
                return True
            expected = _interpolate(ahead, overshoot.expected_ahead, overshoot.expected_gone)
            if self._freed_at_overshoot() - expected > self.shortfall_tokens:
                return True
        elif self.freed_tokens > self.shortfall_tokens:
            return True
        if self.lengths.count < STABLE_COUNT:
            # Finishes still move the estimate itself, by more than the memory they free (long-cot in the
            # simulator lost 3% waiting for the freed tokens alone): enough of them call for a new forecast.
            if self.finished_since_forecast >= max(1.0, self.lengths.count * ESTIMATE_MOVE) * self._estimate_wait:
                self._estimate_forecast = True
                return True
        return False

    def _approved(self, state: StepState) -> int:
        """Requests the last forecast admitted that the engine has not scheduled yet (its token budget)."""
        if self._running_at_forecast is None:
            return 0
        return max(self._running_at_forecast + self.admitted_last - state.num_running - self.finished_since_forecast, 0)

    def steady_until(self) -> float:
        # Between arrivals, admissions, finishes and preemptions nothing wants_requests and batch_cap read
        # changes but the step (where a request left out overshoots later) and the free blocks, which only a
        # finish or a preemption raises. On an H200 (grpo-groups) ~80% of the steps are such, at 35-40 us each.
        if self.graph is not None:  # its limit moves with each step's latency
            return 0
        if self._overshoot is not None and self._overshoot.tokens_ahead and self._overshoot_rows is not None:
            return self._forecast_step + self._overshoot.tokens_ahead
        return math.inf

    def waiting_limit(self) -> int | None:
        # Describing the whole queue costs a pass over it each step. Once forecasting, admissions come in waves
        # of up to ~150 (grpo-groups in the simulator; a limit of 64 there cost 0.9%), and a limit that all
        # fitted doubles at the next step. The first forecast may admit hundreds.
        if self.margin_blocks is None:
            return None
        return max(WAITING_LIMIT, 2 * self.admitted_last)

    def batch_cap(self, state: StepState) -> int:
        if not self._forecasting(state):
            self.margin_blocks = None
            return super().batch_cap(state)
        if state.running_generated is None:  # skipped: see wants_requests
            self.cap = clamp_cap(state.num_running + self._approved(state), state.num_running, self.min_cap,
                                 self.max_cap)
            return self.cap
        if self.margin_feedback:
            self._adjust_margin()
        informed = None
        if self.siblings is not None and state.running_group is not None:
            informed = self.siblings.informed(
                np.concatenate([state.running_group, state.waiting_group]),
                np.concatenate([state.running_generated, state.waiting_generated]),
                np.concatenate([np.ones(state.num_running) if state.running_scale is None else state.running_scale,
                                np.ones(len(state.waiting_group)) if state.waiting_scale is None
                                else state.waiting_scale]).astype(float), len(state.running_group))
            self.informed_rows = 0 if informed is None else int(np.count_nonzero(informed.spread < 1))
        theta = self.theta * self.margin_scale
        admit, margin_tokens, self.shortfall_tokens, self._overshoot = expected_demand_admissions(
            state.running_tokens, state.running_generated, state.waiting_tokens, state.waiting_generated,
            self._estimate(state), state.kv_capacity_blocks * state.block_size, state.block_size, theta,
            state.running_scale, state.waiting_scale, state.running_group, state.waiting_group,
            state.running_shared, state.waiting_shared, informed=informed, with_margin=True,
            max_output=state.max_tokens_bound, horizon_tokens=self._horizon(state),
            pointwise_running_peak=self.pointwise_running_peak)
        self._wave_wait = 0
        if state.num_running and 0 < admit < len(state.waiting_tokens) and admit < self.min_wave * state.num_running:
            # A wave later: about one request fits per finish, so the next forecast waits for finishes (checking
            # at each request that fits doubled kv-bound's forecasts, to 2% of an H100's step; WAVE_WAIT).
            self._wave_wait = WAVE_WAIT * (math.ceil(self.min_wave * state.num_running) - admit)
            admit = 0
        self.margin_blocks = margin_tokens / state.block_size
        if admit:
            self._estimate_wait = 1
        elif self._estimate_forecast:
            self._estimate_wait = min(self._estimate_wait * 2, ESTIMATE_WAIT_MAX)
        self._estimate_forecast = False
        self.preempted_since_forecast = 0
        self.admitted_last = admit
        self._running_at_forecast = state.num_running
        self._free_at_forecast = state.kv_free_blocks
        if admit and state.kv_free_blocks is not None:
            # The admitted take their blocks as they are scheduled: the cache frees what the next request
            # lacked on top of those.
            own = state.waiting_tokens[:admit] - (0 if state.waiting_shared is None else state.waiting_shared[:admit])
            self._free_at_forecast -= int(np.sum(-(-own // state.block_size)))
        self.freed_tokens, self.finished_since_forecast = 0.0, 0
        self.freed_mean, self.freed_var, self._overshoot_theta = 0.0, 0.0, theta
        self._forecast_step = state.step
        self._overshoot_rows = None  # without rows, finishes count what they held (freed_tokens)
        if self._overshoot is not None and self._overshoot.tokens_ahead and state.running_rows is not None:
            rows = np.concatenate([state.running_rows, state.waiting_rows])[:len(self._overshoot.mean)]
            self._overshoot_rows = np.full(int(rows.max(initial=-1)) + 1, -1, dtype=np.int64)
            self._overshoot_rows[rows] = np.arange(len(rows))
        if state.running_shared is not None:  # prompt tokens running samples would hold again without sharing
            _, holder = np.unique(state.running_group, return_index=True)
            self.shared_prompt_tokens = int(state.running_shared.sum() - state.running_shared[holder].sum())
        self.cap = clamp_cap(state.num_running + max(admit, 0 if state.num_running else 1), state.num_running,
                             self.min_cap, self.max_cap)
        return self.cap

    def trace_fields(self) -> dict:
        fields = super().trace_fields()
        fields["forecast_admitted"] = self.admitted_last
        # Where the first request left out overshoots, in tokens ahead of its forecast (0: now; None: all fit).
        fields["overshoot_tokens_ahead"] = None if self._overshoot is None else self._overshoot.tokens_ahead
        if self.margin_feedback:
            fields["margin_scale"] = self.margin_scale
        if self.siblings is not None:
            fields["sibling_informed"] = self.informed_rows
        if self.margin_blocks is not None:  # while forecasting, the trace's safety buffer is the forecast's margin
            fields["safety_buffer_blocks"] = self.margin_blocks
        fields["shared_prompt_tokens"] = self.shared_prompt_tokens  # running prompt tokens counted once, not per sample
        return fields
