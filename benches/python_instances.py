"""Python-backend instances: how long one takes to start and what 1 and 8 of them cost in
memory, started from the snapshot of the first import against started in full (the same
server and model with `parameters { key: "instance_snapshot" value: { string_value: "off" } }`),
side by side in one run.

    python3 benches/python_instances.py [--model add_sub|topk|mean_pool]

The model is one of benches/triton/'s twins (the `model.py` Triton's Python backend runs in
the side-by-side benches). For each case a release server starts on a fresh repository with
the model at `count` instances; 16 clients send requests until every instance has started
(instances start at their first batch); then the server's memory is read from
/proc/<pid>/smaps_rollup: RSS, and PSS (pages shared between instances counted once over the
sharers: what the machine pays). Start times are the server's own (its debug log, from the
instantiation to `initialize` returned), median over the instances started after the first.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import tritonclient.http as httpclient

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "release", "wasmtron"))
STARTED = re.compile(r'Python instance started model=\S+ instance=(\d+) from="(\w+)" us=(\d+)')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def inputs(model):
    """One request's inputs for a twin."""
    def tensor(name, data, dtype):
        t = httpclient.InferInput(name, list(data.shape), dtype)
        t.set_data_from_numpy(data)
        return t
    if model == "add_sub":
        return [tensor(n, np.ones(4, np.float32), "FP32") for n in ("INPUT0", "INPUT1")]
    if model == "topk":
        return [tensor("SCORES", np.linspace(0, 1, 1000, dtype=np.float32), "FP32")]
    if model == "mean_pool":
        return [tensor("last_hidden_state", np.ones((1, 16, 384), np.float32), "FP32"),
                tensor("attention_mask", np.ones((1, 16), np.int64), "INT64")]
    raise SystemExit(f"--model: one of add_sub, topk, mean_pool (got {model})")


def run(model, count, snapshot, work, fresh=False):
    repo = tempfile.mkdtemp(prefix="instances-")
    try:
        dest = os.path.join(repo, model)
        shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", model), dest)
        config = os.path.join(dest, "config.pbtxt")
        text = open(config).read()
        text = re.sub(r"instance_group \[[^\]]*\]", "", text)
        text += f"\ninstance_group [ {{ kind: KIND_CPU, count: {count} }} ]\n"
        if not snapshot:
            text += 'parameters { key: "instance_snapshot" value: { string_value: "off" } }\n'
        if fresh:
            # A new interpreter for every request: one client's requests start one instance
            # after another on an otherwise idle server.
            text += ('parameters { key: "fresh_instance_per_request" '
                     'value: { string_value: "true" } }\n')
        open(config, "w").write(text)
        log = []
        proc = subprocess.Popen(
            [BINARY, "--model-repository", repo, "--http-port", "0", "--grpc-port", "0",
             "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address",
             "127.0.0.1", "--metrics-address", "127.0.0.1", "--log-verbose=1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=lambda: [log.append(ANSI.sub("", l)) for l in proc.stderr],
                         daemon=True).start()
        try:
            deadline = time.monotonic() + 300
            while not any("Started HTTPService" in l for l in log):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("server did not start:\n" + "".join(log))
                time.sleep(0.1)
            url = next(l for l in log if "Started HTTPService" in l).rsplit(" at ", 1)[1].strip()
            started = lambda: [m.groups() for m in map(STARTED.search, log) if m]
            stop = threading.Event()

            def client():
                c = httpclient.InferenceServerClient(url, network_timeout=300)
                while not stop.is_set():
                    c.infer(model, work)

            if fresh:
                c = httpclient.InferenceServerClient(url, network_timeout=300)
                for _ in range(21):
                    c.infer(model, work)
            else:
                threads = [threading.Thread(target=client, daemon=True) for _ in range(16)]
                [t.start() for t in threads]
                while len({i for i, _, _ in started()}) < count and time.monotonic() < deadline:
                    time.sleep(0.2)
                stop.set()
                [t.join() for t in threads]
            time.sleep(1)
            memory = {}
            for line in open(f"/proc/{proc.pid}/smaps_rollup"):
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss"):
                    memory[key] = int(value.split()[0]) / 1024
            starts = started()
            later = [int(us) / 1000 for i, _, us in (starts[1:] if fresh else starts)
                     if fresh or i != "0"]
            first = [int(us) / 1000 for i, _, us in starts[:1]]
            return {"first_ms": first[0] if first else None,
                    "start_ms": statistics.median(later) if later else None,
                    "from": sorted({f for _, f, _ in started()}), **memory}
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="add_sub", choices=["add_sub", "topk", "mean_pool"])
    args = parser.parse_args()
    work = inputs(args.model)
    rows = {}
    for snapshot in (False, True):
        for count in (1, 8, "fresh"):
            fresh = count == "fresh"
            rows[(snapshot, count)] = run(args.model, 1 if fresh else count, snapshot, work, fresh)
            print(f"snapshot={snapshot} count={count}: {rows[(snapshot, count)]}", file=sys.stderr)
    print(f"\n{args.model}: Python-backend instances, started in full vs from the snapshot\n")
    print("| | first instance ms | a later one, idle server (median of 20) | 7 more under "
          "16 clients (median) | RSS 1 / 8 MiB | PSS 1 / 8 MiB | PSS 8 ÷ 1 |")
    print("|---|---|---|---|---|---|---|")
    for snapshot, label in ((False, "in full (instance_snapshot off)"), (True, "from snapshot")):
        one, eight, fresh = rows[(snapshot, 1)], rows[(snapshot, 8)], rows[(snapshot, "fresh")]
        print(f"| {label} | {one['first_ms']:.0f} | {fresh['start_ms']:.1f} "
              f"| {eight['start_ms']:.1f} "
              f"| {one['Rss']:.0f} / {eight['Rss']:.0f} | {one['Pss']:.0f} / {eight['Pss']:.0f} "
              f"| {eight['Pss'] / one['Pss']:.2f} |")


if __name__ == "__main__":
    main()
