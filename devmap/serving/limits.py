"""The service's bounds and scheduling knobs, validated once where the CLI or a caller builds them."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ServiceError
from .jobs import GenerationParams
from .scheduler import SchedulerLimits

SEEDS = (-(1 << 63), (1 << 64) - 1)  # the seeds torch's generators take
MAX_LOGPROBS = 20  # the most alternatives a token's score lists (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class EngineLimits:
    """Bounds of the service (batch and queue sizes, prompt length, token budget, timeouts) and its scheduling
    knobs (see `SchedulerLimits`)."""

    max_batch: int = 64
    max_queue: int = 256
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024  # the largest token budget a request may ask for (HTTP's max_tokens)
    request_timeout: float = 600.0
    idle_timeout: float | None = None  # unload models unused this long (seconds)
    unload_drain: float = 30.0  # an unloaded model's running requests may finish within this long (seconds)
    lanes: int | None = None
    compile: bool | None = None  # compiled decode steps: None where they win (devmap.serving.warm_up), or on/off
    compile_beside: bool | None = False  # compile while the model already serves (devmap.serving.step_compile), not
    # before; None: where its steps would compile anew (its first start on this compile cache: compiles_beside)
    riding: bool | None = None  # joiners ride the decode steps: None where it pays (mixed_joins.rides_by_default)
    graph_shapes: int = 8  # batch shapes whose captured steps stay on a model (devmap's keep_shapes)
    batch_wait: float = 0.005
    max_batch_wait: float = 0.05
    length_bucket: int = 32
    join_wait: float = 0.01
    join_tokens: int = 2048
    preempt_after: float = 0.25
    profile_dir: str | None = None  # where POST /stop_profile writes the engine core's trace (None: profiling off)

    @property
    def max_body_bytes(self) -> int:
        """The largest request body read: room for `max_prompt_tokens` tokens of the longest kinds (64 bytes each,
        JSON-escaped text or a list of ids) and 1 MiB for the rest of the body. Larger bodies are refused (413)
        before they are read, parsed or tokenized."""
        return (1 << 20) + 64 * self.max_prompt_tokens

    def scheduling(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_batch, self.batch_wait, self.max_batch_wait, self.length_bucket,
                               self.join_wait, self.join_tokens, self.preempt_after)

    def check_request(self, prompt_ids: list[int], params: GenerationParams, context: int, vocab_size: int) -> None:
        """Refuse a request these limits or its model do not allow: a ServiceError (400) naming the field as HTTP
        does (max_tokens is the token budget). The model: its `context` (0: unbounded) and `vocab_size` (its prompt's
        token ids are below it). Every value that reaches a tensor is checked here, before the request is queued."""
        prompt_tokens, max_new_tokens = len(prompt_ids), params.max_new_tokens
        if not prompt_tokens:
            raise ServiceError("the prompt is empty", param="prompt")
        if prompt_tokens > self.max_prompt_tokens:
            raise ServiceError(f"the prompt has {prompt_tokens} tokens; this service takes at most "
                               f"{self.max_prompt_tokens}", param="prompt")
        if max_new_tokens < 1 or max_new_tokens > self.max_new_tokens:
            raise ServiceError(f"max_tokens must be between 1 and {self.max_new_tokens}, got {max_new_tokens}",
                               param="max_tokens")
        if context and prompt_tokens + max_new_tokens > context:
            raise ServiceError(f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_new_tokens}) is "
                               f"more than the model's context of {context} tokens", param="max_tokens")
        bad = next((i for i in prompt_ids if not 0 <= i < vocab_size), None) if vocab_size else None
        if bad is not None:
            raise ServiceError(f"the prompt's token id {bad} is outside the model's vocabulary: ids are 0 to "
                               f"{vocab_size - 1}", param="prompt")
        if params.seed is not None and not SEEDS[0] <= params.seed <= SEEDS[1]:
            raise ServiceError(f"seed must be between {SEEDS[0]} and {SEEDS[1]}, got {params.seed}", param="seed")
        if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
            raise ServiceError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {params.logprobs}",
                               param="logprobs")
