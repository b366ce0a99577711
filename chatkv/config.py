"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, fields

from chatkv.errors import InvalidRequest

OVERFLOW_POLICIES = ("sink", "truncate", "error")
WEIGHTS = ("auto", "bf16", "fp32", "int4", "int8")  # chatkv.model.modes
HEADS = ("auto", "float", "int8", "int4")
QUANT_DENSE = ("scratch", "copy")  # chatkv.model.forward.DENSE_KINDS
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8", "fp8")  # chatkv.engine.model_runner.kv_format
SPECULATIVE = ("auto", "off", "lookup")  # chatkv.engine.speculative.MODES
RAG_KV_REUSE = ("off", "edge", "blend")  # chatkv.rag.placement.MODES


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derive from kv_cache_bytes
    kv_cache_bytes: int = 512 * 2**20
    max_batch_tokens: int = 512  # token budget of one step (chunked prefill)
    max_running: int = 32
    dtype: str = (
        "auto"  # "auto" = the model's own dtype (bfloat16 for the packaged default), or float32/bfloat16/float16
    )
    device: str = "cpu"
    weights: str = (
        "auto"  # auto | bf16 | fp32 | int4 | int8 (chatkv.model.modes: auto = a GGUF's own int4, else the float model)
    )
    head_weights: str = "auto"  # the output matrix: auto (= float) | float | int8 | int4
    kv_dtype: str = (
        "auto"  # the KV cache: auto (= the model's dtype) | bf16 | fp16 | fp32 | int8 | fp8 (e4m3, per-token scales)
    )
    quant_dense_rows: int = (
        16  # int4/int8: steps of this many rows or more compute in bf16 (faster prefill; 0: the quantised kernels only)
    )
    # how those steps get bf16 weights: "scratch" (the default: no copy resident; int4 steps of 64+
    # rows dequantise into one reused buffer, shorter ones run the int4 kernel; chatkv.model.prefill)
    # | "copy" (a resident bf16 copy of every projection, 2 bytes a parameter more). "scratch" is the
    # default because it keeps the peak near llama.cpp's (no second copy of the weights: on the
    # default model 516 vs 705 MiB after a 1k prompt, llama.cpp 450) for a prefill time close to the
    # copy's (1k prompt's TTFT 1.08x); benchmarks/bench_quant_prefill.py measures it, docs/reference/weights.md
    quant_dense: str = "scratch"
    # every token's numbers its own: the same reply alone or beside other requests, in any prefill
    # chunk, on any thread count, after a preemption or a restore (chatkv.kernels.cpu_invariant; the
    # float modes on CPU). False: oneDNN's products and the batched attention, faster for long prompts
    deterministic: bool = True
    threads: int | None = None  # compute threads at most; None: torch's (the cores)
    adaptive_threads: bool = True  # fewer threads while other processes keep cores busy (chatkv.model.cpu_threads)
    tenant: str = ""  # salt of the prefix-cache namespace: tenants never share KV
    enable_prefix_caching: bool = True
    # speculative decoding by prompt lookup (chatkv.engine.speculative): exact, greedy or sampled
    speculative: str = (
        "auto"  # "auto" (as many proposals as pay, per sequence) | "lookup" (always, when a match exists) | "off"
    )
    num_speculative_tokens: int = 5  # proposals per sequence and step at most (0: off)
    # conversations longer than the context (chatkv.sessions.context_window)
    context_window: int | None = None  # tokens a conversation's KV may hold; None: the model's context (and the pool)
    overflow: str = (
        "sink"  # beyond it: "sink" (keep the first tokens + a recent window), "truncate" (drop oldest turns), "error"
    )
    sink_tokens: int = (
        4  # attention-sink tokens kept in "sink" mode (rounded up to a block; the system prompt is always kept)
    )
    # sessions
    data_dir: str | None = None  # None: CHATKV_HOME, else the platform's user data dir
    db_url: str | None = None  # any SQLAlchemy URL; None: SQLite file in data_dir
    idle_spill_s: float = 300.0  # a session idle this long is spilled to disk on the next engine activity
    snapshot_budget_bytes: int = 4 * 2**30  # disk budget of KV snapshots, LRU deletion beyond it
    host_cache_bytes: int = 256 * 2**20  # host-memory tier between the KV pool and disk (pinned on CUDA); 0: off
    # retrieved sources' KV reused wherever they land (chatkv.rag.placement): "off" | "edge" | "blend".
    # "off" (prefix caching alone) by default: the default mode must pass benchmarks/rag_eval.py
    # --reuse on both CPU families and be no slower than "off" on any turn of bench_rag.py, and no
    # mode does both (docs/how-to/rag.md has the figures): edge fails the gate; blend at 45% with 4
    # check layers passes it on the Intel Xeon, but its turns were slower than off's on some turns.
    rag_kv_reuse: str = "off"
    rag_edge_tokens: int = 4  # edge: the first tokens of each chunk recomputed
    rag_recompute_ratio: float = 0.45  # blend: the share of all placed chunk tokens recomputed (0..1)
    # blend: layers 1..n each keep, by their own KV deviation, a share of the tokens going on,
    # geometrically down to rag_recompute_ratio at layer n (CacheBlend's gradual filtering); 1: one
    # check at layer 1
    rag_check_layers: int = 4
    chunk_kv_bytes: int = 256 * 2**20  # host memory of the chunk KV store (its own LRU; evicted entries stay on disk)
    rag_kv_disk: bool = True  # chunk KV kept on disk too (data_dir/chunk_kv), read back after a restart

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequest(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**kwargs)
        if cfg.block_size < 1:
            raise InvalidRequest(f"block_size must be >= 1, got {cfg.block_size}")
        if cfg.num_blocks is not None and cfg.num_blocks < 1:
            raise InvalidRequest(f"num_blocks must be >= 1, got {cfg.num_blocks}")
        if cfg.overflow not in OVERFLOW_POLICIES:
            raise InvalidRequest(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {cfg.overflow!r}")
        if cfg.context_window is not None and (
            isinstance(cfg.context_window, bool) or not isinstance(cfg.context_window, int) or cfg.context_window < 2
        ):
            raise InvalidRequest(f"context_window must be an int >= 2 or None, got {cfg.context_window!r}")
        if isinstance(cfg.sink_tokens, bool) or not isinstance(cfg.sink_tokens, int) or cfg.sink_tokens < 0:
            raise InvalidRequest(f"sink_tokens must be an int >= 0, got {cfg.sink_tokens!r}")
        if (
            isinstance(cfg.host_cache_bytes, bool)
            or not isinstance(cfg.host_cache_bytes, int)
            or cfg.host_cache_bytes < 0
        ):
            raise InvalidRequest(f"host_cache_bytes must be an int >= 0, got {cfg.host_cache_bytes!r}")
        if (
            isinstance(cfg.quant_dense_rows, bool)
            or not isinstance(cfg.quant_dense_rows, int)
            or cfg.quant_dense_rows < 0
        ):
            raise InvalidRequest(f"quant_dense_rows must be an int >= 0, got {cfg.quant_dense_rows!r}")
        if cfg.quant_dense not in QUANT_DENSE:
            raise InvalidRequest(f"quant_dense must be one of {', '.join(QUANT_DENSE)}, got {cfg.quant_dense!r}")
        if cfg.threads is not None and (
            isinstance(cfg.threads, bool) or not isinstance(cfg.threads, int) or cfg.threads < 1
        ):
            raise InvalidRequest(f"threads must be an int >= 1 or None, got {cfg.threads!r}")
        if cfg.kv_dtype not in KV_DTYPES:
            raise InvalidRequest(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {cfg.kv_dtype!r}")
        if cfg.speculative not in SPECULATIVE:
            raise InvalidRequest(f"speculative must be one of {', '.join(SPECULATIVE)}, got {cfg.speculative!r}")
        n = cfg.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 64:
            raise InvalidRequest(f"num_speculative_tokens must be an int in [0, 64], got {n!r}")
        if cfg.rag_kv_reuse not in RAG_KV_REUSE:
            raise InvalidRequest(f"rag_kv_reuse must be one of {', '.join(RAG_KV_REUSE)}, got {cfg.rag_kv_reuse!r}")
        if isinstance(cfg.rag_edge_tokens, bool) or not isinstance(cfg.rag_edge_tokens, int) or cfg.rag_edge_tokens < 0:
            raise InvalidRequest(f"rag_edge_tokens must be an int >= 0, got {cfg.rag_edge_tokens!r}")
        r = cfg.rag_recompute_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise InvalidRequest(f"rag_recompute_ratio must be a number in [0, 1], got {r!r}")
        n = cfg.rag_check_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
            raise InvalidRequest(f"rag_check_layers must be an int in [1, 64], got {n!r}")
        if cfg.max_batch_tokens < 1:
            raise InvalidRequest(f"max_batch_tokens must be >= 1, got {cfg.max_batch_tokens}")
        return cfg
