"""Depth dynamics of a looped transformer and its consensus (docs/theory.md §5.3, the survey's (0.39)–(0.45)).

The blocks update every token, z_i(k+1) = z_i(k) + A_i(Z(k)) + r_k(…) (0.39)–(0.40); without
the MLP sublayer only the attention update remains (0.41). Looping the model, feeding the
tokens leaving block L back into block 1 pass after pass, makes the depth grow without
bound, and the tokens reach consensus: the error

    E(k) = 1 − (1/m) Σ_i ⟨z_1(k), z_i(k)⟩ / (‖z_1(k)‖ ‖z_i(k)‖)          (0.45)

falls towards 0 as the layer-steps k accumulate. Weights may be the pretrained ones,
random and fixed across passes (periodic), or random and redrawn every pass.

The same loop runs the recurrent / selective-SSM / hybrid stacks of `hybridlm.ssm`: their
blocks have the same two sublayers, so `attention_only` keeps the token mixer (SSM, RNN or
attention) and drops the MLP, and random weights come from the stack's own initialisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hybridlm.analysis.sphere import consensus_E
from hybridlm.errors import InputError
from hybridlm.lm.model import Block, DecoderLM, init_weights
from hybridlm.lm.sphere_block import SphereBlock
from hybridlm.ssm.model import RecurrentBlock, StackLM

WEIGHTS = ("pretrained", "random-fixed", "random-redrawn")


@dataclass(frozen=True)
class LayerStep:
    """E over the prompts after one block: k counts blocks applied (0 = the embedding)."""

    k: int
    pass_: int  # 1-based pass; 0 for the embedding
    layer: int  # block within the pass; -1 for the embedding
    E: torch.Tensor  # [B]: one value per prompt


def block_step(model: DecoderLM | StackLM, block: nn.Module, h: torch.Tensor, pos: torch.Tensor, *,
               attention_only: bool) -> torch.Tensor:
    """One layer-step: the full block (0.39)–(0.40), or its attention sublayer alone (0.41)."""
    if not attention_only:
        return block(h, pos, None, model.rotary)
    if isinstance(block, SphereBlock):  # the post-norm sphere block: n(z + A(Z)) (0.41)
        return block.attention_only_step(h, pos, model.rotary)
    if isinstance(block, RecurrentBlock):  # a recurrent block of hybridlm.ssm: its mixer sublayer alone
        return block.mixer_step(h, pos)
    if not isinstance(block, Block):
        raise TypeError(f"block {type(block).__name__}: expected a transformer, sphere or recurrent block")
    h = block.hook_resid_pre(h)
    return block.hook_resid_post(h + block.hook_attn_out(block.attention_sublayer(h, pos, None, model.rotary)))


def reinit(model: DecoderLM | StackLM, seed: int, *, part: nn.Module | None = None) -> None:
    """Random weights of the model's family, in place: `model.reinit` where the model has its
    own (the stacks of `hybridlm.ssm`), GPT-2's initialisation otherwise."""
    if isinstance(model, StackLM):
        model.reinit(seed, part=part)
    else:
        init_weights(model, seed=seed, part=part)


def redraw(model: DecoderLM | StackLM, seed: int, *, attention_only: bool = False) -> None:
    """New random weights for every block, in place. Attention only, the MLPs are not drawn:
    no layer-step uses them, and at GPT-Neo 2.7B's shape they are two thirds of the draws."""
    part: nn.Module = model.blocks
    if attention_only:  # the blocks' other parts, named as in the block (the init rules match on names)
        part = nn.ModuleDict({f"{i}_{name}": child for i, block in enumerate(model.blocks)
                              for name, child in block.named_children() if name != "mlp"})
    reinit(model, seed, part=part)


@torch.no_grad()
def looped(
    model: DecoderLM,
    h: torch.Tensor,
    *,
    passes: int,
    attention_only: bool = False,
    redraw_seed: Callable[[int], int] | None = None,
    start_pass: int = 1,
) -> Iterator[tuple[LayerStep, torch.Tensor]]:
    """Loop the blocks over the token states h [B, n, d]; yield E after every layer-step.

    `redraw_seed(p)`, when given, redraws the blocks' weights before pass p (non-periodic).
    `start_pass` resumes a run from a saved h. Yields (LayerStep, h after that step).
    """
    L = model.config.n_layer
    pos = torch.arange(h.shape[1], device=h.device)
    model.hook_ctx.pos = pos
    if start_pass == 1:
        yield LayerStep(0, 0, -1, consensus_E(h)), h
    for p in range(start_pass, passes + 1):
        if redraw_seed is not None:
            redraw(model, redraw_seed(p), attention_only=attention_only)
        for layer, block in enumerate(model.blocks):
            h = block_step(model, block, h, pos, attention_only=attention_only)
            yield LayerStep((p - 1) * L + layer + 1, p, layer, consensus_E(h)), h


def random_prompts(model: DecoderLM, n_prompts: int, prompt_len: int, seed: int) -> torch.Tensor:
    """Prompts of tokens drawn uniformly from the vocabulary (the survey: 100 × 200)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n_prompts, prompt_len), generator=g)


def embed(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    """H⁽⁰⁾ of the prompts: the tokens entering the first pass."""
    pos = torch.arange(ids.shape[1])
    return model.embed(ids.to(model.W_e.device), pos.to(model.W_e.device))


@torch.no_grad()
def decode_positions(model: DecoderLM, h: torch.Tensor) -> torch.Tensor:
    """Table 1: each position's token after final norm, unembedding and argmax: [B, n]."""
    return model.readout(h).argmax(dim=-1)


def table1(model: DecoderLM, sentence: str, passes: tuple[int, ...] = (1, 2, 4, 10),
           *, attention_only: bool = False) -> list[dict]:
    """Decode the looped tokens of a sentence after each number of passes (the survey's Table 1)."""
    if model.tokenizer is None:
        raise InputError(f"Table 1 needs a model with a tokenizer; {model.source} has none")
    ids = torch.tensor([model.tokenizer.encode(sentence)])
    rows, h0 = [], embed(model, ids)
    last = max(passes)
    for step, h in looped(model, h0, passes=last, attention_only=attention_only):
        if step.layer == model.config.n_layer - 1 and step.pass_ in passes:
            tokens = decode_positions(model, h)[0].tolist()
            top = max(set(tokens), key=tokens.count)
            rows.append({
                "passes": step.pass_,
                "text": model.tokenizer.decode(tokens),
                "tokens": tokens,
                "E": float(step.E[0]),
                "majority_token": model.tokenizer.token_str(top),
                "majority_share": tokens.count(top) / len(tokens),
            })
    return rows


def first_below(values: list[float], threshold: float = 0.05) -> int | None:
    """Index of the first value under the threshold (None if never)."""
    return next((i for i, v in enumerate(values) if v < threshold and not math.isnan(v)), None)
