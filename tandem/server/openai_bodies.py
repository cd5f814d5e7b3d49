"""The JSON bodies of the OpenAI-compatible routes (`tandem.server.openai_api`), and their error.

OpenAI's own API refuses parameters it does not know, and so do these: a misspelled field is a 400 naming it.
Parameters OpenAI defines that tandem cannot honour are accepted only at their no-op values (a penalty of 0, no
logit bias, text responses), so a client that sends the defaults works, and one that relies on more learns it.
tandem's additions (as vLLM and SGLang accept them): `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, `chat_template_kwargs`, `return_token_ids` (token ids are always returned).
"""

from __future__ import annotations

from typing import Any, Literal, Self

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class OpenAIError(Exception):
    """A refused request: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             409: "conflict_error", 500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    @classmethod
    async def from_request(cls, request: Request) -> Self:
        """The body validated; OpenAIError (400, naming the first field that is wrong) otherwise."""
        raw = await request.body()
        try:
            return cls.model_validate_json(raw or b"{}")
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            if param is None and err["type"] == "value_error":  # a check of several fields names its own
                message = str(err["ctx"]["error"])
                raise OpenAIError(message, message.split(":", 1)[0]) from None
            if err["type"] == "json_invalid":
                raise OpenAIError(f"malformed JSON ({err['ctx']['error']})") from None
            if err["type"] == "extra_forbidden":
                raise OpenAIError(f"{param}: unrecognized request argument; this endpoint accepts "
                                  f"{sorted(cls.model_fields)}", param) from None
            raise OpenAIError(f"{param}: {err['msg']}" if param else err["msg"], param) from None

    # fields both endpoints share
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Literal[0] | None = Field(None, description="only 0 (tandem has no penalties)")
    presence_penalty: Literal[0] | None = Field(None, description="only 0 (tandem has no penalties)")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # tandem's (vLLM's and SGLang's names)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, lt=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None  # accepted: tandem always returns them

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("at most 16 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _no_ops_only(self):
        if self.logit_bias:
            raise ValueError("logit_bias: not supported (send none, or an empty object)")
        return self

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage comes in the last chunk


class CompletionBody(OpenAIBody):
    """`/v1/completions`: `prompt` a string, a list of strings, a list of token ids, or a list of such lists."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatBody(OpenAIBody):
    """`/v1/chat/completions`. `messages` are passed to the model's chat template as given (roles, content as text
    or text parts, assistant `tool_calls`, tool results)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict | None = None
    store: bool | None = None
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format: only {\"type\": \"text\"} is supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens: differs from max_tokens (send one of them)")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


OpenAIBody.model_rebuild()
CompletionBody.model_rebuild()
ChatBody.model_rebuild()
