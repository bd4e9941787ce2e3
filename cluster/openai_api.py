"""The OpenAI API's request and response bodies, with OpenAI's field names, and its error format.

Request models are strict (no string-to-number coercion: ``"temperature": "0.5"`` is a 400, as in OpenAI's API)
and document their ranges, so the OpenAPI schema FastAPI derives from them is precise enough to fuzz.
Unknown fields are tolerated and ignored (vLLM's behaviour, and what the ``openai`` client's ``extra_body``
relies on), except the ones listed in :data:`UNSUPPORTED` (OpenAI or vLLM fields that would change the result):
those are rejected when set to anything but their neutral value, so a client never gets a silently different
answer from the one it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from kernels.sampling import (
    MAX_PRIORITY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TPOT_SLO_MS,
    MIN_PRIORITY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingParams,
)

#: OpenAI's documented default for the legacy completions endpoint.
DEFAULT_COMPLETION_MAX_TOKENS = 16


def _text_only(value: str) -> str:
    """JSON escapes can smuggle lone surrogates (\\ud800) into a str; they are not text, no tokenizer takes them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("invalid Unicode (a lone surrogate escape is not text)") from None
    return value


#: A str that is real text (constrained strs are checked by pydantic itself, plain ones are not).
Text = Annotated[str, AfterValidator(_text_only)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


#: The ``code`` of an error that names no more specific one, by HTTP status (docs/HTTP_API.md lists every code).
DEFAULT_ERROR_CODES: dict[int, str] = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "slo_unattainable",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

    ``code`` is always a snake_case string, so clients can branch on it without knowing the status: the specific
    code when one is given, else the status' entry in :data:`DEFAULT_ERROR_CODES` (``http_<status>`` for a
    status without one); ``retry_after_s``: the ``Retry-After`` header of a retryable error. ``type`` is OpenAI's
    coarse class: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx unless given
    (``service_unavailable`` marks a retryable 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.message = message
        self.param = param
        self.code = code or DEFAULT_ERROR_CODES.get(status, f"http_{status}")
        if type is None:
            type = "invalid_request_error" if status < 500 else "server_error"
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ------------------------------------------------------------------------------------------------ requests
class _Lenient(BaseModel):
    """Strict types, unknown fields kept (in ``model_extra``) so they can be checked against UNSUPPORTED, and
    finite numbers only: Python's JSON parser accepts ``NaN`` and ``Infinity``, which must be reported as what
    they are rather than as a range violation (NaN fails every comparison)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class _SamplingRequest(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = Field(None, description="served model id (see /v1/models); omitted = the served model")
    max_tokens: int | None = Field(None, ge=1, description="completion token budget")
    temperature: float | None = Field(
        None, ge=0.0, le=100.0, description=f"0 = greedy, else >= {MIN_TEMPERATURE}; default 1"
    )
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1.0, description="nucleus mass; default 1 (off)")
    top_k: int | None = Field(None, ge=-1, description="vLLM extension: keep the k most likely; 0 or -1 = off")
    seed: int | None = Field(None, ge=0, le=(1 << 63) - 1, description="makes sampled output reproducible")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="vLLM extension: token ids that end the completion"
    )
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past the EOS token")
    n: int = Field(1, ge=1, le=1, description="number of choices; only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 is supported")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="only empty is supported")
    user: Text | None = None
    return_token_ids: bool = Field(False, description="vLLM extension: also return prompt and output token ids")
    # Service levels (docs/HTTP_API.md "Service levels"); omitted = the server's default.
    speculative: Literal["auto", "off", "on"] | None = Field(
        None, description="dspark extension: auto (the scheduler decides), off (no drafts), on (drafted every round)"
    )
    priority: int | None = Field(
        None, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="tier; a smaller value is served first (as in vLLM)"
    )
    tpot_slo_ms: float | None = Field(
        None, gt=0, le=MAX_TPOT_SLO_MS, description="dspark extension: target time per output token (ms)"
    )


class CompletionRequest(_SamplingRequest):
    prompt: (
        Annotated[str, StringConstraints(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    ) = Field(description="text, or token ids; a list of prompts must hold exactly one")
    echo: bool = Field(False, description="only false is supported")
    logprobs: int | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    suffix: Text | None = Field(None, description="not supported")


class TextContentPart(_Lenient):
    type: Literal["text"]
    text: Text


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="completion token budget (preferred name)")
    logprobs: bool | None = Field(None, description="only false is supported")
    top_logprobs: int | None = Field(None, description="not supported")
    tools: list[dict[str, Any]] | None = Field(None, description="not supported")
    add_generation_prompt: bool = Field(True, description="vLLM extension: passed to the chat template")


#: Fields (declared above or passed as extras) that change what is generated and that this server does not
#: implement, with the value(s) that are harmless. Anything else is rejected with a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "prompt_logprobs": (None, 0),
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,),
}


def check_supported(request: _SamplingRequest) -> None:
    """400 for a field this server would otherwise ignore although it changes the result."""
    fields = request.model_dump(include=set(UNSUPPORTED) & set(type(request).model_fields))
    fields.update({k: v for k, v in (request.model_extra or {}).items() if k in UNSUPPORTED})
    for name, value in fields.items():
        if value not in UNSUPPORTED[name]:
            raise APIError(
                400, f"{name}={value!r} is not supported by this server", param=name, code="unsupported_parameter"
            )
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def sampling_params(request: _SamplingRequest, max_tokens: int) -> SamplingParams:
    """Map the OpenAI fields to the engine's record (SamplingParams validates the rest)."""
    stop = request.stop
    top_k = request.top_k if request.top_k is not None else 0
    return SamplingParams(
        temperature=float(request.temperature) if request.temperature is not None else 1.0,
        top_k=max(top_k, 0),
        top_p=float(request.top_p) if request.top_p is not None else 1.0,
        max_tokens=max_tokens,
        seed=request.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        speculative=request.speculative,
        priority=request.priority,
        tpot_slo_ms=None if request.tpot_slo_ms is None else float(request.tpot_slo_ms),
    )


# ----------------------------------------------------------------------------------------------- responses
# Documentation of the JSON bodies (FastAPI puts them in the OpenAPI schema); the app builds plain dicts of
# the same shape on the hot path.
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    #: How the model is served (docs/HTTP_API.md): the SPS table(s) Algorithm 1 prices rounds with and where
    #: each came from. An extension of OpenAI's card; clients that do not know it ignore it.
    dspark: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
