"""One vLLM engine in a process of its own: ``python -m tests.vllm_engine.engine_process SPEC.json OUT.json``.

Engines that share a store are separate processes in a real fleet; the fleet tests start one per engine so that
nothing (vLLM's process-wide worker connector, a tier's threads, the page cache's view of a file) is shared by
accident. ``SPEC.json`` names the model directory, the prompts, the sampling and the engine arguments::

    {"model": "/tmp/tiny-llama", "prompts": [[1, 2, ...], ...], "max_tokens": 8, "logprobs": 5,
     "engine": {"kv_transfer_config": {...}, ...}}

``OUT.json`` receives, per prompt, the generated token ids and the logprob of each chosen token, vLLM's
counters the tests read (``vllm:external_prefix_cache_hits``, ...), and -- where the engine has a
``KVBlocksConnector`` -- both halves' stats. Nothing here is imported by the main test environment.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the connector halves stay readable in-process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METRICS = (
    "vllm:external_prefix_cache_hits",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
)


def _connector_stats(llm: Any) -> dict[str, Any] | None:
    """Both connector halves' stats, where the engine core runs in this process (else None)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None or not has_kv_transfer_group():
        return None
    scheduler = core.scheduler.connector
    worker = get_kv_transfer_group()
    if not hasattr(worker, "tier"):
        return None
    flushed = all(tier.flush(60.0) for tier in worker.tiers)
    return {
        "flushed": flushed,
        "scheduler": vars(scheduler.stats),
        "worker": vars(worker.stats),
        "tier": vars(worker.tier.stats),
        "tiers": [vars(tier.stats) for tier in worker.tiers],  # one per KV cache group (hybrid models)
        "writer_dropped": sum(tier.writer.stats.dropped for tier in worker.tiers),
        "hybrid": scheduler.hybrid,
        "groups": [[group.kind, group.span, group.tag] for group in scheduler.groups],
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from tests.vllm_engine.engine import build_llm, metric, shutdown_llm

    llm = build_llm(Path(spec["model"]), **spec.get("engine", {}))
    try:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(spec.get("max_tokens", 8)),
            ignore_eos=True,
            detokenize=False,
            logprobs=int(spec.get("logprobs", 1)),
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        results = []
        for out in outs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            chosen = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens, strict=True)]
            results.append({"tokens": tokens, "logprobs": chosen})
        connector = _connector_stats(llm)  # flushes the writes first
        metrics = {name: metric(llm, name) for name in METRICS}
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        groups = core.scheduler.kv_cache_config.kv_cache_groups if core is not None else []
        for m in llm.get_metrics():  # the connector's counters in vLLM's metrics (vllm:kvblocks_*)
            if m.name.startswith("vllm:kvblocks_") and hasattr(m, "value"):
                metrics[m.name] = metrics.get(m.name, 0.0) + m.value
        kv_cache_groups = [type(group.kv_cache_spec).__name__ for group in groups]  # what vLLM's allocator made
        return {"outputs": results, "metrics": metrics, "connector": connector, "kv_cache_groups": kv_cache_groups}
    finally:
        shutdown_llm(llm)


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
