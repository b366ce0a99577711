"""chatkv.model.deltanet against transformers' own torch forms of Qwen3.5's Gated DeltaNet (its oracle),
and its two forms of the delta rule against each other (float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from chatkv.model import deltanet as dn

DIMS = dn.Dims(k_heads=2, v_heads=4, k_dim=16, v_dim=24, kernel=4)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rule_inputs(t: int, seed: int, decay: float = 2.0):
    """Raw q/k ``[T, k_heads, k_dim]``, v, g (log decay down to ``-decay``), beta and a start state."""
    g = gen(seed)
    q = torch.randn(t, DIMS.k_heads, DIMS.k_dim, generator=g)
    k = torch.randn(t, DIMS.k_heads, DIMS.k_dim, generator=g)
    v = torch.randn(t, DIMS.v_heads, DIMS.v_dim, generator=g)
    log_decay = -torch.rand(t, DIMS.v_heads, generator=g) * decay
    beta = torch.rand(t, DIMS.v_heads, generator=g)
    state = torch.randn(DIMS.v_heads, DIMS.k_dim, DIMS.v_dim, generator=g)
    return q, k, v, log_decay, beta, state


def prepared(q, k, v):
    """chatkv's heads (L2 norm, scale, GQA repeat) of raw q/k/v."""
    t = q.shape[0]
    return dn.heads(torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1), DIMS)


@pytest.mark.parametrize("t", [1, 7, 64, 150])
@pytest.mark.parametrize("decay", [2.0, 60.0])  # 60: states forgotten within a token (exp underflows)
def test_chunk_rule_matches_transformers(t, decay):
    q, k, v, g, beta, state = rule_inputs(t, seed=t, decay=decay)
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, new_state = dn.chunk_rule(*prepared(q, k, v), g, beta, state)
    assert torch.isfinite(out).all()
    assert (out - want[0]).abs().max().item() <= 1e-5
    assert (new_state - want_state[0]).abs().max().item() <= 1e-5


def test_recurrent_rule_matches_transformers_batched():
    """One token each of three sequences with their own states, as one batched step."""
    q, k, v, g, beta, _ = rule_inputs(3, seed=1)
    states = torch.randn(3, DIMS.v_heads, DIMS.k_dim, DIMS.v_dim, generator=gen(2))
    want, want_state = hf.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=states, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, new_states = dn.recurrent_rule(*prepared(q, k, v), g, beta, states)
    assert (out - want[:, 0]).abs().max().item() <= 1e-6
    assert (new_states - want_state).abs().max().item() <= 1e-6


def test_conv_matches_transformers():
    """The prefill form over a zero state is transformers' causal_conv1d_fn; the step form (and the
    state it leaves) is causal_conv1d_update's."""
    g = gen(3)
    c = DIMS.conv_dim
    x = torch.randn(20, c, generator=g)
    weight = torch.randn(c, DIMS.kernel, generator=g)
    y, seen = dn.causal_conv(x, torch.zeros(c, DIMS.kernel - 1), weight)
    want = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    assert (y - want).abs().max().item() <= 1e-6
    assert torch.equal(dn.conv_state_after(seen, 20, DIMS.kernel), x[-3:].t())
    assert torch.equal(dn.conv_state_after(seen, 2, DIMS.kernel)[:, -2:], x[:2].t())

    states = torch.randn(2, c, DIMS.kernel - 1, generator=g)
    theirs = states.clone()
    one = torch.randn(2, c, generator=g)
    y, new_states = dn.causal_conv_step(one, states, weight)
    want = hf.causal_conv1d_update(one[:, :, None], theirs, weight, None, activation="silu")[:, :, 0]
    assert (y - want).abs().max().item() <= 1e-6
    assert torch.equal(new_states, theirs)  # transformers updates its state in place


def reference_layer(seed: int = 0):
    """transformers' Qwen3_5GatedDeltaNet with seeded weights, and chatkv's Weights of the same tensors."""
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        hidden_size=48,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=DIMS.k_heads,
        linear_num_value_heads=DIMS.v_heads,
        linear_key_head_dim=DIMS.k_dim,
        linear_value_head_dim=DIMS.v_dim,
        linear_conv_kernel_dim=DIMS.kernel,
    )
    torch.manual_seed(seed)
    module = hf.Qwen3_5GatedDeltaNet(config, 0).eval()
    g = gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.1, 4, generator=g).log())
            elif name == "norm.weight":
                p.copy_(1 + 0.3 * r)
            elif name in ("dt_bias", "conv1d.weight"):
                p.copy_(0.5 * r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)
    fused = torch.cat([module.in_proj_qkv.weight, module.in_proj_z.weight, module.in_proj_b.weight,
                       module.in_proj_a.weight]).detach()  # fmt: skip
    weights = dn.Weights(
        in_proj=lambda x: F.linear(x, fused),
        conv=module.conv1d.weight.detach().reshape(DIMS.conv_dim, DIMS.kernel),
        a_log=module.A_log.detach(),
        dt_bias=module.dt_bias.detach(),
        norm=module.norm.weight.detach(),
        out_proj=lambda x: F.linear(x, module.out_proj.weight.detach()),
        eps=config.rms_norm_eps,
    )
    return module, weights


