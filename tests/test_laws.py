"""Laws of the alphabet, the attention map and the tokenizer (hypothesis)."""

import torch
from hypothesis import given, settings, strategies as st

from hybridlm import ModelConfig, concat, load_model, truncate
from hybridlm.tokenizer import gpt2_tokenizer

strings = st.lists(st.integers(0, 50256), max_size=80)
horizons = st.integers(1, 60)


@given(strings, horizons)
def test_truncation_idempotent_and_suffix(s, T):
    once = truncate(s, T)
    assert truncate(once, T) == once  # Π_T ∘ Π_T = Π_T
    assert len(once) == min(len(s), T)
    assert once == s[len(s) - len(once) :]  # a suffix of s


@given(strings, strings, strings)
def test_concatenation_is_a_monoid(a, b, c):
    assert concat(concat(a, b), c) == concat(a, concat(b, c))
    assert concat(a, []) == concat([], a) == a


_MODEL = {}


def model():
    if "m" not in _MODEL:
        cfg = ModelConfig(vocab_size=200, n_ctx=48, d_model=32, n_layer=2, n_head=4, n_kv_head=2, eos_token_id=None)
        _MODEL["m"] = load_model(cfg, seed=1)
    return _MODEL["m"]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 48), prefix=st.integers(0, 47), seed=st.integers(0, 10_000))
def test_attention_rows_stochastic_and_causal(n, prefix, seed):
    """Every row of A sums to 1 and A(i, j) = 0 for keys j after the query's position i.

    Checked both for a prefill from the empty state and for a block entering a state
    that already holds `prefix` positions (the queries then sit at prefix..prefix+m−1).
    """
    m = model()
    prefix = min(prefix, n - 1)
    ids = torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(seed))
    patterns = []
    x = m.init_state(ids[:, :prefix]) if prefix else None
    with m.hooks({f"blocks.{l}.attn.hook_pattern": lambda a, h: patterns.append(a) for l in range(2)}):
        m(ids[:, prefix:], x)
    assert len(patterns) == 2
    for A in patterns:
        assert A.shape == (1, 4, n - prefix, n)
        assert torch.allclose(A.sum(-1), torch.ones(A.shape[:-1]), atol=1e-6)
        query_pos = torch.arange(prefix, n)[:, None]
        above = torch.arange(n)[None, :] > query_pos
        assert torch.all(A[..., above] == 0)


def test_pattern_path_equals_fused_path():
    """Forming A explicitly (when a hook asks for it) gives the same logits as the fused kernel."""
    m = model()
    ids = torch.randint(0, 200, (2, 30))
    fused = m(ids)
    with m.hooks({"blocks.0.attn.hook_pattern": lambda a, h: None}):
        explicit = m(ids)
    assert torch.allclose(fused, explicit, atol=1e-5)


_TOK = {}


def tok():
    if "t" not in _TOK:
        _TOK["t"] = gpt2_tokenizer()
    return _TOK["t"]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text):
    ids = tok().encode(text)
    assert all(0 <= i < 50257 for i in ids)
    assert tok().decode(ids) == text
