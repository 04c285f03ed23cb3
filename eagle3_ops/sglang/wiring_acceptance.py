"""Observed against predicted: SGLang's first-draft-token acceptance, counted from its own verify bookkeeping
(:func:`correct_drafts`, on :data:`ACCEPTANCE_TARGET`), compared once with the replay's top-1 agreement of the
served wiring after :data:`ACCEPTANCE_STEPS` verified request steps: one line, and the numbers added to the JSON
result. A large gap with the wiring right points at something else (tokenizer, vocabulary map, embedding scale)."""
from __future__ import annotations

import logging
from typing import Optional

from .wiring_result import LABEL, write_result

log = logging.getLogger("eagle3_ops.sglang")

ACCEPTANCE_STEPS = 1000    # verified (request, step) pairs before the observed-vs-predicted line
GAP_POINTS = 15.0          # observed vs predicted first-token acceptance: a gap worth a line of its own

ACCEPTANCE_TARGET = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                     "SchedulerBatchResultProcessor._resolve_spec_v2_tokens")


def correct_drafts(args, kwargs) -> Optional[list]:
    """From the arguments of SGLang's ``_resolve_spec_v2_tokens(self, result, batch)``, after it ran: the number of
    draft tokens accepted per request of that verify step (``num_correct_drafts_per_req_cpu``, host ints SGLang
    already made), or None."""
    batch_result = kwargs.get("result", args[1] if len(args) > 1 else None)
    return getattr(batch_result, "num_correct_drafts_per_req_cpu", None)


class AcceptanceCount:
    """The counting part of a live check (wiring_check.WiringCheck inherits it). It reads and sets the check's
    ``talks`` (TP rank 0: the others count nothing), ``model_name``, ``lock``, ``predicted`` (the replay's top-1
    agreement of the served wiring, once scored), ``verdict`` (the JSON result), ``steps``, ``first_accepted`` and
    ``acceptance_logged`` (set where there is nothing to compare with: counting stops)."""

    def count(self, correct_per_request) -> None:
        """Count verified (request, step) pairs and how many accepted the first draft token (``correct_per_request``:
        accepted draft tokens per request, from SGLang's verify result); log the comparison once enough are in."""
        if self.acceptance_logged or not self.talks:
            return
        for c in correct_per_request:
            self.steps += 1
            self.first_accepted += int(c) >= 1
        self.maybe_log_acceptance()

    def maybe_log_acceptance(self) -> None:
        """Once the replay's prediction and :data:`ACCEPTANCE_STEPS` verified steps are both in: one line comparing the
        observed first-token acceptance with the predicted one (and what a gap points at), written to the JSON."""
        with self.lock:  # the forward's thread (counting) and the scoring thread both get here
            if self.acceptance_logged or self.predicted is None or self.steps < ACCEPTANCE_STEPS:
                return
            self.acceptance_logged = True
        observed = self.first_accepted / self.steps
        gap = 100 * (self.predicted - observed)
        wiring_ok = self.verdict is not None and self.verdict.get("verdict") == "OK"
        if abs(gap) < GAP_POINTS:
            tail = "they agree"
        elif wiring_ok:
            tail = ("a large gap with the wiring right points at something else: the tokenizer or chat template the "
                    "draft was trained with, its vocabulary map (d2t), an embedding scale the draft does not apply, "
                    "or a sampling setting")
        else:
            tail = "the wiring warning above is the likely cause"
        log.info("eagle3_ops: %s: %s: SGLang accepted the first draft token in %.1f%% of %d verify steps; the replay "
                 "predicted %.1f%% (top-1 agreement of the served wiring): %s", LABEL, self.model_name,
                 100 * observed, self.steps, 100 * self.predicted, tail)
        if self.verdict is not None:
            self.verdict["observed_first_token_acceptance"] = observed
            self.verdict["acceptance_steps"] = self.steps
            write_result(self.verdict, self.model_name)
