"""Forced drafts, for tests/e2e/test_forced_drafts.py: a vLLM worker extension (``worker_extension_cls``)
whose ``force_drafts`` makes the drafter (DSpark's or MTP's) propose a known continuation of each request,
every token right or the one at ``wrong_at`` wrong. Test code: vLLM imports it in each worker by its
qualified name, and the import wraps the proposers of that process; nothing a request can reach.
"""

from __future__ import annotations

import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_dsv4.spec_decode.dspark import DSparkProposer

FORCED: dict = {"runner": None, "sequences": (), "wrong_at": None}


class ForcedDrafts:
    def force_drafts(self, sequences: list[list[int]], wrong_at: int | None = None) -> bool:
        """From the next step on, a request whose prompt begins one of ``sequences`` drafts that sequence's
        tokens after its anchor; the draft at ``wrong_at`` (if given) is the right one with its lowest bit
        flipped."""
        FORCED.update(runner=self.model_runner, sequences=[list(s) for s in sequences], wrong_at=wrong_at)
        return True


def forced(propose):
    def propose_forced(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                       next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs):
        cm, rejected = common_attn_metadata, kwargs.get("num_rejected_tokens_gpu")
        # P: the anchor's position, one past the last kept token (read before MTP's propose edits cm)
        anchors = cm.seq_lens[: cm.num_reqs].long() - (0 if rejected is None else rejected[: cm.num_reqs].long())
        anchors = anchors.tolist()
        drafts = propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                         next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs)
        runner = FORCED["runner"]
        if runner is None:
            return drafts
        for r, P in enumerate(anchors):
            prompt = runner.requests[runner.input_batch.req_ids[r]].prompt_token_ids
            seq = next((s for s in FORCED["sequences"] if s[: len(prompt)] == list(prompt)), None)
            if seq is None or P + num_speculative_tokens >= len(seq):
                continue
            want = seq[P + 1 : P + 1 + num_speculative_tokens]
            if FORCED["wrong_at"] is not None:
                want[FORCED["wrong_at"]] ^= 1
            drafts[r] = torch.tensor(want, dtype=drafts.dtype, device=drafts.device)
        return drafts

    return propose_forced


EagleProposer.propose = forced(EagleProposer.propose)
DSparkProposer.propose = forced(DSparkProposer.propose)
