"""Where a shard set's files are (data=shards): a local dir, or an object-store URL whose files are downloaded into a
local cache held under a size limit, with retries.

The engine is webdataset's FileCache (download to a temp file renamed into place, LRUCleanup holding the cache
under a size limit), opening URLs through fsspec (s3fs for s3://; gcsfs, adlfs for gs://, az:// where installed),
registered in webdataset's own dispatch table (`webdataset.gopen.gopen_schemes`, which has no s3 handler). The
retries are trainkit's (FileCache's own loop fixes 10 tries from 1 s): `retries` tries, the waits between them
`backoff`, 2x, 4x ... seconds (at most a minute each). Rejected engines: MosaicML streaming pins transformers<5 and
numpy<2.2, both incompatible with the hf extra; litdata's reader deletes a chunk when it moves to the next one,
built for its own iteration order, which thrashes under trainkit's global order (random access within a window of
shards); HF datasets' parquet has no cache size limit, and random access to a remote file means the whole file anyway.

The cache: `cache_dir` (default `$TRAINKIT_CACHE/shards`, else `~/.cache/trainkit/shards`) holds a subdir per location
(its last path part and a sha256 of its URL: two shard sets never share a name), the names below the location
%-quoted (`train/000.tar` and `val/000.tar` do not collide). `cache_limit` bounds that subdir: every download first
deletes its least recently used files (LRUCleanup orders by ctime, which the touch of each local() renews; file times
tick in jiffies, a few ms) until the rest fits. So the subdir holds at most cache_limit plus the files being
downloaded (a process's reader and its prefetch thread may each download one; local ranks share the cache), and
nothing outside it is ever deleted. A file local() returned is the newest one; it is pushed out only when the limit
cannot hold the files in use (the ranks' windows of shards: then files are fetched again and again); a file opened
before that stays readable (POSIX). Downloads are atomic (temp + rename): processes sharing the cache see a whole
file or none; one that another process's cleanup deletes before local() touches it is fetched again, and open()
closes the gap up to the open itself. A download that fails midway leaves its temp file (`<name>.temp<pid>`) for the
next try to overwrite or the cleanup to delete.

Credentials come only from the environment, read by botocore (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, AWS_PROFILE): nothing in the config, and messages name
the URL without its user, password or query, with any secret of the environment blanked. The object store's own
retries are off (botocore's `total_max_attempts=1`, s3fs's `retries=1`; its timeouts stay connect 5 s, read 15 s):
with botocore's default five attempts a refused connection took 6.4 s a try, and both multiply with ours.

A Store pickles without its thread, queue and file system (DataLoader workers, spawned or forked): each process
makes its own on first use.
"""

import hashlib
import os
import queue
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from webdataset.cache import FileCache
from webdataset.gopen import gopen_schemes

from trainkit.errors import ConfigError, DataUnavailable

MAX_WAIT = 60.0  # seconds: the longest wait between two tries
MANIFEST = "manifest.json"
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


def parse_size(value: Any, key: str = "data.cache_limit") -> int:
    """Bytes from an int or a string: 4GB, 512MB, 1.5G, 100KB (powers of 1000), 2GiB (powers of 1024), 1000."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    size = float(match[1]) * _UNITS[(match[2] or "").lower()] if match else 0
    if size < 1:
        raise ConfigError(f"{key}={value!r}: not a size (bytes as an int, or e.g. 512MB, 4GB, 1.5GiB)")
    return int(size)


def default_cache_dir() -> Path:
    root = os.environ.get("TRAINKIT_CACHE")
    return Path(root) / "shards" if root else Path.home() / ".cache" / "trainkit" / "shards"


def redact(url: str) -> str:
    """The URL without user, password, query or fragment (a presigned URL's signature): what messages may name."""
    parts = urllib.parse.urlsplit(url)
    return (
        urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
        if parts.scheme
        else url
    )


def first_line(error: BaseException) -> str:
    """An error's first line, any secret of the environment blanked."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
    for name in _SECRETS:
        if len(secret := os.environ.get(name, "")) >= 4:
            line = line.replace(secret, "***")
    return line


def filesystem(protocol: str) -> fsspec.AbstractFileSystem:
    """fsspec's file system for `protocol` (one instance a process, fsspec's cache), the store's own retries off."""
    if protocol in ("s3", "s3a"):
        fs = fsspec.filesystem(protocol, config_kwargs={"retries": {"total_max_attempts": 1}})
        fs.retries = 1  # s3fs's own loop (a class attribute, not an argument)
        return fs
    return fsspec.filesystem(protocol)


class _Missing(FileNotFoundError):
    """The store has no such file: not retried (a FileNotFoundError of the cache itself, a race, is)."""


