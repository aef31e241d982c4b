"""-h / --help before a script's heavy imports: torch, transformers and peft (which imports bitsandbytes when it is
installed) take seconds of CPU to import, and --help needs none of them. A script calls help_before_imports() above
its third-party imports; it prints the same text tyro would print from the script's own Args and exits, or returns.
Imports only the standard library and tyro before that choice; when it returns, it imports PEFT with bitsandbytes
hidden (`import_peft_quietly`). Optional packages are imported through `require`, which fails with an install hint."""

import ast
import importlib
import importlib.util
import logging
import pathlib
import sys
import types

import tyro

# Project modules an Args may import from that import nothing heavy (only typing and tyro).
LIGHT = ("harness.flags",)
# What import_peft_quietly hid (bitsandbytes), for plugins.quantization.import_bitsandbytes to bring back; a package
# blocked otherwise (None in sys.modules, as a test does) stays missing.
HIDDEN = set()


def require(package: str, hint: str):
    """Import an optional package or fail with a one-line install hint naming `hint` (the flag that asks for it)."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{hint} needs the optional package '{package}': pip install {package}")
    return importlib.import_module(package)


def help_before_imports(module_name: str, path: str, description: str | None) -> None:
    """Answers -h/--help from the caller's source (`print_help`) when it runs as __main__ with one; returns otherwise,
    once PEFT is imported quietly."""
    if module_name == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
        print_help(path, description)
    import_peft_quietly()


def import_peft_quietly() -> None:
    """PEFT imports bitsandbytes whenever it is installed (at import, and again for every LoRA it creates), and
    bitsandbytes on a CPU with AVX-512 BF16 then asks the hub for a kernel and logs a line on stderr, in every run.
    Hides bitsandbytes for the run (None in sys.modules: importing it fails and looking for it finds nothing, so PEFT
    and transformers go on without it; HIDDEN says we did) and imports PEFT. plugins.quantization.import_bitsandbytes,
    called where 4-bit, 8-bit or 8-bit AdamW asks for bitsandbytes, brings it back; each line it logs then says why it
    was loaded."""
    if "peft" in sys.modules or "bitsandbytes" in sys.modules:
        return
    said = logging.StreamHandler()
    said.setFormatter(logging.Formatter("bitsandbytes (loaded for 4-bit, 8-bit or 8-bit AdamW) says: %(message)s"))
    logging.getLogger("bitsandbytes").addHandler(said)
    logging.getLogger("bitsandbytes").propagate = False
    sys.modules["bitsandbytes"] = None
    HIDDEN.add("bitsandbytes")
    import peft  # noqa: F401


def print_help(path: str, description: str | None) -> None:
    """Builds its `Args` from its source (the class, the file's
    standard-library imports and those from LIGHT; Args' defaults use nothing else) and prints tyro's help for it,
    which exits. Returns when Args needs a name beyond those (a fork's default from a third-party package): the
    script then loads as usual and tyro prints the same help, slower."""
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
    # A module of its own that names the real file: tyro reads each field's help (its comment) from the class's source.
    module = types.ModuleType("_onlyone_help_args")
    module.__file__ = path
    sys.modules[module.__name__] = module
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), module.__dict__)
    except NameError:
        return
    tyro.cli(module.Args, description=description)
