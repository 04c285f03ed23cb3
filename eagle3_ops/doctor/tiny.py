"""A tiny, real target/draft pair for the doctor's tests and README example (CPU, ~10-30 s).

``build_tiny_pair(root)`` writes, under ``root``:

- ``target/``: a Hugging Face Llama (8 layers, hidden 64, vocab 64, random init, fixed seed),
  ``config.json`` + ``model.safetensors`` + a character-level tokenizer (:func:`save_tokenizer`).
  Layer ``i``'s output projections (``o_proj``, ``down_proj``) are scaled by ``2**(i+1)`` so that
  every layer boundary is distinct: in a plain random-init model of this size adjacent boundaries
  are near copies of each other (the residual
  stream changes by a few percent per layer) and no draft could tell them apart. Real models get
  the same distinctness from training (the residual norm grows by orders of magnitude with depth).
- ``draft/``: an EAGLE-3 draft *trained* on the target's own hidden states at three boundaries
  to predict the target's next token, saved like a SpecForge checkpoint: ``config.json`` with
  ``eagle_config.eagle_aux_hidden_state_layer_ids = [2, 4, 6]`` (SpecForge convention: "output of
  layer k", i.e. Hugging Face ``output_hidden_states[k + 1]``, so it was trained on boundaries
  3, 5, 7), ``model.safetensors`` with ``fc.weight``, ``fc_norm.{k}.weight``, ``midlayer.*``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` (draft vocab 32 of 64), no embedding
  (SGLang shares the target's).
- ``prompts.json``: held-out prompts (token-id lists) for ``capture-states``.

Needs ``transformers`` (test extra). Deterministic for a given seed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import List

import torch

from .draft import DraftSpec, Eagle3Draft

TRAINED_IDS = [2, 4, 6]  # SpecForge ids ("output of layer k") -> HF boundaries 3, 5, 7
NUM_LAYERS = 8
HIDDEN = 64
VOCAB = 64
DRAFT_VOCAB = 32
LAYER_GAIN = 2.0
PARAMS_VERSION = 5  # 5: the target has a tokenizer


@dataclasses.dataclass
class TinyPair:
    """One built tiny pair: its folders and prompts file, the draft's trained layer ids, the build time in seconds and
    the draft's held-out top-1 accuracy."""
    root: Path
    target_dir: Path
    draft_dir: Path
    prompts_file: Path
    trained_ids: List[int]
    seconds: float
    heldout_accuracy: float


def _target_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=1, pad_token_id=None)


def build_target(seed: int = 0):
    """The tiny Hugging Face Llama target (8 layers, hidden 64) seeded with ``seed``, layer i's ``o_proj`` and
    ``down_proj`` scaled by ``LAYER_GAIN**(i+1)`` so that every boundary is distinct; in eval mode."""
    import transformers
    from transformers import LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_target_config()).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.mul_(LAYER_GAIN ** (i + 1))
            layer.mlp.down_proj.weight.mul_(LAYER_GAIN ** (i + 1))
    return model


@torch.no_grad()
def target_states(model, ids: torch.Tensor):
    """ids [N, S] -> (hidden [L+1, N, S, H] in HF output_hidden_states order, next-token argmax [N, S])."""
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return torch.stack(out.hidden_states, 0).float(), out.logits.argmax(-1)


