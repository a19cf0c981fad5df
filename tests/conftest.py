from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Swarm children inherit this: one torch thread each, so 4 nodes share 2 cores without oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def moto_store() -> Iterator[str]:
    """A real S3-protocol server (moto) on loopback for the whole session, behind the store front that checks
    signatures, presigned URLs' expiry and keys as R2 does (scripts/store_front.py); yields its URL."""
    from scripts.embedded_store import s3_server

    with s3_server(front=True) as url:
        yield url


@pytest.fixture(scope="module")
def one_torch_thread():
    """The codecs are measured per core; small tensors are also faster without thread handoffs."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
