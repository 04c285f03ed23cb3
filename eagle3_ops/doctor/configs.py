"""Reading target/draft ``config.json`` dialects and the draft's weight headers.

Dialects of EAGLE-3 draft configs in use:

- ``specforge``: SpecForge / SGLang. ``eagle_config.eagle_aux_hidden_state_layer_ids`` (nested).
  Training convention: id ``k`` = *output* of decoder layer ``k`` (SpecForge captures through
  SGLang's ``set_eagle3_layers_to_capture``, which adds 1; its default ids are
  ``[1, L//2 - 1, L - 4]``), ``-1`` = the embeddings.
- ``speculators``: vLLM's speculators format. ``speculators_model_type``, top-level
  ``eagle_aux_hidden_state_layer_ids``, ``transformer_layer_config`` (the draft layer's Llama
  config), ``target_hidden_size``, ``norm_before_fc``, ``fc_norm``, ``norm_before_residual``.
  Training convention: id ``k`` = the residual stream *entering* layer ``k`` (vLLM's capture
  point), ``0`` = the embeddings.
- ``top-level``: plain config with top-level ``eagle_aux_hidden_state_layer_ids`` (what vLLM
  reads). Assumed convention: vLLM's ("entering layer k").
- ``eagle-original``: no ids at all (SafeAILab EAGLE-3 checkpoints). Trained on Hugging Face
  boundaries ``(2, L//2, L-3)``, which is also every engine's default.

Targets are read by the library that defines their model type (:func:`library_config`): SGLang's own
config parser when the pinned SGLang is installed, else transformers' config class for ``model_type``
(``attribute_map`` aliases, defaults, the nested ``text_config`` of multimodal wrappers such as
Kimi-K2.5 or LLaVA); the doctor's own parsing (``num_hidden_layers`` at the top level or under
``text_config`` / ``language_config`` / ``llm_config``) only for a model type neither knows, which the
report flags (``W_CONFIG_ASSUMED``).

Weights: only safetensors headers are read (``safe_open``: names, shapes, dtypes). ``d2t``/``t2d``
(tiny) are loaded for value checks; nothing else is loaded except by ``--replay``.
``pytorch_model.bin`` drafts are opened with ``torch.load(mmap=True)`` so only headers are touched.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from .._cli import quote_error
from .draft import canonical_name

if TYPE_CHECKING:
    import torch

NESTED_TEXT_KEYS = ("text_config", "language_config", "llm_config")

# Training conventions: how a draft's ids were turned into hidden states during training.
LAYER_OUTPUT = "layer-output"   # id k = output of layer k (SpecForge, SGLang, TensorRT-LLM); -1 = embeddings
LAYER_INPUT = "layer-input"     # id k = input of layer k = HF output_hidden_states[k] (vLLM); 0 = embeddings
CONVENTIONS = (LAYER_OUTPUT, LAYER_INPUT)

CONVENTION_TEXT = {
    LAYER_OUTPUT: 'id k = output of layer k (SpecForge/SGLang convention; -1 = embeddings)',
    LAYER_INPUT: 'id k = residual stream entering layer k (vLLM convention; 0 = embeddings)',
}


class DoctorInputError(Exception):
    """Bad usage or unreadable input: the CLI prints the message and exits with status 2."""


def convention_to_index(conv: str, layer_id: int) -> int:
    """Hugging Face boundary index (output_hidden_states index) that ``layer_id`` names in ``conv``."""
    return layer_id + 1 if conv == LAYER_OUTPUT else layer_id


def index_to_convention(conv: str, index: int) -> int:
    """The layer id that names Hugging Face boundary ``index`` in convention ``conv`` (the inverse of
    :func:`convention_to_index`)."""
    return index - 1 if conv == LAYER_OUTPUT else index


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"))


def _os_why(e: OSError) -> str:
    """``permission denied (EACCES)``: the system's words, lower case, and the errno's name."""
    from ..files import errno_name

    name = errno_name(e)
    words = (e.strerror or str(e)).lower()
    return f"{words} ({name})" if name else words


def _missing(p: Path) -> str:
    """Why ``p`` (which os.stat cannot find) is not there: a dangling symlink says where it points."""
    if os.path.islink(p):
        try:
            return f"{p} is a dangling symlink (-> {os.readlink(p)}): the file it points to does not exist (ENOENT)"
        except OSError:
            pass
    return f"{p} does not exist"


def check_file(path, what: str, expected: str = "a file") -> Path:
    """Refuse, with one clear line, a path that is missing (or a dangling symlink), a directory, not a regular
    file (opening a FIFO would block forever) or unreadable (the errno's name said). Returns the path."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise DoctorInputError(f"{what}: {_missing(p)}") from None
    except OSError as e:
        raise DoctorInputError(f"{what}: cannot read {p}: {_os_why(e)}") from None
    if stat.S_ISDIR(mode):
        raise DoctorInputError(f"{what}: {p} is a directory; expected {expected}")
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _FILE_KINDS if test(mode)), "not a regular file")
        raise DoctorInputError(f"{what}: {p} is {kind}, not a regular file; expected {expected}")
    try:
        os.close(os.open(p, os.O_RDONLY))
    except OSError as e:
        raise DoctorInputError(f"{what}: cannot read {p}: {_os_why(e)}") from None
    return p


