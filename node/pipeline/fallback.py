"""The relayed fallback for pipeline links: libp2p streams through a circuit relay, for nodes nobody can dial.

A node whose pipeline port cannot be reached (NAT, a closed port: node/pipeline/reachability.py says so at join)
still serves its stage. Its upstream neighbour opens a libp2p stream to it through a relay (circuit relay
v2), and the stream carries exactly what a TCP link carries: the same signed Hello first, checked by the
same `Acceptor`, then the same frames through the same `Link`, framing limits and shaper. Each stream is
bridged to a local socket pair (node/pipeline/relay_bridge.py), which also survives the relay's resets.

Design choices:
- The relay is an opt-in role (`crucible-node bootstrap --relay-port`): a p2pd with the relay service on,
  forced publicly reachable. Nodes name it with `--relay MULTIADDR`; `--no-relay` keeps a node direct-only.
  The relay forwards both directions of every relayed link: its operator pays that bandwidth, and placement
  sees a relayed link's lower measured bandwidth in the links' adverts (the link prober measures it through
  the relay).
- Each node runs a fallback p2pd of its own, not the DHT's: one more process (about 30 MB resident) while
  the fallback is on. It listens on no address and reserves a slot on the relay only, so a relayed link's
  stream is always a /p2p-circuit one; the DHT's daemon, reached through whatever connections the DHT made,
  would hand the stream to a direct connection or a hole punch the test could not see. Its libp2p identity
  is a fresh one: the node's own Ed25519 key already names the node in the DHT, and the Hello inside the
  stream is what proves who speaks (libp2p only secures the stream end to end).
- p2pd's relay discovery is off: with it on, autorelay waits for 4 candidate relays or 3 minutes before it
  reserves a slot; with the relay given as static, it reserves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from node.pipeline.relay_bridge import (
    BridgeError,
    BridgeSession,
    Stream,
    open_message,
    read_open,
    read_reply,
    reply_message,
    retrieved_task,
)

log = logging.getLogger(__name__)

PROTOCOL = "/crucible/pipeline/1"
OPEN_TIMEOUT_S = 10.0
"""A stream must state its session within this long."""
MAX_SESSIONS = 64
"""Relayed links a node serves at once (a pipeline stage has one upstream neighbour; probes come and go)."""
MAX_PER_PEER = 4
"""Of them, from one libp2p peer."""
MAX_OPENING = 32
"""Streams still stating their session, at once."""


class FallbackError(ConnectionError):
    """The relayed path could not be set up or used; the message says what to check."""


class _StaticRelayP2P(P2P):
    """hivemind's P2P, with p2pd's relay discovery off (hivemind does not expose the flag)."""

    @staticmethod
    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        return P2P._make_process_args(*args, **kwargs, relayDiscovery=False)


class _RelayServiceP2P(P2P):
    """hivemind's P2P with the relay service's data limit set (hivemind does not expose it). Measured with
    hivemind 1.1.12's p2pd: with an explicit limit the relay resets relayed streams far more often than the
    limit (every ~64 KB under full load), so only tests set one; unset, 12 MB went through with no reset."""

    data_limit = 0

    @classmethod
    def _make_process_args(cls, *args: Any, **kwargs: Any) -> list[str]:
        extra = {"relayDataLimit": cls.data_limit} if cls.data_limit else {}
        return P2P._make_process_args(*args, **kwargs, **extra)


def split_circuit(address: str) -> tuple[Multiaddr, PeerID]:
    """`<relay>/p2p-circuit/p2p/<peer>` -> (the relay's circuit address, the peer); ValueError if not one."""
    relay, sep, peer = address.partition("/p2p-circuit/p2p/")
    if not sep or not relay or not peer or "/" in peer:
        raise ValueError(
            f"{address!r} is not a relayed address (expected RELAY_MULTIADDR/p2p-circuit/p2p/PEER_ID)"
        )
    try:
        return Multiaddr(f"{relay}/p2p-circuit"), PeerID.from_base58(peer)
    except Exception as e:
        raise ValueError(f"{address!r} is not a relayed address: {e}") from e


class AsyncThread:
    """An asyncio loop in a thread of its own, for p2pd clients used from blocking code."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        """Cancel what still runs (bridges, the p2pd client's readers), then end the loop."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(cancel_all(), 5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


class Fallback:
    """This node's end of relayed links: dials neighbours through the relay and, with `accept`, serves
    the streams its upstream neighbours open (each handed to `accept` as a local socket, like a TCP
    connection the pipeline port accepted)."""

    def __init__(
        self,
        relay: str,
        *,
        accept: Callable[[socket.socket, str], None] | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        """relay: the relay's multiaddr (/ip4/HOST/tcp/PORT/p2p/PEER_ID)."""
        m = Multiaddr(relay)
        if "p2p" not in [p.name for p in m.protocols()]:
            raise ValueError(f"--relay {relay!r} must end in /p2p/PEER_ID (the relay prints its address)")
        self.relay, self.accept = str(m), accept
        self.sessions: dict[bytes, BridgeSession] = {}
        self.refused = 0
        self._opening = 0  # streams in _serve that have not stated their session yet
        """Streams refused before a session: a bad opening, a session id of another peer, too many."""
        self._remote: dict[bytes, PeerID] = {}
        self._local_ends: dict[int, BridgeSession] = {}  # fd of the socket handed to `accept` -> its session
        self._loop = AsyncThread("relay-link")
        try:
            self.p2p: P2P = self._loop.run(self._start(startup_timeout_s), 3 * startup_timeout_s + 10)
        except Exception as e:
            self._loop.stop()
            raise FallbackError(
                f"could not start the relayed fallback through {relay}: {e}. Check the --relay address, or "
                "pass --no-relay to stay direct-only"
            ) from e
        self.peer_id = self.p2p.peer_id.to_base58()
        self.address = f"{self.relay}/p2p-circuit/p2p/{self.peer_id}"
        """Where upstream neighbours reach this node through the relay (advertised)."""

    async def _start(self, timeout_s: float) -> P2P:
        """Start the daemon; p2pd exits when it cannot reach the relay at once (a loaded host, a relay
        restarting), so it is tried 3 times."""
        for attempt in range(3):
            try:
                return await self._start_once(timeout_s)
            except Exception as e:
                if attempt == 2:
                    raise
                log.info("relayed fallback: %s; trying again", e)
                await asyncio.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    async def _start_once(self, timeout_s: float) -> P2P:
        p2p = await _StaticRelayP2P.create(
            initial_peers=[self.relay],
            host_maddrs=[],
            no_listen=True,
            use_relay=True,
            use_auto_relay=True,
            trusted_relays=[self.relay],
            force_reachability="private",
            dht_mode="client",
            startup_timeout=timeout_s,
        )
        if self.accept is not None:
            await p2p.add_binary_stream_handler(PROTOCOL, self._serve)
        return p2p

    # --- dialing --------------------------------------------------------------------------------
    def dial(self, address: str, name: str, *, timeout_s: float) -> tuple[socket.socket, BridgeSession]:
        """A local socket carried to the node at `address` (its advertised relayed address), retried until
        timeout_s (the peer may still be reserving its slot), and the session behind it. Only through this
        node's own relay: an advert naming another makes it dial nowhere (ValueError)."""
        circuit, peer = split_circuit(address)
        if str(circuit) != f"{self.relay}/p2p-circuit":
            raise ValueError(f"{address!r} is not reached through this node's relay {self.relay}")
        mine, theirs = socket.socketpair()
        sid = os.urandom(16)

        async def reconnect(recv_total: int, resume: bool = True) -> tuple[Stream, int, str]:
            await self.p2p._client.connect(peer, [circuit])
            info, reader, writer = await self.p2p.call_binary_stream_handler(peer, PROTOCOL)
            try:
                writer.write(open_message(sid, recv_total, resume=resume))
                await writer.drain()
                peer_recv = await asyncio.wait_for(read_reply(reader), OPEN_TIMEOUT_S)
            except BaseException:  # a timeout, a cancellation, GONE: this stream carries nothing
                writer.transport.abort()
                raise
            return (reader, writer), peer_recv, str(info.addr)

        async def first() -> BridgeSession:
            loop = asyncio.get_running_loop()
            deadline, last = loop.time() + timeout_s, None
            while loop.time() < deadline:
                try:
                    stream, peer_recv, addr = await asyncio.wait_for(
                        retrieved_task(reconnect(0, resume=False)), max(0.1, deadline - loop.time())
                    )
                    break
                except Exception as e:  # not reserved yet, the relay restarting, a timeout: try again
                    last = e
                    await asyncio.sleep(0.5)
            else:
                raise FallbackError(
                    f"could not reach {address} through the relay within {timeout_s:.0f} s: {last}"
                )
            session = BridgeSession(theirs, name, reconnect=reconnect, on_close=self._closed)
            self.sessions[sid] = session
            session.attach(stream, peer_recv, addr)
            return session

        try:
            return mine, self._loop.run(first(), timeout_s + 10)
        except Exception as e:
            mine.close()
            theirs.close()
            raise FallbackError(str(e)) from e

    # --- serving --------------------------------------------------------------------------------
    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A stream a peer opened: a new session (handed to `accept`) or a resume of its own. Bounded: at
        most MAX_OPENING streams stating their session at once, MAX_PER_PEER sessions per libp2p peer (its
        identity costs nothing, but a session without a valid hello ends when the acceptor refuses it)."""
        if self._opening >= MAX_OPENING:
            self.refused += 1
            writer.transport.abort()
            return
        self._opening += 1
        try:
            sid, dialer_recv, resume = await asyncio.wait_for(read_open(reader), OPEN_TIMEOUT_S)
            session = self.sessions.get(sid)
            if session is None and resume:  # closed here meanwhile: the dialer must not wait for it
                writer.write(reply_message(0, gone=True))
                await writer.drain()
                writer.transport.abort()
                return
            if session is None:
                reading = await self._new_session(info, sid, dialer_recv, (reader, writer))
            elif self._remote.get(sid) != info.peer_id:
                raise BridgeError("a resume of another peer's session")
            else:
                writer.write(reply_message(session.received()))
                generation = session.generation
                await writer.drain()
                if session.generation != generation:  # a newer resume attached meanwhile
                    raise BridgeError("a resume overtaken by a newer one")
                reading = session.attach((reader, writer), dialer_recv, str(info.addr))
        except (TimeoutError, BridgeError, asyncio.IncompleteReadError, OSError) as e:
            self.refused += 1
            log.warning("refused a relayed stream from %s: %s", info.peer_id, e or type(e).__name__)
            writer.transport.abort()
            return
        finally:
            self._opening -= 1
        if reading is not None:
            with contextlib.suppress(Exception):
                await reading  # the stream stays open while the session reads it

    async def _new_session(
        self, info: Any, sid: bytes, dialer_recv: int, stream: Stream
    ) -> asyncio.Task[None] | None:
        if len(self.sessions) >= MAX_SESSIONS:
            raise BridgeError(f"{MAX_SESSIONS} relayed links already open")
        if sum(1 for p in self._remote.values() if p == info.peer_id) >= MAX_PER_PEER:
            raise BridgeError(f"{MAX_PER_PEER} relayed links already open from this peer")
        mine, theirs = socket.socketpair()
        session = BridgeSession(theirs, f"{info.peer_id.to_base58()[-8:]} (relayed)", on_close=self._closed)
        self.sessions[sid], self._remote[sid] = session, info.peer_id
        stream[1].write(reply_message(0))
        await stream[1].drain()
        reading = session.attach(stream, dialer_recv, str(info.addr))
        assert self.accept is not None
        self._local_ends[mine.fileno()] = session
        self.accept(mine, str(info.addr))
        return reading

    def session_of(self, sock: socket.socket) -> BridgeSession | None:
        """The session behind a socket this fallback handed to `accept`."""
        return self._local_ends.get(sock.fileno())

    def _closed(self, session: BridgeSession) -> None:
        for sid, s in list(self.sessions.items()):
            if s is session:
                del self.sessions[sid]
                self._remote.pop(sid, None)
        for fd, s in list(self._local_ends.items()):
            if s is session:
                del self._local_ends[fd]

    # --- tests and benchmarks -------------------------------------------------------------------
    def cut_all(self) -> int:
        """Reset every session's current stream, as a relay at its limit would; returns how many."""

        async def cut() -> int:
            for s in list(self.sessions.values()):
                s.cut()
            return len(self.sessions)

        return int(self._loop.run(cut(), 10.0))

    def close(self) -> None:
        async def stop() -> None:
            for s in list(self.sessions.values()):
                s.close("the node is shutting down")
            await self.p2p.shutdown()

        with contextlib.suppress(Exception):
            self._loop.run(stop(), 15.0)
        self._loop.stop()


class Relay:
    """The relay role: a publicly reachable p2pd that relays the fallback's circuits.

    hivemind 1.1.12's p2pd runs two circuit relay services: the one its flags configure (p2pd's limits: 4 GiB
    per direction, 30 min), started when the host is public, and one with go-libp2p's default resources
    (`EnableRelayV2`: 128 KiB, 2 min). Whichever registers the hop protocol last serves every circuit, and
    that is decided by a race at start: measured on loopback, about 1 start in 4 gets the configured one;
    the others reset each circuit after ~64 KB, and a relayed link crawls at ~4-5 MB/s through hundreds
    of resumes instead of ~150-185 MB/s (docs/benchmarks.md). So the relay checks itself at start,
    relaying 256 KiB between two fallbacks of its own, and starts its daemon again until a circuit carries
    it without a reset (at most `START_TRIES` starts, ~0.6 s each)."""

    START_TRIES = 40

    def __init__(
        self,
        host: str,
        port: int,
        *,
        announce_host: str | None = None,
        data_limit: int = 0,
        check: bool = True,
    ) -> None:
        """data_limit: reset each relayed connection after this many bytes per direction (0: p2pd's own;
        tests set one to cut links on purpose); check: start again until circuits are not reset."""
        limit_bytes = data_limit

        class _Limited(_RelayServiceP2P):
            data_limit = limit_bytes

        self._loop = AsyncThread("relay")
        announce = [f"/ip4/{announce_host}/tcp/{port}"] if announce_host and port else None

        async def start() -> P2P:
            p2p: P2P = await _Limited.create(
                host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                announce_maddrs=announce,
                force_reachability="public",
                use_relay=True,
                dht_mode="client",
            )
            return p2p

        self.starts = 0
        """Daemon starts it took (the last one serves)."""
        self.resets_per_check: int | None = None
        """Resets the last start's check saw relaying 256 KiB (None: not checked)."""
        for attempt in range(1, self.START_TRIES + 1):
            self.starts = attempt
            self.p2p: P2P = self._loop.run(start(), 40.0)
            self.peer_id = self.p2p.peer_id.to_base58()
            addrs = self._loop.run(self.p2p.get_visible_maddrs(), 10.0)
            self.address = str(addrs[0]) if "/p2p/" in str(addrs[0]) else f"{addrs[0]}/p2p/{self.peer_id}"
            if not check:
                return
            try:
                self.resets_per_check = _resets_relaying(self.address)
            except Exception as e:  # the check's own fallbacks failed: count it as a bad start
                log.debug("relay start %d: its check failed: %s", self.starts, e)
                self.resets_per_check = -1
            if self.resets_per_check == 0 or self.starts == self.START_TRIES:
                break
            log.debug(
                "relay start %d resets circuits (%d in 256 KiB); starting again",
                self.starts,
                self.resets_per_check,
            )
            self._loop.run(self.p2p.shutdown(), 15.0)
        if self.resets_per_check:
            log.warning(
                "relay: in each of %d starts its circuits were reset (%d times in 256 KiB in the last): relayed "
                "links resume through it without loss but run slowly; restart it to try again",
                self.starts,
                self.resets_per_check,
            )
        else:
            log.info("relay: circuits carry 256 KiB without a reset (start %d)", self.starts)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run(self.p2p.shutdown(), 15.0)
        self._loop.stop()


def _resets_relaying(address: str, nbytes: int = 1 << 18) -> int:
    """How often a circuit through the relay at `address` was reset while it carried `nbytes`."""
    got: list[socket.socket] = []
    server, client = Fallback(address, accept=lambda s, a: got.append(s)), Fallback(address)
    try:
        sock, session = client.dial(server.address, "relay self-test", timeout_s=20)
        sender = threading.Thread(target=sock.sendall, args=(bytes(nbytes),), daemon=True)
        sender.start()
        deadline, left = time.monotonic() + 60, nbytes
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        got[0].settimeout(max(0.1, deadline - time.monotonic()))
        while left > 0:
            chunk = got[0].recv(1 << 16)
            if not chunk:
                break
            left -= len(chunk)
        sender.join(5)
        return session.resumes
    finally:
        for s in got:
            s.close()
        client.close()
        server.close()
