"""Wasmtron behind Ray Serve: each replica of the `Wasmtron` deployment runs one wasmtron
process on ephemeral loopback ports and forwards KServe v2 HTTP requests to it, so Serve's
proxy, autoscaling and health checks drive a fleet of servers.

    from ray import serve
    from wasmtron_ray import Wasmtron

    serve.run(Wasmtron.options(num_replicas=2).bind("/models", binary="/opt/wasmtron/bin/wasmtron"),
              route_prefix="/")
    # then any KServe v2 client (tritonclient.http) talks to Serve's HTTP address

- Health: Serve's `check_health` asks the replica's server `/v2/health/ready`, and fails as
  soon as the process has exited; Serve then replaces the replica.
- Shutdown: the replica sends SIGTERM (wasmtron drains: in-flight requests finish) and waits;
  the server also gets SIGTERM if the replica process dies (`PR_SET_PDEATHSIG`), so no
  server outlives its replica.
- The extra hop (Serve's proxy, the replica, this forward) costs latency: see
  deploy/ray/README.md for the measurement. gRPC clients should talk to wasmtron directly.
"""
import ctypes
import signal
import subprocess
import threading
import time

import aiohttp
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

# Headers that mean something to wasmtron or its clients, passed through both ways.
REQUEST_HEADERS = {"content-type", "content-encoding", "accept-encoding", "authorization",
                   "inference-header-content-length", "traceparent", "tracestate"}
RESPONSE_HEADERS = {"content-type", "content-encoding", "inference-header-content-length",
                    "www-authenticate"}
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """In the child, before exec: SIGTERM when the replica process dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(binary, model_repository, args=(), timeout_s=300.0, env=None):
    """Starts wasmtron on ephemeral loopback ports; returns (process, {service: address}) once
    it listens, or raises with its log."""
    proc = subprocess.Popen(
        [binary, "--model-repository", model_repository,
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
         "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
         "--metrics-address", "127.0.0.1", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=_die_with_parent, env=env)
    addresses, log, found = {}, [], threading.Event()

    def read():
        for line in proc.stderr:
            log.append(line)
            if len(log) > 200:
                del log[:100]
            if line.startswith("Started ") and " at " in line:
                addresses[line.split()[1]] = line.rsplit(" at ", 1)[1].strip()
                if len(addresses) == 3:
                    found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout_s) or len(addresses) < 3:
        proc.kill()
        raise RuntimeError("wasmtron did not start:\n" + "".join(log))
    return proc, addresses


@serve.deployment(health_check_period_s=5, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=45, ray_actor_options={"num_cpus": 1})
class Wasmtron:
    """One wasmtron per replica; `args` are extra wasmtron flags (not ports or addresses)."""

    def __init__(self, model_repository, binary="wasmtron", args=(), exit_timeout_s=30):
        self.exit_timeout_s = exit_timeout_s
        self.proc, self.addresses = start_server(
            binary, model_repository, [*args, "--exit-timeout-secs", str(exit_timeout_s)])
        self.base = "http://" + self.addresses["HTTPService"]
        self.session = None
        # Ready means every model loaded (wasmtron's strict readiness); wait for it here so
        # Serve routes nothing to a replica that would refuse.
        deadline = time.time() + 300
        while not self._ready_sync():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("wasmtron did not become ready")
            time.sleep(0.2)

    def _ready_sync(self):
        import urllib.request
        try:
            with urllib.request.urlopen(self.base + "/v2/health/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    async def _client(self):
        if self.session is None:
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False)
        return self.session

    async def __call__(self, request: Request) -> Response:
        """Forwards the request as it came (method, path, query, body, the headers above)."""
        session = await self._client()
        url = self.base + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() in REQUEST_HEADERS}
        async with session.request(request.method, url, data=await request.body(),
                                   headers=headers) as upstream:
            body = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() in RESPONSE_HEADERS}
            return Response(content=body, status_code=upstream.status, headers=out)

    def server(self):
        """This replica's server: its pid and addresses (HTTPService, GRPCInferenceService,
        Metrics), e.g. for clients that want gRPC without the hop."""
        return {"pid": self.proc.pid, **self.addresses}

    async def check_health(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"wasmtron exited with status {self.proc.returncode}")
        session = await self._client()
        async with session.get(self.base + "/v2/health/ready") as r:
            if r.status != 200:
                raise RuntimeError(f"wasmtron is not ready ({r.status})")

    def __del__(self):
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def app(args):
    """`serve run wasmtron_ray:app model_repository=/models binary=/path/to/wasmtron`."""
    extra = args.get("args", "")
    return Wasmtron.bind(args["model_repository"], binary=args.get("binary", "wasmtron"),
                         args=extra.split() if extra else ())


__all__ = ["Wasmtron", "app", "start_server"]