# what Hugging Face accepts as a repo id: owner/name, letters, digits and . _ - (huggingface_hub validate_repo_id)
_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def accelerate_available() -> bool:
    """Whether ``accelerate`` is installed: transformers' ``device_map`` (capture-states --device-map) needs it."""
    import importlib.util

    try:
        return importlib.util.find_spec("accelerate") is not None
    except (ImportError, ValueError):
        return False


def hf_cached_snapshot(repo_id: str) -> Optional[Path]:
    """The folder of ``repo_id``'s snapshot in the local Hugging Face cache (what ``from_pretrained`` and SGLang
    load from), or None; never downloads. Partial snapshots count (``hf download ID --include '*.json'``)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), no huggingface_hub, a bad id
        return None


def resolve_model_dir(arg, what: str) -> Path:
    """``arg`` as a path when something is there, else a Hugging Face repo id found in the local cache; a repo id
    that is not cached is one line saying how to get it."""
    p = Path(arg)
    if os.path.lexists(p) or not _HF_REPO_ID.match(str(arg)):
        return p
    found = hf_cached_snapshot(str(arg))
    if found is not None:
        return found
    try:
        from huggingface_hub import constants

        cache = f" ({constants.HF_HUB_CACHE})"
    except ImportError:
        cache = ""
    raise DoctorInputError(f"{what}: {arg} is no folder here and not in the Hugging Face cache{cache}: download it "
                           f"with `hf download {arg}` (the configs alone, enough for the config checks: "
                           f"`hf download {arg} --include '*.json'`), or pass its folder")


def read_config(path, what: str) -> Tuple[Path, dict]:
    """``path`` is a model directory (or a config.json); returns (dir, parsed config)."""
    p = Path(path)
    try:
        is_dir = p.is_dir()
    except OSError as e:
        raise DoctorInputError(f"{what}: cannot read {p}: {_os_why(e)}") from None
    cfg_path = p / "config.json" if is_dir else p
    model_dir = p if is_dir else p.parent
    if is_dir and not os.path.lexists(cfg_path):
        try:
            os.lstat(cfg_path)
        except FileNotFoundError:
            raise DoctorInputError(f"{what}: no config.json in {p}") from None
        except OSError as e:  # an unsearchable directory hides its files: say so, not "no config.json"
            raise DoctorInputError(f"{what}: cannot read {cfg_path}: {_os_why(e)}") from None
        raise DoctorInputError(f"{what}: no config.json in {p}")
    return model_dir, read_json_object(cfg_path, what, "a model directory or its config.json")


def read_json_object(path, what: str, expected: str) -> dict:
    """A file that must hold one JSON object (a config, a shard index, a draft snapshot), read with one-line
    errors naming ``what`` and the path: not a readable regular file (:func:`check_file`, ``expected``), an
    OS error, not UTF-8, not JSON (line and column), or JSON but not an object."""
    p = check_file(path, what, expected)
    try:
        text = p.read_text()
    except OSError as e:
        raise DoctorInputError(f"{what}: cannot read {p}: {_os_why(e)}") from None
    except UnicodeDecodeError as e:
        raise DoctorInputError(f"{what}: {p} is not UTF-8 text ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DoctorInputError(f"{what}: {p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") \
            from None
    if not isinstance(data, dict):
        raise DoctorInputError(f"{what}: {p} must hold a JSON object, found {type(data).__name__}")
    return data


def _int_field(cfg: dict, key: str, what: str, required: bool = True) -> Optional[int]:
    v = cfg.get(key)
    if v is None:
        if required:
            raise DoctorInputError(f"{what}: config.json has no '{key}'")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise DoctorInputError(f"{what}: '{key}' must be a positive integer, found {v!r}")
    return v


def _ids_field(value, where: str, what: str) -> Optional[List[int]]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise DoctorInputError(f"{what}: {where} must be a list of integers, found {value!r}")
    return [int(x) for x in value] if value else None


# ------------------------------------------------------------------------------ library config reading
@dataclasses.dataclass
class LibraryConfig:
    """A config.json as the library that defines its model type reads it."""
    obj: object                 # the config object (transformers / SGLang class), or None: the doctor's own parsing
    text: object                # the decoder-stack config (the same object unless nested), or None
    reader: str                 # who read it, in words
    assumed: bool               # True: neither transformers nor SGLang knows the model type
    context_length: Optional[int] = None  # SGLang's get_context_length of ``text`` (SGLang's readings only)


def sglang_context_length(text_config) -> Optional[int]:
    """SGLang's own get_context_length of a (text) config object; None where it cannot tell."""
    try:
        from sglang.srt.utils.hf_transformers.common import get_context_length

        return int(get_context_length(text_config))
    except Exception:  # noqa: BLE001 - no length: the context check does not run
        return None


