"""A request's output constraint (structured outputs) as the engine's ``StructuredOutputsParams``.

A request may spell it three ways: OpenAI's ``response_format``, vLLM's ``structured_outputs`` or
vLLM's older ``guided_*`` fields; it may give one. Shape errors are 400s here; whether a schema,
regex or grammar compiles is checked where it compiles (``serving_common.compile_constraints``).
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import StructuredOutputsParams
from server.errors import bad_request
from server.protocol import SamplingFields

# vLLM's older request fields for a constraint, and the StructuredOutputsParams field each sets.
GUIDED_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever of its three spellings it used: OpenAI's
    ``response_format``, vLLM's ``structured_outputs`` or vLLM's older ``guided_*`` fields.

    Shape errors are 400s here; a schema, regex or grammar that is not valid is a 400 where it
    compiles (``serving_common.compile_constraints``), once per distinct constraint.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise bad_request(
                    "response_format of type 'json_schema' needs json_schema.schema",
                    param="response_format.json_schema",
                )
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
        elif rf.type == "structural_tag":
            if rf.format is not None:
                tag: dict[str, Any] = {"type": "structural_tag", "format": rf.format}
            elif rf.structures is not None and rf.triggers is not None:
                tag = {"structures": rf.structures, "triggers": rf.triggers}
            else:
                raise bad_request(
                    "response_format of type 'structural_tag' needs format (or structures and triggers)",
                    param="response_format",
                )
            found.append(("response_format", StructuredOutputsParams(structural_tag=tag)))
        else:
            raise bad_request(
                f"response_format type {rf.type!r} is not supported; use 'text', 'json_object', "
                "'json_schema' or 'structural_tag'",
                param="response_format.type",
            )
    so = req.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            raise bad_request(
                "structured_outputs.whitespace_pattern is not supported by this server",
                param="structured_outputs.whitespace_pattern",
            )
        try:
            found.append(
                (
                    "structured_outputs",
                    StructuredOutputsParams(
                        json=so.json_schema,
                        regex=so.regex,
                        choice=so.choice,
                        grammar=so.grammar,
                        json_object=bool(so.json_object),
                        structural_tag=so.structural_tag,
                        disable_any_whitespace=so.disable_any_whitespace,
                    ),
                )
            )
        except ValueError as e:
            raise bad_request(str(e), param="structured_outputs") from e
    if req.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported by this server", param="guided_whitespace_pattern"
        )
    for name, key in GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{key: value})))
    if len(found) > 1:
        raise bad_request(
            f"give one output constraint, not {len(found)} ({', '.join(n for n, _ in found)})",
            param=found[1][0],
        )
    if not found:
        return None
    name, spec = found[0]
    try:
        _ = spec.kind  # exactly one constraint; the rest is checked where it compiles
    except ValueError as e:
        raise bad_request(str(e), param=name) from e
    return spec
