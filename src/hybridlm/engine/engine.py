"""The engine: one token clock for a population of hybrid automata (docs/theory.md §7).

Each sequence is an `ArcState` with its own `HybridSystem`. One engine step

1. admits the sequences that joined since the last step and advances the prefill of one of them
   by one chunk of at most `prefill_chunk` tokens (reusing cached prefixes): a long prompt is
   prefilled across steps, interleaved with the token steps of the running rows, which so never
   wait longer than one chunk; a sequence whose prefill is complete joins the batch. It lands the jumps whose
   external work finished (their observation enc(y) prefilled, the sequence back in q_G);
2. classifies every sequence in q_G, HyEQ's way: in the jump set D (and below the jump
   horizon) it jumps, leaving the batch for q_E while its tool runs on a worker thread; in
   the flow set C (and below the token budget) it flows; in C ∩ D the priority rule decides;
   in neither, its arc ends with its termination cause;
3. takes one token step for all flowing sequences at once: each row's readout z = G(x), its
   inputs (its constraint's mask, its system's, its controllers'), a draw from its own kernel
   with its own generator, then one batched x ← F(x, w) (`model.step`), whose products are
   batch-invariant, so every sequence gets the tokens it would get alone.

Token steps and wall time are separate clocks: a sequence in q_E takes no token step while
the others go on, and the arc of each records both. Sequences join and leave between any two
steps; `add` and `cancel` may be called from other threads while `run` steps.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import math
import threading
import time
from collections import deque
from collections.abc import Generator
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from hybridlm.engine.arc import Mode, Termination
from hybridlm.engine.prefill import (
    SEGMENT, ContextPolicy, PrefixCache, inject_steps, prefill_steps, truncate_for_step,
)
from hybridlm.engine.sequence import ArcState
from hybridlm.engine.system import Priority
from hybridlm.errors import InputError
from hybridlm.lm.hooks import observing

NEG_INF = float("-inf")


@dataclass
class EngineStats:
    """Counters of the population, for reports and the server's metrics."""

    steps: int = 0  # engine steps that took a token step
    tokens: int = 0  # tokens emitted (all sequences)
    rows: int = 0  # Σ batch size over steps (mean occupancy = rows / steps)
    joined: int = 0
    ended: int = 0
    jumps: int = 0
    wall_flow_s: float = 0.0  # wall time inside token steps
    wall_prefill_s: float = 0.0  # wall time inside prefills (admissions and observations)
    by_cause: dict = field(default_factory=dict)