def sglang_read(cfg: dict, model_dir: Optional[Path] = None) -> Tuple[object, object, str, Optional[int]]:
    """(config object, text config, who read it, SGLang's get_context_length of it): SGLang's own parser on
    ``cfg`` (:func:`sglang_parse`), or what it made of the same config in an earlier run (engine_cache: its
    ``to_dict()``s, rebuilt; a parser error raised again as it was)."""
    from . import engine_cache

    kept = engine_cache.parsed(cfg)
    if kept is not None and "error" in kept:
        raise type(str(kept["error_type"]), (Exception,), {})(kept["error"])
    if kept is not None:
        obj = engine_cache.KeptConfig(kept["obj"], kept["obj_class"])
        text = obj if kept["text"] is None else engine_cache.KeptConfig(kept["text"], kept["text_class"])
        return obj, text, kept["reader"], kept["context_length"]
    try:
        obj, text = sglang_parse(cfg, model_dir)
    except Exception as e:
        engine_cache.remember(cfg, {"error_type": type(e).__name__, "error": str(e)})
        raise
    reader = f"SGLang's config parser ({type(obj).__module__}.{type(obj).__name__})"
    context = sglang_context_length(text)
    engine_cache.remember(cfg, {"obj": engine_cache.attributes(obj), "obj_class": type(obj).__name__,
                                "text": None if text is obj else engine_cache.attributes(text),
                                "text_class": type(text).__name__,
                                "reader": reader, "context_length": context})
    return obj, text, reader, context


def sglang_parse(cfg: dict, model_dir: Optional[Path]):
    """SGLang's own reading (``HfModelConfigParser.parse``: AutoConfig, its own config classes, the text-config
    attributes it copies to the top level), on the directory or a copy of the dict."""
    import tempfile

    from .sglang_code import quiet_sglang

    with quiet_sglang():
        from sglang.srt.utils.hf_transformers.config import HfModelConfigParser
        from sglang.srt.utils.hf_transformers.common import get_hf_text_config

        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            (d / "config.json").write_text(json.dumps(cfg))
            obj = HfModelConfigParser().parse(str(d), trust_remote_code=False)
        return obj, get_hf_text_config(obj)


@contextlib.contextmanager
def _transformers_quiet():
    """transformers logs its own validation notes while it reads a config; the report says what matters."""
    try:
        from transformers.utils import logging as tlog
    except ImportError:  # pragma: no cover
        yield
        return
    old = tlog.get_verbosity()
    tlog.set_verbosity_error()
    try:
        yield
    finally:
        tlog.set_verbosity(old)


def library_config(cfg, model_dir: Optional[Path] = None, use_sglang: bool = False) -> LibraryConfig:
    """Read ``cfg`` (a config.json dict, or an already built config object) with the library that defines its
    model type: SGLang's own parser when ``use_sglang`` (the installed, pinned SGLang), else transformers'
    config class for ``model_type`` (``attribute_map`` aliases, defaults, nested sub-configs); neither: None."""
    if not isinstance(cfg, dict):  # a config object from a running engine
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return LibraryConfig(cfg, text, f"the caller's {type(cfg).__name__} object", False,
                             sglang_context_length(text) if use_sglang else None)
    mt = cfg.get("model_type")
    if use_sglang:
        try:
            obj, text, reader, context = sglang_read(cfg, model_dir)
            return LibraryConfig(obj, text, reader, False, context)
        except Exception as e:  # noqa: BLE001 - fall back to transformers, saying why
            sglang_err = f"SGLang's config parser failed ({type(e).__name__}: {quote_error(e, 200)})"
    else:
        sglang_err = None
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        CONFIG_MAPPING = {}
    if isinstance(mt, str) and mt in CONFIG_MAPPING:
        cls = CONFIG_MAPPING[mt]
        try:
            with _transformers_quiet():
                obj = cls.from_dict(dict(cfg))
        except Exception as e:  # noqa: BLE001
            raise DoctorInputError(f"{cls.__name__} (transformers) cannot read this config: {type(e).__name__}: {e}") \
                from None
        try:
            text = obj.get_text_config(decoder=True)
        except (TypeError, ValueError):
            text = obj
        import transformers

        reader = f"transformers {transformers.__version__} {cls.__name__}"
        return LibraryConfig(obj, text, reader + (f"; {sglang_err}" if sglang_err else ""), False)
    why = f"neither transformers nor SGLang defines model_type {mt!r}" if mt else "config.json has no model_type"
    return LibraryConfig(None, None, (sglang_err + "; " if sglang_err else "") + why, True)


def _lib_int(obj, key: str, where: str, required: bool = True) -> Optional[int]:
    v = getattr(obj, key, None)
    if v is None:
        if required:
            raise DoctorInputError(f"{where}: the config has no {key}")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise DoctorInputError(f"{where}: {key} must be a positive integer, found {v!r}")
    return v