class _Whole:
    """A remote file read to its end, or an error: a read that ends short of the size the store stated raises
    (webdataset's download would otherwise rename a truncated shard into the cache for good)."""

    def __init__(self, file: Any):
        self.file = file

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        expected = getattr(self.file, "size", None)
        if not data and size != 0 and expected is not None and self.file.tell() < expected:
            raise OSError(f"short read: {self.file.tell()} of {expected} bytes")
        return data

    def __enter__(self) -> "_Whole":
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> _Whole:
    """webdataset.gopen's handler for the protocols a Store reads: fsspec opens them."""
    protocol = urllib.parse.urlsplit(url).scheme
    try:
        return _Whole(filesystem(protocol).open(url, mode))
    except FileNotFoundError as error:
        raise _Missing(str(error)) from error


# Per process: a name is downloaded by one thread at a time (webdataset's temp name is per process), and a local()
# of a name the prefetch thread is downloading waits for it here. Reset in a forked child (a lock held then).
_guards: dict[str, threading.Lock] = {}
_guards_lock = threading.Lock()


def _guard(dest: str) -> threading.Lock:
    with _guards_lock:
        return _guards.setdefault(dest, threading.Lock())


def _reset_guards() -> None:
    global _guards_lock
    _guards.clear()
    _guards_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_guards)


