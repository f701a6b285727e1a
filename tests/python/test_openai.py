"""The OpenAI-compatible endpoints (/v1/models, /v1/completions, /v1/chat/completions) with the
official `openai` Python client against the `smollm2` ensemble, behind tenants' API keys."""
import os
import re
import sys
import time

import numpy as np
import openai
import pytest
import tokenizers

from conftest import ROOT, Server
from test_generation import SMOL, link_model
from test_tenancy import digest

sys.path.insert(0, os.path.join(ROOT, "scripts"))

KEYS = {"writer": "writer-key-1", "reader": "reader-key-1", "other": "other-key-1"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("openai")
    for name in ("smollm2", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing"):
        link_model(str(repo), os.path.join(ROOT, "model_repository", name))
    config = repo / "wasmtron.toml"
    config.write_text(f"""
[[tenant]]
name = "writer"
api_keys = [{digest(KEYS["writer"])}]
infer = ["smollm2*"]

[[tenant]]
name = "other"
api_keys = [{digest(KEYS["other"])}]
infer = ["smollm2"]

[[tenant]]
name = "reader"
api_keys = [{digest(KEYS["reader"])}]
see = ["smollm2"]
""")
    s = Server(str(repo), "--config", str(config))
    yield s
    s.stop()


def client(server, tenant="writer"):
    return openai.OpenAI(base_url=f"http://{server.http}/v1", api_key=KEYS.get(tenant, tenant),
                         max_retries=0, timeout=300)


def test_models_lists_the_text_models_a_tenant_may_see(server):
    assert [m.id for m in client(server).models.list()] == ["smollm2"]
    assert [m.id for m in client(server, "reader").models.list()] == ["smollm2"]
    card = client(server, "reader").models.retrieve("smollm2")
    assert (card.id, card.object, card.owned_by) == ("smollm2", "model", "wasmtron")
    # A model that is there but generates nothing, one that is not, one the tenant may not see.
    for tenant, name in [("writer", "smollm2_decoder"), ("writer", "nope"), ("other", "smollm2_decoder")]:
        with pytest.raises(openai.NotFoundError) as e:
            client(server, tenant).models.retrieve(name)
        assert e.value.code == "model_not_found" and f"'{name}'" in e.value.message


def test_a_chat_completion_answers_with_usage(server):
    r = client(server).chat.completions.create(model="smollm2", messages=QUESTION, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens > 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_streamed_chat_adds_up_to_the_same_answer(server):
    c = client(server)
    params = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me about cats."}],
                  temperature=0.8, seed=11, max_tokens=24)
    whole = c.chat.completions.create(**params)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == whole.choices[0].finish_reason == "length"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert len({ch.id for ch in chunks}) == 1


def test_completions_stream_and_not(server):
    c = client(server)
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].text.startswith(" Paris")
    chunks = list(c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5,
                                       temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


def test_n_choices_from_one_request_stream_and_not(server):
    c = client(server)
    params = dict(model="smollm2", messages=[{"role": "user", "content": "Name an animal."}],
                  temperature=1.0, seed=5, max_tokens=10, n=3)
    whole = c.chat.completions.create(**params)
    assert [ch.index for ch in whole.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in whole.choices]
    # Seeded: each choice has a seed of its own (the request's plus its index), so the
    # choices differ and the same request gives the same three again.
    assert len(set(texts)) > 1
    assert [ch.message.content for ch in c.chat.completions.create(**params).choices] == texts
    assert whole.usage.completion_tokens == 30
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **params))
    streamed = ["", "", ""]
    roles = set()
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert streamed == texts and roles == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == 30


