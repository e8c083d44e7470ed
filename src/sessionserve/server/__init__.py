"""The OpenAI- and Anthropic-compatible HTTP server.

What the layers built on it (the scale-out router, the CLI) may use is named
here; every other module of the package is the server's own (an import
contract). Loaded on first use, so the router's ingress does not import the
engine to read a routing hint.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "create_app": "sessionserve.server.app",  # the app factory
    "Auth": "sessionserve.server.auth",
    "tenant_salt": "sessionserve.server.auth",
    "make_response_store": "sessionserve.server.response_store",
    "valid_session_id": "sessionserve.server.protocol",
    "TURN_PATHS": "sessionserve.server.routing",  # routes that run a model turn
    "route_hint": "sessionserve.server.routing",  # the session and prompt a request names, for routing
    "session_key": "sessionserve.server.turn.identity",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
