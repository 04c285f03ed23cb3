"""Every code a doctor finding can carry, in one table: its severity, what it means, why it matters and the fix.

Each row is a module constant, a :class:`Code` (``codes.E_FC_WIDTH``): the code's own string (``"E_FC_WIDTH"``, so
it serialises, prints and compares as that string) that knows its row. Emitters pass the constant, never a string,
and never repeat the severity: ``report.add(codes.E_FC_WIDTH, message, fix=...)`` takes it from the row; readers
compare with the constants (``f.code is codes.E_FC_WIDTH``). :func:`get` turns a code's string (a JSON report's)
back into its constant and refuses one outside the table. docs/doctor.md's code table is rendered from this table
(:func:`markdown`; ``python -m tools.doctor_rule_table --write`` writes it), and tests/doctor/test_codes.py checks
the docs table and that every code the package emits is one of these constants."""
from __future__ import annotations

from typing import Dict, Tuple, Union

SEVERITIES = ("error", "warning", "info")


class Code(str):
    """One row of the table: the code itself (this string) with its severity, what it means, why it matters and the
    fix (the finding's own fix says it for the case at hand). Immutable; one object per code (pickles to it too)."""

    severity: str   # error | warning | info
    meaning: str    # what the finding says happened
    why: str        # what it costs the user
    fix: str        # what to change

    def __new__(cls, code: str, severity: str, meaning: str, why: str, fix: str) -> "Code":
        if severity not in SEVERITIES:
            raise ValueError(f"doctor finding {code}: severity {severity!r} is not one of {SEVERITIES}")
        self = super().__new__(cls, code)
        self.__dict__.update(severity=severity, meaning=meaning, why=why, fix=fix)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"doctor finding code {self.code} is read-only")

    __delattr__ = __setattr__

    @property
    def code(self) -> str:
        """The code as a plain ``str`` (what JSON holds)."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"codes.{self.code}"

    def __reduce__(self):
        return get, (self.code,)


# errors: the draft is not served what it was trained on, or the server fails
E_TARGET_UNSUPPORTED = Code("E_TARGET_UNSUPPORTED", "error",
    "the engine has no EAGLE-3 capture for the target's class", "the server refuses to start EAGLE-3",
    "serve with an engine that captures for the class")
E_ENGINE_RAISES = Code("E_ENGINE_RAISES", "error",
    "the engine's own code raises when it configures these ids", "the server does not start",
    "write ids the engine accepts")
E_DRAFT_CLASS = Code("E_DRAFT_CLASS", "error",
    "the draft's architectures do not resolve to one of the engine's EAGLE-3 heads",
    "the checkpoint is loaded as another model; its fc is never applied", "name the head that loads its layer")
E_TIED_DRAFT_VOCAB = Code("E_TIED_DRAFT_VOCAB", "error",
    "a tied draft with a smaller vocabulary than the target's",
    "its proposals are scored by the target's embedding rows: garbage, acceptance near zero",
    "untie it and load its trained lm_head")
E_NO_LM_HEAD = Code("E_NO_LM_HEAD", "error",
    "an untied draft without lm_head.weight",
    "SGLang's head stays uninitialised (vLLM shares the target's over a smaller vocabulary): acceptance near zero",
    "re-export the draft with its trained lm_head")
E_LM_HEAD_REPLACED = Code("E_LM_HEAD_REPLACED", "error",
    "draft_vocab_size null over a trained smaller head", "SGLang gives the draft the target's head in place of its own",
    "set draft_vocab_size to the head's rows")
E_DRAFT_VOCAB_SIZE_MISSING = Code("E_DRAFT_VOCAB_SIZE_MISSING", "error",
    "an untied draft config without draft_vocab_size",
    "SGLang's LlamaForCausalLMEagle3 raises AttributeError at start-up", "set draft_vocab_size")
E_EMBEDDING_CAPTURE = Code("E_EMBEDDING_CAPTURE", "error",
    "a slot gets the token embeddings, or the config lists an embedding capture the fc has no columns for",
    "every slot after it is shifted: the draft reads garbage", "remove the embedding id")
E_CONVENTION_MISMATCH = Code("E_CONVENTION_MISMATCH", "error",
    "every mismatched slot is off by the same one layer",
    "the ids were written in one convention and the engine reads them in the other",
    "write the ids in the engine's convention")
E_WIRING_MISMATCH = Code("E_WIRING_MISMATCH", "error",
    "a slot gets another boundary than the draft was trained on",
    "acceptance falls (typically ~75% to 20-30%, or ~1%) with no error", "set the ids the finding names")
E_LAST_LAYER_NOT_CAPTURED = Code("E_LAST_LAYER_NOT_CAPTURED", "error",
    "an id names the last layer's output, which this engine never captures",
    "a slot stays empty: serving fails or reads garbage", "name a boundary the engine captures")
E_ID_OUT_OF_RANGE = Code("E_ID_OUT_OF_RANGE", "error",
    "an id names a boundary the model does not have", "a slot is never filled", "write ids within the model's layers")
E_PP_NOT_CAPTURED = Code("E_PP_NOT_CAPTURED", "error",
    "with pipeline parallelism a boundary lives on a stage that does not capture", "a slot is never filled",
    "a smaller --pp, or a layer partition that keeps the boundaries on the last stage")
E_DUPLICATE_CAPTURE = Code("E_DUPLICATE_CAPTURE", "error",
    "two slots name the same boundary", "the engine captures it once: the draft gets fewer slots than its fc takes",
    "name each boundary once")
E_TP_PARTIAL_SUM = Code("E_TP_PARTIAL_SUM", "error",
    "captures are taken before the tensor-parallel all-reduce",
    "each rank feeds its own partial sum: acceptance drops with no error", "capture after the all-reduce")
E_FC_WIDTH = Code("E_FC_WIDTH", "error",
    "the fc's input width is not what the engine feeds or sizes it to",
    "loading fails with a shape mismatch, or the draft reads other slots", "make config and fc agree")
E_TARGET_HIDDEN = Code("E_TARGET_HIDDEN", "error",
    "the draft's target_hidden_size differs from the target's hidden size", "the draft was trained for another target",
    "pair the draft with its own target")
E_VOCAB_MAP = Code("E_VOCAB_MAP", "error",
    "d2t / t2d / lm_head / embedding do not match the target's vocabulary", "draft ids map to the wrong target tokens",
    "rebuild the maps from this target's tokenizer")
E_REPLAY_BETTER_WIRING = Code("E_REPLAY_BETTER_WIRING", "error",
    "(--replay) another wiring predicts the target's next token clearly better",
    "the draft is most likely fed other layers than it was trained on", "set the ids the finding names")
E_REPLAY_NO_WIRING_FITS = Code("E_REPLAY_NO_WIRING_FITS", "error",
    "(--replay) no wiring predicts clearly better than the draft fed nothing",
    "the wiring is not the problem: the draft is untrained, for another target, or mis-loaded",
    "look where the finding's evidence points")
# warnings: what the doctor cannot decide, or a cost that is not a wiring fault
W_TRAINING_AMBIGUOUS = Code("W_TRAINING_AMBIGUOUS", "warning",
    "the readings of the config's ids disagree", "the doctor cannot tell which one the trainer used",
    "replay, or the trainer's own ids")
W_NO_TRAINING_IDS = Code("W_NO_TRAINING_IDS", "warning",
    "the draft config records no layer ids", "the doctor assumes the default boundaries", "replay to check")
W_VLLM_RUNNER = Code("W_VLLM_RUNNER", "warning",
    "vLLM's two model runners read the ids differently for this draft", "what it feeds depends on the runner",
    "write the ids where both read them")
W_SLOT_ORDER = Code("W_SLOT_ORDER", "warning",
    "the engine feeds the slots in another order than the ids are written",
    "if the draft was trained in the ids' order, its slots are permuted", "replay to check")
W_IDS_IGNORED = Code("W_IDS_IGNORED", "warning",
    "the engine does not read the ids where the config writes them",
    "its defaults happen to match today; a retrain can break silently", "write them where it reads them")
W_TP_CAPTURE_UNVERIFIED = Code("W_TP_CAPTURE_UNVERIFIED", "warning",
    "at TP > 1 the doctor could not verify where captures are taken",
    "a capture before the all-reduce would feed partial sums", "--capture-point, or check the hooks")
W_PP_UNVERIFIED = Code("W_PP_UNVERIFIED", "warning",
    "how TensorRT-LLM forwards captures across pipeline stages is not verified", "a stage might not capture",
    "check every rank captures its boundaries")
W_RULE_UNKNOWN = Code("W_RULE_UNKNOWN", "warning",
    "the engine's id rule for the class could not be named or applied", "no slot verdict is given",
    "run with the pinned engine installed")
W_TARGET_SUPPORT_UNVERIFIED = Code("W_TARGET_SUPPORT_UNVERIFIED", "warning",
    "the doctor cannot tell whether the engine serves EAGLE-3 here", "the slot table assumes it does",
    "check the engine's support for the class")
W_CAPTURE_UNVERIFIED = Code("W_CAPTURE_UNVERIFIED", "warning",
    "the engine's capture code for the class was not located", "which boundaries it captures is assumed",
    "check the class's capture code")
W_CAPTURE_VALUE = Code("W_CAPTURE_VALUE", "warning",
    "the class captures hidden_states without the residual", "each slot holds a branch output, not the residual stream",
    "train on what the engine captures")
W_EMBED_SCALE = Code("W_EMBED_SCALE", "warning",
    "the target scales its embeddings and the draft's embedding is not scaled",
    "the draft's embedding input differs from training", "check how the draft was trained")
W_TIED_DRAFT = Code("W_TIED_DRAFT", "warning",
    "a tied draft whose lm_head treatment in this engine is not verified", "the trained head may be dropped",
    "check the engine loads lm_head.weight")
W_CONFIG_ASSUMED = Code("W_CONFIG_ASSUMED", "warning",
    "neither transformers nor SGLang knows the target's model type",
    "its sizes are read as Llama's, with no defaults or aliases", "check them against the model's config class")
W_NORM_BEFORE_RESIDUAL = Code("W_NORM_BEFORE_RESIDUAL", "warning",
    "the draft sets norm_before_residual, which SGLang does not apply",
    "the draft runs other math than it was trained with", "serve it with vLLM, or retrain")
W_NO_WEIGHTS = Code("W_NO_WEIGHTS", "warning",
    "no weight files: the configs alone were checked", "the checks that need the weight headers did not run",
    "download the weights and check again")
W_DRAFT_CONTEXT_SHORT = Code("W_DRAFT_CONTEXT_SHORT", "warning",
    "the draft was trained on a shorter context than the target serves",
    "SGLang refuses to start without its override; past that length acceptance falls",
    "serve within the draft's length, or a draft trained on the target's")
W_REPLAY_UNDECIDED = Code("W_REPLAY_UNDECIDED", "warning",
    "(--replay) the configured and the best wiring are not clearly apart", "the evidence does not separate them",
    "more prompts, as the finding says")
W_REPLAY_FEW_TOKENS = Code("W_REPLAY_FEW_TOKENS", "warning",
    "(--replay) fewer than 200 positions were scored", "differences of a few points are noise", "record more prompts")
# info: what was checked and found
I_CONFIG = Code("I_CONFIG", "info",
    "the configs as read, and by which library", "", "")
I_ENGINE_CODE = Code("I_ENGINE_CODE", "info",
    "where the engine's rules came from, and the target's class", "", "")
I_ENGINE_DEFAULT = Code("I_ENGINE_DEFAULT", "info",
    "the engine uses its default boundaries, and why", "", "")
I_DRAFT_CLASS = Code("I_DRAFT_CLASS", "info",
    "the draft class was not checked for this engine, and why", "", "")
I_TP_CAPTURE_OK = Code("I_TP_CAPTURE_OK", "info",
    "at TP > 1 captures are taken after the all-reduce, and what shows it", "", "")
I_TIED_DRAFT = Code("I_TIED_DRAFT", "info",
    "what the engine does with a tied draft's lm_head (no fault)", "", "")
I_NO_AUX = Code("I_NO_AUX", "info",
    "the draft reads the target's last hidden state only: no wiring to check", "", "")
I_TRAINING_READINGS = Code("I_TRAINING_READINGS", "info",
    "what the draft may have been trained on, reading by reading", "", "")
I_WIRING_MATCHES = Code("I_WIRING_MATCHES", "info",
    "every plausible reading gives what the engine feeds", "", "")
I_REPLAY_CONFIGURED_BEST = Code("I_REPLAY_CONFIGURED_BEST", "info",
    "(--replay) no wiring scores higher than the configured one", "", "")
I_REPLAY_BEST = Code("I_REPLAY_BEST", "info",
    "(--replay) the wiring the draft predicts the target best with", "", "")
I_REPLAY_SETTLED = Code("I_REPLAY_SETTLED", "info",
    "(--replay) the replay settles what the config could not", "", "")
I_REPLAY_SKIPPED = Code("I_REPLAY_SKIPPED", "info",
    "(--replay) the replay did not run, and why", "", "")
I_REPLAY_UNSCORED = Code("I_REPLAY_UNSCORED", "info",
    "(--replay) wirings the STATES file lacks boundaries for", "", "")


_ROWS: Tuple[Code, ...] = tuple(v for v in globals().values() if isinstance(v, Code))  # in the order written
CODES: Dict[str, Code] = {c.code: c for c in _ROWS}
assert all(globals()[c.code] is c for c in _ROWS), "a code constant named other than its code, or listed twice"


def get(code: Union[str, Code]) -> Code:
    """The table's constant for ``code`` (its string, or the constant itself); ValueError for a code outside it."""
    row = CODES.get(str.__str__(code)) if isinstance(code, str) else None
    if row is None:
        raise ValueError(f"doctor finding code {code!r} is not in eagle3_ops/doctor/codes.py")
    return row


def check(severity: str, code: Union[str, Code]) -> Code:
    """A finding's code must be in the table, with its severity (a programming error otherwise); returns the row."""
    row = get(code)
    if row.severity != severity:
        raise ValueError(f"doctor finding {row.code} has severity {row.severity} in eagle3_ops/doctor/codes.py, not "
                         f"{severity}")
    return row


def markdown() -> str:
    """docs/doctor.md's code table."""
    lines = ["| code | severity | what it means | why it matters | the fix |", "|---|---|---|---|---|"]
    for c in _ROWS:
        lines.append(f"| `{c.code}` | {c.severity} | {c.meaning} | {c.why or '-'} | {c.fix or '-'} |")
    return "\n".join(lines) + "\n"