def test_echo_answers_the_prompt_first(server):
    c = client(server)
    prompt = "The capital of France is"
    r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    plain = c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    chunks = list(c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0,
                                       echo=True, stream=True))
    assert chunks[0].choices[0].text == prompt
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_tokens(server):
    import decoder_loop  # noqa: E402
    c = client(server)
    prompt = "The capital of France is"
    r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                             logprobs=2)
    plain = c.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0,
                                 logprobs=2)
    lp, gen = r.choices[0].logprobs, plain.choices[0].logprobs
    n = r.usage.prompt_tokens
    assert r.choices[0].text == prompt + plain.choices[0].text
    # The prompt's tokens first (the first unscored: nothing precedes it), then the answer's.
    assert "".join(lp.tokens[:n]) == prompt and lp.tokens[n:] == gen.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n:] == gen.token_logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # The decoder's own scores of the prompt, run once over it with ONNX Runtime.
    ids = tokenizers.Tokenizer.from_file(os.path.join(SMOL, "1", "tokenizer.json")).encode(
        prompt, add_special_tokens=False).ids
    assert len(ids) == n
    want, want_top = decoder_loop.DecoderLoop(os.path.join(SMOL, "1", "model.onnx")).prompt_log_probs(ids, top=2)
    assert np.allclose(lp.token_logprobs[1:n], want[1:], atol=1e-3)
    for got, top in zip(lp.top_logprobs[1:n], want_top[1:]):
        assert len(got) == 2 and np.allclose(sorted(got.values()), sorted(l for _, l in top), atol=1e-3)
    # Streamed: the echo chunk carries the prompt's scores, then each token its own.
    chunks = list(c.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0,
                                       echo=True, logprobs=2, stream=True))
    assert chunks[0].choices[0].text == prompt
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    # max_tokens 0 with echo: the prompt and its scores alone (how prompts are scored).
    only = c.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert only.choices[0].text == prompt and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (n, 0)
    chunks = list(c.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == prompt
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2", prompt=prompt, max_tokens=0)
    assert e.value.param == "max_tokens"


def test_logprobs_from_the_sampler(server):
    c = client(server)
    params = dict(model="smollm2", messages=QUESTION, temperature=0, max_tokens=5,
                  logprobs=True, top_logprobs=3)
    r = c.chat.completions.create(**params)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        # Greedy: the token taken is the likeliest, and the alternatives come in order.
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes).decode() == t.token
    streamed = [t for ch in c.chat.completions.create(stream=True, **params)
                for choice in ch.choices if choice.logprobs for t in choice.logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == \
        [(t.token, round(t.logprob, 4)) for t in content]
    # Completions' legacy shape.
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                             temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(alternatives) == 2 and lp.tokens[i] in alternatives
               for i, alternatives in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    # Without logprobs, none.
    assert c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2).choices[0].logprobs is None


