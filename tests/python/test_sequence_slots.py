"""The sequence batcher's direct strategy (Triton's default), with the stock tritonclient: each
instance has max_batch_size slots, a sequence holds one from START to END and always runs in
its row, a slot with nothing ready below a busy one runs a filler row whose READY is false,
sequences that find no free slot wait in the backlog, and an idle sequence gives its slot up.
Triton's test hook TRITONSERVER_DELAY_SCHEDULER lines requests up as in L0_sequence_batcher."""
import concurrent.futures
import os
import queue
import shutil
import time
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server, model_variant

TEST_MODELS = os.path.join(ROOT, "tests", "models")
# accumulate's first state, from its initial_state/hundred file.
FIRST = 100


def variant(repo, name, source, replace):
    """A copy of tests/models/<source> named `name`, its config edited by `replace`."""
    model_variant(repo, name, os.path.join(TEST_MODELS, source), replace)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("slots"))
    shutil.copytree(os.path.join(TEST_MODELS, "slot_rows"), os.path.join(repo, "slot_rows"))
    # One slot: a second sequence waits for the first to end (or to idle out).
    variant(repo, "one_slot", "slot_rows", [("max_batch_size: 2", "max_batch_size: 1")])
    variant(repo, "one_slot_cancel", "slot_rows", [("max_batch_size: 2", "max_batch_size: 1")])
    variant(repo, "one_slot_idle", "slot_rows",
            [("max_batch_size: 2", "max_batch_size: 1"),
             ("max_sequence_idle_microseconds: 60000000", "max_sequence_idle_microseconds: 1000000")])
    s = Server(repo)
    yield s
    s.stop()


def add(c, model, sid, value, start=False, end=False):
    """One request of sequence `sid`; returns (SUM, ROWS, FILLERS)."""
    x = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    r = c.infer(model, [x], sequence_id=sid, sequence_start=start, sequence_end=end)
    return tuple(r.as_numpy(n).item() for n in ("SUM", "ROWS", "FILLERS"))


def batch_stats(c, model):
    stats = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
    sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"])
             for b in stats.get("batch_stats", [])}
    return int(stats.get("execution_count", 0)), int(stats.get("inference_count", 0)), sizes


def test_a_sequence_keeps_its_row_with_filler_rows_below_it(server):
    """L0_sequence_batcher test_skip_batch: a sequence in slot 1 runs as row 1 even when slot
    0 has nothing ready; the empty slot gets a READY=false row, left out of the statistics."""
    c = grpcclient.InferenceServerClient(server.grpc)
    assert add(c, "slot_rows", 11, 5, start=True) == (5, 1, 0)   # slot 0, alone
    assert add(c, "slot_rows", 12, 7, start=True) == (7, 2, 1)   # slot 1, under a filler
    assert add(c, "slot_rows", 11, 1) == (6, 1, 0)               # slot 0 is the highest busy
    assert add(c, "slot_rows", 12, 3, end=True) == (10, 2, 1)
    assert add(c, "slot_rows", 11, 2, end=True) == (8, 1, 0)
    # Slot 0 is free again: the next sequence takes it and runs alone.
    assert add(c, "slot_rows", 13, 4, start=True, end=True) == (4, 1, 0)
    # A filler row counts in its execution's batch size, not as an inference (as on Triton).
    executions, inferences, sizes = batch_stats(c, "slot_rows")
    assert (executions, inferences, sizes) == (6, 6, {1: 4, 2: 2})


