"""The request fields of structured output (docs/api.md): OpenAI's ``response_format``, SGLang's ``json_schema``,
``regex`` and ``ebnf``, and vLLM's ``guided_*`` aliases. server/api/openai/protocol.py mixes them into its request
models; server/pipeline/structured_output.py turns them into SamplingParams' one grammar."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema

_JSON_SCHEMA_TEXT = "a JSON schema, as an object or as JSON text"
_REFUSED = "not supported: only null is accepted"
NonEmpty = Annotated[str, Field(min_length=1)]


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``response_format.json_schema``: the output is a JSON document valid against ``schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(default="response", description="the schema's name (not used for decoding)")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the output follows")
    strict: StrictBool | None = Field(default=None, description="accepted; decoding always follows the schema exactly")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class NativeGrammarFields(BaseModel):
    """SGLang's /generate ``sampling_params`` grammar fields: at most one per request."""

    json_schema: NonEmpty | None = Field(default=None, description="a JSON schema (JSON text); the output follows it")
    regex: NonEmpty | None = Field(default=None, description="a regular expression the whole output matches")
    ebnf: NonEmpty | None = Field(default=None, description="an EBNF grammar (start rule 'root') the output follows")


class OpenAIGrammarFields(BaseModel):
    """Structured output on /v1/completions and /v1/chat/completions: OpenAI's response_format, SGLang's extra
    body fields and vLLM's guided_* aliases. At most one per request."""

    response_format: ResponseFormat | None = Field(
        default=None, description="text (no constraint), json_object (any JSON object) or json_schema")
    json_schema: NonEmpty | dict[str, Any] | None = Field(default=None, description=f"SGLang: {_JSON_SCHEMA_TEXT}")
    regex: NonEmpty | None = Field(default=None, description="SGLang: a regular expression the whole output matches")
    ebnf: NonEmpty | None = Field(default=None, description="SGLang: an EBNF grammar (start rule 'root')")
    guided_json: NonEmpty | dict[str, Any] | None = Field(default=None, description=f"vLLM alias of json_schema: "
                                                                               f"{_JSON_SCHEMA_TEXT}")
    guided_regex: NonEmpty | None = Field(default=None, description="vLLM alias of regex")
    guided_choice: list[str] | None = Field(default=None, min_length=1,
                                            description="vLLM: the output is exactly one of these strings")
    guided_grammar: NonEmpty | None = Field(default=None, description="vLLM alias of ebnf")
    guided_decoding_backend: str | None = Field(default=None, description="vLLM: accepted; xgrammar always decodes")
    # Refused with a 400 when set (lax types, so the handler's message says why; the document accepts only null)
    structural_tag: Annotated[Any, WithJsonSchema({"type": "null", "description": _REFUSED})] = None
    guided_whitespace_pattern: Annotated[Any, WithJsonSchema({"type": "null", "description": _REFUSED})] = None
