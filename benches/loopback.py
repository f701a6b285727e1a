"""Helpers shared by the Python load scripts in benches/ (loopback only)."""
import socket


def free_ports(n):
    """`n` free TCP ports on 127.0.0.1 (for a server's HTTP, gRPC and metrics listeners)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
