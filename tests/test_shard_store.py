"""trainkit.data.shard_store: a shard set's files from a local dir or an S3 server (moto's, tests/s3_server.py),
downloaded into a cache held under its size limit, with retries that end in one line."""

import io
import multiprocessing
import os
import pickle
import socket
import threading
import time
from pathlib import Path

import pytest
import s3fs
from s3_server import SECRET, client_env
from webdataset.gopen import gopen_schemes

from trainkit.data import shard_store
from trainkit.data.shard_store import Store, first_line, parse_size, redact, upload
from trainkit.errors import ConfigError, DataUnavailable

SIZE = 10_000  # bytes a file


@pytest.fixture(scope="module")
def bucket(s3_server, tmp_path_factory):
    """s3://shards with prefixes a/ and b/: the same names, different bytes; a/ has f0..f7 and a manifest."""
    url = s3_server.bucket("shards")
    fs = shard_store.filesystem("s3")
    for prefix in "ab":
        for i in range(8):
            fs.pipe_file(f"{url}/{prefix}/f{i}", bytes([ord(prefix) + i]) * SIZE)
    fs.pipe_file(f"{url}/a/manifest.json", b'{"shards": 8}')
    return url


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def down(s3_server):
    """The server stopped for the test's block; started again after, whatever happened."""
    s3_server.stop()
    yield s3_server
    if not s3_server.up:
        s3_server.start()


def cached_bytes(store: Store) -> int:
    return sum(p.stat().st_size for p in Path(str(store.cache_dir)).rglob("*") if p.is_file())


def test_parse_size():
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("100KB") == 100_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size(" 7 ") == 7 and parse_size(12345) == 12345
    for bad in ("4 apples", "", "-1GB", 0, -5, True, 1.5, None, "0.1"):
        with pytest.raises(ConfigError) as error:
            parse_size(bad, "data.cache_limit")
        assert str(error.value).startswith("data.cache_limit=") and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"^data\.cache_limit='lots'"):
        Store("s3://x/y", cache_limit="lots")


def test_a_local_dir(tmp_path):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "s0.tar").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"^data\.path=.*nowhere: no such directory$"):
        Store(str(tmp_path / "nowhere"))
    store = Store(f"file://{tmp_path}/set")
    assert not store.remote and store.local("s0.tar") == str(tmp_path / "set" / "s0.tar")
    with pytest.raises(ConfigError, match=r"^data\.path=.*set: has no manifest\.json$"):
        store.read_text("manifest.json")
    with pytest.raises(DataUnavailable, match="s1.tar: no such file"):
        store.local("s1.tar")
    upload(tmp_path / "set", str(tmp_path / "copy" / "deep"))  # upload() to a local dir makes it
    assert (tmp_path / "copy" / "deep" / "s0.tar").read_bytes() == b"x"


def test_a_download_is_cached(bucket, cache, down):
    down.start()
    store = Store(f"{bucket}/a", cache_dir=str(cache))
    assert store.remote and store.read_text() == '{"shards": 8}'
    path = store.local("f1")
    assert Path(path).read_bytes() == bytes([ord("a") + 1]) * SIZE
    assert Path(path).is_relative_to(cache)
    down.stop()  # no request can be answered now
    assert store.local("f1") == path
    with store.open("f1") as file:
        assert file.read(3) == b"bbb"


def test_the_cache_holds_its_limit_least_recently_used_out(bucket, cache):
    store = Store(f"{bucket}/a", cache_dir=str(cache), cache_limit=int(2.5 * SIZE))
    names = ["f0", "f1", "f0", "f2", "f3", "f4", "f5", "f6", "f7"]  # f0 used again after f1: f1 goes first
    for name in names:
        time.sleep(0.01)  # file times tick in jiffies (ext4: 4 ms): uses within one are in no order
        store.local(name)
        assert cached_bytes(store) <= store.cache_limit + SIZE
        if name == "f3":
            kept = sorted(p.name for p in Path(str(store.cache_dir)).iterdir())
            assert kept == ["f0", "f2", "f3"], kept
    assert cached_bytes(store) == 3 * SIZE  # the limit's 2 files + the one downloaded
    assert len(list(cache.iterdir())) == 1  # one subdir per location, nothing else


