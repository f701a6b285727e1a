"""Abusing the generation and OpenAI surfaces: requests whose fields would make the server do
unbounded work (thousands of banned or stop words, huge `n`, `top_logprobs` or token lists,
out-of-vocabulary biases, tens of thousands of texts to embed, oversized or hostile guides for
constrained decoding) are refused with a 400 naming the field or served within bounds, and the
server answers a real request right after."""
import json
import os
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from attack import ROOT, Server, raw

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from test_generation import link_model  # noqa: E402

MODELS = ("smollm2", "ensemble", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing",
          "trtllm_postprocessing", "embed_text", "bert_tokenizer", "minilm", "mean_pool")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("attack-generation")
    for name in MODELS:
        link_model(str(repo), os.path.join(ROOT, "model_repository", name))
    s = Server(str(repo))
    yield s
    s.stop()


def still_generates(server):
    status, answer = raw(server.http, "POST", "/v1/completions",
                         {"model": "smollm2", "prompt": "The capital of France is",
                          "max_tokens": 2, "temperature": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


def grpc_error(server, inputs):
    client = grpcclient.InferenceServerClient(server.grpc)
    tensors = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, list(value.shape),
                                  "BYTES" if value.dtype == object else "INT32")
        t.set_data_from_numpy(value)
        tensors.append(t)
    stream_errors = []
    client.start_stream(callback=lambda result, error: error and stream_errors.append(error))
    client.async_stream_infer("ensemble", tensors)
    client.stop_stream()
    client.close()
    assert len(stream_errors) == 1, stream_errors
    return stream_errors[0].message()


def test_word_lists_are_bounded(server):
    prompt = np.array([["The capital of France is"]], dtype=object)
    many = np.array([[f"w{i}".encode() for i in range(5000)]], dtype=object)
    message = grpc_error(server, {"text_input": prompt, "bad_words": many})
    assert "'bad_words' holds 5000 strings; at most 32" in message
    long = np.array([[b"x" * 100_000]], dtype=object)
    message = grpc_error(server, {"text_input": prompt, "stop_words": long})
    assert "'stop' holds a string of 100000 bytes; at most 256" in message
    still_generates(server)


@pytest.mark.parametrize("body,param,message", [
    ({"n": 100000}, "n", "'n' is 100000"),
    ({"logprobs": True, "top_logprobs": 10**9}, "top_logprobs", "'top_logprobs' is 1000000000"),
    ({"logit_bias": {str(10**6 + i): 1 for i in range(20000)}}, None, "outside the vocabulary"),
    ({"stop": ["s"] * 500}, "stop", "up to 4 strings"),
    # Guides are bounded in size, named by their field before anything is compiled (the
    # grammar engine's own limits bound the work within).
    ({"guided_json": {"enum": [f"value-{i}" * 10 for i in range(5000)]}}, "guided_json",
     "more than 65536"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(500)]},
     "tools", "'tools' has 500 functions; at most 128"),
    # An overflow the engine trips on is a refusal, without the engine's backtrace.
    ({"guided_json": {"type": "integer", "minimum": -1e300, "maximum": 1e300}}, None,
     "guided_decoding_guide"),
])
def test_openai_fields_are_bounded(server, body, param, message):
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 2} | body
    status, answer = raw(server.http, "POST", "/v1/chat/completions", request)
    assert status == 400, answer
    assert message in answer["error"]["message"] and answer["error"]["param"] == param, answer
    assert "backtrace" not in answer["error"]["message"]
    still_generates(server)


@pytest.mark.parametrize("body,param,message", [
    # Prompts: a list is bounded, and so is every prompt (token ids against the vocabulary and
    # the context, which bounds the work of scoring them too).
    ({"prompt": ["p"] * 10_000}, "prompt", "'prompt' lists 10000 prompts; it must list 1 to 32"),
    ({"prompt": [[1]] * 33}, "prompt", "'prompt' lists 33 prompts"),
    ({"prompt": ["p"] * 32, "n": 16}, "n", "ask for 512 sequences; one request may start at most 64"),
    ({"prompt": [7] * 200_000, "echo": True, "logprobs": 5}, None, "max_sequence_length"),
    ({"prompt": [2**31 - 1, 5]}, None, "'prompt_ids' item 0 is 2147483647"),
    ({"prompt": [-1]}, "prompt", "not a token id"),
    ({"prompt": [1.5]}, "prompt", "not a token id"),
])
def test_completion_prompts_are_bounded(server, body, param, message):
    request = {"model": "smollm2", "max_tokens": 2} | body
    status, answer = raw(server.http, "POST", "/v1/completions", request)
    assert status == 400, answer
    assert message in answer["error"]["message"], answer
    if param:
        assert answer["error"]["param"] == param, answer
    still_generates(server)


def test_embedding_lists_are_bounded(server):
    status, answer = raw(server.http, "POST", "/v1/embeddings",
                         {"model": "embed_text", "input": ["x"] * 50_000})
    assert status == 400 and answer["error"]["param"] == "input", answer
    assert "'input' holds 50000 texts; at most 2048" in answer["error"]["message"]
    # The most allowed is served, batch after batch.
    status, answer = raw(server.http, "POST", "/v1/embeddings",
                         {"model": "embed_text", "input": ["a short text"] * 2048}, timeout=600)
    assert status == 200 and len(answer["data"]) == 2048, str(answer)[:500]
    still_generates(server)


