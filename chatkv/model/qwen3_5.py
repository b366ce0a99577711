"""Qwen3.5's text model (transformers' ``qwen3_5_text``) over paged KV plus per-sequence states.

(Just past ~400 lines on purpose: the model, its state slots and its loader's engine-facing arguments
are one unit; the linear layers' math is already chatkv.model.deltanet.)

Qwen3.5 interleaves two token mixers (``config.layer_types``): Gated DeltaNet linear attention
(chatkv.model.deltanet), whose memory of a sequence is a fixed-size state, and, every
``full_attention_interval``-th layer, gated softmax attention over the paged KV cache:

- full attention: ``q_proj`` is twice as wide as the heads, each head's half ``[D:2D]`` being a
  gate: the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``; q and k get an
  RMSNorm over the head dimension; RoPE rotates only the first ``partial_rotary_factor * head_dim``
  dimensions of each head (Qwen3.5's M-RoPE sections all read the same position for text);
- every RMSNorm except the linear layers' gated one scales by ``1 + w`` (zero-centred weights),
  in float32 before the single rounding to the model's dtype.

The KV pool holds only the full-attention layers: ``num_layers`` counts those (it sizes the
pool: chatkv.engine.model_runner), ``num_hidden_layers`` all of them. The linear layers' states
live in a ``StateSlots`` the caller passes in with one slot per batch item; a slot's state is
the sequence's after ``StateSlots.tokens[slot]`` tokens, and an item must start there.

Computes in the model's dtype as transformers does (its oracle: tests/model/test_qwen3_5.py),
float weights only (no int4/int8 modes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.kernels import AttentionMetadata, attention_backend
from chatkv.model import deltanet
from chatkv.model.forward import Linear, LlamaModel, exact_top

log = logging.getLogger("chatkv.model.qwen3_5")


class StateSlots:
    """The linear-attention layers' states of up to ``num_slots`` sequences (or checkpoints of them).

    ``conv[l, slot]`` ``[conv_dim, kernel - 1]`` (model dtype) and ``recurrent[l, slot]``
    ``[v_heads, k_dim, v_dim]`` (float32) for linear layer ``l``; ``tokens[slot]``: how many tokens of
    its sequence the slot's state has taken in (0: the empty state a prompt starts from)."""

    def __init__(self, num_slots: int, layers: int, dims: deltanet.Dims, dtype: torch.dtype, device="cpu"):
        self.dims = dims
        self.conv = torch.zeros(layers, num_slots, dims.conv_dim, dims.kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            layers, num_slots, dims.v_heads, dims.k_dim, dims.v_dim, dtype=torch.float32, device=device
        )
        self.tokens = [0] * num_slots

    @classmethod
    def for_model(cls, model: "Qwen3_5Model", num_slots: int) -> "StateSlots":
        return cls(num_slots, len(model.linear_layers), model.dims, model.dtype, model.device)

    @property
    def num_slots(self) -> int:
        return len(self.tokens)

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state in bytes, every linear layer's."""
        return (self.conv[:, 0].numel() * self.conv.element_size()) + self.recurrent[:, 0].numel() * 4

    def reset(self, slot: int) -> None:
        """The empty state (a sequence before its first token)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        self.tokens[slot] = 0

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a copy of ``src`` (a checkpoint taken, or one restored)."""
        if src != dst:
            self.conv[:, dst].copy_(self.conv[:, src])
            self.recurrent[:, dst].copy_(self.recurrent[:, src])
            self.tokens[dst] = self.tokens[src]


@dataclass
class Attention:
    qkv: Linear  # q (with its gate, per head [q | gate]), k, v fused: [H * 2D + 2 * KVH * D, hidden]
    o: Linear
    q_norm: torch.Tensor  # 1 + w, float32 [D]
    k_norm: torch.Tensor
    kv_index: int  # this layer's place in the KV pool


@dataclass
class Layer:
    input_norm: torch.Tensor  # 1 + w, float32
    mixer: Attention | deltanet.Weights
    state_index: int | None  # linear layers: this layer's place in StateSlots
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class _Segment:
    """Consecutive batch rows of one slot: one item, or a run of one-token items (a verification)."""

    row: int  # first row in the step
    n: int
    slot: int
    start: int  # tokens the slot's state holds before these
    run: bool  # several one-token items: computed token by token, each as a plain decode


