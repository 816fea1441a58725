"""Length-aware admission from predicted lengths: the oracle's rule with estimates instead of truth.

Output lengths are estimated with censoring: early in a pass the finished requests are the short ones, so the
finished lengths alone understate E[l_out]. Each running request that has generated g tokens says "l_out > g";
the Kaplan-Meier estimator over fixed-width bins combines both (`CensoredLengths`). From it, a running request's
remaining length is E[l_out - g | l_out > g] (conditional on what it already generated), and a fresh request's
is E[l_out].

Admission then follows the oracle (`oracle.py`) with expectations: waiting requests, in queue order, are
admitted while, at every future time, the expected KV demand of everything running plus them (each request's
tokens weighted by the probability it is still running then) plus theta standard deviations fits the cache
(`expected_demand_admissions`). Samples of one prompt (a GRPO group) share its prompt blocks, counted once, and
its length: what a group's finished samples say moves the estimate for the rest of the group (`SiblingLengths`).

`ForecastPolicy` runs a forecast only when something it depends on changed: its last answer is one `Forecast`,
replaced whole by the next, and what happened since is one `Since`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rollout.policy.length_stats import HISTOGRAM_BIN_TOKENS, add_to_bin
from rollout.policy.memory import clamp_cap
from rollout.policy.base import StepState, register, resumes_first
from rollout.policy.policies import MemoryPolicy


MAX_POINTS = 48  # future times a forecast checks, at most
FIRST_WINDOW = 16  # waiting requests forecast first (most steps admit fewer)
WAITING_LIMIT = 256  # waiting requests described to the policy each step once it forecasts (at least)
MARGIN_WIDEN, MARGIN_NARROW = 2.0, 0.99  # margin feedback: theta's scale after a preemption / per quiet forecast
MARGIN_SCALE_MIN, MARGIN_SCALE_MAX = 0.5, 2.0
MARGIN_QUIET_FORECASTS = 32  # forecasts without a preemption before the margin narrows
STABLE_COUNT = 512  # finished lengths after which one more finish barely moves the estimate
# Before STABLE_COUNT, a forecast that admitted nothing is repeated once the finishes since it add this share of
# the lengths seen (any finish below 128): they move the estimate by more than the memory they free. A larger
# share loses throughput where the estimate never settles (small passes); see docs/results.md.
ESTIMATE_MOVE = 1 / 128
# While the cap (B_max) binds, a forecast waits until this share of the running requests could be admitted: each
# forecast reads every running request, and each admission of a few requests costs a step with prefill.
HEADROOM_SHARE = 1 / 64
# A wave too small to admit waits for this many times as many finishes as it lacked requests before the next
# forecast: about one request fits per finish, and re-checks after once as many mostly admit nothing again.
WAVE_WAIT = 2
# A forecast the estimate's move called for that admitted nothing doubles the finishes the next one waits for, up
# to this factor (any admission resets it): almost all such forecasts admit nothing, and throughput does not
# change with it (docs/results.md).
ESTIMATE_WAIT_MAX = 4
# Least correlation taken between the lengths of a group's samples once some of them finished, in a pass that
# starts from nothing (see SiblingLengths.informed): lower preempts more, higher holds the cache emptier
# (docs/results.md).
SIBLING_CORRELATION_MIN = 0.5


def censored_normal_fit(values: np.ndarray, weights: np.ndarray, censored: np.ndarray,
                        censored_weights: np.ndarray, standard_errors: bool = False):
    """Maximum-likelihood mean and sd of a normal from weighted observations and weighted right-censored ones
    (known only to exceed their value). What scipy.stats.norm.fit does with CensoredData, over distinct values
    with weights. Newton's method in (mean / sd, 1 / sd), where the log-likelihood is concave (Olsen, 1978):
    4-7 steps, several times faster than Nelder-Mead's simplex, which remains for where Newton finds no maximum.
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
    else:  # not converged (a flat likelihood): the simplex
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
    """Kaplan-Meier estimate of the output-length distribution over bins of `bin_tokens` tokens.

    Besides the (weighted) finished lengths it keeps what the current pass added: how many finished, and how
    many of them per group, which sets how much the lengths say (`observed`, `design_effect`)."""

    def __init__(self, bin_tokens: int = 16, tail: str = "lognormal", tail_confidence: float = 1.5) -> None:
        self.bin_tokens = bin_tokens
        self.tail = tail
        self.tail_confidence = tail_confidence
        # Finished requests per length bin (weights: earlier passes count less): a list (`add_to_bin`), read
        # whole as an array (`finished`). `count` is their total weight, `longest_bin` the last bin observed.
        self._finished = [0.0] * 64
        self.count = 0.0
        self.longest_bin = 0
        self._tail_fit: tuple[int, float, float] | None = None  # (count when fitted, log-mean, log-sd)
        self._tail_ratio = None  # survival past the longest finished request, relative to it, for a fit
        # This pass: requests finished, the groups (prompts) among them, and the finished samples of a group.
        self.pass_count = 0
        self._pass_groups: set[int] = set()
        self._pass_grouped = 0

    @property
    def finished(self) -> np.ndarray:
        return np.array(self._finished)

    @property
    def design_effect(self) -> float:
        """Finished samples per distinct prompt among this pass's grouped finishes (1 without groups): samples
        of one prompt run about as long as each other, so the fit knows less than its count of lengths says (the
        variance of its parameters grows by up to this factor)."""
        return self._pass_grouped / len(self._pass_groups) if self._pass_groups else 1.0

    @property
    def observed(self) -> float:
        """Finished lengths the estimate rests on: this pass's samples of one prompt count once (a group's short
        samples, finishing first, would otherwise pass for as many observations of the pass), earlier passes at
        their carried weight."""
        return self.count - self._pass_grouped + len(self._pass_groups)

    def observe(self, output_tokens: float, weight: float = 1.0) -> None:
        k = int(output_tokens // self.bin_tokens)
        add_to_bin(self._finished, k, weight)
        self.count += weight
        if k > self.longest_bin:
            self.longest_bin = k

    def observe_finished(self, output_tokens: float, group: int = -1) -> None:
        """A request of this pass finished with `output_tokens` (in the estimate's units); `group`: its prompt's
        group, -1 if none."""
        self.observe(output_tokens)
        self.pass_count += 1
        if group >= 0:
            self._pass_groups.add(group)
            self._pass_grouped += 1

    def forget(self, keep: float) -> None:
        """Weigh everything observed so far by `keep`."""
        self._finished = [w * keep for w in self._finished]
        self.count *= keep
        self._tail_fit = self._tail_ratio = None
        if keep == 0:
            self.longest_bin = 0

    def start_pass(self, keep: float, prior: np.ndarray | None = None) -> None:
        """A new pass (lengths drift between RL iterations): what was observed before counts at weight `keep`,
        or, given a `prior` (expected lengths of the pass), is replaced by it at that weight each."""
        if prior is None:
            self.forget(keep)
        else:
            self.forget(0.0)
            for length in np.asarray(prior, dtype=float):
                self.observe(length, keep)
        self.pass_count = 0
        self._pass_groups.clear()
        self._pass_grouped = 0

    def blended(self, mass: np.ndarray, weight: float) -> CensoredLengths:
        """This estimate with `weight` more observations distributed as `mass` (per bin, summing to 1), and no
        fitted tail."""
        blend = CensoredLengths(self.bin_tokens, tail="none")
        finished = self.finished
        size = max(len(mass), len(finished))
        blend._finished = (np.pad(mass * weight, (0, size - len(mass)))
                           + np.pad(finished, (0, size - len(finished)))).tolist()
        blend.count = self.count + weight
        blend.longest_bin = max(self.longest_bin, len(mass) - 1)
        return blend

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
            # Toward longer lengths by `tail_confidence` standard errors (more where a pass's grouped samples say
            # less than their count, `design_effect`): the first finishes are few and short, and a fit to them
            # that comes out low admits a wave that is preempted later on. Bounded (lengths e times longer, a
            # spread twice as wide) where a flat likelihood (a handful of finishes) has no useful curvature.
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
    groups (complete by then), or in a first pass half the total, narrowed where the groups with finished
    samples show less (`_first_pass_within`)."""

    # Finished samples (any group) before offsets are estimated: a pass's first fit (short finishers, many
    # censored) over-narrows with fewer.
    MIN_FINISHED = 64
    MIN_GROUPS = 8  # groups with two finished samples before their pooled spread is read
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
        pooled = self._pooled_within()  # at a pass's end every group is complete: an unbiased spread
        if pooled is not None:
            self.within_var = pooled
        self._reset()

    def _pooled_within(self) -> float | None:
        """The within-group variance pooled over the groups with two or more finished samples, None while fewer
        than MIN_GROUPS have them. Floored: samples of a prompt with one length (greedy decoding, imposed lengths)
        have none, and a zero spread would divide by zero in `informed`."""
        multi = self.count >= 2
        if np.count_nonzero(multi) < self.MIN_GROUPS:
            return None
        deviation = self.sum_squares[multi] - self.total[multi] ** 2 / self.count[multi]
        return max(float(deviation.sum() / (self.count[multi] - 1).sum()), WITHIN_VAR_MIN)

    def _first_pass_within(self, sd: float) -> float:
        """A pass without an earlier one's groups: half the pass's spread `sd` (in variance), or less where the
        groups whose samples have finished show less. Half the spread alone overstates a group's own where prompts
        differ by classes (tail-bound: a minority ten times longer, its groups first in a longest-first pass; mid-
        pass the finished samples, the short probes and the long groups, spread 1.1-1.4 in log length, and half
        that variance is a spread of 0.8-1.0, against 0.3 within a group): a short group's waiting samples, known
        by their probe, are forecast far longer than they run, and the cache runs part empty as they start
        (docs/results.md, "tail-bound"). The pooled spread of the groups that finished two or more samples reads
        low early (a group's short samples end first, and one short finisher among long-running siblings would
        pull its group down), so it is taken twice over, and only ever narrows the half."""
        pooled = self._pooled_within()
        return sd ** 2 / 2 if pooled is None else min(sd ** 2 / 2, 2 * pooled)

    def observe(self, group: int, output_tokens: float, scale: float) -> None:
        if group < 0:
            return
        if group >= len(self.count):
            grow = max(group + 1, 2 * len(self.count)) - len(self.count)
            self.count, self.total, self.sum_squares = (np.pad(a, (0, grow)) for a in
                                                        (self.count, self.total, self.sum_squares))
        x = math.log(max(output_tokens, 1.0) / scale)  # math's log: numpy's call on one float costs far more
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
        # far. First-pass probes put such requests first (their groups are the long ones), and read as the
        # pass's average they are admitted into a cache they overrun.
        # Only moved up, not narrowed: a censored look at a group is no measure of its spread.
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
        within = max(min(self.within_var if self.within_var is not None else self._first_pass_within(sd), sd ** 2),
                     WITHIN_VAR_MIN)
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
        # the offset's posterior variance against the samples' own (taken as 1, all moving together, the cache
        # stays emptier than the oracle's). Only in a fresh pass: in later ones (lengths carried, per-prompt
        # predictions) the pass's requests share an error (a mean that moved, as RL's lengths drift) which the
        # full correlation covers and this model leaves out, and admissions are preempted (docs/results.md).
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
    # At most 1: interpolated at zero bins ahead, `later` can round a hair above `now`, and a survival over 1
    # makes a demand's variance negative, its sd NaN and every admission fail (one request at a time).
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
    backfill: tuple = ()  # queue positions of the requests admitted past the first left out (`Policy.backfill`)


def expected_demand_admissions(state: StepState, lengths: CensoredLengths, theta: float, *,
                               informed: Informed | None = None, horizon_tokens: int = 0,
                               pointwise_running_peak: bool = True, backfill: bool = False,
                               margin_cap: float = 1.0) -> Admission:
    """How many waiting requests of the step `state` describes (a prefix, in queue order) fit: at every future
    time (in bins of output tokens), the expected KV demand of running and admitted requests plus theta standard
    deviations stays within the cache. A request holding c tokens demands c + t (plus a partly used block) at t
    steps ahead if it is still running then, with the probability `survival_after` gives (each request's length
    `lengths` times its `*_scale`). With groups and shared prompt tokens (prefix caching), a group's shared
    prompt blocks count once, while any member runs; no request runs past `max_tokens_bound` (0: no bound).

    The `Admission` also holds the tokens kept free against uncertainty (theta standard deviations) where the
    admitted demand comes closest to the cache (the forecast's counterpart of Algorithm 1's safety buffer), by
    how many tokens the first request not admitted overshoots the cache and where (`Overshoot`), for the policy
    to know when to look again. Reads the state's token, generated, scale, group and shared arrays, never the
    true remaining lengths.
    `informed`: rows (running, then waiting) whose estimate their group's finished samples moved (see
    SiblingLengths). `horizon_tokens` (0: none): look only this many output tokens ahead (the cold start's first
    wave). `pointwise_running_peak=False`: the running requests alone must fit with their largest expected
    demand plus theta times their largest standard deviation, wherever each falls (stricter than the test
    admissions pass). `backfill`: where a request of the head is left out, the head's later requests and then
    the described tail (`StepState.tail_*`, `informed` rows after the waiting ones) are tried in that order, each
    admitted if it fits by the same test beside those before it and the left-out request's demand from the
    earliest time it fits (first fit; `Admission.backfill`); none past a preempted request (`resumes_first`).
    `margin_cap`: the theta standard deviations kept free are at most this share of the cache (1: the whole
    cache, no bound)."""
    running_tokens, running_generated = state.running_tokens, state.running_generated
    waiting_tokens, waiting_generated = state.waiting_tokens, state.waiting_generated
    running_scale, waiting_scale = state.running_scale, state.waiting_scale
    running_group, waiting_group = state.running_group, state.waiting_group
    running_shared, waiting_shared = state.running_shared, state.waiting_shared
    capacity_tokens, block_size = state.kv_capacity_blocks * state.block_size, state.block_size
    max_output = state.max_tokens_bound
    most_kept_free = margin_cap * capacity_tokens if margin_cap < 1 else np.inf

    def margin(var):
        """The tokens kept free against a demand of variance `var`."""
        return np.minimum(theta * np.sqrt(var), most_kept_free)

    # Only a prefix whose tokens already held fit now can be admitted: the rest need not be forecast.
    sharing = running_shared is not None and waiting_shared is not None
    own_waiting = np.asarray(waiting_tokens, dtype=float) - (waiting_shared if sharing else 0)
    held_now = float(running_tokens.sum() - (running_shared.sum() if sharing else 0)) + np.cumsum(
        own_waiting + block_size - 1)
    fit_now = int(np.searchsorted(held_now, capacity_tokens, side="right"))
    described = len(waiting_tokens)
    waiting_tokens, waiting_generated = waiting_tokens[:fit_now + 1], waiting_generated[:fit_now + 1]
    if sharing:
        waiting_group, waiting_shared = waiting_group[:fit_now + 1], waiting_shared[:fit_now + 1]
    if waiting_scale is not None:
        waiting_scale = waiting_scale[:fit_now + 1]
    head = len(waiting_tokens)
    # The tail's rows follow the head's in every array below; the head's admission reads only the head's.
    tail = len(state.tail_tokens) if backfill and state.tail_tokens is not None else 0
    if tail:
        waiting_tokens = np.concatenate([waiting_tokens, state.tail_tokens])
        waiting_generated = np.concatenate([waiting_generated, state.tail_generated])
        if sharing:
            waiting_group = np.concatenate([waiting_group, state.tail_group])
            waiting_shared = np.concatenate([waiting_shared, state.tail_shared])
        if waiting_scale is not None or state.tail_scale is not None:
            waiting_scale = np.concatenate([np.ones(head) if waiting_scale is None else waiting_scale,
                                            np.ones(tail) if state.tail_scale is None else state.tail_scale])
    generated = np.concatenate([running_generated, waiting_generated]).astype(float)
    scale = None
    if running_scale is not None or waiting_scale is not None:
        scale = np.concatenate([np.ones(len(running_generated)) if running_scale is None else running_scale,
                                np.ones(len(waiting_generated)) if waiting_scale is None else
                                waiting_scale]).astype(float)
    if informed is not None:
        if scale is None:
            scale = np.ones(len(generated))
        n_running = len(running_generated)  # the waiting rows cut above, then the tail's
        informed = _rows(informed, np.concatenate([np.arange(n_running + head),
                                                   n_running + described + np.arange(tail)]))
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
        closest = int(np.argmax(demand_mean + margin(demand_var))) if len(demand_mean) else 0
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
        return Admission(admit, float(margin(demand_var[closest])) if len(demand_var) else 0.0,
                         max(peak - capacity_tokens, 0.0), overshoot)

    # Most steps admit a few requests or none: forecast a short prefix of the queue first, longer ones only
    # while all of it fits (a row's demand does not depend on later rows, so the answer is the same).
    window = FIRST_WINDOW
    while True:
        considered = min(window, head)
        mean, var = demand(n + considered)
        base_mean, base_var = mean[:n].sum(axis=0), var[:n].sum(axis=0)
        base_upper = base_mean + margin(base_var)
        if pointwise_running_peak:
            base_peak = float(base_upper.max(initial=0.0))
        else:
            base_peak = base_mean.max(initial=0.0) + margin(base_var.max(initial=0.0))
        if base_peak > capacity_tokens:
            return result(0, base_mean, base_var, base_peak, (mean[:n], var[:n], base_var, base_upper))
        total_mean = base_mean[None, :] + np.cumsum(mean[n:], axis=0)
        total_var = base_var[None, :] + np.cumsum(var[n:], axis=0)
        upper = total_mean + margin(total_var)
        fits = (upper <= capacity_tokens).all(axis=1)
        admit = int(np.argmin(fits)) if not fits.all() else len(fits)  # demand grows with m: the first misfit ends it
        if admit < considered or considered == head:
            break
        window *= 4
    peak, over = 0.0, None
    if admit < considered:  # the first request left out
        peak = float(upper[admit].max(initial=0.0))
        over = (mean[:n + admit + 1], var[:n + admit + 1], total_var[admit], upper[admit])
    admitted_mean, admitted_var = (base_mean, base_var) if admit == 0 else (total_mean[admit - 1],
                                                                            total_var[admit - 1])
    answer = result(admit, admitted_mean, admitted_var, peak, over)
    if backfill and admit < head and not resumes_first(state, admit):
        mean, var = demand(n + head + tail)
        # The first request left out keeps its place (EASY backfilling): its demand from the earliest future
        # time it fits at, which a backfilled request must leave room for. Without one the short requests
        # behind it, each fitting now, would keep a long head request out for good.
        blocked_mean, blocked_var = mean[n + admit], var[n + admit]
        reserved_mean = reserved_var = None
        for start in range(1, len(steps)):
            shifted_mean, shifted_var = np.zeros(len(steps)), np.zeros(len(steps))
            shifted_mean[start:], shifted_var[start:] = blocked_mean[:-start], blocked_var[:-start]
            if (admitted_mean + shifted_mean + margin(admitted_var + shifted_var) <= capacity_tokens).all():
                reserved_mean, reserved_var = shifted_mean, shifted_var
                break
        picks = []
        if reserved_mean is not None:  # it fits nowhere ahead: nothing may take memory it may need
            # The head's later rows, then the tail's (the last first), as queue positions.
            candidates = [(n + k, k) for k in range(admit + 1, head)] + [(n + head + j, -1 - j) for j in range(tail)]
            for row, position in candidates:
                with_mean, with_var = admitted_mean + mean[row], admitted_var + var[row]
                if (with_mean + reserved_mean + margin(with_var + reserved_var) <= capacity_tokens).all():
                    picks.append(position)
                    admitted_mean, admitted_var = with_mean, with_var
        answer = answer._replace(backfill=tuple(picks))
    return answer


class GammaPrior:
    """The cold start's stand-in for lengths not yet finished: a gamma distribution of shape `shape` whose mean
    is the unfinished requests' mean max_tokens. Shape 1 is exponential (the spread of a mean alone); larger
    shapes concentrate the lengths around the mean, towards Algorithm 1's cold start (every request as long as
    the mean, which holds the whole demand at once). The default, 3, recomputes little where a third of the
    lengths sit at max_tokens, which a gamma underweights (docs/results.md)."""

    def __init__(self, shape: float) -> None:
        if not shape > 0:
            raise ValueError(f"cold_start_shape must be > 0, not {shape!r}")
        self.shape = shape
        self._last: tuple[tuple, CensoredLengths] | None = None  # (what it was built from, the blend)

    def blend(self, lengths: CensoredLengths, mean: float, missing: float) -> CensoredLengths:
        """`lengths` with `missing` observations of the prior of this `mean` added; the same object while
        neither a finish nor the mean (to a bin) moved."""
        from scipy import stats

        key = (round(mean / lengths.bin_tokens), lengths.count, missing)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        edges = np.arange(int(np.ceil(5 * mean / lengths.bin_tokens)) + 1) * lengths.bin_tokens
        survival = stats.gamma.sf(edges, self.shape, scale=mean / self.shape)
        mass = -np.diff(survival)
        mass[-1] += survival[-1]
        blend = lengths.blended(mass, missing)
        self._last = (key, blend)
        return blend


class MarginFeedback:
    """Preemption feedback on the forecast's margin: theta's scale, wider after a preemption, narrower after
    many quiet forecasts of which the last admitted nothing (requests waited while the margin stayed free)."""

    def __init__(self) -> None:
        self.scale = 1.0  # in [MARGIN_SCALE_MIN, MARGIN_SCALE_MAX]
        self.quiet = 0  # forecasts since the last preemption

    def update(self, preempted: bool, admitted_last: int) -> float:
        """Before a forecast: whether anything was preempted since the last one, and what that one admitted."""
        if preempted:
            self.scale = min(self.scale * MARGIN_WIDEN, MARGIN_SCALE_MAX)
            self.quiet = 0
        else:
            self.quiet += 1
            if admitted_last == 0 and self.quiet > MARGIN_QUIET_FORECASTS:
                self.scale = max(self.scale * MARGIN_NARROW, MARGIN_SCALE_MIN)
        return self.scale


@dataclass(frozen=True, eq=False)
class Forecast:
    """A forecast's answer and what the policy needs of it until the next one, which replaces it whole."""

    step: int  # StepState.step it ran at
    running: int  # requests running then
    admitted: int  # waiting requests admitted (a prefix of the queue); 0 where too few for a wave fitted
    # Free KV blocks then, less those the admitted take as they are scheduled (None: not known): the cache frees
    # what the first request left out lacked on top of these.
    free_blocks: int | None
    margin_blocks: float  # kept free against uncertainty where the admitted demand comes closest to the cache
    shortfall_tokens: float  # by how much the first request left out overshoots the cache (0: all fit)
    # Where it does (None: all fit). A finish frees its share of the expected demand there (a request that was
    # to hold 10 tokens then frees 10, whatever it holds now), found through `overshoot_rows`.
    overshoot: Overshoot | None
    # A request's row in the pass -> its index into the overshoot's shares, -1 for none; None where it overshoots
    # now or rows are not known (finishes then count what they held, Since.freed_tokens).
    overshoot_rows: np.ndarray | None
    theta: float  # the standard deviations it kept free (margin feedback scales the policy's)
    wave_wait: int  # finishes the next forecast waits for (a wave too small to admit; 0: none)
    estimate_wait: int  # the next forecast the estimate's move calls for waits this many times as long
    informed_rows: int  # requests whose estimate their siblings moved
    shared_prompt_tokens: int  # prompt tokens running samples would hold again without prefix sharing
    # The head was blocked and a backfill tried: a finish may let more requests fit beside the one left out,
    # whatever that one still lacks.
    backfilling: bool = False
    backfilled: int = 0  # requests it admitted past the one left out


