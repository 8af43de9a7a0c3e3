"""Runs one vLLM engine with the plugin in a fresh process and saves what it produced.

Usage: python run_vllm.py JOB.json OUT.pt. The job names the checkpoint, the engine arguments and
batches of prompts (token ids); each batch is one ``generate`` call (greedy, or at the batch's
``temperature``), optionally on its prompts
extended by an earlier batch's outputs (``extend_with_batch``); ``poison_kv_cache`` fills the caches
with garbage before the first batch, ``fill_uninitialized_memory`` every later allocation with NaN
(integers with their largest value); ``record_draft_logprobs`` keeps what an MTP draft model
scored, ``record_dspark`` what a DSpark drafter computed (dspark_record.py; ``record_drafts``: its
drafts only; ``pad_draft_batches``: block steps padded as CUDA graphs pad them); ``warm_up_kernels``
takes warmup.py's steps before the first batch (counting their attention calls);
``count_kernel_compiles`` lists our Triton kernels' compiles before ready and in each batch;
``force_drafts`` (sequences) makes the drafter propose their tokens, wrong at each batch's
``wrong_at`` (forced_drafts.py).
Every engine gets its own process because vLLM on CPU spawns workers and keeps process-global state.
"""

import json
import os
import sys
import time

import torch


def logprob_rows(steps: list[dict], vocab: int, sparse: bool) -> torch.Tensor:
    """[N, vocab] float64 log-probs of N positions: dense with -inf where vLLM returned none, or
    sparse (top-k of a 129k-token vocabulary: dense, 1k rows would take a gigabyte). Built in one
    indexed store: element by element, a 16 x 2k-token batch would take minutes."""
    rows = torch.tensor([r for r, d in enumerate(steps) for _ in range(len(d))], dtype=torch.long)
    cols = torch.tensor([t for d in steps for t in d], dtype=torch.long)
    values = torch.tensor([lp.logprob for d in steps for lp in d.values()], dtype=torch.float64)
    if sparse:
        return torch.sparse_coo_tensor(torch.stack([rows, cols]), values, (len(steps), vocab)).coalesce()
    out = torch.full((len(steps), vocab), float("-inf"), dtype=torch.float64)
    out[rows, cols] = values
    return out


