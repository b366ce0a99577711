"""ModelRunner: the KV pool's size, one flattened batch per step, the forward pass, sampling.

A step's batch is a list of ``BatchItem``: for each sequence, the new tokens it
computes (a prefill chunk or one decode token), their first position, its block
table, and whether its last new token's logits are wanted. ``build_batch`` turns
them into the model's flat inputs and the attention metadata (one per sliding
window size); ``forward`` runs the model; ``run`` does both for a scheduler plan
and samples the next token of every sequence whose prompt is complete. A sequence with
proposals to verify (``seq.draft``, chatkv.engine.speculative; a constrained one's rows masked) computes its
last token and the proposals in the same batch and gets back the tokens ``speculative.verify``
accepts. They go in as ``1 + len(draft)`` one-token items over the same block table (item ``i``
at position ``start + i``, seeing the keys the items before it stored in the same layer), not as
one ``logits="all"`` chunk: so each row takes the decode attention path a plain decode step
takes, and its logits are a plain decode's, bit for bit, also in bf16 (a chunk would take the
prefill path, whose rounding differs and flips near-tied greedy picks). A sequence that asks for
``logprobs`` gets each emitted token's (``sampling.token_logprobs``) from its rows' raw logits, kept
before any mask or penalty: a verified token's are its plain decode's, since its row is.

A hybrid model (``Qwen3_5Model``: linear-attention layers with a per-sequence recurrent state)
gets a ``StateSlots`` beside the pool (``states``; its bytes come out of ``kv_cache_bytes``) and
its ``StateCache`` (``state_cache``, chatkv.kvcache.states): each item passes its sequence's live
slot, and a step that takes a sequence across a block boundary copies its state there into the
sequence's boundary slot (the forward's ``checkpoints``), which becomes a checkpoint when the
sequence ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from chatkv.config import EngineConfig
from chatkv.engine.sampling import mask_rows, sample, token_logprobs
from chatkv.engine.sequence import Sequence
from chatkv.engine.speculative import verify
from chatkv.errors import UnsupportedModel
from chatkv.kernels import AttentionMetadata, build_metadata, kv_quant
from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.host_pool import HostPool
from chatkv.kvcache.states import StateCache
from chatkv.model.forward import LlamaModel

log = logging.getLogger("chatkv.engine.core")

#: state checkpoints a hybrid model keeps at most (each a whole sequence's state: StateSlots.bytes_per_slot)
MAX_STATE_CHECKPOINTS = 8


@dataclass
class BatchItem:
    token_ids: list[int]  # the new tokens
    start: int  # position of the first one (= tokens of the sequence already in the pool)
    block_table: list[int]  # covers start + len(token_ids) tokens
    logits: str = "last"  # "last": the last new token's logits, "all": every new token's, "none"
    exact: bool = False  # a decode query computed over exactly its own keys (kernels.build_metadata)
    # the new tokens' positions when they are not start, start + 1, ... (ascending; start is the first):
    # chatkv.rag.placement recomputes chosen tokens of a prompt between placed KV in one item
    positions: list[int] | None = None
    state_slot: int | None = None  # a hybrid model's: the sequence's live state slot
    checkpoint: tuple[int, int] | None = None  # (tokens, slot): copy the state there at that many tokens


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metas: dict[int | None, AttentionMetadata]
    logits_rows: torch.Tensor  # rows of the T tokens whose logits are computed
    slots: list[int] | None = None  # a hybrid model's state slot of each item
    checkpoints: dict[int, list[tuple[int, int]]] | None = None  # {slot: [(tokens, dst)]}


@dataclass(frozen=True)
class KVFormat:
    """How the KV cache is stored: a float dtype, or quantised rows (``quant``) that dequantise to ``dtype``."""

    dtype: torch.dtype
    quant: str | None
    name: str  # the kv dtype in the cache namespace and in snapshot headers

    def bytes_per_token(self, model: LlamaModel) -> int:
        row = kv_quant.row_width(self.quant, model.head_dim)
        size = 1 if self.quant else torch.finfo(self.dtype).bits // 8
        return 2 * model.num_layers * model.num_kv_heads * row * size


_FLOAT_KV = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_QUANT_KV = {"int8": "int8", "fp8": "fp8_e4m3"}


def kv_format(kv_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The KV format of the option ``kv_dtype`` (EngineConfig) for a model computing in ``model_dtype``.

    Its ``name`` is the model dtype's for ``auto`` (``bfloat16``: what snapshots always said);
    any other format also names the model dtype (``int8@bfloat16``), because the same KV
    computed in another dtype is other KV."""
    model_name = str(model_dtype).removeprefix("torch.")
    if kv_dtype == "auto" or _FLOAT_KV.get(kv_dtype) == model_dtype:
        return KVFormat(model_dtype, None, model_name)
    if kv_dtype in _FLOAT_KV:
        dt = _FLOAT_KV[kv_dtype]
        return KVFormat(dt, None, f"{str(dt).removeprefix('torch.')}@{model_name}")
    quant = _QUANT_KV[kv_dtype]
    return KVFormat(model_dtype, quant, f"{quant}@{model_name}")


