"""The encoder's learned cost curve and arrival rates, per modality, for `--max-wait-ms auto`.

Pure bookkeeping: the caller passes every time in (no clock here), so it is tested with synthetic
observations. Two online estimates per modality:

- `LinearCostFit`: an exponentially weighted least-squares fit of a forward's seconds against its
  token count, `seconds = a + b * tokens` (`a`: the fixed cost of a forward, `b`: the cost per
  output token). With the mean tokens per request it gives the curve per batch size the policy
  uses, `c(k) = a + (b * tokens_per_request) * k`. The fit only counts as learned once it has seen
  enough batches of different sizes to tell `a` from `b`.
- `ArrivalRate`: an exponentially weighted mean of the gaps between arrivals; the rate it reports
  never exceeds one over the silence since the last arrival, so it falls as soon as traffic stops.

`CostModel` holds both per modality, answers the policy's `CostEstimates` questions (`curve`,
`arrival_rate`), and summarises the learned curve for `/v1/performance`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class EwStats:
    """Exponentially weighted mean, variance and covariance of (x, y) pairs (West/Finch incremental form).

    The first observations weigh equally (`alpha = 1/count` until it drops to `alpha`), so a young
    estimate is not biased towards its first sample.
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.count = 0
        self.mean_x = self.mean_y = 0.0
        self.var_x = self.cov_xy = 0.0

    def add(self, x: float, y: float) -> None:
        self.count += 1
        weight = max(self.alpha, 1.0 / self.count)
        dx, dy = x - self.mean_x, y - self.mean_y
        self.mean_x += weight * dx
        self.mean_y += weight * dy
        self.var_x = (1.0 - weight) * (self.var_x + weight * dx * dx)
        self.cov_xy = (1.0 - weight) * (self.cov_xy + weight * dx * dy)


class LinearCostFit:
    """`seconds = a + b * tokens`, fitted online with exponential forgetting."""

    def __init__(self, alpha: float = 0.05, min_samples: int = 8, min_relative_spread: float = 0.1) -> None:
        self.stats = EwStats(alpha)
        self.min_samples = min_samples
        self.min_relative_spread = min_relative_spread

    def observe(self, tokens: float, seconds: float) -> None:
        if tokens >= 0 and seconds >= 0 and math.isfinite(seconds):
            self.stats.add(float(tokens), float(seconds))

    @property
    def learned(self) -> bool:
        """Enough batches, of sizes different enough, to separate the fixed cost from the per-token one."""
        s = self.stats
        spread = self.min_relative_spread * s.mean_x
        return s.count >= self.min_samples and s.mean_x > 0 and s.var_x > spread * spread

    def coefficients(self) -> tuple[float, float] | None:
        """(a seconds, b seconds per token), both clamped at zero; None until learned."""
        if not self.learned:
            return None
        s = self.stats
        slope = s.cov_xy / s.var_x
        if slope <= 0:  # noise: cost does not grow with size here; all of it is fixed
            return s.mean_y, 0.0
        intercept = s.mean_y - slope * s.mean_x
        if intercept < 0:  # no fixed cost to amortise: cost proportional to tokens
            return 0.0, s.mean_y / s.mean_x
        return intercept, slope


