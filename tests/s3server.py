"""A real S3 HTTP endpoint for tests: moto's server in a subprocess.

Register once in tests/conftest.py (or in a test module):

    pytest_plugins = ["s3server"]

(It is imported as the top-level module `s3server`: pytest puts tests/ on sys.path because tests/ has no
__init__.py, and `import tests...` would find the `tests` package that verl installs into site-packages.)

Fixtures:
  s3_endpoint  (session)  -> "http://127.0.0.1:<port>"; the server is stopped at the end of the session.
  s3_bucket    (function) -> S3Bucket(endpoint, name, uri, key_id, secret, client()): a fresh empty bucket;
                             the environment carries fake credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY),
                             AWS_ENDPOINT_URL pointing at the server and AWS_DEFAULT_REGION, so s3fs and boto3
                             reach it with no extra arguments.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

FAKE_KEY_ID = "AKIAVERLFLOWTEST0001"
FAKE_SECRET = "verlflow-test-secret-3f9c2b7d1e"  # tests assert this never leaks anywhere
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Bucket:
    endpoint: str
    name: str
    key_id: str = FAKE_KEY_ID
    secret: str = FAKE_SECRET  # the value in AWS_SECRET_ACCESS_KEY during the test

    @property
    def uri(self) -> str:
        return f"s3://{self.name}"

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # moto logs every request to stderr: an unread pipe fills after a few hundred requests and the server then
    # blocks mid-response (seen as a hang in the suite). Log to a file instead.
    log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited early: {Path(log.name).read_text(errors='replace')[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not answer on {url} within 30 s")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> S3Bucket:
    for var in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no slow instance-metadata lookups for credentials
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)  # ignore any ~/.aws of the machine running the tests
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    bucket = S3Bucket(s3_endpoint, f"test-{uuid.uuid4().hex[:12]}")
    bucket.client().create_bucket(Bucket=bucket.name)
    _clear_s3fs_instances()
    yield bucket
    _clear_s3fs_instances()


def _clear_s3fs_instances() -> None:
    """s3fs caches filesystem objects (and their listings) per argument set; start each test from none."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
