"""`s3://bucket/prefix`: where an object-store checkpoint root lives, and the keys under it.

The bucket follows S3's naming rules loosely (3-63 of lowercase letters, digits, `.`, `-`); the
prefix is any path without empty, `.` or `..` segments and may be empty. Keys are
`<prefix>/<name>` (or `<name>` for an empty prefix).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from spotguard.config import ConfigError

SCHEME = "s3://"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def is_object_store_url(location: object) -> bool:
    """True when `location` names an object store (`s3://...`) rather than a directory."""
    return isinstance(location, str) and location.startswith(SCHEME)


@dataclass(frozen=True)
class ObjectStoreURL:
    """A parsed `s3://bucket/prefix` (prefix without leading or trailing `/`)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, location: str, field: str = "checkpoint_dir") -> ObjectStoreURL:
        """Parses `location`; ConfigError naming `field` and the URL when it is not a valid S3 URL."""
        if not is_object_store_url(location):
            raise ConfigError(field, f"{location!r} is not an s3://bucket/prefix URL")
        bucket, _, prefix = location[len(SCHEME):].partition("/")
        if not _BUCKET_RE.match(bucket):
            raise ConfigError(field, f"{location}: bucket name {bucket!r} is not valid "
                                     "(3-63 lowercase letters, digits, '.', '-')")
        prefix = prefix.strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ConfigError(field, f"{location}: the prefix must not contain empty, '.' or '..' segments")
        return cls(bucket, prefix)

    def key(self, *names: str) -> str:
        """The object key of `names` joined under the prefix."""
        return "/".join(p for p in (self.prefix, *names) if p)

    @property
    def root_key(self) -> str:
        """The key prefix every object of this store starts with ('' or '<prefix>/')."""
        return f"{self.prefix}/" if self.prefix else ""

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"
