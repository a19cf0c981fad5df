"""Load balancing of an MoE run's experts across the whole run (issue 24).

DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer's router chooses experts by score + bias
(node/model.py `Router`), and after every inner step the bias moves against the load:

    load_e  = tokens routed to expert e in the step, summed over the step's agreed set of replicas
    b_e    <- b_e + gamma * sign(mean_e' load_e' - load_e)          (gamma = model.moe.bias_rate)

Replicas route different batches, so a bias moved by each replica's own load would drift apart, and with
it their routing and then their models. Here every replica moves its bias by the same agreed load: the
per-step barrier of node/sync/route_exchange.py gives step t's set on every replica alike, and the bias
used at step t + 1 moves by step t + 1 - D's (D = model.moe.stats_delay). The update is exact: the sign
compares integers (sum_e' load_e' against E load_e) and the add is one float32 IEEE add per expert, done
on the host, so the bias is bit-identical on every replica, on a CPU or a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from node.model import MoE, moe_blocks
from node.sync.route_exchange import Agreed, RouteExchange, RouteStats
from protocol.identity import Identity
from protocol.net.store import ObjectStore
from protocol.runspec import RunSpec

log = logging.getLogger(__name__)

BIAS_HISTORY = 32
"""(step, digest) pairs of the expert bias a stage keeps for /status (replicas compare equal steps)."""


def take_load(module: torch.nn.Module) -> dict[int, np.ndarray]:
    """Layer -> the tokens each expert of its MoE took in training since the last call (int64), and zero."""
    out = {}
    for layer, moe in moe_blocks(module).items():
        out[layer] = moe.load.detach().cpu().numpy().astype(np.int64)
        moe.load.zero_()
    return out


def bias_delta(load: np.ndarray, rate: float) -> np.ndarray:
    """gamma * sign(mean load - load_e) per expert (float32), the comparison exact in integers."""
    load = np.asarray(load, np.int64)
    return np.sign(load.sum() - load.size * load).astype(np.float32) * np.float32(rate)


def move_bias(moe: MoE, load: np.ndarray, rate: float) -> None:
    """b <- b + bias_delta(load): the float32 add on the host (the same bits on a CPU and a GPU), then
    back where the router lives."""
    with torch.no_grad():
        bias = moe.router.expert_bias
        new = bias.detach().cpu().numpy() + bias_delta(load, rate)
        bias.copy_(torch.from_numpy(new).to(bias.device))


def bias_digest(module: torch.nn.Module) -> str:
    """sha256 of every MoE layer's expert bias (float32 bytes, layer order): the balancing state, which
    every replica's stage holding those layers must show alike at the same step."""
    h = hashlib.sha256()
    for layer, moe in moe_blocks(module).items():
        h.update(str(layer).encode())
        h.update(moe.router.expert_bias.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def load_ratio(counts: np.ndarray) -> float:
    """max / mean tokens per expert of one layer's load (1.0 = perfectly balanced; 0 tokens: 1.0)."""
    mean = float(counts.mean()) if counts.size else 0.0
    return float(counts.max()) / mean if mean > 0 else 1.0


class Balancer:
    """The expert bias of one stage's MoE layers, moved after each inner step by the run's agreed load."""

    def __init__(
        self, module: torch.nn.Module, exchanges: dict[int, RouteExchange], *, rate: float, delay: int
    ) -> None:
        """exchanges: layer group -> its per-step barrier (the stage's groups holding MoE blocks)."""
        self.module, self.exchanges, self.rate, self.delay = module, exchanges, rate, delay
        self.blocks = moe_blocks(module)
        # our record goes up, and each step's set is read, in the background as soon as the step is done:
        # training waits only for the set it needs, D steps later (with D >= 2, usually not at all)
        self._put = ThreadPoolExecutor(max_workers=1, thread_name_prefix="route-put")
        self._get = ThreadPoolExecutor(max_workers=len(exchanges) or 1, thread_name_prefix="route-set")
        self._publishing: list[Future[bool]] = []
        self._sets: dict[tuple[int, int], Future[Agreed | None]] = {}
        """(group, step) -> its agreed set being read (each group's in step order, one reader a group)."""
        self.stall_s = 0.0
        """Training time blocked on agreed sets not yet in: the barrier's stall."""
        self.load_ratio: dict[int, float] = {}
        """Layer -> max/mean tokens per expert in the last agreed step's load, over the run's replicas."""
        self.local_ratio: dict[int, float] = {}
        """Layer -> max/mean tokens per expert in this replica's own last step."""
        self.history: list[tuple[int, str]] = []
        """(step, bias digest) of the last BIAS_HISTORY steps: the bias training step `step` uses."""

    @property
    def stats(self) -> RouteStats:
        """The barrier's figures over the stage's groups, summed."""
        out = RouteStats()
        for ex in self.exchanges.values():
            s = ex.stats
            for name in (
                "steps",
                "settle_s",
                "bytes_up",
                "bytes_down",
                "rejected",
                "missing",
                "not_published",
            ):
                setattr(out, name, getattr(out, name) + getattr(s, name))
        return out

    def set_signers(self, by_group: dict[int, tuple[dict[int, str], dict[int, set[str]] | None]]) -> None:
        for g, ex in self.exchanges.items():
            if g in by_group:
                ex.set_signers(*by_group[g])

    def step_done(self, step: int) -> bool:
        """After inner step `step` (0-based) trained: `publish` its load, then `apply` the update the next
        step needs. False when the wait was cancelled (the worker is stopping; the bias is left as it was)."""
        self.publish(step)
        return self.apply(step)

    def publish(self, step: int) -> None:
        """Take step `step`'s load, put it up and start reading the step's agreed set, in the background."""
        load = take_load(self.module)
        self.local_ratio = {layer: load_ratio(c) for layer, c in load.items()}
        for g, ex in self.exchanges.items():
            counts = np.stack([load[layer] for layer in ex.layers])
            self._publishing.append(self._put.submit(ex.publish, step, counts))
            self._sets[g, step] = self._get.submit(ex.agreed, step)
        self._publishing = [f for f in self._publishing if not f.done()]

    def apply(self, step: int) -> bool:
        """Move the bias that step `step + 1` uses by the agreed load of step `step + 1 - D`, waiting for
        that set (the barrier); False when the wait was cancelled."""
        target = step + 1 - self.delay
        if target >= 0:
            t0 = time.perf_counter()
            try:
                for g, ex in self.exchanges.items():
                    pending = self._sets.pop((g, target), None)  # a resumed stage asks for it now
                    agreed = pending.result() if pending is not None else ex.agreed(target)
                    if agreed is None:
                        return False
                    for layer, load in zip(ex.layers, agreed.counts, strict=True):
                        move_bias(self.blocks[layer], load, self.rate)
                        self.load_ratio[layer] = load_ratio(load)
            finally:
                self.stall_s += time.perf_counter() - t0
        self.history = [*self.history, (step + 1, bias_digest(self.module))][-BIAS_HISTORY:]
        return True

    def figures(self) -> dict[str, object]:
        """The worker's metrics of the balancing (node/worker.py WorkerMetrics' expert and routing fields)."""
        rs = self.stats
        return {
            "expert_load": {str(k): round(v, 4) for k, v in self.load_ratio.items()},
            "expert_load_local": {str(k): round(v, 4) for k, v in self.local_ratio.items()},
            "expert_bias_history": list(self.history),
            "routing": {
                "steps": rs.steps,
                "wait_s": round(self.stall_s, 3),
                "settle_s": round(rs.settle_s, 3),
                "bytes_up": rs.bytes_up,
                "bytes_down": rs.bytes_down,
                "rejected": rs.rejected,
                "missing": rs.missing,
                "not_published": rs.not_published,
            },
        }

    def close(self) -> None:
        """Stop reading sets no step will use (the run's last D - 1) and wait for our records to land."""
        for ex in self.exchanges.values():
            ex.close()
        self._get.shutdown(wait=True, cancel_futures=True)
        self._put.shutdown(wait=True)


Signers = dict[int, tuple[dict[int, str], dict[int, set[str]] | None]]
"""Layer group -> (its signers by replica now, the nodes that held a slot before)."""


def stage_balancer(
    module: torch.nn.Module,
    spec: RunSpec,
    store: ObjectStore,
    identity: Identity,
    *,
    replica: int,
    signers: Signers,
    cancelled: Callable[[], bool],
) -> Balancer | None:
    """The expert bias of a stage and the per-step barrier of each of its layer groups that holds MoE
    blocks (signers: the stage's groups'), or None when it holds none."""
    groups = spec.layer_groups()
    exchanges = {
        g: RouteExchange(
            store, identity, spec, group=g, replica=replica, signers=now, former=former, cancelled=cancelled
        )
        for g, (now, former) in signers.items()
        if any(spec.model.is_moe_layer(i) for i in range(*groups[g]))
    }
    if not exchanges:
        return None
    moe = spec.model.moe
    return Balancer(module, exchanges, rate=moe.bias_rate, delay=moe.stats_delay)


__all__ = [
    "BIAS_HISTORY",
    "Balancer",
    "Signers",
    "bias_delta",
    "bias_digest",
    "load_ratio",
    "move_bias",
    "stage_balancer",
    "take_load",
]
