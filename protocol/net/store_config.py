"""The object store's settings, declared once (protocol/process/settings.py): a node's [store] section and
`crucible-node join`'s --store-* flags, and the --store-* flags of `crucible-coordinator serve` (and of the
commands that take them too) all derive from `StoreConfig`'s fields.

Apart from protocol/net/store.py, which imports boto3 (a second): both CLIs check these values first.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.process.settings import check_fields, in_range, matching, not_empty, setting, url

BUCKET_PATTERN = r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
"""S3 bucket names (as MinIO and R2 apply them too): 3-63 lowercase letters, digits, dots and dashes."""


@dataclass(kw_only=True, frozen=True)
class StoreConfig:
    """Where the run's objects live."""

    endpoint_url: str = setting(
        "",
        "S3-compatible endpoint URL the runs sync through; checked at start: it must answer",
        example="https://ACCOUNT.r2.cloudflarestorage.com",
        flag="--store-endpoint",
        metavar="URL",
        required=True,
        check=url,
    )
    """S3 endpoint, e.g. https://<account>.r2.cloudflarestorage.com or http://127.0.0.1:9000."""
    bucket: str = setting(
        "crucible",
        "bucket name",
        flag="--store-bucket",
        check=matching(BUCKET_PATTERN, "not a bucket name (3-63 lowercase letters, digits, dots or dashes)"),
    )
    """Bucket holding every run (each under its own prefix)."""
    access_key: str = setting(
        "",
        "access key id",
        example="AKIA...",
        flag="--store-access-key",
        shown="boto3's chain: $AWS_ACCESS_KEY_ID, a profile",
        env="AWS_ACCESS_KEY_ID",
    )
    """Access key id; empty = boto3's credential chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/credentials,
    instance roles), and on a loopback endpoint with none of those a placeholder the embedded store takes."""
    secret_key: str = setting(
        "",
        "secret key",
        example="wJalr...",
        flag="--store-secret-key",
        shown="boto3's chain: $AWS_SECRET_ACCESS_KEY, a profile",
        env="AWS_SECRET_ACCESS_KEY",
    )
    """Secret key; empty = as for access_key."""
    region: str = setting("auto", "region name (R2 takes auto)", flag=None, check=not_empty)
    """Region name (R2 uses "auto")."""
    grants: bool = setting(
        False,
        "write only with the coordinator's grants; the credential may be read-only (presigned write-once URLs "
        "for this node's keys, sealed to it: protocol/net/grants.py)",
        example=True,
        flag="--store-grants",
    )
    """A node writes its fragments, checkpoints and report only through the grants the coordinator seals to
    it (protocol/trust/grant_mail.py) and reads with `access_key`, which may then be read-only; the
    node-level probes that write and delete (preflight, the upload-bandwidth probe) are skipped."""
    part_mib: int = setting(
        64,
        "part size in MiB of checkpoint uploads through grants: a coordinator sizes each checkpoint's "
        "multipart grant for it",
        flag="--store-part-mib",
        metavar="MIB",
        check=in_range(5, 5120, "MiB"),
    )
    """S3 takes parts of 5 MiB to 5 GiB; the node's uploads take the size the mail names."""
    grant_hours: float = setting(
        24.0,
        "how long the grants a coordinator issues stay valid, in hours (SigV4 allows at most 7 days)",
        flag="--store-grant-hours",
        metavar="HOURS",
        check=in_range(0.01, 168, "hours"),
    )
    """A coordinator renews a node's grants at half their life, or when the node nears the end of its
    window of rounds."""

    def __post_init__(self) -> None:
        check_fields(self)
