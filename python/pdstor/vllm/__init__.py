"""Storage P/D for vLLM: ``PdstorConnector``, a ``KVConnectorBase_V1`` that
hands a request's KV cache from a prefill engine to a decode engine through
``pdstor serve``, running the ownership protocol per request.

Loaded by vLLM's own configuration::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PdstorConnector",
        "kv_connector_module_path": "pdstor.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"server": "unix:/run/pdstor/control.sock",
                                      "data_socket": "/run/pdstor/data.sock"}}'

The prefill engine (``kv_producer``) answers each request with
``kv_transfer_params = {"pdstor": {"req", "prompt_tokens", "prompt_digest",
"first_token"}}`` as soon as its first token is sampled, and publishes READY
once every chunk is durable; a proxy sends the original request with those
params to the decode engine (``kv_consumer``), which finds the publication
READY by name, claims, adopts, loads, verifies and acknowledges in the
background while it steps its other requests, then decodes. Nothing waits
for the daemon on vLLM's engine thread. A handoff that cannot be restored
fails the request through vLLM's load-error path (``kv_load_failure_policy``,
default ``"fail"``). See docs/vllm.md.

``kv_connector_extra_config``:

- ``server``, ``data_socket``: the daemon's sockets (defaults
  ``unix:/run/pdstor/control.sock``, ``/run/pdstor/data.sock``); checked
  when the engine starts — a daemon that does not answer fails the start;
- ``writer_id``, ``reader_id``: recorded with publications and claims
  (default ``vllm``);
- ``lease_ms``: a claim's lease (default 60000);
- ``admission_timeout_s``: how long a request waits for room to be stored
  before it is prefilled without a handoff (its params then carry
  ``error``; default 30);
- ``ready_timeout_s``: how long a decode waits for a publication it names
  to become READY (default 30);
- ``unread_release_s``: a publication no decode claims this long after it
  is READY is released unread by the daemon — the exact unread release,
  counted, an ``expire`` on its timeline — so a decode that never comes (a
  proxy that crashed, a request abandoned) holds its slots a bounded time
  (default 480, vLLM's own bound on a prefill's unread blocks; 0 keeps
  them until released);
- ``staging_bytes``: the worker's registered staging buffer (default 64 MiB);
- ``model_identity``: names the weights instead of vLLM's config hash (a
  checkpoint digest, say);
- ``timeline``: a file this engine appends its timeline lines to (node
  ``vllm-scheduler-<engine_id>-<pid>-<6 hex>`` / ``vllm-worker-…``): schedule
  and the decode's continuation (scheduler); the publish, claim and ack
  echoes and restored (worker) —
  beside the daemon's ``--timeline``, ``pdstor timeline check`` verifies the
  run.
"""

from __future__ import annotations

from typing import Any

from ._identity import UnsupportedEngine
from ._scheduler import PARAMS

__all__ = ["PARAMS", "PdstorConnector", "UnsupportedEngine"]


def __getattr__(name: str) -> Any:
    # vLLM is imported with the connector only: the worker half and the
    # layouts (``_worker``, ``_paged``) run where vLLM is not installed (the
    # GPU bundle), and vLLM finds ``PdstorConnector`` by getattr all the same.
    if name == "PdstorConnector":
        from ._connector import PdstorConnector

        return PdstorConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
