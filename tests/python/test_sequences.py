"""Stateful models through the sequence batcher, with the stock tritonclient: sequence IDs and
START / END flags over HTTP and gRPC, control tensors, implicit state, idle release, batching
across sequences, and the streaming voice-activity pipeline (`vad` stage + silero-vad)
compared with silero-vad's own way of running its ONNX model."""
import glob
import os
import shutil
import threading
import time
import zipfile

import numpy as np
import onnxruntime
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server, model_variant

TEST_MODELS = os.path.join(ROOT, "tests", "models")
# accumulate's first state, from its initial_state/hundred file.
FIRST = 100


def variant(repo, name, replace, source=os.path.join(TEST_MODELS, "accumulate")):
    """A copy of the model at `source` named `name`, its config edited by `replace`."""
    model_variant(repo, name, source, replace)


# An ensemble whose one step is the stateful model: the sequence parameters pass through.
ENSEMBLE = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "accumulate" model_version: -1
  input_map { key: "INPUT" value: "X" } output_map { key: "OUTPUT" value: "SUM" } } ] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("sequences"))
    shutil.copytree(os.path.join(TEST_MODELS, "accumulate"), os.path.join(repo, "accumulate"))
    shutil.copytree(os.path.join(TEST_MODELS, "instance_sum"), os.path.join(repo, "instance_sum"))
    variant(repo, "accumulate_idle",
            [("max_sequence_idle_microseconds: 30000000", "max_sequence_idle_microseconds: 300000")])
    # Batches of exactly 4: the queue waits (up to 60 s) for four sequences' requests, all on
    # the one instance (a sequence's requests run on the instance it started on).
    variant(repo, "accumulate_batched",
            [("max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: 60000000"),
             ("sequence_batching {",
              "instance_group [ { kind: KIND_CPU count: 1 } ]\nsequence_batching {")])
    os.makedirs(os.path.join(repo, "running_sum", "1"))
    with open(os.path.join(repo, "running_sum", "config.pbtxt"), "w") as f:
        f.write(ENSEMBLE)
    for name in ("silero_vad", "vad"):
        shutil.copytree(os.path.join(ROOT, "model_repository", name), os.path.join(repo, name))
    variant(repo, "vad_batched",
            [("direct { max_queue_delay_microseconds: 500 }",
              "oldest { max_queue_delay_microseconds: 60000000 preferred_batch_size: [ 4 ] }"),
             ("count: 2", "count: 1")],
            source=os.path.join(ROOT, "model_repository", "vad"))
    s = Server(repo)
    yield s
    s.stop()


def client(server, protocol):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(server.http, network_timeout=120)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc)


def step(mod, c, value, sequence_id, start=False, end=False, model="accumulate"):
    tensor = mod.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    r = c.infer(model, [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    return {name: r.as_numpy(name).item()
            for name in ("OUTPUT", "START_OUT", "END_OUT", "READY_OUT", "CORRID_OUT")}


def concurrently(run, ids):
    """Runs `run(id)` for every id at once, each in a thread; raises what any of them raised."""
    errors = []

    def guarded(sid):
        try:
            run(sid)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_interleaved_sequences_keep_their_own_state(server, protocol):
    mod, c = client(server, protocol)
    base = 1000 if protocol == "http" else 2000
    a, b = base + 1, base + 2
    first = step(mod, c, 5, a, start=True)
    assert first == {"OUTPUT": FIRST + 5, "START_OUT": 1, "END_OUT": 0.0, "READY_OUT": True,
                     "CORRID_OUT": a}
    assert step(mod, c, 7, b, start=True)["OUTPUT"] == FIRST + 7
    middle = step(mod, c, 1, a)
    assert middle["OUTPUT"] == FIRST + 6 and middle["START_OUT"] == 0 and middle["CORRID_OUT"] == a
    last = step(mod, c, 3, b, end=True)
    assert last["OUTPUT"] == FIRST + 10 and last["END_OUT"] == 1.0 and last["CORRID_OUT"] == b
    assert step(mod, c, 1, a, end=True)["OUTPUT"] == FIRST + 7
    # A new START with an ID that was used before starts from the initial state again.
    assert step(mod, c, 2, a, start=True, end=True)["OUTPUT"] == FIRST + 2


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_sequence_requests_are_refused_by_name(server, protocol):
    mod, c = client(server, protocol)
    base = 3000 if protocol == "http" else 4000

    def refused(**kwargs):
        with pytest.raises(InferenceServerException) as e:
            step(mod, c, 1, **kwargs)
        text = str(e.value)
        assert "400" in text or "INVALID_ARGUMENT" in text, text
        return text

    text = refused(sequence_id=0)
    assert "model 'accumulate' must specify a non-zero or non-empty correlation ID" in text
    text = refused(sequence_id=base + 1)
    assert f"sequence {base + 1} to model 'accumulate' must specify the START flag" in text
    step(mod, c, 1, base + 2, start=True, end=True)
    text = refused(sequence_id=base + 2)
    assert "must specify the START flag" in text, "a sequence is over after its END"
    text = refused(sequence_id="text-id", start=True)
    assert "correlation ID input 'CORRID' is TYPE_UINT64" in text
    # One row per request of a sequence.
    rows = mod.InferInput("INPUT", [2, 1], "INT32")
    rows.set_data_from_numpy(np.array([[1], [2]], dtype=np.int32))
    with pytest.raises(InferenceServerException,
                       match="must specify batch-size 1 due to requirements of sequence batcher"):
        c.infer("accumulate", [rows], sequence_id=base + 3, sequence_start=True)
    # The server still serves, and a refused START left nothing behind.
    assert step(mod, c, 4, base + 3, start=True)["OUTPUT"] == FIRST + 4


def test_a_client_may_ask_for_a_state_listed_as_an_output(server):
    c = grpcclient.InferenceServerClient(server.grpc)
    x = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[3]], dtype=np.int32))
    only_state = [grpcclient.InferRequestedOutput("ACC_OUT")]
    r = c.infer("accumulate", [x], outputs=only_state, sequence_id=7001, sequence_start=True)
    assert r.as_numpy("ACC_OUT").item() == FIRST + 3 and r.as_numpy("OUTPUT") is None
    r = c.infer("accumulate", [x], sequence_id=7001, sequence_end=True)
    assert r.as_numpy("ACC_OUT").item() == r.as_numpy("OUTPUT").item() == FIRST + 6


