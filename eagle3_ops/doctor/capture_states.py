"""``capture-states``: record a target's hidden states at every layer boundary (Hugging Face, CPU).

STATES file (safetensors), format ``eagle3_ops.doctor.states/1``:

- ``prompt.{i}.input_ids``          int64 [T]
- ``prompt.{i}.hidden_states``      [L+1, T, H], Hugging Face ``output_hidden_states`` order:
  index 0 = embeddings, index j = residual stream entering layer j; index L is *after* the final
  norm (Hugging Face's convention)
- ``prompt.{i}.last_layer_output``  [T, H]: the last layer's output *before* the final norm (what
  engines capture as boundary L)
- ``prompt.{i}.next_token``         int64 [T]: the target's greedy next token after position t
- metadata: ``format``, ``num_layers``, ``hidden_size``, ``num_prompts``, ``model``

Prompts file: a JSON list whose items are strings (tokenized with the model's tokenizer) or lists
of token ids; or plain text with one prompt per non-empty line. Without one, :data:`BUILTIN_PROMPTS`
(plain text: needs the model's tokenizer).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import List, Union

import torch

from .._cli import quote_error
from .configs import NESTED_TEXT_KEYS, DoctorInputError, check_file
from .configs import accelerate_available as _accelerate_available  # the doctor's advice asks the same

FORMAT = "eagle3_ops.doctor.states/1"
_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")


# What capture-states records without --prompts: varied plain text (chat, code, maths, facts, instructions), so
# that a copy-pasted command runs; each prompt gives the replay its tokens' positions.
BUILTIN_PROMPTS = [
    "Explain in a few sentences why the sky is blue, as you would to a ten-year-old.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "A train leaves at 3:15 pm and travels 240 km at 80 km/h. When does it arrive? Show your working.",
    "Translate into French: The meeting has been moved to Thursday morning at nine.",
    "List five tips for writing clear technical documentation.",
    "What are the main differences between TCP and UDP?",
    "Write a haiku about the first snow of winter.",
    "Give me a recipe for a simple vegetable soup, with ingredients and steps.",
    "How does a hash table handle collisions? Describe two common strategies.",
    "Write a short, polite email declining an invitation to speak at a conference.",
    "Solve for x: 3x + 7 = 22, and explain each step.",
    "What causes the seasons on Earth?",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Describe the water cycle, naming each stage.",
    "Give three arguments for and three against working from home.",
    "What is the difference between a list and a tuple in Python?",
    "Tell a short story about a robot who learns to paint.",
    "Explain what a neural network is without using any mathematics.",
    "How do vaccines train the immune system?",
    "Write a bash one-liner that counts the lines of every .py file in a directory tree.",
    "Why did the Roman Empire split into East and West?",
    "Compare the time complexity of quicksort and merge sort, best and worst case.",
]


def read_prompts(path) -> List[Union[str, List[int]]]:
    """The prompts of the file at ``path``: a JSON list of non-empty strings or token-id lists, else one string per
    non-empty line. Raises DoctorInputError for a file that cannot be read, bad JSON, a bad item or no prompt."""
    p = check_file(path, "prompts", "a prompts file (JSON list or one prompt per line)")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DoctorInputError(f"prompts: cannot read {p}: {e}") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DoctorInputError(f"prompts: {p} looks like JSON but does not parse (line {e.lineno}: {e.msg})") \
                from None
        out = []
        for k, it in enumerate(items):
            if isinstance(it, str) and it:
                out.append(it)
            elif isinstance(it, list) and it and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                     for x in it):
                out.append([int(x) for x in it])
            else:
                raise DoctorInputError(f"prompts: item {k} of {p} must be a non-empty string or a list of token ids")
    else:
        out = [line for line in text.splitlines() if line.strip()]
    if not out:
        raise DoctorInputError(f"prompts: {p} holds no prompts")
    return out


def _positive(cfg_path: Path, field: str, v) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise DoctorInputError(f"capture-states: {field} in {cfg_path} must be a positive integer, found {v!r}")


def check_target_config(model_dir: Path, cfg: dict, effective=None) -> None:
    """Before any model is built: the config's sizes are positive integers, and the layer count, hidden size and
    vocabulary the model would be built with (``effective``: the config object transformers reads, defaults
    included) fit the checkpoint's own tensors (their names and shapes, read from the safetensors headers of the
    files the checkpoint consists of), so a config asking for far more layers than the checkpoint holds is refused at
    once, naming the field and the numbers, instead of building a model until memory runs out."""
    from .configs import checkpoint_files, read_weight_headers

    cfg_path = model_dir / "config.json"
    text, prefix = cfg, ""
    if "num_hidden_layers" not in cfg:
        for k in NESTED_TEXT_KEYS:
            if isinstance(cfg.get(k), dict):
                text, prefix = cfg[k], f"{k}."
                break
    for field in _SIZE_FIELDS:
        _positive(cfg_path, prefix + field, text.get(field))
    if effective is not None:
        for field in _SIZE_FIELDS:
            _positive(cfg_path, prefix + field, getattr(effective, field, None))
    values = {f: (getattr(effective, f, None) if effective is not None else None) or text.get(f)
              for f in ("num_hidden_layers", "hidden_size", "vocab_size")}
    chosen = checkpoint_files(model_dir, "capture-states")
    if not chosen.files:
        return  # transformers says what is missing
    weights = read_weight_headers(model_dir, chosen.files, what="capture-states")
    files = ", ".join(Path(f).name for f in chosen.files[:3]) + (f" and {len(chosen.files) - 3} more"
                                                                 if len(chosen.files) > 3 else "")
    layers = {int(m.group(1)) for info in weights.values() for m in [_LAYER_NAME.search(info.raw_name)] if m}
    n = values["num_hidden_layers"]
    if layers and isinstance(n, int) and n > max(layers) + 1:
        held = max(layers) + 1
        raise DoctorInputError(f"capture-states: {prefix}num_hidden_layers = {n} in {cfg_path}, but the checkpoint "
                               f"({files}) holds layers 0..{held - 1} only ({held} layers): expected at most {held}")
    emb = next((info for info in weights.values() if info.raw_name.endswith(("embed_tokens.weight", "wte.weight"))
                and len(info.shape) == 2), None)
    if emb is not None:
        rows, width = emb.shape
        for field, want in (("hidden_size", width), ("vocab_size", rows)):
            v = values[field]
            if isinstance(v, int) and v != want:
                raise DoctorInputError(f"capture-states: {prefix}{field} = {v} in {cfg_path}, but the checkpoint's "
                                       f"{emb.raw_name} ({Path(emb.file).name}) is {list(emb.shape)}: expected {want}")


def _effective_config(model_dir: Path, trust_remote_code: bool):
    """The config transformers builds the model from (defaults applied), or None where it cannot be read here
    (loading the model then says why)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=bool(trust_remote_code))
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    except Exception:  # noqa: BLE001 - remote code not allowed, an unknown model type: _load_model reports it
        return None


