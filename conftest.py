"""Collection rules for the whole repository (pytest collects kvblocks/ too, for its doctests)."""

from __future__ import annotations

import importlib.util

# The optional integrations import their library at module level: without it installed, their doctests
# cannot be collected (the tests under tests/ skip themselves with importorskip).
collect_ignore = [] if importlib.util.find_spec("transformers") else ["kvblocks/integrations/transformers"]
if importlib.util.find_spec("vllm") is None:
    collect_ignore += ["kvblocks/integrations/vllm/connector.py", "kvblocks/integrations/vllm/stats.py"]
if importlib.util.find_spec("sglang") is None:
    collect_ignore += ["kvblocks/integrations/sglang/backend.py"]

# A module's previous path, kept one release, is the moved module itself (it replaces itself in sys.modules):
# its doctests run at the new path.
collect_ignore += [
    "kvblocks/pool.py",
    "kvblocks/radix.py",
    "kvblocks/eviction.py",
    "kvblocks/hybrid/layout.py",
    "kvblocks/hybrid/presets.py",
    "kvblocks/hybrid/tensors.py",
]

# A hot module running compiled is an extension module: pytest cannot collect the doctests of its source (the
# module it imports is not that file). CI runs those doctests under KVBLOCKS_PURE_PYTHON=1.
from kvblocks import native  # noqa: E402

collect_ignore += [f"{name.replace('.', '/')}.py" for name in native.status().compiled]
