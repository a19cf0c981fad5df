"""The embedded default object store: moto's S3 server on loopback (a real S3 protocol server).

  python -m scripts.embedded_store [--host 127.0.0.1] [--port 0] [--bucket crucible]
prints `STORE http://HOST:PORT` once it serves, and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator

import boto3

from protocol.net.store import ObjectStore, StoreConfig


@contextlib.contextmanager
def embedded_store(bucket: str, host: str = "127.0.0.1") -> Iterator[ObjectStore]:
    """An S3 server (moto) on loopback for the `with` block, and a client of a fresh bucket on it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer  # the `swarm` extra: imported only where a store is served

    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    try:
        h, port = server.get_host_and_port()
        store = ObjectStore(StoreConfig(endpoint_url=f"http://{h}:{port}", bucket=bucket))
        store.ensure_bucket()
        yield store
    finally:
        server.stop()


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
    args = ap.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id="crucible",
        aws_secret_access_key="crucible",
        region_name="us-east-1",
    ).create_bucket(Bucket=args.bucket)
    print(f"STORE {url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
