"""The tool schemas of a turn with calls, as every call format's grammar needs them.

`tool_specs` checks the offered tools (each a name and an object schema for its arguments) and
`tool_choice_name` the tool choice; `tool_schema` is a tool's argument schema as a constraint
enforces it (objects that list their properties take no others; free strings bounded where
asked); `argument_schemas` makes every tool's schema a part of one turn's schema, moving
schemas that refer into themselves under the root's $defs. The formats themselves (how a
call is written around these schemas) are hybridlm.turns.codecs'.
"""

from __future__ import annotations

from hybridlm.errors import InputError

TOOL_CHOICES = ("auto", "required", "none")


def tool_specs(tools) -> dict[str, dict]:
    """name → argument schema of each offered tool (objects with .name and .parameters, e.g. a
    ToolRegistry, or dicts {"name", "parameters"}); one line naming a tool that is not one."""
    out: dict[str, dict] = {}
    for t in tools if tools is not None else []:
        name = t["name"] if isinstance(t, dict) else getattr(t, "name", None)
        params = t.get("parameters", {}) if isinstance(t, dict) else getattr(t, "parameters", {})
        if not isinstance(name, str) or not name:
            raise InputError(f"tool {_short(t)}: expected a name (a non-empty string)")
        if not isinstance(params, dict):
            raise InputError(f"tool {name}: parameters must be a JSON Schema object, got {_short(params)}")
        kind = params.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise InputError(f"tool {name}: parameters must be a schema of type object (a call's arguments are "
                             f"named), got type {_short(kind)}")
        out[name] = params or {"type": "object"}
    return out


def tool_choice_name(tool_choice, specs: dict) -> str:
    """auto, required, none or an offered tool's name, from any of these or OpenAI's
    {"type": "function", "function": {"name": ...}}."""
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
    if tool_choice in TOOL_CHOICES:
        return tool_choice
    if isinstance(tool_choice, str) and tool_choice in specs:
        return tool_choice
    raise InputError(f"tool choice {tool_choice!r}: expected auto, required, none or one of the tools "
                     f"{sorted(specs)[:8]}")


def tool_schema(schema, max_string: int | None = None):
    """A tool's argument schema as the constraint enforces it.

    Objects that list their properties take no others (a function rejects unknown keyword
    arguments; JSON Schema's default would let a model invent keys), unless the schema says
    so with additionalProperties or patternProperties (a required key missing from the
    properties is added to them, with any value); with max_string, every free string
    (no enum, const or format) is at most max_string characters.
    """
    if not isinstance(schema, dict):
        return schema
    out = _subschemas_mapped(schema, lambda sub: tool_schema(sub, max_string))
    kinds = out.get("type")
    is_string = kinds == "string" or (isinstance(kinds, list) and "string" in kinds)
    if max_string is not None and is_string and not {"enum", "const", "format"} & set(out):
        out["maxLength"] = min(out.get("maxLength", max_string), max_string)
    if "properties" in out and not {"additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
        # a required key the properties do not describe stays writable, with any value
        missing = [k for k in out.get("required") or [] if isinstance(k, str) and k not in out["properties"]]
        if missing and isinstance(out["properties"], dict):
            out["properties"] = {**out["properties"], **{k: {} for k in missing}}
    return out


def admit_defaults(schema):
    """The schema with each optional property whose declared default its own schema rejects widened to take that
    default too, in every object it describes.

    This is how a Python signature reads: a parameter's default is what the function receives when the key is
    left out, so a call that writes it out is the same call, whatever type the rest of the declaration gives
    (`"type": "string", "default": null` for `= None`; an enum beside its "N/A" default). BFCL declares its
    functions so, and its checker takes the default written out. JSON Schema itself does not (a default is an
    annotation; pydantic refuses null for `x: str = None`), so it is asked for, never assumed.
    """
    if not isinstance(schema, dict):
        return schema
    out = _subschemas_mapped(schema, admit_defaults)
    properties, required = out.get("properties"), out.get("required") or []
    if isinstance(properties, dict):
        out["properties"] = {
            key: {"anyOf": [prop, {"const": prop["default"]}]}
            if isinstance(prop, dict) and "default" in prop and key not in required and not _admits(prop, prop["default"])
            else prop
            for key, prop in properties.items()}
    return out


def _subschemas_mapped(schema: dict, f) -> dict:
    """The schema with `f` applied to each schema directly inside it (each property's, each $defs entry, the
    items', each alternative of anyOf, ...); every other keyword as it is."""
    out: dict = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {k: f(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not", "contains") and isinstance(value, dict):
            out[key] = f(value)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            out[key] = [f(v) for v in value]
        else:
            out[key] = value
    return out


def _admits(schema: dict, value) -> bool:
    """The schema admits the value, as jsonschema judges. A schema it cannot judge (a $ref out of it, a malformed
    one) is taken to admit it, and so is a string judged by a pattern: a schema's regular expression is never run
    on Python's backtracking engine (`(a+)+$` on a default of 40 a's would run for hours)."""
    import jsonschema

    if _holds_string(value) and _has_pattern(schema):
        return True
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    except Exception:  # noqa: BLE001 - an unresolvable $ref, a malformed or hostile schema: left as it is
        return True


def _has_pattern(schema) -> bool:
    if isinstance(schema, dict):
        return bool({"pattern", "patternProperties"} & set(schema)) or any(_has_pattern(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_pattern(v) for v in schema)


def _holds_string(value) -> bool:
    if isinstance(value, dict):
        return bool(value)  # (its keys are strings)
    return isinstance(value, str) or (isinstance(value, list) and any(_holds_string(v) for v in value))


def _rebase_refs(schema, base: str):
    """The schema with every `$ref` into itself ("#/…") pointing at the same place under `base`."""
    if isinstance(schema, dict):
        out = {k: _rebase_refs(v, base) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def argument_schemas(specs: dict, max_string: int | None) -> tuple[dict, dict]:
    """Each tool's argument schema as the call's "arguments", and the root's $defs: a schema that
    refers into itself (its own $defs, "#") is moved under the root's $defs and its pointers
    rebased, since inside the turn's schema "#" is the root (an MCP server's nested models)."""
    arguments, defs = {}, {}
    for i, (name, params) in enumerate(specs.items()):
        schema, key = tool_schema(params, max_string), f"tool{i}"
        rebased = _rebase_refs(schema, f"#/$defs/{key}")
        if rebased != schema:  # it refers into itself
            defs[key] = rebased
            arguments[name] = {"$ref": f"#/$defs/{key}"}
        else:
            arguments[name] = schema
    return arguments, defs


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
