"""Mixture-of-experts blocks and their run-wide load balancing (issue 24): the router and experts
(node/model.py), the bias update (node/sync/expert_bias.py) and the per-step barrier of routing counts
(node/sync/route_exchange.py) against a real S3 server (moto), replicas in one process."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch

from node.inner_step import is_muon_matrix, make_optimizer
from node.model import build_full_model, lm_loss, moe_blocks
from node.sync.expert_bias import Balancer, bias_delta, bias_digest, take_load
from node.sync.round_rule import decide_step
from node.sync.route_exchange import RouteExchange
from protocol import keys
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.memory import stage_memory, stage_params
from protocol.messages import RouteCounts
from protocol.net.store import ObjectStore, StoreConfig, StoreError
from protocol.runspec import ModelSpec, MoESpec, RunSpec, SyncSpec, TrainSpec

pytestmark = pytest.mark.timeout(180)

IDS = [Identity.from_seed(bytes([i + 40]) * 32) for i in range(4)]
MOE = MoESpec(experts=8, top_k=2, d_ff=48, bias_rate=1e-2, stats_timeout_s=1.0)
MODEL = ModelSpec(d_model=64, n_layers=2, n_heads=4, d_ff=172, seq_len=16, moe=MOE)


def spec(replicas: int = 2, model: ModelSpec = MODEL, quorum: int = 0, **moe: object) -> RunSpec:
    m = model if not moe else ModelSpec(**{**model.__dict__, "moe": MoESpec(**{**MOE.__dict__, **moe})})
    return RunSpec(
        run_id=f"moe-{uuid.uuid4().hex[:8]}",
        replicas=replicas,
        stages=1,
        model=m,
        train=TrainSpec(total_steps=50, batch_size=4, microbatches=1),
        sync=SyncSpec(H=5, quorum=quorum),
    )


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="moe-balance"))
    s.ensure_bucket()
    return s


# --- the model --------------------------------------------------------------------------------------
def test_moe_block_routes_each_token_to_top_k_experts_and_learns() -> None:
    torch.manual_seed(0)
    model = build_full_model(MODEL)
    x = torch.randint(0, 256, (4, MODEL.seq_len + 1))
    loss = lm_loss(model(x[:, :-1]), x)
    loss.backward()
    load = take_load(model)
    assert sorted(load) == [0, 1]
    for counts in load.values():
        assert counts.sum() == 4 * MODEL.seq_len * MOE.top_k
    assert all(int(c.sum()) == 0 for c in take_load(model).values())  # taken: zero again
    # every parameter is one node/model.py builds and ModelSpec counts, and gets a gradient
    assert sum(p.numel() for p in model.parameters()) == MODEL.n_params
    router = model.layers["0"].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    assert MODEL.n_active_params < MODEL.n_params
    # validation forwards route but do not count (the worker validates in train mode, without grad)
    with torch.no_grad():
        model(x[:, :-1])
    model.eval()
    model(x[:, :-1])
    assert all(int(c.sum()) == 0 for c in take_load(model).values())


def test_moe_parameters_are_two_d_per_expert_and_the_router_stays_with_adamw() -> None:
    model = build_full_model(MODEL)
    named = dict(model.named_parameters())
    assert named["layers.1.mlp.experts.7.w_down.weight"].shape == (64, 48)
    assert "layers.0.mlp.router.expert_bias" in model.state_dict()  # checkpointed with the weights
    assert not is_muon_matrix("layers.0.mlp.router.weight", named["layers.0.mlp.router.weight"])
    assert is_muon_matrix("layers.0.mlp.experts.3.w_up.weight", named["layers.0.mlp.experts.3.w_up.weight"])
    opt = make_optimizer(model, TrainSpec(optimizer="muon", batch_size=4, microbatches=1))
    muon = {id(p) for p in opt.parts[0].param_groups[0]["params"]}
    assert id(named["layers.0.mlp.experts.3.w_up.weight"]) in muon
    assert id(named["layers.0.mlp.router.weight"]) not in muon
    writers = MODEL.residual_writers(1)
    assert "layers.1.mlp.experts.5.w_down.weight" in writers and "layers.1.attn.wo.weight" in writers


def test_first_dense_blocks_and_shared_experts() -> None:
    m = ModelSpec(**{**MODEL.__dict__, "moe": MoESpec(experts=4, top_k=1, first_dense=1, shared_experts=1)})
    model = build_full_model(m)
    assert list(moe_blocks(model)) == [1]
    assert sum(p.numel() for p in model.parameters()) == m.n_params
    assert "layers.1.mlp.shared.w_down.weight" in m.residual_writers(1)
    with pytest.raises(ValueError, match="first_dense"):
        ModelSpec(**{**MODEL.__dict__, "moe": MoESpec(experts=4, first_dense=2)})
    with pytest.raises(ValueError, match="top_k"):
        MoESpec(experts=4, top_k=5)


def test_memory_estimate_counts_every_expert() -> None:
    s = spec()
    assert stage_params(s, 0) == MODEL.n_params
    dense = RunSpec(
        run_id="dense", replicas=2, stages=1, model=ModelSpec(**{**MODEL.__dict__, "moe": MoESpec()})
    )
    assert stage_memory(s, 0, "fp32").weights > stage_memory(dense, 0, "fp32").weights
    assert stage_memory(s, 0, "fp32").activations > stage_memory(dense, 0, "fp32").activations


# --- the bias rule ----------------------------------------------------------------------------------
def test_bias_moves_against_the_load_exactly() -> None:
    d = bias_delta(np.array([10, 2, 0, 4]), 1e-3)  # mean 4: over, under, under, at
    assert d.dtype == np.float32
    assert d.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 0.0])
    assert bias_delta(np.array([3, 3, 3]), 0.5).tolist() == [0.0, 0.0, 0.0]


def test_step_rule_is_final_once_every_slot_is_in() -> None:
    d = decide_step({0: 100, 1: 100}, {0, 1}, quorum=2, window_s=1, now_s=100)
    assert d.final and d.members == {0, 1}
    late = decide_step({0: 100, 1: 103}, {0, 1}, quorum=1, window_s=1, now_s=103)
    assert late.final and late.members == {0}  # in, but past the quorum's arrival + W: out, for everyone
    missing = decide_step({0: 100}, {0, 1}, quorum=1, window_s=1, now_s=102)
    assert not missing.final
    assert decide_step({0: 100}, {0, 1}, quorum=1, window_s=1, now_s=103).final


# --- the barrier through the store ------------------------------------------------------------------
OPEN: list[Balancer] = []


@pytest.fixture(autouse=True)
def _close_balancers():
    """Each test's balancers stop reading sets nobody waits for (the last D - 1) before the next test."""
    yield
    while OPEN:
        OPEN.pop().close()


