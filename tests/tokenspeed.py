"""TokenSpeed's own publisher module, loaded from its PyPI wheel for the tests that run against it.

`tokenspeed==0.1.1`'s `tokenspeed/runtime/pd/kv_events.py` imports only msgspec, pyzmq and
pydantic; `nox -s tests` downloads the wheel without its dependencies and names it in
TSKV_TOKENSPEED_WHEEL. The wheel's one file is executed as a module of its own; nothing of it
is kept in this repository.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import zipfile
from pathlib import Path
from types import ModuleType

MODULE_IN_WHEEL = "tokenspeed/runtime/pd/kv_events.py"


def load_tokenspeed() -> ModuleType | str:
    """TokenSpeed's kv_events module, or why it cannot be had here."""
    wheel = os.environ.get("TSKV_TOKENSPEED_WHEEL")
    if not wheel or not Path(wheel).is_file():
        return "TokenSpeed's wheel is not here (nox -s tests downloads it: TSKV_TOKENSPEED_WHEEL)"
    try:
        import pydantic  # noqa: F401  (TokenSpeed's config model needs it)
    except ImportError:
        return "pydantic, which TokenSpeed's module imports, is not installed"
    source = zipfile.ZipFile(wheel).read(MODULE_IN_WHEEL)
    spec = importlib.util.spec_from_loader("tokenspeed_kv_events", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the Structs' annotations through it
    exec(compile(source, f"{wheel}!{MODULE_IN_WHEEL}", "exec"), module.__dict__)
    return module


LOADED = load_tokenspeed()
