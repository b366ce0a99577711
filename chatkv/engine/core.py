"""Engine: the SDK's entry point, and the wiring of model runner, KV manager and scheduler.

(Past ~400 lines on purpose: it is the one place a user looks for what the SDK can do -
requests, the engine loop, sessions, knowledge bases, state - and each method is a few
lines handing the work to its owner: the scheduler, the loop (chatkv.engine.loop), the
closer (chatkv.engine.closing), the session manager, the KV manager.)

``Engine.from_pretrained(model=None, **config)`` loads a Hugging Face directory of the
Llama family (None = the packaged SmolLM2-135M-Instruct). ``generate`` runs prompts to
completion, batched together; ``stream`` yields text pieces and then the
``GenerationResult``; ``session``/``resume`` open saved conversations. ``step`` is one
round of the engine loop (chatkv.engine.loop), whose step is ``run_batch``: schedule, run,
postprocess. The loop's rounds run on its thread after ``start()``, else on whichever caller
waits for a request: the entry points are the same code either way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import operator
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterator
from typing import Sequence as Seq

from chatkv.config import EngineConfig
from chatkv.engine import closing, text_tokens
from chatkv.engine.detokenize import TextStream
from chatkv.engine.loop import EngineLoop, RequestStream
from chatkv.engine.model_runner import ModelRunner
from chatkv.engine.sampling import SamplingParams, make_generator
from chatkv.engine.scheduler import NeedsBlocks, Scheduler
from chatkv.engine.sequence import Sequence
from chatkv.engine.speculative import Speculator
from chatkv.errors import (
    EngineClosed,
    InvalidRequest,
    ModelNotFound,
    StorageError,
    UnsupportedModel,
    check_text,
    check_timeout,
)
from chatkv.kvcache.manager import KVManager, RetainedKV
from chatkv.model.cpu_threads import ThreadGovernor
from chatkv.model.modes import choose as choose_weights
from chatkv.model.self_check import load_checked
from chatkv.outputs import EngineStats, GenerationResult
from chatkv.storage.paths import LOCAL_USER  # not storage.models: no SQLAlchemy until a store is opened
from chatkv.weights import ensure_default_model, load_config, load_tokenizer, model_fingerprint
from chatkv.weights.loading import with_chat_template
from chatkv.weights.prepared import ensure_gguf_model
from chatkv.weights.quantised import vnni_kernels

if TYPE_CHECKING:  # imported when sessions are first used: the store (SQLAlchemy) is not a one-shot's
    from chatkv.sessions.manager import SessionManager

log = logging.getLogger("chatkv.engine.core")


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        hf_config = load_config(self.model_dir)  # raises ModelNotFound / UnsupportedModel first
        c = self.config
        self.threads = ThreadGovernor(c.threads, enabled=c.adaptive_threads)  # its first look: before the load
        self.weights = choose_weights(c.weights, c.head_weights, c.dtype, c.device, self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.default_chat_template = with_chat_template(self.tokenizer, self.model_dir)  # ChatML, warned once
        base = model_fingerprint(self.model_dir, self.config.data_dir or os.environ.get("CHATKV_HOME"))
        # a quantised mode proves itself on this CPU first (cached verdict), else falls back
        self.model, self.weights = load_checked(
            self.model_dir,
            self.weights,
            c,
            self.tokenizer,
            base,
            explicit=c.weights != "auto" or c.head_weights != "auto",
        )
        log.info("weights: %s", self.weights.label)
        self.fingerprint = self.weights.fingerprint(base)
        if self.weights.weights != "float" and any(vnni_kernels()):
            # int8 activations (CHATKV_Q4_VNNI) compute other KV: never shared with the bf16 kernels'
            salted = f"{self.fingerprint}:q8-activations{vnni_kernels()}"
            self.fingerprint = hashlib.sha256(salted.encode()).hexdigest()[:32]
        self.runner = ModelRunner(self.model, self.config)
        self.kv_dtype = self.runner.kv_format.name  # in the cache namespace and every snapshot header
        self.kv = KVManager(
            self.runner.pool,
            (self.fingerprint, self.kv_dtype, self.config.tenant),
            self.config.enable_prefix_caching,
            host=self.runner.host_pool,
            states=self.runner.state_cache,
        )
        self.hybrid = self.runner.states is not None  # recurrent states beside the KV (chatkv.kvcache.states)
        speculator = Speculator.from_config(self.config)
        if self.hybrid and speculator is not None:
            # a rejected proposal would have to be taken back out of the recurrent state
            log.info("speculative decoding is off: %s keeps a recurrent state per sequence", hf_config.model_type)
            speculator = None
        self.scheduler = Scheduler(
            self.kv,
            self.config.max_batch_tokens,
            self.runner.max_running,
            speculator=speculator,
        )
        self.max_context = int(getattr(hf_config, "max_position_embeddings", 2048))
        self.context_window = self._context_window()
        self.eos_ids = self._eos_ids()
        self._ids = itertools.count()
        self._sessions: SessionManager | None = None
        self._kbs: dict = {}  # open knowledge bases by name
        self._embedder = None  # the embedding model, loaded once for every knowledge base
        self._loop = EngineLoop(self)  # its rounds run on a thread once start()ed, else on whoever waits
        self._gate = closing.Gate()  # what close() still admits (chatkv.engine.closing)
        self._closer = closing.Closer(
            self._gate,
            self._loop,
            self.scheduler,
            self.kv,
            lambda: self._sessions,
            self._take_sessions,
            self._close_kbs,
        )
        self._open_lock = threading.Lock()  # the store and knowledge bases open once, whichever thread asks first

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, *, progress=True, **config) -> "Engine":
        """Load ``model``: a local Hugging Face directory, a GGUF file (prepared once into the data
        directory, chatkv.weights.prepared), or None for the packaged default chat model.
        ``progress`` reports a first run's conversion: True a bar on the terminal, False nothing,
        or ``fn(done, total)`` after each tensor."""
        cfg = EngineConfig.from_kwargs(**config)
        home = Path(cfg.data_dir) if cfg.data_dir else None
        if model is None:  # converted once into the data directory this engine uses
            model = ensure_default_model(home, progress=progress)
        elif not Path(model).exists():
            raise ModelNotFound(f"model path '{model}' does not exist (chatkv never downloads weights)")
        elif Path(model).is_file():
            model = ensure_gguf_model(model, home, progress=progress)
        return cls(model, cfg)

    def _context_window(self) -> int:
        """Tokens one conversation's KV may hold: ``context_window`` (default: the model's
        context), never more than the model's context or the KV pool."""
        pool = self.runner.pool
        want = self.config.context_window or self.max_context
        if want > self.max_context:
            raise InvalidRequest(f"context_window {want} exceeds the model's context of {self.max_context} tokens")
        return min(want, pool.num_blocks * pool.block_size)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except (ValueError, AttributeError, OSError):
                raise ModelNotFound(f"'{gen}' is not a JSON object; fix or remove it") from None
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(i for i in ids if isinstance(i, int))

    # -- requests -----------------------------------------------------------

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) - {"role", "content"} or "content" not in m:
                raise InvalidRequest(f"message {i} must be a dict with 'role' and 'content'")
            check_text(f"message {i} role", m.get("role"))
            check_text(f"message {i} content", m["content"])
        # contents are data: a special-token string in a message is its characters (chatkv.engine.text_tokens)
        return text_tokens.encode_chat(
            self.tokenizer,
            lambda ms: self.tokenizer.apply_chat_template(
                ms, add_generation_prompt=add_generation_prompt, tokenize=False
            ),
            messages,
        )

    def _to_ids(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            if not prompt.strip():
                raise InvalidRequest("prompt is empty")
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)):
            ids = []
            for t in prompt:
                try:
                    if isinstance(t, bool):
                        raise TypeError
                    ids.append(operator.index(t))
                except TypeError:
                    raise InvalidRequest(f"a token-id prompt must hold only integers, got {t!r}") from None
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
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
        prefix: RetainedKV | None = None,
        namespace=None,
        max_context: int | None = None,
        priority: int = 0,
        admitted: bool = False,
        on_finish=None,
    ) -> Sequence:
        """Queue one request (in a round of the engine loop); it runs on the next rounds and its
        output reaches ``seq.stream``. Validates before queueing.

        ``retain`` keeps the finished sequence's KV (``seq.retained``) for a next turn;
        ``prefix`` hands such retained KV to this request, which ends it once admitted
        (sessions use both). On an error nothing is queued and ``prefix`` is left to the caller.
        ``namespace``: the radix namespace of its KV (None: the engine's shared one; a moved
        attention-sink window has a private one). ``max_context``: a tighter bound than the
        model's context on prompt + reply (a session's context window). ``priority``: lower
        runs first (session turns 0, ``generate`` batches 1); see the scheduler.
        ``admitted``: part of a call that began before ``close()`` (a session turn, ``generate``):
        refused only once close's grace period is over, where a new request is refused at once.
        ``on_finish``: ``fn(seq)`` called once as it finishes, in the round that finishes it (a
        session turn takes its retained KV there).
        """
        if not admitted:
            self._gate.check("a new request")
        if self.hybrid and (retain or prefix is not None):
            self._refuse_hybrid("retaining a request's KV for a next turn")
        return self.on_loop(
            lambda: self._new_request(prompt, params, retain, prefix, namespace, max_context, priority, on_finish)
        )

    def _new_request(self, prompt, params, retain, prefix, namespace, max_context, priority, on_finish) -> Sequence:
        if self._gate.cut:
            raise EngineClosed("the engine was closed before this request started; nothing of it was run")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
            raise InvalidRequest(f"priority must be an int in [-1000, 1000], got {priority!r}")
        params.check_vocab(self.model.embed.shape[0])
        ids = self._to_ids(prompt)
        limit = min(self.max_context, max_context or self.max_context)
        if len(ids) >= limit:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the context is {limit}")
        pool = self.runner.pool
        pool_tokens = pool.num_blocks * pool.block_size
        if len(ids) + 1 > pool_tokens:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; the KV pool can hold at most {pool_tokens} "
                f"({pool.num_blocks} blocks of {pool.block_size}); raise kv_cache_bytes or num_blocks"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        matcher = None
        if params.constrained:  # compiled once per constraint (cached); InvalidRequest if it cannot be
            from chatkv.engine.constraints import compiler_for, constraint_of

            matcher = compiler_for(self.tokenizer).matcher(constraint_of(params), stop_ids)
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=ids,
            num_prompt_tokens=len(ids),
            params=params,
            generator=make_generator(params),
            stop_ids=frozenset(stop_ids),
            max_total_tokens=min(limit, pool_tokens),
            out=TextStream(self.tokenizer, params.stop),
            retain=retain,
            prefix=prefix,
            namespace=namespace,
            priority=priority,
            on_finish=on_finish,
            matcher=matcher,
        )
        self._loop.track(seq)  # its output reaches whoever reads it through a stream
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now; what it generated so far stays in its result."""
        if self._loop.closed:  # close() ended every request
            return
        try:
            self.on_loop(lambda: self.scheduler.abort(seq))
        except EngineClosed:  # close() finished between the look above and the lock: it ended them all
            pass

    # -- the engine loop (threads and asyncio) ---------------------------------

    def start(self) -> "Engine":
        """Run the steps on one background thread. Afterwards requests (``submit``, ``generate``,
        ``stream``, ``agenerate``) and session turns (``send``/``stream``/``asend``/``astream``)
        may come from any thread or from asyncio; concurrent ones share the running batch.
        ``close()`` stops it. Returns the engine."""
        self._gate.check("start()")
        self._loop.start()
        return self

    @property
    def started(self) -> bool:
        return self._loop.running

    @property
    def open(self) -> bool:
        """Not closing or closed."""
        return self._gate.state == "open"

    @property
    def idle(self) -> bool:
        """Open, no session turn running and no request to step: low-priority background work
        (a chunk's KV made for later turns, chatkv.rag.background) may use the machine."""
        return self._gate.state == "open" and self._gate.turns <= 0 and not self.scheduler.has_work()

    def on_loop(self, fn):
        """Run ``fn()`` where the engine's state may be touched, in a round of the engine loop
        (the loop thread's once started, waiting for it; else one run here), and return its result."""
        return self._loop.call(fn)

    def submit(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
    ) -> RequestStream:
        """Queue one request and return its ``RequestStream`` (iterate it, ``async for`` it,
        ``cancel()`` it, ``result()``). Bad input raises here. Before ``start()`` reading the
        stream runs the engine loop on the reader's thread. ``user``: whose prefix cache it reads and
        fills (``chatkv serve``'s API keys; None: the local user, as the app and the SDK are)."""
        self._gate.check("a new request")
        namespace = self.kv.user_namespace(user)
        return self.add_request(prompt, params, priority=priority, namespace=namespace, admitted=True).stream

    async def agenerate(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, *, priority: int = 0
    ) -> GenerationResult:
        """Run one request from asyncio (starts the loop if needed); its GenerationResult."""
        import asyncio

        self._gate.check("a new request")
        self.start()
        stream = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.submit(prompt, params, priority=priority)
        )
        return await stream.aresult()

    def add_finish_listener(self, fn) -> None:
        """Call ``fn(result, seq)`` in the loop's round whenever a request finishes (keep it cheap)."""
        self._loop.listeners.append(fn)

    def shift_keys(self, blocks: list[int], delta: int) -> None:
        """Re-rotate the keys in ``blocks`` of the KV pool by ``delta`` positions (attention-sink windows)."""
        if self.hybrid:
            self._refuse_hybrid("moving an attention-sink window")
        self.model.shift_key_positions(self.runner.pool.kv, blocks, delta, self.runner.pool.quant)

    # -- the loop -----------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def fail_all(self, error: Exception) -> None:
        """End every request with ``error`` (a step raised; where the engine's state lives)."""
        self.scheduler.fail_all(error)

    def step(self) -> list[Sequence]:
        """One round of the engine loop, on this thread: the queued commands, one batched forward
        over everything scheduled, each stream's new text. The sequences that finished. (The
        loop thread runs the same rounds once started; a round holds the state's lock.)"""
        return self._loop.round()

    def run_batch(self) -> list[Sequence]:
        """A round's step: schedule, run, postprocess (in a round: ``step``)."""
        if self._gate.cut and self.scheduler.has_work():  # close()'s grace period is over
            self._closer.end_requests()
            return []
        plan = self._schedule()
        if not plan:
            return []
        self.threads.adjust()  # as many compute threads as there are free cores (chatkv.model.cpu_threads)
        return self.scheduler.postprocess(plan, self.runner.run(plan))

    def _schedule(self) -> list:
        """The next step's plan. Memory pressure is a result here, not a call from inside the KV
        manager: a pass that finds blocks short says how many (``NeedsBlocks``); idle sessions
        are spilled for them and the scheduler plans again, until nothing more can be spilled
        (then it preempts or fails as it must)."""
        sessions = self._sessions
        plan = self.scheduler.schedule(relievable=sessions is not None)
        while isinstance(plan, NeedsBlocks):
            plan = self.scheduler.schedule(relievable=sessions.relieve(plan.blocks))
        return plan

    # -- convenience --------------------------------------------------------

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Run prompts to completion, all batched together. One prompt in, one result out; a list in, a list out."""
        if not isinstance(prompts, (str, list, tuple)):
            raise InvalidRequest(f"prompts must be a string, token ids or a list of them, got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (len(prompts) > 0 and not isinstance(prompts[0], (str, list, tuple)))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise InvalidRequest("prompt list is empty: no prompts given")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise InvalidRequest(f"{len(plist)} sampling params for {len(batch)} prompts")
        self._gate.check("a new request")
        seqs = []
        try:
            for p, sp in zip(batch, plist):  # one at a time: a bad prompt aborts those already queued
                seqs.append(self.add_request(p, sp, priority=1, admitted=True))
            for s in seqs:
                s.stream.wait()
        except BaseException:
            for s in seqs:
                self.abort(s)
            raise
        for s in seqs:
            if s.error is not None:
                raise s.error
        results = [s.result() for s in seqs]
        return results[0] if single else results

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[str | GenerationResult]:
        """Yield text pieces as they are generated, then the GenerationResult."""
        self._gate.check("a new request")
        seq = self.add_request(prompt, params, admitted=True)
        try:
            yield from self.drive(seq)
            yield seq.result()
        finally:
            self.abort(seq)  # no-op when finished; frees the blocks if the caller stopped early

    def drive(self, seq: Sequence) -> Iterator[str]:
        """``seq``'s settled new text as it appears (its stream: read before ``start()``, it runs
        the engine loop on this thread). Raises the request's own error if it ended with one."""
        return iter(seq.stream)

    # -- sessions -------------------------------------------------------------

    def data_root(self) -> Path:
        """The data directory (``config.data_dir``, else the default), created if missing."""
        from chatkv.storage.paths import data_dir

        try:
            return data_dir(self.config.data_dir)
        except OSError as e:
            raise StorageError(f"the data directory cannot be created: {e.strerror or e} ({e.filename})") from e

    @property
    def session_manager(self) -> SessionManager:
        """The conversation store and snapshot directory, opened on first use."""
        if self._sessions is None:
            self._gate.check("opening the conversation store")
            with self._open_lock:
                if self._sessions is None:
                    from chatkv.sessions.manager import SessionManager

                    self._sessions = SessionManager(self, self.data_root())
        return self._sessions

    def session(
        self,
        system: str | None = None,
        title: str | None = None,
        params: dict | None = None,
        *,
        knowledge=None,
        top_k: int = 4,
        documents: list[str] | None = None,
        overflow: str | None = None,
        user: str | None = None,
    ):
        """Start a new saved conversation (of ``user``: a ``chatkv serve`` API key's user; None:
        the local user, whom the app and the SDK are). ``params``: default SamplingParams fields for its turns.

        With ``knowledge`` (a KnowledgeBase) every turn retrieves ``top_k`` sources for the
        message and the reply lists them (``reply.sources``); ``documents`` (sources in that
        knowledge base) are pinned after the system prompt, their KV shared by every session
        with the same system prompt and documents. ``overflow``: what happens when the history
        outgrows the context window ("sink", "truncate" or "error"; default: the engine's)."""
        self._gate.check("a new session")
        if self.hybrid:
            self._refuse_hybrid("sessions (KV kept and saved between turns)")
        return self.session_manager.create(system, title, params, knowledge, top_k, documents, overflow, owner=user)

    def knowledge_base(self, name: str):
        """Open (or create) the knowledge base ``name`` in this engine's data directory and database."""

        self._gate.check("opening a knowledge base")
        with self._open_lock:
            return self._knowledge_base(name)

    def _knowledge_base(self, name: str):
        from chatkv.retrieval import Embedder, KnowledgeBase

        kb = self._kbs.get(name)
        if kb is None:
            if self._embedder is None:
                self._embedder = Embedder()
            kb = KnowledgeBase.open(
                name,
                data_dir=self.data_root(),
                db_url=self.config.db_url,
                embedder=self._embedder,
                tenant=self.config.tenant,
            )
            kb.kv_precompute = self._precompute_kv  # kb.add(..., precompute_kv=True): chatkv.rag.placement
            self._kbs[name] = kb
        return kb

    def _refuse_hybrid(self, what: str) -> None:
        raise UnsupportedModel(
            f"{what} is not supported for model_type '{self.model.config.model_type}': its linear-attention "
            "layers keep a recurrent state per sequence that this feature does not carry; use generate/submit "
            "(a re-sent history resumes from a state checkpoint)"
        )

    def _precompute_kv(self, texts: list[str], progress: bool) -> int:
        if self.hybrid:
            self._refuse_hybrid("precomputing RAG chunk KV")
        from chatkv.rag.placement import precompute_with_bar

        return precompute_with_bar(self, texts, progress)

    def resume(self, conv_id: str, *, user: str | None = None):
        """Reopen a saved conversation; its next turn restores the KV from disk instead of recomputing.
        One of another ``user`` (None: the local user) is unknown: the same SessionError as an id never used."""
        self._gate.check("resume()")
        if self.hybrid:
            self._refuse_hybrid("resuming a session (KV restored from disk)")
        return self.session_manager.resume(conv_id, owner=user)

    def sessions(self, include_archived: bool = False, *, user: str | None = None):
        """Saved conversations (of ``user``; None: the local user), newest activity first (storage.ConversationInfo)."""
        self._gate.check("sessions()")
        return self.session_manager.store.list_conversations(
            include_archived=include_archived, tenant=self.config.tenant, owner=user or LOCAL_USER
        )

    def search(self, query: str, limit: int = 20, *, user: str | None = None):
        """Messages of ``user``'s saved conversations (None: the local user), every branch, whose
        text holds ``query``'s words, best first: ``SearchHit`` records (conversation_id, title,
        message, snippet). ``session.switch(hit.message.id)`` opens that message's branch."""
        self._gate.check("search()")
        return self.session_manager.store.search(
            query, owner=user or LOCAL_USER, tenant=self.config.tenant, limit=limit
        )

    def sessions_in_memory(self) -> list[str]:
        """Ids of this process's open conversations whose KV is in memory now (kept between turns,
        or in a turn); opens the conversation store if it is not open yet. Any thread."""
        return self.session_manager.in_memory()

    def spill_idle(self) -> int:
        """Spill sessions idle past ``idle_spill_s`` to disk now; returns how many."""
        if self._loop.closed:
            raise EngineClosed()
        return self.on_loop(self.session_manager.spill_idle) if self._sessions is not None else 0

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop admitting; let the requests and turns in flight finish within ``timeout`` seconds
        (None: no limit), then interrupt what is left: its callers get ``EngineClosed``, a turn's
        partial reply stored first, marked interrupted. Then spill and close every open session
        and the database, and release the prefix cache. Afterwards every call raises
        ``EngineClosed``. Idempotent; never hangs (see ``chatkv.engine.closing``). A ``timeout`` that is
        not a number of seconds >= 0 (nan, negative) is refused before anything closes."""
        self._closer.close(check_timeout(timeout))

    def _take_sessions(self) -> SessionManager | None:
        """The session manager detached from this engine, for close() to close."""
        sm, self._sessions = self._sessions, None
        return sm

    def _close_kbs(self) -> None:
        """Close and forget every open knowledge base (close())."""
        for kb in self._kbs.values():
            kb.close()
        self._kbs.clear()

    def turn_in_flight(self):
        """Context manager around a session turn: counted in flight, so close() waits for it;
        raises EngineClosed once close() began."""
        return self._gate.turn()

    def turn_suspended(self):
        """Context manager around a turn's ``yield``: while its caller holds a piece, the turn is
        not running and close() does not wait for it."""
        return self._gate.suspended()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- state ----------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes in the pool: every layer, keys and values, scales included."""
        return self.runner.pool.bytes_per_token

    def kv_stats(self) -> dict[str, int]:
        """KV pool and prefix-cache counts (blocks total/free/cached/evictable, tree nodes, pins, retained;
        with the host tier: host_blocks_total/used, evicted_to_host, host_hits, host_evicted)."""
        return self.on_loop(self.kv.stats)

    def stats(self) -> EngineStats:
        """The engine's state and lifetime counters as one ``EngineStats`` (what /metrics exports)."""

        def collect() -> EngineStats:
            kv = self.kv.stats()
            running, waiting = self.scheduler.counts()
            out = EngineStats(
                num_running=running,
                num_waiting=waiting,
                **{
                    k: kv[k]
                    for k in (
                        "blocks_total",
                        "blocks_free",
                        "blocks_cached",
                        "host_blocks_total",
                        "host_blocks_used",
                        "evicted_to_host",
                        "host_hits",
                    )
                    if k in kv
                },
            )
            out.kv_cache_usage = 1 - out.blocks_free / max(out.blocks_total, 1)
            sm = self._sessions
            if sm is not None:
                out.sessions_open = len(sm.live)
                out.sessions_in_memory = sum(s.kept is not None for s in sm.live.values())
                snap = sm.snapshots
                out.sessions_on_disk = snap.on_disk()
                out.spills, out.spill_bytes = snap.stats["jobs"], snap.stats["bytes"]
                out.restores, out.restore_bytes = snap.stats["restores"], snap.stats["restore_bytes"]
            return out

        return self.on_loop(collect)

    def check_integrity(self) -> None:
        """Assert the pool and cache invariants, and that every block reference and radix lock is
        owned by a live request, open session or pin (call when idle)."""
        self.on_loop(self._check_integrity)

    def _check_integrity(self) -> None:
        seqs = self.scheduler.sequences()
        handles = [s.prefix for s in seqs] + (self._sessions.held_kv() if self._sessions is not None else [])
        self.kv.check_integrity(seqs, handles)
