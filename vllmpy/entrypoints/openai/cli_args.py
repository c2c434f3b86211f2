"""vllm-server's flags: the usage doc's server flag table, vLLM's spellings, one EngineArgs.

Bad flags exit 2 with one line: ``server: unknown argument '<flag>'``. Two recipe flags
are accepted with a notice because they mean nothing here; every other unknown flag,
parallelism flags included, is refused so nobody believes they got what they asked for.
"""

from __future__ import annotations

import argparse
import os
import sys

from vllmpy.config import EngineArgs
from vllmpy.entrypoints.arg_utils import OneLineArgumentParser

PROG = "server"

# flag -> why it has no effect here (printed once on stderr when the flag is passed)
INERT_FLAGS = {
    "--enable-auto-tool-choice": "tool parsing is not implemented yet, so there is no "
                                 "automatic tool choice to enable",
    "--trust-remote-code": "this engine runs only its own model code, so there is no "
                           "remote code to trust",
}




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
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="always include usage in responses and streams")
    g.add_argument("--enable-thinking", dest="enable_thinking", action="store_true",
                   default=None, help="default the chat template's enable_thinking to true")
    g.add_argument("--no-enable-thinking", dest="enable_thinking", action="store_false",
                   help="default the chat template's enable_thinking to false")
    g.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20,
                   help="largest accepted request body (413 beyond it)")
    g.add_argument("-v", "--verbose", action="store_true", help="verbose server logging")
    for flag in INERT_FLAGS:
        g.add_argument(flag, action="store_true", help=f"accepted, no effect: {INERT_FLAGS[flag]}")
    EngineArgs.add_cli_args(p)
    return p


def parse_server_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_strict(argv)
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
    return args


def default_served_model_name(model: str) -> str:
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".gguf")
