"""The cache's core: what every manager is composed of.

Today it holds the group kinds (:mod:`kvblocks.core.groups`): what each kind of layer group
(full attention, sliding window, chunked local, recurrent state, cross-attention) needs for a
prefix hit and which blocks a running sequence of that kind needs and may release. The pool,
prefix tree, sequence state, coordinator and manager move here as the composed manager lands
(see docs/architecture.md).
"""
