"""The argument parser every command shares: a bad flag or value exits 2 with one line
naming it (``<label>: <message>``), and an unknown flag reads ``unknown argument '<flag>'``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


class OneLineArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, error_label: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a prefix never stands for a flag
        super().__init__(*args, **kwargs)
        self.error_label = error_label or self.prog

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.error_label}: {message}", file=sys.stderr)
        raise SystemExit(2)

    def parse_strict(self, argv: list[str] | None = None) -> argparse.Namespace:
        """Parse ``argv``; any flag the parser does not know is refused by name."""
        args, extra = self.parse_known_args(argv)
        if extra:
            self.error(f"unknown argument '{extra[0]}'")
        return args
