"""vllm-server's flags: the usage doc's server flag table, vLLM's spellings, one EngineArgs.

Bad flags exit 2 with one line: ``server: unknown argument '<flag>'``. Two recipe flags
are accepted with a notice because they mean nothing here; every other unknown flag,
parallelism flags included, is refused so nobody believes they got what they asked for.

The engine flags that need no model (``check_startup_flags``: ``--chat-template``,
``--kv-transfer-config``, ...) are checked here too, so such a refusal comes before the
engine core starts.

``--tool-call-parser`` and ``--reasoning-parser`` take a registered parser name, ``auto``
(resolved from the chat template once the model is loaded: ``resolve_output_parsers``) or
``none``.
"""

from __future__ import annotations

import argparse
import os
import sys

from vllmpy.config import EngineArgs
from vllmpy.entrypoints.arg_utils import OneLineArgumentParser
from vllmpy.entrypoints.openai.multimodal_limits import parse_limits
from vllmpy.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    detect_tool_parser,
    get_tool_parser,
)
from vllmpy.reasoning import REASONING_PARSERS, detect_reasoning_parser
from vllmpy.startup_flags import check_startup_flags

PROG = "server"

# flag -> why it has no effect here (printed once on stderr when the flag is passed)
INERT_FLAGS = {
    "--enable-auto-tool-choice": "tool parsing is always on once --tool-call-parser "
                                 "resolves (requests with tools default to tool_choice "
                                 "auto), so there is no second gate to open",
    "--trust-remote-code": "this engine runs only its own model code, so there is no "
                           "remote code to trust",
}


DEFAULT_TOOL_CALL_PARSER = "hermes"
AUTO_TOOL_CHOICE_REFUSAL = (
    f"{PROG}: Error: --enable-auto-tool-choice requires --tool-call-parser\n"
    f"{PROG}: (--tool-call-parser none selects NO parser; name a parser, or drop "
    f"--tool-call-parser to keep the {DEFAULT_TOOL_CALL_PARSER} default)")


def make_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="vllm-server", description="OpenAI-compatible HTTP server.",
                              error_label=PROG)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="bind host")
    g.add_argument("--port", type=int, default=8000, help="bind port")
    g.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and responses (default: the model's "
                        "directory or file basename)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' (also read from VLLM_API_KEY)")
    g.add_argument("--allowed-origins", default=None,
                   help="comma-separated CORS origins to allow (default: none)")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                   default=True, help="log each request (default on)")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="also log each request's generated output")
    g.add_argument("--max-log-len", type=int, default=256,
                   help="truncate logged prompts and outputs to N characters")
    g.add_argument("--enable-metrics", dest="enable_metrics", action="store_true",
                   default=True, help="serve /metrics (default on)")
    g.add_argument("--disable-metrics", dest="enable_metrics", action="store_false")
    g.add_argument("--disable-web-ui", dest="enable_web_ui", action="store_false",
                   default=True, help="do not serve the browser playground at / and the "
                                      "live dashboard at /dashboard (the API is unchanged)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="always include usage in responses and streams")
    g.add_argument("--enable-thinking", dest="enable_thinking", action="store_true",
                   default=None, help="default the chat template's enable_thinking to true")
    g.add_argument("--no-enable-thinking", dest="enable_thinking", action="store_false",
                   help="default the chat template's enable_thinking to false")
    g.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20,
                   help="largest accepted request body (413 beyond it)")
    g.add_argument("-v", "--verbose", action="store_true", help="verbose server logging")
    g.add_argument("--tool-call-parser", default=DEFAULT_TOOL_CALL_PARSER,
                   help="tool-call dialect of the model's output; auto detects it from the "
                        "chat template, none turns tool parsing off (default "
                        f"{DEFAULT_TOOL_CALL_PARSER})")
    g.add_argument("--reasoning-parser", default="none",
                   help="splits reasoning_content off the output; auto detects it from the "
                        "chat template, none turns it off (default none)")
    g.add_argument("--limit-mm-per-prompt", default=None,
                   help="most multimodal items per prompt per modality, vLLM's JSON "
                        "('{\"image\": 2}', options such as '{\"video\": {\"count\": 1, "
                        "\"num_frames\": 32}}' validated and ignored); this server takes "
                        "text only, so every multimodal part is refused")
    g.add_argument("--language-model-only", dest="language_model_only", action="store_true",
                   default=False, help="set every modality's limit to 0")
    g.add_argument("--no-language-model-only", dest="language_model_only",
                   action="store_false", help="leave the modality limits as given (default)")
    for flag in INERT_FLAGS:
        g.add_argument(flag, action="store_true", help=f"accepted, no effect: {INERT_FLAGS[flag]}")
    EngineArgs.add_cli_args(p)
    return p


def parse_server_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_strict(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser == "none":
        print(AUTO_TOOL_CHOICE_REFUSAL, file=sys.stderr)
        raise SystemExit(2)
    _check_parser_name(parser, "--tool-call-parser", args.tool_call_parser, TOOL_PARSERS)
    if args.tool_call_parser in TOOL_PARSERS:
        try:  # a parser that cannot work here is refused now, not on every request
            get_tool_parser(args.tool_call_parser)()
        except ValueError as e:
            parser.error(f"--tool-call-parser {args.tool_call_parser}: {e}")
    _check_parser_name(parser, "--reasoning-parser", args.reasoning_parser, REASONING_PARSERS)
    for flag, why in INERT_FLAGS.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            print(f"{PROG}: accepted '{flag}' for published-recipe compatibility; it has no "
                  f"effect here: {why}", file=sys.stderr)
    if args.api_key is None:
        from vllmpy import envs

        args.api_key = envs.VLLM_API_KEY
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_log_len < 0:
        parser.error(f"--max-log-len must be >= 0, got {args.max_log_len}")
    try:
        args.mm_limits = parse_limits(args.limit_mm_per_prompt, args.language_model_only)
        # the engine core checks them again, and logs what they warn of
        check_startup_flags(EngineArgs.from_cli_args(args), args.device, notify=False)
    except ValueError as e:
        parser.error(str(e))
    if args.mm_limits.dropped:
        print(f"{PROG}: --limit-mm-per-prompt: dropped {', '.join(args.mm_limits.dropped)}: "
              f"only 'count' is read for a modality other than image, video and audio, as "
              f"upstream", file=sys.stderr)
    return args


def default_served_model_name(model: str) -> str:
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".gguf")


def _check_parser_name(parser: OneLineArgumentParser, flag: str, name: str,
                       registry: dict[str, str]) -> None:
    if name not in registry and name not in ("auto", "none"):
        parser.error(f"{flag} {name!r} is not a known parser; choose from "
                     f"{', '.join([*registry, 'auto', 'none'])}")


def resolve_output_parsers(args: argparse.Namespace,
                           chat_template: str | None) -> tuple[str | None, str | None]:
    """(tool-call parser, reasoning parser) for the server, None meaning off. ``auto`` is
    resolved from the chat template, and the outcome printed on stderr."""
    resolved = []
    for flag, name, detect in (("--tool-call-parser", args.tool_call_parser, detect_tool_parser),
                               ("--reasoning-parser", args.reasoning_parser,
                                detect_reasoning_parser)):
        if name == "auto":
            name = detect(chat_template)
            found = (f"the chat template calls for {name!r}" if name else
                     "the chat template matches no known format, so it is off")
            print(f"{PROG}: {flag} auto: {found}", file=sys.stderr)
        resolved.append(None if name in (None, "none") else name)
    return resolved[0], resolved[1]
