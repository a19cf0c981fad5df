from __future__ import annotations

import os

import pytest

# Swarm children inherit this: one torch thread each, so 4 nodes share 2 cores without oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def moto_store():
    """A real S3-protocol server (moto) on loopback for the whole session; yields its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    # its per-request lines would land in whatever stderr a test captures, at any root level left behind
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """The codecs are measured per core; small tensors are also faster without thread handoffs."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
