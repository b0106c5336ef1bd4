"""`python -m checkpoints.gguf PATH`: convert (or find in the cache) and print the
checkpoint directory as the last stdout line. Any failure is one stderr line,
`<file>: <what is wrong>`, and exit status 1 (the scheduler shows that line to the operator)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import structlog

from checkpoints.files import CheckpointError
from checkpoints.gguf import find_gguf_file, gguf_checkpoint_dir


def _configure_logging(log_format: str) -> None:
    """Log lines go to stderr: stdout carries only the result."""
    renderer = (structlog.processors.JSONRenderer() if log_format == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _gguf_file(path: Path) -> Path:
    found = find_gguf_file(path)
    if found is not None:
        return found
    if not path.exists():
        raise CheckpointError(path, "not found")
    if path.is_dir() and (path / "config.json").exists():
        raise CheckpointError(path, "holds a config.json: it is an HF checkpoint directory, "
                                    "not a GGUF one")
    if path.is_dir():
        raise CheckpointError(path, "holds no .gguf file")
    raise CheckpointError(path, "is not a .gguf file")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints.gguf",
        description="Convert a GGUF file (once) into a Folio/HF checkpoint directory and print "
                    "that directory.")
    parser.add_argument("path", help="a .gguf file, or a directory holding exactly one")
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default: $FOLIO_CACHE_DIR or ~/.cache/folio)")
    parser.add_argument("--log-format", choices=("console", "json"), default=None,
                        help="default: console in a terminal, json otherwise; progress bars "
                             "only with console")
    args = parser.parse_args(argv)
    log_format = args.log_format or ("console" if sys.stderr.isatty() else "json")
    _configure_logging(log_format)
    path = Path(args.path).expanduser()
    try:
        model_dir = gguf_checkpoint_dir(_gguf_file(path), args.cache_dir,
                                        progress=log_format == "console")
    except CheckpointError as e:
        print(e, file=sys.stderr)
        return 1
    except OSError as e:  # the cache directory itself: permissions, a full disk
        print(f"{e.filename or path}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{path}: conversion interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, but the contract is one line: say what and where
        print(f"{path}: conversion failed ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    print(model_dir, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