def empty_states():
    return torch.zeros(DIMS.conv_dim, DIMS.kernel - 1), torch.zeros(DIMS.v_heads, DIMS.k_dim, DIMS.v_dim)


def test_layer_matches_transformers_module():
    """The whole layer (projections, conv, decay/beta, the rule, gated norm, out_proj) from an empty state."""
    module, weights = reference_layer()
    x = torch.randn(90, 48, generator=gen(4))
    with torch.no_grad():
        want = module(x[None])[0]
    out, _, _ = dn.layer(x, weights, DIMS, *empty_states())
    assert (out - want).abs().max().item() <= 1e-5
    assert want.std().item() > 0.1


def steps(x, weights, conv_state, state):
    """The layer token by token through the decode forms (a batch of one)."""
    mixed, z, b, a = dn.split_projection(weights.in_proj(x), DIMS)
    g, beta = dn.decay_and_beta(a, b, weights.a_log, weights.dt_bias)
    conv_state, state, outs = conv_state[None], state[None], []
    for i in range(x.shape[0]):
        c, conv_state = dn.causal_conv_step(mixed[i : i + 1], conv_state, weights.conv)
        o, state = dn.recurrent_rule(*dn.heads(c, DIMS), g[i : i + 1], beta[i : i + 1], state)
        outs.append(o)
    return dn.output(torch.cat(outs), z, weights), conv_state[0], state[0]


def test_prefill_leaves_the_state_of_token_steps():
    """A prefill of 100 tokens after 30 leaves the states 100 single-token steps leave, with the same outputs."""
    _, weights = reference_layer()
    x = torch.randn(130, 48, generator=gen(5))
    _, conv_state, state = dn.layer(x[:30], weights, DIMS, *empty_states())
    out, conv_after, state_after = dn.layer(x[30:], weights, DIMS, conv_state, state)
    step_out, step_conv, step_state = steps(x[30:], weights, conv_state, state)
    assert (out - step_out).abs().max().item() <= 1e-5
    assert (conv_after - step_conv).abs().max().item() <= 1e-6
    assert (state_after - step_state).abs().max().item() <= 1e-5
    assert state_after.abs().max().item() > 0.1


@pytest.mark.parametrize("cuts", [[7, 13, 1], [1, 1, 1, 64, 5], [64, 64, 1]])
def test_split_prefill_equals_one_chunk(cuts):
    """A prefill split anywhere, each piece resuming from the last one's states, equals one chunk."""
    _, weights = reference_layer()
    n = sum(cuts) + 20
    x = torch.randn(n, 48, generator=gen(6))
    whole, conv_whole, state_whole = dn.layer(x, weights, DIMS, *empty_states())
    conv_state, state = empty_states()
    outs, at = [], 0
    for size in [*cuts, n - sum(cuts)]:
        out, conv_state, state = dn.layer(x[at : at + size], weights, DIMS, conv_state, state)
        outs.append(out)
        at += size
    assert (torch.cat(outs) - whole).abs().max().item() <= 1e-5
    assert (conv_state - conv_whole).abs().max().item() <= 1e-6
    assert (state - state_whole).abs().max().item() <= 1e-5


def test_gated_norm_matches_transformers_in_bfloat16():
    """The gated RMSNorm's roundings (normalise in float32, scale in bf16, gate in float32) are transformers'."""
    g = gen(7)
    norm = hf.Qwen3_5RMSNormGated(DIMS.v_dim, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(DIMS.v_dim, generator=g))
    x = torch.randn(10, DIMS.v_heads, DIMS.v_dim, generator=g).to(torch.bfloat16)
    z = torch.randn(10, DIMS.v_heads, DIMS.v_dim, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        want = norm(x, z)
    assert torch.equal(dn.gated_rms_norm(x, z, norm.weight.detach(), 1e-6), want)


def test_recurrent_rule_in_place_is_the_same_step():
    """The in-place decode step leaves the state and gives the output the pure one does."""
    q, k, v, g, beta, _ = rule_inputs(3, seed=8)
    states = torch.randn(3, DIMS.v_heads, DIMS.k_dim, DIMS.v_dim, generator=gen(9))
    out, new_states = dn.recurrent_rule(*prepared(q, k, v), g, beta, states)
    in_place = states.clone()
    out_ = dn.recurrent_rule_(*prepared(q, k, v), g, beta, in_place)
    assert (out_ - out).abs().max().item() <= 1e-6
    assert (in_place - new_states).abs().max().item() <= 1e-6
