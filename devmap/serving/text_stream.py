"""From generated tokens to each request's text stream: incremental decoding, stop strings, the end of a request."""

from __future__ import annotations

import time
from typing import Any

from .jobs import Job
from .metrics import ServiceMetrics
from .registry import ResidentModel


def decode_new(job: Job, tokenizer: Any, final: bool = False) -> None:
    """Extend `job.text` by what the new tokens add, decoding a short window of tokens instead of the whole
    output each step (the host thread that runs this also issues the GPUs' work). The window starts one update
    back, so a token's leading space is decoded the way a whole-sequence decode does; an incomplete multi-byte
    character waits for its next token (unless `final`)."""
    start, end = job.decoded
    before = tokenizer.decode(job.generated[start:end], skip_special_tokens=True)
    after = tokenizer.decode(job.generated[start:], skip_special_tokens=True)
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        job.text += after[len(before):]
        job.decoded = (end, len(job.generated))


def send_text(job: Job, tokenizer: Any) -> bool:
    """Emit the text the job's tokens add (held back while it may be the start of a stop string); True when a
    stop string appeared (the text before it is sent, the rest never)."""
    decode_new(job, tokenizer)
    text = job.text
    for stop in job.params.stop:
        at = text.find(stop, max(len(job.sent) - len(stop), 0)) if stop else -1
        if at >= 0:
            if at > len(job.sent):
                job.emit("text", text[len(job.sent):at])
            job.sent = text[:at]
            job.stopped = True
            return True
    ready = len(text) - max((len(s) - 1 for s in job.params.stop), default=0)
    if ready > len(job.sent):
        job.emit("text", text[len(job.sent):ready])
        job.sent = text[:ready]
    return False


def finish_job(job: Job, reason: str, resident: ResidentModel, metrics: ServiceMetrics) -> None:
    """Send the text held back (unless a stop string ended it) and end the job's stream."""
    if not job.stopped:
        decode_new(job, resident.tokenizer, final=True)
        if len(job.text) > len(job.sent):
            job.emit("text", job.text[len(job.sent):])
            job.sent = job.text
    job.finished = True
    metrics.completion_tokens.labels(model=job.model_id).inc(len(job.generated))
    job.emit("done", reason)


def eos_ids(resident: ResidentModel) -> list[int]:
    config = getattr(resident.model, "generation_config", None) or resident.model.config
    eos = getattr(config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if resident.tokenizer.eos_token_id is not None and resident.tokenizer.eos_token_id not in ids:
        ids.append(resident.tokenizer.eos_token_id)
    return ids


def take_token(job: Job, token: int, resident: ResidentModel, eos: list[int], metrics: ServiceMetrics) -> None:
    """One more generated token for the job: its text goes out. The one stop rule of serving: EOS, a stop string or
    the token budget (`max_new_tokens`) ends a request."""
    if token in eos:
        finish_job(job, "stop", resident, metrics)
        return
    job.generated.append(token)
    if len(job.generated) == 1:
        metrics.first_token.observe(time.perf_counter() - job.arrived)
    if send_text(job, resident.tokenizer):
        finish_job(job, "stop", resident, metrics)
    elif job.budget_left <= 0:
        finish_job(job, "length", resident, metrics)
