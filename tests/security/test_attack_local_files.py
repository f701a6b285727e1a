"""Local users are attackers too. The compiled-stage cache holds native code the server runs
without re-validating it: the server uses it only when it is a directory of its own user that
nobody else may write, and only files in it that are regular files of its own (not links); any
other cache is ignored with a warning and the stage is compiled instead."""
import os
import shutil

import numpy as np
import tritonclient.http as httpclient

from attack import ROOT, Server, raw

X = np.arange(4, dtype=np.float32).reshape(1, 4)


def start(tmp_path, cache):
    repo = tmp_path / "repo"
    if not repo.exists():
        repo.mkdir()
        shutil.copytree(os.path.join(ROOT, "tests", "models", "probe"), repo / "probe")
    return Server(str(repo), "--wasm-cache-dir", str(cache))


def echoes(server):
    t = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    t.set_data_from_numpy(X)
    r = httpclient.InferenceServerClient(server.http, network_timeout=120).infer("probe", [t])
    assert (r.as_numpy("OUTPUT0") == X).all()


def logged(server, text):
    return any(text in line for line in server.log)


def test_a_cache_others_may_write_is_not_used(tmp_path):
    cache = tmp_path / "open-cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    s = start(tmp_path, cache)
    try:
        echoes(s)
        assert logged(s, "not using the compiled-stage cache"), "".join(s.log[-20:])
        assert logged(s, "lets others write"), "".join(s.log[-20:])
        assert os.listdir(cache) == []
    finally:
        s.stop()


def test_a_cache_that_is_a_link_is_not_used(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "cache-link"
    link.symlink_to(target)
    s = start(tmp_path, link)
    try:
        echoes(s)
        assert logged(s, "symbolic link"), "".join(s.log[-20:])
        assert os.listdir(target) == []
    finally:
        s.stop()


def test_a_private_cache_is_used_and_planted_links_in_it_are_ignored(tmp_path):
    cache = tmp_path / "cache"
    s = start(tmp_path, cache)
    try:
        echoes(s)
    finally:
        s.stop()
    assert oct(os.stat(cache).st_mode & 0o777) == oct(0o700)
    compiled = [n for n in os.listdir(cache) if n.endswith(".cwasm")]
    assert len(compiled) == 1, os.listdir(cache)
    path = cache / compiled[0]
    assert os.stat(path).st_mode & 0o077 == 0
    # Replaced by a link to another file (as someone who could write there would): ignored.
    decoy = tmp_path / "decoy.cwasm"
    shutil.copy(path, decoy)
    os.unlink(path)
    path.symlink_to(decoy)
    s = start(tmp_path, cache)
    try:
        echoes(s)
        assert logged(s, "ignoring a compiled component"), "".join(s.log[-20:])
    finally:
        s.stop()


def test_a_cache_swapped_for_a_link_after_start_is_not_followed(tmp_path):
    # The cache is opened once, as a directory, and every later read, write, rename and removal
    # is relative to that open directory: a local user who swaps the path for a link to a
    # victim's folder while the server runs (while a stage compiles, say) steers nothing there.
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(os.path.join(ROOT, "tests", "models", "probe"), repo / "probe")
    shutil.copytree(os.path.join(ROOT, "tests", "models", "probe"), repo / "probe2")
    # Other bytes (a custom section at the end), so that the second stage compiles anew.
    with open(repo / "probe2" / "1" / "model.wasm", "ab") as f:
        f.write(bytes([0, 4, 2]) + b"wtx")
    cache = tmp_path / "cache"
    s = Server(str(repo), "--wasm-cache-dir", str(cache), "--wasm-cache-max-mb", "0",
               "--model-control-mode", "explicit", "--load-model", "probe")
    try:
        echoes(s)
        first = [n for n in os.listdir(cache) if n.endswith(".cwasm")]
        assert len(first) == 1, os.listdir(cache)
        moved = tmp_path / "moved"
        os.rename(cache, moved)
        victim = tmp_path / "victim"
        victim.mkdir(mode=0o700)
        (victim / "precious.cwasm").write_bytes(b"x" * 4096)
        (victim / "keep.txt").write_text("precious")
        cache.symlink_to(victim)
        status, body = raw(s.http, "POST", "/v2/repository/models/probe2/load", {})
        assert status == 200, body
        # The new entry went into the directory that was opened, and pruning (a bound of 0
        # keeps only the newest) removed the old one there; the victim's files are untouched.
        assert sorted(os.listdir(victim)) == ["keep.txt", "precious.cwasm"]
        assert (victim / "precious.cwasm").read_bytes() == b"x" * 4096
        now = [n for n in os.listdir(moved) if n.endswith(".cwasm")]
        assert len(now) == 1 and now != first, (first, now)
        echoes(s)
    finally:
        s.stop()


def test_a_client_cannot_point_the_trace_file_elsewhere(tmp_path):
    """Triton's trace files are written where the operator's --trace-config says; a client
    that asks the trace settings API (HTTP or per model) to write them elsewhere, or in
    another mode, is refused naming the setting (in Triton's words for the file), and nothing
    is written there; how often they are cut may change (as on Triton), beside the
    operator's file only."""
    from attack import plant_victim, still_serves
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(os.path.join(ROOT, "model_repository", "simple"), repo / "simple")
    victim, untouched = plant_victim(tmp_path)
    trace = tmp_path / "trace.json"
    s = Server(str(repo), f"--trace-config=triton,file={trace}", "--trace-config=level=TIMESTAMPS",
               "--trace-config=rate=1")
    try:
        for path in ("/v2/trace/setting", "/v2/models/simple/trace/setting"):
            for setting, says in (
                    ({"trace_file": str(victim / "keep.txt")}, "trace file location can not"),
                    ({"trace_file": str(victim / "new.json")}, "trace file location can not"),
                    ({"trace_mode": "opentelemetry"}, "trace_mode cannot be changed")):
                status, body = raw(s.http, "POST", path, setting)
                assert status == 400 and says in str(body), (status, body)
            status, body = raw(s.http, "POST", path, {"log_frequency": "1"})
            assert status == 200 and body["trace_file"] == str(trace), body
        still_serves(s)
        untouched()
    finally:
        s.stop()
    # The traced requests went to the operator's file (and its indexed siblings), only there.
    assert "simple" in "".join(p.read_text() for p in tmp_path.glob("trace.json*"))
    untouched()