class Store:
    """Where a shard set's files are: a local dir, or a URL of any fsspec protocol (s3://bucket/prefix).

    local(name) gives a local path to the file `name` below the location; read_text(name) a small file's text
    (manifest.json, read anew each time); prefetch(names) downloads in the background. `key` is the config key that
    named the location (its errors name it; cache_limit's name `<parent of key>.cache_limit`)."""

    def __init__(
        self,
        location: str,
        cache_dir: str | None = None,
        cache_limit: int | str = "4GB",
        retries: int = 5,
        backoff: float = 1.0,
        key: str = "data.path",
    ):
        self.location, self.key = str(location).rstrip("/") or "/", key
        scheme = urllib.parse.urlsplit(self.location).scheme
        self.remote = len(scheme) > 1 and scheme != "file"  # a Windows drive letter is no scheme
        self.protocol = scheme if self.remote else "file"
        parent = key.rpartition(".")[0]
        self.cache_limit = parse_size(cache_limit, f"{parent}.cache_limit" if parent else "cache_limit")
        if retries < 1:
            raise ConfigError(f"{parent + '.' if parent else ''}retries={retries}: at least 1 (the first try)")
        self.retries, self.backoff = retries, max(0.0, float(backoff))
        if self.remote:
            digest = hashlib.sha256(self.location.encode()).hexdigest()[:16]
            tail = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.location.rpartition("/")[2])[:40]
            self.cache_dir: Path | None = Path(cache_dir or default_cache_dir()) / f"{tail}-{digest}"
        else:
            self.cache_dir = None
            self.root = Path(urllib.parse.urlsplit(self.location).path if scheme == "file" else self.location)
            if not self.root.is_dir():
                raise ConfigError(f"{key}={self.location}: no such directory")
        self._pid = -1  # the process that made the runtime state below (none yet)

    # -- runtime state, made per process on first use --------------------------------------------------------
    def _runtime(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._cache: FileCache | None = None
            self._queue: queue.Queue[str] | None = None
            self._queued: set[str] = set()
            self._failed: dict[str, BaseException] = {}
            self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")} | {"_pid": -1}

    def _file_cache(self) -> FileCache:
        self._runtime()
        if self._cache is None:
            gopen_schemes[self.protocol] = _gopen  # in each process (a spawned one imports anew)
            # cache_cleanup_interval=0: the cleanup runs before every download (the bound above)
            self._cache = FileCache(
                str(self.cache_dir),
                url_to_name=self._cache_name,
                validator=None,
                cache_size=self.cache_limit,
                cache_cleanup_interval=0,
            )
        return self._cache

    def _cache_name(self, url: str) -> str:
        return urllib.parse.quote(url[len(self.location) + 1 :], safe="")

    def url(self, name: str) -> str:
        return f"{self.location}/{name.lstrip('/')}"

    # -- reading -----------------------------------------------------------------------------------------------
    def read_text(self, name: str = MANIFEST) -> str:
        """A small file's text, read from the store each time (never cached), retried like local()."""
        if not self.remote:
            try:
                return (self.root / name).read_text()
            except FileNotFoundError:
                raise ConfigError(f"{self.key}={self.location}: has no {name}") from None
        url = self.url(name)

        def read() -> str:
            try:
                return filesystem(self.protocol).cat_file(url).decode()
            except FileNotFoundError:
                raise ConfigError(f"{self.key}={redact(self.location)}: has no {name}") from None

        return self._retried(url, read)

    def local(self, name: str) -> str:
        """A local path to the file `name`: the file itself in a local dir; for a URL the cache's copy (downloaded
        now unless cached; if the prefetch thread is downloading it, waits for that). Raises DataUnavailable after
        `retries` tries (one line: the URL, the tries, the last error's first line)."""
        if not self.remote:
            path = self.root / name
            if not path.is_file():
                raise DataUnavailable(f"{path}: no such file in the shard set at {self.key}={self.location}")
            return str(path)
        self._runtime()
        with self._lock:
            failed = self._failed.pop(name, None)  # the prefetch thread's try of it failed: that was the first
        return self._retried(self.url(name), lambda: self._fetch(name), tried=failed)

    def open(self, name: str) -> IO[bytes]:
        """local(name) opened for reading: a cleanup of another process between the two fetches it again."""
        for _ in range(3):
            try:
                return open(self.local(name), "rb")
            except FileNotFoundError:
                continue
        return open(self.local(name), "rb")

    def prefetch(self, names: Iterable[str]) -> None:
        """Start downloading `names` in the background (one daemon thread a process, in order). A failure there
        surfaces only when local() asks for that name, as its first try."""
        if not self.remote:
            return
        self._runtime()
        with self._lock:
            if self._queue is None:
                self._queue = queue.Queue()
                threading.Thread(target=self._prefetching, args=(self._queue,), daemon=True).start()
            for name in names:
                if name not in self._queued and not os.path.exists(self._dest(name)):
                    self._queued.add(name)
                    self._queue.put(name)

    def wait_prefetched(self) -> None:
        """Block until the prefetch thread has tried every name given so far (tests, and a caller that must)."""
        self._runtime()
        if self._queue is not None:
            self._queue.join()

    def _prefetching(self, names: "queue.Queue[str]") -> None:
        while True:
            name = names.get()
            try:
                self._fetch(name)
            except Exception as error:  # kept for local(); any kind: the thread must go on
                with self._lock:
                    self._failed[name] = error
            finally:
                with self._lock:
                    self._queued.discard(name)
                names.task_done()

    def _dest(self, name: str) -> str:
        return os.path.join(str(self.cache_dir), self._cache_name(self.url(name)))

    def _fetch(self, name: str) -> str:
        """One try: the cached file, downloaded first unless there; touched (newest for the LRU cleanup). A file
        another process's cleanup deletes between FileCache's exists() and the touch is downloaded again."""
        dest, url = self._dest(name), self.url(name)
        with _guard(dest):
            for _ in range(3):
                path = self._file_cache().get_file(url)
                try:
                    os.utime(path)
                    return path
                except FileNotFoundError:
                    continue
        raise OSError(f"{dest}: deleted by another process's cache cleanup right after each download")

    def _retried(self, url: str, attempt: Callable[[], Any], tried: BaseException | None = None) -> Any:
        """attempt() until it returns, `retries` tries in all (`tried`: a first one already failed elsewhere; still one
        try here), waiting backoff, 2 backoff, ... between them. A missing file and a ConfigError are not retried."""
        last, tries, own = tried, 1 if tried is not None and self.retries > 1 else 0, 0
        while tries < self.retries:
            if own:
                time.sleep(min(self.backoff * 2 ** (own - 1), MAX_WAIT))
            tries, own = tries + 1, own + 1
            try:
                return attempt()
            except ConfigError:
                raise
            except _Missing:
                raise DataUnavailable(f"{redact(url)}: no such file in the store") from None
            except Exception as error:
                last = error
        plural = "try" if tries == 1 else "tries"
        assert last is not None
        raise DataUnavailable(f"{redact(url)}: unavailable after {tries} {plural}: {first_line(last)}") from None


def upload(local_dir: str | Path, url: str) -> None:
    """Every file below `local_dir` to the same names below `url` (any fsspec URL or a local path), manifest.json
    last: a reader never sees a manifest whose shards are missing. Not retried: a failure raises (run it again)."""
    root = Path(local_dir)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    if MANIFEST in files:
        files.remove(MANIFEST)
        files.append(MANIFEST)
    protocol = urllib.parse.urlsplit(url).scheme
    fs = filesystem(protocol if len(protocol) > 1 else "file")
    base = url.rstrip("/")
    for name in files:
        target = f"{base}/{name}"
        if isinstance(fs, LocalFileSystem):  # an object store has no directories to make
            fs.makedirs(fs._parent(target), exist_ok=True)
        fs.put_file(str(root / name), target)
