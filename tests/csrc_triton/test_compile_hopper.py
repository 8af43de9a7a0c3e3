"""Our Triton kernels compile for Hopper (sm_90) on any machine, GPU or not.

Each launcher runs on CPU tensors with its kernel's ``run`` captured; the captured launch is then
compiled for sm_90 through PTX to a cubin (Triton ships ptxas), with the argument specialisation
Triton's launcher applies (an int equal to 1 becomes a constant, ints and pointers divisible by 16
get that hint), so the code the GPU would build is built here. This catches what the interpreter
accepts but the compiler does not (a kernel reading a plain Python global, an unsupported op), and
checks the resources an H200 launch needs: shared memory within the 227 KiB a block may use, and the
FP8 tensor-core instruction where a tile is meant to use it. The local Triton may be newer than the
device's (3.6 with vLLM 0.26); the GPU runs are the final word.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from csrc_triton import out_proj, rope  # noqa: E402
from tests.csrc_triton.kernel_cases import INTERPRET, out_proj_args, rope_args  # noqa: E402

pytestmark = pytest.mark.skipif(INTERPRET, reason="the interpreter replaces compiled kernels")

HOPPER = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 227 * 1024  # per block on H100 / H200
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                torch.int32: "i32", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


def captured_launches(kernel, launcher, *args) -> list[tuple[tuple, dict]]:
    """The (positional, keyword) arguments of every launch of ``kernel`` that ``launcher(*args)`` makes."""
    launches = []
    with mock.patch.object(kernel, "run", lambda *a, grid, warmup, **kw: launches.append((a, kw))):
        launcher(*args)
    return launches


def compile_for_hopper(kernel, args: tuple, kwargs: dict):
    """Compile one captured launch for sm_90 with the launcher's specialisation (module doc)."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in options}
    signature, constants, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[param.name], constants[(index,)] = "constexpr", value
        elif torch.is_tensor(value):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif type(value) is int:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif type(value) is float:
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{param.name}: cannot specialise {type(value)}")
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=HOPPER, options=options)


# V4-Flash's wo_a at decode (narrow tiles, FP8 operands widened for mma.sync) and prefill (wgmma on e4m3)
@pytest.mark.parametrize("tokens, tensor_core_op", [(1, "mma.sync"), (300, "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3")])
def test_out_proj_compiles_for_hopper(tokens, tensor_core_op):
    args = out_proj_args(tokens, 64, 512, 64, 8, 1024, torch.bfloat16, device="cpu")
    (launch,) = captured_launches(out_proj._rope_out_proj_kernel, out_proj.rope_out_proj, *args)
    compiled = compile_for_hopper(out_proj._rope_out_proj_kernel, *launch)
    assert compiled.metadata.shared <= MAX_SHARED_BYTES
    assert tensor_core_op in compiled.asm["ptx"]
    assert "cp.async" in compiled.asm["ptx"]  # the weight loads are pipelined


def test_rope_compiles_for_hopper():
    (launch,) = captured_launches(rope._rope_tail_kernel, rope.apply_rope_tail,
                                  *rope_args(64, (64,), 512, 64, torch.bfloat16, inverse=True, device="cpu"))
    assert compile_for_hopper(rope._rope_tail_kernel, *launch).metadata.shared <= MAX_SHARED_BYTES