def draft_config(trained_ids=TRAINED_IDS) -> dict:
    """The tiny draft's ``config.json`` as a dict: a one-layer ``LlamaForCausalLMEagle3`` with fc_norm, capturing
    ``trained_ids`` (SpecForge convention)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": HIDDEN,
        "tie_word_embeddings": False,
        "fc_norm": True,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(trained_ids), "use_aux_hidden_state": True},
    }


def _spec_from(cfg: dict) -> DraftSpec:
    return DraftSpec(hidden_size=cfg["hidden_size"], target_hidden_size=cfg["target_hidden_size"], num_aux=3,
                     vocab_size=cfg["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"], num_layers=1,
                     num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
                     intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg["rms_norm_eps"],
                     rope_theta=cfg["rope_theta"], fc_norm=True)


def train_draft(hidden, nxt, boundaries, *, steps: int = 300, batch: int = 32, lr: float = 3e-3, seed: int = 1,
                draft=None):
    """Train a draft on captures at HF ``boundaries``: inputs (hidden[b][:, t], embedding of token t+1),
    label = the target's next token after token t+1. Returns the draft. ``draft``: the model to train (a
    module with ``forward(aux, embeds) -> logits`` over its draft vocabulary and ``d2t`` / ``t2d`` buffers;
    default: this module's llama_eagle3 draft, seeded with ``seed``)."""
    if draft is None:
        torch.manual_seed(seed)
        draft = Eagle3Draft(_spec_from(draft_config()))
    vocab, draft_vocab = draft.t2d.numel(), draft.d2t.numel()
    # Draft vocabulary: the most frequent target predictions (SpecForge does the same).
    counts = torch.bincount(nxt.reshape(-1), minlength=vocab)
    hot = torch.sort(torch.argsort(counts, descending=True)[:draft_vocab]).values
    draft.d2t.copy_(hot - torch.arange(draft_vocab))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    draft.t2d.copy_(t2d)
    target_to_draft = torch.full((vocab,), -100, dtype=torch.long)
    target_to_draft[hot] = torch.arange(draft_vocab)

    x_all = torch.cat([hidden[b] for b in boundaries], dim=-1)[:, :-1]  # [N, S-1, K*H]
    e_all = hidden[0][:, 1:]                                            # embedding of token t+1
    y_all = target_to_draft[nxt[:, 1:]]                                 # next token after t+1
    params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is several times faster than two on a busy 2-core box
    try:
        _train_loop(draft, opt, sched, x_all, e_all, y_all, steps, batch, gen)
    finally:
        torch.set_num_threads(threads)
    return draft


