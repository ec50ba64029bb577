"""OpenAI-compatible request bodies (validated by pydantic) and the response and error bodies built from them."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .jobs import GenerationParams

MAX_STOPS = 4  # OpenAI's limit on `stop` sequences


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields devmap does not use (user, logit_bias...) pass

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1, description="devmap returns one choice per request")
    stream: bool = False
    stop: Union[str, list[str], None] = None
    seed: int | None = None

    @field_validator("stop")
    @classmethod
    def at_most_four_stops(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences (as OpenAI's API), got {len(value)}")
        return value

    def budget(self) -> int | None:
        """The request's token budget as sent (None: the service's default)."""
        return self.max_tokens

    def params(self, default_budget: int = 16) -> GenerationParams:
        """The generation parameters below HTTP: `max_tokens` becomes the token budget `max_new_tokens`."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationParams(max_new_tokens=self.budget() or default_budget, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                stop=tuple(s for s in stops if s))


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str]]

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a list of several prompts is not supported)")
            return value[0]
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts carry meaning here
            return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def budget(self) -> int | None:
        """`max_tokens`, or the newer `max_completion_tokens` when only that is sent."""
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


class LoadRequest(BaseModel):
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


def completion_body(request_id: str, model: str, text: str, finish: str | None, usage: dict | None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if usage is not None:
        body["usage"] = usage
    return body


def chat_body(request_id: str, model: str, text: str, finish: str, usage: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage}


def chat_chunk(request_id: str, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
