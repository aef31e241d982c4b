"""Field types for a script's Args that tyro reads in a way of their own. Imports only typing and tyro, so that
harness.fast_help can build an Args that uses them without the heavy imports."""

from typing import Annotated

from tyro.constructors import PrimitiveConstructorSpec


def _flag_value(strings: list[str]) -> bool:
    if not strings:  # the bare flag, as TRL's HfArgumentParser reads a bool field given without a value
        return True
    if len(strings) > 1 or strings[0].lower() not in ("true", "false"):
        raise ValueError(f"expected nothing, True or False, got {' '.join(strings)!r}")
    return strings[0].lower() == "true"


# A `bool | None` field whose None means "decided by the run" (e.g. by --no-use-lora), that still reads as a flag:
# `--x` = True, `--x False` = False, absent = None (tyro alone would demand a value: `--x {None,True,False}`).
OptionalBool = Annotated[
    bool | None,
    PrimitiveConstructorSpec(
        nargs="*",
        metavar="[True|False]",
        instance_from_str=_flag_value,
        is_instance=lambda value: value is None or isinstance(value, bool),
        str_from_instance=lambda value: [str(value)],
    ),
]
