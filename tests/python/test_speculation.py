"""N-gram (prompt-lookup) speculative decoding, configured as vLLM's `speculative_config`: a
greedy answer is token for token the one decoding without drafts gives (alone, up to its token
limit, and as rows join and leave a batch), the drafts that greedy decoding
confirms are counted under vLLM's metric names, and a configuration vLLM would refuse is
refused by name."""
import json
import os
import threading
import urllib.request

import pytest
import tokenizers

from conftest import Server
import test_generation
from test_generation import SMOL, chat, link_model, metric, without_speculation

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CODE = """def area(width, height):
    result = width * height
    return result


def perimeter(width, height):
    result = 2 * (width + height)
    return result
"""
# Prompts whose answers quote them (where drafts hold) and one that does not.
PROMPTS = [
    "Repeat this text exactly, word for word: the quick brown fox jumps over the lazy dog, "
    "and the quick brown fox jumps over the lazy dog again.",
    f"Rename the argument width to w in this code and print the whole code:\n{CODE}",
    "Copy this list: apples, pears, plums, cherries, apples, pears, plums, cherries.",
    "Write a short poem about autumn leaves.",
]


def with_parameter(key, value):
    return lambda text: without_speculation(text) + (
        f'parameters {{ key: "{key}" value {{ string_value: {json.dumps(value)} }} }}\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("speculation"))
    link_model(repo, SMOL, "smol_plain", without_speculation)
    link_model(repo, SMOL, "smol_spec", with_parameter("speculative_config", json.dumps(SPEC)))
    link_model(repo, SMOL, "smol_bad_spec", with_parameter(
        "speculative_config", json.dumps(dict(SPEC, prompt_lookup_min=5))))
    link_model(repo, SMOL, "smol_unknown_spec", with_parameter(
        "speculative_config", json.dumps(dict(SPEC, speculative_model="eagle3"))))
    s = Server(repo)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.Tokenizer.from_file(os.path.join(SMOL, "1", "tokenizer.json"))


def generate(server, model, ids, max_tokens=64, **sampling):
    """The tokens of one streamed request."""
    return test_generation.generate(server, model, ids, max_tokens=max_tokens, **sampling)[0]


def ids_of(tokenizer, text):
    return tokenizer.encode(chat(text)).ids


def test_greedy_answers_are_the_same_with_drafts_and_drafts_are_taken(server, tokenizer):
    accepted_before = metric(server, "vllm:spec_decode_num_accepted_tokens_total", "smol_spec")
    for prompt in PROMPTS:
        ids = ids_of(tokenizer, prompt)
        plain = generate(server, "smol_plain", ids)
        assert len(plain) > 5, prompt
        assert generate(server, "smol_spec", ids) == plain, prompt
    drafts = metric(server, "vllm:spec_decode_num_drafts_total", "smol_spec")
    draft_tokens = metric(server, "vllm:spec_decode_num_draft_tokens_total", "smol_spec")
    accepted = metric(server, "vllm:spec_decode_num_accepted_tokens_total", "smol_spec") - accepted_before
    # The quoting answers run drafts, and greedy decoding confirms many of their tokens.
    assert drafts > 0 and draft_tokens >= drafts
    assert accepted >= 20, (drafts, draft_tokens, accepted)
    assert metric(server, "vllm:spec_decode_num_drafts_total", "smol_plain") == 0


def test_the_token_limit_holds_with_drafts(server, tokenizer):
    ids = ids_of(tokenizer, PROMPTS[0])
    for limit in (1, 2, 5, 13):
        plain = generate(server, "smol_plain", ids, max_tokens=limit)
        spec = generate(server, "smol_spec", ids, max_tokens=limit)
        assert spec == plain and len(spec) == limit


def test_rows_running_together_each_get_their_own_answer(server, tokenizer):
    """Three greedy rows and a sampled one in one batch (drafts run while a sequence runs
    alone: as rows join and leave, a row switches between drafting and not): each answers
    what it answers alone."""
    requests = [(ids_of(tokenizer, p), {}) for p in PROMPTS[:3]]
    requests.append((ids_of(tokenizer, PROMPTS[3]), {"temperature": 0.8, "seed": 7}))
    alone = [generate(server, "smol_plain", ids, **s) for ids, s in requests]
    together = [None] * len(requests)

    def one(i):
        ids, s = requests[i]
        together[i] = generate(server, "smol_spec", ids, **s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert together == alone


def test_a_configuration_vllm_refuses_is_refused_by_name(server):
    for model, says in [("smol_bad_spec", "prompt_lookup_max"), ("smol_unknown_spec", "speculative_model")]:
        req = urllib.request.Request(f"http://{server.http}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            index = {m["name"]: m for m in json.load(r)}
        assert index[model]["state"] == "UNAVAILABLE"
        assert "speculative_config" in index[model]["reason"] and says in index[model]["reason"], index[model]
    # The others serve.
    for model in ("smol_plain", "smol_spec"):
        with urllib.request.urlopen(f"http://{server.http}/v2/models/{model}/ready", timeout=30) as r:
            assert r.status == 200
