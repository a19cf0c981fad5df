"""What a SparseLoCo fragment is refused for: the errors of its values (`protocol.codecs.sparseloco`,
`check_values`) and of its wire format (`protocol.codecs.sparseloco_format`), in one module both import.
"""

from __future__ import annotations

from protocol.schema import ProtocolError, UntrustedSigner, VersionError


class FragmentError(ProtocolError):
    """A SparseLoCo fragment is malformed, truncated, oversized, or not what was expected."""


class FragmentVersionError(FragmentError, VersionError):
    """The fragment uses a frame or codec version this build does not speak."""


class FragmentSignatureError(FragmentError):
    """The fragment's signature does not verify."""


class UntrustedFragmentSigner(FragmentError, UntrustedSigner):
    """The fragment is validly signed, but by a key not in the trusted set."""


class FragmentMismatch(FragmentError):
    """The fragment's header differs from what the receiver expected (run, stage, round, shapes...)."""


__all__ = [
    "FragmentError",
    "FragmentMismatch",
    "FragmentSignatureError",
    "FragmentVersionError",
    "UntrustedFragmentSigner",
]
