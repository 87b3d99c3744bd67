"""The Berkeley Function Calling Leaderboard (BFCL): its data and AST checker, and runners.

BFCL's tasks and checker come from the `bfcl-eval` package, installed without its
dependencies (`pip install --no-deps bfcl-eval`: it pins an old numpy and pulls a dozen
model SDKs). Only two things are read from it: the data files (JSON lines) and the AST
checker module, whose one heavy import (the table of every supported model, which imports
every SDK) is replaced by a stub, since the checker only asks it whether a model writes
`_` for `.` in function names (ours do not).

A task offers functions described in BFCL's own dialect of JSON Schema ("dict", "float",
"tuple", "any"); `json_schema` maps it to JSON Schema the way BFCL's handlers do for
OpenAI-style models. The checker always sees the original description (it reads the
dialect's type names).

Runners answer a task with a list of calls `[{name: arguments}]`:
`HybridRunner` (the agent, constrained or free, one forced call per task) and
`LlamaCppRunner` (llama.cpp on the same GGUF file, the reference: its OpenAI-style function
calling, or the model's own template with Hermes parsing, strict or lenient). `evaluate`
writes one JSON line per task as it goes, so a killed run resumes.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import re
import sys
import time
import types
from typing import TYPE_CHECKING, Any, cast
from dataclasses import dataclass
from pathlib import Path

from hybridlm.errors import InputError

if TYPE_CHECKING:
    from hybridlm.turns.codecs import ToolCall

# BFCL's single-turn Python categories, which its AST checker scores ("parallel" in a name: several calls
# in the turn, in any order; "multiple": one call, several functions offered)
CATEGORIES = ("simple_python", "multiple", "parallel", "live_simple", "parallel_multiple", "live_multiple",
              "live_parallel", "live_parallel_multiple")
INSTALL = "pip install --no-deps 'bfcl-eval>=2025'"
PARALLEL_HORIZON = 5  # jumps allowed in a parallel task (a fixed horizon: the answer's count is not told)

# BFCL's type names → JSON Schema (as BFCL's handlers convert them for OpenAI-style models;
# an unknown type becomes a string there too).
TYPES = {
    "integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
    "bool": "boolean", "array": "array", "list": "array", "tuple": "array", "dict": "object", "object": "object",
    "any": "string",
}


@dataclass(frozen=True)
class Task:
    id: str
    category: str
    messages: list[dict]  # the first turn's messages, as BFCL gives them
    functions: list[dict]  # BFCL's own function descriptions
    answer: list[dict]  # BFCL's possible answers: [{name: {param: [accepted values]}}]

    @property
    def question(self) -> str:
        """The task as one text for the agent: its user turns joined."""
        return self._joined(system=False)

    @property
    def system(self) -> str:
        """The task's own system text ("" for none): the agent's system message, as BFCL sends it."""
        return self._joined(system=True)

    def _joined(self, *, system: bool) -> str:
        return "\n".join(m["content"] for m in self.messages
                         if m.get("content") and (m.get("role") == "system") == system)


# ---------------------------------------------------------------------- data and checker
def data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"BFCL's data and checker come from the package bfcl-eval; install it with: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _data_file(folder: Path, category: str) -> Path:
    found = sorted(p for p in folder.glob("BFCL_v*.json") if re.fullmatch(rf"BFCL_v\d+_{category}\.json", p.name))
    if not found:
        raise InputError(f"BFCL category {category!r}: no data file in {folder}; expected one of {CATEGORIES}")
    return found[-1]


def tasks(category: str, *, limit: int | None = None, every: int = 1) -> list[Task]:
    """The category's tasks in BFCL's order: every `every`-th (the 1st, the every+1-th, ...), the
    first `limit` of those."""
    if category not in CATEGORIES:
        raise InputError(f"BFCL category {category!r}: expected one of {', '.join(CATEGORIES)}")
    folder = data_dir()
    questions = _jsonl(_data_file(folder, category))
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(_data_file(folder / "possible_answer", category))}
    out = [Task(q["id"], category, q["question"][0], q["function"], answers[q["id"]]) for q in questions]
    out = out[::every]
    return out[:limit] if limit else out


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def json_schema(parameters: dict) -> dict:
    """BFCL's parameter description → JSON Schema (types renamed, nested properties and items too)."""
    schema = copy.deepcopy(parameters)

    def convert(node: dict) -> dict:
        kind = node.get("type")
        if kind is not None:
            node["type"] = TYPES.get(kind, "string")
        for sub in (node.get("properties") or {}).values():
            if isinstance(sub, dict):
                convert(sub)
        if isinstance(node.get("items"), dict):
            convert(node["items"])
        node.pop("optional", None)  # BFCL's own marker; JSON Schema says it with "required"
        return node

    schema = convert(schema)
    schema["type"] = "object"
    schema.setdefault("properties", {})
    return schema


