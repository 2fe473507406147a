"""Collection rules for the whole repository (pytest collects kvblocks/ too, for its doctests)."""

from __future__ import annotations

import importlib.util

# The optional integrations import their library at module level: without it installed, their doctests
# cannot be collected (the tests under tests/ skip themselves with importorskip).
collect_ignore = [] if importlib.util.find_spec("transformers") else ["kvblocks/integrations/transformers"]
if importlib.util.find_spec("vllm") is None:
    collect_ignore += ["kvblocks/integrations/vllm/connector.py", "kvblocks/integrations/vllm/stats.py"]
