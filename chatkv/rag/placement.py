"""Placing retrieved chunks' KV into a turn's prompt, then a selective recompute.

(Past 400 lines on purpose: matching the shared prefix, finding the stored chunks, moving the
conversation into its private namespace and building the KV are one sequence whose order and
fallbacks are read in one place; ``blend`` and ``background`` are the parts that stand alone.)

A RAG turn's user message holds its sources (chatkv.rag.context). With ``rag_kv_reuse`` on, the
turn's KV up to its prompt's last token is built here, before the request is added:

1. the shared prefix first: the longest prefix of the prompt the shared radix tree holds (the
   system prompt, pinned documents, earlier turns) is matched; only sources after it are
   placed. Pinned documents are never placed: computed once, they are every session's;
2. each source's text, as the prompt quotes it with its label (``rag.source_texts``), is found
   as a run of the prompt's tokens (its own tokenisation; one not in the prompt as one run is
   computed);
3. its KV in the canonical frame comes from the chunk owner (chatkv.rag.chunk_kv: memory, then
   disk) and is copied into the request's blocks with its keys re-rotated to the positions it
   takes (``rotate_keys``). A turn places only what is stored: a chunk without stored KV is
   computed in the turn as prefix caching alone computes it (never more tokens than ``off``)
   and queued for chatkv.rag.background, which makes its KV when the engine is idle;
4. one forward then computes, over everything, what is not reused: the tokens between and
   after the sources (for a turn, through the prompt's last token but one when that tail fits
   one step's ``max_batch_tokens``: the scheduler then computes only the last, in a decode
   step) and the chunk tokens chosen for recompute:
   - ``edge`` (EPIC): the first ``rag_edge_tokens`` tokens of each chunk, through every layer;
   - ``blend`` (CacheBlend): every token computes layer 0 (its KV there depends on no other
     token); then at each check layer (1 .. ``rag_check_layers``) the tokens that reached it
     compute its KV (stored: fresh KV replaces the copy) and only the top share of all placed
     chunk tokens by that layer's deviation from the reused KV goes on, shrinking
     geometrically to ``rag_recompute_ratio`` at the last check (gradual filtering; one check
     layer is LMCache's ``check_layers=[1]``; chatkv.rag.blend);
   each computed row replaces the reused row in its layer before that layer's attention, so
   a later token sees it, as in a from-scratch forward. With every chunk token chosen the
   forward is one ordinary prefill chunk: the KV is full prefill's.
5. the result becomes the conversation's RetainedKV in the conversation's private radix
   namespace (``ContextState.private``, as a moved sink window's): KV built from reused
   chunks is never matched by, nor shared with, a from-scratch computation of those tokens.
   The private namespace begins where placed KV begins: the whole blocks before the first
   placed source are computed into the shared tree (as ``off`` computes them), and the private
   namespace holds a copy of them (a block lives in one namespace of the tree).

The scheduler computes the rest (a turn's last prompt token) as usual. Anything that fails
here falls back to computing (a slower turn, never a wrong one).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from chatkv.engine.model_runner import BatchItem
from chatkv.errors import OutOfBlocks
from chatkv.kvcache.types import BlockTable
from chatkv.rag import blend as chunk_blend
from chatkv.rag.background import Filler
from chatkv.rag.chunk_kv import ChunkEntry, ChunkKV

if TYPE_CHECKING:
    from chatkv.kvcache.manager import KVManager
    from chatkv.kvcache.types import RetainedKV

log = logging.getLogger("chatkv.rag.chunk_kv")

MODES = ("off", "edge", "blend")


@dataclass
class Placed:
    """What placement did for a turn: ``kept`` holds the KV of ``tokens[:end]``."""

    kept: RetainedKV | None
    end: int = 0
    reused: int = 0  # chunk tokens placed from chunk KV (and kept)
    recomputed: int = 0  # chunk tokens recomputed over the placed KV
    computed: int = 0  # every token this step computed (recomputed + between the sources)
    private: bool = True  # ``kept`` is in the private namespace (False: nothing placed, as it was)


@dataclass(eq=False)
class _Req:
    """A request's KV record for the manager (chatkv.kvcache.types.SequenceKV) while placement builds it."""

    token_ids: list[int]
    namespace: Hashable | None
    prefix: RetainedKV | None = None
    kv: BlockTable = field(default_factory=BlockTable)
    num_cached: int = 0


