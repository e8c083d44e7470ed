"""Engine and bridge exceptions as the protocol's errors: status, type, code and Retry-After."""

from __future__ import annotations

from types import SimpleNamespace

from sessionserve.core.admission import AdmissionFull
from sessionserve.core.session_manager import SessionBusyError, SessionMovingError
from sessionserve.server.app import engine_error, error_response
from sessionserve.server.bridge import EngineDead, EngineOverloaded


class _Counter:
    def labels(self, *_: str) -> _Counter:
        return self

    def inc(self) -> None:
        pass


STATE = SimpleNamespace(metrics=SimpleNamespace(errors=_Counter()))


def test_admission_full_is_a_429_with_the_doors_retry_time() -> None:
    err = engine_error(AdmissionFull(7.2))
    assert (err.status_code, err.type, err.code) == (429, "rate_limit_error", "admission_full")
    resp = error_response(err, STATE)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "8"
    assert error_response(err, STATE, "/v1/messages").headers["retry-after"] == "8"


def test_other_engine_errors() -> None:
    assert error_response(engine_error(EngineOverloaded("full")), STATE).headers["retry-after"] == "1"
    assert engine_error(EngineDead("gone")).status_code == 503
    assert engine_error(SessionMovingError("moving")).code == "session_busy"
    assert engine_error(SessionBusyError("busy")).status_code == 409
    assert engine_error(ValueError("bad")).status_code == 400
    assert engine_error(RuntimeError("boom")).status_code == 500
