"""What a refused or ended request gets as its final error: a message and a code named as Triton's."""
from __future__ import annotations

from dataclasses import dataclass

# Error codes, named as Triton's (pb_utils.TritonError) so a transport can map them one to one.
INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
CANCELLED = "CANCELLED"
INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class RequestError:
    message: str
    code: str = INVALID_ARG
