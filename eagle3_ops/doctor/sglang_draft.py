"""The replay's draft, run by SGLang's own code: the draft's EAGLE-3 head class (``LlamaForCausalLMEagle3``,
the MLA head ``Eagle3DeepseekV2ForCausalLM``, or any head a later SGLang registers), built on the CPU and
run through SGLang's own forward, so a draft is scored by the code that serves it.

How it runs (:mod:`.sglang_cpu`: gloo groups of world size 1,
SGLang's ``TorchNativeAttnBackend`` over its own KV pools):

- the class: the draft's ``architectures`` resolved as SGLang resolves them (its ``ModelRegistry``; with
  the pinned SGLang installed, the pinned table's name for it, which a test holds equal to the registry);
- the weights: the checkpoint's tensors by their own names through the class's ``load_weights`` (every
  parameter is poisoned with NaN first, so a tensor the class did not load is named, never used);
- the embedding: where SGLang's ``set_embed`` replaces the draft's embedding with the target's (asked of
  the class itself), the recorded boundary 0 (the target's embedding output) is passed as
  ``input_embeds``; otherwise the class is built with only the rows of the recorded tokens (the
  vocabulary can be gigabytes) and the token ids are mapped to them;
- the step: one forward in ``DRAFT_EXTEND_V2`` mode with no selected rows, so SGLang's own
  ``LogitsProcessor`` returns the logits of every position (SGLang's draft extend after a prefill runs
  the same layers over the same positions), mapped to target ids through the class's ``hot_token_id``
  (``d2t``), as SGLang's EAGLE worker does.

A head SGLang serves with the target's lm_head (``load_lm_head_from_target``: its config has no
``draft_vocab_size``) cannot be scored from a STATES file, which holds no lm_head; that is said, not guessed.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
from typing import Dict, Optional, Tuple

import torch

from .configs import DoctorInputError, TensorInfo, load_rows, load_tensors


def head_class(draft) -> Tuple[Optional[type], str]:
    """(SGLang's EAGLE-3 head class for this draft or None, in words where it came from or why not)."""
    from . import sglang_code, tables

    archs = [a for a in draft.architectures if isinstance(a, str)]
    if sglang_code.installed_version() == tables.PINNED["sglang"]:
        heads = (tables.load("sglang") or {}).get("draft_heads", {})
        arch = next((a for a in archs if a in heads), None)
        if arch is None:
            return None, (f"the draft's architectures {archs} name none of SGLang {tables.PINNED['sglang']}'s EAGLE-3 "
                          f"heads ({', '.join(sorted(heads))})")
        module, name = heads[arch]["class"].rsplit(".", 1)
        with sglang_code.quiet_sglang():
            cls = getattr(importlib.import_module(module), name)
        return cls, f"SGLang {tables.PINNED['sglang']}'s own {name} ({module})"
    cls, arch, how = sglang_code.resolve_architecture(archs)
    if cls is None or sglang_code.draft_head(cls) is None:
        return None, (f"SGLang {sglang_code.installed_version()} resolves the draft's architectures {archs} to "
                      f"{arch or 'no class'}, which is not one of its EAGLE-3 heads")
    return cls, f"SGLang {sglang_code.installed_version()}'s own {cls.__name__} ({cls.__module__}; {how})"


@contextlib.contextmanager
def _no_device_sync():
    """SGLang's ``set_embed`` ends with an empty-cache and a synchronize of the device; here there is none."""
    saved = torch.cuda.empty_cache, torch.cuda.synchronize
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.empty_cache, torch.cuda.synchronize = saved


def _replaces_embedding(cls, config) -> bool:
    """Whether SGLang's EAGLE worker would give this draft the target's embedding: its ``set_embed`` (asked
    of a bare instance holding only a stand-in embedding) replaces the draft's own."""
    probe = object.__new__(cls)
    torch.nn.Module.__init__(probe)
    probe.config = config
    probe.model = torch.nn.Module()
    probe.model.embed_tokens = torch.nn.Module()
    own = torch.nn.Parameter(torch.zeros(1))
    probe.model.embed_tokens.weight = own
    if getattr(cls, "set_embed", None) is None:
        return False
    with _no_device_sync():
        cls.set_embed(probe, torch.nn.Parameter(torch.ones(1)))
    return probe.model.embed_tokens.weight is not own


class SGLangDraftRunner:
    """The draft's first step through SGLang's own head class, on the CPU, in ``dtype`` (float32, or bfloat16
    for a 16-bit draft on a CPU that computes it faster: :func:`.replay.compute_dtype`)."""

    def __init__(self, draft, weights: Dict[str, TensorInfo], token_ids: Optional[torch.Tensor],
                 max_positions: int = 0, dtype: torch.dtype = torch.float32):
        """``token_ids``: the tokens the replay embeds; ``max_positions``: its longest sequence (SGLang raises a
        draft's ``max_position_embeddings`` to the target's context length, model_config.py; so does this)."""
        cls, source = head_class(draft)
        if cls is None:
            raise DoctorInputError(f"replay: {source}")
        from . import sglang_cpu as harness
        from .configs import sglang_parse
        from .sglang_code import quiet_sglang

        self.source = source
        self.dtype = dtype
        with quiet_sglang():
            harness.init_distributed()
            config, _ = sglang_parse(dict(draft.config), draft.path)
        self.uses_target_embeddings = _replaces_embedding(cls, config)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        config = copy.deepcopy(config)
        if isinstance(getattr(config, "max_position_embeddings", None), int):
            config.max_position_embeddings = max(config.max_position_embeddings, int(max_positions))
        self.token_rows: Optional[torch.Tensor] = None
        rows = None
        emb = weights.get("embed_tokens.weight")
        if not tied and (self.uses_target_embeddings or (emb is not None and token_ids is not None)):
            # only the rows the replay embeds (none when the target's embedding serves): the class's embedding
            # table is built that small, and token ids are mapped to its rows
            rows = torch.zeros(0, dtype=torch.long) if self.uses_target_embeddings else \
                torch.unique(token_ids.long().reshape(-1))
            config.vocab_size = max(int(rows.numel()), 1)
        try:
            with quiet_sglang():
                self.model = harness.construct(cls, config, dtype)
        except Exception as e:  # noqa: BLE001 - SGLang refuses this draft's config: its words, said as such
            raise DoctorInputError(f"replay: {source} cannot build this draft from its config.json "
                                   f"({type(e).__name__}: {e}); SGLang would refuse it the same way") from None
        if getattr(self.model, "load_lm_head_from_target", False):
            raise DoctorInputError(
                f"replay: SGLang serves this draft with the target's lm_head ({cls.__name__}.load_lm_head_from_target: "
                f"its config has no draft_vocab_size), which a STATES file does not hold; the replay cannot score it")
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or config.hidden_size)
        self._load(weights, rows, tied)
        if tied and self.uses_target_embeddings:
            self.source += (" (its lm_head is tied to its embedding, which SGLang replaces with the target's: the "
                            "checkpoint's embed_tokens.weight stands in for the target's)")
        self.model.eval()
        self.harness = harness

    def _load(self, weights: Dict[str, TensorInfo], rows: Optional[torch.Tensor], tied: bool) -> None:
        from .sglang_code import quiet_sglang

        embed_param = "model.embed_tokens.weight"
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for p in params.values():
                p.fill_(float("nan"))  # a parameter the class does not load stays NaN and is named below
        names = [n for n in weights if not (rows is not None and n == "embed_tokens.weight")]
        tensors = load_tensors(weights, names)
        try:
            with quiet_sglang():
                self.model.load_weights([(weights[n].raw_name, t) for n, t in tensors.items()])
        except Exception as e:  # noqa: BLE001 - a tensor the class cannot take (shape): SGLang would refuse it too
            raise DoctorInputError(f"replay: {type(self.model).__name__}.load_weights cannot load the checkpoint in "
                                   f"{next(iter(weights.values())).file.rsplit('/', 1)[0] if weights else '?'} "
                                   f"({type(e).__name__}: {e}); SGLang would refuse it the same way") from None
        if rows is not None and rows.numel():
            with torch.no_grad():  # SGLang pads its vocabulary (VocabParallelEmbedding): rows past ours are never read
                table = params[embed_param]
                table.zero_()
                table[:rows.numel()].copy_(load_rows(weights["embed_tokens.weight"], rows).to(table.dtype))
            index = torch.full((int(rows.max()) + 1,), -1, dtype=torch.long)
            index[rows] = torch.arange(rows.numel())
            self.token_rows = index
        skip = {embed_param} if self.uses_target_embeddings and not tied else set()
        missing = [n for n, p in self.model.named_parameters() if n not in skip and bool(torch.isnan(p).any())]
        if missing:
            raise DoctorInputError(f"replay: {type(self.model).__name__}.load_weights left parameters unset (the "
                                   f"checkpoint has no tensor for them, or NaN values): {', '.join(missing)}")
        hot = getattr(self.model, "hot_token_id", None)
        if hot is not None and hot.numel() != getattr(self.config, "draft_vocab_size", hot.numel()):
            raise DoctorInputError(f"replay: the draft's d2t has {hot.numel()} entries but it predicts "
                                   f"{self.config.draft_vocab_size} draft tokens (draft_vocab_size): the map from its "
                                   f"tokens to the target's does not fit")

    def predict(self, aux: torch.Tensor, ids: torch.Tensor, embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """Target token ids the draft's first step predicts at every position: ``aux`` [B, n, K*H_t] (the
        captures at position t), ``ids`` [B, n] (token t+1), ``embeds`` [B, n, H] (its target embedding,
        where SGLang gives the draft the target's) -> [B, n]."""
        return self._to_target(self.logits(aux, ids, embeds).argmax(-1))

    def draft_targets(self) -> torch.Tensor:
        """The target id of each draft token (the class's ``hot_token_id``, d2t; the identity without one)."""
        hot = getattr(self.model, "hot_token_id", None)
        if hot is not None:
            return hot.long().cpu()
        return torch.arange(int(getattr(self.config, "draft_vocab_size", None) or self.config.vocab_size))

    def fc_parts(self):
        """The class's own fc and pre-fc norms (``model.fc``, ``model.fc_norm``, ``model.input_norm``), for the
        wiring search's per-slot projections (doctor.search)."""
        from .search import FcParts

        inner = self.model.model
        fc = inner.fc
        bias = getattr(fc, "bias", None)
        norms = getattr(inner, "fc_norm", None)
        slots = int(getattr(inner, "num_aux_hidden_states", 0) or fc.weight.shape[1] // self.target_hidden_size)
        return FcParts(weight=fc.weight.detach(), bias=None if bias is None else bias.detach(),
                       slot_norms=list(norms) if norms is not None else None,
                       input_norm=getattr(inner, "input_norm", None), num_slots=slots)

    @torch.no_grad()
    def logits(self, aux: torch.Tensor, ids: torch.Tensor, embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """The draft's logits over its own vocabulary at every position (arguments as :meth:`predict`; ``aux``
        as wide as the draft's hidden size is taken as the fc output: the class's own forward then skips its
        fc) -> [B, n, draft vocabulary]."""
        B, n = ids.shape
        kv = self.harness.KVCache(self.config, self.dtype, size=B * n + 2, max_reqs=B + 1, max_context=n + 2)
        out, _ = self._extend(kv, aux, ids, embeds, "NULL")
        return out.next_token_logits.view(B, n, -1)

    def _extend(self, kv, aux: torch.Tensor, ids: torch.Tensor, embeds: Optional[torch.Tensor], capture: str):
        """SGLang's draft extend (``DRAFT_EXTEND_V2``, every position's logits) of the B prompts ``ids`` [B, n] on the
        captures ``aux`` [B, n, K*H_t], one new request each: (its LogitsProcessorOutput, the requests)."""
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

        h = self.harness
        B, n = ids.shape
        reqs = [h.Req(kv.new_req()) for _ in range(B)]
        spec = EagleDraftExtendInput(hidden_states=aux.reshape(B * n, -1).to(self.dtype).contiguous(),
                                     num_tokens_per_req=n, num_tokens_for_logprob_per_req=n)
        spec.select_index = None  # every position's logits (LogitsProcessor, draft-extend-v2 path)
        fb = h.extend_batch(kv, reqs, self._rows(ids).tolist(), mode="DRAFT_EXTEND_V2", capture=capture,
                            spec_info=spec)
        return h.run(self.model, fb, kv, self._embeds(embeds.reshape(B * n, -1) if embeds is not None else None)), \
            reqs

    @torch.no_grad()
    def chain(self, aux: torch.Tensor, ids: torch.Tensor, embeds: Optional[torch.Tensor], steps: int):
        """The draft's predictions (target ids) at draft steps 1..``steps`` for every position of one prompt, fed
        as SGLang's EAGLE worker feeds it: step 1 is the draft extend over the target's captures (as
        :meth:`logits`); step k > 1 at position j is one DECODE forward on the draft's own hidden state of step
        k - 1 (``spec_info.hidden_states``: what the head returns as its aux hidden state) and the token step k - 1
        should have accepted, ``ids[j + k - 1]`` (its embedding: ``embeds[j + k - 1]`` where the target's serves),
        at position j + k - 1, attending to the draft's own KV of positions 0..j and of its steps since. All
        positions' chains run as one batch: each request's first j + 1 KV slots are the extend's (SGLang's
        req_to_token table points at them), its later slots its own. ``aux`` [1, n, K*H_t], ``ids`` [1, n],
        ``embeds`` [1, n, H] or None -> a list of ``steps`` tensors, step k's of length n - k + 1."""
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        h = self.harness
        n = ids.shape[1]
        tokens = self._rows(ids[0])
        kv = h.KVCache(self.config, self.dtype, size=n * (steps + 1) + 2, max_reqs=n + 2, max_context=n + steps + 2)
        out, (ext,) = self._extend(kv, aux, ids, embeds, "FULL")
        preds, hidden = [self._to_target(out.next_token_logits.argmax(-1))], out.hidden_states
        locs = kv.req_to_token_pool.req_to_token[ext.pool_index, :n].long()
        reqs = []
        for j in range(n):
            r = h.Req(kv.new_req())
            h.fill_req_to_token(kv, r, 0, locs[:j + 1])
            r.tokens = tokens[:j + 1].tolist()
            reqs.append(r)
        for k in range(2, steps + 1):
            m = n - k + 1  # positions j whose step-k input token ids[j + k - 1] exists
            if m <= 0:
                break
            reqs, hidden = reqs[:m], hidden[:m]
            nxt = tokens[k - 1:k - 1 + m]
            fb = h.decode_batch(kv, reqs, nxt.tolist(), capture="LAST",
                                spec_info=EagleDraftInput(hidden_states=hidden.contiguous()))
            out = h.run(self.model, fb, kv, self._embeds(embeds[0, k - 1:k - 1 + m] if embeds is not None else None))
            preds.append(self._to_target(out.next_token_logits.argmax(-1)))
            hidden = out.hidden_states
        return preds

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input ids the class embeds: rows of its reduced embedding table where it holds only the recorded
        tokens' rows, zeros where the target's embeddings are passed as input_embeds (its table is not read)."""
        if self.token_rows is not None:
            tokens = self.token_rows[ids]
            if bool((tokens < 0).any()):
                raise DoctorInputError("replay: a token whose embedding row was not loaded")
            return tokens
        return torch.zeros_like(ids) if self.uses_target_embeddings else ids

    def _embeds(self, embeds: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The target's embeddings as the class's ``input_embeds`` where SGLang gives it the target's, else None."""
        if not self.uses_target_embeddings:
            return None
        if embeds is None:
            raise ValueError("this draft takes the target's embeddings (SGLang's set_embed): pass them")
        return embeds.to(self.dtype)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids as target ids (the class's ``hot_token_id``, d2t; the identity without one)."""
        hot = getattr(self.model, "hot_token_id", None)  # d2t, as SGLang's EAGLE worker maps them
        return hot.to(draft_ids.device)[draft_ids] if hot is not None else draft_ids

