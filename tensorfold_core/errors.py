"""One small hierarchy of errors, raised where the fact is known and mapped to HTTP and exit codes at the edges."""


class TensorfoldError(Exception):
    """Base of every error the product raises on purpose."""


class CheckpointError(TensorfoldError):
    """A checkpoint dir, file or tensor is missing, corrupt or of a kind no family reads."""


class PluginError(TensorfoldError):
    """No plugin serves what was asked for (family, drafter, shipped model)."""


class OptionError(TensorfoldError):
    """A flag or option value is invalid; the message names the flag."""


class RequestError(TensorfoldError):
    """A request is malformed or can never be served; carries the OpenAI error fields."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.kind = kind


class GroupError(RequestError):
    """A tensor-parallel group cannot serve: a rank failed, or could not join (HTTP 503 to a request)."""

    def __init__(self, message: str):
        super().__init__(message, status=503, kind="server_error", code="group_down")


class DrafterError(TensorfoldError):
    """A drafter is refused for a target (tokenizer mismatch, role, width) or failed to start."""
