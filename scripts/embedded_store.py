"""The embedded default object store: moto's S3 server on loopback (a real S3 protocol server), started
only here: by crucible-swarm (this module as a child), the tests' `moto_store` fixture and the benches.

  python -m scripts.embedded_store [--host 127.0.0.1] [--port 0] [--bucket crucible] [--front]
prints `STORE http://HOST:PORT` once it serves, and runs until SIGINT/SIGTERM. With `front` (--front) the
store is served through scripts/store_front.py, which checks signatures, presigned URLs' expiry and keys,
and the read-only key pair as R2 does (moto itself checks none of these).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator

from protocol.net.store import ObjectStore, StoreConfig
from scripts.store_front import FULL_KEY, READ_ONLY_KEY, store_front


@contextlib.contextmanager
def s3_server(host: str = "127.0.0.1", port: int = 0, *, front: bool = False) -> Iterator[str]:
    """moto's S3 server on `host`:`port` (0: any free port) for the `with` block; yields its endpoint URL.
    front: moto on a loopback port of its own behind a StoreFront on `host`:`port`, whose URL is yielded."""
    if front:
        with s3_server() as upstream, store_front(upstream, host=host, port=port) as f:
            yield f.url
        return
    # werkzeug logs a line per request, into whatever stderr a test, a bench or the swarm's log captures
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer  # the `swarm` extra: imported only where a store is served

    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    try:
        h, p = server.get_host_and_port()
        yield f"http://{h}:{p}"
    finally:
        server.stop()


@contextlib.contextmanager
def embedded_store(
    bucket: str, host: str = "127.0.0.1", port: int = 0, *, front: bool = False
) -> Iterator[ObjectStore]:
    """An S3 server (moto) on loopback for the `with` block, and a client of `bucket` on it (created).
    front: served through scripts/store_front.py (see s3_server)."""
    with s3_server(host, port, front=front) as url:
        # moto takes any key: the placeholder, so that a --host other than loopback needs no credentials
        # (the front takes it as its full credential)
        store = ObjectStore(
            StoreConfig(endpoint_url=url, bucket=bucket, access_key="crucible", secret_key="crucible")
        )
        store.ensure_bucket()
        yield store


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run an S3-compatible object store on loopback (moto server).")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument(
        "--port",
        type=int,
        default=0,
        help="port (default: any free port; a fixed one below 32768, e.g. 9000: Linux picks the ports of "
        "outgoing connections from 32768-60999, so one there may be taken when the store restarts)",
    )
    ap.add_argument("--bucket", default="crucible", help="bucket to create (default: crucible)")
    ap.add_argument(
        "--front",
        action="store_true",
        help="check requests as R2 does (scripts/store_front.py): SigV4 signatures, presigned URLs' expiry "
        f"and keys; full key pair {'/'.join(FULL_KEY)}, read-only {'/'.join(READ_ONLY_KEY)}",
    )
    args = ap.parse_args(argv)
    with embedded_store(args.bucket, args.host, args.port, front=args.front) as store:
        print(f"STORE {store.cfg.endpoint_url}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
