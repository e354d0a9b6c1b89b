import os
import sys
from pathlib import Path

# Triton kernels run on the CPU interpreter in tests; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The project's packages and `tests.*` helpers import however pytest was started.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
