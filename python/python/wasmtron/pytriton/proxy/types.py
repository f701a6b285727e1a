"""``Request``, as PyTriton's ``pytriton.proxy.types`` names it (for type hints of inference callables)."""
from ..decorators import Request

__all__ = ["Request"]
