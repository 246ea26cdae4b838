"""``rediss://`` against real TLS redis-servers, with certificates made here (trustme):
verification is on by default, ``ssl_ca_certs`` names a private CA, client certificates
give mutual TLS, and a wrong CA, an expired certificate or a missing client certificate
is a clear error naming the (redacted) URL and the reason. Cluster and Sentinel URLs
carry the same TLS options."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from sandboxq import Queue
from sandboxq.backends.redis.connection import Connections
from sandboxq.errors import BackendError, ConfigError
from sandboxq.testing.redis_server import RedisServer, TlsFiles
from sandboxq.testing.workers import BackgroundWorkers

from .support import H

pytestmark = pytest.mark.timeout(60)

PASSWORD = "tls-pw-9c1e"


@dataclass
class Pki:
    ca: Path
    other_ca: Path
    client_cert: Path
    client_key: Path


@dataclass
class Servers:
    plain: RedisServer  # server certificate only
    mutual: RedisServer  # client certificates required
    expired: RedisServer  # its certificate ran out yesterday
    pki: Pki


def _write(path: Path, blob: trustme.Blob) -> Path:
    blob.write_to_path(str(path))
    return path


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    d = tmp_path_factory.mktemp("tls")
    ca, other = trustme.CA(), trustme.CA()
    now = datetime.datetime.now(datetime.UTC)
    server = ca.issue_cert("localhost", "127.0.0.1")
    old = ca.issue_cert("localhost", not_before=now - datetime.timedelta(days=2),
                        not_after=now - datetime.timedelta(days=1))  # fmt: skip
    client = ca.issue_cert("sandboxq-client")
    pki = Pki(
        ca=_write(d / "ca.pem", ca.cert_pem),
        other_ca=_write(d / "other-ca.pem", other.cert_pem),
        client_cert=_write(d / "client.pem", client.cert_chain_pems[0]),
        client_key=_write(d / "client.key", client.private_key_pem),
    )

    def files(leaf: trustme.LeafCert, name: str, client_auth: bool = False) -> TlsFiles:
        return TlsFiles(
            cert_file=_write(d / f"{name}.pem", leaf.cert_chain_pems[0]),
            key_file=_write(d / f"{name}.key", leaf.private_key_pem),
            ca_file=pki.ca,
            client_auth=client_auth,
            client_cert_file=pki.client_cert if client_auth else None,
            client_key_file=pki.client_key if client_auth else None,
        )

    args = ["--requirepass", PASSWORD]
    with (
        RedisServer(tls=files(server, "server"), extra_args=args) as plain,
        RedisServer(tls=files(server, "mutual", client_auth=True), extra_args=args) as mutual,
        RedisServer(tls=files(old, "expired"), extra_args=args) as expired,
    ):
        yield Servers(plain, mutual, expired, pki)


def _url(server: RedisServer, query: str = "") -> str:
    return f"rediss://:{PASSWORD}@localhost:{server.port}/0" + (f"?{query}" if query else "")


def _refused(url: str, queue_name: str) -> str:
    with Queue(queue_name, url=url) as q, pytest.raises(BackendError) as caught:
        q.enqueue("x")
    message = str(caught.value)
    assert PASSWORD not in message and ":***@localhost" in message, message
    return message


def test_the_server_certificate_is_verified_by_default(tls: Servers, queue_name: str) -> None:
    message = _refused(_url(tls.plain), queue_name)
    assert "certificate verify failed" in message and "ssl_ca_certs" in message, message


def test_a_certificate_from_another_ca_is_refused(tls: Servers, queue_name: str) -> None:
    message = _refused(_url(tls.plain, f"ssl_ca_certs={tls.pki.other_ca}"), queue_name)
    assert "certificate verify failed" in message, message


def test_an_expired_certificate_is_refused(tls: Servers, queue_name: str) -> None:
    message = _refused(_url(tls.expired, f"ssl_ca_certs={tls.pki.ca}"), queue_name)
    assert "expired" in message, message


def test_a_worker_and_a_producer_over_tls_with_a_ca_file(tls: Servers, queue_name: str) -> None:
    url = _url(tls.plain, f"ssl_ca_certs={tls.pki.ca}")
    workers = BackgroundWorkers(join_timeout_s=20)
    try:
        workers.start(queue_name, H + "echo", url=url, concurrency=1, lease_s=5.0)
        with Queue(queue_name, url=url) as q:
            assert q.enqueue("over tls").result(timeout_s=30) == "over tls"
    finally:
        workers.stop_all()


def test_mutual_tls_needs_the_client_certificate(tls: Servers, queue_name: str) -> None:
    ca = f"ssl_ca_certs={tls.pki.ca}"
    message = _refused(_url(tls.mutual, ca), queue_name)
    assert "unreachable" in message, message
    cert = f"{ca}&ssl_certfile={tls.pki.client_cert}&ssl_keyfile={tls.pki.client_key}"
    with Queue(queue_name, url=_url(tls.mutual, cert)) as q:
        job = q.enqueue("x")
        assert job.state().value == "waiting"


def test_tls_options_are_checked(tls: Servers, queue_name: str) -> None:
    with pytest.raises(ConfigError, match="'ssl_ca_cert'"):  # a typo is named, not ignored
        Queue(queue_name, url=_url(tls.plain, "ssl_ca_cert=/x"))
    with pytest.raises(ConfigError, match="use rediss://"):
        Queue(queue_name, url=f"redis://localhost:{tls.plain.port}/0?ssl_ca_certs=/x")


def test_a_cluster_url_speaks_tls_with_the_same_options(tls: Servers, queue_name: str) -> None:
    """The TLS server is no Cluster node: with the CA the handshake succeeds and the error
    is about cluster mode; without it, about the certificate."""
    url = f"rediss+cluster://:{PASSWORD}@localhost:{tls.plain.port}"
    with pytest.raises(BackendError) as caught:
        Queue(queue_name, url=f"{url}?ssl_ca_certs={tls.pki.ca}")
    assert "cluster" in str(caught.value).lower() and "certificate" not in str(caught.value)
    with pytest.raises(BackendError, match="certificate verify failed"):
        Queue(queue_name, url=url)


def test_a_sentinel_url_carries_tls_options_to_the_master() -> None:
    conns = Connections("rediss+sentinel://:pw@127.0.0.1:1/main?ssl_ca_certs=/ca.pem", 1.0, "k")
    try:
        pool = conns.main.connection_pool
        assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
        assert "SSL" in pool.connection_class.__name__
        assert "pw" not in conns.where
    finally:
        conns.close()
