"""The loading loop places every official tensor, dequantised, and names what is wrong."""

import pytest
import torch

from tests.oracle.hf_oracle import oracle_dequant_fp8, oracle_dequant_mxfp4
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.loader.checkpoint import Checkpoint, CheckpointError
from vllm_dsv4.loader.load import load_official_weights
from vllm_dsv4.loader.names import param_target


def empty_params(cfg: Dsv4Config, ckpt: Checkpoint, mtp: bool = False) -> dict[str, torch.nn.Parameter]:
    """A parameter dict shaped like the model's (``mtp``: the MTP draft model's), built from the names
    alone (no vLLM needed): a merged linear's rows are its members' rows."""
    shapes: dict[str, tuple[int, int]] = {}
    for name in ckpt.names():
        if name.endswith(".scale") or name.startswith("mtp.") != mtp:
            continue
        target = param_target(name)
        if target.expert is None:
            spec = ckpt.spec(name)
            shape = spec.shape if spec.dtype not in (torch.float8_e4m3fn, torch.int8) else None
            if shape is None:  # quantised: the dequantised shape is the scale-free logical one
                shape = (spec.shape[0], spec.shape[1] * (2 if spec.dtype == torch.int8 else 1))
            if target.param in shapes:  # another member of a merged linear
                shape = (shapes[target.param][0] + shape[0], *shape[1:])
            shapes[target.param] = shape
    params = {name: torch.nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
              for name, shape in shapes.items()}
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    blocks = ([f"mtp.{k}" for k in range(cfg.draft_layers)] if mtp else
              [f"layers.{layer}" for layer in range(cfg.num_hidden_layers)])
    for block in blocks:
        params[f"{block}.ffn.experts.w13"] = torch.nn.Parameter(torch.full((e, 2 * i, d), float("nan")))
        params[f"{block}.ffn.experts.w2"] = torch.nn.Parameter(torch.full((e, d, i), float("nan")))
    return params


@pytest.fixture
def quantized(tiny_ckpt):
    cfg = Dsv4Config.from_pretrained(tiny_ckpt)
    return cfg, Checkpoint(tiny_ckpt)


def stream(ckpt: Checkpoint, skip=(), replace=None):
    for name in ckpt.names():
        if name in skip:
            continue
        yield name, (replace or {}).get(name, ckpt.get(name))


def test_every_parameter_filled_with_independently_dequantised_values(quantized):
    cfg, ckpt = quantized
    params = empty_params(cfg, ckpt)
    loaded = load_official_weights(cfg, reversed(list(stream(ckpt))), params)  # scales after weights too
    assert loaded == set(params)
    for name, p in params.items():
        assert not torch.isnan(p.data.float()).any(), name
    wq_b = params["layers.1.attn.wq_b.weight"].data
    ref = oracle_dequant_fp8(ckpt.get("layers.1.attn.wq_b.weight"), ckpt.get("layers.1.attn.wq_b.scale"))
    assert torch.equal(wq_b.float(), ref.float())
    w3 = params["layers.2.ffn.experts.w13"].data[5, cfg.moe_intermediate_size :]
    ref = oracle_dequant_mxfp4(ckpt.get("layers.2.ffn.experts.5.w3.weight"), ckpt.get("layers.2.ffn.experts.5.w3.scale"))
    assert torch.equal(w3.float(), ref.float())
    # merged linears: the official weights' rows, stacked in order
    wq_a, wkv = params["layers.1.attn.wqkv_a.weight"].data.split([cfg.q_lora_rank, cfg.head_dim])
    for part, official in ((wq_a, "layers.1.attn.wq_a"), (wkv, "layers.1.attn.wkv")):
        ref = oracle_dequant_fp8(ckpt.get(f"{official}.weight"), ckpt.get(f"{official}.scale"))
        assert torch.equal(part.float(), ref.float()), official
    for module in ("layers.1.attn.compressor", "layers.1.attn.indexer.compressor"):
        kv, gate = params[f"{module}.wkv_gate.weight"].data.chunk(2)
        assert torch.equal(kv, ckpt.get(f"{module}.wkv.weight").float())
        assert torch.equal(gate, ckpt.get(f"{module}.wgate.weight").float())


def test_mtp_draft_load_places_the_mtp_tensors_only(quantized):
    """The draft model's load (vLLM streams it the whole checkpoint) fills every MTP parameter, with
    independently dequantised values, and nothing else (the main model's: the test above)."""
    cfg, ckpt = quantized
    params = empty_params(cfg, ckpt, mtp=True)
    assert params and all(name.startswith("mtp.0.") for name in params)
    assert load_official_weights(cfg, stream(ckpt), params, mtp=True) == set(params)
    for name, p in params.items():
        assert not torch.isnan(p.data.float()).any(), name
    e_proj = oracle_dequant_fp8(ckpt.get("mtp.0.e_proj.weight"), ckpt.get("mtp.0.e_proj.scale"))
    assert torch.equal(params["mtp.0.e_proj.weight"].data.float(), e_proj.float())
    w1 = oracle_dequant_mxfp4(ckpt.get("mtp.0.ffn.experts.3.w1.weight"), ckpt.get("mtp.0.ffn.experts.3.w1.scale"))
    assert torch.equal(params["mtp.0.ffn.experts.w13"].data[3, : cfg.moe_intermediate_size].float(), w1.float())
    assert torch.equal(params["mtp.0.hc_head.base"].data, ckpt.get("mtp.0.hc_head_base").float())


