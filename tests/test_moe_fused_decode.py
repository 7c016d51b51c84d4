"""The one-launch MoE decode (kernels/moe/fused_decode.py) against the SparseMoE reference path on fresh random
data: tiny shapes under the Triton interpreter on CPU (one program, which meets every wait itself), and on a GPU
(a program per multiprocessor, waiting on each other's counters); real shapes in benchmarks/moe_gpu.py."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.moe import fused_decode as fd  # noqa: E402
from sluice.kernels.moe import triton as mt  # noqa: E402
from sluice.layers.linear import Linear  # noqa: E402
from sluice.layers.moe import SparseMoE, SwiGLU  # noqa: E402
from sluice.quant.affine import QuantizedTensor, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def layer_and_x(E, H, I, k, bits, gs, router, shared=True, seed=0, norm=True):
    g = torch.Generator().manual_seed(seed)
    q = (lambda *shape: quantize(torch.randn(*shape, generator=g) * 0.05, bits, gs))
    sh = SwiGLU(Linear(q(2 * I, H)), Linear(q(H, I)), I) if shared else None
    if router == "dense":
        gates = [Linear(torch.randn(n, H, generator=g)) for n in (E, 1)]
    else:  # quantized like MLX stores it: 8-bit
        gates = [Linear(quantize(torch.randn(n, H, generator=g), router, 64)) for n in (E, 1)]
    layer = SparseMoE(gates[0], q(E, 2 * I, H), q(E, H, I), k, norm, sh, gates[1] if shared else None)
    # fp32 activations: no router near-ties between the fp32 paths
    return layer.to(DEVICE), torch.randn(1, H, generator=g).to(DEVICE)


def router_of(layer):
    return layer.gates.qt if layer.gates.quantized else layer.gates.weight


# (experts, hidden, intermediate, top-k, bits, group, router, shared, item words, renormalise)
CASES = [
    (8, 128, 64, 2, 4, 64, 8, True, 64, True),  # many items: 32 gate_up items per slot, 16 n-blocks
    (8, 128, 64, 3, 4, 32, "dense", True, 4096, False),  # one item per slot
    (16, 256, 128, 4, 8, 64, 8, True, 128, True),  # router and experts share one x layout
    (8, 128, 64, 2, 2, 32, 4, False, 64, True),  # no shared expert; a 4-bit router with its own layout
]


@pytest.mark.parametrize("case", CASES, ids=[f"E{c[0]}-H{c[1]}-I{c[2]}-k{c[3]}-{c[4]}bit-g{c[5]}-r{c[6]}-"
                                             f"{'shared' if c[7] else 'noshared'}-w{c[8]}" for c in CASES])
def test_fused_decode_matches_the_reference_path(case):
    E, H, I, k, bits, gs, router, shared, words, norm = case
    layer, x = layer_and_x(E, H, I, k, bits, gs, router, shared, seed=sum(c for c in case if isinstance(c, int)),
                           norm=norm)
    shared_expert = layer._shared_as_expert(mt)
    assert (shared_expert is not None) == shared
    assert fd.supports(router_of(layer), layer.gate_up, layer.down, k, shared_expert)
    ref = layer._forward_reference(x)
    for _ in range(2):  # the second launch finds the counters the first one returned to zero
        out = fd.moe_decode_fused(x, router_of(layer), layer.gate_up, layer.down, k, norm, shared_expert,
                                  item_words=words)
        assert out.dtype == x.dtype and out.shape == (1, H)
        assert rel_err(out, ref) <= 1e-2
    counters = [ws["counters"] for key, ws in fd._WORKSPACES.items() if key[0] == str(x.device)]
    assert all(int(c.abs().sum()) == 0 for c in counters)


def test_fused_decode_in_bf16():
    layer, x = layer_and_x(8, 128, 64, 2, 4, 64, 8)
    xb = x.bfloat16()
    out = fd.moe_decode_fused(xb, router_of(layer), layer.gate_up, layer.down, 2, True, layer._shared_as_expert(mt))
    assert out.dtype == torch.bfloat16 and rel_err(out, layer._forward_reference(x)) <= 1e-2


def test_fused_decode_rejects_what_it_does_not_run():
    layer, x = layer_and_x(8, 128, 64, 2, 4, 64, 8)
    args = (router_of(layer), layer.gate_up, layer.down, 2, True, layer._shared_as_expert(mt))
    with pytest.raises(ValueError, match="one bf16/fp16/fp32 row"):
        fd.moe_decode_fused(torch.cat([x, x]), *args)
    with pytest.raises(ValueError, match=r"\[1, 128\]"):
        fd.moe_decode_fused(x[:, :64], *args)
    with pytest.raises(ValueError, match="unsupported"):  # router rows must be E + 1 with a shared expert
        fd.moe_decode_fused(x, layer.gates.qt.weight[:8], *args[1:])
    gu = layer.gate_up
    odd = QuantizedTensor(gu.weight[:, :96], gu.scales[:, :96], gu.biases[:, :96], gu.bits, gu.group_size)
    assert not fd.supports(args[0], odd, layer.down, 2, None)  # I = 48: not a power of two
    assert not fd.supports(args[0], gu, layer.down, 17, None)  # top-k above the kernels' limit
