"""POST /infill's request and response: llama.cpp's shape, which its code-completion plugins (llama.vim,
llama.vscode) speak. Fields of llama.cpp's that tierlm has no use for (cache_prompt, samplers, t_max_*_ms,
response_fields, id_slot, ...) are accepted and ignored (docs/api.md lists them)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from tierlm.server.pipeline.request_fields import INT32_MAX, StopField
from tierlm.server.pipeline.text_fields import CheckedText


class InfillChunk(BaseModel):
    """One other file given as context (llama.cpp's input_extra item)."""

    model_config = ConfigDict(extra="ignore")
    filename: str = "tmp"
    text: str = ""


class InfillRequest(CheckedText):
    model_config = ConfigDict(extra="ignore")

    input_prefix: str = Field(default="", description="the code before the cursor")
    input_suffix: str = Field(default="", description="the code after the cursor")
    input_extra: list[InfillChunk] = Field(default_factory=list, description="other files, put before the prefix")
    prompt: str = Field(default="", description="text right before the cursor, after input_prefix (llama.cpp)")
    model: str | None = None
    n_predict: int = Field(default=-1, ge=-1, le=INT32_MAX,
                           description="tokens to generate; -1: what the context leaves, at most 2048")
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX, description="the same as n_predict")
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX, description="0 or -1: off")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, description="llama.cpp's -1 (or 4294967295): a random seed")
    stop: StopField = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False


class InfillStreamChunk(BaseModel):
    """A streamed piece: the new text; the last event is an InfillResponse with stop true."""

    content: str
    stop: bool = False


class InfillResponse(BaseModel):
    content: str
    stop: bool = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int = Field(description="prompt tokens served from the KV cache, any tier")
    stop_type: Literal["eos", "word", "limit"]
    stopping_word: str = ""
    truncated: bool = False
