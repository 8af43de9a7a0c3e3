"""CUDA-graph replay of the ops a decode step runs against the same op run eagerly: bit for bit.

tests/e2e/test_gpu_path.py::test_cuda_graph_decode_matches_eager compares whole generations; this
file names the op when that fails. Each op is captured once on static inputs, then replayed after
other inputs (another seed: other activations, picks, slot lists and lengths) are copied into them,
as vLLM's decode graphs replay with a step's hidden states, positions and block tables, and the
replay's output must equal an eager call's on those inputs. Ops without host reads whose kernels
reduce in a fixed order give identical bits; a difference is state the capture froze (a plan, a
workspace, a length read on the host) or, when two eager calls already differ (checked first), a
reduction order that varies between runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.csrc_triton import kernel_cases as kc
from tests.ops.test_flashmla import _aligned
from vllm_dsv4.kv.layout import Fp8Entry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")]
BF16 = torch.bfloat16


def _copy_into(static, new) -> None:
    """Copy every tensor of ``new`` into ``static``'s (same structure); other values must agree."""
    if isinstance(static, torch.Tensor):
        static.copy_(new)
    elif isinstance(static, (tuple, list)):
        assert len(static) == len(new)
        for s, n in zip(static, new):
            _copy_into(s, n)
    else:
        assert static == new, (static, new)


def assert_replay_matches_eager(fn, inputs_for, seeds=(1, 2)) -> None:
    static = inputs_for(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and initialise outside the capture
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*static)
    for seed in seeds:
        new = inputs_for(seed)
        _copy_into(static, new)
        graph.replay()
        eager = fn(*new)
        # the op alone first: an op whose eager calls differ is nondeterministic, not badly replayed
        assert torch.equal(eager, fn(*new)), ("eager runs differ", seed)
        assert torch.equal(captured, eager), (seed, (captured.double() - eager.double()).abs().max().item())


# routed-expert shapes (D, I, E, top-k): V4-Flash's, where 16 tokens spread thin over the experts, and
# the ktiny e2e checkpoint's, where each expert gets several tokens of a decode step
EXPERT_SHAPES = {"flash": (4096, 2048, 256, 6), "ktiny": (256, 128, 16, 4)}


@pytest.fixture(scope="module", params=list(EXPERT_SHAPES))
def experts(request):
    """(weights, inputs_for(seed)) of one expert shape; every slot routed to a local expert (one rank)."""
    D, I, E, k = EXPERT_SHAPES[request.param]
    *_, w13, s13, w2, s2, limit = kc.moe_mxfp4_args(1, D, I, E, k, BF16, device="cuda")

    def routed(seed: int) -> tuple:
        x, weights, ids, *_ = kc.moe_mxfp4_args(16, D, I, E, k, BF16, p_skip=0.0, seed=seed, device="cuda")
        return x, weights, ids

    return (w13, s13, w2, s2, limit), routed


def test_triton_moe_replays_as_eager(experts):
    from csrc_triton.moe_mxfp4 import moe_experts_mxfp4

    weights, routed = experts
    assert_replay_matches_eager(lambda x, w, ids: moe_experts_mxfp4(x, w, ids, *weights), routed)


def test_marlin_moe_replays_as_eager(experts):
    from vllm_dsv4.ops import vllm_kernels

    weights, routed = experts
    marlin = vllm_kernels.marlin_mxfp4_experts(*[t.clone() if isinstance(t, torch.Tensor) else t for t in weights])
    assert_replay_matches_eager(marlin, routed, seeds=(1, 2, 3, 4))