# --------------------------------------------------------------------------------------- target
@dataclasses.dataclass
class TargetInfo:
    """A target model as the doctor reads its config: the decoder stack's model type, layer count, hidden and vocab
    sizes (from the nested text config for multimodal models), and the library's parsed config."""
    path: Path
    config: dict
    text_config: dict            # the dict that describes the decoder stack (== config unless nested)
    nested_key: Optional[str]
    model_type: str
    text_model_type: str
    architectures: List[str]
    num_layers: int
    hidden_size: int
    vocab_size: Optional[int]
    lib: Optional[LibraryConfig] = None

    def describe(self) -> str:
        """One line for the report: the model type (and the nested language model), layers, hidden size and vocab."""
        mt = self.model_type if self.model_type == self.text_model_type or not self.nested_key else \
            f"{self.model_type}, language model {self.text_model_type} under '{self.nested_key}'"
        vocab = f", vocab {self.vocab_size}" if self.vocab_size else ""
        return f"{mt}, {self.num_layers} layers (0..{self.num_layers - 1}), hidden {self.hidden_size}{vocab}"


def parse_target(path, use_sglang: bool = False) -> TargetInfo:
    """The :class:`TargetInfo` of the model directory (or config.json) at ``path``; ``use_sglang``: read the config as
    SGLang's parser does. Raises DoctorInputError for an unreadable or unusable config."""
    model_dir, cfg = read_config(path, "target")
    return target_from_config(cfg, model_dir, use_sglang=use_sglang)


def target_from_config(cfg, path=None, use_sglang: bool = False) -> TargetInfo:
    """A target from its config (a config.json dict or a config object), read by the library that defines it
    (:func:`library_config`); the doctor's own parsing (``num_hidden_layers`` of the top level or of
    ``text_config`` / ``language_config`` / ``llm_config``) only where no library knows the model type."""
    what = "target"
    model_dir = Path(path) if path is not None else Path("<config>")
    lib = library_config(cfg, model_dir if path is not None else None, use_sglang)
    raw = cfg if isinstance(cfg, dict) else (cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg)))
    text, key = raw, None
    for k in NESTED_TEXT_KEYS:
        if isinstance(raw.get(k), dict) and "num_hidden_layers" not in raw:
            text, key = raw[k], k
            break
    if lib.obj is not None:
        t = lib.text
        where = f"{what} ({lib.reader})"
        num_layers = _lib_int(t, "num_hidden_layers", where)
        hidden = _lib_int(t, "hidden_size", where)
        vocab = _lib_int(t, "vocab_size", where, required=False) or _lib_int(lib.obj, "vocab_size", where,
                                                                             required=False)
        text_mt = str(getattr(t, "model_type", "") or text.get("model_type", ""))
        if t is not lib.obj and key is None:
            key = next((k for k in NESTED_TEXT_KEYS if getattr(lib.obj, k, None) is t), "text_config")
    else:
        where = f"{what} ({key})" if key else what
        num_layers = _int_field(text, "num_hidden_layers", where)
        hidden = _int_field(text, "hidden_size", where)
        vocab = _int_field(text, "vocab_size", where, required=False) or _int_field(raw, "vocab_size", what,
                                                                                   required=False)
        text_mt = str(text.get("model_type", ""))
    archs = raw.get("architectures") or text.get("architectures") or []
    return TargetInfo(path=model_dir, config=raw, text_config=text, nested_key=key,
                      model_type=str(raw.get("model_type", "")), text_model_type=text_mt,
                      architectures=[str(a) for a in archs] if isinstance(archs, list) else [str(archs)],
                      num_layers=num_layers, hidden_size=hidden, vocab_size=vocab, lib=lib)


