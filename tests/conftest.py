from __future__ import annotations

import os

import pytest

# Swarm children inherit this: one torch thread each, so 4 nodes share 2 cores without oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def moto_store():
    """A real S3-protocol server (moto) on loopback for the whole session; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