def count_preemptions() -> list:
    """Counts the scheduler's preemptions (the engine core runs in this process: see __main__)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    calls = []
    original = Scheduler._preempt_request

    def counted(self, request, *args, **kwargs):
        calls.append(request.request_id)
        return original(self, request, *args, **kwargs)

    Scheduler._preempt_request = counted
    return calls


def count_dummy_batches() -> list:
    """Counts the steps this engine ran a dummy batch because another DP rank still had work."""
    from vllm.v1.engine.core import EngineCore

    calls = []
    original = EngineCore.execute_dummy_batch

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    EngineCore.execute_dummy_batch = counted
    return calls


def record_draft_logprobs() -> list:
    """Records what the MTP draft model scores: per row given to ``compute_logits``, (position, the
    token its input embedded, fp64 log-probs, whether its input streams were the draft's own output of
    the previous draft step rather than the main model's), the row found among the streams the last
    ``forward`` returned (the proposer passes a gather of them; rows that match no or several are left
    out)."""
    from vllm_dsv4.model.mtp import DeepseekV4MTP

    rows, last = [], {}
    forward, compute_logits = DeepseekV4MTP.forward, DeepseekV4MTP.compute_logits

    def found_in(x, y):
        """[len(x), len(y)]: row i of x equals row j of y."""
        return (x[:, None, :] == y[None, :, :]).all(-1)

    def recorded_forward(self, input_ids, positions, hidden_states, *args, **kwargs):
        out = forward(self, input_ids, positions, hidden_states, *args, **kwargs)
        # (a later draft step's batch may be padded: some rows match nothing)
        chained = "out" in last and bool(found_in(hidden_states, last["out"]).any())
        last.update(out=out, positions=positions.tolist(), input_ids=input_ids.tolist(), chained=chained)
        return out

    def recorded_logits(self, hidden_states, *args, **kwargs):
        logits = compute_logits(self, hidden_states, *args, **kwargs)
        for row, matches in enumerate(found_in(hidden_states, last["out"])):
            (index,) = matches.nonzero()[:, 0].tolist() or [None]
            if index is not None and matches.sum() == 1:
                rows.append((last["positions"][index], last["input_ids"][index],
                             torch.log_softmax(logits[row].double(), -1).cpu(), last["chained"]))
        return logits

    DeepseekV4MTP.forward, DeepseekV4MTP.compute_logits = recorded_forward, recorded_logits
    return rows


def generate_with_preemptions(llm, prompts, params, steps: set[int]) -> list:
    """Steps the engine by hand; after each step in ``steps`` every running request but the oldest
    is preempted through the scheduler's own method (its blocks freed, its tokens recomputed later).
    vLLM 0.32 admits requests so that they rarely need preempting, so the test forces it."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    scheduler = engine.engine_core.engine_core.scheduler
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
        step += 1
        if step in steps:
            for request in list(scheduler.running[1:]):
                scheduler.running.remove(request)
                scheduler._preempt_request(request, time.monotonic())
                # vLLM 0.26 resends a resumed request's tokens only if it did not run in the previous
                # step; a real preemption happens while scheduling, so it never has.
                getattr(scheduler, "prev_step_scheduled_req_ids", set()).discard(request.request_id)
    return [finished[i] for i in range(len(prompts))]


def poison_kv_caches(worker) -> int:
    """Fills every page of the model's caches with finite garbage (bytes 0x5A: 1.5e16 in bf16, 2.4e-14
    in fp32, 20 as e4m3 values or 1.5e16 as their fp32 scales), as pages left by other requests look to
    a new one; returns how many cache tensors it filled. Called through ``collective_rpc``."""
    from vllm_dsv4.kv.layer import CacheLayer

    storages = {}
    for layer in worker.model_runner.get_model().modules():
        if isinstance(layer, CacheLayer) and layer.kv_cache.numel():
            storage = layer.kv_cache.untyped_storage()
            storages[storage.data_ptr()] = storage  # layers of one KV group share a tensor
    for storage in storages.values():
        storage.fill_(0x5A)
    return len(storages)


def fill_uninitialized_memory(worker) -> bool:
    """From now on torch fills what ``empty`` allocates (NaN, or an integer's largest value), so a kernel
    that reads a temporary before writing it shows, whatever the allocator hands out. Torch does so only
    in deterministic mode; ``warn_only`` keeps the ops that have no deterministic variant (a warning
    each). Called through ``collective_rpc``."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    return torch.are_deterministic_algorithms_enabled()


def warm_up(worker) -> dict:
    """Takes warmup.py's steps (on a GPU vLLM's kernel warm-up has run them already; the CPU
    worker never calls it) and counts the attention calls they made, by path. Called through
    ``collective_rpc``."""
    from vllm_dsv4 import ops
    from vllm_dsv4.warmup import warm_up_kernels

    calls = {"decode": 0, "prefill": 0}
    originals = {"decode": ops.sparse_attn_cached, "prefill": ops.sparse_attn_prefill}

    def counted(path):
        def call(*args, **kwargs):
            calls[path] += 1
            return originals[path](*args, **kwargs)
        return call

    ops.sparse_attn_cached, ops.sparse_attn_prefill = counted("decode"), counted("prefill")
    try:
        warm_up_kernels(worker.model_runner)
    finally:
        ops.sparse_attn_cached, ops.sparse_attn_prefill = originals["decode"], originals["prefill"]
    return calls


def count_kernel_compiles() -> list:
    """Records each compile of one of our Triton kernels (module ``csrc_triton``) in this process (the
    engine's: see __main__), by kernel name, through Triton's post-compile hook."""
    import triton

    compiles, chained = [], triton.knobs.runtime.jit_post_compile_hook

    def hook(*, fn, **kwargs):
        if fn.module.startswith("csrc_triton"):
            compiles.append(fn.name)
        return chained(fn=fn, **kwargs) if chained else None

    triton.knobs.runtime.jit_post_compile_hook = hook
    return compiles


def spec_decode_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens), by metric name."""
    return {m.name: m.value if hasattr(m, "value") else list(m.values) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and (hasattr(m, "value") or hasattr(m, "values"))}


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as the engine will; fail here, loudly, if our entry point is missing
    entry = ModelRegistry.models["DeepseekV4ForCausalLM"]
    assert entry.module_name.startswith("vllm_dsv4"), f"plugin not loaded: {entry}"
    job = json.load(open(job_path))
    preemptions, dummy_batches = count_preemptions(), count_dummy_batches()
    draft_rows = record_draft_logprobs() if job.get("record_draft_logprobs") else []
    if job.get("record_dspark"):
        from dspark_record import record_dspark  # beside this script

        draft_rows = record_dspark()
    if job.get("record_drafts"):
        from dspark_record import record_drafts

        draft_rows = record_drafts()
    if job.get("pad_draft_batches"):
        from dspark_record import pad_draft_batches

        pad_draft_batches()
    compiles = count_kernel_compiles() if job.get("count_kernel_compiles") else []
    engine_args = {"enforce_eager": True, **job["engine"]}  # CUDA graphs only where a job asks for them
    if "force_drafts" in job:
        engine_args["worker_extension_cls"] = "forced_drafts.ForcedDrafts"  # beside this script
    llm = LLM(model=job["model"], skip_tokenizer_init=True, seed=0, max_logprobs=-1, disable_log_stats=False,
              **engine_args)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    poisoned = sum(llm.collective_rpc(poison_kv_caches)) if job.get("poison_kv_cache") else 0
    filling = all(llm.collective_rpc(fill_uninitialized_memory)) if job.get("fill_uninitialized_memory") else False
    warm_up_calls = llm.collective_rpc(warm_up) if job.get("warm_up_kernels") else []

    compiled = {"before_ready": list(compiles), "batches": []}  # kernel names, by when they compiled
    batches = []
    spec_decode = []  # vLLM's speculative-decoding counters after each batch
    for batch in job["batches"]:
        compiled_before = len(compiles)
        if "force_drafts" in job:  # the batch's draft at "wrong_at" wrong (None: every draft right)
            llm.collective_rpc("force_drafts", args=(job["force_drafts"], batch.get("wrong_at")))
        # logprobs: True for the whole vocabulary, k for the top k (stored sparse), False for none
        want_logprobs = batch.get("logprobs", False)
        want_prompt_logprobs = batch.get("prompt_logprobs", want_logprobs)  # (vLLM skips prefix-cache hits for them)
        top_k = None if isinstance(want_logprobs, bool) else want_logprobs
        count = -1 if top_k is None else top_k
        params = SamplingParams(
            temperature=batch.get("temperature", 0.0),
            max_tokens=job["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            logprobs=count if want_logprobs else None,
            prompt_logprobs=count if want_prompt_logprobs else None,
        )
        prompt_ids = batch["prompts"]
        if "extend_with_batch" in batch:  # teacher forcing: each prompt followed by an earlier batch's output
            earlier = batches[batch["extend_with_batch"]]
            prompt_ids = [p + r["tokens"] for p, r in zip(prompt_ids, earlier)]
            params.max_tokens = 1
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        if batch.get("preempt_at_steps"):
            outputs = generate_with_preemptions(llm, prompts, params, set(batch["preempt_at_steps"]))
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        compiled["batches"].append(compiles[compiled_before:])
        results = []
        for o in outputs:
            r = {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens or 0,
                 "finish_reason": o.outputs[0].finish_reason}
            if want_prompt_logprobs:  # score_last: only the last rows (the teacher-forced positions)
                r["prompt_logprobs"] = logprob_rows(o.prompt_logprobs[1:][-batch.get("score_last", 0):], vocab,
                                                    sparse=top_k is not None)
            if want_logprobs:
                r["logprobs"] = logprob_rows(o.outputs[0].logprobs, vocab, sparse=top_k is not None)
            results.append(r)
        batches.append(results)
        if "speculative_config" in job["engine"]:
            spec_decode.append(spec_decode_counters(llm))
    torch.save({"batches": batches, "preemptions": len(preemptions), "dummy_batches": len(dummy_batches),
                "poisoned_caches": poisoned, "filled_uninitialized_memory": filling, "draft_rows": draft_rows,
                "warm_up_calls": warm_up_calls, "kernel_compiles": compiled,
                "spec_decode": spec_decode[-1] if spec_decode else {}, "spec_decode_batches": spec_decode}, out_path)


if __name__ == "__main__":
    os.environ.update(json.load(open(sys.argv[1])).get("env", {}))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process, for the counter
    main(sys.argv[1], sys.argv[2])
