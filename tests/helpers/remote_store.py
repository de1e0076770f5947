"""A real S3 API server for the remote-tier tests: moto's ``ThreadedMotoServer`` on a free localhost port.

No account and no network: the server runs in a thread of the test process, dummy credentials are set in the
environment (as the store's own tools read them), and ``FSSPEC_S3_ENDPOINT_URL`` points fsspec's s3 filesystem at
it. Processes the tests start inherit the environment, so they reach the same server.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

SECRET = "trainkit-test-secret-d41d8cd9"
"""The dummy secret access key: a test greps every file a run writes for it."""
ACCESS_KEY_ID = "AKIATRAINKITTEST0001"
"""The dummy access key id."""


def free_port() -> int:
    """A localhost TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[str]:
    """Run an S3 server on localhost with dummy credentials in the environment; yields its endpoint URL.

    The environment is put back and the server stopped on exit.
    """
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "FSSPEC_S3_ENDPOINT_URL")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        FSSPEC_S3_ENDPOINT_URL=endpoint,
    )
    try:
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def remote_files(url: str) -> dict[str, bytes]:
    """Every object under the prefix, by its name relative to it."""
    from trainkit.checkpoint.remote import open_store

    fs, root = open_store(url)
    fs.invalidate_cache()
    try:
        return {path[len(root) + 1 :]: fs.cat_file(path) for path in fs.find(root)}
    except FileNotFoundError:  # no bucket yet, or an object deleted between the listing and the read
        return {}


def committed_steps(url: str) -> list[int]:
    """The steps of the committed checkpoints under the prefix, in order."""
    from trainkit.checkpoint.remote.manifest import MANIFEST, parse_manifest

    objects = remote_files(url)
    return sorted(parse_manifest(data).step for name, data in objects.items() if name.endswith("/" + MANIFEST))


def failing_store(message: str = "the store is down", protocol: str = "failing") -> str:
    """Register an fsspec memory store on which every write of a ``last.pt`` fails with ``OSError(message)`` (a store
    that is down for checkpoints); a fresh prefix on it.

    :param message: What the store's error says.
    :param protocol: The store's URL scheme.
    :returns: The prefix's URL.
    """
    import secrets

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Failing(MemoryFileSystem):
        store: dict = {}  # noqa: RUF012 - fsspec's own layout: the store is the class's
        pseudo_dirs = [""]  # noqa: RUF012

        def open(self, path, mode="rb", **kwargs):
            if "w" in mode and str(path).endswith("/last.pt"):
                raise OSError(message)
            return super().open(path, mode, **kwargs)

    Failing.protocol = protocol
    fsspec.register_implementation(protocol, Failing, clobber=True)
    return f"{protocol}://trainkit-{secrets.token_hex(4)}/runs/a"