class ArrivalRate:
    """Requests per second, from an exponentially weighted mean of inter-arrival gaps."""

    def __init__(self, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.count = 0
        self.mean_gap = 0.0
        self.last: float | None = None

    def observe(self, at: float) -> None:
        if self.last is not None:
            gap = max(0.0, at - self.last)
            self.count += 1
            weight = max(self.alpha, 1.0 / self.count)
            self.mean_gap += weight * (gap - self.mean_gap)
        self.last = at if self.last is None else max(self.last, at)

    def rate(self, now: float) -> float | None:
        if self.count < 2 or self.last is None:
            return None
        gap = max(self.mean_gap, now - self.last, 1e-6)
        return 1.0 / gap


@dataclass
class _ModalityCosts:
    fit: LinearCostFit
    arrivals: ArrivalRate
    tokens_per_request: EwStats  # only its mean_x is used
    batches: int = 0


class CostModel:
    """Learned forward cost and arrival rate per modality; implements `scheduling.policy.CostEstimates`."""

    def __init__(self, alpha: float = 0.05, min_samples: int = 8) -> None:
        self.alpha = alpha
        self.min_samples = min_samples
        self._modalities: dict[str, _ModalityCosts] = {}

    def _of(self, modality: str) -> _ModalityCosts:
        costs = self._modalities.get(modality)
        if costs is None:
            costs = _ModalityCosts(LinearCostFit(self.alpha, self.min_samples), ArrivalRate(self.alpha),
                                   EwStats(self.alpha))
            self._modalities[modality] = costs
        return costs

    def observe_batch(self, modality: str, count: int, tokens: int, seconds: float) -> None:
        """A forward of `count` requests and `tokens` output tokens took `seconds`."""
        if count <= 0:
            return
        costs = self._of(modality)
        costs.batches += 1
        costs.fit.observe(tokens, seconds)
        costs.tokens_per_request.add(tokens / count, 0.0)

    def observe_arrival(self, modality: str, at: float) -> None:
        """A request of `modality` was queued at `at` (the scheduler's clock)."""
        self._of(modality).arrivals.observe(at)

    def curve(self, modality: str) -> tuple[float, float] | None:
        """(seconds per forward, seconds per typical request), or None until learned."""
        costs = self._modalities.get(modality)
        if costs is None:
            return None
        coefficients = costs.fit.coefficients()
        if coefficients is None:
            return None
        fixed_s, per_token_s = coefficients
        return fixed_s, per_token_s * costs.tokens_per_request.mean_x

    def arrival_rate(self, modality: str, now: float) -> float | None:
        costs = self._modalities.get(modality)
        return None if costs is None else costs.arrivals.rate(now)

    def work_seconds(self, modality: str, tokens: int, batches: int = 1) -> float | None:
        """The expected forward time of `batches` forwards that together give `tokens` output tokens: from the
        learned curve once it is, before that in proportion to the mean forward's seconds per token (which
        overstates a large batch's cost: its fixed part is not amortised). None before any batch of `modality`."""
        costs = self._modalities.get(modality)
        if costs is None or costs.fit.stats.count == 0:
            return None
        coefficients = costs.fit.coefficients()
        if coefficients is not None:
            return batches * coefficients[0] + coefficients[1] * tokens
        stats = costs.fit.stats
        return stats.mean_y * tokens / stats.mean_x if stats.mean_x > 0 else batches * stats.mean_y

    def summary(self, max_batch_size: int, now: float) -> dict[str, dict]:
        """The learned curve per modality, as `/v1/performance` shows it under `cost_model`."""
        sizes = sorted({size for size in (1, 2, 4, 8, 16, 32, 64, 128, 256) if size < max_batch_size}
                       | {max_batch_size})
        out: dict[str, dict] = {}
        for modality, costs in sorted(self._modalities.items()):
            coefficients = costs.fit.coefficients()
            curve = self.curve(modality)
            rate = costs.arrivals.rate(now)
            entry: dict = {
                "learned": coefficients is not None,
                "batches_seen": costs.batches,
                "mean_tokens_per_request": round(costs.tokens_per_request.mean_x, 3),
                "arrival_rate_rps": None if rate is None else round(rate, 3),
            }
            if coefficients is not None and curve is not None:
                fixed_s, per_request_s = curve
                entry["fixed_ms"] = round(fixed_s * 1e3, 4)
                entry["per_token_us"] = round(coefficients[1] * 1e6, 4)
                entry["curve"] = [
                    {"batch_size": size, "forward_ms": round((fixed_s + per_request_s * size) * 1e3, 4),
                     "ms_per_request": round((fixed_s + per_request_s * size) * 1e3 / size, 4)}
                    for size in sizes
                ]
            out[modality] = entry
        return out
