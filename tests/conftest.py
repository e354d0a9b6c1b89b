import os

# Triton kernels run on the CPU interpreter in tests; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