def frame_tokens(tokenizer) -> list[int]:
    """The canonical frame's prefix: a ChatML user turn's opening when the model has one, else
    its start token, else nothing."""
    if "<|im_start|>" in tokenizer.get_vocab():
        return list(tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"])
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def chunk_store(engine) -> ChunkKV:
    """The engine's chunk owner, made on first use (held by its KV manager)."""
    kv = engine.kv
    if getattr(kv, "chunks", None) is None:
        model, cfg = engine.model, engine.config
        root = None
        if cfg.rag_kv_disk:
            root = engine.data_root() / "chunk_kv"
        kv.chunks = ChunkKV(
            engine.fingerprint,
            engine.kv_dtype,
            frame_tokens(engine.tokenizer),
            (model.num_layers, model.num_kv_heads, engine.runner.pool.row_dim),
            root,
            budget_bytes=cfg.chunk_kv_bytes,
        )
    return kv.chunks


def filler(engine, store: ChunkKV) -> Filler:
    """The engine's background filler (chatkv.rag.background), made on first use, held by its chunk store."""
    if store.filler is None:
        store.filler = Filler(engine, store, lambda text, ids: entries(engine, store, [text], [ids]))
    return store.filler


def chunk_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def find_spans(tokens: Sequence[int], start: int, chunks: Sequence[list[int]]) -> list[tuple[int, int, int, int]]:
    """Where each chunk's tokens sit in ``tokens[start:]``, in order: ``(chunk index, position,
    offset into the chunk, length)``. A chunk is matched whole, else without its first and last
    token (tokenisation may merge them with their neighbours); one not found is left out."""
    out, at = [], start
    for i, c in enumerate(chunks):
        for off, n in ((0, len(c)), (1, len(c) - 2)):
            if n < 2:
                continue
            pos = _find(tokens, c[off : off + n], at)
            if pos >= 0:
                out.append((i, pos, off, n))
                at = pos + n
                break
    return out


def _find(tokens: Sequence[int], run: list[int], at: int) -> int:
    first, n = run[0], len(run)
    for p in range(at, len(tokens) - n + 1):
        if tokens[p] == first and list(tokens[p : p + n]) == run:
            return p
    return -1


def entries(engine, store: ChunkKV, texts: Sequence[str], ids: Sequence[list[int]]) -> list[ChunkEntry]:
    """Each chunk's canonical KV: from memory or disk, the missing ones computed in one forward."""
    got: list[ChunkEntry | None] = [store.get(t, c) for t, c in zip(texts, ids)]
    missing = [i for i, e in enumerate(got) if e is None]
    if missing:
        for i, (k, v) in zip(missing, compute_canonical(engine, store.frame, [ids[i] for i in missing])):
            got[i] = store.put(texts[i], ids[i], k, v)
    return got  # type: ignore[return-value]


def precompute(engine, texts: Sequence[str], batch: int = 8, progress=None) -> int:
    """Compute ahead of time the chunk KV of ``texts`` (as a prompt quotes them:
    ``rag.source_texts``) that the store has neither in memory nor on
    disk, ``batch`` chunks a forward, on the engine's loop; ``progress(done, total)`` after
    each batch. Returns how many were computed."""
    store = chunk_store(engine)
    todo = list(dict.fromkeys(t for t in texts if t))
    computed = 0
    for i in range(0, len(todo), batch):
        part = todo[i : i + batch]
        ids = [chunk_ids(engine.tokenizer, t) for t in part]
        before = store.computed
        engine.on_loop(lambda: entries(engine, store, part, ids))
        computed += store.computed - before
        if progress is not None:
            progress(min(i + batch, len(todo)), len(todo))
    return computed


def precompute_with_bar(engine, texts: Sequence[str], progress: bool) -> int:
    """``precompute`` with a tqdm bar on stderr when ``progress`` (``kb.add(precompute_kv=True)``,
    ``chatkv ingest --kv``)."""
    if not progress:
        return precompute(engine, texts)
    from tqdm import tqdm

    with tqdm(total=len(set(texts)), desc="chunk KV", unit="chunk") as bar:
        return precompute(engine, texts, progress=lambda done, total: bar.update(done - bar.n))


def compute_canonical(engine, frame: Sequence[int], chunks: Sequence[list[int]]):
    """Per chunk, its per-layer KV rows (stored form) computed after ``frame`` at positions
    ``len(frame)..``: one forward over blocks of their own, given back after."""
    kv, runner, pool = engine.kv, engine.runner, engine.runner.pool
    bs, f = pool.block_size, len(frame)
    tables = []
    try:
        for c in chunks:
            need = -(-(f + len(c)) // bs)
            if not kv.make_room(need):
                raise OutOfBlocks(f"no room for {need} KV blocks to compute a chunk's KV")
            tables.append(pool.allocate(need))
        items = [BatchItem(list(frame) + list(c), 0, t, "none") for c, t in zip(chunks, tables)]
        runner.forward(runner.build_batch(items))
        out = []
        for c, t in zip(chunks, tables):
            rows = pool.read(t, f + len(c))[:, :, f:].clone()
            out.append(([rows[i, 0] for i in range(rows.shape[0])], [rows[i, 1] for i in range(rows.shape[0])]))
        return out
    finally:
        for t in tables:
            pool.decref(t)


def recomputes_all(spans, mode: str, edge_tokens: int, ratio: float) -> bool:
    """Whether the mode would recompute every token of every found chunk (nothing reused)."""
    if mode == "edge":
        return all(n <= edge_tokens for *_, n in spans)
    return ratio >= 1


def place(
    engine,
    kept: RetainedKV | None,
    tokens: list[int],
    start: int,
    texts: Sequence[str],
    namespace: Hashable,
    old_namespace: Hashable | None,
    migrate: bool,
    mode: str,
    edge_tokens: int,
    ratio: float,
    full_as_prefill: bool = True,
    upto: int | None = None,
    check_layers: int | None = None,
    compute_missing: bool = True,
) -> Placed:
    """Build the KV of ``tokens`` up to the end of the last source placed in ``tokens[start:]``,
    or up to ``upto`` when that is further by at most ``max_batch_tokens`` (what one step
    computes: a longer tail would hold other requests back; the scheduler computes it in its
    chunks). A turn passes its prompt's length less one: the tokens after the sources are
    computed in the same forward, and the scheduler computes only the last, for its logits, in
    a decode step: one pass over the weights less per turn. ``texts``: the sources' texts as the
    prompt holds them. The KV is built in radix ``namespace``, continuing
    ``kept`` (the history's KV). With ``migrate`` the history lives in ``old_namespace`` (the
    shared tree): the longest prefix of ``tokens`` it holds (a system prompt, pinned documents,
    earlier turns) is matched first and only sources after it are placed; the whole blocks
    before the first placed source that it lacks are computed into it first (as prefix caching
    alone would), then copied into ``namespace``: what is private begins where placed KV
    begins. ``kept`` is ended; the Placed's handle replaces it
    (``private``: it is in ``namespace``; else nothing was placed and it is in the namespace it was).

    A source whose chunk KV is not stored is left to be computed as any prompt token is; without
    ``compute_missing`` (a turn) it is queued for chatkv.rag.background, which makes its KV
    when the engine is idle, so a turn never computes more than prefix caching alone would.

    When every chunk token would be recomputed (``blend`` at 100%, ``edge`` at least as long
    as every chunk) nothing is placed (``full_as_prefill``): the scheduler computes the prompt
    in the very forwards full prefill runs, so the result is full prefill's token for token.
    Computing it here instead, in one forward of another length, is the same math but not the
    same rounding in bf16 (a GEMM's row depends on the row count there: oneDNN picks its
    kernel by shape), which flipped greedy near-ties of the default model. The Placed then
    only counts the chunk tokens as ``recomputed``. ``check_layers``: blend's (None: the
    engine's ``rag_check_layers``)."""
    kv: KVManager = engine.kv
    ids = [chunk_ids(engine.tokenizer, t) for t in texts]
    spans = find_spans(tokens, start, ids)
    if not spans:
        return Placed(kept, private=not migrate)
    if full_as_prefill and recomputes_all(spans, mode, edge_tokens, ratio):
        return Placed(kept, recomputed=sum(n for *_, n in spans), private=not migrate)
    shared_ns = old_namespace if migrate else namespace
    shared = max(kv.cached_len(tokens, shared_ns), kept.kv_len if kept is not None else 0)
    spans = [sp for sp in spans if sp[1] >= shared]  # before it: in the tree already, nothing to place
    store = chunk_store(engine)
    try:
        if compute_missing:
            found = entries(engine, store, [texts[i] for i, *_ in spans], [ids[i] for i, *_ in spans])
        else:
            found = [store.get(texts[i], ids[i]) for i, *_ in spans]
    except Exception as e:  # noqa: BLE001 - nothing moved: the sources are computed as usual
        log.warning("the sources' chunk KV is unavailable (%s: %s); computing them instead", type(e).__name__, e)
        return Placed(kept, private=not migrate)
    missing = [i for (i, *_), e in zip(spans, found) if e is None]
    if missing:  # computed in this turn as any prompt token; their KV made when the engine is idle
        filler(engine, store).add([texts[i] for i in missing], [ids[i] for i in missing])
    pairs = [(sp, e) for sp, e in zip(spans, found) if e is not None]
    if not pairs:
        return Placed(kept, private=not migrate)
    spans, found = [sp for sp, _ in pairs], [e for _, e in pairs]
    threads = getattr(engine, "threads", None)
    if threads is not None:  # between steps: as many threads as there are free cores, as a step has
        threads.adjust()
    end = spans[-1][1] + spans[-1][3]
    if upto is not None and 0 < min(upto, len(tokens) - 1) - end <= engine.config.max_batch_tokens:
        end = min(upto, len(tokens) - 1)  # a longer tail is the scheduler's, in its chunks between steps
    if migrate:
        try:
            req, shared_computed = _continue_privately(engine, kept, tokens, spans[0][1], old_namespace, namespace)
        except OutOfBlocks as e:
            log.warning("no room to copy a conversation's KV for its sources' chunk KV (%s)", e)
            return Placed(None, private=False)
    else:
        req, shared_computed = _Req(tokens, namespace, prefix=kept), 0
        kv.attach(req)
    try:
        if not kv.reserve(req.kv, end - req.kv.num_computed):
            raise OutOfBlocks(f"no room for the KV of a {end}-token prompt's sources")
        out = _build(
            engine,
            req,
            spans,
            found,
            end,
            mode,
            edge_tokens,
            ratio,
            engine.config.rag_check_layers if check_layers is None else check_layers,
        )
        req.kv.num_computed = max(end, req.kv.num_computed)
        out.computed += shared_computed
    except Exception as e:  # noqa: BLE001 - the history's KV is kept; the rest is computed as usual
        log.warning("placing the sources' chunk KV failed (%s: %s); computing them instead", type(e).__name__, e)
        out = Placed(None)
    out.end = req.kv.num_computed
    out.kept = kv.release(req, retain=True)
    return out


def _continue_privately(
    engine, kept: RetainedKV | None, tokens: list[int], first: int, old_ns, namespace
) -> tuple[_Req, int]:
    """A request for ``tokens`` in ``namespace`` (a conversation's private one, empty) holding
    the longest prefix the shared tree (``old_ns``) has of them, with the history's own tail
    (``kept``, ended). The whole blocks before ``first`` (the first placed source) that the
    tree lacks are computed into the shared tree first, as prefix caching alone computes
    them, so the next session with the same system prompt and pinned documents finds them;
    the private namespace gets a copy (a block lives in one namespace of the tree).
    Returns the request and how many tokens it computed. OutOfBlocks (``kept`` ended, nothing
    held) when there is no room."""
    kv, runner, bs = engine.kv, engine.runner, engine.kv.block_size
    upto = first // bs * bs
    r0 = _Req(tokens, old_ns, prefix=kept)
    kv.attach(r0)
    t0, computed = r0.kv, 0
    try:
        if t0.num_computed < upto:
            if not kv.reserve(t0, upto - t0.num_computed):
                raise OutOfBlocks(f"no room for the KV of a {upto}-token shared prefix")
            at = t0.num_computed
            runner.forward(runner.build_batch([BatchItem(tokens[at:upto], at, t0.blocks, "none")]))
            t0.num_computed, computed = upto, upto - at
    finally:
        held = kv.release(r0, retain=True)
    moved = None
    if held is not None:
        try:
            k, v = kv.export_kv(held)
            moved = kv.import_kv(tokens, held.kv_len, k, v, namespace=namespace)
        finally:
            kv.drop(held)
    req = _Req(tokens, namespace, prefix=moved)
    kv.attach(req)
    return req, computed


def for_turn(turn, kept: RetainedKV | None, context: list[int]) -> RetainedKV | None:
    """The hook of ``Turn._admit`` (loop thread): place the turn's sources whose chunk KV is
    stored, after the longest prefix the shared tree holds (pinned documents are part of that
    prefix: computed once, then shared by every session that pins them, never placed), making
    the conversation's KV private (a new window epoch) the first time one is placed;
    ``turn.placed`` says what was done. Returns the KV the request continues from."""
    m, s, st, cfg = turn.m, turn.s, turn.st, turn.engine.config
    if not turn.engine.kv.sharing:  # placed KV reaches the request through the tree: none without caching
        return kept
    migrate = not st.private
    old_ns = m.kv_namespace(s.id, st) or turn.user_ns
    if migrate:
        st.private, st.epoch = True, st.epoch + 1  # from now on this conversation's KV is its own
    from chatkv.rag import context as rag

    texts = rag.source_texts(turn.hits)  # each with its label: only its number "[n] " is left to compute
    prompt = context + turn.delta
    placed = place(
        turn.engine,
        kept,
        prompt,
        len(context),
        texts,
        m.kv_namespace(s.id, st),
        old_ns,
        migrate,
        cfg.rag_kv_reuse,
        cfg.rag_edge_tokens,
        cfg.rag_recompute_ratio,
        upto=len(prompt) - 1,
        compute_missing=False,
    )
    if not placed.private and migrate:
        st.private, st.epoch = False, st.epoch - 1
    turn.placed = placed if placed.private or placed.recomputed else None  # usage's counts
    return placed.kept


def _build(
    engine,
    req: _Req,
    spans,
    found: list[ChunkEntry],
    end: int,
    mode: str,
    edge_tokens: int,
    ratio: float,
    check_layers: int,
) -> Placed:
    """Place the found chunks' KV into ``req``'s blocks and compute the rest of ``tokens[h0:end]``."""
    model, runner, pool = engine.model, engine.runner, engine.runner.pool
    quant = pool.quant
    table, tokens, h0 = req.kv.blocks, req.token_ids, req.kv.num_computed
    pairs = [(s, e) for s, e in zip(spans, found) if s[1] >= h0]  # else its KV is there already (shared tree)
    if not pairs:
        return Placed(None)
    spans = [s for s, _ in pairs]
    reused = torch.zeros(len(tokens), dtype=torch.bool)
    for (_, pos, off, n), e in pairs:
        delta = pos - off - e.frame
        k = [model.rotate_keys(x[off : off + n].to(pool.kv.device), delta, quant) for x in e.k]
        v = [x[off : off + n].to(pool.kv.device) for x in e.v]
        pool.write(table, pos, k, v)
        reused[pos : pos + n] = True
    if mode == "blend" and 0 < ratio < 1 and len(model.layers) > 1:  # every token from layer 0, fewer past each check
        n_chunk = int(reused[h0:end].sum())
        shares = chunk_blend.checks(ratio, check_layers, len(model.layers))
        kept = chunk_blend.forward(engine, tokens, table, h0, end, reused, shares)
        return Placed(None, reused=n_chunk - kept, recomputed=kept, computed=end - h0 - n_chunk + kept)
    recompute = _choose(spans, mode, edge_tokens, ratio)
    for p in recompute:
        reused[p] = False
    compute = [p for p in range(h0, end) if not reused[p]]
    if compute:  # one item at the chosen positions: one attention call per layer, however scattered
        item = BatchItem([tokens[p] for p in compute], compute[0], table, "none", positions=compute)
        runner.forward(runner.build_batch([item]))
    return Placed(None, reused=int(reused[h0:end].sum()), recomputed=len(recompute), computed=len(compute))


def _choose(spans, mode: str, edge_tokens: int, ratio: float) -> list[int]:
    """The chunk positions to recompute through every layer when no layer's KV chooses them:
    ``edge``'s first tokens of each chunk, blend at 0% or 100%, or a one-layer model's blend
    (no later layer to compare: each chunk's first ``ratio`` share)."""
    if mode == "edge":
        return [p for _, pos, _, n in spans for p in range(pos, pos + min(n, edge_tokens))]
    return [p for _, pos, _, n in spans for p in range(pos, pos + math.ceil(min(max(ratio, 0.0), 1.0) * n))]
