"""Runs one vLLM engine with the plugin in a fresh process and saves what it produced.

Usage: python run_vllm.py JOB.json OUT.pt. The job names the checkpoint, the engine arguments and
batches of prompts (token ids); each batch is one ``generate`` call. Every engine gets its own
process because vLLM on CPU spawns workers and keeps process-global state.
"""

import json
import sys

import torch


def dense(logprobs: dict, vocab: int) -> torch.Tensor:
    row = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    for token, lp in logprobs.items():
        row[token] = lp.logprob
    return row


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.load(open(job_path))
    llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, seed=0, max_logprobs=-1, disable_log_stats=False,
              **job["engine"])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    batches = []
    for batch in job["batches"]:
        want_logprobs = batch.get("logprobs", False)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=job["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            logprobs=-1 if want_logprobs else None,
            prompt_logprobs=-1 if want_logprobs else None,
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
        results = []
        for o in llm.generate(prompts, params, use_tqdm=False):
            r = {"tokens": list(o.outputs[0].token_ids)}
            if want_logprobs:
                prompt_rows = [dense(d, vocab) for d in o.prompt_logprobs[1:]]
                r["prompt_logprobs"] = torch.stack(prompt_rows) if prompt_rows else torch.empty(0, vocab).double()
                r["logprobs"] = torch.stack([dense(d, vocab) for d in o.outputs[0].logprobs])
            results.append(r)
        batches.append(results)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if hasattr(m, "value")}
    torch.save({"batches": batches, "metrics": metrics}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
