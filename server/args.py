"""The HTTP server's command-line flags, declared once for `python -m server` and
launch.py. This module imports nothing heavy: launch.py parses its flags with it
without loading fastapi."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import jinja2

from ipc.chat_template import environment
from server.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "SPLITSERVE_API_KEY"
# Where several API server processes keep their metrics (prometheus_client's multiprocess
# mode, read when the client is imported): set for them by launch.py --api-server-count.
METRICS_FOLDER_ENV = "PROMETHEUS_MULTIPROC_DIR"
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The HTTP server's flags (launch.py shares them)."""
    group = parser.add_argument_group("OpenAI-compatible API server")
    group.add_argument(
        "--host", "--api-host", dest="api_host", default="0.0.0.0", help="default: %(default)s"
    )
    group.add_argument(
        "--port", "--api-port", dest="api_port", type=int, default=8000, help="default: %(default)s"
    )
    group.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1; repeat it for several keys "
        f"(default: ${API_KEY_ENV}, comma-separated)",
    )
    group.add_argument("--served-model-name", help="default: the model folder's name")
    group.add_argument(
        "--salt-cache-by-api-key",
        action="store_true",
        help="salt each request's prefix-cache blocks with its API key, so that requests "
        "made with different keys never share cached prompts (default: off)",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details (the cached prompt tokens) "
        "(default: off, as in vLLM)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="refuse larger request bodies with a 413 (default: %(default)s, 8 MiB)",
    )
    cors = "for CORS, a JSON list (as vLLM's)"
    group.add_argument(
        "--allowed-origins",
        type=_json_list,
        help=f"origins allowed {cors}, e.g. '[\"https://example.com\"]' or '[\"*\"]' "
        "(default: none, no CORS headers; vLLM's default is any origin)",
    )
    for what in ("methods", "headers"):
        group.add_argument(
            f"--allowed-{what}",
            type=_json_list,
            default=["*"],
            help=f"{what} allowed {cors} (default: '[\"*\"]')",
        )
    group.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow credentials, for CORS (default: off)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose its tool calls (tool_choice "auto", the default with '
        "tools); needs --tool-call-parser (default: off)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), "
        "llama3_json (Llama 3.x) (default: none)",
    )
    group.add_argument(
        "--chat-template",
        type=_chat_template,
        help="a Jinja chat template, or a file holding one, for chats with a model that has "
        "none or to replace its own (vLLM's) (default: the tokenizer's)",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="accepted for vLLM's command lines: X-Request-Id is always answered here "
        "(default: on)",
    )
    return parser


def check_server_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check flag by flag: a parser.error for flags that need others."""
    options = server_options(args)
    if options["salt_cache_by_api_key"] and not options["api_keys"]:
        parser.error("--salt-cache-by-api-key needs --api-key")
    if options["enable_auto_tool_choice"] and not options["tool_call_parser"]:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")


def _chat_template(text: str) -> str:
    """The template a file holds, else the text itself when it is a template (as vLLM
    reads --chat-template); a template Jinja cannot parse is refused here, at start."""
    try:
        is_file = Path(text).is_file()
    except (OSError, ValueError):  # too long, or a NUL: no path, a template
        is_file = False
    if is_file:
        text = Path(text).read_text()
    elif not any(mark in text for mark in ("{{", "{%")):
        raise argparse.ArgumentTypeError(f"no such template file: {text!r}")
    try:
        environment().parse(text)  # the environment templates render in (loop controls too)
    except jinja2.TemplateSyntaxError as e:
        raise argparse.ArgumentTypeError(f"the chat template does not parse: {e}") from None
    return text


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """run_server's keyword arguments from the flags add_server_args declares; a flag the
    namespace lacks takes its default."""
    defaults = add_server_args(argparse.ArgumentParser()).parse_args([])
    given = {**vars(defaults), **vars(args)}
    return {
        "host": given["api_host"],
        "port": given["api_port"],
        "served_model_name": given["served_model_name"],
        "api_keys": _api_keys(given["api_key"]),
        "salt_cache_by_api_key": given["salt_cache_by_api_key"],
        "enable_prompt_tokens_details": given["enable_prompt_tokens_details"],
        "max_request_body_bytes": given["max_request_body_bytes"],
        "cors": _cors(given),
        "enable_auto_tool_choice": given["enable_auto_tool_choice"],
        "tool_call_parser": given["tool_call_parser"],
        "chat_template": given["chat_template"],
    }


def _cors(given: dict[str, Any]) -> dict[str, Any] | None:
    """CORSMiddleware's keyword arguments; None without --allowed-origins."""
    if not given["allowed_origins"]:
        return None
    return {
        "allow_origins": given["allowed_origins"],
        "allow_methods": given["allowed_methods"],
        "allow_headers": given["allowed_headers"],
        "allow_credentials": given["allow_credentials"],
    }


def server_child_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """For a launcher that starts the server as a child process: the server flags of
    `args` as command-line arguments, and the environment variable that carries the API
    keys (out of sight of `ps`)."""
    options = server_options(args)
    argv = ["--api-host", options["host"], "--api-port", str(options["port"])]
    if options["served_model_name"]:
        argv += ["--served-model-name", options["served_model_name"]]
    for flag in (
        "salt_cache_by_api_key",
        "enable_prompt_tokens_details",
        "enable_auto_tool_choice",
    ):
        if options[flag]:
            argv.append("--" + flag.replace("_", "-"))
    if options["tool_call_parser"]:
        argv += ["--tool-call-parser", options["tool_call_parser"]]
    if options["chat_template"]:
        argv += ["--chat-template", options["chat_template"]]
    argv += ["--max-request-body-bytes", str(options["max_request_body_bytes"])]
    cors = options["cors"]
    if cors is not None:
        for flag in ("origins", "methods", "headers"):
            argv += [f"--allowed-{flag}", json.dumps(cors[f"allow_{flag}"])]
        if cors["allow_credentials"]:
            argv.append("--allow-credentials")
    return argv, {API_KEY_ENV: ",".join(options["api_keys"])}


def _api_keys(given: str | list[str] | None) -> list[str]:
    """The keys given, or else those in $SPLITSERVE_API_KEY; each may be a comma-separated
    list."""
    if given is None:
        given = os.environ.get(API_KEY_ENV, "")
    values = [given] if isinstance(given, str) else given
    return [key.strip() for value in values for key in value.split(",") if key.strip()]
