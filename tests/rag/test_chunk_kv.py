"""Position-independent chunk KV (chatkv.rag.chunk_kv, chatkv.rag.placement,
storage.chunk_segments) on a seeded tiny fp32 model, against transformers' own forward:
re-rotated chunk KV equals the KV computed at that position, full recompute equals full
prefill, chunk KV survives a restart on disk, changed text gets new KV, damage is recomputed,
and placed KV lives in the conversation's own radix namespace."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from chatkv import Engine
from chatkv.config import EngineConfig
from chatkv.errors import InvalidRequest
from chatkv.rag import blend as chunk_blend
from chatkv.rag import placement as cp
from tests.rag.test_rag_sessions import DOCS
from tests.support.disks import fill, small_disk  # noqa: F401 (a fixture)

pytestmark = pytest.mark.tiny_model("llama", seed=21, max_position_embeddings=1024, num_hidden_layers=3)

GREEDY = dict(max_tokens=8, temperature=0.0)
QUESTIONS = ["How often should the kettle be descaled?", "And how do I collimate a reflector telescope?"]
CHUNK = "The Brewmaster kettle boils a litre of water in ninety seconds. Its base must be descaled monthly."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name, text in DOCS.items():
        (d / name).write_text(text)
    return d


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 200)
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


def hf_kv(hf, ids: list[int], positions: list[int]):
    """transformers' per-layer keys and values ``[tokens, kv_heads, head_dim]`` of ``ids`` at ``positions``."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True)
    cache = out.past_key_values
    ks, vs = [], []
    for i in range(hf.config.num_hidden_layers):
        if hasattr(cache, "layers"):
            k, v = cache.layers[i].keys, cache.layers[i].values
        elif hasattr(cache, "key_cache"):
            k, v = cache.key_cache[i], cache.value_cache[i]
        else:
            k, v = cache[i]
        ks.append(k[0].transpose(0, 1))
        vs.append(v[0].transpose(0, 1))
    return ks, vs, out.logits[0]


def test_rerotated_chunk_kv_equals_the_kv_computed_at_that_position(model_dir, hf, tmp_path):
    """The chunk's KV in its canonical frame, keys re-rotated to position ``at``, is the KV that
    transformers computes for the frame + chunk placed so the chunk starts at ``at`` (what the
    chunk's own prefix fixes), in fp32 within 1e-4."""
    e = engine_at(model_dir, tmp_path)
    try:
        frame = cp.frame_tokens(e.tokenizer)
        ids = cp.chunk_ids(e.tokenizer, CHUNK)
        [(k, v)] = cp.compute_canonical(e, frame, [ids])
        for at in (len(frame), 37, 300):
            rk = [e.model.rotate_keys(x, at - len(frame)) for x in k]
            ref_k, ref_v, _ = hf_kv(hf, frame + ids, list(range(at - len(frame), at + len(ids))))
            for i in range(len(k)):
                torch.testing.assert_close(rk[i], ref_k[i][len(frame) :], atol=1e-4, rtol=0)
                torch.testing.assert_close(v[i], ref_v[i][len(frame) :], atol=1e-4, rtol=0)
    finally:
        e.close()


