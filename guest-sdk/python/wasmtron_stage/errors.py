"""Errors a stage raises; each maps to an HTTP status / gRPC code for the client."""
from wit_world.imports import types as _wit


class StageError(Exception):
    """A failure reported to the client. `code` is one of "invalid-argument" (HTTP 400),
    "not-found" (404), "unavailable" (503), "unsupported" (501) or "internal" (500)."""

    code = "internal"
    _CODES = {
        "invalid-argument": _wit.ErrorCode.INVALID_ARGUMENT,
        "not-found": _wit.ErrorCode.NOT_FOUND,
        "unavailable": _wit.ErrorCode.UNAVAILABLE,
        "unsupported": _wit.ErrorCode.UNSUPPORTED,
        "internal": _wit.ErrorCode.INTERNAL,
    }

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.message = message
        if code:
            if code not in self._CODES:
                raise ValueError(f"unknown error code {code!r}; one of {', '.join(self._CODES)}")
            self.code = code

    def to_wit(self) -> _wit.Error:
        return _wit.Error(self._CODES[self.code], self.message)

    @classmethod
    def from_wit(cls, error: _wit.Error) -> "StageError":
        code = next(k for k, v in cls._CODES.items() if v == error.code)
        return _BY_CODE.get(code, StageError)(error.message)


class InvalidArgument(StageError):
    """The request does not fit (HTTP 400)."""

    code = "invalid-argument"


class NotFound(StageError):
    """Something named does not exist (HTTP 404)."""

    code = "not-found"


class Unavailable(StageError):
    """Try again later (HTTP 503)."""

    code = "unavailable"


class Unsupported(StageError):
    """Not offered (HTTP 501)."""

    code = "unsupported"


_BY_CODE = {c.code: c for c in (InvalidArgument, NotFound, Unavailable, Unsupported)}
