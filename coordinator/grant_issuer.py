"""Write grants for the placed nodes (issue 21): each node writes only its own keys, each once.

The lease holder's tick calls `GrantIssuer.issue` for a run it leads. For every placed slot whose node
advertises a mail key (NodeAdvert.mail_key: it writes through grants), it signs with the store's full
credential (protocol/net/grants.py `Grantor`), for the node's (run, stage, replica) and the rounds
r .. r + WINDOW - 1 from the node's round r = step // H:

- each fragment's primary key of each round (protocol/keys.py `primary_fragment_key`);
- an MoE run's routing records of each step of those rounds (`route_keys`);
- each checkpointed round's manifest (one PUT) and tensors (one PUT, and a multipart upload when the
  estimate exceeds a part: parts = ceil(1.5 x estimate / part) + 1, the estimate 6 fp32 tensors a
  parameter: weights, anchor, two Adam moments, outer momentum, error feedback);
- the final report.

and seals them to the node (protocol/trust/grant_mail.py) at `keys.grant_mail_key`, write-once. It renews a
slot's grants when the node is within WINDOW / 2 rounds of the window's end, when half their life has
passed, or when the slot's node changed. A successor coordinator knows nothing of its predecessor's mails
and issues afresh from the nodes' rounds (its mails name its term, so the keys never collide); WINDOW
outlasts a failover by far.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from coordinator.managed_run import ManagedRun
from protocol import keys
from protocol.identity import Identity
from protocol.memory import stage_params
from protocol.messages import NodeAdvert
from protocol.net.grants import Grantor, Grants, MultipartGrant
from protocol.net.store import ObjectStore, StoreError
from protocol.runspec import RunSpec
from protocol.trust.grant_mail import write_mail

log = logging.getLogger(__name__)

WINDOW = 32
"""Rounds one mail covers: a coordinator failover (a lease of 15 s, a new placement read from the store)
takes far fewer."""
CKPT_TENSORS_PER_PARAM = 6
CKPT_MARGIN = 1.5


@dataclass(frozen=True)
class _Issued:
    peer: str
    first_round: int
    issued_at: float
    expires_at: float
    seq: int = 0


def checkpoint_parts(spec: RunSpec, stage: int, part_bytes: int, replica: int | None = None) -> int:
    """Parts a stage's checkpoint grant holds: ceil(1.5 x estimated bytes / part_bytes) + 1."""
    estimate = stage_params(spec, stage, replica) * 4 * CKPT_TENSORS_PER_PARAM
    return math.ceil(CKPT_MARGIN * estimate / part_bytes) + 1


def route_keys(spec: RunSpec, replica: int, stage: int, first: int, last: int) -> list[str]:
    """An MoE run's per-step routing records (node/sync/route_exchange.py) of the steps of rounds
    first..last-1, for each of the stage's layer groups holding MoE blocks (none for a dense model)."""
    groups = spec.layer_groups()
    moe = [
        g
        for g in spec.groups_of(replica, stage)
        if any(spec.model.is_moe_layer(i) for i in range(*groups[g]))
    ]
    H, end = spec.sync.H, min(last * spec.sync.H, spec.train.total_steps)
    return [keys.route_key(spec.run_id, g, step, replica) for step in range(first * H, end) for g in moe]


