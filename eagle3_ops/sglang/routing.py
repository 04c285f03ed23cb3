"""How the plugin reaches a model's ``forward``: a class-level wrapper keyed on instance state.

SGLang replaces instance attributes of its models at CUDA-graph / compile setup: with the
``tc_piecewise`` prefill backend, ``install_torch_compiled`` (``srt/compilation/compile.py``) sets
``module.forward`` to a trampoline that calls ``module.__class__.forward`` (read when it installs)
or a ``torch.compile`` of it. A wrapper put on the instance would be dropped silently. So the plugin
wraps the *class* ``forward`` once (per supported class, when it first patches a model of that
class, which is before graph setup) and marks each patched *instance* with its state attribute:

* an instance without the state attribute (another model of the same class, a model the plugin
  left stock) goes straight to the original ``forward``;
* under ``torch.compile`` tracing the wrapper steps aside before it looks at anything, so compiled
  (and piecewise-CUDA-graph) forwards are SGLang's own code;
* any trampoline that calls ``type(module).forward`` still reaches the wrapper.

:func:`routing_problem` is the after-setup check (SGLang's ``ModelRunner.init_cuda_graphs`` /
``init_prefill_cuda_graph``): does the instance still route through the wrapper?
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch

# marks every wrapper this package puts on a class forward (value: the state attribute it reads)
WRAPPER_MARK = "_eagle3_ops_state_attr"


def wrap_class_forward(owner: type, state_attr: str, run: Callable) -> Callable:
    """Make ``owner.forward`` call ``run(state, original, self, args, kwargs)`` for instances whose
    ``__dict__`` holds ``state_attr`` (and ``original(self, *args, **kwargs)`` for every other one).
    Idempotent; returns the wrapper now on the class."""
    current = owner.__dict__.get("forward")
    if current is None:
        raise TypeError(f"{owner.__qualname__} does not define forward itself")
    if getattr(current, WRAPPER_MARK, None) == state_attr:
        return current
    original = current

    @functools.wraps(original)  # signature/annotations stay visible (install_torch_compiled reads them)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return original(self, *args, **kwargs)
        state = self.__dict__.get(state_attr)
        if state is None:
            return original(self, *args, **kwargs)
        return run(state, original, self, args, kwargs)

    # One code object per wrapped class: Dynamo caches compiled frames per code object and
    # install_torch_compiled evicts that cache ("avoid cross-instance cache reuse"); a code object
    # shared by the target's and the draft's wrappers would let one model's setup evict the other's.
    code = forward.__code__
    try:
        code = code.replace(co_qualname=f"{owner.__qualname__}.forward")
    except TypeError:  # Python < 3.11: no co_qualname
        code = code.replace()
    forward.__code__ = code
    setattr(forward, WRAPPER_MARK, state_attr)
    forward._eagle3_ops = True
    owner.forward = forward
    return forward


def forward_owner(instance, cls: type) -> Optional[type]:
    """The class in ``type(instance).__mro__`` that defines the ``forward`` instances of ``type(
    instance)`` run, if that is ``cls.forward`` (the code the plugin knows); else None."""
    if not isinstance(instance, cls) or type(instance).forward is not cls.forward:
        return None
    for klass in type(instance).__mro__:
        if "forward" in klass.__dict__:
            return klass
    return None


def _reaches(obj: Any, target: Callable, depth: int = 5, seen: Optional[set] = None) -> bool:
    """Whether calling ``obj`` can reach ``target``, judged statically: ``obj`` is ``target`` or
    wraps it (bound method, ``__wrapped__``, ``functools.partial``, a closure variable — how
    SGLang's trampoline and HookRegistry's wrappers hold what they call)."""
    if obj is target:
        return True
    if depth == 0 or obj is None:
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    inner = []
    if isinstance(obj, types.MethodType):
        inner.append(obj.__func__)
    if isinstance(obj, functools.partial):
        inner.append(obj.func)
    wrapped = getattr(obj, "__wrapped__", None) if callable(obj) else None
    if wrapped is not None:
        inner.append(wrapped)
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if callable(value):
            inner.append(value)
    return any(_reaches(o, target, depth - 1, seen) for o in inner)


def _describe(fn: Any) -> str:
    fn = getattr(fn, "__func__", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def routing_problem(instance, state_attr: str) -> Optional[str]:
    """None if ``instance.forward`` still goes through the plugin's class wrapper, else what
    replaced it (a class-level ``forward`` that no longer wraps ours, or an instance attribute that
    does not call it)."""
    klass_forward = getattr(type(instance), "forward", None)
    ours = None
    for klass in type(instance).__mro__:
        fn = klass.__dict__.get("forward")
        if fn is not None and getattr(fn, WRAPPER_MARK, None) == state_attr:
            ours = fn
            break
    if ours is None or not _reaches(klass_forward, ours):
        return f"{type(instance).__qualname__}.forward is {_describe(klass_forward)}"
    attr = instance.__dict__.get("forward")
    if attr is not None and not _reaches(attr, ours):
        return f"the instance attribute forward was set to {_describe(attr)}"
    return None
