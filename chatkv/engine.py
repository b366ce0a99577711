"""Engine: tokenizer + model + paged KV pool + radix prefix cache + continuous-batching scheduler.

``Engine.from_pretrained(model=None, **config)`` loads a Hugging Face directory of
the Llama family (None = the packaged SmolLM2-135M-Instruct). ``generate`` runs
prompts to completion, batched together; ``stream`` yields text pieces and then
the ``GenerationResult``; ``step`` is the loop body for callers that drive
several requests themselves.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence as Seq

import torch

from chatkv.block_pool import BlockPool
from chatkv.config import EngineConfig
from chatkv.errors import InvalidRequest, ModelNotFound, OutOfBlocks
from chatkv.fingerprint import model_fingerprint
from chatkv.kernels import build_metadata
from chatkv.model import LlamaModel, load_config
from chatkv.radix_cache import RadixCache
from chatkv.sampling import SamplingParams, make_generator, sample
from chatkv.scheduler import Scheduler
from chatkv.sequence import Retained, Sequence, Status

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerationResult:
    """A finished request and what it cost."""

    request_id: int
    text: str
    token_ids: list[int]  # generated tokens (the stop token included when generation ended on one)
    finish_reason: str  # "stop" | "length" | "aborted"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was already in memory (prefix hit)
    restored_tokens: int  # prompt tokens whose KV was loaded from disk for this request
    computed_tokens: int  # prompt tokens computed before the first generated token
    generated_tokens: int
    ttft_s: float  # time to first token
    decode_tokens_per_s: float  # generated tokens after the first, per second
    preemptions: int


def result_of(seq: Sequence) -> GenerationResult:
    first = seq.first_token_time or seq.finish_time or time.perf_counter()
    end = seq.finish_time or time.perf_counter()
    decode_s = end - first
    return GenerationResult(
        request_id=seq.seq_id,
        text=seq.text,
        token_ids=seq.generated_ids,
        finish_reason=seq.finish_reason or "aborted",
        prompt_tokens=seq.num_prompt_tokens,
        cached_tokens=max(seq.num_cached, 0),
        restored_tokens=seq.num_restored,
        computed_tokens=seq.num_prefilled,
        generated_tokens=seq.num_generated,
        ttft_s=first - seq.arrival,
        decode_tokens_per_s=(seq.num_generated - 1) / decode_s if seq.num_generated > 1 and decode_s > 0 else 0.0,
        preemptions=seq.preemptions,
    )


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        from transformers import AutoTokenizer

        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        hf_config = load_config(self.model_dir)  # raises ModelNotFound / UnsupportedModel first
        dtype = None if self.config.dtype == "auto" else _DTYPES.get(self.config.dtype)
        if self.config.dtype != "auto" and dtype is None:
            raise InvalidRequest(f"dtype '{self.config.dtype}' unknown; use auto or one of {sorted(_DTYPES)}")
        self.model = LlamaModel.from_pretrained(self.model_dir, dtype=dtype, device=self.config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.fingerprint = model_fingerprint(self.model_dir, self.config.data_dir or os.environ.get("CHATKV_HOME"))
        self.kv_dtype = str(self.model.dtype).removeprefix("torch.")
        self.namespace = (self.fingerprint, self.kv_dtype, self.config.tenant)
        bs = self.config.block_size
        num_blocks = self.config.num_blocks or max(2, self.config.kv_cache_bytes // (self.model.kv_bytes_per_token * bs))
        self.pool = BlockPool(
            num_blocks, bs, self.model.num_layers, self.model.num_kv_heads, self.model.head_dim,
            dtype=self.model.dtype, device=self.config.device,
        )
        self.cache = RadixCache(self.pool)
        self.scheduler = Scheduler(self.pool, self.cache, self.config.max_batch_tokens, self.config.max_running)
        self.max_context = int(getattr(hf_config, "max_position_embeddings", 2048))
        self.eos_ids = self._eos_ids()
        self._ids = itertools.count()
        self._sessions = None

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, **config) -> "Engine":
        """Load ``model`` (a local Hugging Face directory; None = the packaged default chat model)."""
        cfg = EngineConfig.from_kwargs(**config)
        if model is None:
            from chatkv.gguf_convert import ensure_default_model

            model = ensure_default_model()
        elif not Path(model).exists():
            raise ModelNotFound(f"model path '{model}' does not exist (chatkv never downloads weights)")
        return cls(model, cfg)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            import json

            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(ids)

    # -- requests -----------------------------------------------------------

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template."""
        if not messages:
            raise InvalidRequest("messages is empty")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def _to_ids(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidRequest("prompt is empty")
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("prompt is empty")
        vocab = self.model.embed.shape[0]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        return ids

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        retain: bool = False,
        prefix: Retained | None = None,
    ) -> Sequence:
        """Queue one request; it runs on the next ``step`` calls. Validates before queueing.

        ``retain`` keeps the finished sequence's KV locked (``seq.retained``) for a next
        turn; ``prefix`` hands such retained KV to this request, which releases it once
        admitted (sessions use both).
        """
        params = params or SamplingParams()
        params.validate()
        ids = self._to_ids(prompt)
        if len(ids) >= self.max_context:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}")
        pool_tokens = self.pool.num_blocks * self.pool.block_size
        if len(ids) + 1 > pool_tokens:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; the KV pool can hold at most {pool_tokens} "
                f"({self.pool.num_blocks} blocks of {self.pool.block_size}); raise kv_cache_bytes or num_blocks"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=ids,
            num_prompt_tokens=len(ids),
            params=params,
            namespace=self.namespace if self.config.enable_prefix_caching else (self.namespace, "private", next(self._ids)),
            generator=make_generator(params),
            stop_ids=frozenset(stop_ids),
            max_total_tokens=min(self.max_context, pool_tokens),
            retain=retain,
            prefix=prefix,
        )
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now; what it generated so far stays in its result."""
        if seq.finished:
            return
        if seq.status is Status.RUNNING:
            self.scheduler.finish(seq)
        else:
            self.scheduler.waiting.remove(seq)
            self.scheduler.drop_prefix(seq)
            seq.status = Status.FINISHED
        seq.finish_reason = "aborted"
        seq.finish_time = time.perf_counter()

    # -- the loop -----------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """Run one batched forward over everything scheduled; return the sequences that finished."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting.popleft()
                self.scheduler.drop_prefix(seq)
                seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, "aborted", time.perf_counter()
                raise OutOfBlocks(
                    f"request {seq.seq_id} ({len(seq.token_ids)} tokens) does not fit in the free KV blocks "
                    f"({self.pool.num_free} free, {self.cache.cached_blocks} held by the prefix cache, locked)"
                )
            return []
        ids, pos, tables, qlens, ctx, rows, samplers = [], [], [], [], [], [], []
        for seq, n in plan:
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            tables.append(seq.block_table)
            qlens.append(n)
            ctx.append(start + n)
            if start + n == len(seq.token_ids):
                rows.append(len(ids) - 1)
                samplers.append(seq)
        dev = self.model.device
        metas = {
            w: build_metadata(tables, qlens, ctx, self.pool.block_size, w, device=dev) for w in self.model.windows
        }
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            self.pool.kv,
            metas,
            torch.tensor(rows, dtype=torch.long, device=dev),
        ).cpu()
        for seq, n in plan:
            seq.num_computed += n
            if seq.first_token_time is None:
                seq.num_prefilled += n
        finished = []
        for row, seq in enumerate(samplers):
            token = sample(logits[row], seq.params, seq.token_ids, seq.generator)
            if self._append(seq, token):
                self.scheduler.finish(seq)
                seq.finish_time = time.perf_counter()
                finished.append(seq)
        return finished

    def _append(self, seq: Sequence, token: int) -> bool:
        """Add a sampled token; return True when the sequence is done."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        seq.token_ids.append(token)
        visible = seq.generated_ids
        if token in seq.stop_ids:
            visible = visible[:-1]
            seq.finish_reason = "stop"
        seq.text = self.tokenizer.decode(visible, skip_special_tokens=True)
        if seq.params.stop and seq.finish_reason is None:
            window = len(seq.text) - max(map(len, seq.params.stop)) - 8
            hits = [i for s in seq.params.stop if (i := seq.text.find(s, max(window, 0))) >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.finish_reason = "stop"
        if seq.finish_reason is None and (
            seq.num_generated >= seq.params.max_tokens or len(seq.token_ids) >= seq.max_total_tokens
        ):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    # -- convenience --------------------------------------------------------

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Run prompts to completion, all batched together. One prompt in, one result out; a list in, a list out."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise InvalidRequest("prompt list is empty: no prompts given")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise InvalidRequest(f"{len(plist)} sampling params for {len(batch)} prompts")
        seqs = []
        try:
            for p, sp in zip(batch, plist):
                seqs.append(self.add_request(p, sp))
            while not all(s.finished for s in seqs):
                self.step()
        except BaseException:
            for s in seqs:
                self.abort(s)
            raise
        results = [result_of(s) for s in seqs]
        return results[0] if single else results

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[str | GenerationResult]:
        """Yield text pieces as they are generated, then the GenerationResult."""
        seq = self.add_request(prompt, params)
        try:
            yield from self.drive(seq)
            yield result_of(seq)
        finally:
            self.abort(seq)  # no-op when finished; frees the blocks if the caller stopped early

    def drive(self, seq: Sequence) -> Iterator[str]:
        """Step the engine until ``seq`` finishes, yielding its new text as it appears.

        Text that may still turn out to be the start of a stop string, or half of a
        multi-byte character, is held back until it is settled.
        """
        hold = max(map(len, seq.params.stop), default=1) - 1
        while not seq.finished:
            self.step()
            end = len(seq.text) if seq.finished else len(seq.text) - hold
            if not seq.finished and seq.text.endswith("\ufffd"):
                end = min(end, len(seq.text) - 1)
            if end > seq.emitted:
                yield seq.text[seq.emitted : end]
                seq.emitted = end

    # -- sessions -------------------------------------------------------------

    @property
    def session_manager(self):
        """The conversation store and snapshot directory, opened on first use."""
        if self._sessions is None:
            from chatkv.paths import data_dir
            from chatkv.session_manager import SessionManager

            root = Path(self.config.data_dir) if self.config.data_dir else data_dir()
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._sessions = SessionManager(
                self, root, self.config.db_url, self.config.idle_spill_s, self.config.snapshot_budget_bytes
            )
        return self._sessions

    def session(self, system: str | None = None, title: str | None = None, params: dict | None = None):
        """Start a new saved conversation. ``params``: default SamplingParams fields for its turns."""
        if params:
            SamplingParams(**params).validate()
        return self.session_manager.create(system, title, params)

    def resume(self, conv_id: str):
        """Reopen a saved conversation; its next turn restores the KV from disk instead of recomputing."""
        return self.session_manager.resume(conv_id)

    def sessions(self, include_archived: bool = False):
        """Saved conversations, newest activity first (storage.ConversationInfo)."""
        return self.session_manager.store.list_conversations(include_archived=include_archived, tenant=self.config.tenant)

    def spill_idle(self) -> int:
        """Spill sessions idle past ``idle_spill_s`` to disk now; returns how many."""
        return self.session_manager.spill_idle() if self._sessions is not None else 0

    def close(self) -> None:
        """Spill and close every open session and the database. The engine is unusable afterwards."""
        if self._sessions is not None:
            self._sessions.close()
            self._sessions = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_integrity(self) -> None:
        """Assert the pool and cache invariants (call when idle)."""
        self.pool.check_integrity()
        self.cache.check_integrity()
