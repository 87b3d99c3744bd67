"""The Elman recurrent mixer (docs/theory.md §5.4, the survey's (S16)).

    c(k, i) = tanh(A(k) c(k, i−1) + B(k) z(k, i) + b(k)),   c(k, 0) = 0
    y(k, i) = C(k) c(k, i)

(S16) writes z(k+1, i) = Σ(C(k) c(k, i)); here, as for every mixer of the stack, y is added
to the residual stream of a pre-norm block. The nonlinearity inside the recursion makes
it inherently sequential in i: prefill is a loop over positions (only the input term
B z is computed for all positions at once), which is what selective SSMs remove.
"""

from __future__ import annotations

import torch

from hybridlm.lm.direct import DirectModule
from hybridlm.lm.hooks import HookPoint
from hybridlm.lm.linear import Linear
from hybridlm.ssm.config import StackConfig


class ElmanRNN(DirectModule):
    def __init__(self, cfg: StackConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.W_A = Linear(cfg.d_rnn, cfg.d_rnn, bias=False)
        self.W_B = Linear(cfg.d_model, cfg.d_rnn, bias=True)  # B z + b
        self.W_C = Linear(cfg.d_rnn, cfg.d_model, bias=False)
        self.hook_state = HookPoint()  # c(k, i): [B, m, d_rnn]

    def forward(self, z: torch.Tensor, state=None) -> torch.Tensor:
        Bz = self.W_B(z)
        c = Bz.new_zeros(Bz.shape[0], Bz.shape[2]) if state is None else state.c[self.layer]
        cs = []
        for i in range(Bz.shape[1]):
            c = torch.tanh(self.W_A(c) + Bz[:, i])
            cs.append(c)
        if state is not None:
            state.c[self.layer] = c
        return self.W_C(self.hook_state(torch.stack(cs, dim=1)))
