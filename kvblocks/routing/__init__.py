"""Cache-aware routing: pick the worker whose cache holds most of the prompt, weighed against its load.

:class:`Router` keeps, per worker, which blocks it caches (fed by the worker's KV events, or by the prompts
routed to it) and its load, and routes each prompt to the cheapest worker with a :class:`Lease` that gives
back every counter it took exactly once. The cost model and the walk are described in
:mod:`kvblocks.routing.router`; ``docs/routing.md`` is the guide.

The package, by job:

* :mod:`kvblocks.routing.router` -- :class:`Router`: workers, KV events in, routes out, health;
* :mod:`kvblocks.routing.config` -- :class:`RouterConfig` (validated once), the tiers and hash forms;
* :mod:`kvblocks.routing.workers` -- per-worker state, :class:`WorkerLoad` and :class:`Lease`;
* :mod:`kvblocks.routing.holders` -- which workers hold which blocks in which tier, tier-weighted overlaps;
* :mod:`kvblocks.routing.holder_index` -- the inverted index under it (:class:`HolderIndex`): its updates
  and integrity check, over :mod:`~kvblocks.routing.table` (rows and their secret placement),
  :mod:`~kvblocks.routing.interned` (shared masks and kid vectors) and :mod:`~kvblocks.routing.walk`
  (a prompt's leading run per worker in O(log n) probes).

The whole package logs on the ``kvblocks.routing`` logger.

>>> from kvblocks.routing import Router, RouterConfig
>>> router = Router(["w0", "w1"], RouterConfig(block_size=4))
>>> with router.route(list(range(16))) as lease:
...     lease.worker
'w0'
"""

from kvblocks.routing.config import HASH_FORMS as HASH_FORMS
from kvblocks.routing.config import TIERS as TIERS
from kvblocks.routing.config import RouterConfig
from kvblocks.routing.holder_index import HolderIndex as HolderIndex
from kvblocks.routing.router import NoWorkerError, Router
from kvblocks.routing.workers import Lease, WorkerLoad

__all__ = ["Lease", "NoWorkerError", "Router", "RouterConfig", "WorkerLoad"]
