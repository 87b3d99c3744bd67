"""Recurrent and selective state-space models as two-index (layer, position) recurrences
(docs/theory.md §5.4, the survey's (S16)–(S17)).

`StackLM` runs a stack of selective-SSM (S), Elman-RNN (R) and attention (A) blocks with the
transformer's state-space interface; `SSMState` is its fixed-size state.
"""

from hybridlm.ssm.config import KINDS, SIZES, StackConfig, preset
from hybridlm.ssm.model import RecurrentBlock, StackLM, init_stack, random_stack
from hybridlm.ssm.plots import plot_state_norms, state_norms
from hybridlm.ssm.scan import parallel_scan, recurrence
from hybridlm.ssm.train import latest_key_batch, train_demo
from hybridlm.ssm.state import SSMState

__all__ = [
    "KINDS", "SIZES", "RecurrentBlock", "SSMState", "StackConfig", "StackLM", "init_stack", "latest_key_batch",
    "parallel_scan", "plot_state_norms", "state_norms", "train_demo",
    "preset", "random_stack", "recurrence",
]