def _prompt(e, texts):
    """A prompt holding ``texts`` as sources the way chatkv.rag.context writes them, and its token ids."""
    from types import SimpleNamespace

    from chatkv.rag import context as rag

    hits = [
        SimpleNamespace(text=t, source=f"doc{i}.md", heading="", document_id=i, ordinal=0) for i, t in enumerate(texts)
    ]
    msg = rag.user_message("What does the kettle do?", hits)
    text = e.tokenizer.apply_chat_template(
        [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
    )
    return e.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("mode,ratio,exact", [("blend", 1.0, True), ("edge", 1000, True), ("blend", 0.0, False)])
def test_placement_against_full_prefill(model_dir, hf, tmp_path, mode, ratio, exact):
    """With every chunk token recomputed the placed KV is full prefill's (transformers' forward
    on the whole prompt), layer by layer; with none recomputed layer 0 still is (its KV depends
    on no other token) and a later layer is not (the chunk never saw the other one)."""
    e = engine_at(model_dir, tmp_path, rag_kv_reuse=mode)
    try:
        texts = [CHUNK, "A refractor uses lenses, a reflector uses mirrors. Collimate a reflector before each night."]
        tokens = list(_prompt(e, texts))
        edge = int(ratio) if mode == "edge" else 0
        # the machinery itself; exact: through the prompt's last token but one, as a turn places it
        # (the instruction and question after the sources computed in the same forward)
        upto = len(tokens) - 1 if exact else None
        placed = e.on_loop(
            lambda: cp.place(
                e,
                None,
                tokens,
                0,
                texts,
                ("test", "private"),
                None,
                False,
                mode,
                edge,
                min(float(ratio), 1.0),
                full_as_prefill=False,
                upto=upto,
            )
        )
        assert placed.private and placed.end == (upto or placed.end) < len(tokens)
        n_chunks = sum(len(cp.chunk_ids(e.tokenizer, t)) for t in texts)
        assert placed.reused + placed.recomputed == n_chunks
        assert placed.reused == (0 if exact else n_chunks)
        k, v = e.on_loop(lambda: e.kv.export_kv(placed.kept))
        ref_k, ref_v, _ = hf_kv(hf, tokens, list(range(len(tokens))))
        n = placed.end
        torch.testing.assert_close(k[0], ref_k[0][:n], atol=1e-4, rtol=0)
        if exact:
            for i in range(len(k)):
                torch.testing.assert_close(k[i], ref_k[i][:n], atol=1e-4, rtol=0)
                torch.testing.assert_close(v[i], ref_v[i][:n], atol=1e-4, rtol=0)
        else:
            assert (k[-1] - ref_k[-1][:n]).abs().max() > 1e-3
        e.on_loop(lambda: e.kv.drop(placed.kept))
        e.check_integrity()
    finally:
        e.close()


def test_blend_recomputes_the_top_share_of_all_chunks_by_their_layer1_deviation(model_dir, hf, tmp_path):
    """Blend's choice against an oracle: layer 1's KV of a from-scratch prefill (transformers)
    against the reused rows. The ratio is a share of all placed chunk tokens together (as
    CacheBlend selects), so a chunk that the others change more gets more of the recompute;
    the rows chosen are the top share by that deviation. Every token computes layers 0 and 1
    (its fresh KV replaces the copy there: layer 1 is from-scratch's for every row); only the
    chosen go on, so layer 2 shows which were chosen (a chosen row is from-scratch's, the
    others the reused copy)."""
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="blend")
    try:
        texts = [
            CHUNK,
            "A refractor uses lenses, a reflector uses mirrors. Collimate a reflector before each night.",
            "Descale the kettle with citric acid; rinse it twice before the next boil.",
        ]
        tokens = list(_prompt(e, texts))
        ids = [cp.chunk_ids(e.tokenizer, t) for t in texts]
        spans = cp.find_spans(tokens, 0, ids)
        chunk_pos = torch.tensor([p for _, pos, _, n in spans for p in range(pos, pos + n)])

        def placed_kv(ratio):
            placed = e.on_loop(
                lambda: cp.place(
                    e,
                    None,
                    tokens,
                    0,
                    texts,
                    ("t", ratio),
                    None,
                    False,
                    "blend",
                    0,
                    ratio,
                    full_as_prefill=False,
                    check_layers=1,
                )
            )
            k, v = e.on_loop(lambda: e.kv.export_kv(placed.kept))
            e.on_loop(lambda: e.kv.drop(placed.kept))
            return placed, k, v

        _, rk, rv = placed_kv(0.0)  # nothing recomputed: every chunk row is the reused copy
        ref_k, ref_v, _ = hf_kv(hf, tokens, list(range(len(tokens))))
        dev = ((ref_k[1][chunk_pos] - rk[1][chunk_pos]) ** 2).sum(dim=(1, 2)) + (
            (ref_v[1][chunk_pos] - rv[1][chunk_pos]) ** 2
        ).sum(dim=(1, 2))
        ratio = 0.3
        want = math.ceil(ratio * len(chunk_pos))
        top = set(chunk_pos[torch.topk(dev, want).indices].tolist())
        per_chunk, at = set(), 0
        for _, pos, _, n in spans:  # r% of each chunk on its own: the selection this replaced
            per_chunk |= set(chunk_pos[at + torch.topk(dev[at : at + n], math.ceil(ratio * n)).indices].tolist())
            at += n
        assert top != per_chunk  # this prompt tells the two apart
        placed, k, v = placed_kv(ratio)
        assert placed.recomputed == want and placed.reused == len(chunk_pos) - want
        n = placed.end
        for layer in (0, 1):  # every token computed these: from-scratch's
            torch.testing.assert_close(k[layer], ref_k[layer][:n], atol=1e-4, rtol=0)
            torch.testing.assert_close(v[layer], ref_v[layer][:n], atol=1e-4, rtol=0)
        changed = {int(p) for p in chunk_pos if not torch.equal(k[2][p], rk[2][p])}
        assert changed == top
        for p in top:  # a chosen row went on with exact layers below it: from-scratch's at layer 2
            torch.testing.assert_close(k[2][p], ref_k[2][p], atol=1e-4, rtol=0)
            torch.testing.assert_close(v[2][p], ref_v[2][p], atol=1e-4, rtol=0)
        e.check_integrity()
    finally:
        e.close()


