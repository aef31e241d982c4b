"""-h / --help before a script's heavy imports: torch, transformers and peft (which imports bitsandbytes when it is
installed) take seconds of CPU to import, and --help needs none of them. A script calls help_before_imports() above
its third-party imports; it prints the same text tyro would print from the script's own Args and exits, or returns.
Imports only the standard library and tyro."""

import ast
import pathlib
import sys
import types

import tyro

# Project modules an Args may import from that import nothing heavy (only typing and tyro).
LIGHT = ("harness.flags",)


def help_before_imports(module_name: str, path: str, description: str | None) -> None:
    """When the caller runs as __main__ with -h/--help: builds its `Args` from its source (the class, the file's
    standard-library imports and those from LIGHT; Args' defaults use nothing else) and prints tyro's help for it,
    which exits. Returns otherwise, and also when Args needs a name beyond those (a fork's default from a third-party
    package): the script then loads as usual and tyro prints the same help, slower."""
    if module_name != "__main__":
        return
    if not {"-h", "--help"} & set(sys.argv[1:]):
        return
    tree = ast.parse(pathlib.Path(path).read_text(), filename=path)
    imports = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module]
        else:
            continue
        if all(module.split(".")[0] in sys.stdlib_module_names or module in LIGHT for module in modules):
            imports.append(node)
    body = imports + [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args"]
    # A module of its own that names the real file: tyro reads each field's docstring from the class's source.
    module = types.ModuleType("_onlyone_help_args")
    module.__file__ = path
    sys.modules[module.__name__] = module
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), module.__dict__)
    except NameError:
        return
    tyro.cli(module.Args, description=description)
