"""The manager's lifecycle state machine (tests/core/test_manager_state_machine.py) with S3-FIFO eviction."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from kvblocks import KVCacheManager

from .test_manager_state_machine import BLOCK, POOL, RESERVE, ManagerMachine


class S3FIFOManagerMachine(ManagerMachine):
    """Every rule and invariant of the LRU machine, on managers that evict with S3-FIFO."""

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(num_blocks=POOL, block_size=BLOCK, reserved_blocks=RESERVE, eviction="s3fifo")
        self.p = KVCacheManager(num_blocks=POOL, block_size=BLOCK, reserved_blocks=RESERVE, eviction="s3fifo")
        self.ms = (self.m, self.p)


S3FIFOManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestS3FIFOManagerMachine = S3FIFOManagerMachine.TestCase
