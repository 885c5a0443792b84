"""argparse, shaped for the commands whose errors read like every other zerotrain error.

The training program (train/args.py), `zerotrain plan` and `zerotrain deepspeed-env` parse with
this ArgumentParser: a bad flag raises ConfigError, which train.errors.user_errors prints as one
line `zerotrain: error: ...` with exit code 2 (argparse's own error() would print a usage block),
`--help` prints the command's hand-written text, and no flag may be abbreviated (`--conf` is not
`--config`). Flags the parser does not know come back from parse_known_args for the command to
judge: dotted config overrides, or a wrong flag to name in its own words.

check, export, plot, prepare and make-shapes use plain argparse, with its usage-block errors.
"""

from __future__ import annotations

import argparse
from typing import Callable

from zerotrain.train.errors import ConfigError

MISSING = object()  # what a Value flag receives when nothing follows it


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, prog: str, help_text: str | Callable[[], str], needs_value: str = "{flag} needs a value",
                 empty_is_missing: bool = False, **kwargs):
        """help_text: printed by -h/--help (a function when it is costly to build).
        needs_value: the error for a Value flag given no value; {flag} is the flag as typed.
        empty_is_missing: `--flag=` (or an empty argument) counts as no value."""
        super().__init__(prog=prog, add_help=False, allow_abbrev=False, **kwargs)
        self.help_text, self.needs_value, self.empty_is_missing = help_text, needs_value, empty_is_missing
        self.add_argument("-h", "--help", action=_Help)

    def format_help(self) -> str:
        return self.help_text() if callable(self.help_text) else self.help_text

    def error(self, message: str):
        # What Value and the commands do not word themselves, e.g. `--debug=1`: "argument --debug:
        # ignored explicit argument '1'".
        raise ConfigError(f"{message} (see {self.prog} --help)")


class _Help(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help())
        parser.exit(0)


class Value(argparse.Action):
    """A flag with one value, `--flag V` or `--flag=V`. nargs="?" rather than argparse's default
    so that a missing value reaches __call__, which names the flag as the user typed it (argparse's
    "expected one argument" names every spelling). convert: applied to the value; a ValueError
    becomes "--flag 'V' is not a <convert's name>". append: collect every occurrence in a list."""

    def __init__(self, option_strings, dest, convert: Callable | None = None, append: bool = False, **kwargs):
        super().__init__(option_strings, dest, nargs="?", const=MISSING, **kwargs)
        self.convert, self.append = convert, append

    def __call__(self, parser, namespace, value, option_string=None):
        if value is MISSING or (value == "" and parser.empty_is_missing):
            raise ConfigError(parser.needs_value.format(flag=option_string))
        if self.convert is not None:
            try:
                value = self.convert(value)
            except ValueError:
                raise ConfigError(f"{option_string} {value!r} is not a {self.convert.__name__}") from None
        if self.append:
            # A new list: argparse hands every parse the same default object.
            value = [*(getattr(namespace, self.dest, None) or []), value]
        setattr(namespace, self.dest, value)
