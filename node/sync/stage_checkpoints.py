"""Where one stage worker's checkpoints come from and go to (protocol/checkpoint.py holds the format).

The round owner (node/sync/outer_sync.py) decides when a checkpoint is due and what its state is; this class
knows whose checkpoints of this stage a node may resume from (the nodes of this stage in every replica,
now or earlier in the run: a rebuilt replica resumes from its predecessor's), in which order replicas
are tried (this replica's own first), and uploads in the background so training does not wait.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from protocol import keys
from protocol.checkpoint import Checkpoint, CheckpointRefused, read_checkpoint, read_round, write_checkpoint
from protocol.identity import Identity, public_key_of_peer_id
from protocol.messages import Assignment
from protocol.net.store import ObjectStore, StoreError
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)


class StageCheckpoints:
    """Checkpoints of (run, stage) for the replica of `assignment`."""

    def __init__(
        self,
        store: ObjectStore,
        identity: Identity,
        assignment: Assignment,
        should_stop: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store, self.identity, self.a = store, identity, assignment
        self.should_stop = should_stop
        self.peers: set[str] = {identity.peer_id, *assignment.stage_peers.values()}
        for former in assignment.former_stage_peers.values():
            self.peers.update(former)
        self._upload: threading.Thread | None = None

    def trust(self, peers: Iterable[str]) -> None:
        """A slot of this stage got a new node: its checkpoints count from now on (the old ones still do)."""
        self.peers.update(peers)

    def trusted(self) -> set[bytes]:
        """The public keys whose checkpoints of this stage we believe."""
        out = set()
        for p in self.peers:
            with contextlib.suppress(ProtocolError):
                out.add(public_key_of_peer_id(p))
        return out

    def replicas(self) -> list[int]:
        """Replicas tried for a checkpoint: this one first, then the others (a new replica has none)."""
        a = self.a
        return [a.replica, *sorted(int(r) for r in a.stage_peers if int(r) != a.replica)]

    def _log_resume(self, rnd: int, step: int, replica: int) -> None:
        a = self.a
        log.info(
            "run %s r%d/s%d resumes from round %d (step %d) of replica %d",
            a.run_id,
            a.replica,
            a.stage,
            rnd,
            step,
            replica,
        )

    def latest(self) -> Checkpoint | None:
        """The newest valid checkpoint of this stage that every later stage of the same replica also
        wrote (a replica resumes all its stages at one round); refused ones are logged and skipped."""
        a, stages = self.a, self.a.spec.stages
        for replica in self.replicas():
            rnd: int | None = None
            while True:
                ck = read_checkpoint(
                    self.store,
                    run_id=a.run_id,
                    stage=a.stage,
                    replica=replica,
                    round=rnd,
                    trusted=self.trusted(),
                )
                if ck is None:
                    break
                if all(
                    self.store.head(keys.ckpt_manifest_key(a.run_id, rnd=ck.round, stage=s, replica=replica))
                    for s in range(a.stage + 1, stages)
                ):
                    self._log_resume(ck.round, ck.step, replica)
                    return ck
                log.info("round %d is not checkpointed by every stage; trying an earlier one", ck.round)
                if ck.round == 0:
                    break
                rnd = ck.round - 1
        return None

    def at_step(self, step: int, wait_s: float = 120.0) -> Checkpoint:
        """The checkpoint of the round that ends at `step` (the first stage chose it), from the first
        replica that has a valid one; waits for one still being written."""
        a = self.a
        rnd = a.spec.sync.schedule().round_at(step)
        deadline = time.monotonic() + wait_s
        while True:
            for replica in self.replicas():
                try:
                    ck = read_round(
                        self.store,
                        run_id=a.run_id,
                        stage=a.stage,
                        replica=replica,
                        round=rnd,
                        trusted=self.trusted(),
                    )
                except CheckpointRefused as e:
                    log.warning("checkpoint of round %d, replica %d: %s", rnd, replica, e)
                    continue
                self._log_resume(rnd, step, replica)
                return ck
            if time.monotonic() > deadline or self.should_stop():
                raise RuntimeError(
                    f"no valid checkpoint of round {rnd} (step {step}) for stage {a.stage} after "
                    f"{wait_s:.0f} s; cannot resume"
                )
            time.sleep(0.5)

    def write(self, tensors: dict[str, torch.Tensor], *, step: int, rnd: int) -> None:
        """Snapshot `tensors` to the CPU now (training goes on) and upload them on a background thread;
        the previous upload is waited for first. A failed upload is logged: the next round's tries again."""
        self.join()
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        a = self.a

        def upload() -> None:
            try:
                write_checkpoint(
                    self.store,
                    self.identity,
                    run_id=a.run_id,
                    stage=a.stage,
                    replica=a.replica,
                    round=rnd,
                    step=step,
                    tensors=snapshot,
                    meta={"data_seed": a.spec.train.data_seed, "data_step": step},
                )
            except (StoreError, ValueError, OSError) as e:
                log.warning("checkpoint of round %d not written: %s", rnd, e)

        self._upload = threading.Thread(target=upload, name="checkpoint", daemon=True)
        self._upload.start()

    def join(self) -> None:
        """Wait for the upload in flight, if any."""
        if self._upload is not None:
            self._upload.join()
            self._upload = None