def _decoder_layers(model):
    for path in ("model.layers", "model.language_model.layers", "language_model.model.layers", "transformer.h"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise DoctorInputError("capture-states: cannot find the decoder layers of this model (expected model.layers)")


def _missing_weights(model, info) -> List[str]:
    """Parameters and persistent buffers the checkpoint did not provide (randomly initialised), less the ones tied
    to a loaded tensor (``lm_head.weight`` with ``tie_word_embeddings``) and the ones the model declares optional."""
    missing = set(info.get("missing_keys") or ()) | {k[0] if isinstance(k, tuple) else k
                                                    for k in info.get("mismatched_keys") or ()}
    if not missing:
        return []
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    loaded = [t for n, t in tensors.items() if n not in missing]
    loaded_ids = {id(t) for t in loaded}
    loaded_storage = {t.data_ptr() for t in loaded if t.numel() > 0 and t.data_ptr() != 0}
    optional = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or ())]
    out = []
    for name in sorted(missing):
        t = tensors.get(name)
        if t is not None and (id(t) in loaded_ids or t.data_ptr() in loaded_storage):
            continue  # tied to a tensor that was loaded
        if any(p.search(name) for p in optional):
            continue
        out.append(name)
    return out


@contextlib.contextmanager
def _quiet_transformers(transformers):
    """transformers logs its own missing-weights report; this command reports them itself, on one line."""
    level = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(level)


def _load_model(model_dir: Path, torch_dtype, *, device_map, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    # trust_remote_code is always a bool: None would make transformers prompt y/N on a terminal (and fail without
    # one) for a config with auto_map.
    kwargs = dict(trust_remote_code=bool(trust_remote_code), output_loading_info=True)
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype, **kwargs)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        return AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch_dtype, **kwargs)