def test_two_locations_with_the_same_names_never_collide(bucket, cache):
    a, b = Store(f"{bucket}/a", cache_dir=str(cache)), Store(f"{bucket}/b", cache_dir=str(cache))
    for name in ["f0", "f3"]:
        pa, pb = a.local(name), b.local(name)
        assert pa != pb
        assert Path(pa).read_bytes()[:1] != Path(pb).read_bytes()[:1]
        assert Path(a.local(name)).read_bytes() == Path(pa).read_bytes()


def test_a_store_down_fails_in_one_line_after_its_tries_then_works_again(bucket, cache, down):
    store = Store(f"{bucket}/a", cache_dir=str(cache), retries=3, backoff=0.01)
    start = time.perf_counter()
    with pytest.raises(DataUnavailable) as error:
        store.local("f2")
    elapsed = time.perf_counter() - start
    line = str(error.value)
    assert line.startswith(f"{bucket}/a/f2: unavailable after 3 tries: EndpointConnectionError: "), line
    assert "\n" not in line and SECRET not in line and "trainkit-test-key" not in line
    assert elapsed < 2, elapsed  # no retries of botocore's or s3fs's own beneath ours
    with pytest.raises(DataUnavailable, match=r"manifest\.json: unavailable after 3 tries"):
        store.read_text()
    down.start()
    assert Path(store.local("f2")).read_bytes()[:1] == b"c"