def test_blend_filters_gradually_each_check_layer_choosing_on_its_own_deviation(model_dir, hf, tmp_path):
    """Two check layers (``rag_check_layers=2``, ratio r): layer 1 keeps the top sqrt(r) of the
    placed chunk tokens by layer 1's deviation, layer 2 the top r of those by layer 2's own.
    Against transformers' from-scratch KV: layers 0 and 1 are from-scratch's for every row;
    at layer 2 exactly the rows layer 1 kept are (they computed it over exact layers below),
    the rest the reused copy; and r of the tokens went on through every layer."""
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="blend", rag_check_layers=2)
    try:
        texts = [CHUNK, "A refractor uses lenses, a reflector uses mirrors. Collimate a reflector before each night."]
        tokens = list(_prompt(e, texts))
        spans = cp.find_spans(tokens, 0, [cp.chunk_ids(e.tokenizer, t) for t in texts])
        chunk_pos = torch.tensor([p for _, pos, _, n in spans for p in range(pos, pos + n)])
        assert chunk_blend.checks(0.25, 2, 3) == {1: 0.5, 2: 0.25}
        assert chunk_blend.checks(0.25, 8, 3) == {1: 0.5, 2: 0.25}  # no more checks than layers after layer 0

        def placed_kv(ratio):
            placed = e.on_loop(
                lambda: cp.place(
                    e, None, tokens, 0, texts, ("g", ratio), None, False, "blend", 0, ratio, full_as_prefill=False
                )
            )
            k, v = e.on_loop(lambda: e.kv.export_kv(placed.kept))
            e.on_loop(lambda: e.kv.drop(placed.kept))
            return placed, k, v

        _, rk, rv = placed_kv(0.0)
        ref_k, ref_v, _ = hf_kv(hf, tokens, list(range(len(tokens))))
        dev = ((ref_k[1][chunk_pos] - rk[1][chunk_pos]) ** 2).sum(dim=(1, 2)) + (
            (ref_v[1][chunk_pos] - rv[1][chunk_pos]) ** 2
        ).sum(dim=(1, 2))
        first = set(chunk_pos[torch.topk(dev, math.ceil(0.5 * len(chunk_pos))).indices].tolist())
        placed, k, v = placed_kv(0.25)
        assert placed.recomputed == math.ceil(0.25 * len(chunk_pos))
        assert placed.reused == len(chunk_pos) - placed.recomputed
        n = placed.end
        for layer in (0, 1):
            torch.testing.assert_close(k[layer], ref_k[layer][:n], atol=1e-4, rtol=0)
            torch.testing.assert_close(v[layer], ref_v[layer][:n], atol=1e-4, rtol=0)
        assert {int(p) for p in chunk_pos if not torch.equal(k[2][p], rk[2][p])} == first
        for p in first:
            torch.testing.assert_close(k[2][p], ref_k[2][p], atol=1e-4, rtol=0)
            torch.testing.assert_close(v[2][p], ref_v[2][p], atol=1e-4, rtol=0)
        e.check_integrity()
    finally:
        e.close()


def _replies(model_dir, data_dir, corpus, ahead=False, settle=False, **kw):
    """Both questions in one session: the replies, the session's tokens and the KV stats.
    ``ahead``: every chunk's KV computed first (``precompute_kv``); ``settle``: the chunk KV
    queued by the turns made (chatkv.rag.background) before the stats are taken."""
    from chatkv.rag import background

    e = engine_at(model_dir, data_dir, **kw)
    try:
        kb = e.knowledge_base("docs")
        kb.add([str(corpus)], precompute_kv=ahead)
        s = e.session(knowledge=kb, top_k=2, params=GREEDY)
        out = [s.send(q) for q in QUESTIONS]
        if settle:
            assert background.settle(e, timeout=120)
        e.check_integrity()
        return out, list(s.tokens), e.kv.stats()
    finally:
        e.close()


@pytest.mark.parametrize(
    "dtype,full",
    [
        ("float32", {"rag_kv_reuse": "blend", "rag_recompute_ratio": 1.0}),
        ("bfloat16", {"rag_kv_reuse": "edge", "rag_edge_tokens": 10_000}),
    ],
)
def test_full_recompute_gives_full_prefills_greedy_tokens_and_usage_counts(model_dir, corpus, tmp_path, dtype, full):
    """With every chunk token recomputed (blend 100%, or edge longer than every chunk) a turn
    is full prefill's exactly, token for token, in bf16 too (where one placement forward of
    another length would round differently from the scheduler's chunks)."""
    small = dict(dtype=dtype, max_batch_tokens=64)  # several scheduler chunks a prompt
    off, off_tokens, _ = _replies(model_dir, tmp_path / "off", corpus, rag_kv_reuse="off", **small)
    got, got_tokens, _ = _replies(model_dir, tmp_path / "all", corpus, **small, **full)
    assert got_tokens == off_tokens  # the same greedy replies, token for token, over two turns
    assert [r.text for r in got] == [r.text for r in off]
    assert all(r.usage.reused_tokens == 0 and r.usage.recomputed_tokens > 0 for r in got)
    assert [r.usage.computed_tokens for r in got] == [r.usage.computed_tokens for r in off]
    if dtype == "bfloat16":
        return
    edge, _, stats = _replies(model_dir, tmp_path / "edge", corpus, ahead=True, rag_kv_reuse="edge", rag_edge_tokens=2)
    for r in edge:
        u = r.usage
        assert u.reused_tokens > 0 and u.recomputed_tokens == 2 * len(r.sources)
        assert (
            u.cached_tokens + u.host_tokens + u.restored_tokens + u.computed_tokens + u.reused_tokens == u.prompt_tokens
        )
    assert edge[1].usage.cached_tokens >= len(off_tokens) // 3  # turn 2 continues turn 1's (private) KV
    assert stats["chunk_computed"] >= 2