@torch.no_grad()
def capture_states(model_dir, prompts, out_path, *, dtype: str = "bfloat16", max_tokens: int = 512,
                   device: str = "cpu", device_map=None, trust_remote_code: bool = False) -> dict:
    """Runs the Hugging Face model in ``model_dir`` on each prompt (at most ``max_tokens`` tokens) and writes a STATES
    file ``/1`` (format above) to ``out_path``; returns a summary dict (out, prompts, tokens, num_layers, hidden_size).
    Raises DoctorInputError for what the user must fix: a missing tokenizer, config or weights, a model needing
    ``--trust-remote-code``."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise DoctorInputError("capture-states needs Hugging Face transformers (pip install transformers)") from None
    from .states import save_states_file as save_file  # atomic; never replaces a device or a directory

    if device_map is not None and not _accelerate_available():
        raise DoctorInputError("capture-states: --device-map needs accelerate (pip install accelerate)")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        check_file(model_dir, "capture-states", "a model directory")  # missing, a FIFO, unreadable
        raise DoctorInputError(f"capture-states: {model_dir} is a file; expected a model directory (with config.json)")
    cfg_path = model_dir / "config.json"
    if not os.path.lexists(cfg_path):
        raise DoctorInputError(f"capture-states: no config.json in {model_dir}")
    check_file(cfg_path, "capture-states", "a config.json file")
    try:
        raw_cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError, TypeError):
        raw_cfg = None  # transformers reports the broken config below
    has_auto_map = isinstance(raw_cfg, dict) and "auto_map" in raw_cfg
    transformers.utils.logging.disable_progress_bar()
    if isinstance(raw_cfg, dict):
        with _quiet_transformers(transformers):
            effective = _effective_config(model_dir, trust_remote_code)
        check_target_config(model_dir, raw_cfg, effective)
    # the tokenizer before the model: a missing one is found in seconds, not after minutes of loading
    tokenizer = None
    if any(isinstance(p, str) for p in prompts):
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=bool(trust_remote_code))
        except Exception as e:
            raise DoctorInputError(f"capture-states: text prompts (the built-in ones without --prompts) need a "
                                   f"tokenizer in {model_dir}: {quote_error(e, 240, whole=True)}; copy the model's "
                                   f"tokenizer files there, or pass --prompts FILE holding token-id lists") from None

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        with _quiet_transformers(transformers):
            model, info = _load_model(model_dir, torch_dtype, device_map=device_map,
                                      trust_remote_code=trust_remote_code)
        if device_map is None:
            model = model.to(device)
        model = model.eval()
    except Exception as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            why = " (its config.json has auto_map)" if has_auto_map else ""
            raise DoctorInputError(f"capture-states: this model needs --trust-remote-code{why}; pass it only if "
                                   f"you trust the code in {model_dir}") from None
        raise DoctorInputError(f"capture-states: cannot load {model_dir} with transformers: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    missing = _missing_weights(model, info)
    if missing:  # states of a half-random model would make replay blame the wiring
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise DoctorInputError(f"capture-states: {model_dir} lacks {len(missing)} weight(s) the model needs (they "
                               f"would be random): {', '.join(missing[:10])}{more}")
    layers = _decoder_layers(model)
    if device_map is not None:  # inputs go where the embedding is
        device = model.get_input_embeddings().weight.device
    threads = torch.get_num_threads()
    if str(device) == "cpu" and model.config.get_text_config().hidden_size < 1024:
        torch.set_num_threads(1)  # tiny models: a second OpenMP thread only adds waiting on a busy machine
    try:
        return _capture(model, layers, tokenizer, prompts, out_path, model_dir, torch_dtype, max_tokens, device,
                        save_file)
    finally:
        torch.set_num_threads(threads)


def _capture(model, layers, tokenizer, prompts, out_path, model_dir, torch_dtype, max_tokens, device, save_file):
    grabbed = {}
    hook = layers[-1].register_forward_hook(
        lambda _m, _i, out: grabbed.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    tensors, total = {}, 0
    try:
        for i, p in enumerate(prompts):
            ids = tokenizer(p, return_tensors="pt").input_ids[0] if isinstance(p, str) else torch.tensor(p)
            ids = ids[:max_tokens].to(device)
            vocab = model.config.get_text_config().vocab_size
            if int(ids.max()) >= vocab:
                raise DoctorInputError(f"prompts: prompt {i} has token id {int(ids.max())} >= vocab size {vocab}")
            out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            hs = torch.stack([h[0] for h in out.hidden_states], 0)
            tensors[f"prompt.{i}.input_ids"] = ids.cpu().long().contiguous()
            tensors[f"prompt.{i}.hidden_states"] = hs.to(torch_dtype).cpu().contiguous()
            tensors[f"prompt.{i}.last_layer_output"] = grabbed["last"][0].to(torch_dtype).cpu().contiguous()
            tensors[f"prompt.{i}.next_token"] = out.logits[0].argmax(-1).cpu().long().contiguous()
            total += ids.numel()
    finally:
        hook.remove()
    num_layers = hs.shape[0] - 1
    meta = {"format": FORMAT, "num_layers": str(num_layers), "hidden_size": str(hs.shape[-1]),
            "num_prompts": str(len(prompts)), "model": str(model_dir)}
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_path), metadata=meta)
    return {"out": str(out_path), "prompts": len(prompts), "tokens": total, "num_layers": num_layers,
            "hidden_size": int(hs.shape[-1])}
