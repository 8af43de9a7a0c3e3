"""warmup.py's sizes and its DeepGEMM warm-up of our FP8 linears (the dummy steps themselves run
in tests/e2e: test_generate.py's warm-up test on the CPU, test_gpu_path.py's no-compile test on a GPU)."""

import torch

from vllm_dsv4 import warmup
from vllm_dsv4.model.layers import Linear
from vllm_dsv4.ops import vllm_kernels
from vllm_dsv4.ops.vllm_kernels import BlockFp8Gemm


def test_warm_up_sizes_are_the_powers_of_two_up_to_the_cap_and_the_budget():
    assert warmup.warm_up_sizes(8192) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert warmup.warm_up_sizes(100) == [1, 2, 4, 8, 16, 32, 64]


def test_skip_takes_no_warm_up_step_and_full_takes_them_all(monkeypatch):
    from types import SimpleNamespace

    steps = []
    runner = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=8), uniform_decode_query_len=1,
                             max_num_reqs=4, positions=torch.zeros(8, dtype=torch.long),
                             _dummy_run=lambda tokens, **kw: steps.append((tokens, "uniform_decode" in kw)),
                             get_model=lambda: torch.nn.Module())
    monkeypatch.setattr(warmup, "WARM_UP", "skip")
    warmup.warm_up_kernels(runner)
    assert steps == []
    monkeypatch.setattr(warmup, "WARM_UP", "full")
    warmup.warm_up_kernels(runner)
    # decodes of 1, 2 and 4 requests (max_num_reqs 4); mixed steps of 2, 4 and 8 tokens
    assert sorted(steps) == [(1, True), (2, False), (2, True), (4, False), (4, True), (8, False)]


def linear(rows: int, cols: int, kernel: str, calls: list, groups: int = 1) -> Linear:
    layer = Linear(cols, rows * groups)
    layer.groups = groups
    layer.gemms = tuple(BlockFp8Gemm(kernel, lambda x, g=g: calls.append((kernel, g, tuple(x.shape))) or x)
                        for g in range(groups))
    return layer


def test_deep_gemm_linears_run_once_per_weight_shape_at_vllms_sizes(monkeypatch):
    asked = []

    def sizes(rows, device, max_tokens):
        asked.append((rows, max_tokens))
        return [1, 3, 64]

    monkeypatch.setattr(vllm_kernels, "deep_gemm_warmup_sizes", sizes)
    calls = []
    model = torch.nn.Sequential(
        linear(256, 512, "DeepGemmFp8BlockScaledMMKernel", calls),
        linear(256, 512, "DeepGemmFp8BlockScaledMMKernel", calls),  # same shape: not again
        linear(128, 512, "FlashInferFp8DeepGEMMDynamicBlockScaledKernel", calls, groups=2),  # one group's GEMM
        linear(384, 512, "CutlassFp8BlockScaledMMKernel", calls),  # no JIT: not run
        linear(64, 128, "triton", calls))
    assert warmup.warm_up_deep_gemm(model, 64) == 6
    assert asked == [(256, 64), (128, 64)]
    assert calls == [("DeepGemmFp8BlockScaledMMKernel", 0, (m, 512)) for m in (1, 3, 64)] + \
        [("FlashInferFp8DeepGEMMDynamicBlockScaledKernel", 0, (m, 512)) for m in (1, 3, 64)]


def test_deep_gemm_sizes_follow_vllms_setting(monkeypatch):
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    assert vllm_kernels.deep_gemm_warmup_sizes(4096, torch.device("cpu"), 512) == []
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "full")
    assert vllm_kernels.deep_gemm_warmup_sizes(4096, torch.device("cpu"), 512) == list(range(1, 513))
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "relax")  # vLLM's default: where DeepGEMM's choice can change
    relaxed = vllm_kernels.deep_gemm_warmup_sizes(4096, torch.device("cpu"), 512)
    assert {1, 2, 4, 8, 16, 32, 64, 512} <= set(relaxed) <= set(range(1, 513)) and len(relaxed) < 512


def test_grouped_wo_a_runs_through_the_attention_output_path_at_vllms_sizes(monkeypatch):
    """wo_a bound to DeepGEMM's grouped GEMM: the attention's own output projection runs (de-rotation,
    quantisation, the grouped GEMM above the fused kernel's sizes), once per shape."""
    from vllm_dsv4.model.attention import Attention

    monkeypatch.setattr(vllm_kernels, "deep_gemm_warmup_sizes", lambda rows, device, max_tokens: [2, 2048])
    calls = []

    def attention() -> Attention:
        attn = Attention.__new__(Attention)
        torch.nn.Module.__init__(attn)
        attn.num_heads, attn.head_dim, attn.o_rank = 4, 64, 32
        attn.wo_a = Linear(2 * 64, 2 * 32)
        attn.wo_a.grouped_gemm = object()  # bound (never called here: out_proj stands in for the path)
        attn.out_proj = lambda o, positions: calls.append((tuple(o.shape), tuple(positions.shape)))
        return attn

    assert warmup.warm_up_deep_gemm(torch.nn.Sequential(attention(), attention()), 2048) == 2
    assert calls == [((2, 4, 64), (2,)), ((2048, 4, 64), (2048,))]
