"""Folio's Python client and the `folio` command line.

    from client import FolioClient
    with FolioClient("127.0.0.1:50051") as folio:
        for resp in folio.generate("Once upon a time", max_tokens=32):
            print(resp.text, end="", flush=True)

Importing this package loads grpc and the generated stubs only: never torch or the services.
"""

from client.aio import AsyncFolioClient
from client.api import DEFAULT_ADDRESS, FolioClient
from client.messages import Completion

__all__ = ["AsyncFolioClient", "Completion", "DEFAULT_ADDRESS", "FolioClient"]
