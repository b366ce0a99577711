"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the status
OpenAI's API uses for the same failure, so a client's error handling works unchanged.

Each error as ``status type (code, ...): when``:

- 400 invalid_request_error (invalid_json, invalid_value, unsupported_parameter, unknown_parameter,
  missing_parameter, context_length_exceeded): the body is wrong
- 401 invalid_request_error (invalid_api_key): keys configured (``--api-key``, ``--api-keys``) and
  the bearer token is missing or wrong
- 404 invalid_request_error (model_not_found, session_not_found, not_found): unknown model, session
  id (or another user's: the same body) or path
- 405 invalid_request_error (method_not_allowed)
- 409 invalid_request_error (session_busy, session_history_mismatch): a session is answering another
  request; the sent history disagrees with the stored one
- 413 invalid_request_error (request_too_large): the body is over ``--max-request-bytes``
- 429 rate_limit_error (rate_limit_exceeded): ``--max-concurrency`` requests are already running
- 500 server_error (internal_error): a bug or a storage failure (the message says which)
- 503 server_error (shutting_down): the server is stopping (also a request cut as
  ``--graceful-timeout`` runs out; an error event mid-stream)
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from chatkv.errors import (
    ChatKVError,
    ContextOverflow,
    ConversationBusy,
    EngineClosed,
    InvalidRequest,
    LeaseLost,
    SessionError,
    StorageError,
)


class APIError(Exception):
    """An error answered to the client as OpenAI answers it."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or (
            "server_error" if status >= 500 else "rate_limit_error" if status == 429 else "invalid_request_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_value(param: str, message: str) -> APIError:
    return APIError(400, message, "invalid_value", param)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, "unsupported_parameter", param)


def from_chatkv(e: Exception) -> APIError:
    """The APIError for an exception the SDK raised while a request was being prepared or run."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequest):
        msg = str(e)
        too_long = (
            isinstance(e, ContextOverflow) or "tokens; the context is" in msg or "the KV pool can hold at most" in msg
        )
        return APIError(
            400, msg, "context_length_exceeded" if too_long else "invalid_value", "messages" if too_long else None
        )
    if isinstance(e, (ConversationBusy, LeaseLost)):  # another process has the conversation now: retry
        return APIError(409, str(e), "session_busy", "session_id")
    if isinstance(e, SessionError):
        msg = str(e)
        if msg.startswith("unknown conversation id"):
            return APIError(404, msg, "session_not_found", "session_id")
        if "already generating" in msg or "is generating" in msg:
            return APIError(409, msg, "session_busy", "session_id")
        return APIError(400, msg, "invalid_session", "session_id")
    if isinstance(e, StorageError):
        return APIError(500, str(e), "storage_error")
    if isinstance(e, EngineClosed):  # the engine closed under the request: the server is stopping
        return APIError(503, "the server is shutting down", "shutting_down")
    if isinstance(e, ChatKVError):
        return APIError(500, f"{type(e).__name__}: {e}", "internal_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_error")
