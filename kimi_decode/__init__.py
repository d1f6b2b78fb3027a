"""kimi_decode: a kernel research workbench for the decode step of Kimi K3.

Data path: config -> weights/state -> reference | stock | fused -> bench/profile
-> data -> plots -> notebooks. See docs/architecture.md.
"""

from .config import DecodeShape, KimiK3Config, ShardSpec
from .support import UnsupportedConfiguration, check_supported

__version__ = "0.1.0"

__all__ = ["KimiK3Config", "ShardSpec", "DecodeShape", "check_supported", "UnsupportedConfiguration"]
