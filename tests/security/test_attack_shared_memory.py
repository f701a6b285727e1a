"""System shared memory cannot be turned against the host: a key that another local user made a
symbolic link (to a file only root may read) or a FIFO is refused, regions are checked against
the object's real size at every use (an object truncated after registration is an error, not a
SIGBUS that kills the server), an output region cannot claim more bytes than its object holds,
and one request cannot make the server copy more than its request size limit out of shared
memory."""
import os
import stat

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from attack import Server, copy_models, error_text, raw, still_serves, ulimit_binary

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("shm")
    copy_models(str(repo), ["simple"])
    s = Server(str(repo), "--http-max-input-size", str(LIMIT), "--allow-client-shm=true")
    yield s
    s.stop()


@pytest.fixture
def key(request):
    name = f"wt_attack_{os.getpid()}_{request.node.name}".replace("[", "_").replace("]", "")
    path = f"/dev/shm/{name}"
    yield name, path
    if os.path.lexists(path):
        os.unlink(path)


def register_http(server, name, key, byte_size, offset=0):
    return raw(server.http, "POST", f"/v2/systemsharedmemory/region/{name}/register",
               {"key": key, "offset": offset, "byte_size": byte_size})


def infer_body(inputs_params, outputs=None):
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "parameters": p}
                       for n, p in inputs_params.items()]}
    if outputs is not None:
        body["outputs"] = outputs
    return body


def test_a_key_planted_as_a_link_to_a_private_file_is_refused(server, key, tmp_path):
    name, path = key
    secret = tmp_path / "root-only"
    secret.write_bytes(b"S" * 4096)
    os.chmod(secret, 0o600)
    os.symlink(secret, path)
    status, body = register_http(server, "leak", f"/{name}", 4096)
    assert status == 400, (status, body)
    assert "symbolic link" in error_text(body), body
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as e:
        client.register_system_shared_memory("leak", f"/{name}", 4096)
    assert "symbolic link" in e.value.message(), e.value
    assert client.get_system_shared_memory_status().regions == {}
    client.close()
    # Neither leaked (no region to read) nor overwritten.
    assert secret.read_bytes() == b"S" * 4096
    still_serves(server)


def test_a_fifo_key_is_refused_without_blocking(server, key):
    name, path = key
    os.mkfifo(path)
    status, body = register_http(server, "fifo", f"/{name}", 64)
    assert status == 400, (status, body)
    assert "not a regular" in error_text(body), body
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    still_serves(server)


def test_an_output_region_cannot_claim_more_than_its_object(server, key):
    name, _ = key
    handle = shm.create_shared_memory_region("out", f"/{name}", 4096)
    try:
        assert register_http(server, "out4k", f"/{name}", 4096)[0] == 200
        data = list(range(16))
        body = {
            "inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": data}
                       for n in ("INPUT0", "INPUT1")],
            "outputs": [{"name": "OUTPUT0", "parameters": {
                "shared_memory_region": "out4k", "shared_memory_byte_size": 2 ** 63}}],
        }
        status, answer = raw(server.http, "POST", "/v2/models/simple/infer", body)
        assert status == 400, (status, answer)
        assert "Invalid offset + byte size for shared memory region: 'out4k'" in \
            error_text(answer), answer
        body["outputs"][0]["parameters"].update(shared_memory_byte_size=64,
                                                shared_memory_offset=4090)
        status, answer = raw(server.http, "POST", "/v2/models/simple/infer", body)
        assert status == 400, (status, answer)
        assert "for shared memory region: 'out4k'" in error_text(answer), answer
    finally:
        raw(server.http, "POST", "/v2/systemsharedmemory/region/out4k/unregister", {})
        shm.destroy_shared_memory_region(handle)
    still_serves(server)


