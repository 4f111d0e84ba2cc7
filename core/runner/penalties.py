"""Repetition, frequency and presence penalties on the device, for a whole batch at once.

A penalty reads what a request has said so far, so its counts come from the token buffer, which
holds each running request's prompt and confirmed output: nothing is kept between steps, so
preemption, run-ahead and failed steps need no bookkeeping. Counting is a gather of each row's
history and a scatter into [R, V]; it runs only when some row of the step has a penalty (a
host-known flag), so steps without penalties run exactly the kernels they ran before.

Verifying drafts, output position j of a row is sampled after the drafts before it: if it is
reached at all, those drafts were accepted, so its counts include them (`with_drafts`), and each
position sees exactly the counts plain decoding would see there. That keeps speculation lossless.

The rules are vLLM's: the repetition penalty (CTRL's) divides a positive logit and multiplies a
negative one, for every token in the prompt or the output; the frequency and presence penalties
(OpenAI's) subtract penalty * count and penalty * (count > 0) over the output only. They apply to
the raw logits, before temperature, top-k and top-p, and to greedy rows too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenCounts:
    """What the penalties of N rows read: per row, how often each token occurs in the output so
    far, and which tokens occur in the prompt."""

    output: torch.Tensor
    """[N, V] float32 occurrences in the output."""
    prompt: torch.Tensor
    """[N, V] bool: occurs in the prompt."""

    def with_drafts(self, draft_ids: torch.Tensor) -> TokenCounts:
        """R rows -> R * (K+1) rows, r-major: position j of row r counts its output plus drafts
        0..j-1 (a -1 counts nothing), what plain decoding would have counted there had they been
        sampled. draft_ids: [R, K] int64."""
        r, k = draft_ids.shape
        v = self.output.shape[-1]
        added = torch.zeros((r, k + 1, v), dtype=self.output.dtype, device=self.output.device)
        valid = (draft_ids >= 0).to(self.output.dtype)[..., None]
        added[:, 1:].scatter_add_(-1, draft_ids.clamp(min=0)[..., None], valid)
        output = (self.output[:, None, :] + added.cumsum_(1)).view(r * (k + 1), v)
        prompt = self.prompt[:, None, :].expand(r, k + 1, v).reshape(r * (k + 1), v)
        return TokenCounts(output, prompt)


def count_history(tokens: torch.Tensor, slot: torch.Tensor, prompt_len: torch.Tensor, length: torch.Tensor,
                  vocab_size: int) -> TokenCounts:
    """Counts of R rows from the token buffer tokens [S, W]: row r's history is
    tokens[slot[r], :length[r]], its first prompt_len[r] entries the prompt. Fixed shapes (the
    whole buffer width is read and masked), no host sync: graph-capturable."""
    history = tokens[slot]  # [R, W]
    where = torch.arange(history.shape[1], device=tokens.device)[None, :]
    ids = history.clamp(min=0)
    in_prompt = where < prompt_len[:, None]
    in_output = (where < length[:, None]) & ~in_prompt
    r = history.shape[0]
    output = torch.zeros((r, vocab_size), dtype=torch.float32, device=tokens.device)
    output.scatter_add_(-1, ids, in_output.float())
    prompt = torch.zeros((r, vocab_size), dtype=torch.float32, device=tokens.device)
    prompt.scatter_add_(-1, ids, in_prompt.float())
    return TokenCounts(output, prompt > 0)


def apply_penalties(logits: torch.Tensor, counts: TokenCounts, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """[N, V] float32 penalized logits. repetition, frequency, presence: [N] float32 (1, 0, 0 leave
    a row's logits exactly as they were)."""
    logits = logits.float()
    occurs = counts.output > 0
    seen = counts.prompt | occurs
    rp = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    return logits - frequency[:, None] * counts.output - presence[:, None] * occurs.float()