_checker = None


def ast_checker():
    """BFCL's `ast_checker` function, imported without the model table it does not need."""
    global _checker
    if _checker is not None:
        return _checker
    data_dir()  # the install hint, when missing
    name = "bfcl_eval.constants.model_config"
    stub = None
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.MODEL_CONFIG_MAPPING = _NoUnderscores()
        sys.modules[name] = stub
    try:
        module = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
    finally:
        if stub is not None:
            del sys.modules[name]
    enums = importlib.import_module("bfcl_eval.constants.enums")

    def check(task: Task, calls: list[dict]) -> dict:
        return module.ast_checker(task.functions, calls, task.answer, enums.Language.PYTHON, task.category,
                                  "hybridlm")

    _checker = check
    return check


class _NoUnderscores(dict):
    """The checker's model table: every model keeps the dots of function names."""

    def __missing__(self, key):
        return types.SimpleNamespace(underscore_to_dot=False)


def check(task: Task, calls: list[dict]) -> dict:
    """BFCL's verdict on the calls: {"valid": bool, "error_type": str, "error": [...]}."""
    try:
        result = ast_checker()(task, calls)
    except Exception as exc:  # noqa: BLE001 - the checker trips on some malformed outputs
        return {"valid": False, "error_type": "checker:exception", "error": [f"{type(exc).__name__}: {exc}"]}
    return {"valid": bool(result["valid"]), "error_type": result.get("error_type", "") if not result["valid"] else "",
            "error": result.get("error", [])}


# ---------------------------------------------------------------------- runners
class HybridRunner:
    """The agent with the task's functions as tools, forced to call (tool choice "required").

    The tools are never run: the arguments of the jumps are the answer.
    """

    def __init__(self, model, *, constrained: bool = True, max_token_steps: int = 256) -> None:
        self.model, self.constrained, self.max_token_steps = model, constrained, max_token_steps
        self.name = "hybridlm-" + ("constrained" if constrained else "free")
        self.precision = getattr(model, "precision", None)

    def __call__(self, task: Task) -> list[dict]:
        from hybridlm.agent.automaton import HybridAgent, Limits
        from hybridlm.tools import Tool, ToolRegistry

        tools = ToolRegistry()
        for f in task.functions:
            tools.register(Tool(f["name"], f.get("description", ""), json_schema(f["parameters"]), _answered,
                                runs_in="thread"))
        parallel = "parallel" in task.category  # several calls: in one turn (jumps at one token step) or over turns
        calls = PARALLEL_HORIZON if parallel else 1
        # BFCL's functions are Python's: an optional parameter takes its declared default (null for `= None`,
        # whatever type is declared beside it), and BFCL's checker takes the default written out
        agent = HybridAgent(self.model, tools, tool_choice="required", constrain=self.constrained,
                            parallel_tool_calls=parallel, system=task.system, admit_defaults=True,
                            limits=Limits(max_token_steps=self.max_token_steps * min(calls, 2), max_jumps=calls,
                                          max_jumps_per_step=calls))
        arc = agent.run(task.question)
        return distinct([{j.tool: j.arguments} for j in arc.jumps if isinstance(j.arguments, dict)])


def distinct(calls: list[dict]) -> list[dict]:
    """The calls without repeats, in the order first made. A model that makes a turn's parallel calls over
    several turns instead, after the first one's result (Qwen2.5-Coder-0.5B does), lists calls it has already
    made again, often the whole set over and over until the jump horizon; a repeated call adds nothing to the
    answer."""
    out: list[dict] = []
    for call in calls:
        if call not in out:
            out.append(call)
    return out


def _answered(**_) -> str:
    return "done"


REFERENCE_SYSTEM = "You are a helpful assistant with access to functions. Use them when they help answer the user."
PARSINGS = ("hermes", "lenient")


