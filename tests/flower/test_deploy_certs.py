"""`fedkl deploy certs DIR` (issue 31, Operations: the README had no certificate step): a CA and a SuperLink
certificate for localhost, 127.0.0.1 and every --host, made by the code that makes a `--backend grpc` run's
own (fedkl.flower.deploy.make_certificates), in the files and roles that run passes to flower-superlink; a TLS
client that trusts only the CA completes a handshake with a server holding them, under each name."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509

from fedkl.cli import main
from fedkl.flower import deploy

pytestmark = pytest.mark.flower


def _sans(path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in ext}


def _handshake(certs, name: str) -> str:
    """A TLS server on 127.0.0.1 with the SuperLink's certificate and key; a client trusting only the CA
    connects asking for ``name``; returns the version the handshake agreed (raises if it fails)."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs / "server.pem", certs / "server.key")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    client.load_verify_locations(certs / "ca.crt")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        failed: list[BaseException] = []

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (OSError, ssl.SSLError) as e:
                failed.append(e)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with socket.create_connection(("127.0.0.1", port)) as raw:
                with client.wrap_socket(raw, server_hostname=name) as tls:
                    version = tls.version()
                    tls.sendall(b"x")
        finally:
            thread.join()
    assert not failed, failed
    return version


def test_fedkl_deploy_certs_writes_what_the_superlink_and_supernodes_take(tmp_path, capsys):
    certs = tmp_path / "certs"
    argv = ["deploy", "certs", str(certs), "--host", "coord.example.org", "--host", "10.0.0.5", "--node-keys", "2"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    for name in deploy.CERT_FILES.values():
        assert (certs / name).exists()
    assert f"--ssl-ca-certfile {certs / 'ca.crt'} --ssl-certfile {certs / 'server.pem'}" in said
    assert f"flower-supernode --root-certificates {certs / 'ca.crt'} --superlink coord.example.org:8000" in said
    for secret in ("server.key", "node-0.key", "node-1.key"):
        assert stat.S_IMODE((certs / secret).stat().st_mode) == 0o600
    assert (certs / "node-1.pub").read_text().startswith("ecdsa-sha2-nistp384 ")  # SuperNode auth's format
    assert _sans(certs / "server.pem") == {"coord.example.org", "10.0.0.5", "127.0.0.1", "localhost"}
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((certs / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    assert server.not_valid_after_utc - server.not_valid_before_utc > datetime.timedelta(days=365)
    for name in ("localhost", "coord.example.org", "127.0.0.1"):
        assert _handshake(certs, name).startswith("TLS")
    # a CA already there is never replaced silently (its nodes would be locked out)
    before = (certs / "ca.crt").read_bytes()
    assert main(["deploy", "certs", str(certs)]) == 2
    assert "already holds ca.crt" in capsys.readouterr().err and (certs / "ca.crt").read_bytes() == before
    assert main(["deploy", "certs", str(certs), "--force"]) == 0 and (certs / "ca.crt").read_bytes() != before
    assert _sans(certs / "server.pem") == {"127.0.0.1", "localhost"}


def test_a_grpc_runs_own_certificates_are_as_before(tmp_path):
    """The run's certificates (run_grpc) from the same code: 127.0.0.1 and localhost, one day, deleted with the run."""
    paths = deploy.make_certificates(tmp_path)
    assert {k: p.name for k, p in paths.items()} == deploy.CERT_FILES
    assert _sans(paths["cert"]) == {"127.0.0.1", "localhost"}
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= datetime.timedelta(days=1, minutes=5)
    assert ipaddress.ip_address("127.0.0.1") in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.IPAddress)
    with pytest.raises(ValueError, match="finite number of days"):
        deploy.make_certificates(tmp_path / "x", days=float("inf"))
