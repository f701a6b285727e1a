"""Idle connections cannot starve the server. Started under `ulimit -n 1024` (soft and hard, the
common default), with 1,100 TCP connections open that never send a request, the server still
answers real requests over HTTP and gRPC: it caps its connections below its file limit and sheds
the longest-idle ones to admit new ones. A connection that sends no complete request (nothing,
half a header, or only the HTTP/2 preface; on a TLS listener, an unfinished handshake) is closed
after the header timeout, and one with no request in flight after the idle timeout. Bounded: at most 1,100 sockets, loopback only."""
import os
import resource
import socket
import time

import pytest
import tritonclient.grpc as grpcclient

from attack import RANGE, Server, copy_models, simple_inputs, still_serves, ulimit_binary

IDLE_CONNECTIONS = 1100
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WAIT = 60  # generous: a loaded 2-core machine


def start(tmp_path, *extra, nofile=None):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["simple"])
    binary = ulimit_binary(tmp_path, nofile) if nofile else None
    return Server(str(repo), *extra, binary=binary)


def address(addr):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def open_idle(addr, count):
    """`count` connections that send nothing (those the server closes at once are kept too)."""
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.settimeout(10)
        try:
            s.connect(address(addr))
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def closed_by_server(sock, deadline):
    """True once the server closes `sock` (EOF or reset) before `deadline`."""
    sock.settimeout(1)
    while time.monotonic() < deadline:
        try:
            data = sock.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return True
        if data == b"":
            return True
        # HTTP/2 SETTINGS or GOAWAY frames: keep reading until the close.
    return False


@pytest.fixture(autouse=True)
def enough_descriptors_here():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE_CONNECTIONS + 512
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"this test process may open only {hard} files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_real_requests_are_served_while_1100_idle_connections_sit_on_the_server(tmp_path):
    # A long header timeout: the cap and the shedding must do the work, not the timer.
    server = start(tmp_path, "--http-header-timeout-secs", "600", nofile=1024)
    idle = []
    try:
        idle += open_idle(server.http, IDLE_CONNECTIONS // 2)
        idle += open_idle(server.grpc, IDLE_CONNECTIONS - len(idle))
        assert len(idle) > 1024  # more than the server could ever hold open
        for _ in range(5):
            still_serves(server)
        client = grpcclient.InferenceServerClient(server.grpc)
        for _ in range(5):
            r = client.infer("simple", simple_inputs(grpcclient, RANGE, RANGE))
            assert (r.as_numpy("OUTPUT0") == RANGE + RANGE).all()
        client.close()
        assert server.proc.poll() is None
        assert any("open files limit" in line for line in server.log), "".join(server.log[-20:])
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_connections_that_send_no_request_are_closed_after_the_header_timeout(tmp_path):
    server = start(tmp_path, "--http-header-timeout-secs", "1", "--http-idle-timeout-secs", "600")
    try:
        silent_http = open_idle(server.http, 1)[0]
        half_header = open_idle(server.http, 1)[0]
        half_header.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n")
        preface_only = open_idle(server.grpc, 1)[0]
        preface_only.sendall(H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        deadline = time.monotonic() + WAIT
        for name, sock in (("silent", silent_http), ("half header", half_header),
                           ("HTTP/2 preface only", preface_only)):
            assert closed_by_server(sock, deadline), f"{name} connection still open"
            sock.close()
        still_serves(server)
    finally:
        server.stop()


def test_a_connection_idle_after_its_requests_is_closed_after_the_idle_timeout(tmp_path):
    server = start(tmp_path, "--http-idle-timeout-secs", "1")
    try:
        sock = open_idle(server.http, 1)[0]
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(WAIT)
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first
        assert closed_by_server(sock, time.monotonic() + WAIT)
        sock.close()
        still_serves(server)
    finally:
        server.stop()


def test_a_long_request_is_not_mistaken_for_an_idle_connection(tmp_path):
    """A request in flight holds its connection open past the idle timeout: a gRPC stream that
    stays open across several idle periods keeps answering."""
    server = start(tmp_path, "--http-idle-timeout-secs", "1", "--http-header-timeout-secs", "1")
    try:
        client = grpcclient.InferenceServerClient(server.grpc)
        answers = []
        client.start_stream(callback=lambda result, error: answers.append((result, error)))
        for _ in range(3):
            client.async_stream_infer("simple", simple_inputs(grpcclient, RANGE, RANGE))
            time.sleep(2.5)  # longer than both timeouts, while the stream is open
        client.stop_stream()
        client.close()
        assert len(answers) == 3 and all(err is None for _, err in answers), answers
    finally:
        server.stop()


def test_requests_whose_body_never_comes_do_not_hold_the_server(tmp_path):
    """Every connection at the cap has sent complete headers and then nothing (a slow-body
    attack): a new connection takes the place of the one silent longest."""
    server = start(tmp_path, "--max-connections", "20", "--http-header-timeout-secs", "1")
    stalled = []
    try:
        for _ in range(20):
            s = open_idle(server.http, 1)[0]
            s.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            stalled.append(s)
        time.sleep(2)  # silent for longer than the header timeout
        for _ in range(3):
            still_serves(server)
    finally:
        for s in stalled:
            s.close()
        server.stop()


def test_tls_handshakes_that_never_finish_are_closed_after_the_header_timeout(tmp_path):
    # The TLS listener's handshake gets the time a request's headers get: a client that says
    # nothing, one that sends half a ClientHello and one that sends garbage hold no connection
    # past it, and clients that finish their handshake are served meanwhile.
    from test_tls import pki as make_pki

    class Dirs:
        def mktemp(self, name):
            path = tmp_path / name
            path.mkdir()
            return path

    pki = make_pki.__wrapped__(Dirs())
    server = start(tmp_path, "--http-header-timeout-secs", "1", "--grpc-use-ssl=true",
                   "--grpc-server-cert", pki["server_cert"], "--grpc-server-key",
                   pki["server_key"])
    try:
        silent = open_idle(server.grpc, 1)[0]
        half_hello = open_idle(server.grpc, 1)[0]
        half_hello.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        garbage = open_idle(server.grpc, 1)[0]
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n")
        deadline = time.monotonic() + WAIT
        for name, sock in (("silent", silent), ("half a ClientHello", half_hello),
                           ("not TLS", garbage)):
            assert closed_by_server(sock, deadline), f"{name} connection still open"
            sock.close()
        g = grpcclient.InferenceServerClient(server.grpc, ssl=True, root_certificates=pki["ca"])
        r = g.infer("simple", simple_inputs(grpcclient, RANGE, RANGE))
        assert (r.as_numpy("OUTPUT0") == RANGE + RANGE).all()
        g.close()
    finally:
        server.stop()
