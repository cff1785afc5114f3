"""ops.index_query against the reference's index query (RoPE + MXFP4) and head-weight scaling."""

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.formats import mxfp4_fake
from dsv41_decode.ops.index_query import index_query
from dsv41_decode.reference.rope import rope_cis, rope_freqs, rope_tail

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,heads", [(1, 32), (3, 8), (5, 12)])
def test_bitwise_equal_to_the_reference(n, heads):
    g = torch.Generator().manual_seed(n * 100 + heads)
    cfg = ModelConfig.preset("v41-flash")
    raw = (2 * torch.randn(n, heads * 128, generator=g)).to(torch.bfloat16)
    raw[0, :32] = 0.0                               # an all-zero MXFP4 block
    wproj = 3 * torch.randn(n, heads, generator=g)
    pos = torch.randint(0, 1 << 20, (n,), generator=g)
    cis = rope_cis(rope_freqs(cfg, 1), pos)
    scale = 128 ** -0.5 * heads ** -0.5
    iq, w = index_query(raw.to(_DEVICE), wproj.to(_DEVICE), cis.real.contiguous().to(_DEVICE),
                        cis.imag.contiguous().to(_DEVICE), scale)
    ref_iq = mxfp4_fake(rope_tail(raw.view(n, heads, 128), cis, 64))
    ref_w = wproj.to(torch.bfloat16) * scale
    assert torch.equal(iq.cpu().view(torch.int16), ref_iq.view(torch.int16))
    assert torch.equal(w.cpu().view(torch.int16), ref_w.view(torch.int16))


def test_bad_arguments_name_the_argument():
    n, h = 2, 8
    args = dict(iq_raw=torch.zeros(n, h * 128, dtype=torch.bfloat16), wproj=torch.zeros(n, h),
                cos=torch.zeros(n, 32), sin=torch.zeros(n, 32), scale=0.1)
    with pytest.raises(ValueError, match="iq_raw"):
        index_query(**{**args, "iq_raw": torch.zeros(n, h * 64, dtype=torch.bfloat16)})
    with pytest.raises(TypeError, match="wproj"):
        index_query(**{**args, "wproj": torch.zeros(n, h, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="cos"):
        index_query(**{**args, "cos": torch.zeros(n, 16)})


def test_non_tensor_wproj_names_the_argument():
    n, h = 2, 8
    for bad in (None, [1.0, 2.0], torch.zeros(n, h, 1)):
        with pytest.raises(ValueError, match="wproj must be a 2-D tensor"):
            index_query(torch.zeros(n, h * 128, dtype=torch.bfloat16), bad, torch.zeros(n, 32), torch.zeros(n, 32), 0.1)
