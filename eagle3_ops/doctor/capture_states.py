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
of token ids; or plain text with one prompt per non-empty line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Union

import torch

from .configs import DoctorInputError

FORMAT = "eagle3_ops.doctor.states/1"


def read_prompts(path) -> List[Union[str, List[int]]]:
    p = Path(path)
    if not p.is_file():
        raise DoctorInputError(f"prompts: {p} does not exist")
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


@torch.no_grad()
def capture_states(model_dir, prompts, out_path, *, dtype: str = "float32", max_tokens: int = 512,
                   device: str = "cpu") -> dict:
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise DoctorInputError("capture-states needs Hugging Face transformers (pip install transformers)") from None
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise DoctorInputError(f"capture-states: no config.json in {model_dir}")
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch_dtype)
        model = model.to(device).eval()
    except Exception as e:
        raise DoctorInputError(f"capture-states: cannot load {model_dir} with transformers: {e}") from None
    tokenizer = None
    if any(isinstance(p, str) for p in prompts):
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:
            raise DoctorInputError(f"capture-states: text prompts need a tokenizer in {model_dir}: {e}") from None

    layers = _decoder_layers(model)
    threads = torch.get_num_threads()
    if device == "cpu" and model.config.get_text_config().hidden_size < 1024:
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