class LlamaCppRunner:
    """llama.cpp on the same GGUF file, the reference, greedy, with the tools visible to the model.

    `parsing` None: llama-cpp-python's OpenAI-style function calling (`chatml-function-calling`),
    whose template lists the tools only inside a system message, so one is given when the task has
    none (`REFERENCE_SYSTEM`). One offered function: tool choice names it (a JSON-schema grammar
    for its arguments); several: "auto" (the handler's grammar picks a function or a message).

    `parsing` "hermes" or "lenient": the model's own chat template (rendered as `transformers`
    renders it, the tools in its `tools` variable), free generation as llama.cpp's server runs
    it, the calls read from the text as vLLM's `hermes` parser and llama.cpp's server read them
    (`<tool_call>` tags only), or leniently (also a ```json block or bare JSON objects).
    Both parsings read the same generations (shared per file and task).
    """

    _generations: dict[tuple[str, str], str] = {}

    def __init__(self, path: str | Path | None = None, *, parsing: str | None = None, max_tokens: int = 256,
                 n_threads: int | None = None, llm=None) -> None:
        if parsing is not None and parsing not in PARSINGS:
            raise InputError(f"llama.cpp parsing {parsing!r}: expected one of {', '.join(PARSINGS)}")
        if path is None:
            from hybridlm.weights.registry import smollm2_path

            path = smollm2_path()
        self.path, self.parsing, self.max_tokens = Path(path), parsing, max_tokens
        self.name = "llama.cpp" if parsing is None else f"llama.cpp-{parsing}"
        self.llm = llm if llm is not None else self.open(self.path, parsing, max_tokens, n_threads)
        self.template = None
        if parsing is not None:
            from hybridlm.weights.gguf import read_gguf

            self.template = read_gguf(self.path)[2]
            if self.template is None or not self.template.chat_template:
                raise InputError(f"{self.path.name}: no chat template for the llama.cpp reference's {parsing} parsing")

    @staticmethod
    def open(path: Path, parsing: str | None, max_tokens: int, n_threads: int | None):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise InputError("the llama.cpp reference needs llama-cpp-python: pip install 'hybridlm[references]'") \
                from None
        llm = cast(Any, Llama(model_path=str(path), n_ctx=4096, seed=0, n_threads=n_threads, verbose=False,
                              chat_format="chatml-function-calling" if parsing is None else None))
        # The handler's message branch asks for no token bound (max_tokens=None): give it ours.
        complete = llm.create_completion

        def bounded(*args, **kwargs):
            if kwargs.get("max_tokens") is None:
                kwargs["max_tokens"] = max_tokens
            return complete(*args, **kwargs)

        llm.create_completion = bounded
        return llm

    def __call__(self, task: Task) -> list[dict]:
        tools: list[dict[str, Any]] = [
            {"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                              "parameters": json_schema(f["parameters"])}}
            for f in task.functions]
        if self.parsing is not None:
            return self.parsed(self.generation(task, tools), [t["function"]["name"] for t in tools])
        messages = task.messages
        if not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": REFERENCE_SYSTEM}, *messages]
        choice = ({"type": "function", "function": {"name": tools[0]["function"]["name"]}} if len(tools) == 1
                  and "parallel" not in task.category else "auto")
        reply = self.llm.create_chat_completion(messages=messages, tools=tools, tool_choice=choice,
                                                temperature=0.0, max_tokens=self.max_tokens)
        calls = []
        for call in reply["choices"][0]["message"].get("tool_calls") or []:
            fn = call["function"]
            try:
                arguments = json.loads(fn["arguments"])
            except ValueError:
                continue
            calls.append({fn["name"]: arguments})
        return calls

    def generation(self, task: Task, tools: list[dict]) -> str:
        """The model's free answer to the task, its own template given the tools (once per file and task)."""
        key = (str(self.path), task.id)
        if key not in self._generations:
            assert self.template is not None
            prompt = self.template.render_chat(task.messages, tools=tools, add_generation_prompt=True)
            ids = self.llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
            reply = self.llm.create_completion(ids, temperature=0.0, max_tokens=self.max_tokens)
            self._generations[key] = reply["choices"][0]["text"]
        return self._generations[key]

    def parsed(self, text: str, names: list[str]) -> list[dict]:
        from hybridlm.turns.codecs.tagged_json import parse_calls

        calls, _ = parse_calls(text, names)  # the <tool_call> tags (the good calls before a bad one kept)
        if not calls and self.parsing == "lenient":
            calls = bare_calls(text)
        return [{c.name: c.arguments} for c in calls]


def llama_cpp_runners(spec=None) -> list[LlamaCppRunner]:
    """The llama.cpp reference of a model (a name or a .gguf path; None: the embedded one): on its own
    template with Hermes parsing, strict and lenient, where the template takes tools in the Hermes
    format; else llama-cpp-python's function calling with the tools in a system message."""
    from hybridlm.turns.codecs import Hermes, detect
    from hybridlm.turns.protocol import takes_tools
    from hybridlm.weights.gguf import read_gguf
    from hybridlm.weights.loading import _gguf_file

    path = _gguf_file(spec if spec is not None else "smollm2-135m")
    if path is None:
        raise InputError(f"model {spec!r}: the llama.cpp reference needs a GGUF file (a model name or a .gguf path)")
    tok = read_gguf(path)[2]
    template = getattr(tok, "chat_template", None) or ""
    if not (isinstance(detect(template), Hermes) and takes_tools(tok)):
        return [LlamaCppRunner(path)]
    strict = LlamaCppRunner(path, parsing="hermes")
    return [strict, LlamaCppRunner(path, parsing="lenient", llm=strict.llm)]


def bare_calls(text: str) -> list[ToolCall]:
    """Every JSON object (or list of them) in the text that reads as a call {"name", "arguments" or
    "parameters"}: what a lenient parser takes from a ```json block or bare JSON."""
    from hybridlm.turns.codecs import ToolCall

    decoder, i = json.JSONDecoder(), 0
    out: list[ToolCall] = []
    while True:
        starts = [j for j in (text.find("{", i), text.find("[", i)) if j >= 0]
        if not starts:
            return out
        i = min(starts)
        try:
            value, end = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            i += 1
            continue
        for obj in value if isinstance(value, list) else [value]:
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                arguments = obj.get("arguments", obj.get("parameters"))
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except ValueError:
                        continue
                if isinstance(arguments, dict):
                    out.append(ToolCall(obj["name"], arguments))
        i = end


# ---------------------------------------------------------------------- the evaluation
def evaluate(runner, categories, *, limit: int | None = None, every: int = 1, out: str | Path,
             resume: bool = False, progress=None) -> list[dict]:
    """Run `runner` on the categories, appending one JSON line per task to `out`.

    With `resume`, tasks already in `out` for this runner are skipped (their lines are kept).
    Returns every row of this runner in `out` for the categories (old and new).
    """
    out = Path(out)
    done = {}
    if out.exists():
        if not resume:
            raise InputError(f"{out} exists: pass --resume to continue it, or choose another --out")
        for row in _rows(out):
            if row.get("system") == runner.name:
                done[row["id"]] = row
    todo = [t for c in categories for t in tasks(c, limit=limit, every=every) if t.id not in done]
    if progress is not None:
        progress = progress(len(todo))
    with out.open("a", encoding="utf-8") as fh:
        if out.stat().st_size and not out.read_bytes().endswith(b"\n"):
            fh.write("\n")  # the last line was cut by a killed run: start on a line of our own
        for task in todo:
            start = time.perf_counter()
            try:
                calls = runner(task)
                verdict = check(task, calls)
            except Exception as exc:  # noqa: BLE001 - one task's failure is a row, not the end of the run
                calls, verdict = [], {"valid": False, "error_type": f"runner:{type(exc).__name__}",
                                      "error": [str(exc)[:300]]}
            row = {"system": runner.name, "category": task.category, "id": task.id, "valid": verdict["valid"],
                   "error_type": verdict["error_type"], "error": [str(e)[:300] for e in verdict["error"]],
                   "calls": calls, "seconds": round(time.perf_counter() - start, 3)}
            if getattr(runner, "precision", None):
                row["precision"] = runner.precision
            fh.write(json.dumps(row, default=str) + "\n")
            fh.flush()
            done[task.id] = row
            if progress is not None:
                progress.update(1)
    if progress is not None:
        progress.close()
    wanted = {t.id for c in categories for t in tasks(c, limit=limit, every=every)}
    return [r for i, r in done.items() if i in wanted]


def _rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a killed run
    return rows


def summary(path: str | Path) -> list[dict]:
    """Accuracy, seconds per task and error types per (system, category) of a results file."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in _rows(Path(path)):
        groups.setdefault((row["system"], row["category"]), []).append(row)
    table = []
    for (system, category), rows in sorted(groups.items()):
        errors: dict[str, int] = {}
        for r in rows:
            if not r["valid"]:
                errors[r["error_type"]] = errors.get(r["error_type"], 0) + 1
        table.append({"system": system, "category": category, "n": len(rows),
                      "accuracy": sum(r["valid"] for r in rows) / len(rows),
                      "seconds_per_task": sum(r["seconds"] for r in rows) / len(rows),
                      "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1]))})
    return table


def format_summary(table: list[dict]) -> str:
    lines = [f"{'system':<22} {'category':<14} {'n':>4} {'accuracy':>9} {'s/task':>7}  errors"]
    for r in table:
        errs = ", ".join(f"{k} {v}" for k, v in r["errors"].items())
        lines.append(f"{r['system']:<22} {r['category']:<14} {r['n']:>4} {r['accuracy']:>9.1%} "
                     f"{r['seconds_per_task']:>7.2f}  {errs}")
    return "\n".join(lines)
