"""The arguments of train_tokenizer.py and create_config.py: from the command line, or from a single .json file
checked as the command line would check it; and the output directory they write into, checked before any work."""

import dataclasses
import json
import sys
import types
import typing

from transformers import HfArgumentParser

from flax_lm.errors import UsageError


def parse_arguments(dataclass_types):
    """Parse the command line, or a single .json file of arguments."""
    parser = HfArgumentParser(dataclass_types)
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        json_path = sys.argv[1]
        try:
            with open(json_path, encoding="utf-8") as json_file:
                values = json.load(json_file)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read the arguments file {json_path}: {error}") from None
        if not isinstance(values, dict):
            raise UsageError(f"the arguments file {json_path} must hold one JSON object of flag names and values")
        for dataclass_type in dataclass_types:
            for argument in dataclasses.fields(dataclass_type):
                required = argument.default is dataclasses.MISSING and argument.default_factory is dataclasses.MISSING
                if required and argument.name not in values:
                    raise UsageError(f"the arguments file {json_path} has no '{argument.name}'; add it")
        try:
            parsed = parser.parse_dict(values)
        except ValueError as error:
            raise UsageError(f"the arguments file {json_path}: {error}") from None
        for arguments in parsed:
            check_argument_types(arguments, json_path)
        return parsed
    # Before argparse's own checks, which would answer a misspelt required flag with "--preset is required".
    for argument in sys.argv[1:]:
        flag = argument.split("=")[0]
        if flag.startswith("--") and not any(option.startswith(flag) for option in parser._option_string_actions):
            raise UsageError(f"unknown argument {flag}; see --help for the arguments this script takes")
    *parsed, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise UsageError(f"unexpected argument {unknown[0]}; flags start with --, see --help")
    return tuple(parsed)


def check_argument_types(arguments, source):
    """Check value types the way the command line would; a JSON file of arguments bypasses that check."""
    type_hints = typing.get_type_hints(type(arguments))
    for argument in dataclasses.fields(arguments):
        value = getattr(arguments, argument.name)
        if isinstance(value, str) and typing.get_origin(type_hints[argument.name]) in (typing.Union, types.UnionType):
            # A single string where a list is expected, e.g. "train_file": "data.txt".
            if list in [typing.get_origin(option) for option in typing.get_args(type_hints[argument.name])]:
                value = [value]
                setattr(arguments, argument.name, value)
        if not value_has_type(value, type_hints[argument.name]):
            annotation = type_hints[argument.name]
            expected = annotation.__name__ if type(annotation) is type else str(annotation).replace("typing.", "")
            raise UsageError(f"{source}: '{argument.name}' must be of type {expected}, not {value!r}")
        choices = argument.metadata.get("choices")
        if choices is not None and value not in choices:
            raise UsageError(f"{source}: '{argument.name}' must be one of {', '.join(choices)}, not {value!r}")


def value_has_type(value, annotation):
    if annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(value_has_type(value, option) for option in typing.get_args(annotation))
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        return isinstance(value, list) and all(value_has_type(item, item_type) for item in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)
