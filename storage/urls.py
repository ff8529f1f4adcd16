"""Storage URLs: turn a run's storage URL into an fsspec filesystem and a root path.

Driven by every store that persists something (the ledger, checkpoints, the trajectory store).
Allowed forms: ``file:///abs/path``, a plain local path (absolute or relative), and
``s3://bucket[/prefix]``. S3 credentials and the endpoint come only from the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, optional ``AWS_SESSION_TOKEN``, and the
endpoint from ``SLUICE_S3_ENDPOINT`` or ``AWS_ENDPOINT_URL``), never from arguments or files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

ALLOWED_FORMS = "file:///absolute/path, a plain local path, or s3://bucket[/prefix]"
ENDPOINT_VARS = ("SLUICE_S3_ENDPOINT", "AWS_ENDPOINT_URL")
REGION_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
DEFAULT_REGION = "us-east-1"
# S3 bucket naming rules: 3-63 chars of lowercase letters, digits, dots and hyphens,
# starting and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def redact(url: str) -> str:
    """``url`` without any ``user:password@`` part, safe to log."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"bad storage URL {redact(url)!r}: {why}; allowed forms: {ALLOWED_FORMS}")


def _local(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return LocalFileSystem(), str(Path(path).expanduser().absolute())


def _file_url(url: str, parts: SplitResult) -> tuple[fsspec.AbstractFileSystem, str]:
    if parts.netloc not in ("", "localhost"):
        raise _bad(url, f"file URLs need an absolute path (file:///...), got host {parts.netloc!r}")
    if not parts.path.startswith("/"):
        raise _bad(url, "file URLs need an absolute path")
    if parts.query or parts.fragment:
        raise _bad(url, "file URLs take no query or fragment")
    # A path's spaces, '#', '%' and non-ASCII characters are percent-encoded in its URL
    # (Path.as_uri): decoded, the URL names the folder the path does.
    return _local(unquote(parts.path))


def _env_first(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    *ENDPOINT_VARS,
    *REGION_VARS,
)


def credential_env() -> dict[str, str]:
    """The storage variables set in this process."""
    return {k: os.environ[k] for k in CREDENTIAL_VARS if os.environ.get(k)}


class Credentials(dict[str, str]):
    """This process's storage variables, handed to a Ray actor as a constructor argument,
    which puts them into its own environment with ``apply``.

    Not through Ray's ``runtime_env``: Ray's runtime-env agent writes every runtime
    environment, values included, to its log file (a test found the secret key there).
    The repr names the variables, never their values.
    """

    @classmethod
    def here(cls) -> Credentials:
        return cls(credential_env())

    def __repr__(self) -> str:
        return f"Credentials({', '.join(sorted(self))})"

    def apply(self) -> None:
        os.environ.update({k: v for k, v in self.items() if k in CREDENTIAL_VARS})


def s3_filesystem() -> fsspec.AbstractFileSystem:
    """An S3 filesystem configured only from the environment (see the module docstring)."""
    import s3fs

    key = os.environ.get("AWS_ACCESS_KEY_ID", "").strip()
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "").strip()
    if not key or not secret:
        raise ValueError(
            "s3:// storage needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
        )
    region = _env_first(REGION_VARS) or DEFAULT_REGION
    return s3fs.S3FileSystem(
        key=key,
        secret=secret,
        token=os.environ.get("AWS_SESSION_TOKEN") or None,
        endpoint_url=_env_first(ENDPOINT_VARS),
        client_kwargs={"region_name": region},
        use_listings_cache=False,
    )


def _s3_root(url: str, parts: SplitResult) -> str:
    if "@" in parts.netloc:
        raise _bad(url, "credentials in the URL are not allowed, set them in the environment")
    bucket = parts.netloc
    if not bucket:
        raise _bad(url, "no bucket name")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise _bad(url, f"invalid bucket name {bucket!r} (3-63 lowercase letters, digits, . or -)")
    if parts.query or parts.fragment:
        raise _bad(url, "s3 URLs take no query or fragment")
    prefix = "/".join(p for p in parts.path.split("/") if p)
    if any(p in (".", "..") for p in prefix.split("/")):
        raise _bad(url, "'.' and '..' are not allowed in an s3 prefix")
    return f"{bucket}/{prefix}" if prefix else bucket


def check_url(url: str) -> None:
    """Raise ``ValueError`` if ``url`` is malformed; needs no credentials (they may come
    later, from a Prefect secret block)."""
    parts = _split(url)
    if parts.scheme.lower() == "s3":
        _s3_root(url, parts)
    else:
        open_url(url)


def _split(url: str) -> SplitResult:
    if not isinstance(url, str) or not url.strip():
        raise _bad(str(url), "empty URL")
    try:
        return urlsplit(url)
    except ValueError as err:
        raise _bad(url, str(err)) from err


def open_url(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path (no protocol, no trailing slash) that ``url`` names.

    Raises ``ValueError`` naming the URL and the allowed forms for anything else.
    """
    parts = _split(url)
    scheme = parts.scheme.lower()
    if scheme == "":
        return _local(url)
    if scheme == "file":
        return _file_url(url, parts)
    if scheme == "s3":
        root = _s3_root(url, parts)  # a malformed URL is named before credentials are asked for
        return s3_filesystem(), root
    raise _bad(url, f"unsupported scheme {parts.scheme!r}")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem (where rename is atomic)."""
    return isinstance(fs, LocalFileSystem)


def url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The URL of ``path`` on ``fs`` (``file:///...`` or ``s3://...``)."""
    return str(fs.unstrip_protocol(path))
