"""Stream one answer from a running EngineCore to stdout:

python -m ipc.client --address ipc:///tmp/splitserve-x/engine --model PATH "Hello!"
"""

from __future__ import annotations

import argparse
import os
import sys

from ipc.auth import CredentialsError
from ipc.client.errors import EngineDeadError, RequestError
from ipc.client.sync_client import EngineClient
from ipc.defaults import default_sampling_params
from ipc.tokenizer import Tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ipc.client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt")
    parser.add_argument("--address", required=True, help="engine address, or a file holding one")
    parser.add_argument(
        "--credentials",
        metavar="FILE",
        help="client credentials of a tcp engine (default: ADDRESS_FILE.credentials if it exists)",
    )
    parser.add_argument(
        "--tokenizer",
        "--model",
        dest="tokenizer",
        metavar="PATH",
        default=os.environ.get("SPLITSERVE_MODEL"),
        help="the model folder, for its tokenizer (default: $SPLITSERVE_MODEL)",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--temperature", type=float, help="default: the model's generation config, else 1.0"
    )
    parser.add_argument(
        "--no-chat", action="store_true", help="send the prompt without the chat template"
    )
    parser.add_argument("--connect-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        parser.error("name the model folder: --tokenizer/--model PATH, or set SPLITSERVE_MODEL")

    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    messages = [{"role": "user", "content": args.prompt}]
    prompt = args.prompt if args.no_chat else tokenizer.encode_chat(messages)
    overrides = {} if args.temperature is None else {"temperature": args.temperature}
    params = default_sampling_params(args.tokenizer, max_tokens=args.max_tokens, **overrides)
    try:
        with EngineClient(
            args.address, tokenizer, args.connect_timeout, credentials=args.credentials
        ) as client:
            for delta in client.stream(prompt, params):
                print(delta.outputs[0].text, end="", flush=True)
    except (TimeoutError, RequestError, EngineDeadError, CredentialsError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