def _replicas(store: ObjectStore, s: RunSpec, n: int) -> tuple[list[torch.nn.Module], list[Balancer]]:
    models, balancers = [], []
    signers = {r: IDS[r].peer_id for r in range(n)}
    for r in range(n):
        model = build_full_model(s.model)
        ex = RouteExchange(store, IDS[r], s, group=0, replica=r, signers=signers)
        models.append(model)
        balancers.append(Balancer(model, {0: ex}, rate=s.model.moe.bias_rate, delay=s.model.moe.stats_delay))
    OPEN.extend(balancers)
    return models, balancers


def _train_step(model: torch.nn.Module, r: int, step: int, s: RunSpec) -> None:
    g = torch.Generator().manual_seed(1000 * r + step)
    x = torch.randint(0, 256, (s.train.batch_size, s.model.seq_len + 1), generator=g)
    lm_loss(model(x[:, :-1]), x).backward()
    model.zero_grad()


def _run_step(models, balancers, s, step, skip_publish=()) -> None:
    for r, m in enumerate(models):
        _train_step(m, r, step, s)
    threads = [threading.Thread(target=b.step_done, args=(step,)) for b in balancers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


@pytest.mark.parametrize("delay", [1, 2])
def test_every_replica_moves_its_bias_by_the_same_agreed_load(store: ObjectStore, delay: int) -> None:
    s = spec(replicas=3, stats_delay=delay)
    models, balancers = _replicas(store, s, 3)
    for step in range(4):
        _run_step(models, balancers, s, step)
        digests = {bias_digest(m) for m in models}
        assert len(digests) == 1, f"step {step}: biases differ"
    assert bias_digest(models[0]) != bias_digest(build_full_model(s.model))  # it moved
    st = balancers[0].stats
    assert st.steps >= 4 - (delay - 1) and st.missing == 0 and st.rejected == 0  # the last D - 1: in flight
    assert st.bytes_up > 0 and st.bytes_down > 0
    assert all(r >= 1.0 for r in balancers[0].load_ratio.values())


def test_a_cut_off_replica_applies_the_same_updates_when_it_is_back(store: ObjectStore) -> None:
    """Replica 2's store access to the routing channel is cut while the others train steps 1-3: they
    decide those steps without its counts (each after W + M), it waits at the first set it needs instead
    of guessing, and once it is back it applies exactly their updates (its late records stay out, for
    everyone alike); then all three go on together."""
    s = spec(replicas=3)
    models, balancers = _replicas(store, s, 3)
    cut = threading.Event()
    real = balancers[2].exchanges[0].store

    class Cut:  # the replica's own view of the store, failing while cut
        def __getattr__(self, name: str):
            attr = getattr(real, name)
            if name in ("put_if_absent", "list_stamped", "get") and cut.is_set():

                def refused(*a, **k):
                    raise StoreError("connection refused (the test cut this replica's channel)")

                return refused
            return attr

    balancers[2].exchanges[0].store = Cut()  # type: ignore[assignment]
    _run_step(models, balancers, s, 0)
    cut.set()
    _train_step(models[2], 2, 1, s)
    stuck = threading.Thread(target=balancers[2].step_done, args=(1,))
    stuck.start()
    for step in (1, 2, 3):  # the others, without replica 2
        for r in (0, 1):
            _train_step(models[r], r, step, s)
        pair = [threading.Thread(target=balancers[r].step_done, args=(step,)) for r in (0, 1)]
        for t in pair:
            t.start()
        for t in pair:
            t.join(timeout=60)
            assert not t.is_alive()
        assert balancers[0].exchanges[0].stats.last_members == [0, 1]
    assert stuck.is_alive(), "a cut-off replica must wait for the agreed set, not guess it"
    cut.clear()
    stuck.join(timeout=60)
    assert not stuck.is_alive()
    for step in (2, 3):  # it catches up: its records of these steps land late and stay out
        _train_step(models[2], 2, step, s)
        assert balancers[2].step_done(step)
    assert len({bias_digest(m) for m in models}) == 1
    assert balancers[2].exchanges[0].stats.last_members == [0, 1]
    assert balancers[0].stats.missing == 3 and balancers[2].stats.not_published >= 1
    _run_step(models, balancers, s, 4)
    assert len({bias_digest(m) for m in models}) == 1
    assert balancers[0].exchanges[0].stats.last_members == [0, 1, 2]


def test_forged_or_inflated_counts_are_refused(store: ObjectStore) -> None:
    s = spec(replicas=2, quorum=1)
    models, balancers = _replicas(store, s, 2)
    tokens = s.tokens_per_step(1)
    layers = [0, 1]

    def plant(identity: Identity, counts: np.ndarray, step: int) -> None:
        body = RouteCounts(
            run_id=s.run_id,
            group=0,
            step=step,
            replica=1,
            tokens=tokens,
            experts=8,
            layers=layers,
            counts=np.ascontiguousarray(counts, "<u4").tobytes(),
        )
        store.put(keys.route_key(s.run_id, 0, step, 1), seal(identity, body))

    honest = np.full((2, 8), tokens * 2 // 8)
    plant(IDS[3], honest, 0)  # signed by a node that is not replica 1's
    inflated = honest.copy()
    inflated[:, 0] += 10 * tokens  # 10x its tokens on expert 0
    plant(IDS[1], inflated, 1)
    _train_step(models[0], 0, 0, s)
    balancers[0].step_done(0)
    _train_step(models[0], 0, 1, s)
    balancers[0].step_done(1)
    st = balancers[0].exchanges[0].stats
    assert st.rejected == 2 and st.last_members == [0]


def test_a_restarted_replica_replays_its_steps_and_ends_with_the_same_bias(store: ObjectStore) -> None:
    """Replica 1 is rebuilt from its state at step 2 (a checkpoint holds the bias the next step uses) and
    replays steps 2-3 while replica 0 goes on: its records of those steps are already in (its
    predecessor's, write-once), the agreed sets are the ones replica 0 read, and both end alike."""
    s = spec(replicas=2, stats_delay=2)
    models, balancers = _replicas(store, s, 2)
    for step in range(2):
        _run_step(models, balancers, s, step)
    saved = {k: v.clone() for k, v in models[1].state_dict().items()}
    for step in range(2, 4):
        _run_step(models, balancers, s, step)
    balancers[1].close()
    rebuilt = build_full_model(s.model)
    rebuilt.load_state_dict(saved)
    ex = RouteExchange(store, IDS[1], s, group=0, replica=1, signers={r: IDS[r].peer_id for r in range(2)})
    again = Balancer(rebuilt, {0: ex}, rate=s.model.moe.bias_rate, delay=s.model.moe.stats_delay)
    for step in range(2, 4):
        _train_step(rebuilt, 1, step, s)
        assert again.step_done(step)
    assert bias_digest(rebuilt) == bias_digest(models[0]) == bias_digest(models[1])
    again.close()  # its records' puts are done
    assert again.stats.not_published == 2  # its predecessor's records stand
