"""Fragment polling costs GETs, not LISTs (issue 14): OuterSync against a real S3 server (moto), every S3
call counted on the store client's own botocore events (a hook on the real client, not a mock).

R2 bills a LIST as a class A operation (about 12x a GET). Waiting for the other replicas used to LIST the
round every 0.1 s; now it GETs each missing slot's primary fragment key, with exponential backoff, and
lists the round when the store-derived rule can settle it (node/sync/round_rule.py; plus while a primary
key is squatted).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from node.sync.outer_sync import FragmentId, OuterSync
from protocol import keys
from protocol.net.store import ObjectStore, StoreConfig
from tests.helpers.fragment_faults import corrupt, valid_blob
from tests.test_sparseloco_sync import CFG, IDS, SHAPES, assert_same_anchors, lockstep, make_replicas

pytestmark = pytest.mark.timeout(60)

BUCKET = "fragment-polling"


class Requests:
    """Every S3 call one store client made, as (operation, key or prefix, HTTP status)."""

    def __init__(self, store: ObjectStore) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        events = store.client.meta.events
        events.register("before-parameter-build.s3", self._params)
        events.register("after-call.s3", self._done)

    def _params(self, params: dict, context: dict, **_: object) -> None:
        context["polling_test_key"] = params.get("Key") or params.get("Prefix", "")

    def _done(self, http_response, model, context: dict, **_: object) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self.calls.append((model.name, context.get("polling_test_key", ""), http_response.status_code))

    def count(self, op: str, *, key_suffix: str = "", status: int | None = None) -> int:
        with self._lock:
            return sum(
                1
                for o, k, s in self.calls
                if o == op and k.endswith(key_suffix) and (status is None or s == status)
            )


def counted_stores(moto_store: str, n: int) -> tuple[list[ObjectStore], list[Requests]]:
    stores = [ObjectStore(StoreConfig(endpoint_url=moto_store, bucket=BUCKET)) for _ in range(n)]
    stores[0].ensure_bucket()
    return stores, [Requests(s) for s in stores]


@pytest.fixture
def closer() -> Iterator[list[OuterSync]]:
    opened: list[OuterSync] = []
    yield opened
    for s in opened:
        s._io.shutdown(wait=True, cancel_futures=True)


def test_a_late_fragment_is_found_by_gets_and_the_round_is_listed_once(
    moto_store: str, closer: list[OuterSync]
) -> None:
    """Replicas 0 and 1 wait for replica 2, whose fragment lands 1.5 s late, and for replica 3, which never
    comes (W = 5 s after the quorum's arrival). With the production poll (0.1 s doubling to 1 s) each
    replica polls replica 3's primary key about once a second and LISTs the round once or twice, to settle
    it (the old code: ~50 LISTs in those 5 s); the late fragment is still used by all three, whose anchors
    are bit-identical; no fragment accepted is fetched twice."""
    H, late_s, timeout_s = 2, 1.5, 5.0
    stores, seen = counted_stores(moto_store, 3)
    _, syncs = make_replicas(stores[0], SHAPES, R=3, H=H, expected=4, stores=stores)
    closer.extend(syncs)
    for s in syncs:
        s.exchange.timeout_s, s.exchange.poll_s, s.exchange.poll_max_s = timeout_s, 0.1, 1.0

    def late() -> None:
        time.sleep(late_s)
        for _ in lockstep(syncs[2:], range(1, H + 1)):
            pass

    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(late)
        for _ in lockstep(syncs[:2], range(1, H + 1)):
            pass
        done.result(timeout=30)
    elapsed = time.monotonic() - t0
    assert [s.stats.last_contributors for s in syncs] == [[0, 1, 2]] * 3
    assert [s.stats.missing for s in syncs] == [1, 1, 1]  # replica 3
    assert_same_anchors(syncs)
    missing = keys.primary_fragment_key(syncs[0].run_id, 0, 0, 0, 3, IDS[3].peer_id)
    for r, req in enumerate(seen):
        assert 1 <= req.count("ListObjectsV2") <= 2, (r, req.calls)
        fragments = Counter(k for o, k, s in req.calls if o == "GetObject" and s == 200)
        assert all(n == 1 for n in fragments.values()), (r, fragments)
    for r in (0, 1):  # waited the whole deadline: polled about once a second
        polls = seen[r].count("GetObject", key_suffix=missing)
        assert 5 <= polls <= 2 * elapsed + 2, (r, polls, elapsed)


def test_a_squatted_primary_key_sends_the_fragment_to_its_hash_key(
    moto_store: str, closer: list[OuterSync]
) -> None:
    """The primary key is predictable, so anyone with store credentials can take it first. Here it holds a
    fragment signed by a stranger: replica 1 rejects it and writes its own at the key naming its hash;
    replica 0 rejects it once and lists the round until it finds that key; the round uses both and the
    anchors are bit-identical."""
    H = 2
    stores, seen = counted_stores(moto_store, 2)
    run_id, syncs = make_replicas(stores[0], SHAPES, R=2, H=H, stores=stores)
    closer.extend(syncs)
    primary = keys.primary_fragment_key(run_id, 0, 0, 0, 1, IDS[1].peer_id)
    stores[0].put(primary, corrupt("untrusted-signer", IDS[1], FragmentId(run_id, 0, 0, 0, 1), SHAPES, CFG))
    for _ in lockstep(syncs, range(1, H + 1)):
        pass
    assert [s.stats.last_contributors for s in syncs] == [[0, 1], [0, 1]]
    assert [(s.stats.rejected, s.stats.not_uploaded) for s in syncs] == [(1, 0), (1, 0)]
    assert_same_anchors(syncs)
    slot = sorted(stores[0].list(keys.slot_prefix(run_id, 0, 0, 0, 1)))
    prefix = keys.sync_prefix(run_id, 0, 0, 0)
    assert [keys.parse_sync_key(prefix, k) is not None for k in slot] == [True, True]
    assert slot[1] == primary and slot[0].rsplit("/", 1)[1] != keys.PRIMARY_NAME
    assert seen[1].count("ListObjectsV2") <= 2  # to settle the round (a second if the first was early)
    assert seen[0].count("GetObject", key_suffix=primary, status=200) == 1  # rejected once, not read again


def test_our_valid_fragment_already_at_our_primary_key_is_used(
    moto_store: str, closer: list[OuterSync]
) -> None:
    """A node replaying a round after a restart finds its earlier, validly signed upload at its primary
    key: both replicas use those bytes, it uploads no second fragment, the anchors are identical."""
    H = 2
    stores, _ = counted_stores(moto_store, 2)
    run_id, syncs = make_replicas(stores[0], SHAPES, R=2, H=H, stores=stores)
    closer.extend(syncs)
    earlier = valid_blob(IDS[1], FragmentId(run_id, 0, 0, 0, 1), SHAPES, CFG)[0]
    stores[0].put(keys.primary_fragment_key(run_id, 0, 0, 0, 1, IDS[1].peer_id), earlier)
    for _ in lockstep(syncs, range(1, H + 1)):
        pass
    assert [s.stats.last_contributors for s in syncs] == [[0, 1], [0, 1]]
    assert syncs[1].stats.not_uploaded == 1 and syncs[0].stats.rejected == syncs[1].stats.rejected == 0
    assert len(stores[0].list(keys.slot_prefix(run_id, 0, 0, 0, 1))) == 1
    assert_same_anchors(syncs)
