"""``KVBlocksConnector`` with a step-by-step trace, for reading what a real engine did (issue 29's evidence).

Each half appends JSON lines to the file named by ``KVBLOCKS_CONNECTOR_TRACE``: the scheduler what it scheduled
(each request's computed and scheduled tokens and its block table) and planned (loads, saves, failures), the
worker what its loads found and what it saved. Blocks are named by their position in their request's chain
(``"r2:6"``: request r2's block 6), which is what a reader of the trace needs. vLLM loads connectors by module
path, so this lives in a module of its own; it is a test tool, never shipped.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvblocks.integrations.vllm.connector import KVBlocksConnector


class TracedConnector(KVBlocksConnector):
    """Writes a trace line per event (see the module docstring); otherwise exactly ``KVBlocksConnector``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trace_path = os.environ.get("KVBLOCKS_CONNECTOR_TRACE")
        self._step = 0
        self._names: dict[bytes, str] = {}

    def _emit(self, event: str, **fields: Any) -> None:
        if self._trace_path:
            with open(self._trace_path, "a") as f:
                f.write(json.dumps({"event": event, "side": "scheduler" if self._is_scheduler else "worker", **fields}))
                f.write("\n")

    def _name(self, h: Any) -> str:
        return self._names.get(bytes(h) if isinstance(h, bytes | bytearray) else h, "?")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        for i, h in enumerate(request.block_hashes):
            self._names.setdefault(bytes(h), f"{request.request_id}:{i}")
        tokens, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._emit("match", request=request.request_id, local=num_computed_tokens, external=tokens)
        return tokens, is_async

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        self._step += 1
        scheduled = []
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append(
                {
                    "request": new.req_id,
                    "new": True,
                    "computed": new.num_computed_tokens,
                    "tokens": scheduler_output.num_scheduled_tokens.get(new.req_id, 0),
                    "table": list(new.block_ids[0]),
                }
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            groups = cached.new_block_ids[i]
            scheduled.append(
                {
                    "request": request_id,
                    "new": False,
                    "computed": cached.num_computed_tokens[i],
                    "tokens": scheduler_output.num_scheduled_tokens.get(request_id, 0),
                    "new_blocks": list(groups[0]) if groups else [],
                }
            )
        plan = meta.plan

        def runs(items: Any) -> list[dict[str, Any]]:
            return [
                {"request": r.request_id, "blocks": list(r.block_ids), "names": [self._name(h) for h in r.hashes]}
                for r in items
            ]

        self._emit(
            "step",
            step=self._step,
            scheduled=scheduled,
            loads=runs(plan.loads),
            saves=runs(plan.saves),
            failed=list(plan.failed),
        )
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = sorted(getattr(connector_output, "invalid_block_ids", None) or ())
        if invalid:
            self._emit("invalid", step=self._step, blocks=invalid)
        super().update_connector_output(connector_output)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        before = self.stats.load_failed_blocks
        loaded = self.stats.load_blocks
        super().start_load_kv(forward_context, **kwargs)
        plan = self._plan()
        if plan is not None and (plan.loads or plan.failed):
            failed = sorted(self.worker._load_errors)
            self._emit(
                "loaded",
                loads=[list(r.block_ids) for r in plan.loads],
                ok=self.stats.load_blocks - loaded,
                failed_count=self.stats.load_failed_blocks - before,
                failed=failed,
            )

    def wait_for_save(self) -> None:
        saved = self.stats.save_blocks
        super().wait_for_save()
        plan = self._plan()
        if plan is not None and plan.saves:
            self._emit(
                "saved",
                planned=[list(r.block_ids) for r in plan.saves],
                saved=self.stats.save_blocks - saved,
            )
