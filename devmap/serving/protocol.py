"""OpenAI-compatible request bodies (validated by pydantic) and the response and error bodies built from them.

Nothing a client asks for is dropped silently: a field devmap implements is honoured, a field that changes nothing
here is accepted (`IGNORED`), and any other field is refused with 400 naming it, unless it carries its neutral value
(`NEUTRAL`: a penalty of 0, no tools, a text response format). docs/serving.md has the table."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import ServiceError
from .jobs import DEFAULT_BUDGET, GenerationParams
from .limits import MAX_LOGPROBS, SEEDS

MAX_STOPS = 4  # OpenAI's limit on `stop` sequences
IGNORED = frozenset({"user", "store", "metadata", "service_tier", "stream_options", "parallel_tool_calls",
                     "prompt_cache_key", "safety_identifier"})  # they change nothing a model generates here
NEUTRAL: dict[str, tuple[Any, ...]] = {  # values of unsupported fields that ask for nothing
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "best_of": (1,), "suffix": ("",), "modalities": (["text"],),
}


def lone_surrogate(value: Any, place: str = "") -> tuple[str, str, int] | None:
    """The first text of a decoded JSON body (a field name or a value) that holds a lone surrogate, which JSON can
    spell (`"\\ud800"`) but is no character (UTF-8 cannot carry it, no tokenizer reads it): (its place, as
    `messages.0.content`, the text, the surrogate's index), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return place, value, exc.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{place}.{key}" if place else str(key)
        if isinstance(key, str) and (found := lone_surrogate(key, place)):
            return f"a field name in {place or 'the body'}", found[1], found[2]
        if found := lone_surrogate(item, inner):
            return found
    return None


class _Body(BaseModel):
    """A request body whose every text is made of characters (checked before its fields are)."""

    @model_validator(mode="before")
    @classmethod
    def characters_only(cls, data: Any) -> Any:
        try:  # the whole body at once; the walk below only finds the place
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, TypeError, ValueError):
            if found := lone_surrogate(data):
                place, text, index = found
                raise ServiceError(f"{place} holds a lone surrogate ({text[index]!r} at character {index}), which is "
                                   "not a character: send a surrogate pair's two halves together", param=place)
        return data


class _Request(_Body):
    model_config = ConfigDict(extra="allow")  # checked against IGNORED and NEUTRAL below

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1, description="devmap returns one choice per request")
    stream: bool = False
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=SEEDS[0], le=SEEDS[1])

    @model_validator(mode="after")
    def nothing_dropped(self) -> Any:
        for name, value in (self.model_extra or {}).items():
            if value is None or name in IGNORED or value in NEUTRAL.get(name, ()):
                continue
            raise ServiceError(f"{name} is not supported by devmap serve (docs/serving.md lists what is); send the "
                               "request without it", param=name)
        return self

    @field_validator("stop")
    @classmethod
    def at_most_four_stops(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences (as OpenAI's API), got {len(value)}")
        return value

    def budget(self) -> int | None:
        """The request's token budget as sent (None: the service's default)."""
        return self.max_tokens

    def scores(self) -> tuple[int | None, bool]:
        """(alternatives per token's score, or None for no scores; whether the prompt is scored too)."""
        return None, False

    def params(self, default_budget: int = DEFAULT_BUDGET) -> GenerationParams:
        """The generation parameters below HTTP: `max_tokens` becomes the token budget `max_new_tokens`."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, echo = self.scores()
        return GenerationParams(max_new_tokens=self.budget() or default_budget, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                stop=tuple(s for s in stops if s), logprobs=logprobs, echo=echo)


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a list of several prompts is not supported)")
            return value[0]
        return value

    def scores(self) -> tuple[int | None, bool]:
        return self.logprobs, self.echo and self.logprobs is not None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    @field_validator("content")
    @classmethod
    def text_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text only)")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def top_needs_logprobs(self) -> Any:
        if self.top_logprobs and not self.logprobs:
            raise ServiceError("top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    def scores(self) -> tuple[int | None, bool]:
        return (self.top_logprobs or 0) if self.logprobs else None, False

    def budget(self) -> int | None:
        """`max_tokens`, or the newer `max_completion_tokens` when only that is sent."""
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


class LoadRequest(_Body):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="a directory under the service's model root")
    id: str | None = None
    device_map: Union[str, dict[str, Union[int, str]], None] = None
    max_memory: Union[str, dict[str, Union[int, str]], None] = None
    dtype: str | None = None


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_body(request_id: str, model: str, text: str, finish: str | None, usage: dict | None,
                    logprobs: dict | None = None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
    if usage is not None:
        body["usage"] = usage
    return body


def chat_body(request_id: str, model: str, text: str, finish: str, usage: dict, logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": logprobs}],
            "usage": usage}


def chat_chunk(request_id: str, model: str, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
