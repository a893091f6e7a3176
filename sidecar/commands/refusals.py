"""How an operator command that calls one RPC of a running sidecar reports its failure: one line, and
its exit code (``exit_codes``). Shared by ``unblock`` and ``skip-gap``.

Rules: INVALID_ARGUMENT and NOT_FOUND mean the command must be fixed (``EXIT_USAGE``); anything
else (FAILED_PRECONDITION: the key is not in the state the action frees; UNAVAILABLE, a deadline:
the sidecar unreachable or its store unavailable) is ``EXIT_FAILED``. The line names the sidecar,
the status code and the sidecar's details, on one line.
"""

from __future__ import annotations

import grpc

from sidecar.commands.exit_codes import EXIT_FAILED, EXIT_USAGE

_USAGE_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND})


def refusal(command: str, target: str, exc: grpc.RpcError) -> tuple[str, int]:
    """The one line to print on stderr for ``exc`` and the exit code."""
    code = exc.code() if hasattr(exc, "code") else None
    details = " ".join(((exc.details() if hasattr(exc, "details") else None) or "").split())
    name = code.name if isinstance(code, grpc.StatusCode) else "ERROR"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and "store" not in details:
        reason = f"cannot reach the sidecar at {target}"
    else:
        reason = f"the sidecar at {target} refused"
    return f"pubsub-sidecar {command}: {reason}: {name}: {details}", EXIT_USAGE if code in _USAGE_CODES else EXIT_FAILED
