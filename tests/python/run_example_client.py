"""Runs one of Triton's example clients unchanged against a test server.

The clients name `localhost:8000` (HTTP), `localhost:8001` (gRPC) and `localhost:8002`
(metrics); tests serve on ephemeral ports, so the clients' connections are pointed there:
`run_example_client.py HTTP GRPC METRICS client.py`, or `... -m pytest test_file.py` for a
test module."""
import runpy
import sys

http, grpc, metrics, script = sys.argv[1:5]
ADDRESSES = {"localhost:8000": http, "localhost:8001": grpc, "localhost:8002": metrics}


def rewrite(url):
    for theirs, ours in ADDRESSES.items():
        url = url.replace(theirs, ours)
    return url


def redirect(cls):
    original = cls.__init__

    def init(self, url, *args, **kwargs):
        original(self, rewrite(url), *args, **kwargs)

    cls.__init__ = init


import requests  # noqa: E402
import tritonclient.grpc  # noqa: E402
import tritonclient.http  # noqa: E402

redirect(tritonclient.http.InferenceServerClient)
redirect(tritonclient.grpc.InferenceServerClient)
_request = requests.Session.request
requests.Session.request = lambda self, method, url, *a, **kw: _request(self, method, rewrite(url), *a, **kw)

if script == "-m":
    # `-m pytest test_file.py ...`: a module run with its arguments (Triton's QA unittests).
    sys.argv = sys.argv[5:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