@pytest.mark.parametrize("mtp", [False, True])
def test_base_checkpoint_fills_every_parameter_with_independently_dequantised_values(tiny_base_ckpt, mtp):
    """V4-Flash-Base (FP8 routed experts, float32 scales): dequantised at load (the CPU path), FP8 experts
    and linears alike, for the main model and the MTP draft."""
    cfg, ckpt = Dsv4Config.from_pretrained(tiny_base_ckpt), Checkpoint(tiny_base_ckpt)
    params = empty_params(cfg, ckpt, mtp=mtp)
    assert load_official_weights(cfg, stream(ckpt), params, mtp=mtp) == set(params)
    for name, p in params.items():
        assert not torch.isnan(p.data.float()).any(), name
    block, i = ("mtp.0" if mtp else "layers.2"), cfg.moe_intermediate_size
    for e, linear, rows in ((5, "w1", slice(None, i)), (5, "w3", slice(i, None)), (6, "w2", slice(None))):
        official = f"{block}.ffn.experts.{e}.{linear}"
        ref = oracle_dequant_fp8(ckpt.get(f"{official}.weight"), ckpt.get(f"{official}.scale"))
        got = params[f"{block}.ffn.experts.{'w2' if linear == 'w2' else 'w13'}"].data[e, rows]
        assert torch.equal(got.float(), ref.float()), official
    ref = oracle_dequant_fp8(ckpt.get(f"{block}.attn.wq_b.weight"), ckpt.get(f"{block}.attn.wq_b.scale"))
    assert torch.equal(params[f"{block}.attn.wq_b.weight"].data.float(), ref.float())


def test_missing_scale_is_named(quantized):
    cfg, ckpt = quantized
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wkv\.scale"):
        load_official_weights(cfg, stream(ckpt, skip={"layers.0.attn.wkv.scale"}), empty_params(cfg, ckpt))


@pytest.mark.parametrize("name", ["layers.2.ffn.experts.5.w3.scale", "layers.1.attn.wq_b.scale"])
def test_nan_block_scales_are_named(quantized, name):
    """An e8m0 scale byte 255 is NaN: the load fails naming the tensor and how many of its scales
    are NaN (MXFP4 expert and FP8 linear scales alike), instead of NaN weights."""
    cfg, ckpt = quantized
    scale = ckpt.get(name).clone()
    scale.view(torch.uint8).view(-1)[[0, scale.numel() - 1]] = 255  # two blocks
    problem = rf"{name.replace('.', '[.]')}: 2 of {scale.numel()} block scales are NaN"
    with pytest.raises(CheckpointError, match=problem):
        load_official_weights(cfg, stream(ckpt, replace={name: scale}), empty_params(cfg, ckpt))


def test_base_scales_that_are_not_powers_of_two_are_named(tiny_base_ckpt):
    """V4-Flash-Base's float32 scales are powers of two (the GPU path's FP8 GEMMs rely on it): NaN, inf,
    negative and in-between values are named; 0 (an all-zero block) is not."""
    cfg, ckpt = Dsv4Config.from_pretrained(tiny_base_ckpt), Checkpoint(tiny_base_ckpt)
    name = "layers.3.ffn.shared_experts.w2.scale"
    for bad in (float("nan"), float("inf"), -0.25, 0.375):
        scale = ckpt.get(name).clone()
        scale.view(-1)[0] = bad
        with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}: 1 of 1 block scales are not a power"):
            load_official_weights(cfg, stream(ckpt, replace={name: scale}), empty_params(cfg, ckpt))
    zero = torch.zeros_like(ckpt.get(name))
    load_official_weights(cfg, stream(ckpt, replace={name: zero}), empty_params(cfg, ckpt))


def test_expert_ids_out_of_range_are_named(quantized):
    """tid2eid (hash routing) indexes the experts unchecked on the GPU: an id outside [0, E) fails the load."""
    cfg, ckpt = quantized
    name = "layers.0.ffn.gate.tid2eid"
    ids = ckpt.get(name).clone()
    ids.view(-1)[[0, 5, ids.numel() - 1]] = torch.tensor([-1, cfg.n_routed_experts, 2**40])
    problem = rf"{name.replace('.', '[.]')}: 3 of {ids.numel()} expert ids are outside \[0, {cfg.n_routed_experts}\)"
    with pytest.raises(CheckpointError, match=problem):
        load_official_weights(cfg, stream(ckpt, replace={name: ids}), empty_params(cfg, ckpt))


