"""Local users are attackers too. The compiled-stage cache holds native code the server runs
without re-validating it: the server uses it only when it is a directory of its own user that
nobody else may write, and only files in it that are regular files of its own (not links); any
other cache is ignored with a warning and the stage is compiled instead."""
import os
import shutil

import numpy as np
import tritonclient.http as httpclient

from attack import ROOT, Server

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