def test_the_server_announces_the_sequence_extension(server):
    metadata = httpclient.InferenceServerClient(server.http).get_server_metadata()
    assert "sequence" in metadata["extensions"]


def test_an_ensemble_step_keeps_the_sequence(server):
    c = grpcclient.InferenceServerClient(server.grpc)

    def add(value, **flags):
        x = grpcclient.InferInput("X", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        return c.infer("running_sum", [x], sequence_id=6001, **flags).as_numpy("SUM").item()

    assert [add(1, sequence_start=True), add(2), add(3, sequence_end=True)] == [FIRST + 1, FIRST + 3, FIRST + 6]
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        add(4)


def test_string_sequence_ids(server):
    # Triton takes strings as correlation IDs too; the vad stage has no CORRID input to type.
    c = grpcclient.InferenceServerClient(server.grpc)
    chunk = grpcclient.InferInput("AUDIO", [1, 512], "FP32")
    chunk.set_data_from_numpy(np.zeros((1, 512), dtype=np.float32))
    for k in range(3):
        r = c.infer("vad", [chunk], sequence_id="stream-1", sequence_start=k == 0)
        assert r.as_numpy("SPEECH_PROBABILITY").shape == (1, 1)
    with pytest.raises(InferenceServerException, match='sequence "stream-2"'):
        c.infer("vad", [chunk], sequence_id="stream-2")


def test_idle_sequences_are_released(server):
    c = grpcclient.InferenceServerClient(server.grpc)
    assert step(grpcclient, c, 1, 5001, start=True, model="accumulate_idle")["OUTPUT"] == FIRST + 1
    time.sleep(1.5)  # five times the model's max_sequence_idle_microseconds
    with pytest.raises(InferenceServerException, match="max_sequence_idle_microseconds"):
        step(grpcclient, c, 1, 5001, model="accumulate_idle")
    assert step(grpcclient, c, 2, 5001, start=True, model="accumulate_idle")["OUTPUT"] == FIRST + 2


def test_a_sequence_stays_on_one_instance_of_a_model_that_keeps_state_in_it(server):
    """L0_sequence_batcher (test_simple_sequence, test_no_sequence_end with a Python model of
    4 instances): a model that keeps each sequence's sum in its instance sees all of the
    sequence's requests, and sequences started together spread over the instances."""
    sequences, steps = 8, 6
    c = grpcclient.InferenceServerClient(server.grpc)

    def add(sid, value, start=False, end=False):
        tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        r = c.infer("instance_sum", [tensor], sequence_id=sid, sequence_start=start,
                    sequence_end=end)
        return r.as_numpy("SUM").item(), r.as_numpy("INSTANCE").item()

    ids = [7000 + k for k in range(sequences)]
    # Every sequence is live before any continues, so each starts on the least-loaded instance.
    seen = {sid: [add(sid, sid, start=True)] for sid in ids}

    def run(sid):
        for k in range(1, steps):
            seen[sid].append(add(sid, k, end=k == steps - 1))

    concurrently(run, ids)
    for sid in ids:
        sums = [s for s, _ in seen[sid]]
        assert sums == list(np.cumsum([sid] + list(range(1, steps)))), (sid, sums)
        assert len({i for _, i in seen[sid]}) == 1, (sid, seen[sid])
    by_instance = {}
    for sid in ids:
        by_instance.setdefault(seen[sid][0][1], []).append(sid)
    assert sorted(len(v) for v in by_instance.values()) == [2, 2, 2, 2], by_instance


def test_requests_of_different_sequences_batch_together(server):
    """Four sequences at once: every execution holds one request of each (the queue waits for
    four), and each sequence still adds up only its own values."""
    sequences, steps = 4, 10
    results = {}

    def run(sid):
        c = grpcclient.InferenceServerClient(server.grpc)
        values = [sid * 10 + k for k in range(steps)]
        outs = [step(grpcclient, c, v, sid, start=k == 0, end=k == steps - 1,
                     model="accumulate_batched")["OUTPUT"]
                for k, v in enumerate(values)]
        results[sid] = (values, outs)

    concurrently(run, range(1, sequences + 1))
    for sid, (values, outs) in results.items():
        assert outs == list(FIRST + np.cumsum(values)), sid
    stats = grpcclient.InferenceServerClient(server.grpc).get_inference_statistics(
        "accumulate_batched", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) == sequences * steps
    assert int(stats["execution_count"]) == steps


def silero_reference(chunks):
    """Speech probabilities as silero-vad's OnnxWrapper computes them (utils_vad.py, whose
    torch calls are plain array operations): each 512-sample chunk runs with the 64 samples
    before it, the recurrent state carries over, and both start as zeros."""
    wheel = glob.glob(os.path.join(ROOT, ".cache", "wheels", "silero_vad-6.2.3-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        model = z.read("silero_vad/data/silero_vad_16k_op15.onnx")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), dtype=np.float32)
    context = np.zeros((1, 64), dtype=np.float32)
    out = []
    for chunk in chunks:
        x = np.concatenate([context, chunk[None, :]], axis=1)
        p, state = session.run(None, {"input": x, "state": state, "sr": np.array(16000, dtype=np.int64)})
        context = x[:, -64:]
        out.append(float(p[0, 0]))
    return np.array(out)


def audio(seed, voiced):
    """Two seconds of 16 kHz audio: quiet noise, then (if `voiced`) a buzzing harmonic tone
    with a syllable-rate envelope, which silero-vad takes for speech."""
    rng = np.random.default_rng(seed)
    t = np.arange(16000) / 16000
    tone = sum(a * np.sin(2 * np.pi * f * t) for f, a in ((150, 1.0), (300, 0.5), (450, 0.3)))
    second = 0.3 * tone * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)) if voiced else 0 * t
    samples = np.concatenate([0.01 * rng.standard_normal(16000), second + 0.02 * rng.standard_normal(16000)])
    return samples.astype(np.float32)[: 16000 * 2 // 512 * 512].reshape(-1, 512)


def detect(mod, c, model, chunks, k, sid):
    """Sends chunk k of a stream; returns its speech probability."""
    tensor = mod.InferInput("AUDIO", [1, 512], "FP32")
    tensor.set_data_from_numpy(chunks[k][None, :])
    r = c.infer(model, [tensor], sequence_id=sid, sequence_start=k == 0,
                sequence_end=k == len(chunks) - 1)
    return r.as_numpy("SPEECH_PROBABILITY").item()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_vad_streams_match_silero(server, protocol):
    mod, c = client(server, protocol)
    streams = {61 if protocol == "http" else 71: audio(1, True),
               62 if protocol == "http" else 72: audio(2, False)}
    got = {sid: [] for sid in streams}
    count = len(next(iter(streams.values())))
    for k in range(count):  # the two streams interleaved, chunk by chunk
        for sid, chunks in streams.items():
            got[sid].append(detect(mod, c, "vad", chunks, k, sid))
    voiced, quiet = streams
    for sid, chunks in streams.items():
        np.testing.assert_allclose(got[sid], silero_reference(chunks), atol=1e-5, rtol=0)
    # The pipeline tells the streams apart: speech in the second half of the voiced one only.
    assert max(got[voiced][count // 2 + 4:]) > 0.9 and max(got[quiet]) < 0.5


def test_vad_streams_batched_together_match_silero(server):
    """Four streams at once through a copy of `vad` whose queue waits for four chunks: every
    silero-vad call carries one chunk of each stream, their states side by side."""
    streams = {81 + i: audio(10 + i, i % 2 == 0) for i in range(4)}
    got = {}

    def run(sid):
        c = grpcclient.InferenceServerClient(server.grpc)
        chunks = streams[sid]
        got[sid] = [detect(grpcclient, c, "vad_batched", chunks, k, sid)
                    for k in range(len(chunks))]

    concurrently(run, streams)
    for sid, chunks in streams.items():
        np.testing.assert_allclose(got[sid], silero_reference(chunks), atol=1e-5, rtol=0)
    stats = grpcclient.InferenceServerClient(server.grpc).get_inference_statistics(
        "vad_batched", as_json=True)["model_stats"][0]
    count = len(streams[81])
    assert int(stats["inference_count"]) == 4 * count
    assert int(stats["execution_count"]) == count