def _train_loop(draft, opt, sched, x_all, e_all, y_all, steps, batch, gen):
    n = x_all.shape[0]
    for _ in range(steps):
        idx = torch.randint(0, n, (batch,), generator=gen)
        logits = draft(x_all[idx], e_all[idx])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[idx].reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def save_tokenizer(target_dir: Path) -> None:
    """A character-level tokenizer of the target's 64 ids (0 = unknown, 1 = start; lower-cased letters, digits,
    space and punctuation), so that text prompts (capture-states' built-in ones) run on the tiny target as they
    do on a real one."""
    import string

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.digits + " .,?!:;'\"-()=+*/_<>%[]{}|\n"
    vocab = {"<unk>": 0, "<s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    assert len(vocab) == VOCAB, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(target_dir)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def build_tiny_pair(root, *, seed: int = 0, steps: int = 300, num_train: int = 512, seq_len: int = 32,
                    num_prompts: int = 96) -> TinyPair:
    """Build (or reuse, when ``root/DONE`` matches the parameters) the tiny target/draft pair."""
    from safetensors.torch import save_file

    root = Path(root)
    params = {"seed": seed, "steps": steps, "num_train": num_train, "seq_len": seq_len,
              "num_prompts": num_prompts, "version": PARAMS_VERSION}
    done = root / "DONE"
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("params") == params:
            return TinyPair(root, root / "target", root / "draft", root / "prompts.json", list(TRAINED_IDS),
                            info["seconds"], info["heldout_accuracy"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and much faster than two on a busy machine
    try:
        return _build(root, params, seed, steps, num_train, seq_len, num_prompts, save_file)
    finally:
        torch.set_num_threads(threads)


def _build(root, params, seed, steps, num_train, seq_len, num_prompts, save_file) -> TinyPair:
    done = root / "DONE"
    t0 = time.time()
    root.mkdir(parents=True, exist_ok=True)
    target = build_target(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    train_ids = torch.randint(2, VOCAB, (num_train, seq_len), generator=gen)
    hidden, nxt = target_states(target, train_ids)
    boundaries = [i + 1 for i in TRAINED_IDS]
    draft = train_draft(hidden, nxt, boundaries, steps=steps, seed=seed + 1)

    prompts = torch.randint(2, VOCAB, (num_prompts, seq_len), generator=gen)
    h_eval, n_eval = target_states(target, prompts)
    with torch.no_grad():
        x = torch.cat([h_eval[b] for b in boundaries], dim=-1)[:, :-1]
        pred = draft.draft_to_target(draft(x, h_eval[0][:, 1:]).argmax(-1))
        acc = (pred == n_eval[:, 1:]).float().mean().item()

    target_dir, draft_dir = root / "target", root / "draft"
    target.save_pretrained(target_dir, safe_serialization=True)
    save_tokenizer(target_dir)
    draft_dir.mkdir(parents=True, exist_ok=True)
    _write_json(draft_dir / "config.json", draft_config())
    save_file(draft.checkpoint_state_dict(include_embeddings=False), str(draft_dir / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(root / "prompts.json", prompts.tolist())
    seconds = time.time() - t0
    _write_json(done, {"params": params, "seconds": seconds, "heldout_accuracy": acc})
    return TinyPair(root, target_dir, draft_dir, root / "prompts.json", list(TRAINED_IDS), seconds, acc)


EDITED_IDS = [1, 3, 5]  # the README's mis-wiring: every slot one layer early


def miswired_example(root) -> int:
    """The README's mis-wired example end to end, each step printed as the command it is and then its output:
    build (or reuse) the tiny pair in ``root``, copy its draft to ``root/draft_edited`` with the ids edited to
    :data:`EDITED_IDS`, record the target's states of the held-out prompts with ``capture-states``, and run the
    doctor on the configs alone, then with ``--replay``. Returns 0 when the replay found the edit (the doctor's
    exit status 1 there), else 1."""
    import shutil
    import sys

    from . import cli

    root = Path(root)
    print(f"# the tiny pair in {root} (its draft trained on ids {TRAINED_IDS}), its draft copied with ids "
          f"{EDITED_IDS}", flush=True)
    pair = build_tiny_pair(root)
    edited = root / "draft_edited"
    shutil.rmtree(edited, ignore_errors=True)
    shutil.copytree(pair.draft_dir, edited)
    cfg = json.loads((edited / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(EDITED_IDS)
    _write_json(edited / "config.json", cfg)

    def step(name, fn, *args):
        print(f"$ python -m eagle3_ops {name} {' '.join(args)}", flush=True)
        rc = fn(list(args))
        sys.stdout.flush()
        print(f"(exit status {rc})\n", flush=True)
        return rc

    states = root / "states.safetensors"
    if step("capture-states", cli.capture_states_main, "--model", str(pair.target_dir), "--prompts",
            str(pair.prompts_file), "--out", str(states)) != 0:
        return 1
    doctor = ["--draft", str(edited), "--target", str(pair.target_dir)]
    if step("doctor", cli.main, *doctor) != 0:  # the configs agree with each other: they cannot see the edit
        return 1
    return 0 if step("doctor", cli.main, *doctor, "--replay", str(states)) == 1 else 1


def main(argv=None) -> int:
    """``python -m eagle3_ops.doctor.tiny [OUT_DIR] [--miswired-example]``: build (or reuse) the tiny pair, and with
    ``--miswired-example`` run the README's example on it; ``--help`` only prints usage."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eagle3_ops.doctor.tiny",
                                description="Build the tiny Llama target and an EAGLE-3 draft trained on its hidden "
                                            "states at ids [2, 4, 6] (boundaries 3, 5, 7), for the doctor's examples.")
    p.add_argument("out", nargs="?", default=os.path.join(os.getcwd(), "tiny_pair"),
                   help="folder to write target/, draft/ and prompts.json into (default: ./tiny_pair)")
    p.add_argument("--miswired-example", action="store_true",
                   help=f"then the README's example: the draft's ids edited to {EDITED_IDS}, the target's states "
                        f"recorded with capture-states, the doctor run on the configs and with --replay")
    args = p.parse_args(argv)
    if args.miswired_example:
        return miswired_example(args.out)
    pair = build_tiny_pair(args.out)
    print(json.dumps({"target": str(pair.target_dir), "draft": str(pair.draft_dir),
                      "prompts": str(pair.prompts_file), "seconds": round(pair.seconds, 1),
                      "heldout_accuracy": round(pair.heldout_accuracy, 3)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
