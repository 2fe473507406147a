"""The cache's core: what every manager is composed of.

* :mod:`kvblocks.core.groups`: the layer-group kinds (their rules, a registry) and the group managers
  beside full attention (local, recurrent, cross-attention) with their index and hit rules.
* :mod:`kvblocks.core.coordinator`: the groups beside full attention and the rules that span them.
* :mod:`kvblocks.core.sequence`, :mod:`~kvblocks.core.timed_tree`, :mod:`~kvblocks.core.step`,
  :mod:`~kvblocks.core.integrity`: a sequence's state, the device tree that records lifetimes, the batched
  step and the manager's integrity checks, which :class:`~kvblocks.manager.KVCacheManager` calls.

The pool, prefix tree and manager move here as the composed manager lands (see docs/architecture.md).
"""
