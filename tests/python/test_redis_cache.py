"""Triton's Redis response cache (`--cache-config redis,host=…` / `redis,port=…`): two servers
share one real redis-server (Debian's, started here on a free loopback port, nothing saved), so a
request answered by one is a hit on the other, answered identically without running; a Redis
that goes away makes lookups misses, never errors, and the servers keep answering."""
import socket
import subprocess
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import Server
from test_config_fields import ADD_CONFIG, write_model
from test_response_cache import ask, stats

CACHED = ADD_CONFIG + "response_cache { enable: true }\n"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis():
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield proc, port
    proc.kill()
    proc.wait(30)


def redis_keys(port):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"DBSIZE\r\n")
        return int(s.recv(64).decode().strip().lstrip(":"))


def test_two_servers_share_answers_and_a_lost_redis_is_only_misses(tmp_path, redis):
    proc, port = redis
    repo = tmp_path / "repo"
    write_model(repo, "cached", CACHED)
    flags = ["--cache-config", "redis,host=127.0.0.1", "--cache-config", f"redis,port={port}"]
    one, two = Server(str(repo), *flags), Server(str(repo), *flags)
    try:
        c1 = httpclient.InferenceServerClient(one.http)
        c2 = httpclient.InferenceServerClient(two.http)
        ask(c1, "cached", 1.0)
        assert stats(c1, "cached") == {"hit": 0, "miss": 1, "success": 1, "inferences": 1}
        # The answer is stored in the background: wait (bounded) until Redis holds it.
        deadline = time.monotonic() + 30
        while redis_keys(port) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert redis_keys(port) == 1
        # The other server answers from it without running the model (ask() checks the values).
        ask(c2, "cached", 1.0)
        assert stats(c2, "cached") == {"hit": 1, "miss": 0, "success": 1, "inferences": 0}
        metrics = two.metrics_text()
        assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 1' in metrics, metrics
        # Redis goes away: requests are still answered, as misses.
        proc.kill()
        proc.wait(30)
        for value in (1.0, 3.0):
            ask(c2, "cached", value)
        assert stats(c2, "cached") == {"hit": 1, "miss": 2, "success": 3, "inferences": 2}
        assert "response cache in Redis" in "".join(two.log)
    finally:
        one.stop()
        two.stop()


def test_redis_settings_are_checked_at_start(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "cached", CACHED)
    from conftest import BINARY
    for flags, says in (
        (["--cache-config", "redis,host=127.0.0.1"], "the redis cache needs host and port"),
        (["--cache-config", "redis,host=h,port=1,cacert=/ca.pem"], "need tls_enabled=true"),
    ):
        done = subprocess.run([BINARY, "--model-repository", str(repo), "--http-port", "0",
                               "--grpc-port", "0", "--metrics-port", "0", *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and says in done.stderr, done.stderr


def test_redis_over_mutual_tls(tmp_path):
    """Triton's TLS settings for its Redis cache (`tls_enabled`, `cacert`, `cert`, `key`): a
    redis-server that only speaks TLS and asks for client certificates serves the cache."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from test_tls import certificate, write

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("ca", ca_key, "ca", ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    files = {
        "ca": write(tmp_path / "ca.pem", ca),
        "server_cert": write(tmp_path / "server.pem",
                             certificate("server", server_key, "ca", ca_key, server=True)),
        "server_key": write(tmp_path / "server.key", key=server_key),
        "client_cert": write(tmp_path / "client.pem",
                             certificate("client", client_key, "ca", ca_key)),
        "client_key": write(tmp_path / "client.key", key=client_key),
    }
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", files["server_cert"], "--tls-key-file", files["server_key"],
         "--tls-ca-cert-file", files["ca"], "--tls-auth-clients", "yes", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    repo = tmp_path / "repo"
    write_model(repo, "cached", CACHED)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        s = Server(str(repo), "--cache-config",
                   f"redis,host=localhost,port={port},tls_enabled=true,cacert={files['ca']},"
                   f"cert={files['client_cert']},key={files['client_key']}")
        try:
            client = httpclient.InferenceServerClient(s.http)
            ask(client, "cached", 1.0)
            # The answer reaches Redis in the background: ask until it comes back as a hit.
            deadline = time.monotonic() + 30
            while stats(client, "cached")["hit"] == 0 and time.monotonic() < deadline:
                ask(client, "cached", 1.0)
                time.sleep(0.05)
            assert stats(client, "cached")["hit"] >= 1, "".join(s.log)[-3000:]
            assert "response cache in Redis" not in "".join(s.log)
        finally:
            s.stop()
    finally:
        proc.kill()
        proc.wait(30)
