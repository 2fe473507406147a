"""A negative control for the connector tests: loads every hit, then overwrites it with zeros.

vLLM loads connectors by module path, so the control lives in a module of its own.
"""

from __future__ import annotations

from typing import Any

from kvblocks.integrations.vllm.connector import KVBlocksConnector


class ZeroingConnector(KVBlocksConnector):
    """What a connector that loaded the wrong KV would look like to vLLM: hits, but zeros in the blocks."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        plan = self._plan()
        if plan is None or self.blocks is None:
            return
        for run in plan.loads:
            self.blocks.write(run.block_ids, [bytes(self.blocks.bytes_per_block)] * len(run.block_ids))