def test_moe_rows_do_not_depend_on_padding_rows(experts):
    """A decode graph runs a batch padded to its capture size (13 requests in the graph of 16), eager
    runs it as it is: each real row must come out the same either way, or graph and eager part. Our
    kernel reduces each row in a fixed order. vLLM's Marlin MoE does not (at V4-Flash's shape a row of
    5 came out one bf16 step away from the same row padded to 16; its tiling follows the row count),
    which is why its whole-model graph decode parts from eager while each replay matches, and why
    batch-invariant mode (VLLM_DSV4_BATCH_INVARIANT=1) runs our kernel."""
    from csrc_triton.moe_mxfp4 import moe_experts_mxfp4

    weights, routed = experts
    x, w, ids = routed(1)
    for real in (1, 5, 13):
        alone = moe_experts_mxfp4(x[:real], w[:real], ids[:real], *weights)
        padded = moe_experts_mxfp4(x, w, ids, *weights)[:real]
        assert torch.equal(alone, padded), (real, (alone.double() - padded.double()).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_dense_moe_replays_as_eager(dtype):
    """Unquantised experts (ops.moe_experts: the reference reads expert counts on the host, so decode
    steps take the formulation without host reads), at the ktiny shape, in the e2e tests' fp32 too."""
    from vllm_dsv4 import ops

    D, I, E, k = EXPERT_SHAPES["ktiny"]
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to("cuda", dtype)
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to("cuda", dtype)

    def routed(seed: int) -> tuple:
        x, weights, ids, *_ = kc.moe_mxfp4_args(16, D, I, E, k, dtype, p_skip=0.2, seed=seed, device="cuda")
        return x, weights, ids

    assert_replay_matches_eager(lambda x, w, ids: ops.moe_experts(x, w, ids, w13, w2, 10.0), routed)


def test_einsum_out_proj_replays_as_eager():
    """wo_a's einsum route (VLLM_DSV4_OUT_PROJ=auto with DeepGEMM): our quantiser, then the grouped GEMM."""
    from csrc_triton.out_proj import rope_quant_fp8
    from vllm_dsv4.ops import vllm_kernels

    if not vllm_kernels.has_grouped_fp8_gemm():
        pytest.skip("no DeepGEMM grouped FP8 GEMM in this vLLM build or on this device")
    *_, inv_freq, weight, weight_scale, groups = kc.out_proj_args(16, 64, 512, 64, 8, 1024, BF16, device="cuda")
    gemm = vllm_kernels.grouped_fp8_gemm(weight, weight_scale, groups)
    assert_replay_matches_eager(
        lambda o, positions: gemm(*rope_quant_fp8(o, positions, inv_freq, groups)),
        lambda seed: kc.out_proj_args(16, 64, 512, 64, 8, 1024, BF16, seed=seed, device="cuda")[:2])


def test_fused_out_proj_replays_as_eager():
    from csrc_triton.out_proj import rope_out_proj

    assert_replay_matches_eager(rope_out_proj,
                                lambda seed: kc.out_proj_args(16, 64, 512, 64, 8, 1024, BF16, seed=seed, device="cuda"))


def test_indexer_topk_replays_as_eager():
    from csrc_triton.indexer_topk import indexer_topk_paged

    visible = [0, 1, 511, 512, 700, 1024, 2048, 3000]
    fp8 = Fp8Entry(128, None)
    assert_replay_matches_eager(indexer_topk_paged, lambda seed: kc.indexer_paged_args(
        visible, [0, 1, 2, 3, 4, 5, 6, -1], 8, 4096, 64, 128, 512, 64, fp8, BF16, seed=seed, device="cuda"))


def test_flashmla_layers_sharing_a_plan_replay_as_eager():
    """Two C4 layers of a step planned once (ops/flashmla.py): the replay re-plans for the new
    slot-list lengths."""
    from vllm_dsv4.ops import vllm_kernels
    from vllm_dsv4.ops import flashmla

    if vllm_kernels.flashmla_sparse() is None:
        pytest.skip("no FlashMLA sparse kernel in this vLLM build or on this device")

    def two_layers(q, sink, scale, req, window, window_entries, main, main_entries):
        plans = {}  # one step's store: the first layer plans, the second reuses
        window = window._replace(plans=plans)
        first = flashmla.sparse_attn_cached(q, sink, scale, req, window, window_entries, main, main_entries)
        second = flashmla.sparse_attn_cached(q.flip(1), sink, scale, req, window, window_entries, main, main_entries)
        return torch.cat([first, second])

    def inputs_for(seed):
        q, sink, scale, req, window, window_entries, main, main_entries = kc.sparse_attn_cached_args(
            32, 64, 512, 128, 512, Fp8Entry(512, 64), BF16, E=(64, 64), entries=(4096, 4096), seed=seed,
            device="cuda")
        window, main = _aligned(window), _aligned(main)
        return q, sink, scale, req, window, window_entries, main, main_entries

    assert_replay_matches_eager(two_layers, inputs_for)



@pytest.mark.parametrize("layer", [0, 2], ids=["hash_routed", "score_routed"])
@pytest.mark.parametrize("backend", ["triton", "marlin"])
def test_moe_layer_replays_as_eager(ktiny_ckpt, monkeypatch, backend, layer):
    """A whole MoE layer of the ktiny e2e checkpoint (router, routed experts on ``backend``, FP8 shared
    expert), loaded as the model loads it: what tests/e2e/test_gpu_path.py's CUDA-graph comparison runs
    per layer, without the engine around it."""
    from vllm.config import set_current_vllm_config

    from tests.loader.test_load import empty_params, stream
    from vllm_dsv4 import ops
    from vllm_dsv4.config import Dsv4Config
    from vllm_dsv4.loader.checkpoint import Checkpoint
    from vllm_dsv4.loader.load import load_official_weights
    from vllm_dsv4.model.decoder import finish_loading
    from vllm_dsv4.model.layers import fp8_linears, hold_fp8_linears
    from vllm_dsv4.model.moe import MoE
    from vllm_dsv4.shard import Shard

    cfg, ckpt = Dsv4Config.from_pretrained(ktiny_ckpt), Checkpoint(ktiny_ckpt)
    prefix = f"layers.{layer}.ffn"
    default = torch.get_default_dtype()
    torch.set_default_dtype(BF16)  # as vLLM builds the model
    try:
        moe = MoE(cfg, layer < cfg.num_hash_layers, Shard())
    finally:
        torch.set_default_dtype(default)
    hold_fp8_linears(moe, {n: g for n, g in fp8_linears(cfg, Shard(), on_gpu=True).items() if n.startswith(prefix)},
                     prefix)
    params = empty_params(cfg, ckpt) | {f"{prefix}.{name}": p for name, p in moe.named_parameters()}
    load_official_weights(cfg, stream(ckpt), params)
    moe.to("cuda")
    monkeypatch.setattr(ops, "MOE_BACKEND", backend)
    with set_current_vllm_config(kc.vllm_config_for(ktiny_ckpt)):  # vLLM's FP8 kernel choice reads it
        finish_loading(moe)
    assert (moe.experts.marlin is not None) == (backend == "marlin")

    def inputs_for(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, cfg.hidden_size, generator=g).to("cuda", BF16)
        return x, torch.randint(0, cfg.vocab_size, (16,), generator=g).to("cuda")

    assert_replay_matches_eager(moe, inputs_for, seeds=(1, 2, 3, 4))
