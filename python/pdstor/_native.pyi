"""Type stubs of pdstor._native (the PyO3 module built from python/src/lib.rs)."""

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Self, TypeAlias, final, overload

from typing_extensions import Buffer as _BufferLike

from pdstor.errors import Error  # collections.abc.Buffer from Python 3.12

__all__ = ["Buffer", "Client", "Reader", "Receipt", "Timeline", "Writer", "refusal_codes", "version"]

_Layout: TypeAlias = dict[str, Any]
"""model_id: str, dtype: str, layers, kv_heads, head_dim, chunk_tokens: int, kv_format: str"""

@final
class Buffer:
    """Memory the daemon reads stores from and loads into: a memfd, mapped here
    and shared with the daemon once over the data socket. Implements the
    buffer protocol (writable): numpy.frombuffer / torch.frombuffer view it
    with no copy."""

    def __new__(cls, size: int, name: str = "pdstor", staging: bool = False) -> Self:
        """With staging, loads into it are checked as a reader copies them
        out (Reader.scatter, get_many's into): one pass over the bytes."""
    @property
    def staging(self) -> bool: ...
    @staticmethod
    def shared_file(path: str | os.PathLike[str], size: int | None = None) -> Buffer:
        """This process's own shared-memory file (/dev/shm/<name>, LMCache's
        pool with shm_name) as a buffer, no copy; the daemon reaches it
        through the file, so shrinking it fails a transfer, not the daemon."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def write(self, offset: int, data: _BufferLike) -> None:
        """Copies data (bytes, a numpy array, a memoryview…) in at offset."""
    def read_into(self, offset: int, dest: _BufferLike) -> None:
        """Copies len(dest) bytes at offset into dest (writable, contiguous)."""
    def read(self, offset: int, len: int) -> bytes:
        """Copies len bytes at offset out."""
    def copy_out(self, offset: int, len: int, pieces: Iterable[tuple[int, _BufferLike]]) -> int:
        """Copies each (at, dest) piece out of the len bytes at offset and
        answers the crc32c of all of them, reading each byte once."""
    def crc32c(self, offset: int, len: int) -> int:
        """crc32c of len bytes at offset, computed in place."""

@final
class Receipt:
    """A signed receipt: READY (publish, lookup) or a claim (claim)."""

    @staticmethod
    def from_json(text: str) -> Receipt: ...
    def to_json(self) -> str: ...
    @property
    def kind(self) -> Literal["READY", "CLAIM"]: ...
    @property
    def publication(self) -> int: ...
    @property
    def req_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def namespace(self) -> str: ...
    @property
    def manifest_digest(self) -> str: ...
    @property
    def reader(self) -> str | None: ...
    @property
    def session(self) -> str | None: ...

@final
class Client:
    """A connection to one `pdstor serve`: control plane and data socket."""

    def __new__(
        cls, server: str = "unix:/run/pdstor/control.sock", data_socket: str = "/run/pdstor/data.sock"
    ) -> Self: ...
    def healthz(self) -> None: ...
    def metrics(self) -> str: ...
    def register(self, buffer: Buffer) -> None: ...
    def namespace(self) -> dict[str, Any]: ...
    def publications(self, state: str | None = None, verbose: bool = False) -> list[dict[str, Any]]: ...
    def lookup(self, req_ids: Sequence[str]) -> list[Receipt | None]: ...
    def release(self, receipt: Receipt) -> None: ...
    def close_session(self, receipt: Receipt) -> None:
        """Closes the reader session a claim or read receipt names: its
        claims become reclaimable, its reads end."""
    def reclaim(self, receipt: Receipt) -> None:
        """Frees a fenced claim's slots (its session closed, or from an earlier epoch)."""
    def reclaim_publication(self, publication: int, reason: str) -> None:
        """An admin reclaims a publication whose reader is gone: its session
        closed first, then its claim reclaimed."""
    def end_reads(self, publication: int, reason: str) -> int:
        """An admin ends every read of a cache publication; how many."""
    def cancel(self, req_id: str) -> str: ...

@final
class Writer:
    """The prefill side of one publication at a time."""

    def __new__(cls, client: Client, writer_id: str = "python") -> Self: ...
    @property
    def publication(self) -> int | None: ...
    def prepare(
        self,
        req_id: str,
        layout: _Layout,
        total_chunks: int,
        timeout_ms: int | None = None,
        unread_release_ms: int | None = None,
        cache: bool = False,
    ) -> int: ...
    def store(self, chunks: Iterable[tuple[int, Buffer, int, int]], last: bool = False) -> None: ...
    def publish(self, first_token: int | None = None) -> Receipt: ...
    def abort(self) -> str: ...
    def handoff(self) -> str:
        """The open publication as a token for Writer.resume in another
        process of the same engine; it carries the writer's secret token."""
    @staticmethod
    def resume(client: Client, handoff: str, writer_id: str = "python") -> Writer:
        """A writer holding the publication another writer handed off."""
    @staticmethod
    def publish_many(client: Client, items: Sequence[tuple[str, int | None]]) -> list[Receipt | Error]:
        """Each `(handoff, first_token)` published, in one round trip and one commit."""
    @staticmethod
    def store_many(
        client: Client, items: Iterable[tuple[str, Iterable[tuple[int, Buffer, int, int]], bool]]
    ) -> list[Error | None]:
        """A store of each `(handoff, chunks, last)`, in one data-plane frame;
        a refused one's publication is rolled back."""
    def put(
        self,
        req_id: str,
        layout: _Layout,
        chunks: Iterable[tuple[Buffer, int, int]],
        batch: int = 16,
        first_token: int | None = None,
        timeout_ms: int | None = None,
    ) -> Receipt: ...
    def put_many(
        self,
        items: Sequence[tuple[str, Sequence[tuple[Buffer, int, int]]]],
        layout: _Layout,
        first_token: int | None = None,
        timeout_ms: int | None = None,
        cache: bool = False,
        unread_release_ms: int | None = None,
    ) -> list[Receipt | Error]: ...

