"""FP8 128x128-block linears kept quantised: reference, loader + module storage, and vLLM's kernels.

Chain of trust: exact float64 ``x @ W^T`` of the dequantised weight -> the PyTorch reference
(csrc_triton/fp8_linear_ref.py, activation quantised per 128-group, CPU) -> vLLM's block-FP8 kernel
(vllm_kernels.block_fp8_gemm, GPU). The weight is the same FP8 bytes on every side; only the activation's
rounding to e4m3 and the arithmetic differ.

The FP8 error bound (``fp8_bound``): an activation element x in a group with scale s is stored as
q = round(x / s), e4m3. A normal e4m3 number has 4 significant bits (3 stored), so round-to-nearest
is off by at most half an ulp: |x_hat - x| <= 2^-4 |x|. Below 2^-6 (subnormals, spacing 2^-9) the
error is at most 2^-10 s absolute, with s = amax / 448, or its power-of-two ceiling (< 2 amax / 448)
when scales are UE8M0. The clamp to +-448 only trims fp32 rounding of amax / s. Summed over k:
    |y_fp8[n] - y[n]| <= 2^-4 sum_k |x_k| |W_nk| + 2^-10 sum_k s_max(k) |W_nk|.
Arithmetic on top: the reference's fp32 GEMM adds at most (K + 2) 2^-24 sum_k |x_hat_k| |W_nk|; a GPU
kernel adds its bf16 output rounding (2^-8 |y|, 2^-7 with slack) and its accumulation (Hopper FP8
MMA sums each 128-wide block in reduced precision before promoting to fp32; 2^-7 of the sum of
|products| covers DeepGEMM's worst case).

Kernel vs reference ("tight"): the same quantised activation on both sides, so the difference is
arithmetic only: relative RMS <= 2^-7 (measured ~2^-9), while a different activation rounding
alone gives ~2^-5. The kernel's activation scales are amax/448 (CUTLASS, Triton) or UE8M0
(DeepGEMM); the test compares against the reference with the rule the kernel matches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from csrc_triton.formats import e8m0_to_float32
from csrc_triton.fp8_linear_ref import FP8_MAX, GROUP, dequant_act, dequant_weight, fp8_linear, quant_act_fp8
from tests.conftest import load_quantize
from tests.csrc_triton.kernel_cases import vllm_config_for
from tests.loader.test_load import empty_params, stream
from vllm_dsv4.config import ConfigError, Dsv4Config, LayerKind
from vllm_dsv4.loader.checkpoint import Checkpoint, scale_name
from vllm_dsv4.loader.load import load_official_weights
from vllm_dsv4.model.layers import Linear, fp8_linears, hold_fp8_linears
from vllm_dsv4.model.moe import SharedExpert
from vllm_dsv4.shard import Shard

quant_fp8_block = load_quantize().quant_fp8_block

# Kernel vs our reference with the same activation-scale rule. On the H200, vLLM 0.26 picks FlashInfer's
# SM90 block-scale GEMM below 32 tokens; it matched neither rule exactly (0.98% relative RMS against the
# amax rule, wo_a at 7 tokens), so the bound is 2^-6: still far below what a layout or scale bug gives.
TIGHT_RMS = 2.0**-6

# The block-FP8 linears the model holds at V4-Flash dimensions (name: out, in; fp8_linears, with the
# merged wq_a + wkv and shared w1 + w3) and token counts: decode, a ragged few, a prefill chunk.
FLASH_SHAPES = {"wqkv_a": (1536, 4096), "wq_b": (32768, 1024), "indexer_wq_b": (8192, 1024),
                "wo_b": (4096, 8192), "shared_w13": (4096, 4096), "shared_w2": (4096, 2048)}
TOKENS = (1, 7, 300)
WO_A = dict(groups=8, rank=1024, in_features=4096)


# ---- inputs and bounds ----------------------------------------------------------------------------


def fp8_weight(out_features: int, in_features: int, seed: int, device="cpu"):
    """A block-FP8 weight as the checkpoint stores it (e8m0 scales, read as float32 by the loader),
    with block magnitudes spread over 2^-6 .. 2^3 so the scales differ."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.02
    bo, bi = -(-out_features // GROUP), -(-in_features // GROUP)
    spread = torch.exp2(torch.randint(-6, 4, (bo, bi), generator=g).float())
    w = w * spread.repeat_interleave(GROUP, 0)[:out_features].repeat_interleave(GROUP, 1)[:, :in_features]
    q, s = quant_fp8_block(w)
    return q.to(device), e8m0_to_float32(s).to(device)


def activations(tokens: int, in_features: int, seed: int, device="cpu", dtype=torch.bfloat16):
    """[T, K] with per-group magnitudes 2^-4 .. 2^4, a few outliers and (T > 1) one all-zero group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g)
    groups = -(-in_features // GROUP)
    magnitude = torch.exp2(torch.randint(-4, 5, (tokens, groups), generator=g).float())
    x = x * magnitude.repeat_interleave(GROUP, 1)[:, :in_features]
    x = torch.where(torch.rand(x.shape, generator=g) < 1e-3, x * 30, x)
    if tokens > 1:
        x[-1, :GROUP] = 0
    return x.to(dtype).to(device)


def group_amax(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> largest |x| of each 128-group [..., ceil(K/128)]."""
    return F.pad(x.abs(), (0, -x.shape[-1] % GROUP)).unflatten(-1, (-1, GROUP)).amax(-1)


def fp8_bound(x: torch.Tensor, w_hat: torch.Tensor, pow2: bool) -> torch.Tensor:
    """Worst-case |y_fp8 - y| [T, N] from rounding x [T, K] to e4m3 per 128-group (module docstring)."""
    xf, wa = x.double(), w_hat.double().abs()
    s_max = (group_amax(xf) * (2 if pow2 else 1) / FP8_MAX).repeat_interleave(GROUP, -1)[..., : xf.shape[-1]]
    return 2.0**-4 * (xf.abs() @ wa.T) + 2.0**-10 * (s_max @ wa.T)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


# ---- CPU: the reference -----------------------------------------------------------------------------


@pytest.mark.parametrize("pow2", [False, True], ids=["amax", "ue8m0"])
def test_activation_rounding_is_within_half_an_e4m3_ulp(pow2):
    x = activations(5, 300, seed=1, dtype=torch.float32)  # 300: a ragged last group
    q, s = quant_act_fp8(x, pow2)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    amax = group_amax(x)
    assert (amax[-1, 0] == 0) and (s * FP8_MAX >= amax * (1 - 2**-23)).all()  # nothing clips
    if pow2:
        assert torch.equal(s, torch.exp2(torch.log2(s).round())) and (s < 2 * amax.clamp(min=1e-10) / FP8_MAX).all()
    else:  # each group's largest element lands on +-448 exactly
        assert ((group_amax(q.float()) == FP8_MAX) | (amax == 0)).all()
    s_el = s.repeat_interleave(GROUP, -1)[:, :300]
    err = (dequant_act(q, s) - x).abs()
    assert (err <= 2.0**-4 * x.abs() + 2.0**-10 * s_el).all()
    assert (err > 0).any()


@pytest.mark.parametrize("pow2", [False, True], ids=["amax", "ue8m0"])
@pytest.mark.parametrize("out_features,in_features,tokens", [(256, 512, 7), (200, 300, 3), (128, 4096, 2)])
def test_reference_is_within_the_fp8_bound_of_the_dequantised_linear(out_features, in_features, tokens, pow2):
    w, s = fp8_weight(out_features, in_features, seed=out_features)
    x = activations(tokens, in_features, seed=in_features, dtype=torch.float32)
    w_hat = dequant_weight(w, s)
    exact = x.double() @ w_hat.double().T
    got = fp8_linear(x, w, s, pow2_act_scales=pow2)
    assert got.dtype == torch.float32
    arithmetic = (in_features + 2) * 2.0**-24 * (17 / 16) * (x.double().abs() @ w_hat.double().abs().T)
    err = (got.double() - exact).abs()
    bound = fp8_bound(x, w_hat, pow2) + arithmetic
    assert (err <= bound).all(), f"worst err/bound {(err / bound).max():.3f}"
    assert rel_rms(got, exact) > 2.0**-10  # the activation really was rounded to FP8 (fp32 alone: ~1e-7)


def test_grouped_dequantised_is_one_linear_per_group():
    lin = Linear(96, 4 * 24)
    lin.weight.data.normal_()
    x = torch.randn(4, 5, 96)  # group-major
    got = lin.grouped(x)
    want = torch.stack([F.linear(x[g], lin.weight[g * 24 : (g + 1) * 24]) for g in range(4)], 1)
    assert got.shape == (5, 4, 24)
    torch.testing.assert_close(got, want)


def held_linear(out_features: int, in_features: int, seed: int, groups: int = 1) -> Linear:
    lin = Linear(in_features, out_features)
    lin.hold_fp8(groups)
    w, s = fp8_weight(out_features, in_features, seed)
    lin.weight.data.copy_(w)
    lin.weight_scale.data.copy_(s)
    lin.finish_loading()
    return lin


def test_fp8_storage_computes_through_the_reference_on_cpu(cpu_ops):
    lin = held_linear(256, 384, seed=3)
    x = activations(6, 384, seed=4, dtype=torch.float32).view(2, 3, 384)
    assert torch.equal(lin(x), fp8_linear(x, lin.weight, lin.weight_scale))
    grouped = held_linear(2 * 128, 256, seed=5, groups=2)
    xg = activations(2 * 5, 256, seed=6, dtype=torch.float32).view(2, 5, 256)  # group-major
    want = torch.stack([fp8_linear(xg[g], grouped.weight[g * 128 : (g + 1) * 128], grouped.weight_scale[g : g + 1])
                        for g in range(2)], 1)
    assert torch.equal(grouped.grouped(xg), want)
    with pytest.raises(ValueError, match="call grouped"):
        grouped(xg[0])
    with pytest.raises(ValueError, match="3 groups"):
        grouped.grouped(xg[:1].expand(3, 5, 256))


@pytest.mark.parametrize("tokens", TOKENS)
def test_rope_out_proj_reference_is_within_the_fp8_bound(tokens):
    """out_proj_ref (de-rotate, then each head group through its rows of an FP8 wo_a) against the exact
    float64 computation on the dequantised weight: within the FP8 bound of each group's activations."""
    from csrc_triton.out_proj_ref import rope_out_proj
    from csrc_triton.rope_ref import apply_rope_tail, rope_inv_freq

    groups, rank, heads, head_dim = 2, 128, 4, 128
    in_features = heads // groups * head_dim
    w, s = fp8_weight(groups * rank, in_features, seed=9)
    o = activations(tokens, heads * head_dim, seed=10, dtype=torch.float32).view(tokens, heads, head_dim)
    positions, inv_freq = torch.arange(tokens) * 977, rope_inv_freq(32, 10000.0, 1, 4096)
    y = rope_out_proj(o, positions, inv_freq, w, s, groups).double()  # [T, G*R]
    x = apply_rope_tail(o.double(), positions, inv_freq, inverse=True).reshape(tokens, groups, in_features)
    w_hat = dequant_weight(w, s).double()
    for g in range(groups):
        rows = w_hat[g * rank : (g + 1) * rank]
        err = (y[:, g * rank : (g + 1) * rank] - x[:, g] @ rows.T).abs()
        arithmetic = (in_features + 2) * 2.0**-24 * 2 * (x[:, g].abs() @ rows.abs().T)
        assert (err <= fp8_bound(x[:, g], rows, pow2=False) + arithmetic).all(), g


@pytest.mark.parametrize("deep_gemm", [True, False], ids=["with_deepgemm", "without"])
def test_auto_out_proj_binds_the_grouped_gemm_where_deepgemm_runs(cpu_ops, monkeypatch, deep_gemm):
    """``ops.OUT_PROJ == "auto"`` on a GPU: wo_a binds DeepGEMM's grouped GEMM (for steps above
    ``OUT_PROJ_FUSED_MAX_TOKENS``) where vLLM has it, one GEMM per group otherwise; ungrouped
    linears bind one GEMM either way."""
    from vllm_dsv4 import ops
    from vllm_dsv4.ops import vllm_kernels

    monkeypatch.setattr(ops, "OUT_PROJ", "auto")
    monkeypatch.setattr(ops, "USE_KERNELS", True)
    monkeypatch.setattr(vllm_kernels, "has_grouped_fp8_gemm", lambda: deep_gemm)
    grouped = held_linear(2 * 128, 256, seed=24, groups=2)
    assert (grouped.grouped_gemm is not None) == deep_gemm
    assert len(grouped.gemms) == (0 if deep_gemm else 2)
    plain = held_linear(256, 384, seed=25)
    assert plain.grouped_gemm is None and len(plain.gemms) == 1


def test_einsum_out_proj_binds_one_grouped_gemm_that_composes_to_the_reference(cpu_ops, monkeypatch):
    """``ops.OUT_PROJ == "einsum"``: wo_a binds one grouped GEMM (no per-group GEMMs), and the de-rotated,
    quantised activations through it give out_proj_ref's projection: the same groups, in order."""
    from csrc_triton.out_proj_ref import rope_out_proj, rope_quant_fp8
    from csrc_triton.rope_ref import rope_inv_freq
    from vllm_dsv4 import ops

    monkeypatch.setattr(ops, "OUT_PROJ", "einsum")
    groups, rank, heads, head_dim, tokens = 2, 128, 4, 128, 5
    lin = held_linear(groups * rank, heads // groups * head_dim, seed=21, groups=groups)
    assert lin.gemms == () and lin.grouped_gemm is not None
    o = activations(tokens, heads * head_dim, seed=22, dtype=torch.float32).view(tokens, heads, head_dim)
    positions, inv_freq = torch.arange(tokens) * 977, rope_inv_freq(32, 10000.0, 1, 4096)
    y = lin.grouped_quantised(*rope_quant_fp8(o, positions, inv_freq, groups))
    assert y.shape == (tokens, groups * rank)
    assert rel_rms(y, rope_out_proj(o, positions, inv_freq, lin.weight, lin.weight_scale, groups)) <= 2.0**-8
    monkeypatch.setattr(ops, "OUT_PROJ", "reference")
    per_group = held_linear(groups * rank, 256, seed=23, groups=groups)
    with pytest.raises(RuntimeError, match="VLLM_DSV4_OUT_PROJ=einsum"):
        per_group.grouped_quantised(*rope_quant_fp8(o, positions, inv_freq, groups))


def test_fp8_storage_refuses_to_compute_before_finish_loading():
    lin = Linear(128, 128)
    lin.hold_fp8()
    with pytest.raises(RuntimeError, match="finish_loading"):
        lin(torch.zeros(1, 128))
    with pytest.raises(ValueError, match="whole 128-row"):
        Linear(128, 2 * 64).hold_fp8(groups=2)


# ---- the decision ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ktiny_cfg(make_checkpoint_module):
    return Dsv4Config.from_dict(make_checkpoint_module.make_config("ktiny"))


def test_gpu_holds_every_whole_block_fp8_linear_but_experts(ktiny_cfg):
    cfg = ktiny_cfg
    L = cfg.num_hidden_layers
    blocks = [(f"layers.{i}", i) for i in range(L)] + [(f"mtp.{k}", L + k) for k in range(cfg.num_nextn_predict_layers)]
    assert cfg.num_nextn_predict_layers == 1
    want = {f"mtp.0.{w}.weight": 1 for w in ("e_proj", "h_proj")}  # the MTP module's input fusion
    for block, layer in blocks:
        a, f = f"{block}.attn.", f"{block}.ffn.shared_experts."
        want |= {f"{a}{w}.weight": 1 for w in ("wqkv_a", "wq_b", "wo_b")} | {f"{a}wo_a.weight": cfg.o_groups}
        want |= {f"{f}{w}.weight": 1 for w in ("w13", "w2")}
        if cfg.layer_kind(layer) is LayerKind.C4:
            want[f"{a}indexer.wq_b.weight"] = 1
    assert fp8_linears(cfg, on_gpu=True) == want
    assert fp8_linears(cfg, on_gpu=False) == {}  # the CPU path dequantises everything


def test_tensor_parallel_shard_cutting_an_fp8_block_is_a_config_error(ktiny_cfg, make_checkpoint_module):
    # ktiny's shared expert is 128 wide: two ranks would hold 64 rows of each 128-row block.
    with pytest.raises(ConfigError, match=r"shared_experts\.w1\.weight: 128 split over tensor_parallel_size=2"):
        fp8_linears(ktiny_cfg, Shard(0, 2), on_gpu=True)
    raw = make_checkpoint_module.make_config("ktiny")
    raw["moe_intermediate_size"] = 256
    held = fp8_linears(Dsv4Config.from_dict(raw), Shard(1, 2), on_gpu=True)
    assert held["layers.0.attn.wo_a.weight"] == 1 and held["layers.0.ffn.shared_experts.w2.weight"] == 1


def test_tiny_and_unquantised_checkpoints_hold_nothing(tiny_ckpt, tiny_ckpt_unquantized):
    assert fp8_linears(Dsv4Config.from_pretrained(tiny_ckpt), on_gpu=True) == {}  # no dim is whole blocks
    assert fp8_linears(Dsv4Config.from_pretrained(tiny_ckpt_unquantized), on_gpu=True) == {}


# ---- loader + module (tiny checkpoint, CPU) -----------------------------------------------------------


def test_loader_fills_fp8_storage_that_dequantises_to_the_dequantised_load(ktiny_ckpt, cpu_ops):
    """Every linear the GPU path holds in FP8 (merged ones too: ktiny's are whole blocks), filled by
    the loader with the checkpoint's bytes and scales, dequantises to what the dequantising load gives
    and computes within the FP8 bound of it."""
    cfg, ckpt = Dsv4Config.from_pretrained(ktiny_ckpt), Checkpoint(ktiny_ckpt)
    dequantised = empty_params(cfg, ckpt)
    load_official_weights(cfg, stream(ckpt), dequantised)
    held = {name: groups for name, groups in fp8_linears(cfg, on_gpu=True).items() if not name.startswith("mtp.")}

    shared = SharedExpert(cfg, Shard())  # a real module tree, switched by the model's own pass
    prefix = "layers.2.ffn.shared_experts"
    hold_fp8_linears(shared, held, prefix)
    linears = {f"{prefix}.{n}.weight": m for n, m in shared.named_children()}
    for name in held.keys() - linears.keys():
        out_features, in_features = dequantised[name].shape
        linears[name] = Linear(in_features, out_features)
        linears[name].hold_fp8()  # one group: wo_a computed as one linear here
    params = empty_params(cfg, ckpt)
    for name, lin in linears.items():
        params[name], params[f"{name}_scale"] = lin.weight, lin.weight_scale
    assert load_official_weights(cfg, reversed(list(stream(ckpt))), params) == set(params)

    for name, lin in linears.items():
        assert lin.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(dequant_weight(lin.weight, lin.weight_scale), dequantised[name].float()), name
        lin.finish_loading()
        x = activations(3, lin.in_features, seed=7, dtype=torch.float32)
        w_hat = dequantised[name].double()
        err = (lin(x).double() - x.double() @ w_hat.T).abs()
        arithmetic = (lin.in_features + 2) * 2.0**-24 * 2 * (x.double().abs() @ w_hat.abs().T)
        assert (err <= fp8_bound(x, w_hat, pow2=False) + arithmetic).all(), name
    x = activations(4, cfg.hidden_size, seed=8, dtype=torch.float32)
    assert shared(x).shape == (4, cfg.hidden_size)


def test_loader_refuses_a_shard_that_cuts_fp8_blocks(tiny_ckpt):
    cfg, ckpt = Dsv4Config.from_pretrained(tiny_ckpt), Checkpoint(tiny_ckpt)
    name = "layers.0.attn.wo_a.weight"  # 32 rows: two ranks of 16 would share one 128-row block
    params = {name: torch.nn.Parameter(torch.empty(16, 128, dtype=torch.float8_e4m3fn), requires_grad=False),
              f"{name}_scale": torch.nn.Parameter(torch.empty(1, 1), requires_grad=False)}
    pair = [(name, ckpt.get(name)), (scale_name(name), ckpt.get(scale_name(name)))]
    with pytest.raises(ConfigError, match=r"wo_a\.weight: 32 split over tensor_parallel_size=2 leaves 16"):
        load_official_weights(cfg, pair, params, Shard(1, 2))


# ---- vllm_kernels' contract with vLLM's kernels (CPU: the GEMM itself is torch here) -----------------------


def test_block_fp8_gemm_names_a_weight_it_cannot_take():
    from vllm_dsv4.ops.vllm_kernels import block_fp8_gemm

    w, s = fp8_weight(200, 256, seed=16)
    with pytest.raises(ValueError, match=r"whole 128-blocks.*\(200, 256\)"):
        block_fp8_gemm(w, s)


def test_vllm_kernel_base_runs_on_compat_layer(tiny_ckpt, monkeypatch):
    """vLLM's block-FP8 kernel base class (weight processing, per-128-group activation quantisation,
    apply) driven through vllm_kernels' layer object, with a torch GEMM in place of the CUDA one."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.kernels.linear import Fp8BlockScaledMMLinearKernel, FP8ScaledMMLinearLayerConfig
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym

    from vllm_dsv4.ops import vllm_kernels

    class TorchBlockKernel(Fp8BlockScaledMMLinearKernel):
        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):
            return (dequant_act(A, As) @ dequant_weight(B, Bs).T).to(torch.bfloat16)

    def pick(weight_shape):
        return TorchBlockKernel(FP8ScaledMMLinearLayerConfig(
            weight_quant_key=kFp8Static128BlockSym, activation_quant_key=kFp8Dynamic128Sym,
            weight_shape=weight_shape, input_dtype=torch.bfloat16, out_dtype=torch.bfloat16))

    monkeypatch.setattr(vllm_kernels, "_vllm_block_fp8_kernel", pick)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # vLLM quantises with its platform's op
    w, s = fp8_weight(384, 1024, seed=17, device=device)
    x = activations(7, 1024, seed=18, device=device)
    with set_current_vllm_config(vllm_config_for(tiny_ckpt)):
        gemm = vllm_kernels.block_fp8_gemm(w.clone(), s.clone())
        y = gemm(x)
    assert gemm.kernel == "TorchBlockKernel" and y.dtype == torch.bfloat16
    assert rel_rms(y, fp8_linear(x.float(), w, s)) <= TIGHT_RMS  # vLLM's amax/448 activation scales


# ---- GPU: vLLM's kernels -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_context(tiny_ckpt):
    from vllm.config import VllmConfig, set_current_vllm_config

    try:
        config = vllm_config_for(tiny_ckpt)
    except Exception as e:  # the kernels still run; DeepGEMM is then not selectable
        warnings.warn(f"no model config for kernel selection ({e!r}); vLLM picks without DeepGEMM")
        config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


def check_kernel(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, kernel: str) -> None:
    """y [T, N] bf16 from a kernel on x [T, K] and the FP8 weight (w, s): tight vs the reference with
    the matching activation-scale rule, and within the FP8 bound of the exact dequantised linear."""
    refs = {pow2: fp8_linear(x.float(), w, s, pow2) for pow2 in (False, True)}
    errors = {pow2: rel_rms(y, ref) for pow2, ref in refs.items()}
    pow2 = min(errors, key=errors.get)
    assert y.dtype == torch.bfloat16 and y.shape == refs[pow2].shape
    assert errors[pow2] <= TIGHT_RMS, f"{kernel}: relative RMS vs reference {errors} (False: amax, True: ue8m0)"
    w_hat = dequant_weight(w, s).double()
    exact = x.double() @ w_hat.T
    total = x.double().abs() @ w_hat.abs().T
    bound = fp8_bound(x, w_hat, pow2) + 2.0**-7 * (17 / 16) * total + 2.0**-7 * exact.abs()
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"{kernel}: worst err/bound {(err / bound).max():.3f}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", list(FLASH_SHAPES))
def test_vllm_block_fp8_kernel_matches_the_reference(vllm_context, name, tokens):
    from vllm_dsv4.ops.vllm_kernels import block_fp8_gemm

    out_features, in_features = FLASH_SHAPES[name]
    w, s = fp8_weight(out_features, in_features, seed=out_features + in_features, device="cuda")
    x = activations(tokens, in_features, seed=tokens, device="cuda")
    gemm = block_fp8_gemm(w.clone(), s.clone())  # the kernel may re-lay its copy out
    check_kernel(gemm(x), x, w, s, gemm.kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
def test_vllm_triton_fallback_matches_the_reference(vllm_context, tokens):
    from vllm_dsv4.ops.vllm_kernels import triton_block_fp8_gemm

    w, s = fp8_weight(*FLASH_SHAPES["wqkv_a"], seed=11, device="cuda")
    x = activations(tokens, FLASH_SHAPES["wqkv_a"][1], seed=12, device="cuda")
    check_kernel(triton_block_fp8_gemm(w, s)(x), x, w, s, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
def test_grouped_wo_a_in_fp8_matches_the_reference_per_group(vllm_context, tokens):
    """The per-group path (``VLLM_DSV4_OUT_PROJ=grouped``, and ``auto``'s above 1,024 tokens without
    DeepGEMM). Also: binding the groups to vLLM's GEMMs leaves the held bytes as loaded, which is what
    the fused kernel reads under ``auto`` (both paths over the same weight)."""
    groups, rank, in_features = WO_A["groups"], WO_A["rank"], WO_A["in_features"]
    w, s = fp8_weight(groups * rank, in_features, seed=13, device="cuda")
    lin = Linear(in_features, groups * rank).cuda()
    lin.hold_fp8(groups)
    lin.weight.data.copy_(w)
    lin.weight_scale.data.copy_(s)
    lin.finish_loading("grouped")
    assert torch.equal(lin.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(lin.weight_scale, s)
    x = activations(groups * tokens, in_features, seed=14, device="cuda").view(groups, tokens, in_features)
    y = lin.grouped(x)
    assert y.shape == (tokens, groups, rank)
    blocks = rank // GROUP
    for g in range(groups):
        check_kernel(y[:, g], x[g], w[g * rank : (g + 1) * rank], s[g * blocks : (g + 1) * blocks],
                     lin.gemms[g].kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
def test_grouped_wo_a_in_fp8_through_deepgemm_einsum_matches_the_reference(vllm_context, tokens):
    """``VLLM_DSV4_OUT_PROJ=einsum``: our de-rotating quantiser's output through DeepGEMM's grouped
    GEMM (vllm_kernels.py binding 4), each group against the reference linear of the de-rotated activations."""
    from csrc_triton.out_proj import rope_quant_fp8
    from csrc_triton.rope_ref import apply_rope_tail, rope_inv_freq
    from vllm_dsv4.ops.vllm_kernels import grouped_fp8_gemm

    groups, rank, in_features, head_dim = WO_A["groups"], WO_A["rank"], WO_A["in_features"], 512
    heads = groups * in_features // head_dim
    w, s = fp8_weight(groups * rank, in_features, seed=17, device="cuda")
    o = activations(tokens, heads * head_dim, seed=18, device="cuda").view(tokens, heads, head_dim)
    positions = torch.arange(tokens, device="cuda") * 977
    inv_freq = rope_inv_freq(64, 10000.0, 1, 4096).cuda()
    y = grouped_fp8_gemm(w, s, groups)(*rope_quant_fp8(o, positions, inv_freq, groups))
    assert y.shape == (tokens, groups * rank)
    x = apply_rope_tail(o, positions, inv_freq, inverse=True).reshape(tokens, groups, in_features)
    blocks = rank // GROUP
    for g in range(groups):
        check_kernel(y[:, g * rank : (g + 1) * rank], x[:, g], w[g * rank : (g + 1) * rank],
                     s[g * blocks : (g + 1) * blocks], "DeepGEMM fp8_einsum")


@pytest.mark.gpu
def test_vllm_picks_its_own_block_fp8_kernel_not_our_fallback(tiny_ckpt):
    """Under the config the worker has current, an H200 gets a vLLM kernel (FlashInfer+DeepGEMM,
    DeepGEMM or CUTLASS), never our Triton fallback."""
    from vllm.config import set_current_vllm_config

    from vllm_dsv4.ops.vllm_kernels import block_fp8_gemm

    with set_current_vllm_config(vllm_config_for(tiny_ckpt)):
        gemm = block_fp8_gemm(*fp8_weight(*FLASH_SHAPES["wqkv_a"], seed=15, device="cuda"))
    print(f"block-FP8 kernel for wqkv_a on {torch.cuda.get_device_name()}: {gemm.kernel}")
    assert gemm.kernel != "triton"
