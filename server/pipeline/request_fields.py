"""Request field types every dialect's schemas share: the token-id and stop-string fields, the lax fields whose
OpenAPI schema states what the handler accepts (``accepts``), and the fast path that validates a list of token ids
at C speed (``token_ids_first``). The dialects' models (server/api/*/protocol.py) are built from these."""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (BeforeValidator, Field, StrictInt, TypeAdapter, ValidationError, ValidatorFunctionWrapHandler,
                      WithJsonSchema)

INT32_MAX = 2**31 - 1  # top_k travels to the samplers as int32
MAX_STOP_STRINGS = 16  # as SamplingParams.verify
MAX_TOP_LOGPROBS = 20  # as SamplingParams.verify (backends/base.py)


def accepts(schema: dict[str, Any], note: str) -> Any:
    """The OpenAPI schema of a field whose other forms the handler refuses with a 400 (it keeps a lax type)."""
    return WithJsonSchema({**schema, "description": note})


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# Lax type: SamplingParams counts the stop strings and its 400 says how many are allowed.
StopField = Annotated[Union[str, list[str], None], accepts(nullable({"anyOf": [
    {"type": "string"}, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string"}}]}),
    f"a stop string or a list of at most {MAX_STOP_STRINGS}")]


JSON_SAFE_INT_MAX = 2**53 - 1
# Lax type: keys are checked as decimal token ids (server/pipeline/sampling_mapping.token_id_keys) and against the
# vocabulary (a 400 naming logit_bias); the document says what a valid key and value are.
LogitBiasField = Annotated[dict[str, float] | None, accepts(nullable({
    "type": "object", "propertyNames": {"pattern": "^[0-9]+$", "maxLength": 19},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
    "token id (as a decimal string) -> bias in [-100, 100] added to its logit before sampling")]


def not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a token id must be an integer, not true or false")
    return value


# Token ids are integers (JSON true/false are not; 7.0 is, as JSON Schema's integer says) that fit the engine's
# int64; booleans are booleans (StrictBool: not 0/1 or "true").
IdInt = Annotated[int, BeforeValidator(not_bool)]


# The bounds before the validator: placed after it, pydantic writes them into the OpenAPI schema as "ge"/"le"
# (no JSON Schema meaning) instead of "minimum"/"maximum", and clients validating against the document miss them.
# The bound is 2**53 - 1, the largest integer every JSON parser holds exactly: at 2**63 - 1 a client (or a fuzzer)
# writing the bound as a float (9.223372036854776e18, "an integer" to JSON Schema) sends 2**63 after parsing.
TokenId = Annotated[int, Field(ge=0, le=JSON_SAFE_INT_MAX), BeforeValidator(not_bool)]


_TOKEN_IDS = TypeAdapter(list[StrictInt])


_TOKEN_ID_LISTS = TypeAdapter(list[list[StrictInt]])


def token_ids_first(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of ints skips the union: pydantic validates a value against every member of a union (and collects
    an error per item for list[str]), which took 270 ms on the event loop for a 1M-id prompt; this takes 20 ms.
    Anything else, and ids that do not validate, go through the union for its usual result and errors."""
    if isinstance(value, list) and value and (type(value[0]) is int or (
            isinstance(value[0], list) and value[0] and type(value[0][0]) is int)):
        try:  # plain ints (strict: no bool, no float) at C speed; the union's per-item check is the slow path
            return (_TOKEN_IDS if type(value[0]) is int else _TOKEN_ID_LISTS).validate_python(value)
        except ValidationError:
            pass
    return handler(value)


# Token ids must be in the model's vocabulary: the engine refuses others with a 400 that says which (its message is
# better than a schema error, so validation stays lax and only the document states the rule).
IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


TEXT_SCHEMA = {"type": "string", "minLength": 1}  # "" has no tokens (unless the tokenizer adds BOS): a 400
