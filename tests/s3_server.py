"""An S3-compatible server on 127.0.0.1 for data=shards' tests: moto's, in a thread of the test process (0.3 s to
import moto, ~1 ms to start).

S3Server().start() serves on a free port; stop() closes the listening socket (clients get "connection refused" at
once, as from a store that is down) and start() serves again on the same port. The buckets and their objects
survive: moto keeps them in the process's memory, not in the server. `env` is what a client needs (fake credentials,
the endpoint; the user's ~/.aws files shut out), set by `serving()` for the fixture `s3_server` (tests/conftest.py).
"""

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

import pytest
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import BaseWSGIServer, make_server

SECRET = "trainkit-test-secret-0123456789"  # tests check that no message shows it


def client_env(endpoint: str) -> dict[str, str]:
    """What an S3 client of `endpoint` needs: fake credentials (the user's ~/.aws files shut out)."""
    return {
        "AWS_ACCESS_KEY_ID": "trainkit-test-key",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


class S3Server:
    def __init__(self) -> None:
        with socket.socket() as probe:  # a free port, kept across stop/start
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = client_env(self.endpoint)
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._left: int | None = None  # stop_after's downloads to go
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

    def start(self) -> None:
        """moto.server.ThreadedMotoServer's few lines, but polling for shutdown every 10 ms (its 0.5 s made each
        stop() cost half a second) and closing the socket in stop() (its stop() leaves it listening: clients hang)."""
        assert self._server is None, "already serving"
        app = self._counted(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", self.port, app, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.01,), daemon=True)
        self._thread.start()

    def stop_after(self, downloads: int | None) -> None:
        """Go down (stop(), from a thread of its own) once `downloads` more objects under a `train-` name were
        served: a store that fails at a fixed point of a run, whatever its timing. None: never."""
        self._left = downloads

    def _counted(self, app):
        def counted(environ, start_response):
            shard = environ["REQUEST_METHOD"] == "GET" and "/train-" in environ.get("PATH_INFO", "")
            if shard and self._left is not None:
                self._left -= 1
                if self._left < 0:  # this one fails too: the server is going down
                    self._left = None
                    threading.Thread(target=self.stop, daemon=True).start()
                    start_response("503 Service Unavailable", [("Content-Length", "0")])
                    return [b""]
            return app(environ, start_response)

        return counted

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None, "not serving"
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = self._thread = None

    @property
    def up(self) -> bool:
        return self._server is not None

    def bucket(self, name: str) -> str:
        """Create bucket `name` (with the env set); its URL."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return f"s3://{name}"


@contextlib.contextmanager
def serving() -> Iterator[S3Server]:
    """A started S3Server with its env set for the block (and fsspec's S3 file systems made anew: they keep the
    endpoint they were made with); stopped after."""
    import s3fs

    server = S3Server()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in server.env.items():
            patch.setenv(name, value)
        patch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        patch.delenv("AWS_PROFILE", raising=False)
        patch.delenv("AWS_SESSION_TOKEN", raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        server.start()
        try:
            yield server
        finally:
            if server.up:
                server.stop()
            s3fs.S3FileSystem.clear_instance_cache()