def pool_blocks(model: LlamaModel, config: EngineConfig, fmt: KVFormat | None = None, state_bytes: int = 0) -> int:
    """Blocks in the pool: ``num_blocks`` if given, else what ``kv_cache_bytes`` holds after
    ``state_bytes`` (a hybrid model's state slots)."""
    per_token = (fmt or kv_format(config.kv_dtype, model.dtype)).bytes_per_token(model)
    return config.num_blocks or max(2, (config.kv_cache_bytes - state_bytes) // (per_token * config.block_size))


def state_layout(slot_bytes: int, config: EngineConfig) -> tuple[int, int, int]:
    """A hybrid model's (running sequences, checkpoints, slots): each running sequence holds a
    live slot and, with prefix caching, a block-boundary one; checkpoints only with prefix caching.
    Sized from ``kv_cache_bytes`` (at most half of it for states; ``num_blocks`` given: as asked)."""
    per_seq = 2 if config.enable_prefix_caching else 1
    running = config.max_running
    checkpoints = MAX_STATE_CHECKPOINTS if config.enable_prefix_caching else 0
    if config.num_blocks is None:
        fit = config.kv_cache_bytes // 2 // slot_bytes
        checkpoints = min(checkpoints, max(0, (fit - per_seq) // 3))
        running = max(1, min(running, (fit - checkpoints) // per_seq))
    return running, checkpoints, running * per_seq + checkpoints


def _report_step(plan: list[tuple[Sequence, int]], seconds: float) -> None:
    """Tell the speculator's step-time model (chatkv.engine.speculative.StepCost) how long this step
    took, when it was decode-only (its sequences' rows, proposals included): auto speculation
    weighs the cost of a verified row as measured on this machine."""
    cost = next((seq.spec.cost for seq, _ in plan if seq.spec is not None and seq.spec.cost is not None), None)
    if cost is None:
        return
    if all(seq.draft or (n == 1 and seq.num_computed + 1 == len(seq.token_ids)) for seq, n in plan):
        cost.record(len(plan), sum(n for _, n in plan), seconds)
    else:
        cost.skip()


def _record_logprobs(seq: Sequence, raw: torch.Tensor, tokens: list[int]) -> None:
    """Append the logprobs of ``tokens`` (row ``i`` of ``raw`` picked ``tokens[i]``) to ``seq.logprobs``.
    The scheduler may append fewer of them (a verified run cut at a stop): the entries past the
    sequence's generated tokens are never read (``Sequence.token_logprobs``)."""
    if seq.logprobs is None:
        seq.logprobs = []
    del seq.logprobs[seq.num_generated :]  # a previous verified run's entries past its stop
    seq.logprobs.extend(token_logprobs(raw, tokens, seq.params.logprobs))


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig):
        self.model = model
        self.kv_format = kv_format(config.kv_dtype, model.dtype)
        self.max_running = config.max_running  # a hybrid model's may be fewer: its state slots
        self.states = self.state_cache = None
        state_bytes = 0
        if getattr(model, "linear_layers", None):  # a hybrid model: per-sequence recurrent states
            from chatkv.model.qwen3_5 import StateSlots

            slot_bytes = StateSlots.for_model(model, 1).bytes_per_slot
            self.max_running, checkpoints, num_slots = state_layout(slot_bytes, config)
            self.states = StateSlots.for_model(model, num_slots)
            self.state_cache = StateCache(self.states, checkpoints, config.enable_prefix_caching)
            state_bytes = num_slots * slot_bytes
            log.log(
                logging.WARNING if self.max_running < config.max_running else logging.INFO,
                "recurrent state: %d slots of %.2f MiB out of kv_cache_bytes: %d sequences run at once "
                "(max_running %d; more need a larger kv_cache_bytes), %d turn-end checkpoints",
                num_slots,
                slot_bytes / 2**20,
                self.max_running,
                config.max_running,
                checkpoints,
            )
        self.pool = BlockPool(
            pool_blocks(model, config, self.kv_format, state_bytes),
            config.block_size,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            dtype=self.kv_format.dtype,
            device=config.device,
            quant=self.kv_format.quant,
        )
        # the host-memory tier backs the shared prefix cache: none without it
        self.host_pool = HostPool.for_pool(self.pool, config.host_cache_bytes) if config.enable_prefix_caching else None

    def build_batch(self, items: list[BatchItem]) -> Batch:
        ids, pos, tables, qlens, ctx, rows, exact, at = [], [], [], [], [], [], [], []
        slots, checkpoints = [], {}
        for it in items:
            slots.append(it.state_slot)
            if it.checkpoint is not None:
                checkpoints.setdefault(it.state_slot, []).append(it.checkpoint)
            exact.append(it.exact)
            at.append(it.positions)
            n = len(it.token_ids)
            first_row = len(ids)
            ids.extend(it.token_ids)
            pos.extend(range(it.start, it.start + n) if it.positions is None else it.positions)
            tables.append(it.block_table)
            qlens.append(n)
            ctx.append(it.start + n if it.positions is None else it.positions[-1] + 1)
            if it.logits == "last":
                rows.append(first_row + n - 1)
            elif it.logits == "all":
                rows.extend(range(first_row, first_row + n))
        dev = self.model.device
        bs = self.pool.block_size
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        batch = Batch(
            torch.tensor(ids, dtype=torch.long, device=dev),
            positions,
            {
                w: build_metadata(
                    tables,
                    qlens,
                    ctx,
                    bs,
                    w,
                    device=dev,
                    exact=exact if any(exact) else None,
                    positions=at if any(a is not None for a in at) else None,
                )
                for w in self.model.windows
            },
            torch.tensor(rows, dtype=torch.long, device=dev),
            slots if any(s is not None for s in slots) else None,
            checkpoints,
        )
        if getattr(self.model, "invariant", False):
            # a deterministic model: every row attends alone (chatkv.model.forward.LlamaModel.attend), over
            # its sequence's blocks (padded with the last one: only the first ctx keys are read) and the
            # keys at or before its position
            width = max(len(t) for t in tables)
            per_item = torch.tensor([t + t[-1:] * (width - len(t)) for t in tables], dtype=torch.long)
            keys = (per_item.repeat_interleave(torch.tensor(qlens), dim=0), positions + 1)
            for meta in batch.metas.values():
                meta.scratch["rows"] = keys
        return batch

    def forward(self, batch: Batch) -> torch.Tensor:
        """Float32 logits ``[len(logits_rows), vocab]`` on the CPU; stores the new tokens' KV (and
        advances a hybrid model's states)."""
        if self.states is not None:
            if batch.slots is None or None in batch.slots:
                raise UnsupportedModel(
                    "this model's linear-attention layers keep a recurrent state per sequence: computing KV "
                    "outside a request (RAG chunk placement, a weight check's batches) is not supported for it"
                )
            try:
                return self.model.forward(
                    batch.input_ids,
                    batch.positions,
                    self.pool.kv,
                    batch.metas,
                    batch.logits_rows,
                    self.pool.quant,
                    states=self.states,
                    slots=batch.slots,
                    checkpoints=batch.checkpoints,
                ).cpu()
            except BaseException:
                # the step's states may be half advanced: none of them resumes anything
                for slot in {*batch.slots, *(d for ps in batch.checkpoints.values() for _, d in ps)}:
                    self.states.tokens[slot] = -1
                raise
        return self.model.forward(
            batch.input_ids, batch.positions, self.pool.kv, batch.metas, batch.logits_rows, self.pool.quant
        ).cpu()

    def run(self, plan: list[tuple[Sequence, int]]) -> dict[Sequence, int | list[int] | Exception]:
        """Compute a scheduler plan; return the next token of every sequence whose prompt is now
        complete (the list of tokens ``verify`` accepts for one verifying a draft), or the error
        its sampling raised (it is that request's alone)."""
        began = time.perf_counter()
        items, samplers, verifying = [], [], []
        for seq, n in plan:
            start = seq.num_computed
            if seq.draft:  # its last token, then the proposals: one decode query each (see the module doc)
                assert start + 1 == len(seq.token_ids) and n == 1 + len(seq.draft), "a draft is verified while decoding"
                for i, token in enumerate(seq.token_ids[start:] + seq.draft):
                    # exact: each row's attention as its lone decode computes it, so what is accepted
                    # is what plain decoding gives (a padded row's bf16 rounding differs)
                    items.append(BatchItem([token], start + i, seq.block_table, "last", exact=True))
                verifying.append(seq)
                continue
            done = start + n == len(seq.token_ids)
            items.append(
                BatchItem(seq.token_ids[start : start + n], start, seq.block_table, "last" if done else "none")
            )
            if self.states is not None:
                self._state_item(items[-1], seq)
            if done:
                samplers.append(seq)
        logits = self.forward(self.build_batch(items))
        out: dict[Sequence, int | list[int] | Exception] = {}
        if verifying:  # the rows in batch order: split them into the samplers' and the verifiers'
            logits, verify_rows = self._split_rows(plan, logits)
        raw = {seq: logits[row].clone() for row, seq in enumerate(samplers) if seq.params.logprobs is not None}
        masked = mask_rows(logits, [seq.matcher for seq in samplers])  # constrained rows only
        for row, seq in enumerate(samplers):
            if masked[row] is not None:  # its constraint's matcher failed
                out[seq] = masked[row]
                continue
            try:
                out[seq] = sample(logits[row], seq.params, seq.token_ids, seq.generator, seq.num_prompt_tokens)
                if seq in raw:
                    _record_logprobs(seq, raw[seq][None], [out[seq]])
            except (RuntimeError, ValueError) as err:  # e.g. non-finite logits from broken weights
                out[seq] = err
        for seq in verifying:
            try:
                rows = verify_rows[seq]
                before = rows.clone() if seq.params.logprobs is not None else None  # verify masks rows in place
                out[seq] = verify(
                    rows, seq.draft, seq.params, seq.token_ids, seq.generator, seq.matcher, seq.num_prompt_tokens
                )
                if before is not None:
                    _record_logprobs(seq, before, out[seq])
            except (RuntimeError, ValueError) as err:
                out[seq] = err
        _report_step(plan, time.perf_counter() - began)
        return out

    def _state_item(self, item: BatchItem, seq: Sequence) -> None:
        """A hybrid model's item: its sequence's live slot, and a copy of its state into its boundary
        slot at the last block boundary the step reaches (when past the one it holds)."""
        t = seq.kv
        item.state_slot = t.state_slot
        if t.boundary_slot is not None:
            end = item.start + len(item.token_ids)
            at = end - end % self.pool.block_size
            if at >= item.start and at > self.states.tokens[t.boundary_slot]:
                item.checkpoint = (at, t.boundary_slot)

    @staticmethod
    def _split_rows(plan: list[tuple[Sequence, int]], logits: torch.Tensor):
        """(the one-token samplers' logits rows, {verifying sequence: its rows}) from a batch's rows."""
        plain, rows, at = [], {}, 0
        for seq, n in plan:
            if seq.draft:
                rows[seq] = logits[at : at + n]
                at += n
            elif seq.num_computed + n == len(seq.token_ids):
                plain.append(at)
                at += 1
        return logits[plain], rows