def test_wrong_shape_is_named_with_expectation(quantized):
    cfg, ckpt = quantized
    bad = {"layers.3.attn.attn_sink": torch.zeros(cfg.num_attention_heads + 1)}
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.attn_sink: expected shape .*\(4,\).*found.*\(5,\)"):
        load_official_weights(cfg, stream(ckpt, replace=bad), empty_params(cfg, ckpt))


def test_unexpected_tensor_is_named(quantized):
    cfg, ckpt = quantized
    extra = list(stream(ckpt)) + [("layers.9.attn.wkv.weight", torch.zeros(2, 2))]
    with pytest.raises(CheckpointError, match=r"layers\.9\.attn\.wkv\.weight: unexpected"):
        load_official_weights(cfg, extra, empty_params(cfg, ckpt))


def test_tensor_parallel_rank_gets_its_slice(quantized):
    """Rank 1 of 2: second half of the heads / groups / shared width, experts 4..7 of 8."""
    from vllm_dsv4.shard import Shard

    cfg, ckpt = quantized
    full = empty_params(cfg, ckpt)
    load_official_weights(cfg, stream(ckpt), full)
    shard = Shard(rank=1, size=2)
    local = {}
    for name, p in full.items():
        shape = list(p.shape)
        if name.endswith(("attn.wq_b.weight", "attn.attn_sink", "attn.wo_a.weight", "shared_experts.w13.weight",
                          "experts.w13", "experts.w2")):
            shape[0] //= 2
        elif name.endswith(("attn.wo_b.weight", "shared_experts.w2.weight")):
            shape[1] //= 2
        local[name] = torch.nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
    assert load_official_weights(cfg, stream(ckpt), local, shard) == set(local)
    half = lambda t, dim: t.chunk(2, dim)[1]  # noqa: E731
    assert torch.equal(local["layers.1.attn.wq_b.weight"], half(full["layers.1.attn.wq_b.weight"], 0))
    assert torch.equal(local["layers.1.attn.attn_sink"], half(full["layers.1.attn.attn_sink"], 0))
    assert torch.equal(local["layers.1.attn.wo_b.weight"], half(full["layers.1.attn.wo_b.weight"], 1))
    assert torch.equal(local["layers.2.ffn.shared_experts.w2.weight"], half(full["layers.2.ffn.shared_experts.w2.weight"], 1))
    assert torch.equal(local["layers.2.ffn.experts.w13"], full["layers.2.ffn.experts.w13"][4:])
    # the shared expert's merged w1 | w3: each member's second half of the rows
    w1, w3 = full["layers.2.ffn.shared_experts.w13.weight"].chunk(2)
    assert torch.equal(local["layers.2.ffn.shared_experts.w13.weight"], torch.cat([half(w1, 0), half(w3, 0)]))
    assert torch.equal(local["layers.0.attn.wqkv_a.weight"], full["layers.0.attn.wqkv_a.weight"])  # replicated


def test_parameters_with_a_scale_beside_them_get_raw_bytes_and_scales(quantized):
    """A ``<target>_scale`` parameter keeps FP8 / MXFP4 weights quantised: bytes copied, not dequantised."""
    cfg, ckpt = quantized
    params = empty_params(cfg, ckpt)
    wq_b, w13 = "layers.1.attn.wq_b.weight", "layers.2.ffn.experts.w13"
    fp8 = ckpt.get(wq_b)
    params[wq_b] = torch.nn.Parameter(torch.empty(fp8.shape, dtype=torch.float8_e4m3fn), requires_grad=False)
    params[f"{wq_b}_scale"] = torch.nn.Parameter(torch.full(ckpt.get("layers.1.attn.wq_b.scale").shape, float("nan")),
                                                  requires_grad=False)
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    params[w13] = torch.nn.Parameter(torch.zeros(e, 2 * i, d // 2, dtype=torch.uint8), requires_grad=False)
    params[f"{w13}_scale"] = torch.nn.Parameter(torch.zeros(e, 2 * i, d // 32, dtype=torch.uint8), requires_grad=False)

    assert load_official_weights(cfg, reversed(list(stream(ckpt))), params) == set(params)
    assert torch.equal(params[wq_b].data.view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(oracle_dequant_fp8(params[wq_b].data, params[f"{wq_b}_scale"].data),
                       oracle_dequant_fp8(fp8, ckpt.get("layers.1.attn.wq_b.scale")).float())
    w3, w3_scale = ckpt.get("layers.2.ffn.experts.5.w3.weight"), ckpt.get("layers.2.ffn.experts.5.w3.scale")
    assert torch.equal(params[w13].data[5, i:], w3.view(torch.uint8))
    assert torch.equal(params[f"{w13}_scale"].data[5, i:], w3_scale.view(torch.uint8))
