"""The unpad pass packs by a float or integer 0/1 mask as it does by the bool one it is cast from:
``h * valid.float()[..., None]``, ``h * valid.unsqueeze(-1).to(h.dtype)``, ``type_as(h)``, ``valid.long()``;
a product with such a mask (scaled, per-token weights) is zero at the padding too. A float tensor that is
not 0 at the padding (the mask plus an offset, weights read from data alone) is no row mask: nothing is
packed by it, and the result is still exact."""

import pytest
import torch
from torch import nn

from gemcompile import explain
from tests.compiled_vs_eager import assert_compiled_matches_eager

B, N, D = 3, 7, 8
LENGTHS = torch.tensor([7, 0, 4])

MASKS = {
    "float": (lambda valid, h: h * valid.float()[..., None], True),
    "to_dtype_unsqueeze": (lambda valid, h: h * valid.unsqueeze(-1).to(h.dtype), True),
    "type_as": (lambda valid, h: h * valid[..., None].type_as(h), True),
    "long": (lambda valid, h: h * valid.long()[..., None], True),
    # zero wherever the mask is: the pass proves the padding zero through the product, and packs
    "scaled": (lambda valid, h: h * (0.5 * valid.float())[..., None], True),
    "data_weights": (lambda valid, h, w=torch.rand(B, N): h * (w * valid.float())[..., None], True),
    # near-misses: not 0 at the padding, so nothing to pack by (taking either for a mask would zero rows)
    "offset": (lambda valid, h: h * (valid.float() + 0.5)[..., None], False),
    "data_only": (lambda valid, h, w=torch.rand(B, N): h * w[..., None], False),
}


class Masked(nn.Module):
    def __init__(self, apply):
        super().__init__()
        self.apply_mask = apply
        self.inp, self.mid, self.out = nn.Linear(5, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, lengths):
        valid = torch.arange(N)[None, :] < lengths[:, None]
        h = self.apply_mask(valid, self.inp(x))
        h = h + self.apply_mask(valid, self.out(torch.relu(self.mid(h))))
        return h


@pytest.mark.parametrize("name", list(MASKS))
def test_float_zero_one_masks_pack_like_bool_ones(name):
    apply, packs = MASKS[name]
    torch.manual_seed(0)
    model = Masked(apply)
    x = torch.randn(B, N, 5, requires_grad=True)
    regions = [r.metrics for r in explain(model, x, LENGTHS).rewrites if r.pass_name == "unpad"]
    if packs:
        assert regions and regions[0]["gemms"] == 3, regions
    else:
        assert not regions, regions
    assert_compiled_matches_eager(model, x, LENGTHS, atol=1e-5)

def test_an_integer_tensor_cast_and_multiplied_in_packs_exactly_for_any_values():
    """The float of integer data multiplied into the tokens is zero exactly where the data is, whatever its
    other values: a mask for 0/1 data, weights for counts. The region packs by the nonzero tokens and keeps
    the product (no device check: it would stop a valid run on counts; tests/integration/
    test_unpad_data_masks.py checks masks derived from such data, which need it)."""
    class FloatOfData(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x, counts):
            return (self.lin(x) * counts.float()[..., None]).sum((1, 2))

    torch.manual_seed(0)
    float_of_data = FloatOfData()
    x = torch.randn(B, N, D, requires_grad=True)
    report = explain(float_of_data, x, torch.randint(0, 2, (B, N)))
    assert report.counts["unpad"] == 1
    assert not [n for n in report.graph_after.graph.nodes if n.target is torch._assert_async]
    for counts in (torch.randint(0, 2, (B, N)), torch.randint(-3, 5, (B, N))):
        assert_compiled_matches_eager(float_of_data, x, counts, atol=1e-5)
