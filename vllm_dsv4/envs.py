"""Every environment variable the plugin reads, with its default and meaning: the one list of them.

``user`` switches are a supported configuration (the README documents them); ``benchmark`` ones exist
to compare or bisect code paths on the GPU and are not. vLLM's own variables that our code reads are
listed too (``vllm``), with what we do with them; vLLM documents their values.

A module reads its switches once, when it is imported (``Switch.read()`` at module level), so every
step of a process takes the same paths; the kernel-path switches are read only where kernels run
(``ops``), so an unused one is never checked. Modules: ``ops`` (OPS, MOE, BATCH_INVARIANT,
VLLM_BATCH_INVARIANT, OUT_PROJ, ATTN), ``model.attention`` (ATTN_QUERY_CHUNK, ATTN_CALL_BYTES),
``warmup`` (WARMUP), ``compat`` (BREAKABLE_CUDAGRAPH) and ``patches`` (V2_MODEL_RUNNER), both read when
vLLM's config is checked, ``ops.vllm_kernels`` (DEEP_GEMM_WARMUP, read at warm-up), ``vision.processor``
(MAX_IMAGE_MB), ``serving.cli`` (PLUGINS), ``plugin`` (TRITON_CACHE_DIR, VLLM_CACHE_ROOT, at registration).

The KV connector takes its options from vLLM's ``kv_connector_extra_config``, not from the environment:
they are listed in ``connector/options.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    """One environment variable: ``choices`` lists the documented values (any value when empty); a
    kernel-path switch (``or_reference``) also takes ``reference``, the value ``ops`` reports for it
    where no kernels run."""

    name: str
    default: str | None
    audience: str  # "user", "benchmark" or "vllm"
    meaning: str
    choices: tuple[str, ...] = ()
    or_reference: bool = False
    through_vllm: bool = False  # read as vLLM parses it (vllm.envs), which owns its default and values

    def read(self, default: str | None = None) -> str:
        """The value now (``default`` instead of the listed one where the default depends on the
        caller); ValueError naming the variable and the documented values for any other value."""
        if self.through_vllm:
            import vllm.envs

            return getattr(vllm.envs, self.name)
        value = os.environ.get(self.name, self.default if default is None else default)
        accepted = self.choices + (("reference",) if self.or_reference else ())
        if self.choices and value not in accepted:
            quoted = [repr(c) for c in self.choices]
            raise ValueError(f"{self.name}={value!r}: use {', '.join(quoted[:-1])} or {quoted[-1]}")
        return value

    def raw(self) -> str | None:
        """The value now, None where the variable is not set."""
        return os.environ.get(self.name)


OPS = Switch("VLLM_DSV4_OPS", "triton", "benchmark", meaning=(
    "With CUDA, 'triton' runs our Triton kernels (and vLLM's GEMMs and attention kernels where they apply); "
    "'reference' runs the PyTorch references of csrc_triton instead, as the CPU path does, to bisect a kernel "
    "against them. Without CUDA the references run whatever it says."))
MOE = Switch("VLLM_DSV4_MOE", "auto", "user", choices=("auto", "triton", "marlin"), or_reference=True, meaning=(
    "Packed MXFP4 experts on the GPU: 'auto', vLLM's Marlin MXFP4 MoE where vLLM ships it (the faster; a row's "
    "result moves by a bf16 rounding with the padding rows of a CUDA graph's batch), our Triton MoE otherwise and "
    "in batch-invariant mode; 'triton' or 'marlin' force one ('marlin' is refused in batch-invariant mode)."))
BATCH_INVARIANT = Switch("VLLM_DSV4_BATCH_INVARIANT", "0", "user", choices=("0", "1"), meaning=(
    "'1': batch-invariant mode: no row's result depends on the other rows of its step or on the padding rows a "
    "CUDA graph adds (the routed experts run our Triton MoE), so CUDA-graph decode repeats eager bit for bit. "
    "Also on where vLLM's VLLM_BATCH_INVARIANT is."))
VLLM_BATCH_INVARIANT = Switch("VLLM_BATCH_INVARIANT", "0", "vllm", through_vllm=True, meaning=(
    "vLLM's batch-invariant mode; on, it turns ours on too (VLLM_DSV4_BATCH_INVARIANT)."))
OUT_PROJ = Switch("VLLM_DSV4_OUT_PROJ", "auto", "benchmark", choices=("auto", "grouped", "fused", "einsum"),
                  or_reference=True, meaning=(
    "wo_a with FP8 weights on the GPU: 'auto', our fused kernel up to ops.OUT_PROJ_FUSED_MAX_TOKENS tokens, above "
    "it our de-rotating quantiser then DeepGEMM's grouped GEMM where vLLM ships it (else the RoPE kernel then a "
    "block-FP8 GEMM per head group); 'fused', 'grouped' and 'einsum' take one of those paths at every size."))
ATTN = Switch("VLLM_DSV4_ATTN", "flashmla", "benchmark", choices=("flashmla", "triton"), or_reference=True, meaning=(
    "Attention over the caches on the GPU: 'flashmla', FlashMLA's sparse decode and prefill kernels where they "
    "apply (FP8 caches, head dim 512, Hopper or Blackwell), our Triton kernel otherwise; 'triton', ours everywhere."))
ATTN_QUERY_CHUNK = Switch("VLLM_DSV4_ATTN_QUERY_CHUNK", None, "benchmark", meaning=(
    "Queries attended per attention call, at most (default 8192 with the kernels, which read keys in place; 2048 "
    "on the reference path, which gathers them)."))
ATTN_CALL_BYTES = Switch("VLLM_DSV4_ATTN_CALL_BYTES", str(1 << 30), "benchmark", meaning=(
    "Bytes an attention call's slot lists and temporaries may take; calls take fewer queries past it (vLLM's "
    "profile run binds no cache, so it never reserves them)."))
WARMUP = Switch("VLLM_DSV4_WARMUP", "full", "user", choices=("full", "skip"), meaning=(
    "'full': before the engine is ready, dummy steps compile every kernel variant serving can need; 'skip': none, "
    "a quicker start whose kernels compile when a step first needs them (seconds each, stalling that step)."))
BREAKABLE_CUDAGRAPH = Switch("VLLM_USE_BREAKABLE_CUDAGRAPH", None, "vllm", meaning=(
    "vLLM 0.26's breakable CUDA graphs: '1' on, '0' off, unset on for DeepSeek-V4. With them a piecewise "
    "cudagraph_mode is kept (attention runs eager between graph pieces); without, CUDA graphs are decode-only."))
DEEP_GEMM_WARMUP = Switch("VLLM_DEEP_GEMM_WARMUP", "relax", "vllm", through_vllm=True, meaning=(
    "vLLM's DeepGEMM warm-up sizes ('relax', 'full', 'skip'); our DeepGEMM-backed linears are warmed at the "
    "same token counts."))
V2_MODEL_RUNNER = Switch("VLLM_USE_V2_MODEL_RUNNER", None, "vllm", through_vllm=True, meaning=(
    "vLLM's choice of Model Runner V2; with DSpark on our DeepSeek-V4 (which drafts in V1, patch 5), set on it "
    "is refused with an error naming it, set off or unset it changes nothing."))
MAX_IMAGE_MB = Switch("VLLM_DSV4_MAX_IMAGE_MB", "20", "user", meaning=(
    "The largest image file (or data URI, decoded) a request may send, in MiB; a larger one is refused with a "
    "400 naming its size. vLLM's own VLLM_MAX_IMAGE_PIXELS bounds the decoded pixels."))
PLUGINS = Switch("VLLM_PLUGINS", None, "vllm", meaning=(
    "vLLM's list of the general plugins to load (all installed ones when unset); `vllm-dsv4 ... --plugin NAME` "
    "adds NAME to it."))

TRITON_CACHE_DIR = Switch("TRITON_CACHE_DIR", None, "user", meaning=(
    "Triton's kernel cache (Triton's variable). Unset, the plugin sets it to VLLM_CACHE_ROOT/triton in every "
    "process: our kernels and vLLM's compile once into vLLM's cache root, beside DeepGEMM's, one folder to keep "
    "for warm starts."))
VLLM_CACHE_ROOT = Switch("VLLM_CACHE_ROOT", "~/.cache/vllm", "vllm", through_vllm=True, meaning=(
    "vLLM's cache root; Triton's kernel cache goes under it unless TRITON_CACHE_DIR is set."))

SWITCHES = (OPS, MOE, BATCH_INVARIANT, VLLM_BATCH_INVARIANT, OUT_PROJ, ATTN, ATTN_QUERY_CHUNK, ATTN_CALL_BYTES,
            WARMUP, BREAKABLE_CUDAGRAPH, DEEP_GEMM_WARMUP, V2_MODEL_RUNNER, MAX_IMAGE_MB, PLUGINS, TRITON_CACHE_DIR,
            VLLM_CACHE_ROOT)
