"""The store client's credentials (issue 10, finding 6: boto3's credential chain when no key is given)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.net.store import ObjectStore, StoreConfig, StoreError

REMOTE = "https://account.r2.cloudflarestorage.com"


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No credentials anywhere: no AWS_* variables, empty config and credentials files, no metadata lookup."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


def _access_key(store: ObjectStore) -> str:
    creds = store.client._request_signer._credentials  # what boto3 will sign requests with
    return str(creds.get_frozen_credentials().access_key)


def test_keys_in_the_config_win(no_aws_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    store = ObjectStore(StoreConfig(endpoint_url=REMOTE, access_key="from-config", secret_key="s"))
    assert store.credential_source == "config" and _access_key(store) == "from-config"


def test_without_keys_boto3_s_chain_finds_a_profile(
    no_aws_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Used to sign with a placeholder ("crucible") whatever the host's AWS setup said."""
    creds = no_aws_env / "credentials"
    creds.write_text("[r2]\naws_access_key_id = from-profile\naws_secret_access_key = profile-secret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "r2")
    store = ObjectStore(StoreConfig(endpoint_url=REMOTE))
    assert store.credential_source == "shared-credentials-file"
    assert _access_key(store) == "from-profile"


def test_without_keys_boto3_s_chain_reads_the_environment(
    no_aws_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    store = ObjectStore(StoreConfig(endpoint_url=REMOTE))
    assert store.credential_source == "env" and _access_key(store) == "from-env"


def test_a_remote_store_without_credentials_is_refused_by_name(no_aws_env: Path) -> None:
    with pytest.raises(StoreError, match="no credentials for the object store .*AWS_ACCESS_KEY_ID"):
        ObjectStore(StoreConfig(endpoint_url=REMOTE))
    with pytest.raises(StoreError, match="both access_key and secret_key"):
        ObjectStore(StoreConfig(endpoint_url=REMOTE, access_key="only-half"))


def test_a_store_on_this_host_takes_a_placeholder(no_aws_env: Path) -> None:
    """The embedded store accepts any key: the local swarm needs no AWS setup."""
    store = ObjectStore(StoreConfig(endpoint_url="http://127.0.0.1:9000"))
    assert store.credential_source == "loopback placeholder" and _access_key(store) == "crucible"


def test_an_overloaded_store_is_told_apart_from_a_refused_request(moto_store: str) -> None:
    """Issue 26: through boto3's retries, a store that answers 503 SlowDown to everything raises
    StoreUnavailable (a passing outage: callers retry and log no traceback); a request the store refuses
    (read-only keys writing) raises a plain StoreError."""
    from protocol.net.store import StoreUnavailable
    from scripts.fault_proxy import FaultProxy
    from scripts.store_front import READ_ONLY_KEY

    proxy = FaultProxy(moto_store)
    try:
        proxy.rule = lambda method, path: "503"
        store = ObjectStore(StoreConfig(endpoint_url=proxy.url, bucket="crucible"))
        with pytest.raises(StoreUnavailable, match="overloaded or unreachable"):
            store.get("any/key")
        assert proxy.actions["503"] >= 3  # boto3 retried (standard mode: 3 attempts a call)
        proxy.rule = lambda method, path: "pass"
        ro = ObjectStore(
            StoreConfig(
                endpoint_url=proxy.url,
                bucket="crucible",
                access_key=READ_ONLY_KEY[0],
                secret_key=READ_ONLY_KEY[1],
            )
        )
        with pytest.raises(StoreError) as refused:
            ro.put("any/key", b"x")
        assert not isinstance(refused.value, StoreUnavailable), refused.value
    finally:
        proxy.close()
