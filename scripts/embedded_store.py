"""The embedded default object store: moto's S3 server on loopback (a real S3 protocol server).

  python -m scripts.embedded_store [--host 127.0.0.1] [--port 0] [--bucket crucible]
prints `STORE http://HOST:PORT` once it serves, and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import boto3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run an S3-compatible object store on loopback (moto server).")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port (default: any free port)")
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
