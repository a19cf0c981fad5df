"""Can other nodes dial this node's pipeline port? Asked of a few peers at join, answered by dialing back.

A node asks up to `peers` other nodes, over their DHT daemons' libp2p connections (which work whatever
the NAT: the node dialed out), to dial its pipeline port. A peer dials only the IP address it sees the
request come from, at the port requested, and only with a signed bandwidth probe addressed to the asker
(node/pipeline/link_probe.py, 1 KiB): nobody can aim peers at a third party, and the asker's acceptor
authenticates the dial like any other. A peer answers one request per asker per `PER_PEER_S` and
`PER_MINUTE` in all. Like Petals, the node counts itself reachable when at least half of the peers that
answered reached it; with no answer (the first node of a swarm) it asks again soon, and with one every
RECHECK_KNOWN_S, other peers at random each time.

An unreachable node logs what to open or forward, and falls back to relayed links (node/pipeline/
fallback.py) when it has a relay: its advert then carries its relayed address, which placement puts in its
upstream neighbour's assignment. Without one, placement gives it only a replica's first stage
(coordinator/placement.py `dialable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from hivemind.p2p import P2P, PeerID

from node.pipeline.fallback import AsyncThread, Fallback, FallbackError
from node.pipeline.link_probe import ProbeError, probe_peer
from protocol import keys
from protocol.identity import Identity
from protocol.messages import NodeAdvert

if TYPE_CHECKING:
    from node.config import NodeConfig
    from node.pipeline.acceptor import Acceptor
    from protocol.net.dht_client import DHTClient

log = logging.getLogger(__name__)

PROTOCOL = "/crucible/dialback/1"
PROBE_BYTES = 1024
DIAL_TIMEOUT_S = 5.0
PER_PEER_S = 30.0
PER_MINUTE = 20
ASK_ALL_S = 30.0
"""The whole check waits this long for answers at most (a node's start waits for it)."""
RECHECK_S = 5.0
"""How soon a node with no verdict yet (no peer answered) asks again."""
RECHECK_KNOWN_S = 600.0
"""How often a node with a verdict asks again (a NAT or firewall changed; one busy answer is not final)."""
RECHECK_UNREACHABLE_S = 60.0
"""How soon a node found unreachable asks again, doubling each time up to RECHECK_KNOWN_S: placement keeps
it off the stages that are dialed, so a wrong verdict (peers' probes timed out on a loaded host) must not
last ten minutes."""
REACHED, NOT_REACHED, REFUSED = b"\x01", b"\x00", b"\x02"
_PORT = struct.Struct(">H")


def observed_ip(addr: str) -> str | None:
    """The IP of a libp2p connection's remote multiaddr (/ip4/X/tcp/P...), None when relayed or not IP."""
    parts = addr.split("/")
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    return parts[2]


class DialbackServer:
    """Answers other nodes' dial-back requests (module docstring), within its rate limits."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._last: dict[str, float] = {}
        self._recent: deque[float] = deque()
        self.served = 0
        self.refused = 0

    def _allowed(self, peer: str, now: float) -> bool:
        while self._recent and self._recent[0] < now - 60.0:
            self._recent.popleft()
        if now - self._last.get(peer, -PER_PEER_S) < PER_PEER_S or len(self._recent) >= PER_MINUTE:
            return False
        if len(self._last) > 4096:
            self._last.clear()
        self._last[peer] = now
        self._recent.append(now)
        return True

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            (port,) = _PORT.unpack(await asyncio.wait_for(reader.readexactly(_PORT.size), 5.0))
            ip = observed_ip(str(info.addr))
            if ip is None or port == 0 or not self._allowed(peer, time.monotonic()):
                self.refused += 1
                writer.write(REFUSED)
            else:
                ok = await asyncio.get_running_loop().run_in_executor(None, self._dial, peer, ip, port)
                self.served += 1
                writer.write(REACHED if ok else NOT_REACHED)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _dial(self, peer: str, ip: str, port: int) -> bool:
        for attempt in range(2):  # the asker's port serves 2 probes at once: another's may hold it
            try:
                probe_peer(self.identity, peer, ip, port, nbytes=PROBE_BYTES, timeout_s=DIAL_TIMEOUT_S)
                return True
            except ProbeError as e:
                if attempt or not isinstance(e.__cause__, ProbeError):  # refused, not merely busy
                    return False
                time.sleep(0.5)
            except ValueError:
                return False
        return False


def recheck_s(reachable: bool | None, unreachable: int) -> float:
    """The wait before the next check: RECHECK_S without a verdict; RECHECK_UNREACHABLE_S, doubling after
    each of `unreachable` "not reachable" verdicts in a row past the first, while not reachable;
    RECHECK_KNOWN_S once reachable (or once the doubling reaches it)."""
    if reachable is None:
        return RECHECK_S
    if reachable is False:
        return min(RECHECK_KNOWN_S, RECHECK_UNREACHABLE_S * 2 ** max(unreachable - 1, 0))
    return RECHECK_KNOWN_S


class Reachability:
    """This node's reachability verdict, its dial-back service, and its relayed fallback (if any)."""

    def __init__(self, cfg: NodeConfig, identity: Identity, dht: DHTClient, acceptor: Acceptor) -> None:
        self.cfg, self.identity, self.dht, self.acceptor = cfg, identity, dht, acceptor
        self.port = cfg.announce_port or acceptor.port
        self.endpoint = f"{cfg.announce_host or cfg.host}:{self.port}"
        self.reachable: bool | None = None
        """None until a peer answered; placement treats unknown as reachable."""
        self.reached_by = self.asked = 0
        self.server = DialbackServer(identity)
        self._loop = AsyncThread("dialback")
        self._p2p: P2P = self._loop.run(self._serve(), 30.0)
        self.fallback: Fallback | None = None
        if cfg.relay and cfg.use_relay:  # dials neighbours through the relay, and serves relayed links
            try:
                self.fallback = Fallback(cfg.relay, accept=acceptor.adopt)
            except FallbackError as e:  # a relay that is down must not keep a reachable node from serving
                log.warning("%s; this node goes on with direct links only", e)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def _serve(self) -> P2P:
        p2p: P2P = await self.dht.dht.replicate_p2p()  # the DHT's daemon: peers are connected there already
        await p2p.add_binary_stream_handler(PROTOCOL, self.server.handle)
        return p2p

    @property
    def relay_addr(self) -> str:
        return self.fallback.address if self.fallback is not None else ""

    def check(self) -> bool | None:
        """Ask up to `reachability_peers` other nodes to dial back; sets and returns the verdict."""
        if self.cfg.reachability_peers == 0:
            self.reachable = True
            return True
        try:
            nodes = self.dht.get_all(keys.NODES_KEY, NodeAdvert)
        except Exception as e:
            log.debug("reachability: no node list yet: %s", e)
            return self.reachable
        me = self.identity.peer_id
        peers = [s.body.peer_id for s in nodes.values() if s.body.peer_id == s.signer_id != me]
        peers = random.sample(peers, min(len(peers), self.cfg.reachability_peers))  # not whoever lists first
        if not peers:
            return self.reachable
        try:
            answers = self._loop.run(self._ask_all(peers), ASK_ALL_S + 10.0)
        except Exception as e:  # the loop stopped (shutdown): no verdict this time
            log.debug("reachability: no answers: %s", e)
            return self.reachable
        answered = [a for a in answers if a in (REACHED, NOT_REACHED)]
        if not answered:
            return self.reachable
        self.asked, self.reached_by = len(answered), answered.count(REACHED)
        self.reachable = 2 * self.reached_by >= self.asked
        self._log_verdict()
        return self.reachable

    async def _ask_all(self, peers: list[str]) -> list[bytes]:
        """The answers that came within ASK_ALL_S (a peer that never answers costs the wait, no more)."""
        two = asyncio.Semaphore(2)  # this node's port answers 2 probes at once (Acceptor.max_probes)

        async def ask(peer: str) -> bytes:
            async with two:
                return await self._ask(peer)

        tasks = [asyncio.create_task(ask(p)) for p in peers]
        done, pending = await asyncio.wait(tasks, timeout=ASK_ALL_S)
        for t in pending:
            t.cancel()
        return [t.result() for t in done if not t.cancelled() and t.exception() is None]

    async def _ask(self, peer: str) -> bytes:
        try:
            _, reader, writer = await asyncio.wait_for(
                self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL), 5.0
            )
            try:
                writer.write(_PORT.pack(self.port))
                await writer.drain()
                return await asyncio.wait_for(reader.readexactly(1), DIAL_TIMEOUT_S + 10.0)
            finally:
                writer.close()
        except Exception as e:  # unreachable peer, an old node without the protocol, a timeout
            log.debug("reachability: %s did not answer: %s", peer[-8:], e)
            return b""

    def _log_verdict(self) -> None:
        seen = f"{self.reached_by} of {self.asked} peers"
        if self.reachable:
            log.info("reachability: %s reached pipeline port %s: reachable", seen, self.endpoint)
            return
        log.warning(
            "reachability: %s reached pipeline port %s: NOT reachable. Open TCP port %d to this host in its "
            "firewall or forward it on the NAT, or pass --announce-host/--announce-port with the address and "
            "port the NAT maps to --port %d",
            seen,
            self.endpoint,
            self.port,
            self.acceptor.port,
        )
        if self.fallback is not None:
            log.warning(
                "reachability: falling back to relayed pipeline links: upstream neighbours reach this node "
                "through the relay at %s",
                self.relay_addr,
            )
        else:
            log.warning(
                "reachability: no relay (--relay MULTIADDR, without --no-relay): placement gives this node "
                "only a replica's first stage, which dials its neighbour and is never dialed"
            )

    def start(self, changed: Any) -> None:
        """Ask again every RECHECK_S until some peer answers, then every RECHECK_KNOWN_S, sooner while not
        reachable (`recheck_s`; other peers at random each time, so a few hostile or busy answers do not
        decide for good); `changed()` when it changes."""

        def loop() -> None:
            unreachable = 0  # verdicts "not reachable" in a row
            while not self._stop.wait(recheck_s(self.reachable, unreachable)):
                before = self.reachable
                try:
                    self.check()
                except Exception as e:  # the DHT briefly away: ask again next time
                    log.debug("reachability: check failed: %s", e)
                unreachable = unreachable + 1 if self.reachable is False else 0
                if self.reachable != before:
                    changed()

        self._thread = threading.Thread(target=loop, name="reachability", daemon=True)
        self._thread.start()

    def status(self) -> dict[str, object]:
        return {
            "reachable": self.reachable,
            "reached_by": f"{self.reached_by}/{self.asked}",
            "relay": self.relay_addr,
            "dialbacks_served": self.server.served,
            "dialbacks_refused": self.server.refused,
        }

    def close(self) -> None:
        self._stop.set()
        if self.fallback is not None:
            self.fallback.close()
        with contextlib.suppress(Exception):
            self._loop.run(self._p2p.remove_binary_stream_handler(PROTOCOL), 5.0)
        self._loop.stop()


def socket_for(fallback: Fallback | None, advert: NodeAdvert) -> socket.socket | None:
    """A relayed connection to an unreachable peer for a bandwidth probe; None when it is reachable."""
    if advert.reachable or not advert.relay_addr or fallback is None:
        return None
    sock, _ = fallback.dial(advert.relay_addr, f"{advert.peer_id[-8:]} (probe)", timeout_s=5.0)
    return sock
