"""TensorRT-LLM's ensemble interface: the Triton guides' gRPC client (end_to_end_grpc_client.py,
older and newer shapes) runs unchanged against the model named `ensemble` with the stock
`tritonclient`, streamed and not, and /v2/models/ensemble/generate takes the same fields."""
import json
import os
import queue
import urllib.error
import urllib.request
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from conftest import ROOT, Server
from test_generation import link_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("trtllm")
    for name in ("ensemble", "smollm2", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing",
                 "trtllm_postprocessing"):
        link_model(str(repo), os.path.join(ROOT, "model_repository", name))
    s = Server(str(repo))
    yield s
    s.stop()


# The client as the guides write it: prepare_tensor, a callback that queues results and
# errors, start_stream / async_stream_infer / stop_stream.
def prepare_tensor(name, value):
    t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def callback(results, result, error):
    results.put(error if error else result)


def run(url, inputs, outputs=None, model="ensemble"):
    """One request over the stream, as the guide's client sends it: the text pieces (joined when
    streamed), the last result and the errors."""
    client = grpcclient.InferenceServerClient(url)
    results = queue.Queue()
    client.start_stream(callback=partial(callback, results))
    client.async_stream_infer(model, [prepare_tensor(k, v) for k, v in inputs.items()],
                              outputs=[grpcclient.InferRequestedOutput(o) for o in outputs or []] or None,
                              request_id="1")
    client.stop_stream()
    texts, errors, last = [], [], None
    while not results.empty():
        r = results.get()
        if isinstance(r, InferenceServerException):
            errors.append(r)
        else:
            texts.append(r.as_numpy("text_output")[0].decode("utf-8"))
            last = r
    client.close()
    return "".join(texts), last, errors


def older_guide_inputs(prompt, output_len, streaming):
    """The Llama-2 guide's client: UINT32 max_tokens, bad_words and stop_words always sent."""
    input0 = [[prompt]]
    return {
        "text_input": np.array(input0).astype(object),
        "max_tokens": np.ones_like(input0).astype(np.uint32) * output_len,
        "bad_words": np.array([[""]], dtype=object),
        "stop_words": np.array([[""]], dtype=object),
        "stream": np.array([[streaming]], dtype=bool),
    }


