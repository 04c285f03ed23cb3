"""Every code a doctor finding can carry, in one table: its severity, what it means, why it matters and the fix.
``Report.add`` refuses a code that is not here or comes with another severity. docs/doctor.md's code table is
rendered from this table (:func:`markdown`; ``python -m tools.doctor_rule_table --write`` writes it), and
tests/doctor/test_codes.py checks the docs table and that every code the package emits is listed here."""
from __future__ import annotations

import dataclasses
from typing import Dict


@dataclasses.dataclass(frozen=True)
class Code:
    code: str
    severity: str   # error | warning | info
    meaning: str    # what the finding says happened
    why: str        # what it costs the user
    fix: str        # what to change (the finding's message says it for the case at hand)


_ROWS = (
    # errors: the draft is not served what it was trained on, or the server fails
    Code("E_TARGET_UNSUPPORTED", "error", "the engine has no EAGLE-3 capture for the target's class",
         "the server refuses to start EAGLE-3", "serve with an engine that captures for the class"),
    Code("E_ENGINE_RAISES", "error", "the engine's own code raises when it configures these ids",
         "the server does not start", "write ids the engine accepts"),
    Code("E_DRAFT_CLASS", "error", "the draft's architectures do not resolve to one of the engine's EAGLE-3 heads",
         "the checkpoint is loaded as another model; its fc is never applied", "name the head that loads its layer"),
    Code("E_TIED_DRAFT_VOCAB", "error", "a tied draft with a smaller vocabulary than the target's",
         "its proposals are scored by the target's embedding rows: garbage, acceptance near zero",
         "untie it and load its trained lm_head"),
    Code("E_NO_LM_HEAD", "error", "an untied draft without lm_head.weight",
         "SGLang's head stays uninitialised (vLLM shares the target's over a smaller vocabulary): acceptance near zero",
         "re-export the draft with its trained lm_head"),
    Code("E_LM_HEAD_REPLACED", "error", "draft_vocab_size null over a trained smaller head",
         "SGLang gives the draft the target's head in place of its own", "set draft_vocab_size to the head's rows"),
    Code("E_DRAFT_VOCAB_SIZE_MISSING", "error", "an untied draft config without draft_vocab_size",
         "SGLang's LlamaForCausalLMEagle3 raises AttributeError at start-up", "set draft_vocab_size"),
    Code("E_EMBEDDING_CAPTURE", "error", "a slot gets the token embeddings, or the config lists an embedding "
         "capture the fc has no columns for", "every slot after it is shifted: the draft reads garbage",
         "remove the embedding id"),
    Code("E_CONVENTION_MISMATCH", "error", "every mismatched slot is off by the same one layer",
         "the ids were written in one convention and the engine reads them in the other",
         "write the ids in the engine's convention"),
    Code("E_WIRING_MISMATCH", "error", "a slot gets another boundary than the draft was trained on",
         "acceptance falls (typically ~75% to 20-30%, or ~1%) with no error", "set the ids the finding names"),
    Code("E_LAST_LAYER_NOT_CAPTURED", "error", "an id names the last layer's output, which this engine never captures",
         "a slot stays empty: serving fails or reads garbage", "name a boundary the engine captures"),
    Code("E_ID_OUT_OF_RANGE", "error", "an id names a boundary the model does not have",
         "a slot is never filled", "write ids within the model's layers"),
    Code("E_PP_NOT_CAPTURED", "error", "with pipeline parallelism a boundary lives on a stage that does not capture",
         "a slot is never filled", "a smaller --pp, or a layer partition that keeps the boundaries on the last stage"),
    Code("E_DUPLICATE_CAPTURE", "error", "two slots name the same boundary",
         "the engine captures it once: the draft gets fewer slots than its fc takes", "name each boundary once"),
    Code("E_TP_PARTIAL_SUM", "error", "captures are taken before the tensor-parallel all-reduce",
         "each rank feeds its own partial sum: acceptance drops with no error", "capture after the all-reduce"),
    Code("E_FC_WIDTH", "error", "the fc's input width is not what the engine feeds or sizes it to",
         "loading fails with a shape mismatch, or the draft reads other slots", "make config and fc agree"),
    Code("E_TARGET_HIDDEN", "error", "the draft's target_hidden_size differs from the target's hidden size",
         "the draft was trained for another target", "pair the draft with its own target"),
    Code("E_VOCAB_MAP", "error", "d2t / t2d / lm_head / embedding do not match the target's vocabulary",
         "draft ids map to the wrong target tokens", "rebuild the maps from this target's tokenizer"),
    Code("E_REPLAY_BETTER_WIRING", "error", "(--replay) another wiring predicts the target's next token clearly better",
         "the draft is most likely fed other layers than it was trained on", "set the ids the finding names"),
    Code("E_REPLAY_NO_WIRING_FITS", "error", "(--replay) no wiring predicts clearly better than the draft fed nothing",
         "the wiring is not the problem: the draft is untrained, for another target, or mis-loaded",
         "look where the finding's evidence points"),
    # warnings: what the doctor cannot decide, or a cost that is not a wiring fault
    Code("W_TRAINING_AMBIGUOUS", "warning", "the readings of the config's ids disagree",
         "the doctor cannot tell which one the trainer used", "replay, or the trainer's own ids"),
    Code("W_NO_TRAINING_IDS", "warning", "the draft config records no layer ids",
         "the doctor assumes the default boundaries", "replay to check"),
    Code("W_VLLM_RUNNER", "warning", "vLLM's two model runners read the ids differently for this draft",
         "what it feeds depends on the runner", "write the ids where both read them"),
    Code("W_SLOT_ORDER", "warning", "the engine feeds the slots in another order than the ids are written",
         "if the draft was trained in the ids' order, its slots are permuted", "replay to check"),
    Code("W_IDS_IGNORED", "warning", "the engine does not read the ids where the config writes them",
         "its defaults happen to match today; a retrain can break silently", "write them where it reads them"),
    Code("W_TP_CAPTURE_UNVERIFIED", "warning", "at TP > 1 the doctor could not verify where captures are taken",
         "a capture before the all-reduce would feed partial sums", "--capture-point, or check the hooks"),
    Code("W_PP_UNVERIFIED", "warning", "how TensorRT-LLM forwards captures across pipeline stages is not verified",
         "a stage might not capture", "check every rank captures its boundaries"),
    Code("W_RULE_UNKNOWN", "warning", "the engine's id rule for the class could not be named or applied",
         "no slot verdict is given", "run with the pinned engine installed"),
    Code("W_TARGET_SUPPORT_UNVERIFIED", "warning", "the doctor cannot tell whether the engine serves EAGLE-3 here",
         "the slot table assumes it does", "check the engine's support for the class"),
    Code("W_CAPTURE_UNVERIFIED", "warning", "the engine's capture code for the class was not located",
         "which boundaries it captures is assumed", "check the class's capture code"),
    Code("W_CAPTURE_VALUE", "warning", "the class captures hidden_states without the residual",
         "each slot holds a branch output, not the residual stream", "train on what the engine captures"),
    Code("W_EMBED_SCALE", "warning", "the target scales its embeddings and the draft's embedding is not scaled",
         "the draft's embedding input differs from training", "check how the draft was trained"),
    Code("W_TIED_DRAFT", "warning", "a tied draft whose lm_head treatment in this engine is not verified",
         "the trained head may be dropped", "check the engine loads lm_head.weight"),
    Code("W_CONFIG_ASSUMED", "warning", "neither transformers nor SGLang knows the target's model type",
         "its sizes are read as Llama's, with no defaults or aliases", "check them against the model's config class"),
    Code("W_NORM_BEFORE_RESIDUAL", "warning", "the draft sets norm_before_residual, which SGLang does not apply",
         "the draft runs other math than it was trained with", "serve it with vLLM, or retrain"),
    Code("W_NO_WEIGHTS", "warning", "no weight files: the configs alone were checked",
         "the checks that need the weight headers did not run", "download the weights and check again"),
    Code("W_DRAFT_CONTEXT_SHORT", "warning", "the draft was trained on a shorter context than the target serves",
         "SGLang refuses to start without its override; past that length acceptance falls",
         "serve within the draft's length, or a draft trained on the target's"),
    Code("W_REPLAY_UNDECIDED", "warning", "(--replay) the configured and the best wiring are not clearly apart",
         "the evidence does not separate them", "more prompts, as the finding says"),
    Code("W_REPLAY_FEW_TOKENS", "warning", "(--replay) fewer than 200 positions were scored",
         "differences of a few points are noise", "record more prompts"),
    # info: what was checked and found
    Code("I_CONFIG", "info", "the configs as read, and by which library", "", ""),
    Code("I_ENGINE_CODE", "info", "where the engine's rules came from, and the target's class", "", ""),
    Code("I_ENGINE_DEFAULT", "info", "the engine uses its default boundaries, and why", "", ""),
    Code("I_DRAFT_CLASS", "info", "the draft class was not checked for this engine, and why", "", ""),
    Code("I_TP_CAPTURE_OK", "info", "at TP > 1 captures are taken after the all-reduce, and what shows it", "", ""),
    Code("I_TIED_DRAFT", "info", "what the engine does with a tied draft's lm_head (no fault)", "", ""),
    Code("I_NO_AUX", "info", "the draft reads the target's last hidden state only: no wiring to check", "", ""),
    Code("I_TRAINING_READINGS", "info", "what the draft may have been trained on, reading by reading", "", ""),
    Code("I_WIRING_MATCHES", "info", "every plausible reading gives what the engine feeds", "", ""),
    Code("I_REPLAY_CONFIGURED_BEST", "info", "(--replay) no wiring scores higher than the configured one", "", ""),
    Code("I_REPLAY_BEST", "info", "(--replay) the wiring the draft predicts the target best with", "", ""),
    Code("I_REPLAY_SETTLED", "info", "(--replay) the replay settles what the config could not", "", ""),
    Code("I_REPLAY_SKIPPED", "info", "(--replay) the replay did not run, and why", "", ""),
    Code("I_REPLAY_UNSCORED", "info", "(--replay) wirings the STATES file lacks boundaries for", "", ""),
)

CODES: Dict[str, Code] = {c.code: c for c in _ROWS}
assert len(CODES) == len(_ROWS), "a code listed twice"


def check(severity: str, code: str) -> None:
    """A finding's code must be in the table, with its severity (a programming error otherwise)."""
    row = CODES.get(code)
    if row is None:
        raise ValueError(f"doctor finding code {code!r} is not in eagle3_ops/doctor/codes.py")
    if row.severity != severity:
        raise ValueError(f"doctor finding {code} has severity {row.severity} in eagle3_ops/doctor/codes.py, not "
                         f"{severity}")


def markdown() -> str:
    """docs/doctor.md's code table."""
    lines = ["| code | severity | what it means | why it matters | the fix |", "|---|---|---|---|---|"]
    for c in _ROWS:
        lines.append(f"| `{c.code}` | {c.severity} | {c.meaning} | {c.why or '-'} | {c.fix or '-'} |")
    return "\n".join(lines) + "\n"
