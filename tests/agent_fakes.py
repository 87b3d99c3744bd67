"""A scripted policy: a stand-in model that emits fixed tokens, to drive the automaton exactly."""

from collections import deque

import torch

from hybridlm.alphabet import truncate


class Config:
    def __init__(self, n_ctx: int, vocab_size: int) -> None:
        self.n_ctx, self.vocab_size = n_ctx, vocab_size


class ScriptState:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.logits = None

    def crop(self, n: int) -> None:
        self.tokens = self.tokens[:n]

    def clone(self) -> "ScriptState":
        return ScriptState(list(self.tokens))


class ScriptedModel:
    """G(x) puts all mass on the next token of the script; F keeps the string s under Π_T.

    The script is text, split into the tokens a model would emit (the tokenizer's own
    segmentation); after it runs out the model ends its turn.
    """

    source = "scripted"

    def __init__(self, tokenizer, script: list[str], *, n_ctx: int = 4096, delay_s: float = 0.0) -> None:
        # (a script is what the model writes: its own control tokens, such as the end of its turn, are tokens)
        self.tokenizer = tokenizer
        self.config = Config(n_ctx, tokenizer.vocab_size)
        self.script = deque(i for piece in script for i in tokenizer.encode_markup(piece))
        self.delay_s = delay_s
        self.contexts: list[list[int]] = []  # s after every F, for inspection

    def init_state(self, ids) -> ScriptState:
        x = ScriptState(truncate(list(ids), self.config.n_ctx))
        self.contexts.append(list(x.tokens))
        return x

    def F(self, x: ScriptState, w) -> ScriptState:
        w = w.tolist() if isinstance(w, torch.Tensor) else list(w)
        x.tokens = truncate(x.tokens + [int(i) for i in w], self.config.n_ctx)
        self.contexts.append(list(x.tokens))
        return x

    def G(self, x: ScriptState) -> torch.Tensor:
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        z = torch.zeros(1, self.config.vocab_size)
        nxt = self.script.popleft() if self.script else self.tokenizer.end_of_turn_id
        z[0, nxt] = 100.0
        return z


class ScriptsState(ScriptState):
    def __init__(self, tokens: list[int], script: deque) -> None:
        super().__init__(tokens)
        self.script = script


class ScriptsModel(ScriptedModel):
    """Like ScriptedModel, but every sequence (every state it prefills, in order) follows its own
    script, so several sequences can share one engine."""

    def __init__(self, tokenizer, scripts: list[list[str]], *, n_ctx: int = 4096, delay_s: float = 0.0) -> None:
        super().__init__(tokenizer, [], n_ctx=n_ctx, delay_s=delay_s)
        self.scripts = deque(deque(i for piece in script for i in tokenizer.encode_markup(piece)) for script in scripts)

    def init_state(self, ids) -> ScriptsState:
        return ScriptsState(truncate(list(ids), self.config.n_ctx), self.scripts.popleft() if self.scripts else deque())

    def G(self, x: ScriptsState) -> torch.Tensor:
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        z = torch.zeros(1, self.config.vocab_size)
        z[0, x.script.popleft() if x.script else self.tokenizer.end_of_turn_id] = 100.0
        return z