# ---------------------------------------------------------------------------------------- draft
@dataclasses.dataclass
class DraftInfo:
    """An EAGLE-3 draft as the doctor reads its config.json: its dialect, the layer ids it records (nested and
    top-level), sizes, vocabularies and the fc-block flags that decide what it was trained on and how it is served."""
    path: Path
    config: dict
    dialect: str                    # specforge | speculators | top-level | eagle-original
    nested_ids: Optional[List[int]]  # eagle_config.eagle_aux_hidden_state_layer_ids
    top_ids: Optional[List[int]]     # top-level eagle_aux_hidden_state_layer_ids
    use_aux_hidden_state: bool
    layer_config: dict               # the draft layer's config (transformer_layer_config for speculators)
    hidden_size: Optional[int]
    target_hidden_size: Optional[int]
    vocab_size: Optional[int]
    draft_vocab_size: Optional[int]
    num_aux_declared: Optional[int]  # num_aux_hidden_states
    norm_before_fc: bool
    fc_norm: bool
    norm_before_residual: bool
    tie_word_embeddings: bool
    architectures: List[str]
    tie_source: Optional[str] = None  # where tie_word_embeddings came from (config.json, a class default)

    @property
    def training_ids(self) -> Optional[List[int]]:
        """The ids that describe what the draft was trained on, as the dialect records them."""
        if self.dialect == "specforge":
            return self.nested_ids
        return self.top_ids

    @property
    def dialect_convention(self) -> Optional[str]:
        """The convention the dialect's ids are written in: layer-output (SpecForge), layer-input (speculators,
        top-level), or None (no ids: the original EAGLE format)."""
        if self.dialect == "specforge":
            return LAYER_OUTPUT
        if self.dialect in ("speculators", "top-level"):
            return LAYER_INPUT
        return None

    def describe(self) -> str:
        """One line for the report: the config's dialect and the layer ids it records."""
        if self.dialect == "specforge":
            s = f"SpecForge/SGLang config: eagle_config.eagle_aux_hidden_state_layer_ids = {self.nested_ids}"
            if self.top_ids is not None:
                s += f"; also top-level eagle_aux_hidden_state_layer_ids = {self.top_ids}"
            return s
        if self.dialect == "speculators":
            s = "speculators config: " + (f"eagle_aux_hidden_state_layer_ids = {self.top_ids}" if self.top_ids
                                          else "no eagle_aux_hidden_state_layer_ids (engine defaults)")
            if self.nested_ids is not None:
                s += f"; also eagle_config.eagle_aux_hidden_state_layer_ids = {self.nested_ids}"
            return s
        if self.dialect == "top-level":
            return f"config with top-level eagle_aux_hidden_state_layer_ids = {self.top_ids}"
        return "EAGLE-3 config without layer ids (original EAGLE format): engines use their defaults"


def parse_draft(path, use_sglang: bool = False) -> DraftInfo:
    """The :class:`DraftInfo` of the draft directory (or config.json) at ``path``; ``use_sglang``: read the config as
    SGLang's parser does. Raises DoctorInputError for an unreadable or unusable config."""
    model_dir, cfg = read_config(path, "draft")
    return draft_from_config(cfg, model_dir, use_sglang=use_sglang)


