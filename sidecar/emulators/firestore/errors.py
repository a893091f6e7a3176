"""The emulator's one error type: a gRPC status code and a message meant for the caller.

Domain code raises ``FirestoreError``; only ``service.py`` turns it into a gRPC status (or, for
BatchWrite, into a per-write ``google.rpc.Status``). Messages follow production's wording where
the wording is known, and always name the offending document, field or argument.
"""

from __future__ import annotations

import grpc


class FirestoreError(Exception):
    """A request Firestore would refuse, with the status code it would use."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> FirestoreError:
    return FirestoreError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> FirestoreError:
    return FirestoreError(grpc.StatusCode.NOT_FOUND, message)


def already_exists(message: str) -> FirestoreError:
    return FirestoreError(grpc.StatusCode.ALREADY_EXISTS, message)


def failed_precondition(message: str) -> FirestoreError:
    return FirestoreError(grpc.StatusCode.FAILED_PRECONDITION, message)


def aborted(message: str) -> FirestoreError:
    return FirestoreError(grpc.StatusCode.ABORTED, message)


def unimplemented(message: str) -> FirestoreError:
    """A feature production serves and this emulator does not: refused, never answered wrongly."""
    return FirestoreError(grpc.StatusCode.UNIMPLEMENTED, message)
