"""How autopar's commands meet a user's mistake: one line on stderr, printed once, with the
chained cause only under --verbose; and torch's warnings that are about autopar's own calls
(not the user's code) filtered out.

- report: `prog: error: message` (the message names the value, the rule and the fix); with
  verbose, the traceback of the chained cause below it.
- quiet_torch_warnings: installs warning filters for what torch says about calls autopar
  makes: pytree's `isinstance(treespec, LeafSpec)` FutureWarning (raised from copyreg when
  torch.export's specs are copied), torch.distributed.checkpoint's UserWarnings on load and
  save, and torch.export's logging of the whole graph before an export error (autopar turns
  the error into one line).
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback
import warnings
from typing import TextIO

VERBOSE_HINT = "run with --verbose for the cause's traceback"


def report(prog: str, err: BaseException, *, verbose: bool = False, where: str = "",
           extra: str = "", out: TextIO | None = None) -> None:
    """Print `prog: error: {where}{err}{extra}` on one line; with verbose also the chained
    cause's traceback."""
    out = sys.stderr if out is None else out
    text = f"{err}{extra}"
    cause = err.__cause__ or err.__context__
    if cause is not None and not verbose and VERBOSE_HINT not in text:
        text = f"{text} ({VERBOSE_HINT})"
    print(f"{prog}: error: {where}{text}", file=out, flush=True)
    if verbose and cause is not None:
        print("".join(traceback.format_exception(cause)), file=out, end="", flush=True)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a flag's type, a missing or unknown argument) are
    one line, `prog: error: message; see prog --help`, instead of the whole usage block above
    the message; exit status 2 as argparse's. Subparsers inherit it."""

    def error(self, message: str):  # noqa: D102 (argparse's hook)
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def quiet_torch_warnings() -> None:
    """Filter the warnings named in the module docstring (process-wide: call it from a
    command's entry point, not from library code)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning,
                            module=r"torch\.distributed\.checkpoint")
    for name in ("torch._dynamo", "torch.export", "torch._export"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
