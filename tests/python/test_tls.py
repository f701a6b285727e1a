"""gRPC over TLS and mutual TLS with Triton's flags (`--grpc-use-ssl`, `--grpc-server-cert`,
`--grpc-server-key`, `--grpc-root-cert`, `--grpc-use-ssl-mutual`; issue 42), and HTTPS on the
HTTP and metrics ports (`--http-ssl-cert`, `--http-ssl-key`), checked with the stock
tritonclient's `ssl=True` and Python's TLS client: a client that trusts the server's CA is
served, a plaintext client is not, and under mutual TLS a client without a certificate, or
with one another CA signed, is refused. Certificates are made here (the `cryptography` package), for 127.0.0.1."""
import datetime
import ipaddress
import ssl
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from conftest import BINARY, Server, copy_models, simple_inputs


def name(common):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def certificate(subject, key, issuer, issuer_key, ca=False, server=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write(path, cert=None, key=None):
    data = b""
    if cert is not None:
        data += cert.public_bytes(serialization.Encoding.PEM)
    if key is not None:
        data += key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    path.write_bytes(data)
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    files = {}
    for authority in ("ca", "other_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[authority] = (key, certificate(authority, key, authority, key, ca=True))
    ca_key, ca = files["ca"]
    server_key = ec.generate_private_key(ec.SECP256R1())
    client_key = ec.generate_private_key(ec.SECP256R1())
    other_key, other_ca = files["other_ca"]
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    return {
        "ca": write(d / "ca.pem", ca),
        "server_cert": write(d / "server.pem", certificate("server", server_key, "ca", ca_key,
                                                           server=True)),
        "server_key": write(d / "server.key", key=server_key),
        "client_cert": write(d / "client.pem", certificate("client", client_key, "ca", ca_key)),
        "client_key": write(d / "client.key", key=client_key),
        "rogue_cert": write(d / "rogue.pem", certificate("rogue", rogue_key, "other_ca",
                                                         other_key)),
        "rogue_key": write(d / "rogue.key", key=rogue_key),
    }


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    copy_models(str(path), ["simple"])
    return str(path)


def served(url, **tls):
    """Whether a client with these TLS settings gets `simple`'s answer; a client the server
    refuses must fail to connect (UNAVAILABLE), not for another reason."""
    client = grpcclient.InferenceServerClient(url, **tls)
    inputs = simple_inputs(grpcclient, np.arange(16).reshape(1, 16), np.ones((1, 16)))
    try:
        result = client.infer("simple", inputs, client_timeout=60)
        assert result.as_numpy("OUTPUT0").tolist() == [list(range(1, 17))]
        return True
    except InferenceServerException as e:
        assert e.status() == "StatusCode.UNAVAILABLE", e
        return False
    finally:
        client.close()


def test_grpc_over_tls_serves_clients_that_trust_the_server(repo, pki):
    s = Server(repo, "--grpc-use-ssl=1", "--grpc-server-cert", pki["server_cert"],
               "--grpc-server-key", pki["server_key"])
    try:
        assert served(s.grpc, ssl=True, root_certificates=pki["ca"])
        assert not served(s.grpc)  # plaintext to a TLS port
    finally:
        s.stop()


def test_mutual_tls_refuses_clients_without_a_certificate_the_root_signs(repo, pki):
    s = Server(repo, "--grpc-use-ssl-mutual=true", "--grpc-server-cert", pki["server_cert"],
               "--grpc-server-key", pki["server_key"], "--grpc-root-cert", pki["ca"])
    try:
        assert served(s.grpc, ssl=True, root_certificates=pki["ca"],
                      private_key=pki["client_key"], certificate_chain=pki["client_cert"])
        assert not served(s.grpc, ssl=True, root_certificates=pki["ca"])
        assert not served(s.grpc, ssl=True, root_certificates=pki["ca"],
                          private_key=pki["rogue_key"], certificate_chain=pki["rogue_cert"])
        # The HTTP listener is not affected.
        assert s.http
    finally:
        s.stop()


def test_https_on_the_http_and_metrics_ports(repo, pki):
    s = Server(repo, "--http-ssl-cert", pki["server_cert"], "--http-ssl-key", pki["server_key"])
    try:
        trusting = ssl.create_default_context(cafile=pki["ca"])
        with urllib.request.urlopen(f"https://{s.http}/v2/health/ready", context=trusting,
                                    timeout=60) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"https://{s.metrics}/metrics", context=trusting,
                                    timeout=60) as r:
            assert b"nv_inference_count" in r.read()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"https://{s.http}/v2/health/ready",
                                   context=ssl.create_default_context(), timeout=60)
        # gRPC stays plaintext unless --grpc-use-ssl says otherwise.
        assert served(s.grpc)
    finally:
        s.stop()


@pytest.mark.parametrize("flags,says", [
    (["--grpc-use-ssl"], "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
    (["--grpc-use-ssl-mutual", "--grpc-server-cert", "{server_cert}", "--grpc-server-key",
      "{server_key}"], "--grpc-use-ssl-mutual needs --grpc-root-cert"),
    (["--grpc-use-ssl", "--grpc-server-cert", "{ca}", "--grpc-server-key", "{ca}"],
     "--grpc-server-key"),
    (["--http-ssl-cert", "{server_cert}"], "--http-ssl-cert and --http-ssl-key go together"),
])
def test_tls_mistakes_stop_the_start_naming_the_flag(repo, pki, flags, says):
    flags = [f.format(**pki) for f in flags]
    out = subprocess.run([BINARY, "--model-repository", repo, "--http-port", "0", "--grpc-port",
                          "0", "--metrics-port", "0", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert says in out.stderr, out.stderr