def test_placed_kv_is_never_shared_under_from_scratch_token_ids(model_dir, corpus, tmp_path):
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="blend", rag_recompute_ratio=0.2)
    try:
        kb = e.knowledge_base("docs")
        kb.add([str(corpus)], precompute_kv=True)
        s = e.session(knowledge=kb, top_k=2, params=GREEDY)
        r = s.send(QUESTIONS[0])
        assert r.usage.reused_tokens > 0
        from chatkv.rag import context as rag

        first_source = cp.find_spans(s.tokens, 0, [cp.chunk_ids(e.tokenizer, t) for t in rag.source_texts(r.sources)])[
            0
        ][1]
        assert e.kv.cached_len(s.tokens) <= first_source  # the default namespace has none of the placed KV
        # a second session asking the same with reuse off computes the sources itself
        e.config.rag_kv_reuse = "off"
        r2 = e.session(knowledge=kb, top_k=2, params=GREEDY).send(QUESTIONS[0])
        assert r2.usage.reused_tokens == 0 and r2.usage.cached_tokens <= first_source
        e.check_integrity()
    finally:
        e.close()


def _placements(monkeypatch) -> list:
    """Every turn's placement from now on, as ``(prompt tokens, Placed.end, Placed.computed)``:
    the real ``chunk_place.place`` runs, its outcome noted."""
    seen, real = [], cp.place

    def spy(engine, kept, tokens, *args, **kwargs):
        out = real(engine, kept, tokens, *args, **kwargs)
        seen.append((list(tokens), out.end, out.computed))
        return out

    monkeypatch.setattr(cp, "place", spy)
    return seen


@pytest.mark.parametrize("mode", ["blend", "edge"])
def test_a_turn_places_through_its_last_prompt_token_but_one(model_dir, corpus, tmp_path, monkeypatch, mode):
    """A RAG turn's placement computes the instruction and the question after the sources in
    the same forward (one pass over the weights less per turn): its KV ends at the prompt's last
    token but one, and the scheduler computes only the last, for the first token's logits."""
    e = engine_at(model_dir, tmp_path, rag_kv_reuse=mode, rag_recompute_ratio=0.3)
    seen = _placements(monkeypatch)
    try:
        kb = e.knowledge_base("docs")
        kb.add([str(corpus)], precompute_kv=True)
        s = e.session(knowledge=kb, top_k=2, params=GREEDY)
        for q in QUESTIONS:  # a first turn, then one after a history
            r = s.send(q)
            tokens, end, computed = seen.pop()
            assert r.usage.reused_tokens > 0 and end == len(tokens) - 1
            assert r.usage.computed_tokens == computed + 1, r.usage
        e.check_integrity()
    finally:
        e.close()


def test_a_tail_longer_than_a_step_is_left_to_the_scheduler(model_dir, corpus, tmp_path, monkeypatch):
    """Placement runs on the loop between steps: it computes the instruction and question after
    the sources only when they fit one step's budget (``max_batch_tokens``); a longer tail is
    the scheduler's, in its chunks, and placement ends at the last source as before."""
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="blend", rag_recompute_ratio=0.3, max_batch_tokens=8)
    seen = _placements(monkeypatch)
    try:
        kb = e.knowledge_base("docs")
        kb.add([str(corpus)], precompute_kv=True)
        s = e.session(knowledge=kb, top_k=2, params=GREEDY)
        r = s.send(QUESTIONS[0] + " Please answer in one short sentence with the source's number.")
        tokens, end, computed = seen.pop()
        from chatkv.rag import context as rag

        spans = cp.find_spans(tokens, 0, [cp.chunk_ids(e.tokenizer, t) for t in rag.source_texts(r.sources)])
        assert end == spans[-1][1] + spans[-1][3] and len(tokens) - 1 - end > 8
        assert r.usage.reused_tokens > 0 and r.usage.computed_tokens == computed + len(tokens) - end
        e.check_integrity()
    finally:
        e.close()


def test_chunk_kv_comes_back_from_disk_after_a_restart(model_dir, corpus, tmp_path):
    """The chunk KV the background made after the first engine's turns is on disk: a second
    engine's turns place it, reading it back rather than computing it."""
    _, _, first = _replies(model_dir, tmp_path, corpus, settle=True, rag_kv_reuse="edge")
    assert first["chunk_computed"] >= 2 and first["chunk_loaded"] == 0
    assert list((tmp_path / "chunk_kv").glob("chunk-*.safetensors"))
    _, _, second = _replies(model_dir, tmp_path, corpus, rag_kv_reuse="edge")
    assert second["chunk_computed"] == 0 and second["chunk_loaded"] >= 2  # read back, not recomputed