@pytest.fixture
def rude(monkeypatch):
    """The endpoint a server that closes every connection unanswered (botocore's ConnectionClosedError, which s3fs's
    own loop retries: 5 times, 1 s in all, by default)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                connection = listener.accept()[0]
                connection.recv(65536)  # the request read, so the client sees a closed connection, not a refusal
                connection.close()
            except OSError:  # closed
                return

    threading.Thread(target=serve, daemon=True).start()
    for name, value in client_env(f"http://127.0.0.1:{listener.getsockname()[1]}").items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance keeps the endpoint it was made with
    yield
    listener.close()
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_store_that_drops_connections_fails_after_our_tries_alone(rude, cache):
    store = Store("s3://shards/a", cache_dir=str(cache), retries=2, backoff=0.01)
    start = time.perf_counter()
    with pytest.raises(DataUnavailable, match=r"f1: unavailable after 2 tries: ConnectionClosedError: "):
        store.local("f1")
    assert time.perf_counter() - start < 2.0  # 2 x (s3fs's one try + its 0.1 s wait); its own 5 tries: 3.8 s


def test_a_download_cut_short_never_enters_the_cache(bucket, cache, monkeypatch):
    class Cut(io.BytesIO):  # the store stated SIZE bytes; the connection ended after 4000
        size = SIZE

    class CuttingStore:
        def open(self, url, mode):
            return Cut(b"x" * 4000)

    store = Store(f"{bucket}/a", cache_dir=str(cache), retries=2, backoff=0.01)
    monkeypatch.setattr(shard_store, "filesystem", lambda protocol: CuttingStore())
    with pytest.raises(DataUnavailable, match=r"f5: unavailable after 2 tries: OSError: short read: 4000 of 10000"):
        store.local("f5")
    assert not (Path(str(store.cache_dir)) / "f5").exists()


def test_a_missing_file_is_not_retried(bucket, cache):
    store = Store(f"{bucket}/a", cache_dir=str(cache), retries=4, backoff=5)  # a retry would take 5 s
    with pytest.raises(DataUnavailable, match=r"^s3://shards/a/nope: no such file in the store$"):
        store.local("nope")
    with pytest.raises(ConfigError, match=r"^data\.path=s3://shards/b: has no manifest\.json$"):
        Store(f"{bucket}/b", cache_dir=str(cache), backoff=5).read_text()


def test_prefetch_downloads_in_the_background_and_its_failure_surfaces_at_local(bucket, cache, down, monkeypatch):
    down.start()
    store = Store(f"{bucket}/a", cache_dir=str(cache), retries=2, backoff=0.01)
    store.prefetch(["f4", "f5"])
    store.wait_prefetched()
    down.stop()
    assert Path(store.local("f4")).read_bytes()[:1] == b"e" and Path(store.local("f5")).read_bytes()[:1] == b"f"
    store.prefetch(["f6", "f7"])  # fail in the background, silently
    store.wait_prefetched()
    fetch, tries = store._fetch, list[str]()

    def counted(name):
        tries.append(name)
        return fetch(name)

    monkeypatch.setattr(store, "_fetch", counted)
    with pytest.raises(DataUnavailable, match=r"f6: unavailable after 2 tries"):
        store.local("f6")
    assert tries == ["f6"]  # the background's try was the first
    down.start()
    assert Path(store.local("f7")).read_bytes()[:1] == b"h"  # retried as usual


def test_local_waits_for_the_prefetch_of_its_file(bucket, cache, monkeypatch):
    store = Store(f"{bucket}/a", cache_dir=str(cache))
    store.local("f0")  # the gopen handler registered
    opened, handler = [], gopen_schemes["s3"]

    def slow(url, *args, **kw):  # a download that takes a while
        opened.append(url)
        time.sleep(0.1)
        return handler(url, *args, **kw)

    monkeypatch.setitem(gopen_schemes, "s3", slow)
    store.prefetch(["f1"])
    assert Path(store.local("f1")).read_bytes() == b"b" * SIZE
    assert opened == [f"{bucket}/a/f1"]  # downloaded once


def test_a_file_a_cleanup_deletes_before_use_is_fetched_again(bucket, cache, monkeypatch):
    store = Store(f"{bucket}/a", cache_dir=str(cache))
    cache_object = store._file_cache()
    get_file, deleted = cache_object.get_file, list[str]()

    def racing(url):  # another process's cleanup deletes the file right after FileCache's exists()
        path = get_file(url)
        if not deleted:
            os.remove(path)
            deleted.append(path)
        return path

    monkeypatch.setattr(cache_object, "get_file", racing)
    path = store.local("f1")
    assert deleted == [path] and Path(path).read_bytes()[:1] == b"b"
    monkeypatch.undo()
    local = store.local

    def deleting(name):  # ... or between local() and the open
        path = local(name)
        if len(deleted) < 2:
            os.remove(path)
            deleted.append(path)
        return path

    monkeypatch.setattr(store, "local", deleting)
    with store.open("f2") as file:
        assert file.read() == b"c" * SIZE and len(deleted) == 2


def _child(store, name, results):
    results.put(Path(store.local(name)).read_bytes()[:1])


def test_a_store_pickles_and_forks_without_its_thread(bucket, cache):
    store = Store(f"{bucket}/a", cache_dir=str(cache))
    store.prefetch(["f0"])  # a thread, a queue, a lock, a FileCache: none of them travel
    copy = pickle.loads(pickle.dumps(store))
    assert Path(copy.local("f2")).read_bytes()[:1] == b"c"
    results = multiprocessing.get_context("fork").SimpleQueue()
    child = multiprocessing.get_context("fork").Process(target=_child, args=(store, "f3", results))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and results.get() == b"d"


def test_upload_puts_the_manifest_last(bucket, tmp_path, monkeypatch):
    source = tmp_path / "set"
    (source / "sub").mkdir(parents=True)
    for name in ["manifest.json", "shard-000.tar", "shard-001.tar", "sub/x.tar"]:
        (source / name).write_text(name)
    fs = shard_store.filesystem("s3")  # the instance upload() gets (fsspec's cache)
    put, order, fail = fs.put_file, [], ["shard-001.tar"]

    def recording(lpath, rpath, **kw):  # the order of the puts; the store fails on one shard first
        order.append(rpath.rpartition("/up/")[2])
        if fail and rpath.endswith(fail[0]):
            raise OSError("the store failed")
        return put(lpath, rpath, **kw)

    monkeypatch.setattr(fs, "put_file", recording)
    with pytest.raises(OSError, match="the store failed"):
        upload(source, f"{bucket}/up")
    assert order == ["shard-000.tar", "shard-001.tar"]
    assert not fs.exists(f"{bucket}/up/manifest.json")  # a reader never sees a manifest without its shards
    fail.clear()
    order.clear()
    upload(source, f"{bucket}/up/")
    assert order == ["shard-000.tar", "shard-001.tar", "sub/x.tar", "manifest.json"]
    assert fs.cat_file(f"{bucket}/up/sub/x.tar") == b"sub/x.tar"
    assert Store(f"{bucket}/up").read_text() == "manifest.json"


def test_messages_name_no_secret(monkeypatch):
    assert redact("https://user:pw@host:9000/b/p?X-Amz-Signature=abc#f") == "https://host:9000/b/p"
    assert redact("s3://Bucket/p") == "s3://Bucket/p" and redact("/local/dir") == "/local/dir"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit-value")
    assert first_line(OSError("denied for sekrit-value\nmore")) == "OSError: denied for ***"
