"""The scheduler's exceptions, each tied to the gRPC status a client should see.

`grpc_handlers.grpc_errors` is the one place that turns these into statuses; everything else raises.
"""

from __future__ import annotations

import grpc


class FolioError(Exception):
    """Base class: `code` is the gRPC status; the message is shown to the client as is."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(FolioError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DuplicateRequest(FolioError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(FolioError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ExecutorUnavailable(FolioError):
    code = grpc.StatusCode.UNAVAILABLE


class ExecutorFailed(FolioError):
    """The executor reported an error for a step this request was in."""

    code = grpc.StatusCode.INTERNAL


class NotSupported(FolioError):
    """A field or RPC of a gateway's worker contract that Folio does not implement."""

    code = grpc.StatusCode.UNIMPLEMENTED
