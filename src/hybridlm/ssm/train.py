"""A tiny selective SSM learns a task that needs selective memory (docs/theory.md §5.4, the survey's (S17)).

The task, "latest key": the string mixes key tokens (0..K−1, rare) with noise tokens
(K..K+M−1); at every position the model must name the most recent key seen so far. The
answer can lie far behind the current token, beyond the short convolution's window, so
it must live in the state c(k, i): a key has to be written (large Δ: Ā ≈ 0 forgets the
old key, B̄ writes the new one) and noise ignored (small Δ: Ā ≈ I holds) — the
input-dependent Ā(z), B̄(z) of a selective SSM do exactly this; a time-invariant one
cannot. Chance is ln K (uniform over the keys).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridlm.ssm.config import StackConfig
from hybridlm.ssm.model import StackLM, init_stack


def latest_key_batch(batch: int, n: int, *, keys: int = 8, noise: int = 8, p_key: float = 0.1,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets), both [batch, n]: targets[i] is the latest key among ids[..i]; ids[0] is a key."""
    g = generator
    is_key = torch.rand(batch, n, generator=g) < p_key
    is_key[:, 0] = True
    ids = torch.where(is_key, torch.randint(0, keys, (batch, n), generator=g),
                      torch.randint(keys, keys + noise, (batch, n), generator=g))
    last = torch.where(is_key, torch.arange(n), 0).cummax(dim=1).values  # index of the latest key
    return ids, ids.gather(1, last)


@dataclass
class TrainResult:
    model: StackLM
    losses: list[float] = field(default_factory=list)  # training loss per step
    chance: float = 0.0  # ln K
    initial_loss: float = 0.0  # held-out loss before training
    final_loss: float = 0.0  # held-out loss after training
    final_accuracy: float = 0.0
    wall_s: float = 0.0


def train_demo(*, steps: int = 200, batch: int = 16, n: int = 64, keys: int = 8, noise: int = 8,
               p_key: float = 0.1, layers: str = "SS", d_model: int = 32, d_state: int = 4, lr: float = 1e-2,
               seed: int = 0, eval_batch: int = 256, log_every: int = 0) -> TrainResult:
    """Train a tiny selective SSM on `latest_key_batch` with Adam; return losses and held-out figures."""
    torch.manual_seed(seed)
    cfg = StackConfig(layers=layers, vocab_size=keys + noise, n_ctx=n, d_model=d_model, d_state=d_state,
                      eos_token_id=None)
    model = init_stack(StackLM(cfg), seed).train()
    g = torch.Generator().manual_seed(seed)
    held_out = latest_key_batch(eval_batch, n, keys=keys, noise=noise, p_key=p_key,
                                generator=torch.Generator().manual_seed(seed + 1))
    result = TrainResult(model=model, chance=math.log(keys))
    result.initial_loss, _ = evaluate(model, *held_out)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        ids, target = latest_key_batch(batch, n, keys=keys, noise=noise, p_key=p_key, generator=g)
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        result.losses.append(loss.item())
        if log_every and step % log_every == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  (chance {result.chance:.3f})")
    result.wall_s = time.perf_counter() - t0
    model.eval()
    result.final_loss, result.final_accuracy = evaluate(model, *held_out)
    return result


@torch.no_grad()
def evaluate(model: StackLM, ids: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """Held-out cross-entropy and accuracy."""
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten()).item()
    return loss, (logits.argmax(-1) == target).float().mean().item()
