"""Records what the plugin's DSpark drafter computes inside vLLM, per draft step and request, for
tests/e2e/test_dspark.py to compare with tests/oracle/dspark_ref.py. Runs in the engine's process (one
worker, run_vllm.py's ``record_dspark``), by wrapping the proposer's ``propose`` and reading the draft
model's modules and caches; nothing of this is in the plugin."""

from __future__ import annotations

import torch


def record_dspark() -> list:
    """Installs the recorder; returns the list it fills with one dict per (draft step, request): its
    prompt, the anchor and its position P, the kept target tokens' positions with their features and
    main_x rows, each stage's context KV as stored at positions P - W .. P - 1, each stage's output
    streams, the head hidden, base and Markov-corrected logits, the drafts and the confidences."""
    from vllm_dsv4.spec_decode.dspark import DSparkProposer

    rows, propose = [], DSparkProposer.propose

    def recorded(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                 next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs):
        model, got = self.model, {"stages": [], "bias": [], "embed": []}
        hooks = [stage.register_forward_hook(lambda m, a, out: got["stages"].append(out.detach().clone()))
                 for stage in model.mtp]
        hooks.append(model.register_forward_hook(lambda m, a, out: got.update(h=out.detach().clone())))
        model.combine = _tap(model.combine, lambda out: got.update(main_x=out.detach().clone()))
        model.compute_logits = _tap(model.compute_logits, lambda out: got.update(base=out.detach().clone()))
        model.markov_bias = _tap(model.markov_bias, lambda out: got["bias"].append(out.detach().clone()))
        model.markov_embed = _tap(model.markov_embed, lambda out: got["embed"].append(out.detach().clone()))
        cm = common_attn_metadata
        R, T = cm.num_reqs, cm.num_actual_tokens
        kept_req, anchor_pos = self._step_layout(cm.query_start_loc[: R + 1].long(), kwargs.get("num_rejected_tokens_gpu"),
                                                 target_positions[:T], T)
        try:
            drafts = propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                             next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                             *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
            for name in ("combine", "compute_logits", "markov_bias", "markov_embed"):
                delattr(model, name)
        N, window = self.block, model.cfg.sliding_window
        h = got["h"][: R * N].view(R, N, -1)  # (a padded block step has more rows: see pad_draft_batches)
        bias, embed = torch.stack(got["bias"], 1)[:R], torch.stack(got["embed"], 1)[:R]  # [R, N, V], [R, N, r]
        for r in range(R):
            req_id = self.runner.input_batch.req_ids[r]
            P = int(anchor_pos[r])
            mine = (kept_req == r).nonzero()[:, 0]
            context = []
            for stage, gid in zip(model.mtp, self.stage_groups):
                table = self.runner.input_batch.block_table[gid].get_device_tensor(R)[r]
                cache, E = stage.attn.swa_cache.view, stage.attn.swa_cache.component.entries_per_block
                pos = torch.arange(max(P - window, 0), P)
                context.append(cache[table[pos // E].long(), pos % E].clone())
            rows.append({
                "prompt": list(self.runner.requests[req_id].prompt_token_ids), "P": P, "anchor": int(next_token_ids[r]),
                "positions": target_positions[mine].tolist(), "features": target_hidden_states[mine].clone(),
                "main_x": got["main_x"][mine], "context_kv": context,
                "stages": [s[: R * N].view(R, N, *s.shape[1:])[r] for s in got["stages"]], "head_hidden": h[r],
                "base_logits": got["base"][:R][r], "logits": got["base"][:R][r] + bias[r],
                "drafts": drafts[r].tolist(), "confidence": model.confidence(h[r], embed[r]),
            })
        return drafts

    DSparkProposer.propose = recorded
    return rows


def _tap(method, record):
    """``method`` that also hands each result to ``record``."""
    def tapped(*args, **kwargs):
        out = method(*args, **kwargs)
        record(out)
        return out
    return tapped


def record_drafts() -> list:
    """Installs a recorder of what ``propose`` returns (also when a CUDA graph replays the block step):
    one (prompt, anchor position P, drafts) per draft step and request."""
    from vllm_dsv4.spec_decode.dspark import DSparkProposer

    rows, propose = [], DSparkProposer.propose

    def recorded(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                 next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs):
        cm = common_attn_metadata
        _, anchor_pos = self._step_layout(cm.query_start_loc[: cm.num_reqs + 1].long(),
                                          kwargs.get("num_rejected_tokens_gpu"), target_positions[: cm.num_actual_tokens],
                                          cm.num_actual_tokens)
        drafts = propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                         next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs)
        for r, (P, row) in enumerate(zip(anchor_pos.tolist(), drafts.tolist())):
            prompt = self.runner.requests[self.runner.input_batch.req_ids[r]].prompt_token_ids
            rows.append((tuple(prompt), P, row))
        return drafts

    DSparkProposer.propose = recorded
    return rows


def pad_draft_batches() -> None:
    """Every block step padded to the batch limit, as a CUDA graph's is (padding rows: request -1), so the
    CPU runs the rows a GPU replays."""
    from vllm_dsv4.spec_decode.dspark import DSparkProposer

    DSparkProposer._graph_rows = lambda self, R: self.block_inputs.drafts.shape[0]