@final
class Reader:
    """The decode side: claim → adopt → load (verified in place) → ack, or get.

    verify="daemon" takes each chunk's crc32c as the daemon computed it in
    place in this process's buffer (checked against the manifest);
    verify="local" checksums every chunk in this process as well."""

    def __new__(
        cls, client: Client, reader_id: str = "python", session: str | None = None, verify: str = "daemon"
    ) -> Self: ...
    @property
    def session(self) -> str: ...
    def claim(self, ready: Receipt, lease_ms: int = 60000, layout: _Layout | None = None) -> Receipt: ...
    def claim_many(
        self, readies: Sequence[Receipt], lease_ms: int = 60000, layout: _Layout | None = None
    ) -> list[Receipt | Error]: ...
    def adopt(self, claim: Receipt, layout: _Layout) -> dict[str, Any]: ...
    def load(self, claim: Receipt, chunks: Iterable[tuple[int, Buffer, int]]) -> None: ...
    def scatter(self, claim: Receipt, index: int, pieces: Iterable[tuple[int, _BufferLike]]) -> None:
        """Copies chunk index, loaded into a staging buffer, out: each
        (at, dest) takes len(dest) bytes from at within the chunk; the whole
        chunk is checked against the manifest in the same pass."""
    def ack(self, claim: Receipt) -> None: ...
    def read(self, ready: Receipt, layout: _Layout | None = None) -> Receipt: ...
    def end_read(self, read: Receipt) -> None: ...
    def abandon_read(self, read: Receipt, reason: str) -> None: ...
    def read_many(self, readies: Sequence[Receipt | str], layout: _Layout | None = None) -> list[Receipt | Error]:
        """Each READY cache publication read — by its receipt, or by its name
        (found READY by the daemon in the same step) — the read held, in one
        round trip."""
    def finish_reads(
        self,
        items: Sequence[tuple[Receipt, Buffer, int]],
        into: Callable[[dict[str, Any]], _BufferLike] | None = None,
    ) -> list[dict[str, Any] | Error]:
        """Each held read loaded (and with into copied on, checked in the
        copy) and ended: done once restored, abandoned if not."""
    def abandon_reads(self, reads: Sequence[Receipt], reason: str) -> list[None | Error]: ...
    def manifest(self, receipt: Receipt) -> dict[str, Any]:
        """The manifest of a claim this reader adopted, or of a read it holds."""
    def fail(self, claim: Receipt, reason: str) -> None: ...
    def get(
        self, ready: Receipt, layout: _Layout, buffer: Buffer, offset: int = 0, lease_ms: int = 60000
    ) -> dict[str, Any]: ...
    @overload
    def get_many(
        self,
        items: Sequence[tuple[Receipt, Buffer, int]],
        layout: _Layout,
        lease_ms: int = 60000,
        *,
        into: Callable[[dict[str, Any]], _BufferLike] | None = None,
        cache: bool = False,
    ) -> list[dict[str, Any] | Error]:
        """With into: each item copied on into into(manifest) (exactly its
        bytes), every chunk checked in that copy, before the ack."""
    @overload
    def get_many(
        self,
        items: Sequence[Receipt],
        layout: _Layout,
        lease_ms: int = 60000,
        *,
        place: Callable[[dict[str, Any]], tuple[Buffer, int]],
        cache: bool = False,
    ) -> list[dict[str, Any] | Error]:
        """With place: each adopted item goes where place(manifest) says."""
    @overload
    def get_many(
        self,
        items: Sequence[Receipt],
        layout: _Layout,
        lease_ms: int = 60000,
        *,
        place_many: Callable[[list[dict[str, Any] | None]], Sequence[tuple[Buffer, int] | BaseException | None]],
        cache: bool = False,
    ) -> list[dict[str, Any] | Error]:
        """With place_many: every item placed in one call (a batched
        allocation), given each item's manifest (None where not adopted)."""

@final
class Timeline:
    """This process's lines of the causal timeline (`pdstor timeline check`
    reads them beside the daemon's): appended to `path` as `node`."""

    def __new__(cls, path: str | os.PathLike[str], node: str) -> Self: ...
    @property
    def node(self) -> str: ...
    def emit(
        self,
        event: str,
        *,
        receipt: Receipt | None = None,
        req_id: str | None = None,
        publication: int | None = None,
        token: int | None = None,
        tokens: Sequence[int] | None = None,
        detail: str | None = None,
    ) -> int:
        """Appends one line; answers its seq."""

def refusal_codes() -> list[tuple[str, int]]: ...
def version() -> str: ...
