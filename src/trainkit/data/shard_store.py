"""STAND-IN (drop at merge): the storage side of data=shards, local directories only.

The real module (another helper's: download, a local cache under a size limit, retries, object-store URLs through
fsspec) replaces this file whole; this one has exactly its API so data=shards builds and tests against it:
`Store(location, cache_dir=None, cache_limit="4GB", retries=5, backoff=1.0, key="data.path")` with `.remote`,
`.read_text(name)`, `.local(name)` (a local path), `.prefetch(names)`; `upload(local_dir, url)`; `parse_size(v)`.
"""

import re
from collections.abc import Iterable
from pathlib import Path

from trainkit.errors import ConfigError, DataUnavailable

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(value) -> int:
    """Bytes of `value`: an int, or a string like 64MB, 4GB, 512KiB (one ConfigError where it is none)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if found is None or found.group(2).upper() not in _UNITS or float(found.group(1)) <= 0:
        raise ConfigError(f"size {value!r} is not a positive size such as 64MB, 4GB or 1048576")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


class Store:
    """A shard set's location: here a local directory only."""

    def __init__(
        self, location, cache_dir=None, cache_limit="4GB", retries: int = 5, backoff: float = 1.0, key="data.path"
    ):
        self.location, self.key = str(location), key
        self.remote = "://" in self.location
        if self.remote:
            raise ConfigError(f"{key}={location}: object-store URLs need trainkit's shard_store (not merged yet)")
        self.cache_limit = parse_size(cache_limit)

    def read_text(self, name: str) -> str:
        """A small file of the set (manifest.json); FileNotFoundError where it is not there."""
        return (Path(self.location) / name).read_text()

    def local(self, name: str) -> str:
        path = Path(self.location) / name
        if not path.is_file():
            raise DataUnavailable(f"{self.key}={self.location}: {name} is not there")
        return str(path)

    def prefetch(self, names: Iterable[str]) -> None:
        """Nothing to fetch ahead: the files are local."""


def upload(local_dir, url: str) -> None:
    raise ConfigError(f"out={url}: object-store URLs need trainkit's shard_store (not merged yet)")
