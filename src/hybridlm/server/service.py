"""The serving side of the engine: one thread steps it, requests join and leave its population.

`Service` owns an `Engine` (hybridlm.engine) and runs `engine.step()` in a thread of its own;
the HTTP handlers (hybridlm.server.app) turn each request into sequences (`ArcState`s) and
`submit` them from any thread. A sequence joins the running batch at the next token step,
leaves it for q_E while a server-side tool runs, and leaves for good at the end of its arc or
when its client goes away (`cancel`): continuous batching, with the token clock of every
sequence its own.

Two stores make a conversation cheap to continue:

- the engine's `PrefixCache` (states after canonical segments: the system prompt, the tool
  list, every earlier message), so no shared prefix is prefilled twice;
- `Continuations`: the state an arc ended in when it stopped in the jump set of a client-side
  tool, keyed by the conversation the client will send back. The request that brings the
  tool results continues from that state, with the observations injected through a prefill
  as every jump map injects them (hybridlm.turns.protocol), instead of prefilling the
  conversation again.

Every arc is kept (the last `max_arcs`) for `GET /v1/arcs/{id}`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

from hybridlm.engine.arc import Mode, Termination
from hybridlm.engine.engine import Engine
from hybridlm.engine.prefill import SEGMENT, ContextPolicy, PrefixCache, compact_copy
from hybridlm.engine.sequence import ArcState
from hybridlm.memory import return_freed_memory
from hybridlm.server.wire import APIError

log = logging.getLogger("hybridlm.server")

MB = 2**20
TRIM_EVERY_S = 1.0  # the most often a busy engine hands freed memory back (hybridlm.memory.return_freed_memory)


@dataclass
class Continuation:
    """The state an arc ended in at a client-side jump, and what the jump map needs to land it."""

    state: object  # the KVState after the call's last token
    messages: list[dict]  # the chat template's messages up to and including the assistant's calls
    call_ids: list[str]  # the ids the client got, in the order of the calls
    turn_closed: bool  # the model emitted its end-of-turn token after the calls
    arc: str  # the arc that ended there
    t: int  # token steps of that arc
    kept: int | None = None  # the calling turn's tokens the state keeps where ρ rewrote it (None: as written)

    @property
    def nbytes(self) -> int:
        return int(self.state.nbytes()) if hasattr(self.state, "nbytes") else 0


class Continuations:
    """Continuation states by conversation, bounded in bytes, least recently used dropped first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, Continuation] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = 0

    def put(self, key: str, entry: Continuation) -> None:
        size = entry.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[key] = entry
            self.bytes += size
            while self.bytes > self.max_bytes and self._entries:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= gone.nbytes

    def get(self, key: str) -> Continuation | None:
        """The entry, or None. Its state is shared: a sequence continues from a copy
        (`ArcState.continues`, copied by the engine at admission), so a retried request finds
        it again."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def __len__(self) -> int:
        return len(self._entries)


class Arcs:
    """The arcs of the last `max_arcs` sequences, by name (their events, live while they run)."""

    def __init__(self, max_arcs: int) -> None:
        self.max_arcs = max_arcs
        self._arcs: collections.OrderedDict[str, ArcState] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, s: ArcState) -> None:
        with self._lock:
            self._arcs[s.name] = s
            while len(self._arcs) > self.max_arcs:
                self._arcs.popitem(last=False)

    def get(self, name: str) -> ArcState | None:
        with self._lock:
            return self._arcs.get(name)


class Counters:
    """What /metrics reports beyond the engine's own statistics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (endpoint, status) -> count
        self.mode_s = {Mode.GENERATE.value: 0.0, Mode.EXTERNAL.value: 0.0}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rate: collections.deque = collections.deque(maxlen=256)  # (time, tokens emitted so far)

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1


