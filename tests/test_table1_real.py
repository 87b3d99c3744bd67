"""Table 1 of the survey on a real pretrained model: the looped model's decoded sentence after 1, 2, 4
and 10 passes, and the share of its most frequent token, which rises with the passes (Qwen2.5-Coder-0.5B,
full blocks: 8 % → 12 % → 32 % → 88 % when measured)."""

from __future__ import annotations

import pytest

SENTENCE = ("Deep neural networks, in their different shapes and flavors, are having a remarkable impact in almost "
            "every area of science and engineering.")


def test_the_majority_share_rises_with_the_passes_on_qwen():
    from hybridlm import load_model
    from hybridlm.analysis.consensus import table1
    from hybridlm.errors import ModelNotFoundError
    from hybridlm.weights.registry import real_model_path

    try:
        real_model_path("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(f"qwen2.5-coder-0.5b: {exc}")
    model = load_model("qwen2.5-coder-0.5b")
    rows = table1(model, SENTENCE)
    assert [r["passes"] for r in rows] == [1, 2, 4, 10]
    shares = [r["majority_share"] for r in rows]
    n = len(rows[0]["tokens"])
    for r in rows:  # the share is that of the named token among the decoded positions
        assert len(r["tokens"]) == n and r["tokens"].count(max(set(r["tokens"]), key=r["tokens"].count)) == round(
            r["majority_share"] * n)
    print("majority share per pass:", [f"{s:.0%}" for s in shares])
    assert all(a <= b for a, b in zip(shares, shares[1:])) and shares[-1] >= shares[0] + 0.5, shares
    assert "networks" in rows[0]["text"]  # one pass is the model itself: it still reads the sentence
