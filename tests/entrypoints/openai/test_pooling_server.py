"""The pooling endpoints over a real socket: /v1/embeddings (through the openai SDK and
LangChain), /pooling, /score, /rerank and /classify, each against transformers on the same
random weights. Three pooling servers (a decoder served with --runner pooling, a BERT
cross-encoder, a BERT 3-label classifier) and one generative server, each started once;
the refusals name the task, the model and the lengths."""

from __future__ import annotations

import base64
import json
import struct
import time

import httpx
import pytest
import torch
import torch.nn.functional as F
from server_utils import COMMON, TINY_SERVER, start_server, write_tiny_chat_model

SENTENCES = ["hello world", "a somewhat longer sentence about pooling vectors", "x",
             "the quick brown fox jumps over the lazy dog " * 3]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "berlin is a city in germany",
             "the cat sat on the mat", "france has many old cities", "what a capital idea"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def error_message(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


# ---- the embedding model: a decoder's last token, normalized ----------------------------


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A tiny random Llama saved by transformers (real weights) with SmolLM2's tokenizer,
    and the transformers model on the same weights."""
    import transformers

    path = write_tiny_chat_model(tmp_path_factory.mktemp("embedder"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def embed_server(decoder):
    # one whole prompt a step at most, so a large request takes a while (the disconnect test)
    s = start_server("--model", decoder[0], *COMMON, "--runner", "pooling", "--num-blocks",
                     "64", "--max-model-len", "128", "--max-num-batched-tokens", "128",
                     "--served-model-name", "tiny-embed")
    yield s
    s.stop()


def token_ids(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


def hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]  # [tokens, hidden]


def reference_embedding(model, ids: list[int]) -> torch.Tensor:
    return F.normalize(hidden(model, ids)[-1], dim=-1)


def same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to float32 precision: two requests batch differently, which moves the last
    bits of a float32 sum."""
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-6, rtol=1e-5)


def test_sdk_embeddings_equal_transformers_in_every_encoding(embed_server, decoder):
    client = embed_server.client()
    floats = client.embeddings.create(model="tiny-embed", input=SENTENCES,
                                      encoding_format="float")
    assert floats.object == "list" and floats.model == "tiny-embed"
    assert floats.id.startswith("embd-") and floats.created > 0
    ids = [token_ids(embed_server, text) for text in SENTENCES]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in floats.data] == list(range(len(SENTENCES)))
    for d, prompt_ids in zip(floats.data, ids):
        got, ref = torch.tensor(d.embedding), reference_embedding(decoder[1], prompt_ids)
        assert F.cosine_similarity(got, ref, dim=0) >= 0.9999
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    default = client.embeddings.create(model="tiny-embed", input=SENTENCES)  # base64 inside
    explicit = client.embeddings.create(model="tiny-embed", input=SENTENCES,
                                        encoding_format="base64")
    for f, d, e in zip(floats.data, default.data, explicit.data):
        as_float = torch.tensor(f.embedding)
        same(torch.tensor(d.embedding), as_float)
        raw = base64.b64decode(e.embedding)
        assert len(raw) == 4 * len(f.embedding)
        same(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), as_float)


def test_token_id_inputs_embed_as_their_text(embed_server):
    client = embed_server.client()
    ids = [token_ids(embed_server, text) for text in SENTENCES[:2]]
    by_text = client.embeddings.create(model="tiny-embed", input=SENTENCES[:2],
                                       encoding_format="float").data
    one = client.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float")
    assert one.usage.prompt_tokens == len(ids[0])
    same(torch.tensor(one.data[0].embedding), torch.tensor(by_text[0].embedding))
    many = client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    assert len(many.data) == 2 and many.usage.prompt_tokens == sum(map(len, ids))
    for d, t in zip(many.data, by_text):
        same(torch.tensor(d.embedding), torch.tensor(t.embedding))


