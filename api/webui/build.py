"""Builds the chat page's JavaScript libraries into `static/vendor/` (`python -m baselm.api.webui.build`).

The libraries (marked for markdown, DOMPurify to sanitize its HTML, highlight.js for code) come from
the npm registry at the exact versions of `package-lock.json`: `npm ci` installs them into a temporary
folder and the few files the page imports are copied out, with their licences. `make install` runs
this, and so does setup.py's build where npm exists, so an installed package serves the page without
fetching anything at run time. Without npm the page still works: it shows answers as plain text.

Standard library only: setup.py runs this file by its path, before the package is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENDOR_DIR = HERE / "static" / "vendor"
# The page's name of each file -> its path under node_modules.
FILES = {
    "marked.esm.js": "marked/lib/marked.esm.js",
    "marked.LICENSE": "marked/LICENSE",
    "purify.es.mjs": "dompurify/dist/purify.es.mjs",
    "purify.LICENSE": "dompurify/LICENSE",
    "highlight.min.js": "@highlightjs/cdn-assets/es/highlight.min.js",
    "highlight-light.min.css": "@highlightjs/cdn-assets/styles/github.min.css",
    "highlight-dark.min.css": "@highlightjs/cdn-assets/styles/github-dark.min.css",
    "highlight.LICENSE": "@highlightjs/cdn-assets/LICENSE",
}
STAMP = ".package-lock.sha256"  # the lock file the files were built from: a second run with it does nothing


class BuildError(RuntimeError):
    """The libraries could not be built here; the message says why in a line."""


def lock_digest() -> str:
    return hashlib.sha256((HERE / "package-lock.json").read_bytes()).hexdigest()


def has_files(vendor_dir: Path = VENDOR_DIR) -> bool:
    """True when `vendor_dir` holds every file the page imports (built from some lock file)."""
    return all((vendor_dir / name).is_file() for name in FILES)


def is_built(vendor_dir: Path = VENDOR_DIR) -> bool:
    """True when `vendor_dir` holds every file, built from the current lock file."""
    stamp = vendor_dir / STAMP
    return has_files(vendor_dir) and stamp.is_file() and stamp.read_text().strip() == lock_digest()


def _npm_ci(work: Path) -> Path:
    """`npm ci` of the pinned libraries in `work`; returns its node_modules."""
    npm = shutil.which("npm")
    if npm is None:
        raise BuildError("npm not found (install it, e.g. apt-get install npm)")
    for name in ("package.json", "package-lock.json"):
        shutil.copy2(HERE / name, work / name)
    # --ignore-scripts: the page needs the packages' files, never their install scripts.
    command = [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"]
    done = subprocess.run(command, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"npm ci failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    return work / "node_modules"


def build(vendor_dir: Path = VENDOR_DIR) -> bool:
    """Fills `vendor_dir` from the lock file's packages; False when it was up to date already."""
    if is_built(vendor_dir):
        return False
    with tempfile.TemporaryDirectory(prefix="baselm-webui-") as work:
        modules = _npm_ci(Path(work))
        missing = [path for path in FILES.values() if not (modules / path).is_file()]
        if missing:
            raise BuildError(f"the npm packages lack {', '.join(missing)}; FILES in build.py needs updating")
        shutil.rmtree(vendor_dir, ignore_errors=True)
        vendor_dir.mkdir(parents=True)
        for name, path in FILES.items():
            shutil.copyfile(modules / path, vendor_dir / name)
    (vendor_dir / STAMP).write_text(lock_digest() + "\n")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vendor-dir", type=Path, default=VENDOR_DIR, help="where the files go")
    vendor_dir = parser.parse_args().vendor_dir
    try:
        done = build(vendor_dir)
    except BuildError as exc:
        print(f"warning: the chat page's libraries were not built ({exc}); it shows answers as plain text")
        return 0  # like the CPU kernels: a missing optional part never fails the install
    print(f"chat page libraries: {vendor_dir}" + ("" if done else " (up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
