"""Request hooks: an optional module, named by the model parameter `request_hook_module`, that claims one request
parameter and may act on the engine. The product ships none; the fault tests bring theirs (tests/fault_hooks.py).

Without a hook the claimed parameter is just an unknown request parameter, refused like any other.
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # model.py loads the hook before torch is imported
    from inflight.engine import LLMEngine

log = logging.getLogger(__name__)

FACTORY = "make_request_hook"  # what a hook module must define: a no-argument callable returning a RequestHook


@runtime_checkable
class RequestHook(Protocol):
    """`parameter` is popped from a request before the contract sees it; `parse` validates its value (raising
    inflight.fields.InvalidRequestError, which refuses that request only) and `apply` runs once the request was
    accepted. `attach` is called once, before the engine loop starts (e.g. to set engine.step_hook)."""

    parameter: str

    def attach(self, engine: LLMEngine) -> None: ...

    def parse(self, raw: Any) -> Any: ...

    def apply(self, parsed: Any) -> None: ...


def load_request_hook(module_name: str) -> RequestHook | None:
    """Import `module_name` and build its hook; "" means none. A hook module that is missing or malformed fails
    the model load with a message naming it."""
    module_name = module_name.strip()
    if not module_name:
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"parameter request_hook_module={module_name!r} cannot be imported ({e}): allowed an "
                         f"importable module name (on sys.path, e.g. beside model.py), or empty") from None
    factory = getattr(module, FACTORY, None)
    if not callable(factory):
        raise ValueError(f"parameter request_hook_module={module_name!r}: {module.__file__} has no {FACTORY}()")
    hook = factory()
    if not isinstance(hook, RequestHook) or not isinstance(hook.parameter, str) or not hook.parameter:
        raise ValueError(f"parameter request_hook_module={module_name!r}: {FACTORY}() returned {hook!r}, "
                         f"which lacks parameter/attach/parse/apply")
    log.warning("request hook %s loaded from %s: requests may send %r; tests only", module_name, module.__file__,
                hook.parameter)
    return hook