def test_embedding_refusals_and_truncation(embed_server):
    msg = error_message(post(embed_server, "/v1/embeddings", {"input": "hi", "dimensions": 8}))
    assert "does not support matryoshka representation" in msg
    long_text = "word " * 200
    n = len(token_ids(embed_server, long_text))
    msg = error_message(post(embed_server, "/v1/embeddings", {"input": ["hi", long_text]}))
    assert f"maximum input length is 128 tokens. However, the input is {n} tokens" in msg
    cut = post(embed_server, "/v1/embeddings", {"input": long_text,
                                                "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 128
    assert post(embed_server, "/v1/embeddings", {"input": long_text,
                                                 "truncate_prompt_tokens": 16}
                ).json()["usage"]["prompt_tokens"] == 16
    msg = error_message(post(embed_server, "/v1/embeddings", {"input": "hi", "model": "gpt"}),
                        404)
    assert "`gpt` does not exist" in msg
    msg = error_message(post(embed_server, "/v1/embeddings", {"input": [[1], [10**9]]}))
    assert "out of range for the vocabulary" in msg
    msg = error_message(post(embed_server, "/v1/embeddings", {"input": "hi",
                                                              "embed_dtype": "float16"}))
    assert "embed_dtype" in msg


def metric(server, name: str, label: str = "") -> float:
    """The sum of a Prometheus metric's samples whose labels hold ``label``."""
    lines = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name + "{") and label in line)


def test_pooling_requests_are_counted_in_metrics(embed_server):
    def counts() -> tuple[float, float]:
        return (metric(embed_server, "vllm:request_success_total", 'finished_reason="stop"'),
                metric(embed_server, "vllm:prompt_tokens_total"))

    done, tokens = counts()
    texts = ["one two three", "four five"]
    r = post(embed_server, "/v1/embeddings", {"input": texts})
    assert r.status_code == 200
    sent = r.json()["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 5  # the metrics are updated after the response
    while counts() != (done + 2, tokens + sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts() == (done + 2, tokens + sent)


def test_a_client_gone_aborts_its_inputs(embed_server):
    def aborted() -> float:
        return metric(embed_server, "vllm:request_success_total", 'finished_reason="abort"')

    def ended() -> float:
        return metric(embed_server, "vllm:request_success_total")

    def in_flight() -> float:
        return (metric(embed_server, "vllm:num_requests_waiting")
                + metric(embed_server, "vllm:num_requests_running"))

    before, ended_before = aborted(), ended()
    with pytest.raises(httpx.TimeoutException):  # 1000 inputs take seconds, one a step
        httpx.post(f"{embed_server.url}/v1/embeddings",
                   json={"input": ["word " * 120] * 1000}, timeout=0.3)
    # The client may leave before the server has even read the body, while the gauges
    # still say nothing is in flight: wait for every input to end (computed or aborted).
    deadline = time.monotonic() + 60  # a loaded machine takes a while over 1000 aborts
    while ((ended() - ended_before < 1000 or in_flight())
           and time.monotonic() < deadline):
        time.sleep(0.1)
    # most inputs were still queued when the client left: they end aborted, not computed
    assert ended() - ended_before == 1000
    assert in_flight() == 0 and aborted() - before >= 500


def test_a_pooling_model_does_not_generate(embed_server):
    for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}],
                                                 "stream": True})]:
        msg = error_message(post(embed_server, path, body))
        assert "is a pooling model (tasks: embed, score, encode)" in msg
        assert "does not generate text" in msg and "LlamaForCausalLM" in msg
    msg = error_message(post(embed_server, "/classify", {"input": "hi"}))
    assert "does not serve the classify task" in msg
    card = embed_server.client().models.list().data[0]
    assert card.id == "tiny-embed" and card.max_model_len == 128
    assert (card.task, card.tasks) == ("embed", ["embed", "score", "encode"])


def test_pooling_returns_every_token_state_or_the_embedding(embed_server, decoder):
    ids = token_ids(embed_server, SENTENCES[1])
    body = post(embed_server, "/pooling", {"input": SENTENCES[1]}).json()
    assert body["object"] == "list" and body["id"].startswith("pool-")
    assert body["data"][0]["object"] == "pooling" and body["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), hidden(decoder[1], ids),
                               atol=1e-5, rtol=1e-4)
    raw = base64.b64decode(post(embed_server, "/pooling", {
        "input": SENTENCES[1], "encoding_format": "base64"}).json()["data"][0]["data"])
    same(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)),
         torch.tensor(body["data"][0]["data"]).flatten())
    embed = post(embed_server, "/pooling", {"input": [SENTENCES[1]], "task": "embed"}).json()
    torch.testing.assert_close(torch.tensor(embed["data"][0]["data"]),
                               reference_embedding(decoder[1], ids), atol=1e-5, rtol=1e-4)
    msg = error_message(post(embed_server, "/pooling", {"input": "hi", "task": "classify"}))
    assert "does not serve the classify task" in msg
    refused = post(embed_server, "/pooling", {"input": "hi", "dimensions": 8})
    assert "dimensions applies to the embed task, not encode" in error_message(refused)
    assert refused.json()["error"]["param"] == "dimensions"


