"""How much of the predicted prefix hit each pod actually delivers.

The index says which blocks a pod holds *now*. A pod whose KV is smaller than
what is routed to it evicts blocks while requests wait in its queue, so a
turn predicted to hit 1792 tokens finds 512 when it is scheduled, turn after
turn (measured with tight KV: every request on the crowded pod "over"
predicted, TTFT 10-15 s, while the other pod kept its sessions' KV). The
index is right each time it is asked; what it cannot see is the churn ahead.

So the router keeps, per pod, the share of predicted cached tokens the engine
reported as cached (an exponential average over requests that predicted a
hit), and the cost policy discounts that pod's predicted hits by it: a
thrashing pod stops looking like the cheap place to keep a session, and
stickiness yields to a pod that keeps KV. The memory fades with a half-life,
so a pod that stopped thrashing (or that nothing is sent to any more) is
trusted again. With ample KV every share is 1 and nothing changes.
"""

from __future__ import annotations

import math

# Weight of one observation: a few bad turns in a row are enough to act on.
_ALPHA = 0.3


class DeliveredHits:
    def __init__(self, half_life_s: float) -> None:
        if half_life_s < 0:
            raise ValueError(f"--miss-memory {half_life_s:g}: must be >= 0")
        self.half_life_s = half_life_s
        self._share: dict[str, tuple[float, float]] = {}  # pod -> (share, when)

    def share(self, pod: str, now: float) -> float:
        """The fraction of predicted hits ``pod`` has been delivering (1 = all)."""
        entry = self._share.get(pod)
        if entry is None or self.half_life_s == 0:
            return 1.0
        share, when = entry
        fade = math.exp2(-max(0.0, now - when) / self.half_life_s)
        return 1.0 - (1.0 - share) * fade

    def observe(self, pod: str, predicted: int, actual: int, now: float) -> None:
        """A request predicted ``predicted`` cached tokens on ``pod``; the engine
        reported ``actual``. More than predicted counts as all delivered."""
        if predicted <= 0 or self.half_life_s == 0:
            return
        seen = min(1.0, actual / predicted)
        current = self.share(pod, now)
        self._share[pod] = (current + _ALPHA * (seen - current), now)

    def discount(self, pod: str, matched_blocks: int, now: float) -> int:
        """Blocks of a predicted match the pod can be expected to deliver."""
        return math.floor(matched_blocks * self.share(pod, now))