def test_an_object_truncated_after_registration_is_an_error_not_a_crash(server, key):
    name, path = key
    handle = shm.create_shared_memory_region("trunc", f"/{name}", 4096)
    try:
        assert register_http(server, "trunc", f"/{name}", 4096)[0] == 200
        os.truncate(path, 0)
        params = {"shared_memory_region": "trunc", "shared_memory_byte_size": 64}
        for proto in ("http", "grpc"):
            if proto == "http":
                status, answer = raw(server.http, "POST", "/v2/models/simple/infer",
                                     infer_body({"INPUT0": params, "INPUT1": params}))
                assert status == 400, (status, answer)
                assert "truncated" in error_text(answer), answer
            else:
                client = grpcclient.InferenceServerClient(server.grpc)
                inputs = []
                for n in ("INPUT0", "INPUT1"):
                    t = grpcclient.InferInput(n, [1, 16], "INT32")
                    t.set_shared_memory("trunc", 64)
                    inputs.append(t)
                with pytest.raises(InferenceServerException) as e:
                    client.infer("simple", inputs)
                assert "truncated" in e.value.message(), e.value
                client.close()
        # Outputs into the truncated object: refused the same way.
        out = {"name": "OUTPUT0", "parameters": {"shared_memory_region": "trunc",
                                                 "shared_memory_byte_size": 64}}
        body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32",
                            "data": list(range(16))} for n in ("INPUT0", "INPUT1")],
                "outputs": [out]}
        status, answer = raw(server.http, "POST", "/v2/models/simple/infer", body)
        assert status == 400, (status, answer)
        assert "truncated" in error_text(answer), answer
    finally:
        raw(server.http, "POST", "/v2/systemsharedmemory/region/trunc/unregister", {})
        shm.destroy_shared_memory_region(handle)
    assert server.proc.poll() is None, "".join(server.log[-20:])
    still_serves(server)


def test_one_request_copies_at_most_its_size_limit_from_shared_memory(server, key):
    name, _ = key
    handle = shm.create_shared_memory_region("big", f"/{name}", LIMIT)
    try:
        assert register_http(server, "big", f"/{name}", LIMIT)[0] == 200
        params = {"shared_memory_region": "big", "shared_memory_byte_size": LIMIT}
        status, answer = raw(server.http, "POST", "/v2/models/simple/infer",
                             infer_body({"INPUT0": params, "INPUT1": params}))
        assert status == 400, (status, answer)
        assert f"more than {LIMIT} bytes" in error_text(answer), answer
    finally:
        raw(server.http, "POST", "/v2/systemsharedmemory/region/big/unregister", {})
        shm.destroy_shared_memory_region(handle)
    still_serves(server)


def test_keys_naming_other_files_are_refused(server):
    for bad in ["/../etc/passwd", "../etc/passwd", "/a/b", "/", "", "/..", "/x\\..\\y"]:
        status, body = register_http(server, "bad", bad, 64)
        assert status == 400, (bad, status, body)
        said = error_text(body)
        # Slashes alone get Triton's words; other bad keys say what a key must be.
        assert "POSIX shared memory name" in said or "invalid shm key" in said, (bad, body)
    client = httpclient.InferenceServerClient(server.http)
    assert client.get_system_shared_memory_status() == []


def test_many_regions_do_not_use_up_the_servers_descriptors(tmp_path, key):
    """Regions hold no open file: 300 of them on a server limited to 256 open files, and real
    requests (new connections) are still answered."""
    name, _ = key
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["simple"])
    server = Server(str(repo), "--allow-client-shm=true", binary=ulimit_binary(tmp_path, 256))
    handle = shm.create_shared_memory_region("many", f"/{name}", 64)
    try:
        for i in range(300):
            status, body = register_http(server, f"r{i}", f"/{name}", 64)
            assert status == 200, (i, status, body)
        still_serves(server)
    finally:
        raw(server.http, "POST", "/v2/systemsharedmemory/unregister", {})
        shm.destroy_shared_memory_region(handle)
        server.stop()
