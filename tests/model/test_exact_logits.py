"""The output matrix's top logits in float32 (chatkv.model.forward.ExactTop).

The default model's logits lie between 16 and 32, where bfloat16 values are 0.125 apart; its
int8/bf16 head kernels round their outputs to bfloat16. With AMX bf16 kernels the France
prompt's "The" and "L", 0.009 apart in exact arithmetic over the same hidden state, both
round to 25.25, so argmax without ExactTop takes "L" (the lower id) and answers "L'Étoile".
These tests build that situation on purpose, on any CPU: two output rows whose exact logits
differ by less than bfloat16's spacing, the higher one with the higher id."""

from __future__ import annotations

import torch

from chatkv.model.forward import ExactTop, Linear, exact_top
from chatkv.weights.quantised import Int8Linear, quantize_int8

K, V = 64, 300


def tied_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """x and a float32 matrix whose rows 5 and 9 give about 25.23 and 25.24 for x: one
    bfloat16 value apart from neither, so a bf16 output ties them."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, K, generator=g).to(torch.bfloat16)
    w = torch.randn(V, K, generator=g) * 0.05
    xf = x.float()[0]
    unit = xf / (xf @ xf)
    for row, target in ((5, 25.23), (9, 25.24)):
        w[row] += (target - w[row] @ xf) * unit  # w[row] @ x == target
    return x, w


def test_a_bf16_head_ties_the_two_rows_and_exact_top_separates_them():
    x, w = tied_rows()
    wb = w.to(torch.bfloat16)
    exact = x.double() @ wb.double().t()
    assert exact[0, 9] > exact[0, 5] and exact[0, 9] - exact[0, 5] < 0.05
    plain = Linear(wb, pack=False)(x).float()
    assert plain[0, 5] == plain[0, 9]  # the tie the output rounding makes
    head = exact_top(Linear(wb, pack=True), wb)
    assert isinstance(head, ExactTop)
    got = head(x)
    assert int(got.argmax()) == 9 == int(exact.argmax())
    top = plain[0].topk(16).indices  # the rows ExactTop recomputes: the kernel's own top 16
    assert torch.allclose(got[0, top].double(), exact[0, top], atol=1e-4, rtol=0)
    rest = torch.ones(V, dtype=torch.bool)
    rest[top] = False
    assert torch.equal(got[0, rest], plain[0, rest])  # the tail keeps the kernel's values


def test_an_int8_head_gets_the_exact_top_of_its_own_codes_and_scales():
    x, w = tied_rows()
    q = quantize_int8(w)
    lin = Int8Linear(q)
    exact = x.double() @ (q.codes.double() * lin.scales.double()[:, None]).t()  # what the kernel computes with
    head = exact_top(lin, None)
    assert isinstance(head, ExactTop)
    got = head(x)
    assert int(got.argmax()) == int(exact.argmax())
    top = lin(x).float()[0].topk(16).indices
    assert torch.allclose(got[0, top].double(), exact[0, top], atol=1e-4, rtol=0)


def test_several_rows_and_a_bias_and_no_rows():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, K, generator=g).to(torch.bfloat16)
    w = torch.randn(V, K, generator=g).to(torch.bfloat16)
    b = torch.randn(V, generator=g).to(torch.bfloat16)
    head = exact_top(Linear(w, b, pack=False), w)
    got = head(x)
    exact = x.double() @ w.double().t() + b.double()
    for r in range(4):
        top = Linear(w, b, pack=False)(x[r : r + 1]).float()[0].topk(16).indices
        assert torch.allclose(got[r, top].double(), exact[r, top], atol=1e-4, rtol=0)
        assert int(got[r].argmax()) == int(exact[r].argmax())
    assert head(x[:0]).shape == (0, V)
