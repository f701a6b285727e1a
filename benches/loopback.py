"""Helpers shared by the Python load scripts in benches/ (loopback only)."""
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def free_ports(n):
    """`n` free TCP ports on 127.0.0.1 (for a server's HTTP, gRPC and metrics listeners)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_server(binary, repo, *extra, timeout=120):
    """Starts wasmtron on `repo` with `extra` flags on free loopback ports and waits until it
    is ready; returns (process, HTTP address, gRPC address), addresses as "127.0.0.1:PORT".
    Ends the script if the server is not ready within `timeout` seconds."""
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, ORT_DYLIB_PATH=os.environ.get(
        "ORT_DYLIB_PATH", os.path.join(ROOT, ".cache", "onnxruntime", "lib", "libonnxruntime.so")))
    proc = subprocess.Popen(
        [binary, "--model-repository", repo, "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics), "--http-address", "127.0.0.1",
         "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=5) as r:
                if r.status == 200:
                    return proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("wasmtron did not become ready")
