"""Runs one vLLM engine on a Vision checkpoint in a fresh process and saves what it produced.

Usage: python run_vision.py JOB.json OUT.pt. The job names the checkpoint, the engine arguments and
batches of prompts, each prompt token ids (with the image placeholder's id where an image goes) and
image files; each batch is one ``generate`` call, greedy, with the whole vocabulary's log-probs. Eager
unless the job's engine arguments say ``enforce_eager: false``. With a ``speculative_config``, vLLM's
speculative-decoding counters after the last batch are saved too, and with ``record_drafts``
each DSpark draft step's (prompt, anchor position, drafts) (tests/e2e/dspark_record.py).
"""

import json
import os
import sys

import torch


def main(job_path: str, out_path: str) -> None:
    from PIL import Image
    from vllm import LLM, SamplingParams

    from tests.e2e.run_vllm import logprob_rows, spec_decode_counters

    job = json.load(open(job_path))
    draft_rows = []
    if job.get("record_drafts"):  # the engine runs in this process (see __main__)
        from tests.e2e.dspark_record import record_drafts

        draft_rows = record_drafts()
    speculative = "speculative_config" in job["engine"]
    llm = LLM(model=job["model"], seed=0, max_logprobs=-1, disable_log_stats=not speculative,
              **{"enforce_eager": True, **job["engine"]})
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False,
                            logprobs=-1)
    batches = []
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": p["ids"], "multi_modal_data": {"image": [Image.open(f) for f in p["images"]]}}
                   for p in batch]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        batches.append([{"prompt_token_ids": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
                         "num_cached_tokens": o.num_cached_tokens or 0,
                         "logprobs": logprob_rows(o.outputs[0].logprobs, vocab, sparse=False)} for o in outputs])
    torch.save({"batches": batches, "spec_decode": spec_decode_counters(llm) if speculative else {},
                "draft_rows": draft_rows}, out_path)


if __name__ == "__main__":
    if json.load(open(sys.argv[1])).get("record_drafts"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, for the recorder
    main(sys.argv[1], sys.argv[2])
