"""Errors of the service, each with its HTTP status and OpenAI error type."""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses or could not serve; `status` and `kind` go into the OpenAI error body."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param

    def __reduce__(self) -> tuple:  # crosses from the engine core's process to the API's whole
        return type(self), (self.message, self.param)


class ModelNotFound(ServiceError):
    status = 404
    kind = "not_found_error"


class QueueFull(ServiceError):
    status = 429
    kind = "rate_limit_error"


class DoesNotFit(ServiceError):
    status = 409
    kind = "insufficient_memory"


class RequestTimeout(ServiceError):
    status = 504
    kind = "timeout_error"


class ShuttingDown(ServiceError):
    status = 503
    kind = "service_unavailable"


class ModelUnloading(ServiceError):
    """The model is being unloaded: it takes no new requests, and those still running when its drain bound ends
    are ended with this."""

    status = 503
    kind = "service_unavailable"


class GenerationFailed(ServiceError):
    status = 500
    kind = "server_error"


class EngineGone(ServiceError):
    """The engine core's process ended (killed, or out of memory): nothing more can be generated."""

    status = 503
    kind = "service_unavailable"
