import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("torch", "transformers", "worker", "models", "attention", "kv_cache")


def test_server_imports_none_of_the_engine_side_packages():
    code = (
        "import sys, server, server.cli;"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r})))"
    )
    root = Path(__file__).parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert result.stdout.strip() == "[]"
