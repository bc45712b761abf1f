"""A local S3 (moto's server) for the tests of remote checkpoint storage: the protocol s3fs speaks to a real one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import fsspec
from moto.server import ThreadedMotoServer


@contextmanager
def s3_server(bucket: str) -> Iterator[str]:
    """moto's S3 server on a free loopback port, with `bucket`; yields its endpoint. The endpoint and test credentials
    reach s3fs, and every process started meanwhile (which inherits the environment, as the spawned ranks do), through
    the AWS_* variables, as they would on a real cluster; the variables are restored afterwards."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    settings = {
        "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    filesystem_class = fsspec.get_filesystem_class("s3")
    try:
        with patch.dict(os.environ, settings):
            filesystem_class.clear_instance_cache()  # an instance made for an earlier server would be reused
            # moto keeps its buckets in this process across servers: an earlier server may have made it already.
            fsspec.filesystem("s3").makedirs(bucket, exist_ok=True)
            yield settings["AWS_ENDPOINT_URL_S3"]
    finally:
        filesystem_class.clear_instance_cache()
        server.stop()