def test_score_and_rerank_by_cosine_of_embeddings(embed_server, decoder):
    vectors = {t: reference_embedding(decoder[1], token_ids(embed_server, t))
               for t in SENTENCES}
    body = post(embed_server, "/score", {"text_1": SENTENCES[0], "text_2": SENTENCES}).json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    for item, text in zip(body["data"], SENTENCES):
        assert item["object"] == "score"
        ref = F.cosine_similarity(vectors[SENTENCES[0]], vectors[text], dim=0).item()
        assert item["score"] == pytest.approx(ref, abs=1e-5)
    # each distinct text is embedded once
    assert body["usage"]["prompt_tokens"] == sum(len(token_ids(embed_server, t))
                                                 for t in SENTENCES)
    pairwise = post(embed_server, "/v1/score", {"text_1": SENTENCES[:2],
                                                "text_2": SENTENCES[2:]}).json()
    for item, a, b in zip(pairwise["data"], SENTENCES[:2], SENTENCES[2:]):
        ref = F.cosine_similarity(vectors[a], vectors[b], dim=0).item()
        assert item["score"] == pytest.approx(ref, abs=1e-5)
    msg = error_message(post(embed_server, "/score", {"text_1": SENTENCES[:2],
                                                      "text_2": SENTENCES[:3]}))
    assert "same length" in msg
    ranked = post(embed_server, "/rerank", {"query": SENTENCES[0], "documents": SENTENCES[1:],
                                            "top_n": 2}).json()["results"]
    order = sorted(range(3), key=lambda i: -F.cosine_similarity(
        vectors[SENTENCES[0]], vectors[SENTENCES[i + 1]], dim=0).item())
    assert [r["index"] for r in ranked] == order[:2]


def test_langchain_embeddings_round_trip(embed_server, decoder):
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai (the test extra) is not installed")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model="tiny-embed", base_url=f"{embed_server.url}/v1", api_key="x",
        check_embedding_ctx_length=False, max_retries=0)
    documents = embeddings.embed_documents(SENTENCES)
    assert len(documents) == len(SENTENCES)
    for vector, text in zip(documents, SENTENCES):
        ref = reference_embedding(decoder[1], token_ids(embed_server, text))
        torch.testing.assert_close(torch.tensor(vector), ref, atol=1e-5, rtol=1e-4)
    same(torch.tensor(embeddings.embed_query(SENTENCES[2])), torch.tensor(documents[2]))


# ---- a generative model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_server(tiny_chat_model):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "16",
                     "--max-model-len", "128", "--served-model-name", "tiny-chat")
    yield s
    s.stop()


