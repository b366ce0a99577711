"""Gated DeltaNet (Qwen3.5's linear-attention layers) as pure functions over an explicit state.

A linear-attention layer keeps no KV: each sequence carries a fixed-size state, made of

- the conv state ``[conv_dim, kernel - 1]`` (the model's dtype): the last ``kernel - 1`` inputs
  of the short causal depthwise convolution that runs over the fused q/k/v projection;
- the recurrent state ``[v_heads, k_dim, v_dim]`` (float32): the delta rule's fast-weight matrix
  ``S``, read as ``o = S^T q`` and written, per token t, as
  ``S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T``.

Two forms compute the same rule: ``chunk_rule`` for a prefill chunk of any length (resuming from
a given state; chunks of ``CHUNK`` tokens solved in matrix form, a scan across them), and
``recurrent_rule`` for one token of each of a batch of sequences (decode). A prefill of N tokens
leaves the state N recurrent steps leave, within float32 rounding (tests/model/test_deltanet.py).

Precision follows transformers' ``Qwen3_5GatedDeltaNet`` (the oracle): the projections and the
convolution in the model's dtype; q/k L2 norm, the decay and the rule itself in float32; the
rule's output rounded to the model's dtype before the gated RMSNorm, which normalises in float32,
scales in the model's dtype and multiplies by ``silu(z)`` in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Tokens per block of ``chunk_rule``'s matrix form (as the reference kernels use).
CHUNK = 64


@dataclass(frozen=True)
class Dims:
    """A layer's shapes (config: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int

    @classmethod
    def of(cls, config) -> "Dims":
        return cls(
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
        )

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def projected(self) -> int:
        """Width of the fused input projection: q/k/v, z, b, a."""
        return self.conv_dim + self.value_dim + 2 * self.v_heads


@dataclass
class Weights:
    """One layer's weights. ``in_proj`` computes in_proj_qkv, in_proj_z, in_proj_b and in_proj_a
    fused along the output (``Dims.projected`` wide); ``conv``: ``[conv_dim, kernel]``."""

    in_proj: Callable[[torch.Tensor], torch.Tensor]
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out_proj: Callable[[torch.Tensor], torch.Tensor]
    eps: float