class Engine:
    """Advances every sequence in q_G by one token step at a time, in one batch.

    `prefill_chunk`: what is prefilled between two token steps of the running rows, in tokens at the start
    of a context (deeper in it a chunk is shorter, costing the same: `prefill.grid`), and the scale of the
    canonical segments' grid (so of the prefix cache's keys); 0 prefills a prompt in one piece, however
    long, while the running rows wait."""

    def __init__(self, model, *, max_batch: int = 64, priority: Priority | str = Priority.JUMPS,
                 context: ContextPolicy | str = ContextPolicy(), prefix_cache: PrefixCache | None = None,
                 workers: int = 32, prefill_chunk: int = SEGMENT) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch={max_batch!r}: expected an integer ≥ 1")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise InputError(f"prefill_chunk={prefill_chunk!r}: expected an integer ≥ 0 (0: a prompt in one piece)")
        self.prefill_chunk = prefill_chunk
        self.model = model
        self.max_batch = max_batch
        self.priority = Priority(priority)
        self.context = ContextPolicy.parse(context) if isinstance(context, str) else context
        self.prefix_cache = prefix_cache
        self.stats = EngineStats()
        self.waiting: deque[ArcState] = deque()  # joined, not yet admitted
        # admitted or landing, their prefill under way: (sequence, its chunks, what follows the last)
        self.filling: deque[tuple[ArcState, Generator, Callable[[ArcState, Any], None]]] = deque()
        self.active: list[ArcState] = []  # in q_G: the batch
        self.external: list[ArcState] = []  # in q_E: their jump maps run
        self._cancelled: set[ArcState] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._workers = workers
        self._pool: cf.ThreadPoolExecutor | None = None
        self._hooks: dict[int, list] = {}  # per sequence: the hooks on its rows (residual inputs, probes)

    @torch.no_grad()
    def warm_up(self) -> None:
        """A throwaway prefill of one chunk and one token step, into a state of its own (the prefix cache
        untouched). A process's first prefill pays for its buffers' first touch, seconds on a small CPU
        and the other rows waiting; a server pays it before it says it is ready, not on its first client."""
        model = self.model
        if not hasattr(model, "empty_state"):
            return
        n = max(1, min(self.prefill_chunk or SEGMENT, model.config.n_ctx - 1))
        tokens = [i % model.config.vocab_size for i in range(n)]
        x = model.empty_state(1, capacity=n + 1)
        model.F(x, tokens)
        model.F(x, tokens[:1])

    # ------------------------------------------------------------------ the population
    def add(self, s: ArcState) -> ArcState:
        """A sequence joins; it is admitted at the next step (thread-safe)."""
        if not s.prompt:
            raise InputError("empty prompt: a sequence needs at least one token")
        with self._lock:
            self.waiting.append(s)
        self._wake.set()
        return s

    def cancel(self, s: ArcState) -> None:
        """Withdraw a sequence at the next step, whatever its mode (thread-safe): its rows are freed."""
        with self._lock:
            self._cancelled.add(s)
        self._wake.set()

    def sequences(self) -> list[ArcState]:
        """Every sequence not yet ended: waiting, being prefilled or landing, in q_G, in q_E."""
        return [*self.waiting, *(f[0] for f in self.filling), *self.active, *self.external]

    def fail_all(self, exc: BaseException) -> None:
        """Every admitted sequence ends with `exc` (a step failed in a way no one sequence explains)."""
        for s in [*(f[0] for f in self.filling), *self.active, *self.external]:
            if not s.done:
                self._fail(s, exc)
        self.filling.clear()
        self.active.clear()
        self.external.clear()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.filling or self.active or self.external)

    def run(self, sequences: list[ArcState] | None = None) -> None:
        """Step until every sequence (or the given ones) has ended."""
        while self.busy and (sequences is None or not all(s.done for s in sequences)):
            self.step()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def solve(self, sequences: list[ArcState]) -> None:
        """The sequences join, and the engine steps until every arc has ended; then it closes, with
        every observer of theirs that can be closed (a trace writer), whatever happened. The first
        sequence that ended in an error raises it."""
        for s in sequences:
            self.add(s)
        try:
            self.run()
        finally:
            self.close()
            for s in sequences:
                for obs in s.observers:
                    close = getattr(obs, "close", None)
                    if close is not None:
                        close()
        for s in sequences:
            if s.error is not None:
                raise s.error

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """One engine step; False when nothing was left to do."""
        self._withdraw()
        self._admit()
        self._fill()
        self._land()
        flowing = self._classify()
        if flowing:
            self._flow(flowing)
        elif self.external and not self.filling:
            cf.wait([s.pending for s in self.external], timeout=0.05, return_when=cf.FIRST_COMPLETED)
        return self.busy

    def wait_for_work(self, timeout: float) -> None:
        """Block until a sequence joins or is cancelled, or `timeout` passes (for a serving loop)."""
        if not self.busy:
            self._wake.wait(timeout)
        self._wake.clear()

    # ------------------------------------------------------------------ joining and leaving
    def _admit(self) -> None:
        while self.waiting and len(self.active) + self._admitted_filling() < self.max_batch:
            with self._lock:
                s = self.waiting.popleft()
            self.stats.joined += 1
            self._start(s)

    def _start(self, s: ArcState) -> None:
        model = self.model
        s.started = time.perf_counter()
        s.generator = torch.Generator(device=_device(model)).manual_seed(s.seed)
        s.recent = deque(maxlen=s.kernel.repeat_window)
        s.entered(s.prompt)
        s.emit("start", **s.system.describe(s), model=getattr(model, "source", "?"),
               precision=getattr(model, "precision", "float32"),
               layers=getattr(getattr(model, "config", None), "n_layer", None), kernel=asdict(s.kernel),
               limits=asdict(s.limits), seed=s.seed, context=self.context.describe(),
               constraint=s.constraint.describe() if s.constraint is not None else None,
               control=s.controls.describe() if s.controls is not None else [], time_unix_ns=time.time_ns())
        s.enter_phase("prefill", tokens=len(s.prompt))
        t0 = time.perf_counter()
        try:
            if s.x is None and s.continues is not None:  # copied here, in the engine's thread
                s.x = s.continues.clone()
            if s.x is None:  # (a caller may hand over a state that holds the prompt already)
                steps = prefill_steps(self.model, s.prompt, marks=s.marks, cache=self.prefix_cache,
                                      soft_prefix=None if s.controls is None else s.controls.prefix, policy=self.context,
                                      segment=self.prefill_chunk or model.config.n_ctx)
                with self._inputs([s]):
                    ended, value = _advance(steps)  # (the cache's lookup)
                if not ended:
                    s.cached_tokens = value
                    self.filling.append((s, steps, self._prefilled))
                    return
                s.x = value  # a prefill in one piece (a soft prefix, a bare state-space form)
            # a continued state: it holds all but `resume` (e.g. the observations of a client's tools)
            s.cached_tokens = len(s.prompt) - len(s.resume)
        except Exception as exc:  # noqa: BLE001 - the sequence ends with its error; the others go on
            self._fail(s, exc)
            return
        finally:
            self.stats.wall_prefill_s += time.perf_counter() - t0
        if s.resume:
            self._fill_later(s, s.resume, self._resumed)
        else:
            self._joined(s)

    def _admitted_filling(self) -> int:
        """Sequences admitted whose prompt is being prefilled (a landing was admitted before)."""
        return sum(1 for _, _, then in self.filling if then in (self._prefilled, self._resumed))

    def _fill_later(self, s: ArcState, tokens: list[int], then) -> None:
        """`tokens` into s's state chunk by chunk, interleaved with the token steps; then `then(s, rebuilt)`."""
        steps = inject_steps(self.model, s.x, tokens, policy=self.context, chunk=self.prefill_chunk)
        self.filling.append((s, steps, then))

    def _prefilled(self, s: ArcState, x) -> None:
        s.x = x
        self._joined(s)

    def _resumed(self, s: ArcState, rebuilt: bool) -> None:
        s.rebuilds += bool(rebuilt)
        self._joined(s)

    def _fill(self) -> None:
        """One chunk of the first prefill under way (the running rows wait for no more than that)."""
        if not self.filling:
            return
        s, steps, then = self.filling[0]
        t0 = time.perf_counter()
        try:
            with self._inputs([s]):
                ended, value = _advance(steps)
            if ended:
                self.filling.popleft()
                then(s, value)
        except Exception as exc:  # noqa: BLE001 - the sequence ends with its error; the others go on
            if self.filling and self.filling[0][0] is s:
                self.filling.popleft()
            self._fail(s, exc)
        finally:
            self.stats.wall_prefill_s += time.perf_counter() - t0

    def _joined(self, s: ArcState) -> None:
        """The prompt is in the state: the sequence joins the batch."""
        try:
            if s.controls is not None:
                s.controls.start(s.prompt, s.x, s.limits.max_token_steps)
        except Exception as exc:  # noqa: BLE001 - the sequence ends with its error; the others go on
            self._fail(s, exc)
            return
        s.enter_phase(s.system.phase_of(s))
        self.active.append(s)
        s.emit("batch", action="join", reason="prefilled", batch=len(self.active))

    def _withdraw(self) -> None:
        if not self._cancelled:
            return
        with self._lock:
            gone, self._cancelled = self._cancelled, set()
            for s in gone:
                if s in self.waiting:
                    self.waiting.remove(s)
            self.filling = deque(f for f in self.filling if f[0] not in gone)
        for s in gone:
            if s.done:
                continue
            if s in self.external:
                self.external.remove(s)
                s.pending.cancel()
                s.system.cancel_jump(s)
            if s in self.active:
                self.active.remove(s)
            self._end(s, Termination.CANCELLED)

    def _end(self, s: ArcState, cause: Termination, **data) -> None:
        try:
            data = {**s.system.summary(s), **data}
        except Exception as exc:  # noqa: BLE001 - the arc still ends
            data = {"error": f"{type(exc).__name__}: {exc}", **data}
        s.terminate(cause, **data)
        s.system.ended(s)
        self._hooks.pop(id(s), None)
        self.stats.ended += 1
        self.stats.by_cause[cause.value] = self.stats.by_cause.get(cause.value, 0) + 1

    def _fail(self, s: ArcState, exc: BaseException) -> None:
        s.error = exc
        if s in self.active:
            self.active.remove(s)
        self._end(s, Termination.ERROR, error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ C, D and the priority rule
    def _classify(self) -> list[ArcState]:
        flowing = []
        for s in list(self.active):
            system = s.system
            try:
                in_D = system.jump_set(s)
                in_C = system.flow_set(s) and s.t < s.limits.max_token_steps
            except Exception as exc:  # noqa: BLE001 - a fault of one sequence ends its arc, not the step
                self._fail(s, exc)
                continue
            if in_D and system.jumps_elsewhere(s):  # g runs elsewhere (a client's tool): the arc ends in D
                self.active.remove(s)
                self._end(s, Termination.JUMP_SET)
            elif in_D and s.jumps_allowed and (not in_C or self.priority is Priority.JUMPS):
                self._jump(s)
            elif in_C:
                flowing.append(s)
            else:
                self.active.remove(s)
                if in_D:
                    cause = Termination.JUMP_HORIZON
                elif isinstance(s.finished, Termination):
                    cause = s.finished
                else:
                    cause = Termination.TOKEN_BUDGET
                self._end(s, cause)
        return flowing

    # ------------------------------------------------------------------ g: the jump map
    def _jump(self, s: ArcState) -> None:
        self.active.remove(s)
        try:
            work = s.system.jump(s)
        except Exception as exc:  # noqa: BLE001 - a fault of one sequence ends its arc, not the step
            self._fail(s, exc)
            return
        s.q = Mode.EXTERNAL
        s.enter_phase("external")
        s.emit("batch", action="leave", reason="q_E", batch=len(self.active))
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self._workers, thread_name_prefix="hybridlm-q_E")
        s.pending = self._pool.submit(work)
        self.external.append(s)

    def _land(self) -> None:
        """The jumps whose external work finished: their observation enc(y) is prefilled into the state
        (chunk by chunk, interleaved with the token steps) and the sequence is back in q_G."""
        for s in [s for s in self.external if s.pending.done()]:
            self.external.remove(s)
            t0 = time.perf_counter()
            try:
                k = s.k
                tokens = s.system.landed(s, s.pending.result())
                self.stats.jumps += s.k - k
                s.pending = None
                s.q = Mode.GENERATE
                s.enter_phase("prefill", tokens=len(tokens))
                self._fill_later(s, tokens, functools.partial(self._landed, tokens=tokens))
            except Exception as exc:  # noqa: BLE001 - a fault of one sequence ends its arc, not the step
                self._fail(s, exc)
            finally:
                self.stats.wall_prefill_s += time.perf_counter() - t0

    def _landed(self, s: ArcState, rebuilt: bool, *, tokens: list[int]) -> None:
        """The observation `tokens` is in the state: the sequence rejoins the batch."""
        if rebuilt:
            s.rebuilds += 1
            s.emit("context", policy=self.context.describe(), n=s.x.n if hasattr(s.x, "n") else None)
        s.entered(tokens)
        if s.controls is not None:
            s.controls.observe(tokens)
        s.turn = []
        s.enter_phase(s.system.phase_of(s))
        self.active.append(s)
        s.emit("batch", action="join", reason="observation", batch=len(self.active))

    # ------------------------------------------------------------------ f: one token step for the batch
    def _flow(self, batch: list[ArcState]) -> None:
        t0 = time.perf_counter()
        model = self.model
        for s in batch:
            if truncate_for_step(model, s.x, self.context):
                s.rebuilds += 1
                s.emit("context", policy=self.context.describe(), n=s.x.n)
        draws, records = [], []
        for s in list(batch):
            try:
                w, kernel_logprob, recs, z = self._draw(s)
            except Exception as exc:  # noqa: BLE001 - a fault of one sequence ends its arc, not the step
                batch.remove(s)
                self._fail(s, exc)
                continue
            draws.append((w, kernel_logprob, z))
            records.append(recs)
        if not batch:
            return
        rebuilds = [getattr(s.x, "rebuilds", 0) for s in batch]
        tokens = [w for w, _, _ in draws]
        self._keep_forks(batch)
        with self._inputs(batch):
            step = getattr(model, "step", None)
            if step is not None:
                step([s.x for s in batch], tokens)
            else:  # a bare state-space form: one F per sequence
                for s, w in zip(batch, tokens):
                    model.F(s.x, [w])
        self.stats.steps += 1
        self.stats.rows += len(batch)
        self.stats.tokens += len(batch)
        for s, (w, kernel_logprob, z), recs, before in zip(batch, draws, records, rebuilds):
            s.t += 1
            for rec in recs:
                s.emit("control", **rec)
            s.generated.append(w)
            s.counts[w] = s.counts.get(w, 0) + 1
            s.entered((w,))
            s.turn.append(w)
            if s.constraint is not None:
                s.constraint.advance(w)
            if s.controls is not None:
                s.controls.advance(w)
            rebuilt = getattr(s.x, "rebuilds", 0) > before
            s.rebuilds += rebuilt
            s.emit("token", token=w, text=_text(model, w), **_logprobs(z, w, kernel_logprob, s.logprobs),
                   n=getattr(s.x, "n", None), rebuilt=rebuilt, stop=w in s.stop_ids, phase=s.phase)
            try:
                s.system.flowed(s, w)
                phase = s.system.phase_of(s)
            except Exception as exc:  # noqa: BLE001 - a fault of one sequence ends its arc, not the step
                self._fail(s, exc)
                continue
            if phase != s.phase:
                s.enter_phase(phase)
        self.stats.wall_flow_s += time.perf_counter() - t0

    def _draw(self, s: ArcState) -> tuple[int, float, list[dict], torch.Tensor]:
        """w_{t+1} ~ p_θ,u(· | s_t) for one row: its readout, its kernel's bias and penalties, its masks and
        controllers, its kernel (the order of `hybridlm.engine.sampling`). Returns w, log p_θ,u(w | s_t) under
        the kernel that drew it, what the controllers did, and the readout z_t before any input."""
        readout = z = self.model.G(s.x)
        z = s.kernel.penalised(z, s.counts, s.recent)
        masks = [m for m in (s.constraint.mask() if s.constraint is not None else None, s.system.flow_mask(s))
                 if m is not None]
        for m in masks:
            z = z.masked_fill(~m.to(z.device).view(1, -1)[:, : z.shape[-1]], NEG_INF)
        recs: list[dict] = []
        if s.controls is not None and s.system.controlled(s):
            z, recs = s.controls.act(s.t + 1, z, s.x)
            masks.append(None)
        if masks and not bool(torch.isfinite(z).any()):
            raise InputError(f"token step {s.t + 1}: no token is allowed (every logit is masked)")
        w, logprob = s.kernel.sample_with_logprob(z, s.generator)
        return int(w[0]), float(logprob[0]), recs, readout

    def _keep_forks(self, batch: list[ArcState]) -> None:
        """A state may carry the fork of its successors a barrier computed (the step then adopts the
        chosen one); not where a hook would watch that step: the caller's own hooks, or the
        sequence's (its residual inputs, its recorders), which a step without a forward would miss."""
        if not any(getattr(s.x, "successors", None) is not None for s in batch):
            return
        points = getattr(self.model, "hook_points", None)
        global_hooks = points is not None and any(p.active for p in points.values())
        for s in batch:
            if getattr(s.x, "successors", None) is not None and (global_hooks or self._hook_pairs(s)):
                s.x.successors = None

    def _hook_pairs(self, s: ArcState) -> list:
        if id(s) not in self._hooks:
            self._hooks[id(s)] = s.hook_pairs(self.model)
        return self._hooks[id(s)]

    # ------------------------------------------------------------------ inputs on the state
    @contextlib.contextmanager
    def _inputs(self, seqs: list[ArcState]):
        """While the model runs rows of `seqs`: the hook context names each row's sequence, and
        every sequence's residual inputs (its controllers' hooks) act on its own rows only."""
        model = self.model
        ctx = getattr(model, "hook_ctx", None)
        groups: dict[tuple, set] = {}
        for s in seqs:
            for point, fn in self._hook_pairs(s):
                groups.setdefault((point, fn), set()).add(s)
        if ctx is not None:
            ctx.rows = list(seqs)
        try:
            if groups:
                with model.hooks([(point, _on_rows(fn, members)) for (point, fn), members in groups.items()]):
                    yield
            else:
                yield
        finally:
            if ctx is not None:
                ctx.rows = None