class GrantIssuer:
    """Issues and renews the grants of one coordinator's placed nodes."""

    def __init__(
        self,
        identity: Identity,
        store: ObjectStore,
        *,
        certificate: bytes = b"",
        grantor: Grantor | None = None,
    ) -> None:
        self.identity, self.store, self.certificate = identity, store, certificate
        self._grantor = grantor
        self._issued: dict[tuple[str, int, int], _Issued] = {}
        """(run, replica, stage) -> the last mail this coordinator wrote for the slot."""

    @property
    def expires_s(self) -> int:
        """How long a grant lives (--store-grant-hours)."""
        return int(self.store.cfg.grant_hours * 3600)

    @property
    def part_bytes(self) -> int:
        """The part size the multipart grants are sized for (--store-part-mib)."""
        return self.store.cfg.part_mib << 20

    @property
    def grantor(self) -> Grantor:
        """Made on first use: a coordinator whose nodes all hold full credentials signs nothing."""
        if self._grantor is None:
            self._grantor = Grantor(self.store.cfg)
        return self._grantor

    def issue(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> int:
        """Grants for each placed slot of `run` whose node asks for them and is due; returns mails written."""
        if run.placement is None:
            return 0
        spec, rid = run.record.spec, run.record.spec.run_id
        progress = [a.step // spec.sync.H for a in adverts.values() if a.run_id == rid]
        written = 0
        for (replica, stage), peer in sorted(run.placement.slots.items()):
            advert = adverts.get(peer)
            if advert is None or not advert.mail_key:
                continue
            mine = advert.run_id == rid and (advert.replica, advert.stage) == (replica, stage)
            own = advert.step // spec.sync.H if mine else None
            # a node new to the slot resumes from a checkpoint at most checkpoint_every rounds behind the run
            behind = max(spec.sync.checkpoint_every, 1) + 1
            r = own if own is not None else max(0, min(progress, default=0) - behind)
            prev = self._issued.get((rid, replica, stage))
            now = time.time()
            if prev is not None and prev.peer == peer:
                ends = prev.first_round + WINDOW
                fresh = now < prev.issued_at + (prev.expires_at - prev.issued_at) / 2
                if (r < ends - WINDOW // 2 or ends >= spec.rounds + 1) and fresh:
                    continue
                r = max(r, prev.first_round)  # a renewal before its expiry, from the same round: seq + 1
            seq = prev.seq + 1 if prev is not None and prev.first_round == r else 0
            with_fault = f"run {rid}: grants of replica {replica} stage {stage} for {peer}"
            try:
                written += self._issue(run, spec, replica, stage, advert, r, seq)
                self._issued[(rid, replica, stage)] = _Issued(peer, r, now, now + self.expires_s, seq)
            except (StoreError, ValueError) as e:
                log.warning("%s not issued (tried again next tick): %s", with_fault, e)
        return written

    def _issue(
        self,
        run: ManagedRun,
        spec: RunSpec,
        replica: int,
        stage: int,
        advert: NodeAdvert,
        first: int,
        seq: int,
    ) -> bool:
        rid, term = spec.run_id, run.lease.lease.term
        last = min(first + WINDOW, spec.rounds + 1)  # fragment rounds 0..rounds-1, checkpoints 1..rounds
        every = spec.sync.checkpoint_every
        puts = [  # fragments are keyed by layer group: the stage's groups in the replica's split
            keys.primary_fragment_key(rid, g, f, rnd, replica, advert.peer_id)
            for rnd in range(first, min(last, spec.rounds))
            for g in spec.groups_of(replica, stage)
            for f in range(spec.sync.P)
        ]
        ckpt_rounds = [rnd for rnd in range(max(first, 1), last) if every > 0 and rnd % every == 0]
        puts += [keys.ckpt_manifest_key(rid, rnd=rnd, stage=stage, replica=replica) for rnd in ckpt_rounds]
        puts += [keys.ckpt_tensors_key(rid, rnd=rnd, stage=stage, replica=replica) for rnd in ckpt_rounds]
        puts += route_keys(spec, replica, stage, first, last)
        puts.append(keys.report_key(rid, replica, stage))
        parts = checkpoint_parts(spec, stage, self.part_bytes, replica)
        uploads: list[MultipartGrant] = []
        if parts > 2:  # the estimate exceeds a part: one PUT would do otherwise
            uploads = [
                self.grantor.open_multipart(
                    keys.ckpt_tensors_key(rid, rnd=rnd, stage=stage, replica=replica), parts, self.expires_s
                )
                for rnd in ckpt_rounds
            ]
        grants = Grants(puts=self.grantor.grants(puts, self.expires_s).puts, uploads=tuple(uploads))
        expires_at = min([g.expires_at for g in grants.puts] + [u.expires_at for u in uploads])
        done = write_mail(
            self.store,
            self.identity,
            grants,
            recipient=advert.peer_id,
            recipient_mail_key=advert.mail_key,
            run_id=rid,
            term=term,
            replica=replica,
            stage=stage,
            first_round=first,
            rounds=last - first,
            part_bytes=self.part_bytes,
            expires_at=expires_at,
            certificate=self.certificate,
            seq=seq,
        )
        if done:
            log.info(
                "run %s: granted replica %d stage %d (%s) rounds %d..%d: %d keys, %d multipart uploads",
                rid,
                replica,
                stage,
                advert.peer_id,
                first,
                last - 1,
                len(puts),
                len(uploads),
            )
        else:  # this coordinator wrote the mail of this first round and term already: these go unused
            for u in uploads:
                self.grantor.abort(u)
        return done