def draft_from_config(cfg: dict, path=None, use_sglang: bool = False) -> DraftInfo:
    """A draft from its config.json dict. ``tie_word_embeddings`` is read through the config class of the
    draft's model type where one exists (its default applies when the key is absent, as in the engine)."""
    what = "draft"
    model_dir = Path(path) if path is not None else Path("<config>")
    eagle_cfg = cfg.get("eagle_config")
    if eagle_cfg is not None and not isinstance(eagle_cfg, dict):
        raise DoctorInputError(f"{what}: 'eagle_config' must be a JSON object, found {eagle_cfg!r}")
    eagle_cfg = eagle_cfg or {}
    nested = _ids_field(eagle_cfg.get("eagle_aux_hidden_state_layer_ids"),
                        "eagle_config.eagle_aux_hidden_state_layer_ids", what)
    top = _ids_field(cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", what)
    is_speculators = "speculators_model_type" in cfg or "transformer_layer_config" in cfg
    layer_cfg = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else cfg
    if is_speculators:
        dialect = "speculators"
    elif nested is not None:
        dialect = "specforge"
    elif top is not None:
        dialect = "top-level"
    else:
        dialect = "eagle-original"

    def pick(key, default=None):
        for d in (cfg, eagle_cfg, layer_cfg):
            if key in d and d[key] is not None:
                return d[key]
        return default

    num_aux = cfg.get("num_aux_hidden_states")
    if num_aux is not None and (isinstance(num_aux, bool) or not isinstance(num_aux, int) or num_aux <= 0):
        raise DoctorInputError(f"{what}: 'num_aux_hidden_states' must be a positive integer, found {num_aux!r}")
    archs = cfg.get("architectures") or layer_cfg.get("architectures") or []
    tie = layer_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
    tie_source = "config.json" if tie is not None else None
    if tie is None:  # the config class's default, as the engine builds it
        try:
            lib = library_config(layer_cfg, None, use_sglang)
        except DoctorInputError:
            lib = None
        if lib is not None and lib.obj is not None:
            tie = getattr(lib.obj, "tie_word_embeddings", False)
            tie_source = f"the default of {lib.reader}"
    nbr_default = is_speculators  # vLLM's speculators conversion defaults norm_before_residual to True
    return DraftInfo(
        path=model_dir, config=cfg, dialect=dialect, nested_ids=nested, top_ids=top,
        use_aux_hidden_state=bool(eagle_cfg.get("use_aux_hidden_state", True)),
        layer_config=layer_cfg,
        hidden_size=_int_field(layer_cfg, "hidden_size", what, required=False),
        target_hidden_size=_int_field(cfg, "target_hidden_size", what, required=False),
        vocab_size=_int_field(layer_cfg, "vocab_size", what, required=False),
        draft_vocab_size=_int_field(cfg, "draft_vocab_size", what, required=False)
        or _int_field(layer_cfg, "draft_vocab_size", what, required=False),
        num_aux_declared=num_aux,
        norm_before_fc=bool(pick("norm_before_fc", False)),
        fc_norm=bool(pick("fc_norm", False) or pick("use_aux_norm", False)),
        norm_before_residual=bool(pick("norm_before_residual", nbr_default)),
        tie_word_embeddings=bool(tie),
        tie_source=tie_source,
        architectures=[str(a) for a in archs] if isinstance(archs, list) else [str(archs)],
    )


# -------------------------------------------------------------------------------------- weights
@dataclasses.dataclass
class TensorInfo:
    """One tensor of a checkpoint, from its file's header only: canonical and raw name, shape, dtype and the file
    holding it."""
    name: str          # canonical name (see draft.canonical_name)
    raw_name: str
    shape: Tuple[int, ...]
    dtype: str
    file: str


INDEX_NAME = "model.safetensors.index.json"
# what SGLang's loader leaves out of a *.bin checkpoint (weight_utils.filter_files_not_needed_for_inference)
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


@dataclasses.dataclass
class CheckpointFiles:
    """The files a checkpoint folder's weights are read from, chosen as SGLang's loader chooses them."""
    folder: Path
    files: List[str]          # the weight files, in order
    index: Optional[str]      # model.safetensors.index.json, when it decides
    rule: str                 # in words: how they were chosen
    left_out: List[str]       # weight-like files in the folder that are not read (names)

    def describe(self) -> str:
        """One line for the report: the first four weight files, the rule that chose them, and any weight-like files
        left out."""
        names = ", ".join(Path(f).name for f in self.files[:4]) + (f" and {len(self.files) - 4} more"
                                                                  if len(self.files) > 4 else "")
        out = f"{names} ({self.rule})"
        if self.left_out:
            out += (f"; not read: {', '.join(self.left_out[:4])}" + (f" and {len(self.left_out) - 4} more"
                                                                    if len(self.left_out) > 4 else ""))
        return out


def _list_folder(model_dir: Path, what: str) -> List[str]:
    try:
        with os.scandir(model_dir) as it:
            return sorted(e.name for e in it)
    except OSError as e:  # entered but not listed (chmod -r), gone, a symlink loop: the folder's own cause
        raise DoctorInputError(f"{what}: cannot list the folder {model_dir}: {_os_why(e)}; without "
                               f"{INDEX_NAME} the checkpoint is every *.safetensors file in it, so the folder must "
                               f"be readable (read permission for the user that runs this)") from None


def checkpoint_files(model_dir, what: str = "draft") -> CheckpointFiles:
    """The weight files of a checkpoint folder, as SGLang's loader picks them: with ``model.safetensors.index.json``
    exactly the shards its weight_map names (nothing else in the folder is opened, so a stale shard or a dangling
    ``pytorch_model.bin`` beside them does not matter); without it every ``*.safetensors`` file in the folder; with
    none, every ``*.bin`` (not training_args.bin, optimizer.bin). Raises DoctorInputError (one line) where the index
    is unreadable, names a file that is not there, or the folder cannot be listed."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if os.path.lexists(index):
        data = read_json_object(index, what, "a JSON index of the safetensors shards")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            found = "none" if weight_map is None else type(weight_map).__name__
            raise DoctorInputError(f"{what}: in {index}, weight_map must be a JSON object mapping tensor names to "
                                   f"files, found {found}")
        names = sorted(set(weight_map.values()))
        outside = [f for f in names if os.path.isabs(f) or ".." in Path(f).parts or not f.strip()]
        if outside:
            raise DoctorInputError(f"{what}: {index} names files outside its folder: {', '.join(map(repr, outside))}; "
                                   f"expected shard names in {model_dir}")
        files = [str(model_dir / f) for f in names]
        missing = [f for f in files if not os.path.lexists(f)]
        if missing:
            raise DoctorInputError(f"{what}: {index.name} lists missing files: {', '.join(missing)}")
        return CheckpointFiles(model_dir, files, str(index), f"the {len(files)} shard(s) {INDEX_NAME} names", [])
    listed = [n for n in _list_folder(model_dir, what) if not n.startswith(".")]
    st = [n for n in listed if n.endswith(".safetensors")]
    if st:
        other = [n for n in listed if n.endswith((".bin", ".pt", ".pth"))]
        return CheckpointFiles(model_dir, [str(model_dir / n) for n in st], None,
                               f"every *.safetensors file in the folder: it has no {INDEX_NAME}", other)
    bins = [n for n in listed if n.endswith(".bin") and n not in _NOT_WEIGHTS]
    return CheckpointFiles(model_dir, [str(model_dir / n) for n in bins], None,
                           "every *.bin file in the folder: it has no *.safetensors", [])


def _weight_files(model_dir: Path, what: str = "draft") -> List[str]:
    return checkpoint_files(model_dir, what).files


def read_weight_headers(model_dir, files: Optional[List[str]] = None, what: str = "draft") -> Dict[str, TensorInfo]:
    """Names, shapes and dtypes of every tensor of a checkpoint directory, without loading data; ``files``: the
    weight files to read (default: :func:`checkpoint_files`), and no other file is opened."""
    model_dir = Path(model_dir)
    if files is None:
        files = checkpoint_files(model_dir, what).files
    if not files:
        raise DoctorInputError(f"{what}: no weights in {model_dir} (expected model.safetensors, sharded "
                               f"*.safetensors with {INDEX_NAME}, or pytorch_model.bin)")
    out: Dict[str, TensorInfo] = {}
    for f in files:
        check_file(f, what, "a weights file")  # a FIFO would hang safe_open / torch.load
        if f.endswith((".bin", ".pt", ".pth")):
            out.update(_bin_headers(f, what))
            continue
        try:
            from safetensors import safe_open

            with safe_open(f, framework="pt") as st:
                for raw in st.keys():
                    sl = st.get_slice(raw)
                    name = canonical_name(raw)
                    out[name] = TensorInfo(name, raw, tuple(int(x) for x in sl.get_shape()), str(sl.get_dtype()), f)
        except DoctorInputError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise DoctorInputError(f"{what}: cannot read safetensors header of {f}: {e}") from None
    return out


# ------------------------------------------------------------------------------------- draft snapshots
SNAPSHOT_FORMAT = "eagle3_ops.draft-snapshot/1"


def _identity(path: str, role: str) -> dict:
    """What identifies a file's content without reading it: where it is (and where a symlink leads), its size,
    its modification and change times, its inode. Raises DoctorInputError where it cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DoctorInputError(f"draft: {_missing(Path(path))}") from None
    except OSError as e:
        raise DoctorInputError(f"draft: cannot read {path}: {_os_why(e)}") from None
    return {"path": str(path), "role": role, "real": os.path.realpath(path), "size": int(st.st_size),
            "mtime_ns": int(st.st_mtime_ns), "ctime_ns": int(st.st_ctime_ns), "ino": int(st.st_ino),
            "dev": int(st.st_dev)}


def _sha256(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def draft_snapshot(model_dir) -> dict:
    """One reading of a draft checkpoint, fixed: its config.json as read now (the dict and its hash), the weight
    files (:func:`checkpoint_files`) and the index with their identities (paths, sizes, mtimes, inodes; the index
    also hashed). What a server serves is what this says; :func:`snapshot_changes` tells whether the folder still
    holds it. Raises DoctorInputError (one line naming the file) where a file it needs cannot be read."""
    model_dir = Path(model_dir)
    cfg_dir, cfg = read_config(model_dir, "draft")
    chosen = checkpoint_files(cfg_dir)
    if not chosen.files:
        raise DoctorInputError(f"draft: no weights in {cfg_dir} (expected model.safetensors, sharded "
                               f"*.safetensors with {INDEX_NAME}, or pytorch_model.bin)")
    cfg_path = str(cfg_dir / "config.json")
    files = [_identity(cfg_path, "config")]
    try:
        files[0]["sha256"] = _sha256(cfg_path)
    except OSError as e:
        raise DoctorInputError(f"draft: cannot read {cfg_path}: {_os_why(e)}") from None
    if chosen.index is not None:
        files.append(dict(_identity(chosen.index, "index"), sha256=_sha256(chosen.index)))
    for f in chosen.files:
        check_file(f, "draft", "a weights file")
        files.append(_identity(f, "weights"))
    return {"format": SNAPSHOT_FORMAT, "dir": str(cfg_dir), "config": cfg, "files": files, "rule": chosen.rule,
            "left_out": chosen.left_out, "describe": chosen.describe()}


def snapshot_weight_files(snapshot: dict) -> List[str]:
    """The paths of the weight files a :func:`draft_snapshot` recorded, in order."""
    return [f["path"] for f in snapshot["files"] if f["role"] == "weights"]


def snapshot_bytes(snapshot: dict) -> int:
    """The total size in bytes of the weight files a :func:`draft_snapshot` recorded."""
    return sum(int(f["size"]) for f in snapshot["files"] if f["role"] == "weights")


def _when(ns: int) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def snapshot_changes(snapshot: dict, roles=("config", "index", "weights")) -> List[str]:
    """How the files of ``snapshot`` (of ``roles``) differ on disk now, in words (empty: unchanged)."""
    out = []
    for f in snapshot["files"]:
        if f["role"] not in roles:
            continue
        path = f["path"]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            out.append(f"{path} is gone" + (" (a dangling symlink now)" if os.path.islink(path) else ""))
            continue
        except OSError as e:
            out.append(f"{path} cannot be read now ({_os_why(e)})")
            continue
        if os.path.realpath(path) != f["real"]:
            out.append(f"{path} now leads to {os.path.realpath(path)} (was {f['real']})")
        elif (st.st_ino, st.st_dev) != (f["ino"], f["dev"]):
            size = "the same size" if st.st_size == f["size"] else f"size {f['size']} -> {st.st_size} bytes"
            out.append(f"{path} was replaced by another file ({size}, modified {_when(st.st_mtime_ns)})")
        elif st.st_size != f["size"]:
            out.append(f"{path} changed size ({f['size']} -> {st.st_size} bytes, modified {_when(st.st_mtime_ns)})")
        elif (st.st_mtime_ns, st.st_ctime_ns) != (f["mtime_ns"], f["ctime_ns"]):
            if "sha256" in f:
                try:
                    if _sha256(path) == f["sha256"]:
                        continue  # rewritten with the same content
                except OSError as e:
                    out.append(f"{path} cannot be read now ({_os_why(e)})")
                    continue
            out.append(f"{path} was modified at {_when(max(st.st_mtime_ns, st.st_ctime_ns))} (size unchanged)")
    return out


def read_snapshot(path, draft_dir=None) -> dict:
    """A snapshot written by the live wiring check (``doctor --draft-snapshot``), checked against its format."""
    p = Path(path)
    data = read_json_object(p, "draft-snapshot", "a draft snapshot (JSON) written by the live wiring check")
    keys = {"path": str, "role": str, "real": str, "size": int, "mtime_ns": int, "ctime_ns": int, "ino": int,
            "dev": int}
    ok = (data.get("format") == SNAPSHOT_FORMAT and isinstance(data.get("dir"), str)
          and isinstance(data.get("config"), dict) and isinstance(data.get("files"), list) and data["files"]
          and all(isinstance(f, dict) and all(isinstance(f.get(k), t) for k, t in keys.items()) for f in data["files"])
          and any(f["role"] == "weights" for f in data["files"]))
    if not ok:
        raise DoctorInputError(f"draft-snapshot: {p} is not a draft snapshot of format {SNAPSHOT_FORMAT!r} (expected "
                               f"format, dir, config and files with path, role, size, mtime_ns, ino per file)")
    if draft_dir is not None and os.path.realpath(str(draft_dir)) != os.path.realpath(data["dir"]):
        raise DoctorInputError(f"draft-snapshot: {p} is a snapshot of {data['dir']}, not of --draft {draft_dir}")
    return data


def changed_since_start(snapshot: dict, changes: List[str]) -> str:
    """The line for a draft whose weights changed on disk since the server read them."""
    return (f"the draft in {snapshot['dir']} changed since the server started: {'; '.join(changes)}; restart to "
            f"check it (the server serves what it loaded at start-up, which is no longer on disk to score)")


def _bin_headers(f: str, what: str = "draft") -> Dict[str, TensorInfo]:
    import torch

    check_file(f, what, "a weights file")
    try:
        sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise DoctorInputError(f"{what}: cannot read {f}: {e}") from None
    if not isinstance(sd, dict):
        raise DoctorInputError(f"{what}: {f} holds a {type(sd).__name__}, not a dict of tensors")
    out = {}
    for raw, t in sd.items():
        if hasattr(t, "shape"):
            name = canonical_name(raw)
            out[name] = TensorInfo(name, raw, tuple(t.shape), str(t.dtype).replace("torch.", "").upper(), f)
    return out


def load_rows(info: TensorInfo, rows: "torch.Tensor") -> "torch.Tensor":
    """Rows ``rows`` (sorted token ids) of one 2-D tensor, reading only those rows where the file
    allows it (safetensors slices; a .bin checkpoint is memory-mapped)."""
    import torch

    rows = rows.long()
    try:
        if info.file.endswith(".bin"):
            sd = torch.load(info.file, map_location="cpu", mmap=True, weights_only=True)
            return sd[info.raw_name].index_select(0, rows).clone()
        from safetensors import safe_open

        with safe_open(info.file, framework="pt") as st:
            sl = st.get_slice(info.raw_name)
            return torch.stack([sl[int(r):int(r) + 1][0] for r in rows.tolist()]) if rows.numel() else \
                torch.empty((0,) + tuple(info.shape[1:]))
    except Exception as e:
        raise DoctorInputError(f"draft: cannot load rows of {info.raw_name} from {info.file}: {e}") from None


def load_tensors(infos: Dict[str, TensorInfo], names) -> Dict[str, "torch.Tensor"]:
    """Load only the named tensors (canonical names) from their files."""
    import torch

    by_file: Dict[str, List[TensorInfo]] = {}
    for n in names:
        if n in infos:
            by_file.setdefault(infos[n].file, []).append(infos[n])
    out = {}
    for f, items in by_file.items():
        try:
            if f.endswith(".bin"):
                sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
                for it in items:
                    out[it.name] = sd[it.raw_name]
            else:
                from safetensors import safe_open

                with safe_open(f, framework="pt") as st:
                    for it in items:
                        out[it.name] = st.get_tensor(it.raw_name)
        except Exception as e:
            raise DoctorInputError(f"draft: cannot load tensors from {f}: {e}") from None
    return out