def test_changed_text_gets_new_kv_and_damage_is_recomputed(model_dir, tmp_path, caplog):
    e = engine_at(model_dir, tmp_path)
    try:
        store = cp.chunk_store(e)
        old, new = CHUNK, CHUNK.replace("monthly", "weekly")
        ids_old, ids_new = cp.chunk_ids(e.tokenizer, old), cp.chunk_ids(e.tokenizer, new)
        [a] = e.on_loop(lambda: cp.entries(e, store, [old], [ids_old]))
        [b] = e.on_loop(lambda: cp.entries(e, store, [new], [ids_new]))
        assert a.key != b.key and store.computed == 2
        [(fresh_k, _)] = e.on_loop(lambda: cp.compute_canonical(e, store.frame, [ids_new]))
        for x, y in zip(b.k, fresh_k):
            torch.testing.assert_close(x, y, atol=0, rtol=0)  # the new text's KV, never the old
        assert a.tokens != b.tokens and b.tokens == tuple(ids_new)
        path = tmp_path / "chunk_kv" / f"{b.key}.safetensors"
        raw = bytearray(path.read_bytes())
        raw[-20:] = bytes(20)  # damage its tensor bytes
        path.write_bytes(bytes(raw))
    finally:
        e.close()
    e = engine_at(model_dir, tmp_path)
    try:
        store = cp.chunk_store(e)
        with caplog.at_level(logging.WARNING, logger="chatkv"):
            [c] = e.on_loop(lambda: cp.entries(e, store, [new], [ids_new]))
        assert store.computed == 1 and store.loaded == 0
        assert any("chunk KV" in r.getMessage() for r in caplog.records)
        for x, y in zip(c.k, fresh_k):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
        [d] = e.on_loop(lambda: cp.entries(e, store, [old], [ids_old]))  # the intact file is read back
        assert store.loaded == 1 and d.key == a.key
    finally:
        e.close()


def test_a_full_disk_keeps_the_chunk_kv_in_memory_and_writes_it_once_there_is_room(model_dir, small_disk, caplog):
    """The chunk KV directory on a real full disk (a filled tmpfs): computing a chunk's KV warns
    that it could not be written, the turn gets the computed KV all the same (the numbers a fresh
    computation gives), and no file or temporary is left half written. Once the disk has room, the
    next engine computes it again, writes it, and a third reads it back."""
    data = small_disk / "data"
    data.mkdir()
    (data / "chunk_kv").mkdir()
    filler = fill(small_disk)
    e = engine_at(model_dir, data)
    try:
        store = cp.chunk_store(e)
        ids = cp.chunk_ids(e.tokenizer, CHUNK)
        with caplog.at_level(logging.WARNING, logger="chatkv"):
            [a] = e.on_loop(lambda: cp.entries(e, store, [CHUNK], [ids]))
        assert any("could not be written" in r.getMessage() for r in caplog.records)
        [(fresh_k, fresh_v)] = e.on_loop(lambda: cp.compute_canonical(e, store.frame, [ids]))
        for x, y in zip(a.k + a.v, fresh_k + fresh_v):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
        assert list((data / "chunk_kv").iterdir()) == []  # no partial file, no temporary
    finally:
        e.close()
    filler.unlink()
    for expect_loaded in (0, 1):
        e = engine_at(model_dir, data)
        try:
            store = cp.chunk_store(e)
            [b] = e.on_loop(lambda: cp.entries(e, store, [CHUNK], [ids]))
            assert (store.loaded, store.computed) == ((0, 1) if expect_loaded == 0 else (1, 0))
            for x, y in zip(b.k, fresh_k):
                torch.testing.assert_close(x, y, atol=0, rtol=0)
        finally:
            e.close()
    assert len(list((data / "chunk_kv").glob("chunk-*.safetensors"))) == 1


def test_blends_choice_keeps_every_token_between_the_chunks_and_a_non_finite_row():
    """``_keep``: the rows between the chunks always go on, then the chunk rows by deviation; a
    chunk row whose deviation is NaN or inf (non-finite KV) counts as the most deviant, never
    pushing a row between the chunks out."""
    kc, vc = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)  # 8 slots of one head of 2
    slots = torch.arange(6)
    k = torch.tensor(
        [[[0.0, 0.0]], [[1.0, 0.0]], [[float("nan"), 0.0]], [[0.0, 0.0]], [[3.0, 0.0]], [[float("inf"), 0.0]]]
    )
    chunk = torch.tensor([False, True, True, False, True, True])
    assert chunk_blend.keep_rows(kc, vc, slots, k, torch.zeros_like(k), chunk, 2, None).tolist() == [0, 2, 3, 5]
    assert chunk_blend.keep_rows(kc, vc, slots, k, torch.zeros_like(k), chunk, 3, None).tolist() == [0, 2, 3, 4, 5]
    assert chunk_blend.keep_rows(kc, vc, slots, k, torch.zeros_like(k), chunk, 9, None).tolist() == [0, 1, 2, 3, 4, 5]
    one = chunk_blend.keep_rows(kc, vc, slots, k, torch.zeros_like(k), chunk, 1, None).tolist()
    assert len(one) == 3 and {0, 3} < set(one) and set(one) - {0, 3} <= {2, 5}  # two non-finite rows for one place