class Qwen3_5Model:
    """Weights and the forward pass of a ``qwen3_5_text`` model. Not an nn.Module: nothing here trains."""

    def __init__(self, config, weights: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu", pack: bool = True):
        """``weights``: the checkpoint's tensors without the ``model.`` prefix (chatkv.weights.loading.read_weights;
        a multimodal checkpoint's ``language_model.`` prefix is read too, its vision tower and MTP head ignored)."""
        config = getattr(config, "text_config", None) or config
        rope = dict(config.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"qwen3_5 with rope_type '{rope['rope_type']}' is not supported")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.dims = deltanet.Dims.of(config)
        self.num_hidden_layers = config.num_hidden_layers
        prefix = "language_model." if any(k.startswith("language_model.") for k in weights) else ""

        def w(name: str) -> torch.Tensor:
            if prefix + name not in weights:
                raise ModelNotFound(f"weight '{prefix + name}' missing from the model's safetensors")
            return weights[prefix + name].to(device=self.device, dtype=dtype).contiguous()

        def norm1p(name: str) -> torch.Tensor:
            return 1.0 + w(name).float()

        def linear(*names: str) -> Linear:
            return Linear(torch.cat([w(n) for n in names]), None, pack)

        self.layers: list[Layer] = []
        self.linear_layers: list[int] = []
        self.attention_layers: list[int] = []
        for i, kind in enumerate(config.layer_types):
            p = f"layers.{i}."
            if kind == "full_attention":
                a = p + "self_attn."
                mixer = Attention(
                    linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    linear(a + "o_proj.weight"),
                    norm1p(a + "q_norm.weight"),
                    norm1p(a + "k_norm.weight"),
                    len(self.attention_layers),
                )
                if config.attention_bias:
                    raise UnsupportedModel("qwen3_5 with attention_bias is not supported")
                state_index, kinds = None, self.attention_layers
            elif kind == "linear_attention":
                a = p + "linear_attn."
                mixer = deltanet.Weights(
                    linear(*(a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a"))),
                    w(a + "conv1d.weight").reshape(self.dims.conv_dim, self.dims.kernel),
                    w(a + "A_log"),
                    w(a + "dt_bias"),
                    w(a + "norm.weight"),
                    linear(a + "out_proj.weight"),
                    self.eps,
                )
                state_index, kinds = len(self.linear_layers), self.linear_layers
            else:
                raise UnsupportedModel(f"qwen3_5 layer type '{kind}' (layer {i}) is not supported")
            kinds.append(i)
            self.layers.append(
                Layer(
                    norm1p(p + "input_layernorm.weight"),
                    mixer,
                    state_index,
                    norm1p(p + "post_attention_layernorm.weight"),
                    linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    linear(p + "mlp.down_proj.weight"),
                )
            )
        #: KV layers: what the KV pool holds (the linear layers keep StateSlots instead)
        self.num_layers = len(self.attention_layers)
        self.windows = [None]
        self.embed = w("embed_tokens.weight")
        self.norm = norm1p("norm.weight")
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in weights
        matrix = self.embed if tied else weights["lm_head.weight"].to(device=self.device, dtype=dtype).contiguous()
        self.lm_head = exact_top(Linear(matrix, pack=pack), matrix)
        self.rotary_dim = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        base = rope["rope_theta"]
        self.inv_freq = 1.0 / (
            base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=self.device) / self.rotary_dim)
        )
        self._cos_sin = torch.empty(0, 2, self.rotary_dim, dtype=dtype, device=self.device)
        self.store_kv, self.attention = attention_backend(self.device)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype | None = torch.float32,
        device="cpu",
        weights_mode: str = "float",
        head_mode: str = "float",
        deterministic: bool = False,
        **_quantised,
    ):
        """The model of a local Hugging Face directory (its config read by transformers); ``dtype``
        None: the config's. Takes ``LlamaModel.from_pretrained``'s arguments (the engine loads every
        model alike, chatkv.model.self_check.load_checked): the quantised modes are refused (float
        weights only), their tuning arguments ignored; ``deterministic`` (batch-invariant numbers)
        is not implemented here: logged, and the numbers may depend on the batch a row is in."""
        from transformers import AutoConfig

        from chatkv.weights.loading import read_weights

        if weights_mode != "float" or head_mode != "float":
            raise UnsupportedModel(
                f"qwen3_5 runs float weights only (bf16/fp32), not weights {weights_mode} / head {head_mode}"
            )
        config = AutoConfig.from_pretrained(str(model_dir))
        if dtype is None:
            dtype = getattr(config, "dtype", None) or torch.float32
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if deterministic:
            log.info("qwen3_5: deterministic (batch-invariant) numbers are not implemented for this model")
        return cls(config, read_weights(model_dir), dtype, device)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm scaled by ``weight`` (``1 + w``, float32): in float32, rounded once to ``x``'s dtype."""
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps=self.eps).to(x.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, rotary_dim]`` of ``positions`` (LlamaModel.rotate's form)."""
        need = int(positions.max()) + 1
        if need > self._cos_sin.shape[0]:
            n = max(need, 2 * self._cos_sin.shape[0], 256)
            freqs = torch.arange(n, device=self.device).float()[:, None] * self.inv_freq[None, :]
            half = freqs.shape[-1]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, :half] = -sin[:, :half]
            self._cos_sin = torch.stack((emb.cos(), sin), dim=1).to(self.dtype)
        cs = self._cos_sin.index_select(0, positions)
        return cs[:, 0:1], cs[:, 1:2]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        metas: dict[int | None, AttentionMetadata],
        logits_rows: torch.Tensor,
        quant: str | None = None,
        *,
        states: StateSlots,
        slots: list[int],
        checkpoints: dict[int, list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """Compute one flattened step (as ``LlamaModel.forward``; ``kv`` holds the full-attention layers).

        ``slots[i]``: the StateSlots slot of batch item ``i`` (``metas[None].query_lens`` order), whose
        state must hold exactly the tokens before the item. Consecutive items of one slot (a
        verification's one-token items) are computed in order, token by token. The slots' states
        are advanced in place. ``checkpoints``: ``{slot: [(tokens, dst), ...]}``: when the slot's
        sequence has taken in ``tokens`` tokens (from its start in this step to its end, inclusive),
        its state is copied into slot ``dst`` (a slot of no item of this step).
        Returns float32 logits ``[len(logits_rows), vocab]``."""
        meta = metas[None]
        segments = self._segments(meta, states, slots)
        checkpoints = self._check_checkpoints(checkpoints or {}, segments)
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(positions)
        for layer in self.layers:
            x = self.rms(h, layer.input_norm)
            if layer.state_index is None:
                h = h + self._attend(x, layer.mixer, kv, meta, cos, sin, quant)
            else:
                h = h + self._linear(x, layer.mixer, states, layer.state_index, segments, checkpoints)
            g, u = layer.gate_up(self.rms(h, layer.post_norm)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(g) * u)
        for seg in segments:
            states.tokens[seg.slot] = seg.start + seg.n
        for points in checkpoints.values():
            for tokens, dst in points:
                states.tokens[dst] = tokens
        return self.lm_head(self.rms(h.index_select(0, logits_rows), self.norm)).float()

    @staticmethod
    def _segments(meta: AttentionMetadata, states: StateSlots, slots: list[int]) -> list[_Segment]:
        if len(slots) != len(meta.query_lens):
            raise ValueError(f"{len(slots)} state slots for {len(meta.query_lens)} batch items")
        if any(p.scattered for p in meta.prefills):
            # a recurrent state takes tokens in order: none can be recomputed between others' KV
            raise UnsupportedModel("qwen3_5: items at given positions (build_metadata(positions=)) are not supported")
        segments: list[_Segment] = []
        row = 0
        for slot, n, ctx in zip(slots, meta.query_lens, meta.context_lens):
            start = ctx - n
            last = segments[-1] if segments else None
            if last is not None and last.slot == slot and n == 1 and (last.run or last.n == 1):
                if start != last.start + last.n:
                    end = last.start + last.n
                    raise ValueError(f"state slot {slot}: an item at token {start} follows one ending at {end}")
                last.n += 1
                last.run = True
            else:
                if any(s.slot == slot for s in segments):
                    raise ValueError(f"state slot {slot} is given to two batch items that are not one run")
                if states.tokens[slot] != start:
                    raise ValueError(
                        f"state slot {slot} holds {states.tokens[slot]} tokens; its item starts at token {start}"
                    )
                segments.append(_Segment(row, n, slot, start, False))
            row += n
        return segments

    @staticmethod
    def _check_checkpoints(checkpoints: dict[int, list[tuple[int, int]]], segments: list[_Segment]):
        by_slot = {s.slot: s for s in segments}
        for slot, points in checkpoints.items():
            seg = by_slot.get(slot)
            if seg is None:
                raise ValueError(f"checkpoint of state slot {slot}, which no batch item computes")
            for tokens, dst in points:
                if not seg.start <= tokens <= seg.start + seg.n:
                    raise ValueError(
                        f"checkpoint of slot {slot} at {tokens} tokens: this step takes it "
                        f"from {seg.start} to {seg.start + seg.n}"
                    )
                if dst in by_slot:
                    raise ValueError(f"checkpoint slot {dst} is computed in the same step")
        return {slot: sorted(points) for slot, points in checkpoints.items()}

    def _attend(self, x, a: Attention, kv, meta: AttentionMetadata, cos, sin, quant) -> torch.Tensor:
        t = x.shape[0]
        nh, nkv, d, r = self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim
        y = a.qkv(x)
        qg = y[:, : 2 * nh * d].view(t, nh, 2 * d)
        q, gate = self.rms(qg[..., :d], a.q_norm), qg[..., d:].reshape(t, nh * d)
        k = self.rms(y[:, 2 * nh * d : (2 * nh + nkv) * d].view(t, nkv, d), a.k_norm)
        v = y[:, (2 * nh + nkv) * d :].view(t, nkv, d)
        q = torch.cat((LlamaModel.rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        k = torch.cat((LlamaModel.rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1)
        k_cache, v_cache = kv[a.kv_index, 0], kv[a.kv_index, 1]
        self.store_kv(k_cache, v_cache, meta.slot_mapping, k, v, quant=quant)
        o = self.attention(q, k_cache, v_cache, meta, self.scale, quant=quant).reshape(t, nh * d)
        return a.o(o * torch.sigmoid(gate))

    def _linear(
        self,
        x: torch.Tensor,
        w: deltanet.Weights,
        states: StateSlots,
        li: int,
        segments: list[_Segment],
        checkpoints: dict[int, list[tuple[int, int]]],
    ) -> torch.Tensor:
        """One linear-attention layer over the step's segments, advancing their states in place."""
        dims = self.dims
        mixed, z, b, a = deltanet.split_projection(w.in_proj(x), dims)
        g, beta = deltanet.decay_and_beta(a, b, w.a_log, w.dt_bias)
        conv, rec = states.conv[li], states.recurrent[li]
        out = x.new_empty(x.shape[0], dims.v_heads, dims.v_dim, dtype=torch.float32)

        def save(slot: int, tokens: int, conv_state: torch.Tensor, state: torch.Tensor) -> None:
            for at, dst in checkpoints.get(slot, ()):
                if at == tokens:
                    conv[dst].copy_(conv_state)
                    rec[dst].copy_(state)

        for seg in segments:
            save(seg.slot, seg.start, conv[seg.slot], rec[seg.slot])
        single = [s for s in segments if s.n == 1]
        if single:  # one-token items: one batched recurrent step
            rows = torch.tensor([s.row for s in single], device=x.device)
            idx = torch.tensor([s.slot for s in single], device=x.device)
            c_out, new_conv = deltanet.causal_conv_step(mixed.index_select(0, rows), conv.index_select(0, idx), w.conv)
            q, k, v = deltanet.heads(c_out, dims)
            s = rec.index_select(0, idx)
            o = deltanet.recurrent_rule_(q, k, v, g.index_select(0, rows), beta.index_select(0, rows), s)
            conv.index_copy_(0, idx, new_conv.to(conv.dtype))
            rec.index_copy_(0, idx, s)
            out.index_copy_(0, rows, o)
            for s in single:
                save(s.slot, s.start + 1, conv[s.slot], rec[s.slot])
        for seg in segments:
            if seg.n == 1:
                continue
            r0, r1 = seg.row, seg.row + seg.n
            if seg.run:  # a verification: each token as its plain decode computes it, its state saveable
                cs, s = conv[seg.slot : seg.slot + 1], rec[seg.slot : seg.slot + 1]  # s: advanced in place
                for r in range(r0, r1):
                    c_out, cs = deltanet.causal_conv_step(mixed[r : r + 1], cs, w.conv)
                    q, k, v = deltanet.heads(c_out, dims)
                    out[r] = deltanet.recurrent_rule_(q, k, v, g[r : r + 1], beta[r : r + 1], s)[0]
                    save(seg.slot, seg.start + r - r0 + 1, cs[0], s[0])
                conv[seg.slot].copy_(cs[0])
                continue
            c_out, seen = deltanet.causal_conv(mixed[r0:r1], conv[seg.slot], w.conv)
            q, k, v = deltanet.heads(c_out, dims)
            # split where a checkpoint falls inside the segment: the rule resumes from the state there
            cuts = sorted({at - seg.start for at, _ in checkpoints.get(seg.slot, ()) if 0 < at - seg.start < seg.n})
            s = rec[seg.slot]
            for lo, hi in zip([0, *cuts], [*cuts, seg.n]):
                rows = slice(r0 + lo, r0 + hi)
                o, s = deltanet.chunk_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[rows], beta[rows], s)
                out[r0 + lo : r0 + hi] = o
                save(seg.slot, seg.start + hi, deltanet.conv_state_after(seen, hi, dims.kernel), s)
            conv[seg.slot].copy_(deltanet.conv_state_after(seen, seg.n, dims.kernel))
            rec[seg.slot].copy_(s)
        return deltanet.output(out.to(x.dtype), z, w)
