"""What a request or a turn returns, and what it cost: declared once, used by the engine's
results, a session's replies, the stored messages and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class Usage:
    """The statistics of one request or turn. ``prompt_tokens = cached + host + restored +
    computed + reused`` (plus any tokens recomputed after a preemption)."""

    prompt_tokens: int = 0  # the whole prompt (for a turn: history + new message)
    cached_tokens: int = 0  # of which already in device memory (a prefix-cache hit)
    host_tokens: int = 0  # of which copied back from the host-memory tier
    restored_tokens: int = 0  # of which loaded from a snapshot on disk
    computed_tokens: int = 0  # of which computed before the first generated token
    generated_tokens: int = 0
    ttft_s: float = 0.0  # time to first token
    tokens_per_s: float = 0.0  # generated tokens after the first, per second
    proposed_tokens: int = 0  # speculative decoding: tokens proposed for verification (chatkv.engine.speculative)
    accepted_tokens: int = 0  # of which the model accepted (each one a token without a step of its own)
    reused_tokens: int = 0  # RAG sources' tokens placed from their chunk KV, not computed (chatkv.rag.placement)
    recomputed_tokens: int = 0  # of the sources' tokens, those recomputed over the placed KV (in computed_tokens)

    def message_columns(self) -> dict:
        """The fields as the database's message columns name them (``ttft_ms``)."""
        stats = asdict(self)
        stats["ttft_ms"] = stats.pop("ttft_s") * 1000
        return stats

    @classmethod
    def from_message(cls, message) -> "Usage | None":
        """The usage stored with a message (storage.MessageInfo); None if it has none."""
        if message.prompt_tokens is None:
            return None
        values = {f.name: getattr(message, f.name, None) for f in fields(cls) if f.name != "ttft_s"}
        values["ttft_s"] = (message.ttft_ms or 0.0) / 1000
        return cls(**{k: (v if v is not None else 0) for k, v in values.items()})

    def summary(self) -> str:
        """One line for people: ``12 prompt tokens (8 cached, 2 host, 0 restored, 2 computed), ...``."""
        return (
            f"{self.prompt_tokens} prompt tokens ({self.cached_tokens} cached, {self.host_tokens} host, "
            f"{self.restored_tokens} restored, "
            f"{self.computed_tokens} computed), {self.generated_tokens} generated, "
            f"TTFT {self.ttft_s * 1000:.0f} ms, {self.tokens_per_s:.1f} tok/s"
        )


@dataclass
class TokenLogprob:
    """One generated token's log probability (``SamplingParams.logprobs``): the float32
    log-softmax of the model's raw logits at that step, before logit bias, penalties,
    temperature and any constraint's mask, as OpenAI and vLLM report them."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens, best first


@dataclass
class GenerationResult:
    """A finished request."""

    request_id: int
    text: str
    token_ids: list[int]  # generated tokens (the stop token included when generation ended on one)
    finish_reason: str  # "stop" | "length" | "aborted"
    usage: Usage
    preemptions: int = 0
    # with SamplingParams.logprobs: one per generated token, the stop token excluded (None: not asked)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Reply:
    """A finished turn of a session."""

    text: str
    usage: Usage
    finish_reason: str  # "stop" | "length" | "aborted"
    message_id: int
    sources: list = field(default_factory=list)
    context: object = None  # chatkv.sessions.context_window.ContextInfo: what the KV window kept and dropped
    parsed: object = None  # send(json_schema=...): the reply as JSON (None unless it ended by stop, valid)
    tool_calls: list = field(default_factory=list)  # send(tools=...): chatkv.sessions.tools.ToolCall, in order


@dataclass
class EngineStats:
    """A snapshot of the engine's state and lifetime counters (``engine.stats()``; the
    server's /metrics exports them)."""

    blocks_total: int = 0  # device KV blocks
    blocks_free: int = 0
    blocks_cached: int = 0  # held by the prefix cache
    kv_cache_usage: float = 0.0  # 1.0 = every device block in use
    host_blocks_total: int = 0  # the host-memory tier
    host_blocks_used: int = 0
    evicted_to_host: int = 0  # blocks, lifetime
    host_hits: int = 0  # blocks copied back from host, lifetime
    num_running: int = 0
    num_waiting: int = 0
    sessions_open: int = 0  # open sessions in this process
    sessions_in_memory: int = 0  # of which holding KV in memory
    sessions_on_disk: int = 0  # conversations with a KV snapshot on disk (this tenant)
    spills: int = 0  # snapshot writes (write-behind segments and spills), lifetime
    spill_bytes: int = 0
    restores: int = 0  # snapshots restored from disk, lifetime
    restore_bytes: int = 0
