"""The cache's core: what every manager is composed of.

* :mod:`kvblocks.core.groups`: the layer-group kinds (their rules, a registry) and the group managers
  beside full attention (local, recurrent, cross-attention) with their index and hit rules.
* :mod:`kvblocks.core.coordinator`: the groups beside full attention and the rules that span them.
* :mod:`kvblocks.core.sequence`, :mod:`~kvblocks.core.step`: a sequence's state and the batched step.
* :mod:`kvblocks.core.pool`, :mod:`~kvblocks.core.prefix_tree`, :mod:`~kvblocks.core.eviction`: block ids and
  their references, hash -> block, and which idle block goes next.
* :mod:`kvblocks.core.manager` and its parts (admission, coordinator, role): the one manager
  (docs/architecture.md).
"""