@dataclass
class Since:
    """What happened since the last forecast: counts that only grow and flags that only turn on, until the next
    forecast starts a new one."""

    finished: int = 0
    freed_tokens: float = 0.0  # what the finished held (at most: a group's shared prompt stays while others run)
    freed_mean: float = 0.0  # the finished's shares of the overshoot's expected demand, and of its variance
    freed_var: float = 0.0
    preempted: int = 0  # they free memory the finishes do not count
    new_pass: bool = False  # its requests are not those the forecast saw: the forecast is out of date
    estimate_called: bool = False  # the forecast now due is one the estimate's move called for


@register
class ForecastPolicy(MemoryPolicy):
    """Admission by the forecast peak KV of running and admitted requests, from censored length estimates.

    Until `forecast_after` requests, and `forecast_after_share` of the running ones, have finished (earlier
    passes counted at their carried weight) it forecasts with a prior in their place (`cold_start="gamma"`) or
    behaves as Algorithm 1 (`"memory"`); with the prior, until the pass's first finish it looks only
    `cold_start_horizon` x max_tokens ahead (the first wave).

    A forecast that admitted nothing is not repeated until something changed: finishes that free what its first
    waiting request lacked (`Forecast.overshoot`), a preemption, a new pass, or, before STABLE_COUNT finishes,
    enough finishes to move the estimate (ESTIMATE_MOVE). Most steps of a KV-bound pass admit nothing, and a
    forecast reads every running request."""

    name = "forecast"
    needs_requests = True

    def __init__(self, config, stats=None, graph_batch: int = 0) -> None:
        super().__init__(config, stats, graph_batch)
        cold_start, cold_start_shape = config.forecast_cold_start, config.forecast_cold_start_shape
        cold_start_horizon, forecast_after_share = config.forecast_cold_start_horizon, config.forecast_after_share
        pointwise_running_peak, min_wave = config.forecast_pointwise_running_peak, config.forecast_min_wave
        forecast_after, carry_over = config.forecast_after, config.forecast_carry_over
        tail_confidence = config.forecast_tail_confidence
        self.cold_start = cold_start
        self.prior = GammaPrior(cold_start_shape)
        # The first wave of a pass that knows nothing is sized for `cold_start_horizon` x max_tokens of output
        # each, not for the prior's whole future, which admits a fraction of what fits; the prior then stays
        # until `forecast_after_share` of the running requests have finished (at least `forecast_after`): the
        # first few to finish are a wave's shortest, and a fit to them alone admits a wave that preempts.
        self.cold_start_horizon = cold_start_horizon
        # Past the cold start, demand is held within the cache for `horizon_tokens` output tokens ahead (0: to the
        # longest predicted request's end): the forecast is run again at each finish, and the far future rests
        # on the estimate's fitted tail.
        self.horizon_tokens = config.forecast_horizon_tokens
        self.forecast_after_share = forecast_after_share
        # The running requests are held to the test admissions pass, at each future time (not their largest
        # demand plus their largest spread wherever each falls, a margin that keeps the cache emptier).
        self.pointwise_running_peak = pointwise_running_peak
        # A forecast admits nothing until `min_wave` x the running requests fit (or the whole queue): each
        # admission puts prompt tokens into a step, which leaves vLLM's decode-only CUDA graph.
        self.min_wave = min_wave
        # Until this many have finished a prior stands in for the missing lengths (see `_estimate`); its mean is
        # the requests' max_tokens, which in RL is a cap far above the mean. After them the fitted tail, pushed
        # toward longer lengths by its own uncertainty (`tail_confidence` standard errors), carries the estimate.
        self.min_observations = max(self.min_observations, forecast_after)
        self.carry_over = carry_over  # weight of earlier passes' lengths when a new pass starts
        self.lengths = CensoredLengths(tail_confidence=tail_confidence)
        # Saved statistics carry earlier runs' lengths: they seed the estimate as earlier passes do (the first
        # pass's start weighs them by carry_over).
        for k, weight in enumerate(self.stats.output_histogram):
            if weight > 0:
                self.lengths.observe((k + 0.5) * HISTOGRAM_BIN_TOKENS, weight)
        # Sibling updates: a group's finished samples move the estimate of its others within the pass.
        self.siblings = SiblingLengths() if config.forecast_siblings else None
        self.margin = MarginFeedback() if config.forecast_margin_feedback else None
        self.last: Forecast | None = None  # the last forecast (of an earlier pass where since.new_pass)
        self.since = Since()
        # Whether the last cap came from a forecast (or the skip that stands by one); False while Algorithm 1
        # decides (the cold start with cold_start="memory", or nothing waiting).
        self.forecasting = False
        self.backfills = config.forecast_backfill
        # The margin's bound, tighter where requests carry their prompts' predicted lengths (`_margin_cap`).
        self.margin_cap = config.forecast_margin_cap
        self.margin_cap_predicted = config.forecast_margin_cap_predicted
        self.picks: list[int] = []  # queue positions the last cap counts past the blocked head (`backfill`)
        self.preemption_order = config.forecast_preemption

    @property
    def margin_feedback(self) -> bool:
        """Whether preemption feedback scales the margin (`MarginFeedback`)."""
        return self.margin is not None

    def _current(self) -> Forecast | None:
        """This pass's last forecast (None before its first)."""
        return None if self.since.new_pass else self.last

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1, aborted: bool = False) -> None:
        super().observe_finished(prompt_tokens, output_tokens, length_scale, group, row, aborted)
        if not aborted:
            if self.siblings is not None:
                self.siblings.observe(group, output_tokens, length_scale)
            self.lengths.observe_finished(output_tokens / max(length_scale, 1e-6), group)
        since, last = self.since, self._current()
        since.freed_tokens += prompt_tokens + output_tokens
        since.finished += 1
        if last is not None and last.overshoot_rows is not None and 0 <= row < len(last.overshoot_rows):
            at = int(last.overshoot_rows[row])
            if at >= 0:
                since.freed_mean += last.overshoot.mean[at]
                since.freed_var += last.overshoot.var[at]

    def observe_preempted(self, computed_tokens: int) -> None:
        self.since.preempted += 1

    def _freed_at_overshoot(self, last: Forecast) -> float:
        """How far the finishes since the last forecast lowered its overshoot: their shares of the mean, and of
        theta standard deviations (rows taken as independent)."""
        total = last.overshoot.total_var
        return self.since.freed_mean + last.theta * (
            math.sqrt(total) - math.sqrt(max(total - self.since.freed_var, 0.0)))

    def start_pass(self, prior: np.ndarray | None = None) -> None:
        """A new pass. `prior`: the driver's expectation of its lengths, in the units the requests' scales
        define (the previous pass's lengths of the same prompts divided by their new scales); it replaces what
        was observed before, at weight `carry_over` each. Without one, earlier lengths are kept at that weight."""
        super().start_pass(prior)
        self.since.new_pass = True
        self.lengths.start_pass(self.carry_over, prior)
        if self.siblings is not None:
            self.siblings.start_pass(fresh=self.lengths.count == 0)

    def _forecasting(self, state: StepState) -> bool:
        if not state.num_waiting:
            return False
        if self.cold_start == "gamma":
            return self.lengths.observed >= self.min_observations or state.pending_max_tokens_mean > 0
        # "memory": Algorithm 1 until the estimate rests on finished lengths alone (no prior to blend in)
        return self._missing(state) <= 0

    def _estimate(self, state: StepState) -> CensoredLengths:
        """The length estimate to forecast with: the finished lengths, blended with the cold start's prior
        (`GammaPrior`) for as many as are still missing."""
        missing = self._missing(state)
        if missing <= 0:
            return self.lengths
        return self.prior.blend(self.lengths, max(state.pending_max_tokens_mean, 1.0), missing)

    def _missing(self, state: StepState) -> float:
        """Finished lengths still wanted before the estimate rests on them alone (the prior stands in)."""
        wanted = max(self.min_observations, math.ceil(self.forecast_after_share * state.num_running))
        return wanted - self.lengths.observed

    def _horizon(self, state: StepState) -> int:
        """Output tokens the forecast looks ahead (0: all the way): `horizon_tokens` once a request of this pass
        has finished or the estimate rests on finished lengths; before, while the prior stands in, a share of
        max_tokens (`cold_start_horizon`; 0: the prior's whole future). Not only the first step's forecast:
        requests reach vLLM's engine over its first steps."""
        if self.lengths.pass_count or self._missing(state) <= 0:
            return self.horizon_tokens
        if not self.cold_start_horizon:
            return 0
        return max(int(self.cold_start_horizon * max(state.pending_max_tokens_mean, 1.0)), 1)

    def wants_requests(self, state: StepState) -> bool:
        if not self._forecasting(state):
            return False
        last, since = self._current(), self.since
        if last is not None and self.max_cap - state.num_running < state.num_running * HEADROOM_SHARE:
            return False
        if last is None or since.preempted:
            # Running requests that left other than by finishing free memory the finishes do not count.
            return True
        if since.finished < last.wave_wait:
            return False
        if last.backfilling and since.finished:
            return True
        overshoot = last.overshoot
        if last.admitted and overshoot is None:
            # All it was shown fit: more may (the admitted wait in the cap until scheduled, see batch_cap).
            return self._approved(state) == 0
        if overshoot is not None and not overshoot.tokens_ahead and last.free_blocks is not None:
            # The first request left out does not fit now: it can once the cache has freed what it lacked
            # (finishes, less what running requests wrote since). The estimate plays no part in that.
            return (state.kv_free_blocks or 0) - last.free_blocks > last.shortfall_tokens / state.block_size
        if overshoot is not None and last.overshoot_rows is not None:
            # It overshoots later: finishes count beyond those the forecast expected by then; once that time
            # has come, the forecast is out of date.
            ahead = state.step - last.step
            if ahead >= overshoot.tokens_ahead:
                return True
            expected = _interpolate(ahead, overshoot.expected_ahead, overshoot.expected_gone)
            if self._freed_at_overshoot(last) - expected > last.shortfall_tokens:
                return True
        elif since.freed_tokens > last.shortfall_tokens:
            return True
        if self.lengths.count < STABLE_COUNT:
            # Finishes still move the estimate itself, by more than the memory they free: enough of them call
            # for a new forecast.
            if since.finished >= max(1.0, self.lengths.count * ESTIMATE_MOVE) * last.estimate_wait:
                since.estimate_called = True
                return True
        return False

    def _approved(self, state: StepState) -> int:
        """Requests the last forecast admitted that the engine has not scheduled yet (its token budget)."""
        last = self._current()
        if last is None:
            return 0
        return max(last.running + last.admitted - state.num_running - self.since.finished, 0)

    def steady_until(self) -> float:
        # Between arrivals, admissions, finishes and preemptions nothing wants_requests and batch_cap read
        # changes but the step (where a request left out overshoots later) and the free blocks, which only a
        # finish or a preemption raises: most decode steps need not ask.
        if self.graph is not None:  # its limit moves with each step's latency
            return 0
        last = self.last
        if last is not None and last.overshoot is not None and last.overshoot.tokens_ahead and (
                last.overshoot_rows is not None):
            return last.step + last.overshoot.tokens_ahead
        return math.inf

    def waiting_limit(self) -> int | None:
        # Describing the whole queue costs a pass over it each step. Once forecasting, admissions come in waves
        # far smaller than the queue, and a limit that all fitted doubles at the next step. The first forecast
        # may admit hundreds.
        if not self.forecasting:
            return None
        return max(WAITING_LIMIT, 2 * self.last.admitted)

    def _informed(self, state: StepState) -> Informed | None:
        """What the groups' finished samples say of each described request (running, then waiting)."""
        if self.siblings is None or state.running_group is None:
            return None
        sides = ["running", "waiting"] + (["tail"] if state.tail_group is not None else [])
        groups = [getattr(state, f"{side}_group") for side in sides]
        return self.siblings.informed(
            np.concatenate(groups), np.concatenate([getattr(state, f"{side}_generated") for side in sides]),
            np.concatenate([np.ones(len(group)) if getattr(state, f"{side}_scale") is None
                            else getattr(state, f"{side}_scale") for side, group in zip(sides, groups)]).astype(float),
            len(state.running_group))

    def batch_cap(self, state: StepState) -> int:
        self.picks = []  # a cap without a forecast counts none
        if not self._forecasting(state):
            self.forecasting = False
            return super().batch_cap(state)
        if state.running_generated is None:  # skipped: see wants_requests
            self.cap = clamp_cap(state.num_running + self._approved(state), state.num_running, self.min_cap,
                                 self.max_cap)
            return self.cap
        last, since = self.last, self.since
        theta = self.theta
        if self.margin is not None:
            theta = self.theta * self.margin.update(since.preempted > 0, 0 if last is None else last.admitted)
        informed = self._informed(state)
        admission = expected_demand_admissions(state, self._estimate(state), theta, informed=informed,
                                               horizon_tokens=self._horizon(state),
                                               pointwise_running_peak=self.pointwise_running_peak,
                                               backfill=self.backfills, margin_cap=self._margin_cap(state))
        admit, picks, wave_wait = admission.count, list(admission.backfill), 0
        blocked = admit < len(state.waiting_tokens)
        if state.num_running and blocked and 0 < admit + len(picks) < self.min_wave * state.num_running:
            # A wave later: about one request fits per finish, so the next forecast waits for finishes.
            wave_wait = WAVE_WAIT * (math.ceil(self.min_wave * state.num_running) - admit - len(picks))
            admit, picks = 0, []
        self.picks = picks
        estimate_wait = 1 if last is None else last.estimate_wait
        if admit:
            estimate_wait = 1
        elif since.estimate_called:
            estimate_wait = min(estimate_wait * 2, ESTIMATE_WAIT_MAX)
        free_blocks = state.kv_free_blocks
        if (admit or picks) and free_blocks is not None:
            # The admitted take their blocks as they are scheduled.
            own = state.waiting_tokens[:admit] - (0 if state.waiting_shared is None else state.waiting_shared[:admit])
            free_blocks -= int(np.sum(-(-own // state.block_size)))
            for position in picks:
                side, k = ("waiting", position) if position >= 0 else ("tail", -1 - position)
                shared = getattr(state, f"{side}_shared")
                own = getattr(state, f"{side}_tokens")[k] - (0 if shared is None else shared[k])
                free_blocks -= int(-(-own // state.block_size))
        overshoot, rows = admission.overshoot, None
        if overshoot is not None and overshoot.tokens_ahead and state.running_rows is not None:
            described = np.concatenate([state.running_rows, state.waiting_rows])[:len(overshoot.mean)]
            rows = np.full(int(described.max(initial=-1)) + 1, -1, dtype=np.int64)
            rows[described] = np.arange(len(described))
        shared_prompt_tokens = 0
        if state.running_shared is not None:
            _, holder = np.unique(state.running_group, return_index=True)
            shared_prompt_tokens = int(state.running_shared.sum() - state.running_shared[holder].sum())
        self.last = Forecast(
            step=state.step, running=state.num_running, admitted=admit + len(picks), free_blocks=free_blocks,
            margin_blocks=admission.margin_tokens / state.block_size, shortfall_tokens=admission.shortfall_tokens,
            overshoot=overshoot, overshoot_rows=rows, theta=theta, wave_wait=wave_wait, estimate_wait=estimate_wait,
            informed_rows=0 if informed is None else int(np.count_nonzero(informed.spread < 1)),
            shared_prompt_tokens=shared_prompt_tokens, backfilling=self.backfills and blocked,
            backfilled=len(picks))
        self.since = Since()
        self.forecasting = True
        self.cap = clamp_cap(state.num_running + max(admit + len(picks), 0 if state.num_running else 1),
                             state.num_running, self.min_cap, self.max_cap)
        return self.cap

    def _margin_cap(self, state: StepState) -> float:
        """The margin's bound at this step: `margin_cap_predicted` where the pass's requests carry predicted length
        scales (the state shows scale columns only then), else `margin_cap`."""
        predicted = state.running_scale is not None or state.waiting_scale is not None
        return self.margin_cap_predicted if predicted else self.margin_cap

    def backfill(self) -> list[int]:
        return self.picks

    def trace_fields(self) -> dict:
        fields = super().trace_fields()
        last = self.last
        fields["forecast_admitted"] = 0 if last is None else last.admitted
        fields["backfilled"] = 0 if last is None else last.backfilled
        # Where the first request left out overshoots, in tokens ahead of its forecast (0: now; None: all fit).
        overshoot = None if last is None else last.overshoot
        fields["overshoot_tokens_ahead"] = None if overshoot is None else overshoot.tokens_ahead
        if self.margin is not None:
            fields["margin_scale"] = self.margin.scale
        if self.siblings is not None:
            fields["sibling_informed"] = 0 if last is None else last.informed_rows
        if self.forecasting:  # while forecasting, the trace's safety buffer is the forecast's margin
            fields["safety_buffer_blocks"] = self.last.margin_blocks
        # Running prompt tokens counted once, not per sample.
        fields["shared_prompt_tokens"] = 0 if last is None else last.shared_prompt_tokens
        return fields
