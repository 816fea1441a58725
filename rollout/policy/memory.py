"""Memory-aware batch sizing: Algorithm 1 of Pang, Li, Wang, "Optimizing LLM Inference Throughput via
Memory-aware and SLA-constrained Dynamic Batching" (arXiv 2503.05248), and its exact CLT bound.

In the paper's symbols: eta is the KV capacity, L0 the safety buffer, E[l_in] + E[l_out] the mean demand of one
request, theta = Phi^-1(1 - eps_M). Demand of b requests is approximately normal with mean b*mu and standard
deviation sqrt(b)*sigma (CLT), so P(demand > eta) <= eps_M holds while b*mu + theta*sigma*sqrt(b) <= eta, whose
largest solution is the closed form in `clt_batch_bound`. The buffer L0 = eta - (theta*sigma_S + mu_S) is read at
that bound, where the capacity left for expected use is eta - L0 = mu_S, so L0 = theta*sigma_S: the part of the
cache held back for fluctuation. Algorithm 1 then sizes the batch as b_t = floor((eta - L0) / mu) every step
while L0 is refreshed only every K finished requests.

All quantities here are in KV blocks: vLLM allocates whole blocks, so a request of l tokens holds ceil(l/bs).
"""

from __future__ import annotations

import math
from scipy.stats import norm


def overflow_quantile(eps_m: float) -> float:
    """theta: the standard-normal quantile for an overflow probability eps_m."""
    if not 0.0 < eps_m < 1.0:
        raise ValueError(f"eps_m must be in (0, 1), got {eps_m}")
    return float(norm.ppf(1.0 - eps_m))


def clt_batch_bound(kv_capacity: float, mean_demand: float, std_demand: float, theta: float) -> float:
    """Largest real b with b*mean + theta*std*sqrt(b) <= kv_capacity (inf when demand is zero)."""
    if mean_demand <= 0.0:
        return math.inf
    if kv_capacity <= 0.0:
        return 0.0
    spread = std_demand * theta
    disc = math.sqrt(spread * spread + 4.0 * mean_demand * kv_capacity)
    # sqrt(b) = (disc - spread) / (2*mean); for spread >= 0 the equal form 2*eta / (disc + spread) avoids
    # cancellation when the spread dwarfs the mean.
    root = 2.0 * kv_capacity / (disc + spread) if spread >= 0 else (disc - spread) / (2.0 * mean_demand)
    return root * root


def safety_buffer(kv_capacity: float, mean_demand: float, std_demand: float, theta: float) -> float:
    """L0: capacity held back so that the expected demand of the admitted batch stays eta - L0."""
    bound = clt_batch_bound(kv_capacity, mean_demand, std_demand, theta)
    if math.isinf(bound):
        return 0.0
    return theta * std_demand * math.sqrt(bound)  # = eta - bound*mean, without the cancellation


def memory_batch_size(kv_capacity: float, buffer: float, mean_demand: float) -> float:
    """Algorithm 1's b_t = floor((eta - L0) / (E[l_in] + E[l_out])), before clamping."""
    if mean_demand <= 0.0:
        return math.inf
    return math.floor(max(kv_capacity - buffer, 0.0) / mean_demand)


def clamp_cap(batch_size: float, num_running: int, min_cap: int, max_cap: int) -> int:
    """Never below the running count (lowering the cap must not evict) nor above what vLLM sized buffers for."""
    if math.isnan(batch_size):
        batch_size = max_cap
    return int(min(max(batch_size, num_running, min_cap), max_cap))

