"""Run a Hugging Face transformers CausalLM on kvblocks' paged KV cache (``pip install "kvblocks[transformers]"``).

:class:`PagedGenerator` serves greedy generation the way an engine does: continuous batching
(every step is one forward pass over the running sequences' new tokens -- prefill chunks and
decode tokens packed into one row, positions given explicitly), prefix caching across requests
and across calls, and preemption with recomputation when the pool runs short::

    step     packed tokens (positions)           what each sequence does
    1        a0..a5 | b0..b3                      a and b prefill (b hit 4 cached tokens: b4..b7 run)
    2        a6 | b8 | c4..c9                     a and b decode, c is admitted and prefills

The model's attention modules call the attention function registered here as ``"kvblocks"``
(transformers' ``AttentionInterface``): it writes the step's new K/V into their slots of a
kvblocks ``KVCache`` and attends over each sequence's context read back through its block
table -- the step's tensors from :class:`~kvblocks.attention.StepMetadataBuilder`, the K/V
through :func:`~kvblocks.attention.write_kv` and :func:`~kvblocks.attention.gather_kv`. The step
reaches it through a context variable set around the forward pass, so families whose modules
drop extra keyword arguments (GPT-2, GPT-BigCode) work as the others. Everything else --
projections, rotary or learned position embeddings, q/k norms, biases, GQA/MQA, the MLP -- stays
the model's own code, so the outputs are the model's.

Before serving a model the generator runs it once on three tokens with a probe in place of the
step: every layer must call the attention function once (with its ``layer_idx``), causal, with no
mask but a plain causal one, keys and values of one size, and the positions given. A model that
fails any of these is refused with one :class:`~kvblocks.errors.ConfigError` line naming its
class (GPT-J, GPT-Neo, Falcon, Bloom: their attention does not go through the interface).

Layers follow the config: full attention, or a sliding window (Mistral's ``sliding_window``,
``layer_types`` of Qwen2/Qwen3/Gemma-like models). A model whose layers all share one kind keeps
one cache (every block kept; the window is applied when attending); a model mixing full and
sliding layers gets a :class:`~kvblocks.hybrid.HybridKVCacheManager` with a sliding-window
group whose blocks are released once no later token attends to them. Other layer kinds (linear
attention, chunked attention) and encoder-decoder models are refused with
:class:`~kvblocks.errors.ConfigError`.

With ``tiers=TierConfig(...)`` (models whose layers are all of one kind) the manager is a
:class:`~kvblocks.tiers.TieredKVCacheManager`: every step runs its copies with a
:class:`~kvblocks.tiers.TransferExecutor` before the forward pass, and a request admitted with
host or storage hits joins the forward passes once its copies landed.
"""

from __future__ import annotations

from kvblocks.errors import MissingExtraError

try:
    import torch  # noqa: F401  (the modules below need both; one message names the extra)
    import transformers  # noqa: F401
except ImportError as missing:  # one message naming the extra, as every optional dependency gives
    raise MissingExtraError(
        "kvblocks.integrations.transformers needs torch and transformers", "transformers", str(missing)
    ) from missing

from kvblocks.integrations.transformers.attention import ATTENTION_NAME
from kvblocks.integrations.transformers.generator import PagedGenerator
from kvblocks.integrations.transformers.inspection import entry_format

__all__ = ["ATTENTION_NAME", "PagedGenerator", "entry_format"]
