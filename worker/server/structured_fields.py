"""The request fields that ask for structured output - OpenAI's response_format and vLLM's structured_outputs
and guided_* - mapped onto one StructuredOutputSpec (or a 400 naming the field)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from disagg.worker.sampling_params import StructuredOutputSpec


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the grammar enforces the schema either way


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` object (one of its constraint fields)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredOutputSpec | None:
        """The one constraint asked for; ValueError(param, message) when several or a malformed one."""
        found: list[tuple[str, StructuredOutputSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputSpec(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format", "response_format.json_schema.schema is required")
            found.append(("response_format", StructuredOutputSpec(json=rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            spec = StructuredOutputSpec(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                                        choice=so.choice, grammar=so.grammar)
            found.append(("structured_outputs", spec))
        for name, spec in (("guided_json", StructuredOutputSpec(json=self.guided_json)),
                           ("guided_regex", StructuredOutputSpec(regex=self.guided_regex)),
                           ("guided_choice", StructuredOutputSpec(choice=self.guided_choice)),
                           ("guided_grammar", StructuredOutputSpec(grammar=self.guided_grammar))):
            if getattr(self, name) is not None:
                found.append((name, spec))
        if not found:
            return None
        if len(found) > 1:
            names = [n for n, _ in found]
            raise ValueError(names[1], f"{' and '.join(names)}: ask for one structured output constraint")
        name, spec = found[0]
        try:
            spec.kind()
        except ValueError as e:
            raise ValueError(name, f"{name}: {e}") from None
        return spec