class Service:
    """The engine of a server: started once, stepped by its own thread until closed."""

    def __init__(self, model, *, model_id: str | tuple[str, ...], tools=None, max_batch: int = 32, max_queue: int = 256,
                 prefix_cache_mb: float = 256, continuation_mb: float = 256, max_arcs: int = 1000,
                 context: ContextPolicy | str = ContextPolicy(), max_jumps: int = 3, max_calls: int = 3,
                 repeat_calls: bool = False, prefill_chunk: int = SEGMENT) -> None:
        self.model = model
        # the names a request's `model` may give (--served-model-name): the first is the model's id
        self.names = (model_id,) if isinstance(model_id, str) else tuple(model_id)
        self.model_id = self.names[0]
        self.tokenizer = model.tokenizer
        self.tools = tools  # a ToolRegistry the server runs itself, or None
        self.max_batch, self.max_queue, self.max_jumps = max_batch, max_queue, max_jumps
        # the call horizon of one turn, and whether a turn may repeat a call it made (hybridlm.turns)
        self.max_calls, self.repeat_calls = max_calls, repeat_calls
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * MB))
        self.engine = Engine(model, max_batch=max_batch, context=context, prefix_cache=self.prefix_cache,
                             prefill_chunk=prefill_chunk)
        self.continuations = Continuations(int(continuation_mb * MB))
        self.arcs = Arcs(max_arcs)
        self.counters = Counters()
        self.created = int(time.time())
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._looping = False

    # ------------------------------------------------------------------ the engine's thread
    def start(self) -> "Service":
        """Step the engine in a thread of its own (tests, benchmarks; `hybridlm serve` steps it in
        the main thread instead, see `loop`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.loop, name="hybridlm-engine", daemon=True)
            self._thread.start()
            while not self._looping and self._thread.is_alive():
                time.sleep(0.001)
        return self

    def close(self) -> None:
        self._stop.set()
        self.engine._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.engine.close()

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not yet ended (running, queued or in q_E)."""
        return self._in_flight

    @property
    def alive(self) -> bool:
        return self._looping

    def loop(self) -> None:
        """Step the engine in this thread until `close` (or `stop`). Why the main thread is best:
        the OpenMP runtime that runs the kernels keeps a team of threads per thread that starts
        parallel work, and with more teams' threads than cores it stops spinning between regions,
        which halves the speed of a step on two cores (measured: int4 decode 72 tok/s in the main
        thread, 40 in another)."""
        engine = self.engine
        self._looping = True
        ended, trimmed, was_busy = engine.stats.ended, 0.0, False
        try:
            while not self._stop.is_set():
                engine.wait_for_work(0.05)
                try:
                    if engine.busy:
                        engine.step()
                except Exception as exc:
                    log.exception("engine step failed")
                    self.engine.fail_all(exc)
                self.counters.rate.append((time.perf_counter(), engine.stats.tokens))
                now = time.monotonic()
                if (was_busy and not engine.busy) or (engine.stats.ended != ended and now - trimmed >= TRIM_EVERY_S):
                    # idle, or a sequence ended: the heap's free pages (its prompt's activations, its state) go
                    # back to the kernel, so a finished request leaves the resident size where it found it
                    # (the kept prefixes aside) even while other rows run. The next prefill pays their first
                    # touch again; malloc_trim itself walks the heap (10-70 ms on a fragmented one), hence
                    # at most once a TRIM_EVERY_S while rows run
                    ended, trimmed = engine.stats.ended, now
                    return_freed_memory()
                was_busy = engine.busy
        finally:
            self._looping = False
            for s in engine.sequences():
                engine.cancel(s)
            if engine.busy:
                engine.step()

    def stop(self) -> None:
        """Ask `loop` to return after the step in progress."""
        self._stop.set()
        self.engine._wake.set()

    # ------------------------------------------------------------------ the population
    def submit(self, sequences: list[ArcState]) -> None:
        """Sequences join (all or none): 503 when the batch and the queue are full now, 400 when they
        could never hold the request."""
        capacity = self.max_batch + self.max_queue
        if len(sequences) > capacity:  # never admissible: not worth a retry
            raise APIError(400, f"the request makes {len(sequences)} sequences (prompts × n); this server holds at "
                                f"most {capacity} (max_batch {self.max_batch} + max_queue {self.max_queue})",
                           param="n", code="too_many_sequences")
        with self._lock:
            if self._in_flight + len(sequences) > capacity:
                raise APIError(503, f"the server is at capacity ({self._in_flight} sequences running or queued, "
                                    f"max_batch {self.max_batch} + max_queue {self.max_queue}); retry later",
                               type="server_error", code="overloaded", headers={"Retry-After": "1"})
            self._in_flight += len(sequences)
        if not self.alive:
            with self._lock:
                self._in_flight -= len(sequences)
            raise APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        for s in sequences:
            s.observers.insert(0, _Bookkeeping(self))
            self.arcs.add(s)
            self.engine.add(s)

    def cancel(self, sequences: list[ArcState]) -> None:
        for s in sequences:
            if not s.done:
                self.engine.cancel(s)

    def _ended(self, s: ArcState) -> None:
        with self._lock:
            self._in_flight -= 1
        c = self.counters
        with c.lock:
            c.mode_s[Mode.GENERATE.value] += s.arc.wall_in(Mode.GENERATE)
            c.mode_s[Mode.EXTERNAL.value] += s.arc.wall_in(Mode.EXTERNAL)
            c.completion_tokens += s.t
        elsewhere = getattr(s.system, "elsewhere", None)  # the jump map of a client's tools (hybridlm.turns)
        if elsewhere is not None and s.arc.termination is Termination.JUMP_SET and s.x is not None:
            try:
                key, entry = elsewhere.continuation(s, compact_copy(s.x))
                self.continuations.put(key, entry)
            except Exception:
                log.exception("could not keep the continuation of %s", s.name)
        # the arc stays (its events, for /v1/arcs) but not its rows of the state: kept arcs held
        # their KV states, ~12 MB each, and the server's memory grew with every request
        s.x = s.continues = None

    # ------------------------------------------------------------------ what /metrics reads
    def snapshot(self) -> dict:
        e = self.engine
        stats = e.stats
        rate = 0.0
        samples = list(self.counters.rate)
        now = time.perf_counter()
        window = [(t, n) for t, n in samples if now - t <= 10.0]
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            rate = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
        with self.counters.lock:
            requests = dict(self.counters.requests)
            mode_s = dict(self.counters.mode_s)
            completion = self.counters.completion_tokens
            prompt = self.counters.prompt_tokens
        return {
            "tokens_total": stats.tokens, "tokens_per_second": rate, "steps_total": stats.steps,
            "rows_total": stats.rows, "batch": len(e.active), "external": len(e.external), "queue": len(e.waiting),
            "in_flight": self._in_flight, "max_batch": self.max_batch, "jumps_total": stats.jumps,
            "mode_seconds": mode_s, "prefill_seconds": stats.wall_prefill_s, "flow_seconds": stats.wall_flow_s,
            "ended_by_cause": dict(stats.by_cause), "requests": requests, "prompt_tokens": prompt,
            "completion_tokens": completion, "prefix_cache": self.prefix_cache.stats(),
            "continuations": {"entries": len(self.continuations), "bytes": self.continuations.bytes,
                              "hits": self.continuations.hits, "misses": self.continuations.misses},
        }


class _Bookkeeping:
    """The service's observer of each of its sequences (first among the observers, so that a
    continuation is stored before the client hears that its arc ended)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def on_event(self, s, event) -> None:
        pass

    def on_end(self, s) -> None:
        self.service._ended(s)
