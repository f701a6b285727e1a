"""Prefix caching in the generation backend: a prompt that begins like a recent one (a system
prompt, a few-shot block) prefills only what follows the shared part, answers exactly the
tokens a cold prefill gives, is counted under vLLM's metric names, and by default only reuses
its own tenant's prompts (`prefix_cache_scope`)."""
import os

import numpy as np
import tritonclient.grpc as grpcclient

import pytest

from conftest import ROOT, Server
from test_generation import SMOL, TINY, chat, link_model, metric
from test_tenancy import digest

KEYS = {"a": "tenant-a-key-1", "b": "tenant-b-key-1"}
SYSTEM = (
    "You are a careful assistant for a bakery. The bakery opens at seven in the morning and "
    "closes at six in the evening, every day but Monday. It sells sourdough, rye, baguettes, "
    "croissants, cinnamon rolls and three kinds of cake: chocolate, lemon and carrot. Orders "
    "for cakes need two days' notice. Answer in one short sentence and never invent prices. "
)
QUESTIONS = ["When does the bakery open?", "Which cakes are sold?", "Is it open on Monday?"]


def conversation(question):
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n" + chat(question))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("prefix"))
    link_model(repo, SMOL, "smol_cached")
    link_model(repo, SMOL, "smol_cold", lambda t: t + (
        'parameters { key: "prefix_cache_max_tokens" value { string_value: "0" } }\n'))
    link_model(repo, TINY, "tiny_tenant")
    link_model(repo, TINY, "tiny_shared", lambda t: t + (
        'parameters { key: "prefix_cache_scope" value { string_value: "server" } }\n'))
    config = os.path.join(repo, "wasmtron.toml")
    with open(config, "w") as f:
        for name in KEYS:
            f.write(f'[[tenant]]\nname = "{name}"\napi_keys = [{digest(KEYS[name])}]\n'
                    f'infer = ["*"]\n\n')
    s = Server(repo, "--config", config)
    yield s
    s.stop()


def generate(server, model, ids, tenant="a", max_tokens=24):
    """The greedy tokens of one streamed request."""
    client = grpcclient.InferenceServerClient(server.grpc)
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)),
                        headers={"authorization": f"Bearer {KEYS[tenant]}"})
    inputs = []
    for name, value, wire, dtype in [("input_ids", [ids], "INT32", np.int32),
                                     ("max_tokens", [[max_tokens]], "INT32", np.int32)]:
        t = grpcclient.InferInput(name, list(np.shape(value)), wire)
        t.set_data_from_numpy(np.array(value, dtype=dtype))
        inputs.append(t)
    client.async_stream_infer(model, inputs)
    client.stop_stream()
    client.close()
    tokens = []
    for result, error in answers:
        if error is not None:
            raise RuntimeError(str(error))
        tokens += [int(t) for t in result.as_numpy("output_ids")[0]]
    return tokens


def hits(server, model):
    return metric(server, "vllm:prefix_cache_hits_total", model)


def test_a_shared_system_prompt_is_prefilled_once_and_answers_as_a_cold_prefill(server):
    import tokenizers
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(SMOL, "1", "tokenizer.json"))
    system_tokens = len(tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n").ids)
    assert system_tokens > 64
    before = hits(server, "smol_cached")
    queries = metric(server, "vllm:prefix_cache_queries_total", "smol_cached")
    prompts = [tokenizer.encode(conversation(q)).ids for q in QUESTIONS]
    for ids in prompts:
        cached = generate(server, "smol_cached", ids)
        cold = generate(server, "smol_cold", ids)
        assert cached == cold, (tokenizer.decode(cached), tokenizer.decode(cold))
    # The second and third questions found the system prompt (and more) in the cache.
    assert hits(server, "smol_cached") - before >= 2 * system_tokens
    assert metric(server, "vllm:prefix_cache_queries_total", "smol_cached") - queries == sum(
        len(p) for p in prompts)
    # The same prompt again: all of it but its last token comes from the cache.
    before = hits(server, "smol_cached")
    assert generate(server, "smol_cached", prompts[0]) == generate(server, "smol_cold", prompts[0])
    assert hits(server, "smol_cached") - before == len(prompts[0]) - 1
    assert metric(server, "vllm:prefix_cache_hits_total", "smol_cold") == 0


def test_tenants_reuse_only_their_own_prompts_unless_the_model_shares_them(server):
    prefix = list(range(10, 50))
    for model, shared in (("tiny_tenant", False), ("tiny_shared", True)):
        generate(server, model, prefix + [60], tenant="a", max_tokens=4)
        before = hits(server, model)
        generate(server, model, prefix + [61], tenant="b", max_tokens=4)
        gained = hits(server, model) - before
        assert gained == (len(prefix) if shared else 0), model
        before = hits(server, model)
        generate(server, model, prefix + [62], tenant="a", max_tokens=4)
        assert hits(server, model) - before == len(prefix), model


def test_prompts_arriving_together_prefill_their_shared_part_once(server):
    # Three questions on one new system prompt, sent at once: however they are admitted
    # (together, or one after another), only the first prefills the shared part.
    import threading
    import tokenizers
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(SMOL, "1", "tokenizer.json"))
    system = "Remember: the sea is calm today, and " + SYSTEM
    prompts = [tokenizer.encode(f"<|im_start|>system\n{system}<|im_end|>\n" + chat(q)).ids
               for q in QUESTIONS]
    shared = len(tokenizer.encode(f"<|im_start|>system\n{system}<|im_end|>\n").ids)
    cold = [generate(server, "smol_cold", p, max_tokens=12) for p in prompts]
    before = hits(server, "smol_cached")
    answers = [None] * len(prompts)

    def one(i):
        answers[i] = generate(server, "smol_cached", prompts[i], max_tokens=12)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert answers == cold
    assert hits(server, "smol_cached") - before >= 2 * shared


def test_a_tenant_cannot_evict_another_tenants_prompts(server):
    # The tiny decoder's budget is 128 tokens: each of the two tenants keeps 64. Tenant b's
    # prompt stays cached however many prompts tenant a sends (a's newest replace a's oldest),
    # so a can neither evict it nor learn from its own entries going when b is busy.
    prompt = list(range(100, 140))
    generate(server, "tiny_tenant", prompt + [200], tenant="b", max_tokens=2)
    for i in range(6):
        generate(server, "tiny_tenant", [250 + i] + list(range(150, 190)), tenant="a", max_tokens=2)
    before = hits(server, "tiny_tenant")
    generate(server, "tiny_tenant", prompt + [201], tenant="b", max_tokens=2)
    assert hits(server, "tiny_tenant") - before == len(prompt)
