"""Which links a node measures, and when: a few peers at a time, only while it is not training.

A probe sends `probe_bytes` over the pipeline port (node/pipeline/link_probe.py); while a stage trains that
would steal its pipeline's bandwidth, so probing waits for an idle node. Each round takes the `peers` least
recently measured nodes of the swarm (never a flood), and the newest `ADVERTISED_PEERS` measures go into the
node's advert, where placement reads each link's bandwidth and RTT.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from node.config import ADVERTISED_PEERS
from node.pipeline.link_probe import LinkMeasure, ProbeError, probe_peer
from node.pipeline.transport import Shaper
from protocol import keys
from protocol.identity import Identity
from protocol.messages import NodeAdvert

if TYPE_CHECKING:
    from protocol.net.dht_client import DHTClient

log = logging.getLogger(__name__)


class LinkProber:
    """Measures bandwidth and RTT to other nodes in a thread of its own, until `stop` is set."""

    def __init__(
        self,
        identity: Identity,
        dht: DHTClient,
        shaper: Shaper,
        *,
        every_s: float,
        peers: int,
        nbytes: int,
        busy: Callable[[], bool],
        measured: Callable[[], None],
        stop: threading.Event,
        relayed: Callable[[NodeAdvert], socket.socket | None] = lambda a: None,
    ) -> None:
        """busy: whether the node trains now (no probes then); measured: called after each round; relayed: a
        connection through the relay to a peer that cannot be dialed (None: dial it directly)."""
        self.relayed = relayed
        self.identity, self.dht, self.shaper = identity, dht, shaper
        self.every_s, self.peers, self.nbytes = every_s, peers, nbytes
        self.busy, self.measured, self.stop = busy, measured, stop
        self.links: dict[str, LinkMeasure] = {}
        """peer id -> the latest measure of the link to it."""
        self._thread = threading.Thread(target=self._loop, name="link-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def advertised(self) -> list[tuple[str, LinkMeasure]]:
        """The links the advert carries: the most recently measured."""
        newest = sorted(self.links.items(), key=lambda kv: -kv[1].at)
        return newest[:ADVERTISED_PEERS]

    def _loop(self) -> None:
        while not self.stop.wait(1.0 if not self.links else self.every_s):
            if self.busy() or not self.peers:
                continue
            try:
                nodes = self.dht.get_all(keys.NODES_KEY, NodeAdvert)
            except Exception as e:
                log.debug("no node list to probe from: %s", e)
                continue
            me = self.identity.peer_id
            others = [
                s.body for s in nodes.values() if s.body.peer_id != me and s.body.peer_id == s.signer_id
            ]
            others.sort(key=lambda a: self.links[a.peer_id].at if a.peer_id in self.links else -1.0)
            for a in others[: self.peers]:
                try:
                    self.links[a.peer_id] = probe_peer(
                        self.identity,
                        a.peer_id,
                        a.host,
                        a.port,
                        nbytes=self.nbytes,
                        shaper=self.shaper,
                        sock=self.relayed(a),  # a relayed link's bandwidth is what placement must see
                    )
                except (ProbeError, ValueError, OSError) as e:
                    log.info("%s", e)
            self.measured()