def test_a_sequence_waits_in_the_backlog_for_a_free_slot(server):
    """L0_sequence_batcher test_backlog: with every slot held, a new sequence waits, its
    requests kept in order, and takes the slot once the holder ends."""
    c = grpcclient.InferenceServerClient(server.grpc)
    assert add(c, "one_slot", 21, 1, start=True) == (1, 1, 0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(add, grpcclient.InferenceServerClient(server.grpc), "one_slot",
                              22, 10, True)
        # It cannot run while sequence 21 holds the only slot.
        time.sleep(1)
        assert not waiting.done()
        assert add(c, "one_slot", 21, 2) == (3, 1, 0)
        assert not waiting.done()
        assert add(c, "one_slot", 21, 3, end=True) == (6, 1, 0)
        assert waiting.result(timeout=120) == (10, 1, 0)
    assert add(c, "one_slot", 22, 5, end=True) == (15, 1, 0)


def test_a_sequence_whose_caller_left_is_cancelled_and_frees_its_slot(server):
    """L0_sequence_batcher's cancellation case: the caller of a sequence's waiting request goes
    away (a gRPC deadline); when the request's turn comes the sequence is cancelled, its slot
    given up, so its next request must start it again and others find the slot free."""
    c = grpcclient.InferenceServerClient(server.grpc)
    assert add(c, "one_slot_cancel", 41, 1, start=True) == (1, 1, 0)
    x = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[10]], dtype=np.int32))
    # Waits in the backlog behind sequence 41; its caller gives up after a second.
    with pytest.raises(InferenceServerException, match="Deadline"):
        c.infer("one_slot_cancel", [x], sequence_id=42, sequence_start=True, client_timeout=1)
    assert add(c, "one_slot_cancel", 41, 2, end=True) == (3, 1, 0)
    # Sequence 42 took the slot with a request nobody waits for: it is cancelled, not run.
    assert add(c, "one_slot_cancel", 43, 5, start=True, end=True) == (5, 1, 0)
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        add(c, "one_slot_cancel", 42, 1)
    # Run: 41's two requests and 43's; not 42's.
    assert batch_stats(c, "one_slot_cancel")[:2] == (3, 3)


def test_an_idle_sequence_gives_its_slot_to_the_backlog(server):
    """L0_sequence_batcher test_backlog_sequence_timeout: a sequence idle for longer than
    max_sequence_idle_microseconds loses its slot to the one waiting, and its next request is
    refused, naming why."""
    c = grpcclient.InferenceServerClient(server.grpc)
    assert add(c, "one_slot_idle", 31, 1, start=True) == (1, 1, 0)
    other = grpcclient.InferenceServerClient(server.grpc)
    # Runs once sequence 31 has been idle for a second.
    assert add(other, "one_slot_idle", 32, 10, start=True) == (10, 1, 0)
    with pytest.raises(InferenceServerException, match="max_sequence_idle_microseconds"):
        add(c, "one_slot_idle", 31, 2)
    assert add(other, "one_slot_idle", 32, 5, end=True) == (15, 1, 0)


# Requests the held server waits for before it runs any batch (Triton's test hook).
HELD = 12


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("held"))
    # accumulate (ONNX, implicit state) under the direct strategy: one instance of 4 slots.
    variant(repo, "lockstep", "accumulate",
            [("  oldest { max_candidate_sequences: 64 max_queue_delay_microseconds: 2000 "
              "preferred_batch_size: [ 4 ] }\n", ""),
             ("sequence_batching {",
              "instance_group [ { kind: KIND_CPU count: 1 } ]\nsequence_batching {")])
    s = Server(repo, env={**os.environ, "TRITONSERVER_DELAY_SCHEDULER": str(HELD)})
    yield s
    s.stop()


def test_sequences_run_in_lockstep_in_their_slots(held):
    """L0_sequence_batcher test_skip_batch (TRITONSERVER_DELAY_SCHEDULER=12): four sequences,
    two of four requests and two of two, every request sent at once on gRPC streams. Nothing
    runs until all 12 are queued; then each batch holds the next request of every slot: two
    batches of 4, then two of the long sequences' requests (with filler rows for the slots
    below them that the short ones left, so of 2 to 4 rows, depending on which slots the
    sequences took in the order their STARTs arrived)."""
    sequences = {1: [1, 2, 3, 4], 2: [10, 20], 3: [100, 200, 300, 400], 4: [1000, 2000]}
    clients, answers = [], {}
    for sid, values in sequences.items():
        c = grpcclient.InferenceServerClient(held.grpc)
        got = queue.Queue()
        c.start_stream(partial(lambda q, result, error: q.put((result, error)), got))
        for k, v in enumerate(values):
            x = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[v]], dtype=np.int32))
            c.async_stream_infer("lockstep", [x], sequence_id=sid, sequence_start=k == 0,
                                 sequence_end=k == len(values) - 1)
        clients.append(c)
        answers[sid] = got
    for sid, values in sequences.items():
        outs = []
        for _ in values:
            result, error = answers[sid].get(timeout=120)
            assert error is None, error
            outs.append(result.as_numpy("OUTPUT").item())
        assert outs == list(FIRST + np.cumsum(values)), sid
    for c in clients:
        c.stop_stream()
    executions, inferences, sizes = batch_stats(
        grpcclient.InferenceServerClient(held.grpc), "lockstep")
    assert (executions, inferences) == (4, 12), sizes
    assert sizes in ({4: 2, 2: 2}, {4: 2, 3: 2}, {4: 4}), sizes