def nested_arrays(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("constraint", [
    # Catastrophic backtracking for a backtracking engine; nested and huge counted repeats;
    # intersections; a self-referencing schema; a pattern with nested quantifiers.
    {"guided_regex": "((a|aa)*(b|ab)*)*(x{100}){100}"},
    {"guided_regex": "[a-z]{1000000}"},
    {"guided_regex": "((((a{50}){50}){50}){50})"},
    {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}},
                     "additionalProperties": False}},
    {"guided_json": {"type": "string", "pattern": "^(a+)+$"}},
    {"guided_json": nested_arrays(60)},
])
def test_hostile_guides_are_answered_within_bounds(server, constraint):
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 16, "temperature": 0} | constraint
    status, answer = raw(server.http, "POST", "/v1/chat/completions", request, timeout=300)
    # Served under the constraint, or refused naming it; never a hang or a crash.
    assert status in (200, 400), answer
    if status == 200:
        assert answer["choices"][0]["message"]["content"] is not None
    still_generates(server)


def lark_chain(rules):
    """A Lark grammar of `rules` rules, each calling the next: what a recursive compiler
    follows to its end."""
    lines = ["start: r0"] + [f'r{i}: "a" r{i + 1} | "b"' for i in range(rules - 1)]
    return "\n".join(lines + [f'r{rules - 1}: "z"'])


def ref_chain(defs):
    """A JSON schema whose `$ref`s chain through `defs` definitions."""
    chain = {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(defs)}
    chain[str(defs)] = {"type": "integer"}
    return {"$defs": chain, "$ref": "#/$defs/0"}


@pytest.mark.parametrize("field,guide,says", [
    # Before, each of these overflowed the decoder worker's stack and ended the process.
    ("lark", lark_chain(2800), "it has 2801 rules, more than 1000"),
    ("response_format", ref_chain(1500), "it has 1501 '$ref's, more than 1000"),
    ("guided_json", ref_chain(1500), "it has 1501 '$ref's, more than 1000"),
    ("guided_json", ref_chain(5000), "more than 65536"),
])
def test_deeply_recursive_guides_are_refused_naming_the_field(server, field, guide, says):
    if field == "lark":
        request = {"guided_decoding_guide_type": "lark", "guided_decoding_guide": guide}
        status, answer = raw(server.http, "POST", "/v2/models/smollm2/generate",
                             {"text_input": "hi", "max_tokens": 2, **request})
        assert status == 400, answer
        assert "guided_decoding_guide" in answer["error"] and says in answer["error"], answer
    else:
        body = ({"guided_json": guide} if field == "guided_json" else
                {"response_format": {"type": "json_schema",
                                     "json_schema": {"name": "chain", "schema": guide}}})
        status, answer = raw(server.http, "POST", "/v1/chat/completions",
                             {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2} | body)
        assert status == 400, answer
        assert says in answer["error"]["message"], answer
        if "65536" in says:
            assert answer["error"]["param"] == field, answer
    still_generates(server)


def test_a_guide_at_the_bound_compiles_on_a_deep_stack_and_is_followed(server):
    # 1,000 chained Lark rules: deeper than a worker thread's stack allows, compiled on a
    # thread whose stack holds it; the answer follows the grammar.
    grammar = lark_chain(998)
    status, answer = raw(server.http, "POST", "/v2/models/smollm2/generate",
                         {"text_input": "Say something", "max_tokens": 8, "temperature": 0,
                          "guided_decoding_guide_type": "lark", "guided_decoding_guide": grammar},
                         timeout=300)
    assert status == 200, answer
    text = answer["text_output"]
    assert set(text.replace("a", "")) <= {"b", "z"} and text.count("b") + text.count("z") <= 1, text
    still_generates(server)



def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


LONG = "word " * ((4 << 20) // 5)  # 4 MiB of text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/responses", {"model": "smollm2", "input": "Hi", "instructions": LONG,
                       "max_output_tokens": 2}, "instructions"),
    ("/v1/responses", {"model": "smollm2", "input": [{"role": "user", "content": LONG}],
                       "max_output_tokens": 2}, "input"),
    ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 2, "messages": [
        {"role": "system", "content": LONG}, {"role": "user", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 2, "messages": [
        {"role": "user", "content": "x" * 200_000}, {"role": "user", "content": "y" * 200_000}]},
     "messages"),
    ("/v1/completions", {"model": "smollm2", "max_tokens": 2, "prompt": LONG}, "prompt"),
])
def test_a_prompt_over_the_models_bound_is_refused_before_the_model(server, path, body, param):
    before = rss_mib(server.proc.pid)
    sent = len(json.dumps(body))
    status, answer = raw(server.http, "POST", path, body, timeout=300)
    assert status == 400, answer
    error = answer["error"]
    assert error.get("param") == param, error
    assert "max_prompt_chars" in error["message"] and "262144" in error["message"], error
    grown = rss_mib(server.proc.pid) - before
    assert grown < 7 * sent / (1 << 20), f"+{grown:.0f} MiB for a {sent >> 20} MiB body"
    still_generates(server)