def test_bad_options_are_refused():
    bad = [
        {"rag_kv_reuse": "always"},
        {"rag_recompute_ratio": 1.5},
        {"rag_recompute_ratio": float("nan")},
        {"rag_edge_tokens": -1},
    ]
    bad += [{"rag_check_layers": n} for n in (0, -1, 65, 10**30, True, 2.5, float("nan"), "4", None)]
    for kw in bad:
        with pytest.raises(InvalidRequest, match=next(iter(kw))):
            EngineConfig.from_kwargs(**kw)


def test_kb_add_precompute_kv_computes_every_chunk_ahead_of_the_first_turn(model_dir, corpus, tmp_path):
    from chatkv.retrieval import KnowledgeBase

    e = engine_at(model_dir, tmp_path, rag_kv_reuse="edge")
    try:
        kb = e.knowledge_base("docs")
        report = kb.add([str(corpus)], precompute_kv=True)
        n_chunks = sum(len(kb.chunks_of(d.source)) + 1 for d in kb.documents())  # each chunk, and each document whole
        assert report.kv_chunks == n_chunks > 0
        assert kb.add([str(corpus)], precompute_kv=True).kv_chunks == 0  # already there
        r = e.session(knowledge=kb, top_k=2, params=GREEDY).send(QUESTIONS[0])
        assert r.usage.reused_tokens > 0
        assert e.kv.stats()["chunk_computed"] == n_chunks  # the turn computed no chunk KV of its own
    finally:
        e.close()
    plain = KnowledgeBase.open("docs", data_dir=tmp_path)
    try:
        with pytest.raises(InvalidRequest, match="precompute_kv needs the chat model"):
            plain.add([str(corpus)], precompute_kv=True)
    finally:
        plain.close()


def test_a_conversation_with_placed_kv_resumes_from_its_snapshot(model_dir, corpus, tmp_path):
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="edge")
    try:
        kb = e.knowledge_base("docs")
        kb.add([str(corpus)], precompute_kv=True)
        s = e.session(knowledge=kb, top_k=2, params=GREEDY)
        assert s.send(QUESTIONS[0]).usage.reused_tokens > 0
        conv, tokens = s.id, list(s.tokens)
        s.close()
    finally:
        e.close()
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="edge")
    try:
        s = e.resume(conv)
        assert s.tokens == tokens
        r = s.send(QUESTIONS[1])
        assert r.usage.restored_tokens >= len(tokens) - e.kv.block_size  # the private KV came back from disk
        assert r.usage.reused_tokens > 0
        stored = s.messages()[-1]  # the reply's counts are stored with it (migration 0007)
        assert (stored.reused_tokens, stored.recomputed_tokens) == (r.usage.reused_tokens, r.usage.recomputed_tokens)
        e.check_integrity()
    finally:
        e.close()


def test_the_servers_usage_carries_reused_and_recomputed_tokens():
    from chatkv.outputs import Usage
    from chatkv.server.chat_shapes import sum_usage, usage_json

    u = sum_usage([Usage(prompt_tokens=10, reused_tokens=6, recomputed_tokens=1, computed_tokens=4)] * 2)
    details = usage_json(u)["prompt_tokens_details"]
    assert (details["reused_tokens"], details["recomputed_tokens"]) == (12, 2)
    cols = Usage(reused_tokens=3, recomputed_tokens=1).message_columns()  # stored with the reply (migration 0007)
    assert (cols["reused_tokens"], cols["recomputed_tokens"]) == (3, 1)


