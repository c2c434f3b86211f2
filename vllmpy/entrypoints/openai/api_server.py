"""vllm-server: the OpenAI-compatible HTTP server over AsyncLLM.

The engine core runs in its own process; this process does HTTP, JSON, templates,
tokenization and detokenization (the app: app.py). This module stays light until the
core is started, so the core's start-up does not wait for this process's imports.
"""

from __future__ import annotations

import sys
from typing import Any

from vllmpy.config import EngineArgs
from vllmpy.engine import core_launch
from vllmpy.entrypoints.openai.cli_args import default_served_model_name, parse_server_args


def main(argv: list[str] | None = None) -> int:
    args = parse_server_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    # The engine core starts before this process imports torch and the web stack: the
    # two processes import side by side, and the core resolves the model and builds the
    # config itself.
    launched = core_launch.launch(engine_args, core_launch.probable_device(engine_args.device))
    try:
        import uvicorn

        from vllmpy.engine.async_llm import AsyncLLM, EngineStartupError
        from vllmpy.entrypoints.openai.app import build_app, startup_lines
    except BaseException:
        launched.stop()
        raise
    try:
        engine = AsyncLLM.from_engine_args(engine_args, launched=launched)
    except ValueError as e:
        print(f"server: {e}", file=sys.stderr)
        return 2
    except EngineStartupError as e:  # the core has printed its own traceback
        print(f"server: {e}", file=sys.stderr)
        return 1
    name = args.served_model_name or default_served_model_name(engine.model_config.model)
    engine_died = False

    def stop_on_engine_death() -> None:
        nonlocal engine_died
        engine_died = True
        server.should_exit = True

    app = build_app(engine, args, name, on_engine_dead=stop_on_engine_death)
    startup_lines(engine, name)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level="info" if args.verbose else "warning",
                            loop="uvloop" if _has_uvloop() else "asyncio",
                            timeout_keep_alive=5)
    server = _Server(config, listening=f"server: listening on http://"
                     f"{f'[{args.host}]' if ':' in args.host else args.host}:{args.port} "
                     f"(model {name!r})")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    if engine_died:
        print("server: exiting with status 1 because the engine core died", file=sys.stderr)
        return 1
    return 0 if server.started else 1


class _Server:
    """uvicorn's server, printing the listening line once the socket is bound."""

    def __new__(cls, config: Any, listening: str) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                if self.started:
                    print(listening, file=sys.stderr, flush=True)

        return Server(config)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
