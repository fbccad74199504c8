"""Drafts inside batched steps (a mixin of BatchScheduler, engine/batching/scheduler.py): after every decode row
and prefill chunk of a step is planned, a decoding sequence may run extra rows in the room left -- its grammar's
forced tokens (jump-forward) or a prompt-lookup draft -- and its rows are then sampled as the single-stream
generator samples a verify pass, so the tokens are the same as without drafts."""
from __future__ import annotations

import numpy as np

from ..runtime.speculative import choose_draft

FORCED_DRAFT_MAX = 8   # rows of one forced-token (jump-forward) draft: JSON keys and punctuation rarely run longer
FORCED_STEP_ROWS = 12  # forced drafts are planned only while a step has fewer rows than this (see _plan_drafts)


class Drafts:
    def _plan_drafts(self, plan, budget: int) -> int:
        """Give decoding sequences of the plan a prompt-lookup draft in the rows the budget has left (in plan
        order, as long as the logit rows last); returns the budget left."""
        logit_room = self.model.max_logit_rows - sum(1 for s, r in plan if s.n_past + r == len(s.tokens))
        # forced-token drafts only while the step stays small: each draft row costs an LM-head row, which is
        # nearly free where a step is bound by reading the weights (a few rows) and full price where it is bound
        # by arithmetic (16 sequences on 2 cores: jump-forward measured 0.74x plain constrained decoding there)
        forced_rows = FORCED_STEP_ROWS - sum(r for _, r in plan)
        for e in plan:
            s, r = e
            forcing = s.cm is not None and s.cm.jump_forward and forced_rows > 0
            lookup = s.finder is not None and s.draft_len.ready()
            if r != 1 or s.n_gen == 0 or len(s.tokens) - s.n_past != 1 or not (forcing or lookup):
                continue
            # no draft past the context, past the tokens still wanted (the last one needs no check), the rows
            # of the step, or the pages promised to s
            room = min(max(min(self.forced_max, forced_rows) if forcing else 0, s.draft_len.k if lookup else 0),
                       self.n_ctx - s.n_past - 1, s.max_tokens - s.n_gen - 1, budget, logit_room)
            while room > 0 and self._pages_needed(s, s.n_past, s.n_past + 1 + room) > s.reserve:
                room -= 1
            if room <= 0:
                continue
            draft, s.looked_up = choose_draft(s.cm, min(room, forced_rows) if forcing else 0,
                                              s.finder if lookup else None, s.tokens,
                                              min(room, s.draft_len.k) if lookup else 0)
            if not s.looked_up:
                forced_rows -= len(draft)
            if draft:
                s.draft = draft
                e[1] = 1 + len(draft)
                budget -= len(draft)
                logit_room -= len(draft)
                s.n_drafted += len(draft)
                if s.looked_up:   # the lookup counters are prompt lookup's own; forced tokens run as drafts too
                    self.lookup_drafted_total += len(draft)
                else:
                    self.forced_drafted_total += len(draft)
        return budget

    def _sample_draft(self, s, logits: np.ndarray, li: int) -> int:
        """Sample the rows of s's draft step as engine/runtime/generate.py samples a verify pass: row j holds the
        logits after the draft's first j tokens; keep going while the sampled token equals the draft, stop at the
        first mismatch (or a finish) and roll n_past back to the committed positions. Returns the next logit row."""
        draft, base, j = s.draft, s.n_past, 0
        s.draft = []
        while True:
            s.n_past = base + j + 1     # positions whose K/V are committed: the pending token and draft[:j]
            self._index(s)
            tok = self._sample(s, logits[li + j])
            if s.state == "done" or j == len(draft) or tok != draft[j]:
                break
            j += 1                      # accepted: its logits are already computed
            s.n_accepted += 1
            if s.looked_up:
                self.lookup_accepted_total += 1
            else:
                self.forced_accepted_total += 1
        if s.state != "done" and s.looked_up:
            s.draft_len.update(len(draft), j)
        return li + len(draft) + 1
