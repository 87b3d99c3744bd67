"""An affine map x ↦ x Wᵀ + b whose parameters start at zero.

`torch.nn.Linear` draws random starting weights that hybridlm always replaces (by
`init_weights` or by loaded weights); drawing them costs over a second for a 135M model,
so this subclass starts from zeros instead.
"""

from torch import nn


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
