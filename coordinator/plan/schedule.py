"""Schedule replay: one replica's inner step, its pipeline schedule (1F1B or GPipe) replayed op by op.

Exact where a closed form is not: with slow links the round trip, not the slowest stage, binds the
steady state. The order of ops is node/pipeline/schedule.py's.
"""

from __future__ import annotations

import functools
import math
from typing import Literal


def warmup_forwards(S: int, s: int, extra_in_flight: int = 0) -> int:
    """1F1B warm-up forwards of stage s: S - s - 1, plus extra_in_flight x (S - s - 1) / (S - 1) rounded
    up, so stage 0 keeps S + extra in flight and the last stage none.

    What hides a link is the difference between neighbours: stage s waits on B(i) after F(i) for
    (w_s - w_{s+1}) of its own microbatches, and that must cover the round trip to s + 1. Growing the
    warm-up with the distance to the last stage gives every link its share; adding the same `extra`
    to every non-last stage leaves a difference of 1 except at the last link, so with S >= 3 the other
    links still stall every microbatch (the replay shows it: S = 4, rtt + 2 t_x = t_c / 2, extra 4: a
    period of 1.34 t_c against 1.0).
    """
    if not 0 <= s < S:
        raise ValueError(f"stage {s} is outside 0..{S - 1}")
    return S - s - 1 + math.ceil(extra_in_flight * (S - s - 1) / max(1, S - 1))


def schedule_step(
    f: list[float],
    b: list[float],
    t_x: list[float],
    delay: list[float],
    M: int,
    schedule: Literal["1f1b", "gpipe"] = "1f1b",
    extra_in_flight: int = 0,
) -> float:
    """Seconds of one inner step of one replica: its pipeline schedule replayed op by op.

    f[s], b[s]: forward and backward compute of stage s per microbatch; t_x[l], delay[l]: serialization
    and one-way latency of link l (stage l -> l+1), each direction a FIFO of its own (full duplex).
    Stage s runs node/pipeline/schedule.py's order: 1F1B does `warmup_forwards(S, s, extra_in_flight)` forwards,
    then alternates forward and backward, then drains; GPipe all forwards, then all backwards. An op starts when its stage is free and its input has arrived; a message starts
    serializing when its op ends and the link direction is free, and arrives t_x + delay later::

        F(s, i) starts at max(stage s free, arrival of activation i from s-1)
        B(s, i) starts at max(stage s free, arrival of gradient i from s+1)   (last stage: its F)
        message: start = max(op end, direction free); arrival = start + t_x + delay

    With ideal links and equal stages this is (M + S - 1)(f + b), the textbook bubble. With slow links
    it is exact where a closed form is not: when the round trip binds, the steady state spends
    (sum t_c + sum (rtt + 2 t_x)) / W per microbatch and the bubble is already inside it.
    Cached: replicas on identical hosts cost one replay.
    """
    return _schedule_step(tuple(f), tuple(b), tuple(t_x), tuple(delay), M, schedule, extra_in_flight)


@functools.lru_cache(maxsize=4096)
def _schedule_step(
    f: tuple[float, ...],
    b: tuple[float, ...],
    t_x: tuple[float, ...],
    delay: tuple[float, ...],
    M: int,
    schedule: str,
    extra_in_flight: int,
) -> float:
    S = len(f)
    order: list[list[tuple[str, int]]] = []
    for s in range(S):
        if schedule == "gpipe":
            order.append([("F", i) for i in range(M)] + [("B", i) for i in range(M)])
            continue
        w = min(M, warmup_forwards(S, s, extra_in_flight))
        ops = [("F", i) for i in range(w)]
        for i in range(w, M):
            ops += [("F", i), ("B", i - w)]
        order.append(ops + [("B", i) for i in range(M - w, M)])
    act: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> when its input activation arrives
    grad: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> when its output gradient arrives
    fwd_free, bwd_free = [0.0] * (S - 1), [0.0] * (S - 1)
    free, nxt = [0.0] * S, [0] * S
    left = sum(len(ops) for ops in order)
    while left:
        moved = False
        for s in range(S):
            while nxt[s] < len(order[s]):
                kind, i = order[s][nxt[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else act.get((s, i))
                else:
                    ready = 0.0 if s == S - 1 else grad.get((s, i))
                if ready is None:
                    break  # waits on a neighbour: try the other stages
                end = max(free[s], ready) + (f[s] if kind == "F" else b[s])
                free[s] = end
                if kind == "F" and s < S - 1:
                    start = max(end, fwd_free[s])
                    fwd_free[s] = start + t_x[s]
                    act[(s + 1, i)] = start + t_x[s] + delay[s]
                elif kind == "B" and s > 0:
                    start = max(end, bwd_free[s - 1])
                    bwd_free[s - 1] = start + t_x[s - 1]
                    grad[(s - 1, i)] = start + t_x[s - 1] + delay[s - 1]
                nxt[s] += 1
                left -= 1
                moved = True
        assert moved, "pipeline schedule deadlocked"  # cannot happen: both orders are deadlock-free
    return max(free)