def test_a_generative_model_does_not_pool(chat_server, tiny_chat_model):
    for path, body in [("/v1/embeddings", {"input": "hi", "model": "tiny-chat"}),
                       ("/pooling", {"input": "hi", "task": "embed"})]:
        msg = error_message(post(chat_server, path, body))
        assert "does not serve the embed task" in msg and repr(tiny_chat_model) in msg
        assert "--runner pooling" in msg
    msg = error_message(post(chat_server, "/score", {"text_1": "a", "text_2": "b"}))
    assert "does not serve the score task" in msg
    msg = error_message(post(chat_server, "/classify", {"input": "a"}))
    assert "does not serve the classify task" in msg
    card = chat_server.client().models.list().data[0]
    assert (card.task, card.tasks) == ("generate", ["generate"])
    done = post(chat_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert done.status_code == 200, done.text


# ---- BERT cross-encoder and classifier ----------------------------------------------------


def write_bert(path, num_labels: int, seed: int, id2label: dict[int, str] | None = None):
    """A tiny random BertForSequenceClassification saved by transformers, with a WordPiece
    tokenizer over the test words whose pair template gives [CLS] a [SEP] b [SEP]; returns
    (path, the transformers model, the tokenizers tokenizer). Weights drawn wide (std 0.5)
    spread the scores apart and make the token types count."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = sorted({w for text in [QUERY, *DOCUMENTS, *SENTENCES] for w in text.split()})
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]),
                                                         ("[CLS]", vocab["[CLS]"]))
    tokenizer.decoder = decoders.WordPiece()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": True,
        "model_max_length": 128, **{f"{name}_token": f"[{name.upper()}]"
                                    for name in ("pad", "unk", "cls", "sep", "mask")}}))
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, type_vocab_size=2,
        initializer_range=0.5, sep_token_id=vocab["[SEP]"], num_labels=num_labels,
        **({"id2label": id2label} if id2label else {}))
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model, tokenizer


def logits(model, tokenizer, a: str, b: str | None = None) -> torch.Tensor:
    encoding = tokenizer.encode(a, b) if b is not None else tokenizer.encode(a)
    with torch.no_grad():
        return model(input_ids=torch.tensor([encoding.ids]),
                     token_type_ids=torch.tensor([encoding.type_ids])).logits[0]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return write_bert(tmp_path_factory.mktemp("cross-encoder"), num_labels=1, seed=1)


@pytest.fixture(scope="module")
def rerank_server(cross_encoder):
    s = start_server("--model", cross_encoder[0], *COMMON, "--num-blocks", "32",
                     "--max-model-len", "128", "--served-model-name", "tiny-rerank")
    yield s
    s.stop()


def oracle_scores(cross_encoder, query: str, documents: list[str]) -> list[float]:
    _, model, tokenizer = cross_encoder
    return [torch.sigmoid(logits(model, tokenizer, query, d)[0]).item() for d in documents]


def test_cross_encoder_scores_equal_transformers(rerank_server, cross_encoder):
    expected = oracle_scores(cross_encoder, QUERY, DOCUMENTS)
    body = post(rerank_server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-4)
    tokenizer = cross_encoder[2]
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(QUERY, d).ids)
                                                 for d in DOCUMENTS)
    pairwise = post(rerank_server, "/v1/score", {"text_1": DOCUMENTS[:2],
                                                 "text_2": DOCUMENTS[2:4]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [oracle_scores(cross_encoder, a, [b])[0] for a, b in zip(DOCUMENTS[:2], DOCUMENTS[2:4])],
        abs=1e-4)
    card = rerank_server.client().models.list().data[0]
    assert card.tasks == ["classify", "score", "encode"]


def test_rerank_orders_cuts_and_returns_documents(rerank_server, cross_encoder):
    expected = oracle_scores(cross_encoder, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    body = post(rerank_server, "/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert body["id"].startswith("rerank-") and body["model"] == "tiny-rerank"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
    results = body["results"]
    assert [r["index"] for r in results] == order
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in order]
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [expected[i] for i in order], abs=1e-4)
    for path in ("/v1/rerank", "/v2/rerank"):
        top = post(rerank_server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                         "return_documents": False}).json()["results"]
        assert [r["index"] for r in top] == order[:2]
        assert all("document" not in r for r in top)
    msg = error_message(post(rerank_server, "/rerank", {"query": QUERY, "documents": []}))
    assert "at least one text" in msg


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return write_bert(tmp_path_factory.mktemp("classifier"), num_labels=3, seed=3,
                      id2label=LABELS)  # its top labels over DOCUMENTS: all three


@pytest.fixture(scope="module")
def classify_server(classifier):
    s = start_server("--model", classifier[0], *COMMON, "--num-blocks", "32",
                     "--max-model-len", "128", "--served-model-name", "tiny-classify")
    yield s
    s.stop()


def test_classify_probs_and_labels_equal_transformers(classify_server, classifier):
    _, model, tokenizer = classifier
    body = post(classify_server, "/classify", {"input": DOCUMENTS}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for item, text in zip(body["data"], DOCUMENTS):
        probs = torch.softmax(logits(model, tokenizer, text), dim=-1)
        assert item["num_classes"] == 3
        assert item["probs"] == pytest.approx(probs.tolist(), abs=1e-4)
        assert item["label"] == LABELS[int(probs.argmax())]
    assert {item["label"] for item in body["data"]} == set(LABELS.values())
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t).ids)
                                                 for t in DOCUMENTS)
    msg = error_message(post(classify_server, "/v1/embeddings", {"input": "hi"}))
    assert "does not serve the embed task" in msg
