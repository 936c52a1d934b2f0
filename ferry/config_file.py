"""`ferry serve --config FILE` (and `ferry run-batch`): flags from a YAML file, as `vllm serve --config`.

The file is a mapping of long flag names (``max-model-len`` or ``max_model_len``) to values::

    model: /models/llama-3.1-8b
    port: 8001
    max-model-len: 8192
    enable-prefix-caching: false
    served-model-name: [llama, llama-3.1]
    hf-overrides: {max_position_embeddings: 4096}

Each entry becomes the flag it names, placed before the command line's own flags, so the command
line wins (vLLM's order: command line > config file > defaults). ``true`` is the switch alone,
``false`` its ``--no-`` form (or nothing, for a switch that has none); a list fills a flag that takes
several values and is JSON for one that takes a JSON value, as a mapping always is. ``model`` gives
way to a positional ``ferry serve MODEL``, which a file's last flag never takes as one more value (the
positional then goes first). What the parser would refuse on a command line (an unknown name, a bad
value) is refused here, naming the file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    """A parser that raises instead of printing usage and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ConfigFileError(message)


def config_path(argv: Sequence[str]) -> str | None:
    """The ``--config`` value on a command line (``--config FILE`` or ``--config=FILE``), if any."""
    for i, arg in enumerate(argv):
        if arg == CONFIG_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def expand_config(
    command: str, argv: Sequence[str], make_parser: Callable[[argparse.ArgumentParser], Any]
) -> list[str]:
    """``argv`` (a subcommand's arguments, after its name) with the ``--config`` file's flags put
    first; ``make_parser`` adds the subcommand's flags to a parser. ConfigFileError for a file that
    cannot be read or names what the command does not take."""
    path = config_path(argv)
    if path is None:
        return list(argv)
    where = f"ferry {command} --config {path}"
    try:
        loaded = _load(Path(path))
    except (OSError, ValueError) as e:
        raise ConfigFileError(f"{where}: {e}") from None
    parser = _Parser(prog=f"ferry {command}", add_help=False)
    make_parser(parser)
    options = parser._option_string_actions  # noqa: SLF001 - argparse keeps no public index
    flags: list[str] = []
    takes_several = False  # whether the last flag in ``flags`` takes several values
    for key, value in loaded.items():
        name = "--" + str(key).replace("_", "-")
        if name == CONFIG_FLAG:
            raise ConfigFileError(f"{where}: a config file cannot name another config file")
        action = options.get(name)
        if action is None:
            raise ConfigFileError(f"{where}: unknown option {key!r} (not a `ferry {command}` flag)")
        if name == "--model" and _positional_model(parser, argv):
            continue  # `ferry serve MODEL --config FILE`: the command line's model wins
        emitted = _flag(name, value, action, options, where)
        if emitted:
            flags += emitted
            takes_several = action.nargs in ("+", "*")
    try:  # a bad value (``max-num-seqs: abc``) is the file's mistake: say so
        parser.parse_args(flags)
    except ConfigFileError as e:
        if not str(e).startswith("the following arguments are required"):  # given on the command line
            raise ConfigFileError(f"{where}: {e}") from None
    if takes_several and argv and not argv[0].startswith("-"):
        # ``ferry serve MODEL --config FILE`` with a file ending in ``served-model-name: [a, b]``:
        # MODEL would be one more name. A leading positional goes before the file's flags (vLLM's order).
        return [argv[0], *flags, *argv[1:]]
    return [*flags, *argv]


def _load(path: Path) -> dict[str, Any]:
    import yaml

    from ferry.strict_yaml import load_yaml, not_yaml_problem

    problem = not_yaml_problem(path)
    if problem is not None:
        raise ValueError(problem)
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"the file must hold a mapping of flag names to values, not a {type(data).__name__}")
    return data


def _flag(
    name: str, value: Any, action: argparse.Action, options: dict[str, argparse.Action], where: str
) -> list[str]:
    takes_value = action.nargs != 0
    if isinstance(value, bool) and not takes_value:
        if value:
            return [name]
        negative = "--no-" + name[2:]
        return [negative] if options.get(negative) is action else []
    if not takes_value:
        raise ConfigFileError(f"{where}: {name[2:]} is a switch: give it true or false, not {value!r}")
    if value is None:
        return []
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [name, *(_text(v) for v in value)]
    return [name, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _positional_model(parser: argparse.ArgumentParser, argv: Sequence[str]) -> bool:
    """Whether the command line names the model positionally (``ferry serve MODEL``)."""
    if not any(a.dest == "model_tag" for a in parser._actions):  # noqa: SLF001
        return False
    try:
        known, _ = parser.parse_known_args(list(argv))
    except (ConfigFileError, argparse.ArgumentError):  # reported when the line is parsed for real
        return False
    return getattr(known, "model_tag", None) is not None