def test_one_item_recomputing_scattered_tokens_gives_full_prefills_kv(model_dir, hf, tmp_path):
    """The recompute forward (one item at the chosen positions, chatkv.engine.model_runner.BatchItem's
    ``positions``) over KV that is full prefill's everywhere else gives full prefill's KV at
    those positions in every layer, in fp32 within 1e-4 of transformers: each recomputed token
    sees the tokens before it, the others recomputed with it included, and none after it."""
    from chatkv.engine.model_runner import BatchItem

    e = engine_at(model_dir, tmp_path)
    try:
        tokens = list(_prompt(e, [CHUNK]))
        pool, runner = e.runner.pool, e.runner
        ref_k, ref_v, _ = hf_kv(hf, tokens, list(range(len(tokens))))
        g = torch.Generator().manual_seed(5)
        at = sorted(torch.randperm(len(tokens) - 8, generator=g)[:17].tolist())  # scattered, not the last ones

        def run():
            table = pool.allocate(-(-len(tokens) // pool.block_size))
            try:
                runner.forward(runner.build_batch([BatchItem(tokens, 0, table, "none")]))
                for p in at:  # stale rows at the chosen positions, in every layer
                    noise = [torch.randn(1, *pool.kv.shape[-2:], generator=g) * 50 for _ in range(pool.kv.shape[0])]
                    pool.write(table, p, noise, noise)
                runner.forward(
                    runner.build_batch([BatchItem([tokens[p] for p in at], at[0], table, "none", positions=at)])
                )
                return pool.read(table, len(tokens)).clone()
            finally:
                pool.decref(table)

        kv = e.on_loop(run)
        for i in range(kv.shape[0]):
            torch.testing.assert_close(kv[i, 0], ref_k[i], atol=1e-4, rtol=0)
            torch.testing.assert_close(kv[i, 1], ref_v[i], atol=1e-4, rtol=0)
        e.check_integrity()
    finally:
        e.close()


def test_pinned_documents_are_the_shared_prefix_and_sources_are_placed_after_them(model_dir, corpus, tmp_path):
    """Pinned documents are never placed, even with their KV precomputed: the first turn
    computes them into the shared tree (as ``off`` does) and places only the sources after
    them; the next session with the same system prompt and document finds them cached."""
    pinned = [str(corpus / "bread.md")]
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="edge", rag_edge_tokens=2)
    try:
        kb = e.knowledge_base("docs")
        kb.add([str(corpus)], precompute_kv=True)
        prefix = None
        for _ in range(2):
            s = e.session(system="Answer briefly.", knowledge=kb, documents=pinned, top_k=2, params=GREEDY)
            r = s.send(QUESTIONS[0])
            prefix = len(e.session_manager.renderer.system_prefix(s.system_content))
            spans = cp.find_spans(s.tokens, 0, [cp.chunk_ids(e.tokenizer, t) for t in rag_texts(r.sources)])
            assert spans[0][1] > prefix  # the first placed run is a source, after the system message
            assert r.usage.recomputed_tokens == 2 * len(r.sources)  # each source's first 2 tokens: no document
        assert r.usage.cached_tokens >= prefix // 16 * 16  # the second session: the whole blocks, cached
        e.check_integrity()
    finally:
        e.close()


def rag_texts(sources):
    from chatkv.rag import context as rag

    return rag.source_texts(sources)


def test_chatkv_ingest_kv_computes_the_chunk_kv_a_chat_then_reads_from_disk(
    model_dir, corpus, tmp_path, monkeypatch, capsys
):
    """``chatkv ingest --kv --model DIR``: every chunk's and document's KV computed by the CLI on
    the named model and written to disk; an engine on that model then places it without
    computing any. A missing model or --model without --kv is a clear error."""
    from chatkv.cli import main

    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    assert main(["ingest", str(corpus), "--kb", "docs", "--kv", "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "chunk KV: " in out and "3 added" in out
    n = int(out.split("chunk KV: ")[1].split()[0])
    assert n > 0 and len(list((tmp_path / "chunk_kv").glob("chunk-*.safetensors"))) == n
    assert main(["ingest", str(corpus), "--kb", "docs", "--kv", "--model", str(model_dir)]) == 0
    assert "chunk KV: 0 chunks" in capsys.readouterr().out  # already on disk
    e = engine_at(model_dir, tmp_path, rag_kv_reuse="edge")
    try:
        r = e.session(knowledge=e.knowledge_base("docs"), top_k=2, params=GREEDY).send(QUESTIONS[0])
        stats = e.kv.stats()
        assert r.usage.reused_tokens > 0 and stats["chunk_computed"] == 0 and stats["chunk_loaded"] >= 1
    finally:
        e.close()
    assert main(["ingest", str(corpus), "--kb", "docs", "--kv", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["ingest", str(corpus), "--kb", "docs", "--model", str(model_dir)]) == 2
    assert "--model only matters with --kv" in capsys.readouterr().err


@pytest.mark.parametrize("kv_dtype,gate", [("int8", 2 / 127), ("fp8", 1 / 8)])
def test_placement_in_a_quantised_pool_against_the_same_dtype_full_prefill(model_dir, tmp_path, kv_dtype, gate):
    """int8/fp8 KV: placement compared with the engine's own full prefill into a pool of the same
    dtype (dequantised rows). Every chunk token recomputed: every layer within 1e-5 (the same
    math, forwards of other lengths), but for a rare element rounded to the neighbouring code. None
    recomputed: layer 0's values are the same bytes and its re-rotated keys are within ``gate`` of
    each row's largest element, two quantisation roundings (canonical, then after the rotation)
    against one: int8 two steps of max/127, fp8 two half-ulps of 2^-4 (e4m3's 3 mantissa
    bits); a later layer is not (no cross-attention)."""
    from chatkv.engine.sampling import SamplingParams
    from chatkv.kernels import kv_quant

    e = engine_at(model_dir, tmp_path, kv_dtype=kv_dtype)
    try:
        quant = e.runner.pool.quant
        texts = [CHUNK, "A refractor uses lenses, a reflector uses mirrors. Collimate a reflector before each night."]
        tokens = list(_prompt(e, texts))
        seq = e.add_request(tokens, SamplingParams(max_tokens=1, temperature=0.0), retain=True, namespace=("full",))
        for _ in e.drive(seq):
            pass
        ref = e.on_loop(lambda: e.kv.export_kv(seq.retained))

        def deq(x):
            return kv_quant.dequantize(x, quant, torch.float32)

        for ratio in (1.0, 0.0):
            placed = e.on_loop(
                lambda: cp.place(
                    e, None, tokens, 0, texts, ("t", ratio), None, False, "blend", 0, ratio, full_as_prefill=False
                )
            )
            got, n = e.on_loop(lambda: e.kv.export_kv(placed.kept)), placed.end
            assert placed.reused == (0 if ratio else sum(len(cp.chunk_ids(e.tokenizer, t)) for t in texts))
            for w in (0, 1):  # keys, values
                for layer in range(len(got[w])):
                    a, b = deq(got[w][layer]), deq(ref[w][layer][:n])
                    if ratio == 1.0:
                        # the same math over forwards of other lengths: float32 sums in another order,
                        # 1e-7 apart, which now and then round to the neighbouring code (one element
                        # of 6,304 in a CI run, under load): within 1e-5, or one code step for 0.1%
                        diff = (a - b).abs()
                        step = gate / 2 * b.abs().amax(-1, keepdim=True) + 1e-6
                        assert (diff <= torch.maximum(step, torch.full_like(step, 1e-5))).all()
                        assert int((diff > 1e-5).sum()) <= max(1, diff.numel() // 1000)
                    elif layer == 0 and w == 1:
                        assert torch.equal(got[w][0], ref[w][0][:n])  # values carry no position: the same bytes
                    elif layer == 0:
                        assert ((a - b).abs() <= gate * b.abs().amax(-1, keepdim=True) + 1e-6).all()
                    else:
                        assert ((a - b).abs() > gate * b.abs().amax(-1, keepdim=True)).any()
            e.on_loop(lambda: e.kv.drop(placed.kept))
        e.on_loop(lambda: e.kv.drop(seq.retained))
        e.check_integrity()
    finally:
        e.close()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_blend_in_a_quantised_pool_chooses_on_dequantised_rows(model_dir, tmp_path, kv_dtype):
    """Blend with check layers over int8 / fp8 KV: the deviation is taken on the dequantised
    reused rows; the share recomputed is exact, layer 0 is the same dtype's full prefill within
    its two roundings, every value finite, and the pool's accounting holds."""
    from chatkv.engine.sampling import SamplingParams
    from chatkv.kernels import kv_quant

    e = engine_at(model_dir, tmp_path, kv_dtype=kv_dtype, rag_check_layers=2)
    try:
        quant = e.runner.pool.quant
        texts = [CHUNK, "A refractor uses lenses, a reflector uses mirrors. Collimate a reflector before each night."]
        tokens = list(_prompt(e, texts))
        n_chunks = sum(len(cp.chunk_ids(e.tokenizer, t)) for t in texts)
        seq = e.add_request(tokens, SamplingParams(max_tokens=1, temperature=0.0), retain=True, namespace=("full",))
        for _ in e.drive(seq):
            pass
        ref = e.on_loop(lambda: e.kv.export_kv(seq.retained))
        placed = e.on_loop(
            lambda: cp.place(
                e,
                None,
                tokens,
                0,
                texts,
                ("q",),
                None,
                False,
                "blend",
                0,
                0.3,
                full_as_prefill=False,
                upto=len(tokens) - 1,
            )
        )
        assert placed.end == len(tokens) - 1
        assert placed.recomputed == math.ceil(0.3 * n_chunks) and placed.reused == n_chunks - placed.recomputed
        k, v = e.on_loop(lambda: e.kv.export_kv(placed.kept))
        gate = {"int8": 2 / 127, "fp8": 1 / 8}[kv_dtype]
        for got, want in ((k, ref[0]), (v, ref[1])):
            a = kv_quant.dequantize(got[0], quant, torch.float32)
            b = kv_quant.dequantize(want[0][: placed.end], quant, torch.float32)
            assert ((a - b).abs() <= gate * b.abs().amax(-1, keepdim=True) + 1e-6).all()
            assert all(torch.isfinite(kv_quant.dequantize(x, quant, torch.float32)).all() for x in got)
        e.on_loop(lambda: e.kv.drop(placed.kept))
        e.on_loop(lambda: e.kv.drop(seq.retained))
        e.check_integrity()
    finally:
        e.close()
