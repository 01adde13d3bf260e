"""pdstor from Python: hand a KV cache from a prefill process to a decode
process through NVMe storage, with signed receipts, leases that a timeout
never frees, and restores verified chunk by chunk.

The objects mirror ``pdstor::client``::

    import pdstor, torch

    client = pdstor.Client("unix:/run/pdstor/control.sock", "/run/pdstor/data.sock")
    buf = pdstor.Buffer(8 << 20)                        # a memfd the daemon reads and writes
    kv = torch.frombuffer(buf, dtype=torch.bfloat16)    # a view of it: no copy
    kv.copy_(prefill_kv.view(-1))
    receipt = pdstor.Writer(client).put("req-1", layout, [(buf, 0, len(buf))])
    # ... hand receipt.to_json() to the decode process, which does:
    pdstor.Reader(client).get(pdstor.Receipt.from_json(text), layout, buf)

Every blocking call releases the GIL. Refusals raise the classes of
:mod:`pdstor.errors` (``pdstor.AdmissionTimeout``, ``pdstor.LayoutMismatch``,
``pdstor.LoadFailed`` …), each carrying the daemon's ``code``, ``field`` and
``message``. The LMCache storage plugin is :class:`pdstor.lmcache.PdstorBackend`.
"""

from __future__ import annotations

from . import errors
from ._native import Buffer, Client, Reader, Receipt, Timeline, Writer, refusal_codes
from ._native import version as _native_version
from .errors import *  # noqa: F401,F403  (one exception class per refusal code)

__version__ = _native_version()


def layout(
    *,
    model_id: str,
    dtype: str,
    layers: int,
    kv_heads: int,
    head_dim: int,
    chunk_tokens: int,
    kv_format: str,
) -> dict:
    """A KV layout, as ``prepare`` records it and ``adopt`` checks it: a
    reader that expects another layout is refused (``pdstor.LayoutMismatch``)."""
    return {
        "model_id": model_id,
        "dtype": dtype,
        "layers": int(layers),
        "kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "chunk_tokens": int(chunk_tokens),
        "kv_format": kv_format,
    }


__all__ = [
    "Buffer",
    "Client",
    "Reader",
    "Receipt",
    "Timeline",
    "Writer",
    "errors",
    "layout",
    "refusal_codes",
    *errors.__all__,
]