def split_projection(y: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection ``[T, projected]`` as (mixed q/k/v ``[T, conv_dim]``, z ``[T, v_heads, v_dim]``,
    b ``[T, v_heads]``, a ``[T, v_heads]``)."""
    mixed, z, b, a = y.split([dims.conv_dim, dims.value_dim, dims.v_heads, dims.v_heads], dim=-1)
    return mixed, z.reshape(-1, dims.v_heads, dims.v_dim), b, a


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution of one sequence's ``x`` ``[T, C]`` after its ``state``
    ``[C, kernel - 1]``, then SiLU. Returns (``[T, C]``, the inputs it saw ``[C, kernel - 1 + T]``:
    ``conv_state_after`` reads the state after any of the T tokens from them)."""
    seen = torch.cat((state.to(x.dtype), x.t()), dim=1)
    y = F.conv1d(seen[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(y).t(), seen


def conv_state_after(seen: torch.Tensor, n: int, kernel: int) -> torch.Tensor:
    """The conv state after the first ``n`` new tokens of ``causal_conv``'s ``seen``."""
    return seen[:, n : n + kernel - 1]


def causal_conv_step(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: ``x`` ``[B, C]``, ``states`` ``[B, C, kernel - 1]``.
    Returns (SiLU of the convolution ``[B, C]``, the new states)."""
    seen = torch.cat((states.to(x.dtype), x[:, :, None]), dim=2)
    # summed in float32 and rounded once, as the convolution of the prefill form accumulates
    y = (seen.float() * weight.float()).sum(-1).to(x.dtype)
    return F.silu(y), seen[:, :, 1:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dimension (the reference kernels' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head: the log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32,
    <= 0) and the write strength ``beta = sigmoid(b)`` (float32)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid().float()


def heads(mixed: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolved q/k/v ``[..., conv_dim]`` as float32 heads ``[..., v_heads, dim]``: q and k
    L2-normalised, q scaled by ``k_dim ** -0.5``, and each q/k head repeated for the
    ``v_heads // k_heads`` consecutive value heads it serves."""
    lead = mixed.shape[:-1]
    q, k, v = mixed.float().split([dims.key_dim, dims.key_dim, dims.value_dim], dim=-1)
    q = l2norm(q.reshape(*lead, dims.k_heads, dims.k_dim)) * dims.k_dim**-0.5
    k = l2norm(k.reshape(*lead, dims.k_heads, dims.k_dim))
    group = dims.v_heads // dims.k_heads
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k, v.reshape(*lead, dims.v_heads, dims.v_dim)


def recurrent_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences. q, k ``[B, H, k_dim]``, v ``[B, H, v_dim]``, g and beta
    ``[B, H]``, state ``[B, H, k_dim, v_dim]`` (all float32). Returns (output ``[B, H, v_dim]``,
    the new state)."""
    s = state * g.exp()[..., None, None]
    predicted = (k[..., None, :] @ s)[..., 0, :]  # S^T k
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :], s


def recurrent_rule_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """``recurrent_rule`` advancing ``state`` (contiguous) in place; returns the output. The same
    arithmetic without the two state-sized temporaries (a decode step's main memory traffic)."""
    state.mul_(g.exp()[..., None, None])
    predicted = (k[..., None, :] @ state)[..., 0, :]
    delta = (v - predicted) * beta[..., None]
    flat = state.view(-1, *state.shape[-2:])
    flat.baddbmm_(k.reshape(-1, k.shape[-1], 1), delta.reshape(-1, 1, delta.shape[-1]))
    return (q[..., None, :] @ state)[..., 0, :]


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence from ``state``. q, k ``[T, H, k_dim]``, v ``[T, H, v_dim]``, g and beta
    ``[T, H]``, state ``[H, k_dim, v_dim]`` (all float32). Returns (output ``[T, H, v_dim]``, the state
    after the T tokens).

    Within a block of L tokens, with ``c_t`` the cumulative log decay from the block's start and
    ``S0`` the state there, the values written are ``u_t = beta_t (v_t - e^{c_t} S0^T k_t
    - sum_{s<t} e^{c_t - c_s} (k_t . k_s) u_s)``: a unit lower-triangular system ``(I + A) U = ...``
    solved for all L at once. Then ``o_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t . k_s) u_s``
    and ``S_L = e^{c_L} S0 + sum_s e^{c_L - c_s} k_s u_s^T``. Every block's system is solved in one
    batched call; only the state is carried block to block. The tokens are padded to whole blocks
    with ``beta = 0`` and ``g = 0``, which write nothing and leave the state as it is."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    if t == 0:
        return v.new_zeros(0, h, dv), state
    pad = -t % chunk
    n = (t + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, n, chunk, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(n, chunk, h, *x.shape[2:]).movedim(2, 0)

    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    c = g.cumsum(-1)  # [H, n, L]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{c_t - c_s}, s <= t
    a = ((k @ k.transpose(-1, -2)) * decay * beta[..., :, None]).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat((v * beta[..., None], k * (beta * c.exp())[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    u_own, u_state = solved[..., :dv], solved[..., dv:]  # U = u_own - u_state @ S0
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, n, L, L]
    q_read = q * c.exp()[..., None]  # reads S0 with the decay since the block's start
    k_write = k * (c[..., -1:] - c).exp()[..., None]  # writes decayed to the block's end
    block_decay = c[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(v)
    s = state
    for i in range(n):
        u = u_own[:, i] - u_state[:, i] @ s
        out[:, i] = q_read[:, i] @ s + attn[:, i] @ u
        s = s * block_decay[:, i] + k_write[:, i].transpose(-1, -2) @ u
    return out.movedim(0, 2).reshape(n * chunk, h, dv)[:t], s


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension scaled by ``weight`` (plain, not ``1 + w``), times
    ``silu(z)``: normalised in float32, scaled in ``x``'s dtype, gated in float32, returned in ``x``'s dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(z.float())).to(dtype)


def layer(
    x: torch.Tensor, w: Weights, dims: Dims, conv_state: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole layer for T tokens of one sequence (``x`` ``[T, hidden]``, the normed input) from its
    states. Returns (output ``[T, hidden]``, the conv state and the recurrent state after them).
    The model (chatkv.model.qwen3_5) batches the same steps across sequences."""
    mixed, z, b, a = split_projection(w.in_proj(x), dims)
    conv_out, seen = causal_conv(mixed, conv_state, w.conv)
    q, k, v = heads(conv_out, dims)
    g, beta = decay_and_beta(a, b, w.a_log, w.dt_bias)
    o, state = chunk_rule(q, k, v, g, beta, state)
    return output(o.to(x.dtype), z, w), conv_state_after(seen, x.shape[0], dims.kernel), state


def output(o: torch.Tensor, z: torch.Tensor, w: Weights) -> torch.Tensor:
    """The rule's output ``[T, v_heads, v_dim]`` (model dtype) through the gated norm and out_proj."""
    return w.out_proj(gated_rms_norm(o, z, w.norm, w.eps).reshape(o.shape[0], -1))
