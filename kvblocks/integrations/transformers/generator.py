"""PagedGenerator: greedy generation for a transformers CausalLM, continuous batching over kvblocks blocks."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvblocks.attention import StepMetadataBuilder
from kvblocks.backends import get_backend
from kvblocks.backends.cache import KVCache
from kvblocks.core.groups.local_group import LocalGroup
from kvblocks.core.manager import KVCacheManager
from kvblocks.errors import ConfigError, InvalidArgumentError, InvalidTokenError
from kvblocks.hashing import DEFAULT_SCHEME
from kvblocks.integrations.transformers.attention import Step, kvblocks_attention, step_scope
from kvblocks.integrations.transformers.inspection import model_layout
from kvblocks.integrations.transformers.layout import FULL_GROUP
from kvblocks.tiers import EntryFormat, TierConfig
from kvblocks.tiers.executor import TransferExecutor


@dataclass(eq=False)
class _Request:
    seq_id: tuple[str, int]
    tokens: list[int]
    max_new_tokens: int
    prompt_length: int
    computed: int = 0  # tokens whose K/V the forward passes wrote (the next one to compute)
    known: int = 0  # tokens the manager holds for it (the newest sampled token may not be there yet)
    registered: bool = False
    pending: bool = False  # admitted with host/storage hits whose copies have not landed yet
    granted: int = 0  # the chunk its admission allocated (run once it is ready)
    probe_deadline: float = 0.0  # until when admission waits for its storage check
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens


StepHook = Callable[["PagedGenerator"], None]


class PagedGenerator:
    """Greedy generation for a transformers CausalLM, its K/V in kvblocks blocks.

    ``num_blocks`` blocks of ``block_size`` tokens; ``max_running`` sequences and
    ``max_batch_tokens`` new tokens per forward pass at most (a longer prompt is prefilled in
    chunks); ``window_blocks`` sizes the sliding-window group's pool of a model mixing full and
    sliding layers (default ``num_blocks``). ``after_step(generator)`` runs after every step.
    The model keeps its own attention implementation outside :meth:`generate`.

    ``tiers`` puts a host tier and/or a storage tier under the device pool (a
    manager's ``tiers``; its ``entry_format`` must be
    :func:`entry_format` of the model). ``namespace`` names the key space of stored entries:
    generators of different models sharing a storage directory need different namespaces.
    A generator with a storage tier owns its threads: :meth:`close` it (or use ``with``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int = 16,
        *,
        max_running: int = 64,
        max_batch_tokens: int = 512,
        window_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        after_step: StepHook | None = None,
        tiers: TierConfig | None = None,
        namespace: str = "default",
    ) -> None:
        for name, value in (("max_running", max_running), ("max_batch_tokens", max_batch_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        self.layout = model_layout(model)  # refuses a model its attention cannot serve, naming the class
        self.model = model
        self._config: Any = model.config
        self.device = next(model.parameters()).device
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.after_step = after_step
        self.vocab_size: int = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
        self._check_tiers(tiers, block_size)
        self.manager = self._manager(num_blocks, block_size, window_blocks, enable_prefix_caching, tiers, namespace)
        backend = get_backend(str(self.device))
        self.caches: list[KVCache] = [
            backend.allocate(self.layout.spec(g, block_size), self._group_blocks(g)) for g in self.layout.groups
        ]
        self._executor = self._transfer_executor(backend, block_size)
        self.computed_tokens = 0
        """Tokens the forward passes computed so far (prefix-cache hits are not computed)."""
        self.last_logits: list[torch.Tensor] = []
        """Per prompt of the last :meth:`generate` call: the logits each new token was picked from."""
        self._ids = itertools.count()
        self._builder = StepMetadataBuilder(self.manager, self.device)

    def _check_tiers(self, tiers: TierConfig | None, block_size: int) -> None:
        """Tiers serve models with one kind of layer, with the model's own entry format; else a ConfigError."""
        if tiers is None:
            return
        if not isinstance(tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        if self.layout.hybrid:
            raise ConfigError(
                "PagedGenerator serves tiers for models whose layers are all of one kind; this one mixes full "
                "and sliding-window layers (a hybrid manager's plan.group_transfers are not run yet)"
            )
        expected = EntryFormat.for_spec(self.layout.spec(FULL_GROUP, block_size), DEFAULT_SCHEME)
        if tiers.storage is not None and tiers.entry_format != expected:
            raise ConfigError(
                f"tiers.entry_format {tiers.entry_format!r} does not describe this model's blocks; "
                f"use entry_format(model, block_size={block_size}): {expected!r}"
            )

    def _manager(
        self,
        num_blocks: int,
        block_size: int,
        window_blocks: int | None,
        caching: bool,
        tiers: TierConfig | None,
        namespace: str,
    ) -> KVCacheManager:
        layout = self.layout
        groups: list[LocalGroup] = []
        if layout.hybrid:
            window = layout.window
            if window is None:  # pragma: no cover - hybrid means a window exists
                raise ConfigError("a hybrid layout needs a sliding window")
            groups.append(LocalGroup("sliding_window", span=window, num_blocks=window_blocks or num_blocks))
        return KVCacheManager(
            num_blocks, block_size, namespace=namespace, enable_prefix_caching=caching, tiers=tiers, groups=groups
        )

    def _transfer_executor(self, backend: Any, block_size: int) -> TransferExecutor | None:
        """The executor that runs a tiered manager's copies between the device cache and a host cache."""
        manager = self.manager
        if manager.tiers is None:
            return None
        host = None
        if manager.host is not None:
            spec = self.layout.spec(FULL_GROUP, block_size)
            host = get_backend("cpu").allocate(spec, manager.host.pool.num_blocks)
        return TransferExecutor(manager, backend, self.caches[FULL_GROUP], host)

    def _group_blocks(self, group: int) -> int:
        return self.manager.group_pool(group).num_blocks

    # ------------------------------------------------------------------ public

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16) -> list[list[int]]:
        """The ``max_new_tokens`` greedy tokens after each prompt (no stop token), in prompt order."""
        requests = self._requests(prompts, max_new_tokens)
        waiting: deque[_Request] = deque(requests)
        running: list[_Request] = []
        try:
            self._probe(requests)
            with torch.inference_mode(), kvblocks_attention(self._config):
                while waiting or running:
                    chunks = self._schedule(running, waiting)
                    self._transfer(running, chunks)
                    if not self._forward(running, chunks):
                        time.sleep(0.0005)  # waiting on a storage check or read (bounded by its timeout)
                    if self.after_step is not None:
                        self.after_step(self)
        finally:
            for request in requests:  # an error mid-way: give every block back
                if request.registered:
                    self.manager.free(request.seq_id)
            self._drain()
        self.last_logits = [torch.stack(r.logits) for r in requests]
        return [r.tokens[r.prompt_length :] for r in requests]

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until queued storage writes reached storage (True if they did; no storage tier: True)."""
        return self.manager.flush(timeout)

    def close(self) -> None:
        """Stop a storage tier's threads (queued writes get a bounded time to finish) and close its backend."""
        self.manager.close()

    def __enter__(self) -> PagedGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ input

    def _requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[_Request]:
        """Checked requests; any bad input raises before a block or a forward pass is spent."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgumentError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        checked = [self._prompt(i, prompt, max_new_tokens) for i, prompt in enumerate(prompts)]
        return [_Request(("kvblocks-generate", next(self._ids)), p, max_new_tokens, len(p)) for p in checked]

    def _prompt(self, number: int, prompt: object, max_new_tokens: int) -> list[int]:
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise InvalidArgumentError(f"prompt {number} must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidTokenError(f"prompt {number} is empty; a prompt needs at least one token")
        tokens = list(prompt)
        for position, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidTokenError(f"prompt {number}, position {position}: {token!r} is not a token id")
            if not 0 <= token < self.vocab_size:
                raise InvalidTokenError(
                    f"prompt {number}, position {position}: token {token} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        need = math.ceil((len(tokens) + max_new_tokens - 1) / self.manager.block_size)
        if need > self.manager.num_blocks:
            raise ConfigError(
                f"prompt {number} needs {need} blocks with its new tokens; the pool has {self.manager.num_blocks}"
            )
        return tokens

    # ------------------------------------------------------------------ scheduling

    def _schedule(self, running: list[_Request], waiting: deque[_Request]) -> dict[int, int]:
        """Slots for this step: the running sequences' next chunks (one ``step`` call), then admissions.

        Returns the number of new tokens per request (by ``id``). A sequence that cannot grow
        preempts the newest running one (which is recomputed later) until it can.
        """
        budget = self.max_batch_tokens - sum(r.granted for r in running if r.pending)
        chunks: dict[int, int] = {}
        for request in running:
            if not request.pending:
                chunks[id(request)] = n = min(len(request.tokens) - request.computed, max(budget, 0))
                budget -= n
        self._grow(running, waiting, chunks)
        if self._admit_waiting(running, waiting, chunks) or running:
            return chunks
        if self._executor is not None:  # blocks held for a preemption snapshot are freed once its plan ran
            self._executor.step()
            if self._admit_waiting(running, waiting, chunks) or running:
                return chunks
        raise ConfigError("the pool cannot hold even one waiting request; give PagedGenerator more blocks")

    def _admit_waiting(self, running: list[_Request], waiting: deque[_Request], chunks: dict[int, int]) -> bool:
        """Admit waiting requests in order while they fit; True if the head waits for its storage check."""
        budget = self.max_batch_tokens - sum(chunks.values()) - sum(r.granted for r in running if r.pending)
        while waiting and len(running) < self.max_running and budget > 0:
            request = waiting[0]
            if self._probing(request):
                return True  # its storage check is still out: admit it (and those after it) later
            admitted = self._admit(request, budget)
            if admitted is None:
                break
            waiting.popleft()
            running.append(request)
            if not request.pending:
                chunks[id(request)] = admitted
            budget -= admitted
        return False

    def _grow(self, running: list[_Request], waiting: deque[_Request], chunks: dict[int, int]) -> None:
        """One ``manager.step`` for the running sequences: commit last step's tokens, append, grow."""
        pending = [r for r in running if not r.pending]  # a sequence whose copies are out cannot commit yet
        while pending:
            failed = set(
                self.manager.step(
                    [r.seq_id for r in pending],
                    [r.computed for r in pending],
                    [r.tokens[r.known :] for r in pending],
                    [chunks[id(r)] for r in pending],
                )
            )
            for request in pending:
                if request.seq_id not in failed:
                    request.known = len(request.tokens)
            pending = [r for r in pending if r.seq_id in failed]
            if pending:
                victim = running.pop()
                self._preempt(victim, waiting, chunks)
                pending = [r for r in pending if r is not victim]

    def _preempt(self, request: _Request, waiting: deque[_Request], chunks: dict[int, int]) -> None:
        self.manager.preempt(request.seq_id)
        request.computed = 0
        request.pending = False
        chunks.pop(id(request), None)
        waiting.appendleft(request)

    def _admit(self, request: _Request, budget: int) -> int | None:
        """Admit ``request`` with its cached prefix and a first chunk; None (nothing changed) if no room."""
        manager = self.manager
        if not request.registered:
            manager.add_sequence(request.seq_id, request.tokens)
            request.registered = True
        elif request.known < len(request.tokens):
            manager.append_tokens(request.seq_id, request.tokens[request.known :])
        request.known = len(request.tokens)
        hit = manager.lookup(request.seq_id).total  # device, host and storage hits alike
        n = min(len(request.tokens) - hit, budget)
        if manager.allocate(request.seq_id, n, num_cached_tokens=hit) is None:
            return None
        request.computed = hit
        request.pending = not manager.is_ready(request.seq_id)
        request.granted = n if request.pending else 0
        return n

    # ------------------------------------------------------------------ tiers

    def _probe(self, requests: list[_Request]) -> None:
        """With a storage tier, register every request up front: its storage check runs while others compute."""
        manager = self.manager
        if manager.storage is None or manager.tiers is None:
            return
        deadline = time.monotonic() + manager.tiers.storage_timeout_s
        for request in requests:
            manager.add_sequence(request.seq_id, request.tokens)
            request.registered = True
            request.known = len(request.tokens)
            request.probe_deadline = deadline

    def _probing(self, request: _Request) -> bool:
        """Whether admission should wait for the request's storage check (else stored blocks would be recomputed)."""
        manager = self.manager
        return (
            manager.tiers is not None
            and request.registered
            and time.monotonic() < request.probe_deadline
            and manager.is_storage_check_pending(request.seq_id)
        )

    def _transfer(self, running: list[_Request], chunks: dict[int, int]) -> None:
        """Run the step's copies (saves, swap-outs, swap-ins), write finished storage reads, release the
        admissions whose copies all landed. A short read cut the table back: that request computes the rest,
        allocated by the next step."""
        executor = self._executor
        if executor is None:
            return
        executor.step()
        manager = executor.manager
        for request in running:
            if request.pending and manager.is_ready(request.seq_id):
                request.pending = False
                usable = manager.num_computed_tokens(request.seq_id)
                if usable == request.computed:
                    chunks[id(request)] = request.granted
                request.computed = usable
                request.granted = 0

    def _drain(self) -> None:
        """Run what the last commits and frees planned (write-through saves, deferred releases), then wait for the
        storage writes, so that a generator started next on the same directory finds them."""
        manager = self.manager
        if self._executor is None:
            return
        self._executor.run(manager.take_transfers())
        self.flush()

    # ------------------------------------------------------------------ forward

    def _forward(self, running: list[_Request], chunks: dict[int, int]) -> bool:
        """One forward pass over every scheduled chunk; sample where a sequence caught up; retire finished ones.

        False if nothing was scheduled (every request waits on copies or storage checks)."""
        batch = [r for r in running if chunks.get(id(r), 0) > 0]
        if not batch:
            return False
        counts = [chunks[id(r)] for r in batch]
        starts = [r.computed for r in batch]
        meta = self._builder.build([r.seq_id for r in batch], counts)
        query_starts = list(itertools.accumulate(counts, initial=0))
        step = Step(self.layout, self.caches, meta, starts, query_starts)
        tokens = [t for r, s, n in zip(batch, starts, counts) for t in r.tokens[s : s + n]]
        with step_scope(step):
            output = self.model(
                input_ids=torch.tensor([tokens], device=self.device),
                position_ids=meta.positions.unsqueeze(0),
                use_cache=False,
            )
        logits = output.logits[0]
        self.computed_tokens += len(tokens)
        for request, n, end in zip(batch, counts, query_starts[1:]):
            request.computed += n
            if request.computed == len(request.tokens):
                row = logits[end - 1].float()
                request.logits.append(row)
                request.tokens.append(int(row.argmax()))
                if request.done:
                    self.manager.commit(request.seq_id, request.computed)
                    self.manager.free(request.seq_id)
                    request.registered = False
                    running.remove(request)
        return True