def test_logit_bias_bans_and_forces_tokens(server):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(ROOT, "model_repository", "smollm2_decoder", "1",
                                                 "tokenizer.json"))
    paris = tokenizer.encode(" Paris", add_special_tokens=False).ids
    bang = tokenizer.encode("!", add_special_tokens=False).ids
    assert len(paris) == 1 and len(bang) == 1
    c = client(server)
    request = dict(model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert c.completions.create(**request).choices[0].text.startswith(" Paris")
    banned = c.completions.create(logit_bias={str(paris[0]): -100}, **request).choices[0].text
    assert not banned.startswith(" Paris")
    forced = c.completions.create(logit_bias={str(bang[0]): 100}, **request).choices[0].text
    assert forced == "!!!"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(logit_bias={"not-a-token": 1}, **request)
    assert e.value.param == "logit_bias" and "'not-a-token' is not a token id" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(logit_bias={"10000000": 1}, **request)
    assert "outside the vocabulary" in e.value.message


def test_a_stop_string_ends_the_answer_before_it(server):
    r = client(server).chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                               stop=["Paris", "\n\n"])
    assert r.choices[0].message.content == "The capital of France is"
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("params,status,param,message", [
    (dict(n=20), 400, "n", "'n' is 20; it must be between 1 and 16"),
    (dict(logprobs=True, top_logprobs=30), 400, "top_logprobs", "'top_logprobs' is 30"),
    (dict(top_logprobs=2), 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
    (dict(temperature=3), 400, "temperature", "'temperature' is 3"),
    (dict(top_p=1.5), 400, "top_p", "'top_p' is 1.5"),
    (dict(frequency_penalty=-3), 400, "frequency_penalty", "'frequency_penalty' is -3"),
    (dict(extra_body={"best_guess": 1}), 400, "best_guess", "Unrecognized request argument supplied: best_guess"),
    (dict(messages=[{"role": "system", "content": "Be brief."}]), 400, "messages", "no message with role 'user'"),
    (dict(messages=[]), 400, "messages", "'messages' is empty"),
    (dict(max_tokens=5000), 400, "max_tokens", "'max_tokens' is 5000"),
    (dict(temperature="hot"), 400, "temperature", "'temperature': invalid type: string"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), 400, "messages", "'messages[0].role': unknown variant"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop", "up to 4 strings"),
    (dict(model="smollm2-large"), 404, None, "'smollm2-large'"),
])
def test_bad_chat_requests_get_openai_errors_naming_the_field(server, params, status, param, message):
    request = dict(model="smollm2", messages=QUESTION, max_tokens=4) | params
    with pytest.raises(openai.APIStatusError) as e:
        client(server).chat.completions.create(**request)
    assert e.value.status_code == status
    assert e.value.param == param
    assert message in e.value.message
    if status == 404:
        assert e.value.code == "model_not_found"
    # Nothing else is affected.
    ok = client(server).chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_a_list_of_prompts_gets_n_choices_each_as_if_asked_alone(server):
    c = client(server)
    prompts = ["The capital of France is", "One, two, three,", "Water is made of"]
    alone = [c.completions.create(model="smollm2", prompt=p, max_tokens=6, temperature=0)
             for p in prompts]
    r = c.completions.create(model="smollm2", prompt=prompts, max_tokens=6, temperature=0, n=2,
                             echo=True)
    assert [ch.index for ch in r.choices] == list(range(6))
    for i, ch in enumerate(r.choices):
        p = prompts[i // 2]
        assert ch.text == p + alone[i // 2].choices[0].text
    # Each prompt's tokens count once, each choice's completion tokens each time.
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    chunks = list(c.completions.create(model="smollm2", prompt=prompts, max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    streamed = [""] * 3
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [a.choices[0].text for a in alone]
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_token_id_prompts_answer_as_their_text_does(server):
    c = client(server)
    tok = tokenizers.Tokenizer.from_file(os.path.join(SMOL, "1", "tokenizer.json"))
    texts = ["The capital of France is", "Water is made of"]
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    by_text = c.completions.create(model="smollm2", prompt=texts, max_tokens=5, temperature=0,
                                   echo=True, logprobs=1)
    one = c.completions.create(model="smollm2", prompt=ids[0], max_tokens=5, temperature=0)
    assert one.choices[0].text == by_text.choices[0].text[len(texts[0]):]
    assert one.usage.prompt_tokens == len(ids[0])
    # A list of token-id lists; echo spells each prompt as the model's tokens do.
    by_ids = c.completions.create(model="smollm2", prompt=ids, max_tokens=5, temperature=0,
                                  echo=True, logprobs=1)
    assert [ch.text for ch in by_ids.choices] == [ch.text for ch in by_text.choices]
    assert [ch.logprobs.token_logprobs for ch in by_ids.choices] == \
        [ch.logprobs.token_logprobs for ch in by_text.choices]
    chunks = list(c.completions.create(model="smollm2", prompt=ids[1], max_tokens=5, temperature=0,
                                       echo=True, stream=True))
    assert chunks[0].choices[0].text == texts[1] and chunks[0].choices[0].logprobs is None
    assert "".join(ch.choices[0].text for ch in chunks) == by_text.choices[1].text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2", prompt=[1, 10**6], max_tokens=2)
    assert "'prompt_ids' item 1 is 1000000" in e.value.message


def test_bad_completion_prompts_are_refused(server):
    for prompt, message in [("", "'prompt' is empty"), ([[1, 2], []], "'prompt' item 1 is empty"),
                            (["a", ""], "'prompt' item 1 is empty"), ([1, -2], "not a token id")]:
        with pytest.raises(openai.BadRequestError) as e:
            client(server).completions.create(model="smollm2", prompt=prompt, max_tokens=2)
        assert e.value.param == "prompt" and message in e.value.message


def test_api_keys_are_the_tenants(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, "not-a-key").chat.completions.create(model="smollm2", messages=QUESTION)
    with pytest.raises(openai.PermissionDeniedError) as e:
        client(server, "reader").chat.completions.create(model="smollm2", messages=QUESTION)
    assert "tenant 'reader' may not infer" in e.value.message


def running(server):
    text = server.metrics_text()
    m = re.search(r'^vllm:num_requests_running\{model="smollm2_decoder",version="1"\} (\S+)$', text, re.M)
    aborted = re.search(r'^vllm:request_success_total\{model="smollm2_decoder",version="1",'
                        r'finished_reason="abort"\} (\S+)$', text, re.M)
    return float(m.group(1)), float(aborted.group(1))


def settled(server):
    """The decoder's counters once no sequence runs (another test's may still be leaving)."""
    deadline = time.time() + 120
    while running(server)[0] != 0:
        assert time.time() < deadline, f"still running: {running(server)}"
        time.sleep(0.2)
    return running(server)


def test_closing_a_stream_frees_its_place_at_the_next_step(server):
    _, aborted_before = settled(server)
    stream = client(server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long essay about rivers."}],
        max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(range(4), stream):
        pass
    assert running(server)[0] == 1
    stream.close()
    deadline = time.time() + 120
    while running(server) != (0, aborted_before + 1):
        assert time.time() < deadline, f"still running: {running(server)}"
        time.sleep(0.2)


def test_tenants_generate_in_one_batch(server):
    """Two tenants' streams share the running batch: the execution share (a part of the cores
    per active tenant) does not cut a tenant down to one sequence."""
    body = dict(model="smollm2", messages=[{"role": "user", "content": "Write a long essay about lakes."}],
                max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    streams = [client(server, t).chat.completions.create(**body) for t in ("writer", "writer", "other", "other")]
    try:
        for s in streams:
            next(iter(s))
        deadline = time.time() + 120
        while running(server)[0] != 4:
            assert time.time() < deadline, f"running: {running(server)}"
            time.sleep(0.2)
    finally:
        for s in streams:
            s.close()