def _logprobs(z: torch.Tensor, w: int, kernel_logprob: float, k: int | None) -> dict:
    """The token event's probabilities: `logprob` = log p_θ(w | s_t) of the model itself (τ = 1, the readout
    before any input: what the model thought of w, whatever drew it), `kernel_logprob` = log p of w under the
    kernel that drew it (bias, penalties, masks, τ and truncations; 0 for greedy decoding), and, when asked,
    the model's k most likely tokens with their log p_θ."""
    z = z[0].float()
    if k:
        lp = torch.log_softmax(z, dim=-1)
        values, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = {"top_logprobs": [[int(i), round(float(v), 6)] for i, v in zip(ids, values)]}
        model_logprob = float(lp[w])
    else:
        top = {}
        model_logprob = float(z[w] - torch.logsumexp(z, dim=-1))
    # (the drawn token has p > 0 under its kernel; a hook may have set the model's own readout of it to −∞,
    # which JSON cannot hold: then the model's value is left out)
    model = {"logprob": round(model_logprob, 6)} if math.isfinite(model_logprob) else {}
    return {**model, "kernel_logprob": round(kernel_logprob, 6), **top}


def _on_rows(fn, members: set):
    """A hook that acts only on the batch rows of `members` (by `hook.ctx.rows`)."""

    def on_rows(h: torch.Tensor, hook):
        ctx = hook.ctx
        rows = ctx.rows
        if rows is None:
            return fn(h, hook)
        idx = [i for i, r in enumerate(rows) if r in members]
        if not idx:
            return None
        if len(idx) == len(rows):
            return fn(h, hook)
        sel = torch.tensor(idx, device=h.device)
        pos = ctx.pos
        ctx.rows = [rows[i] for i in idx]
        if pos is not None and pos.dim() == 2:
            ctx.pos = pos.index_select(0, sel.to(pos.device))
        try:
            out = fn(h.index_select(0, sel), hook)
        finally:
            ctx.rows, ctx.pos = rows, pos
        if out is None:
            return None
        h = h.clone()
        h[sel] = out.to(h.dtype)
        return h

    return observing(on_rows) if getattr(fn, "observes", False) else on_rows


def _advance(steps: Generator) -> tuple[bool, Any]:
    """One step of a generator: (False, what it yielded) or (True, what it returned)."""
    try:
        return False, next(steps)
    except StopIteration as done:
        return True, done.value


def _device(model):
    W = getattr(model, "W_e", None)
    return W.device if W is not None else "cpu"


def _text(model, token: int) -> str | None:
    tok = getattr(model, "tokenizer", None)
    return None if tok is None else tok.token_str(token)