def newer_guide_inputs(prompt, output_len, streaming, **extra):
    """The newer client: INT32 max_tokens, beam_width, temperature, num_return_sequences and
    exclude_input_in_output always sent; the rest when given."""
    input0 = [[prompt]]
    inputs = {
        "text_input": np.array(input0).astype(object),
        "max_tokens": np.ones_like(input0).astype(np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        # Greedy, so that answers can be compared.
        "temperature": np.array([[0.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "exclude_input_in_output": np.array([[extra.pop("exclude_input_in_output", True)]], dtype=bool),
    }
    for key, value in extra.items():
        if isinstance(value, list):
            inputs[key] = np.array([value], dtype=object)
        elif isinstance(value, bool):
            inputs[key] = np.array([[value]], dtype=bool)
        else:
            inputs[key] = np.array([[value]], dtype=np.int32)
    return inputs


def generate(server, model, body):
    request = urllib.request.Request(f"http://{server.http}/v2/models/{model}/generate",
                                     data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        e.body = e.read().decode()
        raise


def test_the_older_guide_client_streams_and_answers_whole(server):
    streamed, _, errors = run(server.grpc, older_guide_inputs(PROMPT, 12, True))
    assert not errors, errors
    whole, _, errors = run(server.grpc, older_guide_inputs(PROMPT, 12, False))
    assert not errors, errors
    # Greedy by default, as TensorRT-LLM samples without sampling fields: the same text either
    # way, and the same as the smollm2 ensemble's over HTTP; the whole answer starts with the
    # prompt, as TensorRT-LLM's does (exclude_input_in_output defaults to false; a stream
    # never carries it).
    assert whole == PROMPT + streamed, (whole, streamed)
    reference = generate(server, "smollm2", {"text_input": PROMPT, "max_tokens": 12})["text_output"]
    assert streamed == reference and "Paris" in whole


def test_without_a_stream_input_the_answer_comes_whole_as_tensorrt_llm_gives_it(server):
    """The guide's client when not streaming sends no `stream` at all: TensorRT-LLM answers
    once, the whole text (with the prompt: exclude_input_in_output, not sent either, defaults
    to false); with `stream: true` one response per token."""
    inputs = newer_guide_inputs(PROMPT, 8, False)
    # Neither sent: exclude_input_in_output defaults to false, as in TensorRT-LLM.
    del inputs["stream"], inputs["exclude_input_in_output"]
    client = grpcclient.InferenceServerClient(server.grpc)
    results = queue.Queue()
    client.start_stream(callback=partial(callback, results))
    client.async_stream_infer("ensemble", [prepare_tensor(k, v) for k, v in inputs.items()])
    client.stop_stream()
    answers = []
    while not results.empty():
        answers.append(results.get())
    client.close()
    assert len(answers) == 1 and not isinstance(answers[0], InferenceServerException), answers
    whole = answers[0].as_numpy("text_output")[0].decode("utf-8")
    assert whole.startswith(PROMPT) and "Paris" in whole[len(PROMPT):], whole
    inputs = newer_guide_inputs(PROMPT, 8, True)
    client = grpcclient.InferenceServerClient(server.grpc)
    results = queue.Queue()
    client.start_stream(callback=partial(callback, results))
    client.async_stream_infer("ensemble", [prepare_tensor(k, v) for k, v in inputs.items()])
    client.stop_stream()
    assert results.qsize() == 8
    client.close()


def test_the_newer_guide_client_with_log_probs_and_the_prompt(server):
    inputs = newer_guide_inputs(PROMPT, 6, False, exclude_input_in_output=False,
                                return_log_probs=True, end_id=2, pad_id=2)
    text, last, errors = run(server.grpc, inputs,
                             ["text_output", "cum_log_probs", "output_log_probs", "generated_tokens"])
    assert not errors, errors
    # exclude_input_in_output false: a whole answer starts with the prompt.
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    per_token = last.as_numpy("output_log_probs")[0]
    cumulative = last.as_numpy("cum_log_probs")[0][0]
    assert len(per_token) == last.as_numpy("generated_tokens")[0][0] > 0
    assert all(p <= 0 for p in per_token) and cumulative == pytest.approx(per_token.sum(), abs=1e-3)


def test_bad_words_are_never_generated_and_stop_words_end_the_text(server):
    plain, _, _ = run(server.grpc, newer_guide_inputs(PROMPT, 12, False))
    assert "Paris" in plain
    banned, _, errors = run(server.grpc, newer_guide_inputs(PROMPT, 12, False, bad_words=["Paris"]))
    assert not errors, errors
    assert "Paris" not in banned and banned
    assert "answer" in plain
    stopped, _, errors = run(server.grpc, newer_guide_inputs(PROMPT, 12, True, stop_words=["answer"]))
    assert not errors, errors
    # The text up to the token that spells the stop word.
    assert "answer" not in stopped and "Paris" in stopped and plain.startswith(stopped)


def test_unserved_fields_get_an_error_naming_them(server):
    for key, value, message in [("beam_width", 2, "'beam_width' is 2; only 1 is supported"),
                                ("num_return_sequences", 3, "'num_return_sequences' is 3"),
                                ("return_context_logits", True, "'return_context_logits' is not supported")]:
        inputs = newer_guide_inputs(PROMPT, 4, True)
        inputs[key] = np.array([[value]], dtype=bool if isinstance(value, bool) else np.int32)
        _, _, errors = run(server.grpc, inputs)
        assert len(errors) == 1 and message in errors[0].message(), errors
    # UINT32 max_tokens that INT32 cannot hold.
    inputs = older_guide_inputs(PROMPT, 1, True)
    inputs["max_tokens"] = np.array([[2**31 + 5]], dtype=np.uint32)
    _, _, errors = run(server.grpc, inputs)
    assert len(errors) == 1 and "'max_tokens'" in errors[0].message() and "2147483653" in errors[0].message()
    # The stream still serves.
    text, _, errors = run(server.grpc, older_guide_inputs(PROMPT, 2, True))
    assert not errors and text


def test_generate_takes_the_same_fields_as_json(server):
    body = {"text_input": PROMPT, "max_tokens": 12, "bad_words": "", "stop_words": ""}
    answer = generate(server, "ensemble", body)
    assert answer["model_name"] == "ensemble" and "Paris" in answer["text_output"]
    body["beam_width"] = 4
    with pytest.raises(urllib.error.HTTPError) as e:
        generate(server, "ensemble", body)
    assert e.value.code == 400 and "'beam_width' is 4" in e.value.body
